"""Records into a ``Packer``'s batch (``twin.trace.packio`` gives the layout): what the trace
writer (``twin.trace.format.TraceWriter``) and a recording runtime (``twin.runtime.runtime``)
call once per input, effect list or driver record. Compiled with the core.

Each function writes a whole item or nothing: an item that fails half-way (a float that is not
finite, a field of the wrong type) is rolled back before the error is raised, so the batch and
the string codes stay as the reader expects them.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import Any, Final

from twin.core.events import RoomConcluded
from twin.trace.packers import pack_effect, pack_input
from twin.trace.packio import K_FLUSH, K_IN, K_INOUT, K_OUT, K_SYS, Packer
from twin.trace.sysrec import sys_type

__all__ = ["BAD_EFFECT", "BAD_INPUT", "BAD_NODE", "OK", "pack_flush", "pack_item", "pack_record",
           "pack_sys"]

OK: Final = 0
BAD_NODE: Final = 1
BAD_INPUT: Final = 2
BAD_EFFECT: Final = 3

def pack_item(p: Packer, t: float, node: str, event: Any, effects: list[Any] | None) -> int:
    """Pack input ``event`` handled on ``node`` at ``t`` and the ``effects`` it returned
    (``K_INOUT``), or the input alone (``effects`` None: ``K_IN``) or the effects alone
    (``event`` None: ``K_OUT``). ``OK``, or what was wrong (``BAD_NODE``: not one of the
    header's nodes; ``BAD_INPUT``, ``BAD_EFFECT``: not a core input or effect), nothing
    written. Times must be non-decreasing and finite (the caller's check)."""
    code = p.node_code.get(node, -1)
    if code < 0 or code == p.driver:
        return BAD_NODE
    size = len(p.w)
    t0 = p.t
    lines = p.lines
    try:
        p.time(t)
        if event is not None:
            p.put_tag(K_IN if effects is None else K_INOUT)
            p.put_int(code)
            if not pack_input(p, event):
                p.rollback(size, t0, lines)
                return BAD_INPUT
            p.lines += 1
        else:
            p.put_tag(K_OUT)
            p.put_int(code)
        if effects is not None:
            p.put_int(len(effects))
            for e in effects:
                if not pack_effect(p, e):
                    p.rollback(size, t0, lines)
                    return BAD_EFFECT
                if type(e) is RoomConcluded and code in p.decode:
                    (p.succeeded if e.status == "Success" else p.failed).add(e.room)
            p.lines += len(effects)
    except BaseException:
        p.rollback(size, t0, lines)
        raise
    p.fresh.clear()
    p.items += 1
    return OK


def pack_sys(p: Packer, t: float, node: str, rtype: str, room: Any, record: Any) -> int:
    """Pack driver record ``record`` (of type ``rtype``, naming ``room`` or None) written by
    ``node`` (a node of the header's or ``"driver"``) at ``t``; ``OK`` or ``BAD_NODE``."""
    code = p.node_code.get(node, -1)
    if code < 0:
        return BAD_NODE
    p.time(t)
    p.put_tag(K_SYS)
    p.put_int(code)
    p.put_int(len(p.sys))
    p.sys.append((rtype, room, record))
    p.items += 1
    p.lines += 1
    return OK


def pack_record(p: Packer, t: float, node: str, record: Mapping[str, Any],
                types: dict[str, dict[str, str]], statuses: tuple[str, ...],
                nodes: Container[str]) -> str | None:
    """Check driver record ``record`` (``twin.trace.sysrec.sys_type`` with ``types``,
    ``statuses`` and ``nodes``) and pack a copy of it, its ``type`` first, written by ``node``
    at ``t`` (``pack_sys``); its type, or None when it is not valid or ``node`` is not one of
    the header's nodes or ``"driver"`` (nothing written)."""
    rec = dict(record)
    rtype = sys_type(rec, types, statuses, nodes)
    if rtype is None:
        return None
    if next(iter(rec)) != "type":
        rec = {"type": rtype, **{k: v for k, v in rec.items() if k != "type"}}
    if pack_sys(p, t, node, rtype, rec["room"] if "room" in types[rtype] else None, rec):
        return None
    return rtype


def pack_flush(p: Packer) -> None:
    """End the trace's block after the items packed so far (``K_FLUSH``)."""
    p.put_tag(K_FLUSH)
    p.items += 1
