"""The hardware mode's processes under signals and deaths, in real subprocesses.

SIGTERM ends a run like Ctrl-C (verdict ``interrupted``, exit 1, no rank left behind); a rank
killed with SIGKILL is named in the verdict; rank processes die with a coordinator killed by
SIGKILL. An abort fault fails its room (exit 5) and the summary says it fired.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.hw.launcher import HwOptions
from twin.hw.run import run_hw
from twin.runtime.outcome import EXIT_ERROR, EXIT_FAILED
from twin.runtime.params import SimParams
from twin.workloads import fixed

pytestmark = pytest.mark.hw

ROOT = Path(__file__).resolve().parents[2]
SMALL = str(ROOT / "examples" / "tp2-tp1-small.toml")
RANKS = 3  # prefill TP2 -> decode TP1


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


def _ranks(pid: int) -> list[int]:
    """The coordinator's rank processes: spawned children, or children of its forkserver."""
    ranks = []
    for child in _children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            ranks.append(child)
        elif b"forkserver" in cmdline:
            ranks.extend(_children(child))
    return ranks


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start(tmp_path: Path) -> tuple[subprocess.Popen[str], list[int]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", "from twin.cli import main; main()", "hw", "--config", SMALL,
         "--workload", "poisson:n=400,rate=5,input=600,output=4", "--timeout", "90",
         # A loaded host can open the late-STAGING_REQ race and wedge the run before the
         # signal: that is test_hw_mode's subject, not this file's.
         "--fix", "drop-late-staging-req"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    deadline = time.monotonic() + 120
    ranks: list[int] = []
    while time.monotonic() < deadline and len(ranks) < RANKS:
        time.sleep(0.5)
        ranks = _ranks(proc.pid)
        assert proc.poll() is None, proc.communicate()[0]
    assert len(ranks) == RANKS, ranks
    time.sleep(12)  # let the ranks start and requests flow (start-up is covered as well)
    return proc, ranks


def _gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


def test_sigterm_ends_the_run_like_ctrl_c(tmp_path: Path) -> None:
    proc, ranks = _start(tmp_path)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_ERROR, out
    assert "interrupted by SIGTERM" in out, out
    assert "Traceback" not in out
    assert _gone(ranks, 5), "rank processes outlived the run"


def test_a_killed_rank_is_named(tmp_path: Path) -> None:
    proc, ranks = _start(tmp_path)
    victim = ranks[-1]
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_ERROR, out
    assert time.monotonic() - t0 < 30
    assert "killed by SIGKILL" in out and "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error ")]
    assert errors and all(" d0g0r0" in e or " p0g0r" in e for e in errors), out
    assert _gone(ranks, 5)


def test_ranks_die_with_a_killed_coordinator(tmp_path: Path) -> None:
    proc, ranks = _start(tmp_path)
    proc.kill()
    proc.communicate(timeout=30)
    assert _gone(ranks, 10), "rank processes outlived a coordinator killed by SIGKILL"


def test_abort_fault_fails_its_room_and_is_reported() -> None:
    cfg = TwinConfig(prefill=ServerSide(tp_size=2), decode=ServerSide(tp_size=1),
                     model=ModelShape(num_layers=2, num_kv_heads=4, head_dim=32),
                     chunked_prefill_size=64, page_size=16, staging_pool_size_mb=2,
                     fixes=("drop-late-staging-req",))  # two writers: see test_hw_mode.py
    # Room 0 needs 200 forwards of 64 tokens; it is aborted halfway.
    workload = fixed([(0.0, 12800, 4, 0), (0.05, 300, 4, 0), (0.1, 300, 4, 0)])
    result = run_hw(cfg, workload, faults=["abort:room=0:at=0.2", "abort:room=2:at=500"],
                    params=SimParams(prefill_radix_tokens=0),
                    options=HwOptions(kv_pool_pages=1024, forward_s=0.002, timeout_s=120))
    s = result.summary()
    assert s["status"] == "failed" and result.exit_code == EXIT_FAILED, s
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["fault_report"] == [
        {"fault": "abort:room=0:at=0.2", "fired": 1},
        {"fault": "abort:room=2:at=500", "fired": 0, "note": "never fired"}]
