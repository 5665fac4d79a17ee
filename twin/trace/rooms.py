"""The room a core event or control frame names (compiled with the core by ``twin compile``:
the trace writer asks it of every line it writes, a replay of every input it feeds)."""

from __future__ import annotations

from typing import Any, Final

from twin.core import events as ev

__all__ = ["named_room", "room_of"]

_EXEMPT_ROOM_CHECK: Final = frozenset((ev.Dropped, ev.MessageArrived, ev.SendFailed))
_WITH_MSG: Final = frozenset(t for t in (*ev.INPUT_TYPES, *ev.EFFECT_TYPES)
                             if "msg" in getattr(t, "__struct_fields__", ()))
_HAS_ROOM: Final[dict[type, bool]] = {}
"""Event and message class -> whether it has a ``room`` field (asked once per class: a
``getattr`` with a default raises and clears an AttributeError for every class without one)."""


def _has_room(t: type) -> bool:
    has = _HAS_ROOM.get(t)
    if has is None:
        has = _HAS_ROOM[t] = "room" in getattr(t, "__struct_fields__", ())
    return has


def named_room(event: Any) -> Any:
    """The room an event names (its ``room`` field, or its message's), or None."""
    t = type(event)
    if _has_room(t):
        room = event.room
        if room is not None:
            return room
    if t in _WITH_MSG:
        msg = event.msg
        if msg is not None and _has_room(type(msg)):
            return msg.room
    return None


def room_of(event: Any) -> Any:
    """The room an event must have been introduced for (its ``room`` field, or its message's),
    None when it is not checked (a dropped or failed frame may name any room)."""
    if type(event) in _EXEMPT_ROOM_CHECK:
        return None
    return named_room(event)
