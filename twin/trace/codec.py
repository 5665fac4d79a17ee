"""The one codec of the core's events and control frames: msgspec, driven by the classes.

The classes in ``twin.core.events`` and ``twin.core.wire`` are the schema: each is a tagged
``msgspec.Struct``, so every event encodes as ``{"type": ClassName, **fields}`` and every
control message as ``{"kind": "STAGING_REQ", **fields}`` (``TransferStatus.status`` is the
``KVPoll`` name; tuples are lists). JSON text goes into trace lines and msgpack bytes across
pipes and sockets; nothing else lists a class's fields, so a field is added in one place.

Decoding is strict: an unknown type or kind, a missing required field, an unknown field or a
value of the wrong type raises ``TraceError`` naming ``where`` (``"run.jsonl:17"``) and the
field. ``decode_event(encode(e)) == e`` for every event.
"""

from __future__ import annotations

import re
from typing import Any, Union

import msgspec

from twin.core import events as ev
from twin.core import wire

__all__ = [
    "EFFECT_NAMES",
    "INPUT_NAMES",
    "MESSAGE_KINDS",
    "TraceError",
    "body",
    "decode_event",
    "encode",
    "event_from_json",
    "event_to_json",
    "message_to_json",
]


class TraceError(ValueError):
    """A trace (or one value in it) is malformed: names the place and, when known, the field."""

    def __init__(self, where: str, detail: str, field: str | None = None) -> None:
        self.where = where
        self.field = field
        self.detail = detail
        self.text = f"{where}: field {field!r}: {detail}" if field else f"{where}: {detail}"
        super().__init__(where, detail, field)  # re-creatable from args (SimPy re-raises so)

    def __str__(self) -> str:
        return self.text


MESSAGE_KINDS: dict[str, type] = {tag.decode("ascii"): cls
                                  for tag, cls in wire.MESSAGE_TYPES.items()}
INPUT_NAMES: frozenset[str] = frozenset(c.__name__ for c in ev.INPUT_TYPES)
EFFECT_NAMES: frozenset[str] = frozenset(c.__name__ for c in ev.EFFECT_TYPES)

_INPUT = Union[ev.INPUT_TYPES]  # type: ignore[valid-type]  # noqa: UP007 - a runtime union
_EFFECT = Union[ev.EFFECT_TYPES]  # type: ignore[valid-type]  # noqa: UP007
_EVENT = Union[(*ev.INPUT_TYPES, *ev.EFFECT_TYPES, ev.Target)]  # type: ignore[valid-type]  # noqa: UP007
_MESSAGE = Union[tuple(wire.MESSAGE_TYPES.values())]  # type: ignore[valid-type]  # noqa: UP007

encode = msgspec.json.Encoder().encode
"""``event -> b'{"type":"Name",...}'``: the compact JSON text of an event (or a message)."""
_DECODERS = {"in": msgspec.json.Decoder(_INPUT), "out": msgspec.json.Decoder(_EFFECT),
             None: msgspec.json.Decoder(_EVENT)}


def body(event: Any) -> bytes:
    """An event's JSON text without its braces: ``"type":"Name",...`` (a line's payload)."""
    return encode(event)[1:-1]


def _error(where: str, exc: msgspec.ValidationError, path: str = "") -> TraceError:
    """``exc`` as a ``TraceError`` naming the field (``"msg.room"``) it is about."""
    text = str(exc)
    detail, _, at = text.rpartition(" - at `")
    if not _:
        detail, at = text, "$`"
    loc = at.rstrip("`")[2:]  # "$.msg.room" -> "msg.room"; "$" -> ""
    m = re.match(r"Object (?:missing required|contains unknown) field `([^`]+)`", detail)
    if m:
        loc = f"{loc}.{m[1]}" if loc else m[1]
        detail = "missing (required)" if "missing" in detail else "unknown field"
    elif detail.startswith("Invalid value") and loc.endswith(("type", "kind")):
        detail = f"unknown {'event type' if loc.endswith('type') else 'message kind'} " \
                 f"{detail[len('Invalid value '):]}"
    elif detail.startswith("Expected `"):
        want, _, got = detail[len("Expected `"):].partition("`, got `")
        detail = (f"expected {' or '.join(_WORDS.get(w, w) for w in want.split(' | '))}, "
                  f"got {_WORDS.get(got.rstrip('`'), got.rstrip('`'))}")
    elif detail.startswith("Invalid enum value"):
        names = ", ".join(_CHOICES.get(loc.rpartition(".")[2], ("the known values",)))
        detail = f"expected one of {names}, got {detail[len('Invalid enum value '):]}"
    loc = f"{path}.{loc}" if path and loc else (path or loc)
    return TraceError(where, detail[:1].lower() + detail[1:], loc or None)


_WORDS = {"int": "an integer", "float": "a finite number", "str": "a string",
          "bool": "true/false", "array": "a list", "object": "an object", "null": "null"}
_CHOICES: dict[str, tuple[str, ...]] = {"status": tuple(m.value for m in wire.KVPoll)}
"""A field holding one of fixed names -> the names, for errors (the records add theirs)."""


def decode_event(text: bytes, *, where: str, direction: str | None = None) -> Any:
    """The event a JSON object's text holds (an input for ``direction="in"``, an effect for
    ``"out"``, any event for None), checked strictly."""
    try:
        return _DECODERS[direction].decode(text)
    except msgspec.ValidationError as exc:
        raise _error(where, exc) from None
    except msgspec.DecodeError:
        raise TraceError(where, "not valid JSON") from None


def event_to_json(obj: Any) -> dict[str, Any]:
    """``{"type": ClassName, **fields}`` of a core event (a fresh dict of JSON values)."""
    if not isinstance(obj, ev.Event):
        raise TypeError(f"not a core event: {type(obj).__name__}")
    d: dict[str, Any] = msgspec.json.decode(encode(obj))
    return d


def message_to_json(msg: Any) -> dict[str, Any]:
    """``{"kind": "STAGING_REQ", **fields}`` of a control message."""
    if not isinstance(msg, wire.Frame):
        raise TypeError(f"not a control message: {type(msg).__name__}")
    d: dict[str, Any] = msgspec.json.decode(encode(msg))
    return d


def event_from_json(d: Any, *, where: str) -> Any:
    """Inverse of ``event_to_json``: the event, or ``TraceError`` naming where and field.
    ``d`` must hold exactly ``type`` and the class's fields (fields with defaults may be
    absent)."""
    if type(d) is not dict:
        raise TraceError(where, f"expected an event object, got {_describe(d)}")
    try:
        return msgspec.convert(d, _EVENT)
    except msgspec.ValidationError as exc:
        raise _error(where, exc) from None


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---------------------------------------------------------------------------------------------
# Field specifications (for the JSON Schema and the documentation tables), from the classes
# ---------------------------------------------------------------------------------------------
Spec = tuple[Any, ...]
"""``("int",)``, ``("str",)``, ``("bool",)``, ``("float",)``, ``("opt", spec)``,
``("list", spec)``, ``("enum", EnumCls)``, ``("msg",)`` or ``("event", cls)``."""


class FieldSpec(msgspec.Struct, frozen=True):
    """One field of an event or message class: name, spec, required, default."""

    name: str
    spec: Spec
    required: bool
    default: Any


def _spec_of(hint: Any) -> Spec:
    import enum
    import types
    import typing

    if hint in (int, str, bool, float):
        return (hint.__name__,)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return ("enum", hint)
    if isinstance(hint, type) and issubclass(hint, ev.Event):
        return ("event", hint)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return ("list", _spec_of(args[0]))
    if origin in (Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if set(members) == set(wire.MESSAGE_TYPES.values()):
            return ("msg",)
        if len(members) == 1 and len(args) == 2:
            return ("opt", _spec_of(members[0]))
    raise TypeError(f"no trace spec for the type {hint!r}")


def field_specs(cls: type) -> tuple[FieldSpec, ...]:
    """The fields of an event or message class, in order, as the trace writes them (worked out
    once per class)."""
    specs = _SPECS.get(cls)
    if specs is None:
        specs = _SPECS[cls] = _field_specs(cls)
    return specs


_SPECS: dict[type, tuple[FieldSpec, ...]] = {}


def _field_specs(cls: type) -> tuple[FieldSpec, ...]:
    out = []
    for f in msgspec.structs.fields(cls):
        required = f.required
        default = None if required else f.default
        out.append(FieldSpec(f.name, _spec_of(f.type), required, default))
    return tuple(out)
