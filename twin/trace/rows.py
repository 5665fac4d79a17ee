"""Events as rows: ``(tag, field, ...)`` tuples of plain values, and trace lines from rows.

A row (``REDUCE``: the field values in declaration order behind a class tag; nested messages
and targets become rows themselves, ``KVPoll`` members their names, floats are checked finite)
holds only ints, floats, strings, bools, None, tuples and lists, so ``marshal`` carries it
between processes. The trace writer packs events field by field (``twin.trace.packio``) and its
encoder reads them back as rows (``twin.trace.packers.unpack_event``, equal to ``REDUCE``'s);
readers decode lines straight into rows, and a replay builds events back from them
(``BUILD``). ``LINE_OF_ROW[row[0]](row, seq, head)`` is exactly the line
``twin.trace.codec.LINE_TEXT`` writes for the event (``tests/trace/test_rows.py``). Tags are
positions in ``CLASSES``: they mean something within one process and its forks, never in a file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twin.core import wire
from twin.trace import codec, emitters, reducers, rowdecoders
from twin.trace.codec import _SPECS, _compile
from twin.trace.reducegen import build_expr

__all__ = ["BUILD", "CID", "CLASSES", "LINE_OF_ROW", "LINE_ROWS", "REDUCE", "Row", "field_pos", "msg_room"]

Row = tuple[Any, ...]

CLASSES: tuple[type, ...] = tuple(_SPECS)
"""Every event, message and nested class; a row's tag is its class's position here."""
CID: dict[type, int] = codec.ROW_TAG


def field_pos(cls: type, name: str) -> int:
    """Where field ``name`` of ``cls`` sits in the class's rows."""
    for i, f in enumerate(_SPECS[cls]):
        if f.name == name:
            return i + 1
    raise KeyError(f"{cls.__name__} has no field {name!r}")


REDUCE: dict[type, Callable[[Any], Row]] = dict(reducers.REDUCERS)
"""Event, message or nested class -> ``object -> row`` (the generated ``twin.trace.reducers``,
compiled with the core by ``twin compile``)."""
LINE_ROWS: dict[str, Callable[[dict[str, Any]], Row | None]] = rowdecoders.LINE_ROWS
"""Event type name -> ``row(line dict)``: the row of the event a whole parsed line holds
(envelope keys included) when it is complete and well typed, else None (then
``codec.event_from_json`` names the problem); no entry for a type without a fast path (the
generated ``twin.trace.rowdecoders``)."""
if (reducers.TAGS != CID or set(emitters.LINES) | set(emitters.TEXTS) != set(CID.values())
        or {c.__name__: t for c, t in CID.items()} != rowdecoders.TAGS):
    raise ImportError(  # pragma: no cover - a class or field changed since generation
        "twin/trace/reducers.py, emitters.py or rowdecoders.py is out of date with the event "
        "classes: run "
        "python scripts/generate_factories.py")

_MSG_ROOM: dict[int, int] = {CID[c]: field_pos(c, "room") for c in codec.MESSAGE_KINDS.values()
                             if any(f.name == "room" for f in _SPECS[c])}


def msg_room(m: Row) -> int | None:
    """The room a message's row names (None: a kind without one)."""
    pos = _MSG_ROOM.get(m[0])
    return None if pos is None else m[pos]


def _enum_member(spec: tuple[Any, ...], value: str, var: str) -> str:
    return f"_KVPOLL[{value}]"


def _nested_row(spec: tuple[Any, ...], value: str, var: str) -> str:
    return f"_B[({var} := {value})[0]]({var})"


def _make_build(cls: type) -> Callable[[Row], Any]:
    """``row -> object`` for ``cls``: a new instance whose slots are set from the row, as the
    generated factories of ``twin.core.factories`` build them (no ``__init__`` call)."""
    specs = _SPECS[cls]
    lines = ["def fn(r):", "    o = _new(_cls)"]
    scope: dict[str, Any] = {"_new": cls.__new__, "_cls": cls, "_B": BUILD,
                             "_KVPOLL": wire.KVPoll.__members__}
    for i, f in enumerate(specs):
        scope[f"_s{i}"] = cls.__dict__[f.name].__set__
        value = build_expr(f.spec, f"r[{i + 1}]", f"_x{i}", _enum_member, _nested_row)
        lines.append(f"    _s{i}(o, {value})")
    lines.append("    return o")
    return _compile(cls, "\n".join(lines) + "\n", scope, "build")


class _Builders(dict):  # type: ignore[type-arg]
    """Made on first use: only a replay builds objects from rows."""

    def __missing__(self, tag: int) -> Callable[[Row], Any]:
        fn = self[tag] = _make_build(CLASSES[tag])
        return fn


BUILD: dict[int, Callable[[Row], Any]] = (
    _Builders() if str(reducers.__file__).endswith(".py") else dict(reducers.BUILDERS))
"""Tag -> ``row -> object``: the inverse of ``REDUCE`` (``BUILD[r[0]](r)`` equals the object
the row was reduced from), for a process that receives events as rows. Compiled with the core,
the generated ``reducers.BUILDERS`` (the classes called natively); interpreted, functions made
on first use that set the objects' slots (a frozen dataclass's ``__init__`` costs more there)."""


LINE_OF_ROW: dict[int, Callable[[Row, int, str], str]] = dict(emitters.LINES)
"""Event tag -> ``(row, seq, head) -> line`` (``head`` as for ``codec.LINE_TEXT``): the generated
``twin.trace.emitters``, compiled with the core; the trace encoder (``twin.trace.rowenc``) calls
them through ``emitters.event_line``."""
