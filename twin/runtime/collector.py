"""The cyclic garbage collector, paced for a simulation's allocation pattern.

A run allocates and drops several small objects per core input (events, frames, queue entries);
almost none of them form cycles. At CPython's default pace (a young-generation pass every 700
net allocations) the collector took about 14% of a simulation's wall time while finding next to
nothing. ``paced_collector()`` makes those passes rarer for the length of a run and restores
the previous thresholds after it; collection itself stays on, so any cycles are still freed.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

RUN_THRESHOLDS = (50_000, 50, 100)
"""Young-generation pass every 50,000 net allocations; the older generations after 50 and 100
passes of the one below (measured on the Mooncake sample trace: as fast as no collector at all,
peak memory unchanged)."""


@contextmanager
def paced_collector(thresholds: tuple[int, int, int] = RUN_THRESHOLDS) -> Iterator[None]:
    """Run the body with the collector's thresholds at ``thresholds`` (never lower than the
    current ones; a collector switched off by a zero threshold stays off), then restore them."""
    before = gc.get_threshold()
    if before[0]:
        gc.set_threshold(*(max(a, b) for a, b in zip(thresholds, before, strict=True)))
    try:
        yield
    finally:
        gc.set_threshold(*before)
