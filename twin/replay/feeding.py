"""Feeding recorded inputs to a replay's cores: compiled with the core by ``twin compile``.

``feed`` hands one input to its rank (``Replayer.feed``); ``feed_batch`` feeds a forked
reader's batch (``twin.replay.forked``) and writes the text of the effects it got, to be
compared with the recorded text in one go.
"""

from __future__ import annotations

from typing import Any

from twin.core.events import TransferDone
from twin.trace.emitters import event_body
from twin.trace.rows import BUILD
from twin.trace.scan import SEP

__all__ = ["feed", "feed_batch"]

_SEP = SEP.decode()


def feed(rank: Any, node: str, event: Any, t: float, in_flight: dict[tuple[str, int], Any],
         integrity: Any) -> list[Any]:
    """Hand ``event`` to ``rank`` (of ``node``) at time ``t``; its effects. A successful
    transfer's completion first lands its bytes in ``integrity`` (from ``in_flight``, the
    transfers started and not yet done, by node and worker)."""
    if type(event) is TransferDone and event.ok:
        st = in_flight.pop((node, event.worker), None)
        if st is not None:
            integrity.on_transfer(st.session, st)
    effects: list[Any] = rank.handle(event, t)
    return effects


def feed_batch(replayer: Any, items: list[tuple[Any, ...]]) -> str:
    """Feed a forked reader's batch to ``replayer``'s ranks: inputs ``(1, t, node, row)`` and
    followed driver records ``(2, type, data)``. The text of the effects, as the reader
    collects the recorded ones (``twin.trace.scan.Collector``): each input's effect payloads
    one per line, then ``SEP``. The replayer observes the effects as it would after checking
    them (``Replayer._observe``); raises what feeding raises."""
    ranks: dict[str, Any] = replayer.ranks
    in_flight: dict[tuple[str, int], Any] = replayer.in_flight
    integrity = replayer.integrity
    observers: frozenset[type] = replayer._observers
    observe = replayer._observe
    note_sys = replayer._sys
    build = BUILD
    text: list[str] = []
    n = 0
    try:
        for item in items:
            if item[0] == 1:
                node: str = item[2]
                row: tuple[Any, ...] = item[3]
                n += 1
                for e in feed(ranks[node], node, build[row[0]](row), item[1], in_flight,
                              integrity):
                    text.append(event_body(e))
                    if type(e) in observers:
                        observe(node, e)
                text.append(_SEP)
            else:
                note_sys(item[1], item[2])
    finally:
        replayer.inputs += n
    return "\n".join(text)
