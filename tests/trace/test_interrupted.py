"""Ctrl-C, SIGTERM and SIGHUP during `twin replay` and `twin perfetto`.

The command runs as a process of its own, slowed down (each replayed input, or each record
the export reads, waits a few milliseconds) so that the signal surely lands while it works: a
replay says when it fed its first input, an export is at work once its temporary file is
there. A replay then ends with exit 1, status ``interrupted`` and what it replayed so far, as
`twin sim` and `twin hw` do; an export leaves no partial file and no temporary behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from twin.cli import cli

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = "poisson:n=20,rate=10,input=1024,output=4,seed=1"
DEADLINE = 120.0  # seconds: generous, on a loaded host

SLOW_REPLAY = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # even where SIGINT was ignored
from twin.replay import Replayer
told = []
def slow(self, *args, _feed=Replayer.feed):
    effects = _feed(self, *args)
    if not told:
        told.append(1)
        print("first input fed", file=sys.stderr, flush=True)
    time.sleep(0.005)
    return effects
Replayer.feed = slow
if sys.argv[1] == "forked":
    from twin.replay import forked
    forked.MIN_BYTES = 0  # the reader in a forked process, as for a large trace
from twin.cli import cli
cli(sys.argv[2:])
"""

SLOW_EXPORT = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from twin.trace import perfetto
def slow(self, rec, _feed=perfetto._Timeline.feed):
    time.sleep(0.003)
    return _feed(self, rec)
perfetto._Timeline.feed = slow
from twin.cli import cli
cli(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("interrupted") / "run.jsonl.zst"
    r = CliRunner().invoke(cli, ["sim", "--workload", WORKLOAD, "--trace-out", str(path)])
    assert r.exit_code == 0, r.output
    return path


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _interrupt(args: list[str], ready: Callable[[subprocess.Popen[str]], bool],
               sig: signal.Signals) -> tuple[int, str, str]:
    """Start ``args``, wait until ``ready``, send ``sig``; exit status, stdout, stderr."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), cwd=ROOT)
    try:
        deadline = time.monotonic() + DEADLINE
        while not ready(proc):
            assert proc.poll() is None, ("ended before the signal", proc.communicate())
            assert time.monotonic() < deadline, "never got ready"
            time.sleep(0.02)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=DEADLINE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


def _said_ready(proc: subprocess.Popen[str]) -> bool:
    assert proc.stderr is not None
    return proc.stderr.readline().strip() == "first input fed"


@pytest.mark.parametrize(("reader", "sig"), [
    ("sequential", signal.SIGTERM),
    ("sequential", signal.SIGINT),
    ("forked", signal.SIGHUP),
    ("forked", signal.SIGTERM),
])
def test_a_signal_ends_a_replay_with_what_it_replayed(trace: Path, reader: str,
                                                      sig: signal.Signals) -> None:
    code, out, err = _interrupt([sys.executable, "-c", SLOW_REPLAY, reader, "replay",
                                 str(trace)], _said_ready, sig)
    why = "Ctrl-C" if sig == signal.SIGINT else sig.name
    assert code == 1, (code, out, err)
    assert "Traceback" not in out + err, err
    first = out.splitlines()[0]
    assert first.startswith("replayed ") and ": interrupted, " in first, out
    assert f"stopped     interrupted by {why} after " in out, out
    fed = int(first.split()[1])
    assert 0 < fed < 924, out  # stopped part way: the trace has 924 inputs
    assert "same outcome" not in out and "recorded:" not in out, out


def test_a_signal_ends_a_replay_json(trace: Path) -> None:
    code, out, err = _interrupt([sys.executable, "-c", SLOW_REPLAY, "sequential", "replay",
                                 str(trace), "--json"], _said_ready, signal.SIGTERM)
    import json

    doc = json.loads(out)
    assert code == 1 and doc["status"] == "interrupted" and not doc["same_outcome"], out
    assert doc["interrupted"].startswith("interrupted by SIGTERM after "), doc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_perfetto_leaves_no_partial_file(trace: Path, tmp_path: Path,
                                                         sig: signal.Signals) -> None:
    out_path = tmp_path / "run.pftrace"
    out_path.write_bytes(b"an earlier export")

    def writing(proc: subprocess.Popen[str]) -> bool:
        return any(p.name.endswith(".part") for p in tmp_path.iterdir())

    code, out, err = _interrupt([sys.executable, "-c", SLOW_EXPORT, "perfetto", str(trace),
                                 "-o", str(out_path)], writing, sig)
    assert code == 1, (code, out, err)
    assert "Traceback" not in out + err, err
    why = "Ctrl-C" if sig == signal.SIGINT else sig.name
    assert f"interrupted by {why}: {out_path} not written" in err, err
    assert [p.name for p in tmp_path.iterdir()] == ["run.pftrace"]
    assert out_path.read_bytes() == b"an earlier export"
