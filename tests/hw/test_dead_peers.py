"""A rank that dies mid-run on real processes: SGLang's socket options and heartbeat.

Both tests run the `twin` command as a user does, once in simulation and once on real rank
processes (real zmq sockets with SGLang's options, real NIXL), and hold the hardware run to the
simulator's verdict and numbers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.hw

ROOT = Path(__file__).resolve().parents[2]


def twin_json(*args: str, ok: tuple[int, ...] = (5,)) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "twin", *args, "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode in ok, (proc.returncode, proc.stderr[-3000:])
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def test_a_dead_dp_group_blocks_decode_sends_as_simulated(tmp_path: Path) -> None:
    """The dead-DP-group incident: one prefill DP group's rank crashes, decode's scheduler
    fills its queues to it and then blocks in every send; blocked seconds per frame and per
    thread on real sockets are within 30% of the simulator's, and both name the crash."""
    fast = tmp_path / "fast.toml"
    fast.write_text("[sim]\nzmq_send_timeout_s = 0.25\n")
    args = ["--config", str(ROOT / "examples" / "dead-dp-group.toml"), "--config", str(fast),
            "--env", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT=8",
            "--workload", "poisson:n=30,rate=10,input=600,output=1,seed=1",
            "--max-concurrency", "8", "--fault", "crash:p0g1r0:at=1"]
    sim = twin_json("sim", *args)
    trace = tmp_path / "hw.jsonl.zst"
    # Room for the failed rooms decode holds until the deferred-release deadline (30 s; their
    # dead prefill never acknowledges): the simulator's decode pool is a GPU's, far larger.
    hw = twin_json("hw", *args, "--kv-pool-pages", "1200", "--trace-out", str(trace))
    for s in (sim, hw):
        assert s["status"] == "failed"
        assert s["roots"] and "p0g1r0 crashed by fault crash:p0g1r0:at=1" in s["roots"][0]
        assert "blocked d0g0r" in s["roots"][0]
    assert hw["errors"] == []
    # A loaded host can push a room of a live group past the 8 s waiting timeout too.
    assert abs(hw["failed"] - sim["failed"]) <= 2, (hw["failed"], sim["failed"])
    for key in ("send_blocked_by_frame", "send_blocked_by_thread"):
        assert set(hw[key]) == set(sim[key]), key
        for name, seconds in sim[key].items():
            assert abs(hw[key][name] - seconds) <= 0.3 * seconds, (key, name, hw[key], sim[key])
    # The recording replays in simulation: the crash is a fault record of the trace.
    proc = subprocess.run([sys.executable, "-m", "twin", "replay", str(trace)], cwd=ROOT,
                          capture_output=True, text=True, timeout=200, check=False)
    assert "same outcome as recorded" in proc.stdout, proc.stdout + proc.stderr


def test_the_heartbeat_fails_a_dead_prefill_servers_rooms(tmp_path: Path) -> None:
    """Every rank of the prefill server dies: decode's heartbeat (probes 0.5 s apart, two
    failures) fails its rooms within a second or two, not at the 60 s waiting timeout, and
    later rooms fail at once; the simulator agrees."""
    args = ["--config", str(ROOT / "examples" / "tp2-tp1-small.toml"),
            "--env", "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL=0.5",
            "--env", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT=60",
            "--workload", "poisson:n=30,rate=20,input=600,output=1,seed=1",
            "--max-concurrency", "4", "--fault", "crash:p0g0r0:at=0.5:scope=server"]
    sim = twin_json("sim", *args)
    hw = twin_json("hw", *args, "--kv-pool-pages", "1200")
    for s in (sim, hw):
        assert s["status"] == "failed" and s["unfinished"] == 0
        assert all(k.startswith("prefill server p0 ") for k in s["failures"]), s["failures"]
        assert "p0g0r0, p0g0r1 crashed" in s["roots"][0]
    assert hw["sim_seconds"] < 15, hw["sim_seconds"]  # the heartbeat, not the 60 s timeout
    assert hw["errors"] == []


def test_a_dead_decode_rank_wedges_its_rooms_as_simulated() -> None:
    """A decode rank's process ends: its rooms wait on it, the run is a wedge (exit 3) whose
    root names the crash, in simulation and on real ranks alike."""
    args = ["--config", str(ROOT / "examples" / "tp2-tp1-small.toml"),
            "--workload", "poisson:n=20,rate=10,input=600,output=1,seed=1",
            "--max-concurrency", "4", "--fault", "crash:d0g0r0:at=0.5"]
    sim = twin_json("sim", *args, ok=(3,))
    hw = twin_json("hw", *args, ok=(3,))
    for s in (sim, hw):
        assert s["status"] == "wedged"
        assert any("root: d0g0r0 crashed: crashed by fault crash:d0g0r0" in line
                   for line in s["diagnosis"]), s["diagnosis"]
        assert not any("did not report its state" in line for line in s["diagnosis"])
    assert abs(hw["completed"] - sim["completed"]) <= 2  # those done before the crash
