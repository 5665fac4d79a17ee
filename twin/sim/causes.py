"""A simulation's root lines for requests lost to a dead rank (``twin.runtime.causes``): the
deaths, the rooms and the blocked sends as the simulator knows them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from twin.runtime.causes import Death, RoomEnd, root_lines

if TYPE_CHECKING:
    from twin.sim.engine import Simulation


def root_causes(sim: Simulation) -> list[str]:
    """``root_lines`` of ``sim``: empty when no rank died."""
    if not sim.crash_times:
        return []
    topo = sim.topo
    deaths = [Death(node, t, sim.runtime.crashed.get(node) or sim.restarted.get(node)
                    or "crashed") for node, t in sim.crash_times.items()]
    rooms = [RoomEnd(r.room, tuple(n.id for n in (*topo.prefill_groups[r.prefill_group].nodes,
                                                   *topo.decode_groups[r.decode_group].nodes)),
                     r.status, r.reason)
             for r in sim.requests.values()]
    return root_lines(deaths, rooms, sim.sockets.blocked_on(sim.env.now),
                      sim.sockets.first_full)
