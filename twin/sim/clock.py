"""SimPy's environment on the simulation's clock.

The simulator runs most of its events from its own ``Calendar`` (``twin.sim.engine``) beside
SimPy's queue, and its compiled code reads and writes the time as the calendar's native field
``now``. ``CalendarEnvironment`` makes SimPy keep its time there too: ``env._now`` (and so
``env.now``) is a property over ``calendar.now``, so SimPy's steps move the calendar's clock,
the calendar's calls move SimPy's, and either reads the same instant. This module stays pure
Python: a compiled class cannot subclass SimPy's.
"""

from __future__ import annotations

from typing import Any, Protocol

import simpy

__all__ = ["CalendarEnvironment"]


class _Clock(Protocol):
    now: float
    eids: Any


class CalendarEnvironment(simpy.Environment):
    """A ``simpy.Environment`` whose clock is ``calendar.now`` and whose event ids come from
    ``calendar.eids`` (one counter for SimPy's events and the calendar's calls)."""

    def __init__(self, calendar: _Clock, initial_time: float = 0.0) -> None:
        self._calendar = calendar
        super().__init__(initial_time)
        self._eid = calendar.eids  # type: ignore[assignment]  # SimPy only calls next() on it

    @property  # type: ignore[override]
    def _now(self) -> float:
        return self._calendar.now

    @_now.setter
    def _now(self, t: float) -> None:
        self._calendar.now = t
