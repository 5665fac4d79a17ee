"""Root lines for a run that lost requests to a dead rank: effects linked to their cause.

A crashed prefill or decode rank fails the rooms its group served, and a decode rank's sends to
it fill their ZMQ queue and then block the sending thread (``twin.sim.sockets``); a blocked
decode scheduler admits, scatters and frees nothing, so rooms of live groups fail too. The
summary's ``failures`` and ``send_blocked_*`` give each effect alone; ``root_causes`` joins them
into one line per dead rank, for example::

    2388 request(s) failed: p0g1r0 crashed by fault crash:p0g1r0:at=2 at t=2 s; 1455 failed
    request(s) were served by its prefill group p0g1; sends to it filled their queues and then
    blocked d0g0r0's scheduler 2,723.0 s from t=22.3 s, ...
    the other 933 failed request(s) were served by live groups (933 x no transfer result
    within 300s); decode's scheduler sat in blocked sends to a dead rank meanwhile ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from twin.runtime.requests import RequestState
    from twin.sim.engine import Simulation


def _group_name(role: str, instance: int, dp: int) -> str:
    return f"{role[0]}{instance}g{dp}"


def _served(sim: Simulation, r: RequestState, role: str, instance: int, dp: int) -> bool:
    """Whether request ``r`` was served by the ``role`` group (``instance``, ``dp``)."""
    topo = sim.topo
    g = (topo.prefill_groups[r.prefill_group] if role == "prefill"
         else topo.decode_groups[r.decode_group])
    return g.instance == instance and g.dp == dp


def root_causes(sim: Simulation) -> list[str]:
    """One line per rank that died during the run (in the order they died): the requests that
    failed with it, the sends to it that blocked their threads and, on the last line, what the
    failed requests not served by a dead rank's group have in common. Empty when no rank died
    (a wedge's own roots are in its diagnosis)."""
    if not sim.crash_times:
        return []
    topo = sim.topo
    failed: list[RequestState] = [r for r in sim.metrics.done if r.status == "Failed"]
    waiting = [r for r in sim.requests.values() if not r.finished]
    blocked = sim.sockets.blocked_on(sim.env.now)
    restarted = sim.restarted
    explained: set[int] = set()
    scheduler_blocked = False
    lines = []
    dead: dict[tuple[str, int, int], list[str]] = {}  # group -> its dead ranks, as they died
    for node, _t in sorted(sim.crash_times.items(), key=lambda kv: (kv[1], kv[0])):
        n = topo.nodes[node]
        dead.setdefault((n.role, n.instance, n.dp), []).append(node)
    for (role, instance, dp), nodes in dead.items():
        mine = [r for r in failed if _served(sim, r, role, instance, dp)]
        stuck = sum(_served(sim, r, role, instance, dp) for r in waiting)
        explained.update(r.room for r in mine)
        deaths: dict[str, list[str]] = {}  # how they died -> the ranks, in order
        for node in nodes:
            how = sim.runtime.crashed.get(node) or restarted.get(node) or "crashed"
            t = sim.crash_times[node]
            deaths.setdefault(how if "at t=" in how else f"died at t={t:,.1f} s ({how})",
                              []).append(node)
        parts = ["; ".join(f"{', '.join(ns)} {how}" for how, ns in deaths.items()), f"its {role} group {_group_name(role, instance, dp)} "
                 f"served {len(mine)} of the failed request(s)"
                 + (f" and {stuck} unfinished one(s)" if stuck else "")]
        sends = sorted(((src, node, thread, s) for (src, node, thread), s in blocked.items()
                        if node in nodes), key=lambda x: -x[3])
        if sends:
            scheduler_blocked |= any(thread == "scheduler" for _, _, thread, _ in sends)
            held = ", ".join(
                f"{src}'s {thread} {s:,.1f} s on {node} from t="
                f"{sim.sockets.first_full.get((src, node), 0.0):,.1f} s"
                for src, node, thread, s in sends)
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
