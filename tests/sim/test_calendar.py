"""The simulator's calendar runs its calls in (time, scheduling order), across its two parts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from twin.sim.engine import Calendar, EventIds

# Delays from the same instant to minutes away, so calls land in both parts of the calendar
# and the same times recur (ties run in scheduling order).
DELAYS = st.one_of(st.sampled_from([0.0, 1e-6, 0.5, 1.0, 2.0]),
                   st.floats(0.0, 1e-3), st.floats(0.0, 600.0))


def _next(cal: Calendar) -> tuple[float, int] | None:
    if not cal.soon and not cal.refill():
        return None
    call = cal.soon.pop()
    return call.t, call.eid


@given(st.lists(st.tuples(DELAYS, st.integers(0, 3)), min_size=1, max_size=200),
       st.sampled_from([1e-3, 1.0, 60.0]))
@settings(max_examples=200, deadline=None)
def test_calls_run_in_time_then_scheduling_order(script: list[tuple[float, int]],
                                                 horizon: float) -> None:
    """Each step schedules a call ``delay`` after the current time, then runs ``pops`` calls;
    what runs must be what a sort by (time, id) of the pending calls says, every time."""
    cal = Calendar(EventIds(), horizon=horizon)
    pending: list[tuple[float, int]] = []
    now = 0.0
    for delay, pops in script:
        t = now + delay
        eid = cal.eids.n
        cal.add(t, print, ())
        pending.append((t, eid))
        assert len(cal) == len(pending)
        for _ in range(pops):
            got = _next(cal)
            pending.sort()
            assert got == (pending.pop(0) if pending else None)
            if got is not None:
                assert got[0] >= now  # time never runs backwards
                now = got[0]
    while (got := _next(cal)) is not None:
        pending.sort()
        assert got == pending.pop(0)
    assert not pending and len(cal) == 0
