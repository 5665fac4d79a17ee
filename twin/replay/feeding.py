"""Feeding a forked reader's batch to a replay's cores: compiled with the core by ``twin compile``.

``feed_batch`` decodes each input into its class, feeds it to its rank (``Replayer.feed``),
and checks that the effects' text is the recorded text (``twin.replay.forked``).
"""

from __future__ import annotations

from typing import Any

from twin.trace.codec import body, decode_event
from twin.trace.rooms import room_of

__all__ = ["feed_batch"]


def feed_batch(replayer: Any, name: str, items: list[Any], introduced: set[int]) -> str | None:
    """Feed one batch: inputs ``[1, line, t, node, payload, effects text]`` and followed
    driver records ``[2, type, data]``; None when every input's effects wrote the recorded
    text, else why not (the caller replays sequentially). A malformed input raises the
    reader's ``TraceError``."""
    ranks: dict[str, Any] = replayer.ranks
    feed = replayer.feed
    observe = replayer.observe
    for item in items:
        if item[0] == 2:
            if item[1] == "RequestArrived":
                introduced.add(item[2]["room"])
            replayer.note_sys(item[1], item[2])
            continue
        node: str = item[3]
        event = decode_event(b"{" + item[4], where=f"{name}:{item[1]}", direction="in")
        room = room_of(event)
        if room is not None and room not in introduced:
            return "a room never introduced (the sequential reader names it)"
        try:
            effects: list[Any] = feed(ranks[node], node, event, item[2])
        except Exception as exc:  # the sequential replay raises it again, or diverges
            return f"{type(exc).__name__}: {exc}"
        if b"\n".join([body(e) for e in effects]) != item[5]:
            return "not the recorded effects"
        observe(node, effects)
    return None
