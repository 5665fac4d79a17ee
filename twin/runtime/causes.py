"""Root lines for a run that lost requests to a dead rank: effects linked to their cause.

A crashed prefill or decode rank fails the rooms its group served, and a decode rank's sends to
it fill their ZMQ queue and then block the sending thread (``twin.sim.sockets``); a blocked
decode scheduler admits, scatters and frees nothing, so rooms of live groups fail too. The
summary's ``failures`` and ``send_blocked_*`` give each effect alone; ``root_lines`` joins them
into one line per group with dead ranks, for example::

    2388 request(s) failed: p0g1r0 crashed by fault crash:p0g1r0:at=2 at t=2 s; its prefill
    group p0g1 served 1455 of the failed request(s); sends to it filled their queues and then
    blocked d0g0r0's scheduler 2,723.0 s on p0g1r0 from t=22.3 s, ...
    the other 933 failed request(s) were served by live groups (933 x no transfer result
    within 300s); decode's scheduler sat in blocked sends to a dead rank meanwhile ...

The simulator (``twin.sim.runner``) and a replay (``twin.replay``) build the same lines from
what each knows: a replay reads deaths and rooms from the trace and has no blocked sends.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Death:
    """A rank that died: when, and how (``crash_reason``'s text, which may carry the time)."""

    node: str
    t: float
    how: str


@dataclass(frozen=True, slots=True)
class RoomEnd:
    """A request's room: the ranks it was placed on and how it ended ("Failed", "Success";
    anything else is unfinished), with the first failure reason."""

    room: int
    nodes: tuple[str, ...]
    status: str
    reason: str = ""


def group_of(node: str) -> str:
    """``p0g1`` of ``p0g1r0`` (and of a PP stage's ``p0g1s1r0``)."""
    return node[:node.index("g") + 1] + node[node.index("g") + 1:].split("r")[0].split("s")[0]


def root_lines(deaths: Iterable[Death], rooms: Iterable[RoomEnd],
               blocked: Mapping[tuple[str, str, str], float] | None = None,
               first_full: Mapping[tuple[str, str], float] | None = None) -> list[str]:
    """One line per group with dead ranks (in the order they died): its dead ranks, the
    failed and unfinished requests it served and each (rank, thread) that sat in sends to
    them (``blocked``: seconds by (sender, dead peer, thread); ``first_full``: when a
    sender's queue to that peer filled); then one line for the failed requests of live
    groups. Empty when no rank died (a wedge's own roots are in its diagnosis)."""
    deaths = sorted(deaths, key=lambda d: (d.t, d.node))
    if not deaths:
        return []
    rooms = list(rooms)
    blocked = blocked or {}
    first_full = first_full or {}
    failed = [r for r in rooms if r.status == "Failed"]
    by_group: dict[str, list[Death]] = {}
    for d in deaths:
        by_group.setdefault(group_of(d.node), []).append(d)
    explained: set[int] = set()
    scheduler_blocked = False
    lines = []
    for group, dead in by_group.items():
        role = "prefill" if group.startswith("p") else "decode"
        mine = [r for r in failed if any(group_of(n) == group for n in r.nodes)]
        stuck = sum(any(group_of(n) == group for n in r.nodes) for r in rooms
                    if r.status not in ("Failed", "Success"))
        explained.update(r.room for r in mine)
        how: dict[str, list[str]] = {}  # how they died -> the ranks, in order
        for d in dead:
            text = d.how if "at t=" in d.how else f"died at t={d.t:,.1f} s ({d.how})"
            how.setdefault(text, []).append(d.node)
        parts = ["; ".join(f"{', '.join(ns)} {text}" for text, ns in how.items()),
                 f"its {role} group {group} served {len(mine)} of the failed request(s)"
                 + (f" and {stuck} unfinished one(s)" if stuck else "")]
        nodes = {d.node for d in dead}
        sends = sorted(((src, peer, thread, s) for (src, peer, thread), s in blocked.items()
                        if peer in nodes), key=lambda x: -x[3])
        if sends:
            scheduler_blocked |= any(thread == "scheduler" for _, _, thread, _ in sends)
            held = ", ".join(f"{src}'s {thread} {s:,.1f} s on {peer} from t="
                             f"{first_full.get((src, peer), 0.0):,.1f} s"
                             for src, peer, thread, s in sends)
            parts.append(f"sends to it filled their queues and then blocked {held}")
        lines.append("; ".join(parts))
    rest = [r for r in failed if r.room not in explained]
    if rest:
        reasons: dict[str, int] = {}
        for r in rest:
            key = r.reason.split(":")[0][:80] or "failed"
            reasons[key] = reasons.get(key, 0) + 1
        why = ", ".join(f"{n} x {k}" for k, n in sorted(reasons.items(), key=lambda x: -x[1]))
        line = f"the other {len(rest)} failed request(s) were served by live groups ({why})"
        if scheduler_blocked:
            line += ("; decode's scheduler sat in blocked sends to a dead rank meanwhile (it "
                     "admits, scatters and frees nothing while blocked)")
        lines.append(line)
    if failed:
        lines[0] = f"{len(failed)} request(s) failed: {lines[0]}"
    return lines
