"""Writes ``twin/trace/emitters.py``: the trace text of rows (``twin.trace.rows``), one function
per event, message and nested class, generated from the trace codec's field specs. A module of
source, not functions made at import, so that ``twin compile`` builds it with the core: the
trace encoder (``twin.trace.rowenc``) then writes each line with one native string build.
Regenerate with ``python scripts/generate_factories.py`` (``tests/trace/test_emitters.py``
checks it is current).

The text is the text ``twin.trace.codec.LINE_TEXT`` writes for the event the row was reduced
from: ints as ``str`` gives them, strings through the codec's cache of their JSON text, floats
by ``repr`` (finite only), nested messages and targets as objects, ``KVPoll`` members by name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twin.core import events as ev
from twin.trace import codec
from twin.trace.codec import _KIND_OF, _SPECS, MESSAGE_KINDS, ROW_TAG
from twin.trace.reducegen import import_lines, reducer_name

EMITTERS_PATH = Path(__file__).with_name("emitters.py")


def _spec_name(spec: tuple[Any, ...]) -> str:
    kind = spec[0]
    if kind in ("opt", "list"):
        return f"{kind}_{_spec_name(spec[1])}"
    if kind == "event":
        return spec[1].__name__
    return kind


class _Gen:
    def __init__(self) -> None:
        self.helpers: dict[str, list[str]] = {}

    def value(self, spec: tuple[Any, ...], v: str) -> str:
        """Source of the JSON text of row value ``v`` (``codec._value_fn(spec, rows=True)``)."""
        kind = spec[0]
        if kind == "int":
            return f"repr({v})"
        if kind in ("str", "enum"):
            return f"str_text({v})"
        if kind == "bool":
            return f'("true" if {v} else "false")'
        if kind == "float":
            return f"float_text({v})"
        if kind == "msg":
            return f"msg_text({v})"
        if kind == "event":
            return f"text_{spec[1].__name__}({v})"
        name = f"_{_spec_name(spec)}"
        if name not in self.helpers:
            if kind == "opt":
                body = f'    return "null" if v is None else {self.value(spec[1], "v")}'
            elif kind == "list":
                body = f'    return "[" + ",".join([{self.value(spec[1], "x")} for x in v]) + "]"'
            else:  # pragma: no cover - every spec kind is handled above
                raise AssertionError(spec)
            self.helpers[name] = [f"def {name}(v: Any) -> str:", body]
        return f"{name}({v})"

    def parts(self, cls: type, tag_key: str, tag: str) -> str:
        """The inside of an f-string writing ``"tag":...,fields`` of row ``r``
        (``codec._text_parts(..., rows=True)``)."""
        out = [f'"{tag_key}":"{tag}"']
        for i, f in enumerate(_SPECS[cls]):
            v = f"r[{i + 1}]"
            kind = f.spec[0]
            expr = "{" + (f"int_text({v})" if kind == "int" else self.value(f.spec, v)) + "}"
            out.append(f'"{f.name}":{expr}')
        return ",".join(out)


def tree(tags: list[int], leaf: Callable[[int], str], pad: str = "    ", *,
         call: bool = False) -> list[str]:
    """An if-tree over the sorted ``tags`` (``tag``: a native int) returning ``leaf(tag)``
    (with ``call``: calling it, then returning); any other tag raises KeyError."""
    if len(tags) <= 3:
        out = [f"{pad}if tag == {t}:\n{pad}    {leaf(t)}\n{pad}    return" if call else
               f"{pad}if tag == {t}:\n{pad}    return {leaf(t)}" for t in tags]
        return [*out, f"{pad}raise KeyError(tag)"]
    mid = len(tags) // 2
    return [f"{pad}if tag < {tags[mid]}:", *tree(tags[:mid], leaf, pad + "    ", call=call),
            *tree(tags[mid:], leaf, pad, call=call)]


def _imports(events: list[type]) -> list[str]:
    """Imports of the event classes and their reducers (``twin.trace.reducers``)."""
    return import_lines(events, {"twin.trace.reducers": [reducer_name(c) for c in events]})


def _room_expr(cls: type) -> str:
    names = [f.name for f in _SPECS[cls]]
    if "room" in names:
        return f"r[{names.index('room') + 1}]"
    if "msg" in names:
        return f"msg_room(r[{names.index('msg') + 1}])"
    return "None"


def emitters_source() -> str:
    """The text of ``twin/trace/emitters.py``."""
    g = _Gen()
    events = list(ev.EVENT_TYPES.values())
    nested = [*MESSAGE_KINDS.values(), ev.Target]
    name_of = {c: c.__name__ for c in _SPECS}
    funcs: list[str] = []
    for cls in nested:
        tag_key, tag = ("type", "Target") if cls is ev.Target else ("kind", _KIND_OF[cls])
        text = "{{" + g.parts(cls, tag_key, tag) + "}}"
        funcs += ["", "", f"def text_{cls.__name__}(r: tuple[Any, ...]) -> str:",
                  f"    return f'{text}'"]
    for cls in events:
        parts = g.parts(cls, "type", cls.__name__)
        text = '{{"seq":{seq},{head}' + parts + "}}\\n"
        funcs += ["", "", f"def line_{cls.__name__}(r: tuple[Any, ...], seq: int, head: str) "
                  "-> str:", f"    return f'{text}'",
                  "", "", f"def body_{cls.__name__}(r: tuple[Any, ...]) -> str:",
                  f"    return {'f' if '{' in parts else ''}'{parts}'"]
    msg_tags = sorted(ROW_TAG[c] for c in MESSAGE_KINDS.values())
    ev_tags = sorted(ROW_TAG[c] for c in events)
    by_tag = {ROW_TAG[c]: c for c in _SPECS}
    rooms: dict[int, str] = {}
    for c in MESSAGE_KINDS.values():
        names = [f.name for f in _SPECS[c]]
        rooms[ROW_TAG[c]] = f"m[{names.index('room') + 1}]" if "room" in names else "None"

    lines = ['"""Trace text of rows (``twin.trace.rows``): the lines the trace encoder writes.',
             "",
             "GENERATED by ``python scripts/generate_factories.py`` from the trace codec's field",
             "specs (``twin.trace.emitgen``): do not edit. ``event_line(r, seq, head)`` is the",
             "line ``twin.trace.codec.LINE_TEXT`` writes for the event row ``r`` was reduced",
             "from; ``event_room(r)`` the room it names (its ``room`` field, or its message's)",
             "or None. Compiled with the core, each line is one native string build.", '"""',
             "", "from __future__ import annotations", "",
             "import math",
             "from json.encoder import encode_basestring_ascii",
             "from typing import Any, Final", "",
             "try:", "    from orjson import dumps as _orjson_dumps",
             "except ImportError:  # pragma: no cover - a declared dependency",
             "    _orjson_dumps = None  # type: ignore[assignment]", "",
             *_imports(events),
             "", "SMALL_INTS: Final = 4096",
             "_INT_TEXT: Final[list[str]] = [str(i) for i in range(SMALL_INTS)]",
             "_STR_TEXT: Final[dict[str, str]] = {}", "", "",
             "def int_text(v: Any) -> str:",
             '    """``str(v)``; a small int\'s text made once. (An int is read as one, so',
             '    that compiled, the compares and ``str`` are native.)"""',
             "    if type(v) is int:",
             "        i: int = v",
             "        if 0 <= i < SMALL_INTS:",
             "            return _INT_TEXT[i]",
             "        return str(i)",
             "    return str(v)", "", "",
             "def str_text(v: Any) -> str:",
             '    """A str\'s JSON text (ASCII, escaped), cached: node ids, sessions and reasons',
             '    repeat a lot. A value that is not a str raises TypeError."""',
             "    text = _STR_TEXT.get(v)",
             "    if text is None:",
             "        if type(v) is not str:",
             '            raise TypeError(f"expected a string, got {type(v).__name__}")',
             "        if len(_STR_TEXT) > 50_000:",
             "            _STR_TEXT.clear()",
             "        text = _STR_TEXT[v] = encode_basestring_ascii(v)",
             "    return text", "", "",
             # the codec's own function, so that both write a float alike
             *inspect.getsource(codec._float_text).replace("_float_text", "float_text")
             .splitlines(), "", "",
             "def msg_text(m: tuple[Any, ...]) -> str:",
             '    """The JSON text of a control message\'s row."""',
             "    tag: int = m[0]",
             *tree(msg_tags, lambda t: f"text_{by_tag[t].__name__}(m)"),
             "", "",
             "def msg_room(m: tuple[Any, ...]) -> Any:",
             '    """The room a control message\'s row names (None: a kind without one)."""',
             "    tag: int = m[0]",
             *tree(msg_tags, lambda t: rooms[t]),
             ]
    for _name, body in sorted(g.helpers.items()):
        lines += ["", "", *body]
    lines += funcs
    lines += ["", "", "def event_line(r: tuple[Any, ...], seq: int, head: str) -> str:",
              '    """The trace line of event row ``r`` (``seq``, ``head``: the envelope)."""',
              "    tag: int = r[0]",
              *tree(ev_tags, lambda t: f"line_{by_tag[t].__name__}(r, seq, head)"),
              "", "",
              "def event_room(r: tuple[Any, ...]) -> Any:",
              '    """The room event row ``r`` names, or None."""',
              "    tag: int = r[0]",
              *tree(ev_tags, lambda t: _room_expr(by_tag[t])),
              "", "",
              "def event_body(e: Any) -> str:",
              '    """``codec.BODY_TEXT[type(e)](e)``: the payload text of event ``e`` without braces',
              '    (``\'"type":"Name",field...\'``), from its row."""',
              "    cls = type(e)",
              *[x for c in events for x in (
                  f"    if cls is {c.__name__}:",
                  f"        return body_{c.__name__}({reducer_name(c)}(e))")],
              '    raise TypeError(f"not a core event: {cls.__name__}")',
              "", "",
              "LINES: Final[dict[int, Any]] = {",
              *(f"    {ROW_TAG[c]}: line_{name_of[c]}," for c in events), "}",
              '"""Event row tag -> ``(row, seq, head) -> line``."""',
              "TEXTS: Final[dict[int, Any]] = {",
              *(f"    {ROW_TAG[c]}: text_{name_of[c]}," for c in nested), "}",
              '"""Message or target row tag -> ``row -> JSON text``."""']
    return "\n".join(lines) + "\n"

