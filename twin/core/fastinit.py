"""A faster ``__init__`` for the core's frozen, slotted, keyword-only dataclasses.

A frozen dataclass sets each field with ``object.__setattr__(self, name, value)``: a global
lookup, an attribute lookup and a generic set per field, which made constructing events and
frames about a quarter of a simulation's time. ``fast_frozen_init`` replaces the generated
``__init__`` with one of the same signature that calls each slot's descriptor directly (bound
in a closure). Instances stay frozen (``__setattr__`` still raises), hash and compare as before;
only construction is cheaper. Classes it cannot handle exactly (``__post_init__``, default
factories, positional or init-less fields, no slots) are left alone.

``factories_source`` writes ``twin/core/factories.py``: for the classes built on every chunk,
frame, request or timer, a ``new_<name>(**fields)`` that skips the class call as well (calling a class with
keywords packs them into a dict for ``__init__``). It is a module of source, not functions made
at import, so that the compiled core calls them as native functions.
"""

from __future__ import annotations

import copyreg
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def _plan(cls: type) -> tuple[list[str], list[Any], list[str], list[str]] | None:
    """For a class these helpers handle: the closure's names and values (each field's slot
    setter ``_sI``, its default ``_dI``), the parameters and the body lines setting each
    field on ``self``; None for any other class."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__ \
            or hasattr(cls, "__post_init__"):
        return None
    fields = list(dataclasses.fields(cls))
    if any(not f.init or not f.kw_only or f.default_factory is not dataclasses.MISSING
           for f in fields):
        return None
    names: list[str] = []
    values: list[Any] = []
    args: list[str] = []
    body: list[str] = []
    for i, f in enumerate(fields):
        setter = cls.__dict__[f.name].__set__  # the slot's member descriptor
        names.append(f"_s{i}")
        values.append(setter)
        if f.default is dataclasses.MISSING:
            args.append(f.name)
        else:
            names.append(f"_d{i}")
            values.append(f.default)
            args.append(f"{f.name}=_d{i}")
        body.append(f"        _s{i}(self, {f.name})\n")
    return names, values, args, body


def _compile_init(cls: type) -> Any:
    """Compile ``def __init__(self, *, fields...)`` for ``cls`` (``_plan``): the line setting
    each field on ``self``. None for a class ``_plan`` does not handle."""
    plan = _plan(cls)
    if plan is None:
        return None
    names, values, args, body = plan
    signature = ", ".join(["self", *(["*", *args] if args else [])])
    src = (f"def _make({', '.join(names)}):\n"
           f"    def __init__({signature}):\n"
           + "".join(body) + "        pass\n"
           + "    return __init__\n")
    namespace: dict[str, Any] = {}
    exec(src, namespace)  # noqa: S102 - generated from the dataclass's own field names
    return namespace["_make"](*values)


def fast_frozen_init(cls: type[T]) -> type[T]:
    """Give ``cls`` (a frozen, slotted, keyword-only dataclass) a faster ``__init__``."""
    init = _compile_init(cls)
    if init is None:
        return cls
    old = cls.__dict__["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__annotations__ = dict(old.__annotations__)
    init.__doc__ = old.__doc__
    cls.__init__ = init  # type: ignore[method-assign]
    return cls


FACTORY_CLASSES: tuple[tuple[str, str], ...] = (
    *(("twin.core.events", name) for name in (
        "MessageArrived", "TransferDone", "ScatterDone", "Send", "ChunkQueued", "StartTransfer",
        "WorkerIdle", "RoomTornDown", "Allocated", "Freed", "StartScatter", "TargetsKnown",
        "RoomConcluded", "SetTimer", "WatermarkMoved", "GroupPoll", "PeerPolled",
        # ... and per request or timer
        "Tick", "WorkerPoll", "Target", "RoomBootstrapped", "DecodeRoomInit", "SendMetadata",
        "Prefetch", "SendKV")),
    *(("twin.core.wire", name) for name in (
        "StagingReq", "StagingRsp", "Watermark", "ChunkReady", "TransferStatus")),
)
"""The classes built on every chunk, frame, request or timer: ``twin/core/factories.py`` has a
``new_<name>`` for each (module, class name)."""
FACTORIES_PATH = Path(__file__).with_name("factories.py")
NATIVE_MODULES = ("twin.core.events", "twin.core.wire")
"""The modules whose classes ``twin compile`` builds as native classes (``twin.compiled``)."""


def factory_name(cls: type) -> str:
    """``StartTransfer`` -> ``new_start_transfer``, ``SendKV`` -> ``new_send_kv``."""
    name = cls.__name__
    out = []
    for i, ch in enumerate(name):
        if ch.isupper() and i and (name[i - 1].islower()
                                   or (i + 1 < len(name) and name[i + 1].islower())):
            out.append("_")
        out.append(ch.lower())
    return "new_" + "".join(out)


def factories_source(modules: Sequence[Any]) -> str:
    """The text of ``twin/core/factories.py``, for the classes of ``FACTORY_CLASSES`` found in
    ``modules`` (the events and the wire modules): for each a function with the class's
    keyword-only signature that builds the same frozen object without the class call
    (``object.__new__`` and each field's slot descriptor)."""
    by_name = {m.__name__: m for m in modules}
    classes = [getattr(by_name[m], n) for m, n in FACTORY_CLASSES]
    names: dict[str, str] = {}  # a class named in an annotation -> the module to import it from
    for cls in classes:
        names[cls.__name__] = cls.__module__
        for f in dataclasses.fields(cls):
            words = "".join(c if c.isalnum() or c == "_" else " " for c in str(f.type)).split()
            for word in words:
                home = next((m.__name__ for m in modules if word[0].isupper()
                             and hasattr(m, word)), None)
                if home is not None:
                    names.setdefault(word, home)
    lines = ['"""Factories for the events and frames built on every chunk, frame, request or timer.',
             "",
             "GENERATED by ``python scripts/generate_factories.py`` from the dataclasses' fields:",
             "do not edit (``tests/core/test_fastinit.py`` checks it is current). ``new_x(**f)``",
             "builds the same frozen object as ``X(**f)`` without the class call, which",
             "packs the keywords into a dict for ``__init__``; compiled with the core, a call",
             'to one is a native call."""',
             "",
             "from __future__ import annotations",
             "",
             "from typing import Any, Final",
             ""]
    names["is_native"] = __name__
    for module in sorted(set(names.values())):
        imported = sorted(n for n, m in names.items() if m == module)
        one_line = f"from {module} import {', '.join(imported)}"
        lines += [one_line] if len(one_line) <= 100 else [
            f"from {module} import (", *(f"    {n}," for n in imported), ")"]
    lines += ["", "_new: Final[Any] = object.__new__",
              "NATIVE_EVENTS: Final[bool] = is_native(MessageArrived)",
              '"""Whether the events and frames are compiled classes (``twin compile``): their',
              "factories then allocate with the class's own ``__new__`` and store each field",
              "directly (a native store, which a frozen class allows its compiled code); the",
              'pure-Python classes are built through their slot descriptors."""']
    for cls in classes:
        if cls.__module__ in NATIVE_MODULES:
            lines.append(f"_{cls.__name__}_new: Final[Any] = {cls.__name__}.__new__")
        for f in dataclasses.fields(cls):
            lines.append(f'_{cls.__name__}_{f.name}: Final[Any] = '
                         f'vars({cls.__name__})["{f.name}"].__set__')
    for cls in classes:
        params = []
        for f in dataclasses.fields(cls):
            default = "" if f.default is dataclasses.MISSING else f" = {f.default!r}"
            params.append(f"{f.name}: {f.type}{default}")
        signature = f"*, {', '.join(params)}" if params else ""
        head = f"def {factory_name(cls)}({signature}) -> {cls.__name__}:"
        if len(head) > 100:
            head = "\n".join([f"def {factory_name(cls)}(", "    *,",
                               *(f"    {p}," for p in params), f") -> {cls.__name__}:"])
        lines += ["", "", head, f'    """``{cls.__name__}(**fields)``."""']
        if cls.__module__ in NATIVE_MODULES:
            lines += ["    if NATIVE_EVENTS:",
                      f"        n: {cls.__name__} = _{cls.__name__}_new({cls.__name__})"]
            lines += [f"        n.{f.name} = {f.name}  # type: ignore[misc]"
                      for f in dataclasses.fields(cls)]
            lines.append("        return n")
        lines.append(f"    o: {cls.__name__} = _new({cls.__name__})")
        lines += [f"    _{cls.__name__}_{f.name}(o, {f.name})" for f in dataclasses.fields(cls)]
        lines.append("    return o")
    return "\n".join(lines) + "\n"


def is_native(cls: type) -> bool:
    """Whether ``cls`` is a compiled (native) class: ``twin compile`` built its module, so it
    has no slot descriptors (a pure-Python slotted dataclass has ``__slots__``)."""
    return "__slots__" not in vars(cls)


def _rebuild(cls: Any, values: tuple[Any, ...]) -> Any:
    """Unpickle a native dataclass: the class call, whose ``__init__`` sets frozen fields."""
    return cls(**{f.name: v for f, v in zip(dataclasses.fields(cls), values, strict=True)})


def _reduce_native(obj: Any) -> tuple[Any, ...]:
    """Pickle a native (compiled) frozen dataclass by its fields: mypyc's own state restore
    assigns through the class's ``__setattr__``, which a frozen dataclass refuses."""
    cls = type(obj)
    return _rebuild, (cls, tuple(getattr(obj, f.name) for f in dataclasses.fields(cls)))


def speed_up_module(namespace: dict[str, Any]) -> None:
    """Apply ``fast_frozen_init`` to every dataclass defined in a module's namespace; a
    compiled (native) one instead gets a pickle reducer (``_reduce_native``)."""
    module = namespace["__name__"]
    for value in list(namespace.values()):
        if isinstance(value, type) and value.__module__ == module \
                and dataclasses.is_dataclass(value):
            if is_native(value):
                copyreg.pickle(value, _reduce_native)
            else:
                fast_frozen_init(value)
