"""Per-process stalls: a rank process that is descheduled handles nothing until it runs again.

On a loaded host (more rank processes than cores) a process runs for a while, then waits for a
core; whatever reaches it meanwhile (frames, transfer and scatter completions, the scheduler's
calls, its own timers) is handled when it runs again, in arrival order, and everything it sends
leaves after that. Independent per-frame jitter misses that correlation: it delays one socket
of a process and not the others, which opens overtaking races the host rarely shows.

``ProcessStalls`` draws, per node and lazily, alternating run and stall periods (exponential,
means ``interval_s`` and ``stall_s``) from the node's own seeded stream, so the periods do not
depend on the order in which nodes are asked about.
"""

from __future__ import annotations

import random


class ProcessStalls:
    """``end(node, t)``: when ``node`` can next run at time ``t`` (``t`` itself when it is
    running then, else the end of the stall ``t`` falls in). Each node is asked at
    non-decreasing times, as a simulation's clock gives them."""

    __slots__ = ("_interval", "_periods", "_rngs", "_seed", "_stall", "delayed", "stalled_s")

    def __init__(self, stall_s: float, interval_s: float, seed: int) -> None:
        if stall_s <= 0 or interval_s <= 0:
            raise ValueError("stall and run periods must be positive")
        self._stall = stall_s
        self._interval = interval_s
        self._seed = seed
        self._rngs: dict[str, random.Random] = {}
        self._periods: dict[str, list[float]] = {}  # node -> [stall start, stall end]
        self.delayed = 0  # inputs that arrived during a stall
        self.stalled_s = 0.0  # the delay they waited, summed

    def _next(self, node: str, after: float) -> list[float]:
        rng = self._rngs.get(node)
        if rng is None:
            rng = self._rngs[node] = random.Random(f"{self._seed}:stall:{node}")
        start = after + rng.expovariate(1.0 / self._interval)
        return [start, start + rng.expovariate(1.0 / self._stall)]

    def end(self, node: str, t: float) -> float:
        period = self._periods.get(node)
        if period is None:
            period = self._periods[node] = self._next(node, 0.0)
        while period[1] <= t:
            period = self._periods[node] = self._next(node, period[1])
        if period[0] <= t:
            self.delayed += 1
            self.stalled_s += period[1] - t
            return period[1]
        return t
