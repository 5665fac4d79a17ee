"""JSON codec of the core's events: ``event_to_json`` and its exact inverse ``event_from_json``.

Every class in ``twin.core.events.EVENT_TYPES`` encodes as ``{"type": ClassName, **fields}``.
Nested values are plain JSON:

* a control message (``msg`` fields) is ``{"kind": "STAGING_REQ", **fields}``; the kind is the
  frame tag as ASCII, and ``TransferStatus.status`` is the ``KVPoll`` member name (``"Success"``);
* tuples are lists; ``RoomBootstrapped.targets`` is a list of ``Target`` objects
  (``{"type": "Target", ...}``).

``event_from_json(event_to_json(e), where=...) == e`` for every event. Decoding is strict: an
unknown type, a missing required field, an unknown field or a value of the wrong JSON type
raises ``TraceError`` naming ``where`` (for example ``"run.trace.jsonl:17"``) and the field.
Encoders are generated once per class, so encoding costs about one dict literal per event.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import math
import operator
import types
import typing
from collections.abc import Callable, Iterable
from json import encoder as json_encoder
from typing import Any, Union

try:
    from orjson import dumps as _orjson_dumps
except ImportError:  # pragma: no cover - a declared dependency; repr writes the same text
    _orjson_dumps = None  # type: ignore[assignment]

from twin import compiled
from twin.core import events as ev
from twin.core import wire
from twin.core.fastinit import is_native
from twin.core.wire import KVPoll

__all__ = [
    "BODY_TEXT",
    "EFFECT_NAMES",
    "INPUT_NAMES",
    "LINE_TEXT",
    "MESSAGE_KINDS",
    "ROOM_OF",
    "TraceError",
    "event_from_json",
    "event_text",
    "event_to_json",
    "field_specs",
    "message_from_json",
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


# ---------------------------------------------------------------------------------------------
# Field specifications, derived once from the dataclass annotations
# ---------------------------------------------------------------------------------------------
Spec = tuple[Any, ...]
"""``("int",)``, ``("str",)``, ``("bool",)``, ``("float",)``, ``("opt", spec)``,
``("list", spec)``, ``("enum", EnumCls)``, ``("msg",)`` or ``("event", cls)``."""

MESSAGE_KINDS: dict[str, type] = {tag.decode("ascii"): cls for tag, cls in wire.MESSAGE_TYPES.items()}
_KIND_OF: dict[type, str] = {cls: kind for kind, cls in MESSAGE_KINDS.items()}
INPUT_NAMES: frozenset[str] = frozenset(c.__name__ for c in ev.INPUT_TYPES)
EFFECT_NAMES: frozenset[str] = frozenset(c.__name__ for c in ev.EFFECT_TYPES)
_MESSAGE_UNION_MEMBERS = frozenset(MESSAGE_KINDS.values())


def _spec_of(hint: Any, owner: str, name: str) -> Spec:
    if hint is bool:
        return ("bool",)
    if hint is int:
        return ("int",)
    if hint is float:
        return ("float",)
    if hint is str:
        return ("str",)
    if isinstance(hint, type) and issubclass(hint, KVPoll):
        return ("enum", hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint) and hint in ev.EVENT_TYPES.values():
        return ("event", hint)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return ("list", _spec_of(args[0], owner, name))
    if origin in (Union, types.UnionType):
        members = set(args)
        if members == _MESSAGE_UNION_MEMBERS:
            return ("msg",)
        if type(None) in members and len(members) == 2:
            (inner,) = members - {type(None)}
            return ("opt", _spec_of(inner, owner, name))
    raise TypeError(f"trace codec: unsupported annotation {hint!r} of {owner}.{name}")


@dataclasses.dataclass(frozen=True, slots=True)
class FieldSpec:
    """One dataclass field as the trace sees it."""

    name: str
    spec: Spec
    required: bool
    default: Any


@functools.cache
def _source_annotations(module: str) -> dict[str, dict[str, str]]:
    """Class name -> field -> annotation text, read from the source file of ``module``."""
    out: dict[str, dict[str, str]] = {}
    for node in ast.parse(compiled.source_path(module).read_text()).body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = {
                a.target.id: ast.unparse(a.annotation) for a in node.body
                if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)}
    return out


def _type_hints(cls: type) -> dict[str, Any]:
    """``cls``'s field types. A class compiled by ``twin compile`` keeps only erased
    annotations, so its source's (the source ``twin.compiled`` checked it was built from) are
    evaluated instead, the same way."""
    namespace = vars(ev) | vars(wire)
    if not dataclasses.is_dataclass(cls) or not is_native(cls):
        return typing.get_type_hints(cls, namespace)
    texts = _source_annotations(cls.__module__)
    stand_in = type(cls.__name__, (), {"__annotations__": texts[cls.__name__],
                                       "__module__": cls.__module__})
    return typing.get_type_hints(stand_in, namespace)


def _field_specs(cls: type) -> tuple[FieldSpec, ...]:
    hints = _type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = None if f.default is dataclasses.MISSING else f.default
        out.append(FieldSpec(f.name, _spec_of(hints[f.name], cls.__name__, f.name), required,
                             default))
    return tuple(out)


_SPECS: dict[type, tuple[FieldSpec, ...]] = {
    cls: _field_specs(cls) for cls in (*ev.EVENT_TYPES.values(), *MESSAGE_KINDS.values())
}
_RESERVED = frozenset({"type", "kind", "seq", "t", "node", "dir"})
for _cls, _fs in _SPECS.items():  # the envelope and tag keys must never collide with a field
    assert not _RESERVED & {f.name for f in _fs}, _cls


def field_specs(cls: type) -> tuple[FieldSpec, ...]:
    """The fields of an event or message class, in declaration order."""
    return _SPECS[cls]


class _Lazy(dict):  # type: ignore[type-arg]
    """A table of generated functions, each made on first use (``make(key)``; None where
    there is none) for the keys in ``keys``: a process compiles only what it calls (most
    commands call a few of them, or none). ``get`` makes the entry too."""

    def __init__(self, make: Callable[[Any], Any], keys: Iterable[Any]) -> None:
        super().__init__()
        self._make = make
        self._keys = frozenset(keys)

    def __missing__(self, key: Any) -> Any:
        if key not in self._keys:
            raise KeyError(key)
        value = self[key] = self._make(key)
        return value

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            value = self[key]
        except KeyError:
            return default
        return default if value is None else value


# ---------------------------------------------------------------------------------------------
# Encoding: one generated function per class
# ---------------------------------------------------------------------------------------------
def _enc_expr(spec: Spec, value: str) -> str:
    kind = spec[0]
    if kind in ("int", "str", "bool", "float"):
        return value
    if kind == "opt":
        inner = _enc_expr(spec[1], value)
        return value if inner == value else f"(None if {value} is None else {inner})"
    if kind == "enum":
        return f"{spec[1].__name__}({value}).name"
    if kind == "msg":
        return f"_MSG_ENC[type({value})]({value})"
    if kind == "event":
        return f"_ENC[{spec[1].__name__!r}]({value})"
    if kind == "list":
        inner = _enc_expr(spec[1], "x")
        return f"list({value})" if inner == "x" else f"[{inner} for x in {value}]"
    raise AssertionError(spec)


def _make_encoder(cls: type, tag_key: str, tag: str) -> Callable[[Any], dict[str, Any]]:
    items = [f"{tag_key!r}: {tag!r}"]
    items += [f"{f.name!r}: {_enc_expr(f.spec, 'o.' + f.name)}" for f in _SPECS[cls]]
    src = f"def enc(o):\n    return {{{', '.join(items)}}}\n"
    scope: dict[str, Any] = {"_MSG_ENC": _MSG_ENC, "_ENC": _ENC_BY_NAME, "KVPoll": KVPoll}
    exec(compile(src, f"<trace encoder {cls.__name__}>", "exec"), scope)  # noqa: S102
    return scope["enc"]


_MSG_ENC: dict[type, Callable[[Any], dict[str, Any]]] = _Lazy(
    lambda cls: _make_encoder(cls, "kind", _KIND_OF[cls]), MESSAGE_KINDS.values())
_ENC_BY_NAME: dict[str, Callable[[Any], dict[str, Any]]] = _Lazy(
    lambda name: _make_encoder(ev.EVENT_TYPES[name], "type", name), ev.EVENT_TYPES)
ENCODERS: dict[type, Callable[[Any], dict[str, Any]]] = _Lazy(
    lambda cls: _ENC_BY_NAME[cls.__name__], ev.EVENT_TYPES.values())
"""Event class -> encoder (made on first use)."""


# ---------------------------------------------------------------------------------------------
# Text encoding: JSON text straight from the objects, no intermediate dicts
# ---------------------------------------------------------------------------------------------
# The text is byte-identical to ``json.dumps(event_to_json(e), separators=(",", ":"))`` (ASCII,
# ``\u``-escaped strings, ``repr`` floats); ``tests/trace/test_format.py`` checks that.
_str_text: Callable[[str], str] = json_encoder.encode_basestring_ascii  # type: ignore[assignment]


class _StrTextCache(dict):  # type: ignore[type-arg]
    """str -> its JSON text, computed once (node ids, sessions and reasons repeat a lot)."""

    def __missing__(self, s: str) -> str:
        if type(s) is not str:
            raise TypeError(f"expected a string, got {type(s).__name__}")
        if len(self) > 50_000:
            self.clear()
        text = self[s] = _str_text(s)
        return text


_STR_CACHE = _StrTextCache()


def _float_text(v: Any) -> str:
    """A float's JSON text (``repr``); ints as they are; not finite: ValueError. From 1e-4 to
    1e16, where ``repr`` writes no exponent, orjson writes the same shortest round-trip digits
    in the same form, several times faster (``tests/trace/test_codec.py`` holds them equal)."""
    if type(v) is float:
        if 0.0001 <= v < 1e16 and _orjson_dumps is not None:
            return _orjson_dumps(v).decode()
        if not math.isfinite(v):
            raise ValueError(f"out of range float value {v!r}: traces hold finite numbers only")
        return repr(v)
    if type(v) is int:
        return repr(v)
    return _float_text(float(v))


def _bool_text(v: Any) -> str:
    return "true" if v else "false"


_TEXT: dict[type, Callable[[Any], str]] = {}
"""Message and nested-object class -> ``obj -> JSON text`` (with braces)."""


def _msg_text(m: Any) -> str:
    try:
        return _TEXT[type(m)](m)
    except KeyError:
        raise TypeError(f"not a control message: {type(m).__name__}") from None


def _value_fn(spec: Spec) -> Callable[[Any], str]:
    """``value -> JSON text`` for any field spec (used for the composite kinds); the text of a
    row's values is generated as source (``twin.trace.emitgen``)."""
    kind = spec[0]
    if kind == "int":
        return repr
    if kind == "str":
        return _str_text
    if kind == "bool":
        return _bool_text
    if kind == "float":
        return _float_text
    if kind == "opt":
        inner = _value_fn(spec[1])
        return lambda v: "null" if v is None else inner(v)
    if kind == "list":
        inner = _value_fn(spec[1])
        return lambda v: "[" + ",".join(map(inner, v)) + "]"
    if kind == "enum":
        enum_cls = spec[1]
        return lambda v: '"' + enum_cls(v).name + '"'
    if kind == "msg":
        return _msg_text
    if kind == "event":
        cls = spec[1]
        return lambda v: _TEXT[cls](v)
    raise AssertionError(spec)


def _text_parts(cls: type, tag_key: str, tag: str, scope: dict[str, Any]) -> str:
    """The inside of an f-string (no quotes) writing ``"tag":..., fields`` of ``o`` (an
    object)."""
    out = [f'"{tag_key}":"{tag}"']
    for i, f in enumerate(_SPECS[cls]):
        kind = f.spec[0]
        value = f"o.{f.name}"
        if kind == "int":
            expr = f"{{{value}}}"
        elif kind == "str":
            expr = f"{{_S[{value}]}}"
        elif kind == "bool":
            expr = f'{{"true" if {value} else "false"}}'
        elif kind == "float":
            expr = f"{{_f({value})}}"
        elif kind == "msg":
            expr = f"{{_m[type({value})]({value})}}"
        else:
            scope[f"_v{i}"] = _value_fn(f.spec)
            expr = f"{{_v{i}({value})}}"
        out.append(f'"{f.name}":{expr}')
    return ",".join(out)


def _compile(cls: type, src: str, scope: dict[str, Any], name: str) -> Callable[..., Any]:
    scope.update({"_S": _STR_CACHE, "_f": _float_text, "_m": _TEXT})
    exec(compile(src, f"<trace text {name} {cls.__name__}>", "exec"), scope)  # noqa: S102
    return scope["fn"]


def _fstring(text: str) -> str:
    """``text`` (f-string inside, quotes excluded) as f-string source."""
    return "f'" + text + "'"


def _object_text(cls: type, tag_key: str, tag: str) -> Callable[[Any], str]:
    scope: dict[str, Any] = {}
    parts = _text_parts(cls, tag_key, tag, scope)
    src = f"def fn(o):\n    return {_fstring('{{' + parts + '}}')}\n"
    return _compile(cls, src, scope, "object")


for _kind, _mcls in MESSAGE_KINDS.items():
    _TEXT[_mcls] = _object_text(_mcls, "kind", _kind)
_TEXT[ev.Target] = _object_text(ev.Target, "type", "Target")


def _make_line(cls: type) -> tuple[Callable[[Any, int, str], str], Callable[[Any], str]]:
    scope: dict[str, Any] = {}
    parts = _text_parts(cls, "type", cls.__name__, scope)
    line_src = _fstring('{{"seq":{seq},{head}' + parts + '}}\\n')
    line = _compile(cls, f"def fn(o, seq, head):\n    return {line_src}\n", scope, "line")
    body = _compile(cls, f"def fn(o):\n    return {_fstring(parts)}\n", dict(scope), "body")
    return line, body


LINE_TEXT: dict[type, Callable[[Any, int, str], str]] = _Lazy(
    lambda cls: _make_line(cls)[0], ev.EVENT_TYPES.values())
"""Event class -> ``(event, seq, head) -> line``: one whole trace line, ``head`` being the
envelope after ``seq`` (``'"t":0.5,"node":"p0g0r0","dir":"out",'``); made on first use."""
BODY_TEXT: dict[type, Callable[[Any], str]] = _Lazy(
    lambda cls: _make_line(cls)[1], ev.EVENT_TYPES.values())
"""Event class -> ``event -> '"type":"Name",field...'``: the payload of a line without braces
(made on first use)."""


def event_text(obj: Any) -> str:
    """The JSON text of ``event_to_json(obj)`` (compact, ASCII), built without a dict."""
    try:
        return "{" + BODY_TEXT[type(obj)](obj) + "}"
    except KeyError:
        raise TypeError(f"not a core event: {type(obj).__name__}") from None


def _room_getter(cls: type) -> Callable[[Any], int | None] | None:
    names = {f.name for f in _SPECS[cls]}
    if "room" in names:
        return operator.attrgetter("room")
    if "msg" in names:
        return lambda e: getattr(e.msg, "room", None)
    return None


ROOM_OF: dict[type, Callable[[Any], int | None] | None] = {
    cls: _room_getter(cls) for cls in ev.EVENT_TYPES.values()}
"""Event class -> ``event -> room`` (its ``room`` field, or its message's) or None."""


def event_to_json(obj: Any) -> dict[str, Any]:
    """``{"type": ClassName, **fields}`` of a core event (a fresh dict of JSON values)."""
    try:
        enc = ENCODERS[type(obj)]
    except KeyError:
        raise TypeError(f"not a core event: {type(obj).__name__}") from None
    return enc(obj)


def message_to_json(msg: Any) -> dict[str, Any]:
    """``{"kind": "STAGING_REQ", **fields}`` of a control message."""
    try:
        return _MSG_ENC[type(msg)](msg)
    except KeyError:
        raise TypeError(f"not a control message: {type(msg).__name__}") from None


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------
def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _decode_value(spec: Spec, value: Any, where: str, path: str) -> Any:
    kind = spec[0]
    if kind == "int":
        if type(value) is not int:
            raise TraceError(where, f"expected an integer, got {_describe(value)}", path)
        return value
    if kind == "str":
        if type(value) is not str:
            raise TraceError(where, f"expected a string, got {_describe(value)}", path)
        return value
    if kind == "bool":
        if type(value) is not bool:
            raise TraceError(where, f"expected true/false, got {_describe(value)}", path)
        return value
    if kind == "float":
        if type(value) not in (int, float) or not math.isfinite(value):
            raise TraceError(where, f"expected a finite number, got {_describe(value)}", path)
        return float(value)
    if kind == "opt":
        return None if value is None else _decode_value(spec[1], value, where, path)
    if kind == "list":
        if type(value) is not list:
            raise TraceError(where, f"expected a list, got {_describe(value)}", path)
        return tuple(_decode_value(spec[1], x, where, f"{path}[{i}]") for i, x in enumerate(value))
    if kind == "enum":
        enum_cls = spec[1]
        if type(value) is not str or value not in enum_cls.__members__:
            names = ", ".join(enum_cls.__members__)
            raise TraceError(where, f"expected one of {names}, got {_describe(value)}", path)
        return enum_cls[value]
    if kind == "msg":
        return message_from_json(value, where=where, path=path)
    if kind == "event":
        return _decode_object(spec[1], value, where, path, "type", spec[1].__name__)
    raise AssertionError(spec)


def _decode_object(cls: type, d: Any, where: str, path: str, tag_key: str, tag: str) -> Any:
    if type(d) is not dict:
        raise TraceError(where, f"expected an object, got {_describe(d)}", path or None)
    prefix = f"{path}." if path else ""
    kwargs: dict[str, Any] = {}
    seen = 1
    for f in _SPECS[cls]:
        if f.name in d:
            seen += 1
            kwargs[f.name] = _decode_value(f.spec, d[f.name], where, prefix + f.name)
        elif f.required:
            raise TraceError(where, f"missing (required by {tag})", prefix + f.name)
    if len(d) != seen or d.get(tag_key) != tag:
        known = {f.name for f in _SPECS[cls]} | {tag_key}
        extra = sorted(k for k in d if k not in known)
        if extra:
            raise TraceError(where, f"unknown field of {tag}", prefix + extra[0])
        raise TraceError(where, f"expected {tag!r}, got {_describe(d.get(tag_key))}",
                         prefix + tag_key)
    return cls(**kwargs)


def message_from_json(d: Any, *, where: str, path: str = "msg") -> Any:
    """Inverse of ``message_to_json``; ``path`` names the field in errors."""
    if type(d) is not dict:
        raise TraceError(where, f"expected a message object, got {_describe(d)}", path)
    kind = d.get("kind")
    cls = MESSAGE_KINDS.get(kind) if type(kind) is str else None
    if cls is None:
        raise TraceError(where, f"unknown message kind {_describe(kind)}; known: "
                         f"{', '.join(MESSAGE_KINDS)}", f"{path}.kind")
    return _decode_object(cls, d, where, path, "kind", kind)


# Fast decoders: generated per class; they accept only complete, well-typed objects and return
# None for anything else, which then takes the checking path above for a precise error.
def _guard(lines: list[str], cond: str) -> None:
    """Append ``if cond: return None``, one statement a line, to a fast decoder's body."""
    lines += [f"    if {cond}:", "        return None"]


def _fast_check(spec: Spec, var: str, lines: list[str], depth: int, rows: bool = False
                ) -> str | None:
    """Append checks of ``var`` to ``lines``; return the expression of its decoded value (with
    ``rows``: of its value in the object's row, as ``twin.trace.rows.REDUCE`` gives it)."""
    kind = spec[0]
    pad = "    "
    if kind in ("int", "str", "bool"):
        _guard(lines, f"type({var}) is not {kind}")
        return var
    if kind == "float":
        _guard(lines, f"type({var}) not in (int, float) or not _isfinite({var})")
        return f"float({var})"
    if kind == "opt" and spec[1][0] in ("int", "str"):
        _guard(lines, f"{var} is not None and type({var}) is not {spec[1][0]}")
        return var
    if kind == "list" and spec[1][0] in ("int", "str"):
        item = spec[1][0]
        _guard(lines, f"type({var}) is not list or not all(type(y) is {item} for y in {var})")
        return f"tuple({var})"
    if kind == "enum":
        _guard(lines, f"type({var}) is not str or {var} not in _KVPOLL")
        return var if rows else f"_KVPOLL[{var}]"
    if kind == "msg":
        tmp = f"m{depth}"
        lines.append(f"{pad}{tmp} = _fast_msg({var})")
        _guard(lines, f"{tmp} is None")
        return tmp
    if kind == "list" and spec[1][0] == "event" and spec[1][1] in _FAST_NESTED:
        tmp = f"l{depth}"
        _guard(lines, f"type({var}) is not list")
        lines.append(f"{pad}{tmp} = {'list' if rows else 'tuple'}(map("
                     f"_fast_{spec[1][1].__name__}, {var}))")
        _guard(lines, f"None in {tmp}")
        return tmp
    return None


def fast_source(cls: type, extra: int = 0, rows: bool = False,
                header: str = "def dec(d):") -> str | None:
    """The source of a fast decoder of ``cls`` from a parsed dict (``extra`` more keys: a
    line's envelope), opening with ``header``: it returns the object, or with ``rows`` its row
    (``ROW_TAG``), and None where it cannot vouch; None when ``cls`` has no fast decoder. Free
    names: ``_MISSING``, ``_isfinite``, ``_KVPOLL``, ``_fast_msg`` and ``_fast_Target``."""
    specs = _SPECS[cls]
    lines: list[str] = []
    _guard(lines, f"len(d) != {len(specs) + 1 + extra}")
    args = []
    for i, f in enumerate(specs):
        var = f"v{i}"
        lines.append(f"    {var} = d.get({f.name!r}, _MISSING)")
        expr = _fast_check(f.spec, var, lines, i, rows)
        if expr is None:
            return None
        args.append(expr if rows else f"{f.name}={expr}")
    lines.append(f"    return ({', '.join([str(ROW_TAG[cls]), *args])},)" if rows else
                 f"    return _cls({', '.join(args)})")
    return header + "\n" + "\n".join(lines) + "\n"


def _make_fast(cls: type, extra: int = 0) -> Callable[[dict[str, Any]], Any] | None:
    """A fast decoder of ``cls`` from a parsed dict (``extra`` more keys: a line's envelope):
    the object, or None where it cannot vouch (``fast_source``). Rows have theirs generated
    (``twin.trace.rowdecoders``)."""
    src = fast_source(cls, extra)
    if src is None:
        return None
    scope: dict[str, Any] = {"_cls": cls, "_isfinite": math.isfinite, "_MISSING": object(),
                             "_KVPOLL": KVPoll.__members__, "_fast_msg": _fast_msg}
    scope.update({f"_fast_{c.__name__}": fn for c, fn in _FAST_NESTED.items()})
    exec(compile(src, f"<trace decoder {cls.__name__}>", "exec"), scope)  # noqa: S102
    return scope["dec"]


ROW_TAG: dict[type, int] = {cls: i for i, cls in enumerate(_SPECS)}
"""Every event, message and nested class -> its tag in rows (``twin.trace.rows``)."""
_FAST_MSG: dict[str, Callable[[dict[str, Any]], Any]] = {}
_FAST_NESTED: dict[type, Callable[[Any], Any]] = {}


def _fast_msg(x: Any) -> Any:
    """A fast decoder of any message, by its ``kind``."""
    if type(x) is not dict:
        return None
    kind = x.get("kind")
    fn = _FAST_MSG.get(kind) if type(kind) is str else None
    return None if fn is None else fn(x)


for _kind, _mcls in MESSAGE_KINDS.items():
    _dec = _make_fast(_mcls)
    if _dec is not None:
        _FAST_MSG[_kind] = _dec
_dec = _make_fast(ev.Target)
if _dec is not None:
    def _fast_target(x: Any, _dec: Callable[[dict[str, Any]], Any] = _dec) -> Any:
        if type(x) is not dict or x.get("type") != "Target":
            return None
        return _dec(x)

    _FAST_NESTED[ev.Target] = _fast_target
_FAST_EVENT: dict[str, Callable[[dict[str, Any]], Any]] = _Lazy(
    lambda name: _make_fast(ev.EVENT_TYPES[name]), ev.EVENT_TYPES)
FAST_LINE_DECODERS: dict[str, Callable[[dict[str, Any]], Any]] = _Lazy(
    lambda name: _make_fast(ev.EVENT_TYPES[name], extra=4), ev.EVENT_TYPES)
"""Type name -> ``decode(line dict)``: the event of a whole parsed line (envelope keys ``seq``,
``t``, ``node``, ``dir`` included) when it is complete and well typed, else None (then
``event_from_json`` on the payload names the problem). Made on first use: look up with
``get`` (None for a type without one)."""


def event_from_json(d: Any, *, where: str) -> Any:
    """Inverse of ``event_to_json``: the event object, or ``TraceError`` naming where and field.

    ``d`` must hold exactly ``type`` and the class's fields (fields with defaults may be absent).
    """
    if type(d) is not dict:
        raise TraceError(where, f"expected an event object, got {_describe(d)}")
    name = d.get("type")
    fast = _FAST_EVENT[name] if type(name) is str and name in ev.EVENT_TYPES else None
    if fast is not None:
        obj = fast(d)
        if obj is not None:
            return obj
    cls = ev.EVENT_TYPES.get(name) if type(name) is str else None
    if cls is None:
        raise TraceError(where, f"unknown event type {_describe(name)}", "type")
    return _decode_object(cls, d, where, "", "type", name)
