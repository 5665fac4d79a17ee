"""SIGTERM and SIGHUP end a run as Ctrl-C does, even when they land inside a SimPy process."""

from __future__ import annotations

import signal
from collections.abc import Generator
from typing import Any

import pytest
import simpy

from twin.runtime.signals import Interrupted


def test_an_interrupt_is_rebuilt_from_its_args() -> None:
    exc = Interrupted(signal.SIGTERM)
    again = type(exc)(*exc.args)  # what SimPy does with an exception that ended a process
    assert exc.args == ("SIGTERM",) and again.signum == exc.signum == signal.SIGTERM


def test_a_signal_inside_a_simpy_process_stops_the_run_as_an_interrupt() -> None:
    env = simpy.Environment()

    def arrivals() -> Generator[simpy.Event, Any, None]:
        yield env.timeout(1.0)
        raise Interrupted(signal.SIGHUP)  # the handler raised while this process ran

    env.process(arrivals())
    with pytest.raises(KeyboardInterrupt) as info:
        env.run()
    assert isinstance(info.value, Interrupted) and info.value.signum == signal.SIGHUP
