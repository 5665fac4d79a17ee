"""SIGTERM and SIGHUP stop a simulation the way Ctrl-C does: status interrupted, exit 1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
import simpy

from twin.runtime.signals import Interrupted

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_interrupted_rebuilds_from_its_args(signum: signal.Signals) -> None:
    """SimPy re-raises a process's exception as ``type(exc)(*exc.args)``; the copy must be
    the same interruption (it raised ``ValueError: 'SIGTERM' is not a valid Signals``)."""
    exc = Interrupted(signum)
    again = type(exc)(*exc.args)
    assert (again.signum, again.args) == (exc.signum, exc.args) == (int(signum),
                                                                    (signum.name,))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_the_simulation_runs(tmp_path: Path, signum: signal.Signals) -> None:
    """A signal that arrives while the simulation runs (almost always inside a SimPy process)
    must end the run as interrupted, not crashed. (Idle time no longer takes wall time, so
    the run is a busy one.)"""
    trace = tmp_path / "t.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "twin", "sim", "--workload", "poisson:n=200000,rate=2000",
         "--json", "--trace-out", str(trace)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not trace.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # into the simulation
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in err, err
    assert proc.returncode == 1, (proc.returncode, out, err)
    assert json.loads(out)["status"] == "interrupted", out


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
