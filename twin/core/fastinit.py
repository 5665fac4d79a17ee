"""A faster ``__init__`` for the core's frozen, slotted, keyword-only dataclasses.

A frozen dataclass sets each field with ``object.__setattr__(self, name, value)``: a global
lookup, an attribute lookup and a generic set per field, which made constructing events and
frames about a quarter of a simulation's time. ``fast_frozen_init`` replaces the generated
``__init__`` with one of the same signature that calls each slot's descriptor directly (bound
in a closure). Instances stay frozen (``__setattr__`` still raises), hash and compare as before;
only construction is cheaper. Classes it cannot handle exactly (``__post_init__``, default
factories, positional or init-less fields, no slots) are left alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, cast

T = TypeVar("T")
P = ParamSpec("P")


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


def _generate(cls: type, name: str, first: str, head: str, tail: str,
              extra: list[Any]) -> Any:
    """Compile ``def name(first, *, fields...)`` for ``cls`` (``_plan``): ``head``, the line
    setting each field on ``self``, then ``tail``; ``extra`` are bound to the closure's first
    names. None for a class ``_plan`` does not handle."""
    plan = _plan(cls)
    if plan is None:
        return None
    names, values, args, body = plan
    signature = ", ".join([*([first] if first else []), *(["*", *args] if args else [])])
    outer = ", ".join([*(f"_x{i}" for i in range(len(extra))), *names])
    src = (f"def _make({outer}):\n"
           f"    def {name}({signature}):\n"
           + head + "".join(body) + tail
           + f"    return {name}\n")
    namespace: dict[str, Any] = {}
    exec(src, namespace)  # noqa: S102 - generated from the dataclass's own field names
    return namespace["_make"](*extra, *values)


def fast_frozen_init(cls: type[T]) -> type[T]:
    """Give ``cls`` (a frozen, slotted, keyword-only dataclass) a faster ``__init__``."""
    init = _generate(cls, "__init__", "self", "", "        pass\n", [])
    if init is None:
        return cls
    old = cls.__dict__["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__annotations__ = dict(old.__annotations__)
    init.__doc__ = old.__doc__
    cls.__init__ = init  # type: ignore[method-assign]
    return cls


def fast_new(cls: Callable[P, T]) -> Callable[P, T]:
    """A function building ``cls(**fields)`` without calling the class. Calling a class with
    keywords packs them into a dict for ``__init__``; calling a function does not (about a
    third cheaper for a two-field event). The instance is the same: same type, fields,
    equality and hash; the factory takes the class's own arguments. For a class
    ``fast_frozen_init`` cannot handle (a compiled one among them), the class itself."""
    assert isinstance(cls, type)
    new = _generate(cls, "new", "", "        self = _x0(_x1)\n", "        return self\n",
                    [object.__new__, cls])
    if new is None:
        return cls
    new.__name__ = new.__qualname__ = f"new_{cls.__name__}"
    new.__module__ = cls.__module__
    new.__doc__ = f"``{cls.__name__}(**fields)``, built without the class call."
    return cast("Callable[P, T]", new)


def speed_up_module(namespace: dict[str, Any]) -> None:
    """Apply ``fast_frozen_init`` to every dataclass defined in a module's namespace."""
    module = namespace["__name__"]
    for value in list(namespace.values()):
        if isinstance(value, type) and value.__module__ == module \
                and dataclasses.is_dataclass(value):
            fast_frozen_init(value)
