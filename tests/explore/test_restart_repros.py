"""Repros with a ``restart:`` fault replay to their recorded verdict: the replay gives the
restarted rank a fresh core, as the simulator does (two findings of a
``--defect swallowed-chunk-ready-error --seed 7`` campaign, once divergent)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from twin.explore.oracles import run_trial
from twin.explore.trial import Base, Trial
from twin.replay import replay_sim
from twin.sim.scenarios import SCENARIOS

SMALL = SCENARIOS["default"].config.replace(
    chunked_prefill_size=2048, staging_pool_size_mb=64,
    model=SCENARIOS["default"].config.model.__class__(num_layers=4, num_kv_heads=8,
                                                      head_dim=64, dtype_bytes=2))
TRIALS = {
    "restart-before-first-chunk": {
        "deploy": {"chunked_prefill_size": 16, "ring_bytes": 131072},
        "faults": ["restart:p0g0r1:at=0.003:down=0.01"], "requests": [[0.0, 56, 0, 0]],
        "seed": 0},
    "restart-then-stale-session": {
        "deploy": {}, "faults": ["restart:p0g0r1:at=0.01:down=0.1"],
        "requests": [[0.0, 47, 32, 0], [1.5, 72, 0, 64]], "seed": 0},
    "server-restart": {
        "deploy": {}, "faults": ["restart:p0g0r1:at=0.01:down=0.1:scope=server"],
        "requests": [[0.0, 47, 32, 0], [1.5, 72, 0, 64]], "seed": 0},
}


@pytest.mark.parametrize("name", sorted(TRIALS))
def test_a_restart_repro_replays_to_its_verdict(name: str, tmp_path: Path) -> None:
    base = Base(SMALL, SCENARIOS["default"].params.replace(wedge_window_s=5.0),
                ("swallowed-chunk-ready-error",))
    trial = Trial.from_json(json.loads(json.dumps(TRIALS[name])))
    path = tmp_path / "repro.jsonl.gz"
    result = run_trial(base, trial, trace_out=str(path))
    assert result.status in ("wedged", "completed"), result.status
    replayed = replay_sim(str(path))
    assert replayed.divergence is None, replayed.divergence
    assert replayed.same_outcome, (replayed.status, result.status)


def test_a_restarted_decode_ranks_new_ring_is_not_held_against_its_old_one() -> None:
    """A decode rank restarted empty allocates from round 0 again: the explorer's safety
    checks forget the old ring's live allocations and watermark (this trial, found with every
    fix on, was reported as an overlapping allocation)."""
    data = json.loads((Path(__file__).parent / "data" / "decode-restart-trial.json").read_text())
    assert any(f.startswith("restart:d") for f in data["trial"]["faults"])
    result = run_trial(Base.from_json(data["base"]), Trial.from_json(data["trial"]))
    assert not any(s.startswith(("overlap:", "watermark:")) for s in result.safety), \
        result.safety


def test_a_restarted_decode_server_writes_to_a_new_ring(tmp_path: Path) -> None:
    """A decode server restarted empty gets new memory: a later room's write to offset 0 is
    not an overwrite of the old process's unscattered data (found with every fix on as a
    corruption), and the repro replays to the simulator's verdict."""
    data = json.loads((Path(__file__).parent / "data" / "decode-server-restart-trial.json")
                      .read_text())
    assert data["trial"]["faults"] == ["restart:d0g0r1:at=0.003:down=0.1:scope=server"]
    path = tmp_path / "repro.jsonl.gz"
    result = run_trial(Base.from_json(data["base"]), Trial.from_json(data["trial"]),
                       trace_out=str(path))
    assert not result.corruption, result.corruption
    replayed = replay_sim(str(path))
    assert replayed.divergence is None and replayed.same_outcome and not replayed.corruption


def test_a_lost_kv_status_is_settled_by_the_waiting_timeout() -> None:
    """Every fix on, a KV_STATUS lost to a send timeout: the first run wedges (5 s window), the
    settling run fails the room at decode's waiting timeout, a fault on its path: no finding.
    The same wedge with no fault on the room's path would stand (the stale-watermark test)."""
    data = json.loads((Path(__file__).parent / "data" / "lost-kv-status-trial.json").read_text())
    assert data["trial"]["faults"] == ["fail-send:KV_STATUS:nth=1"]
    result = run_trial(Base.from_json(data["base"]), Trial.from_json(data["trial"]))
    assert result.status == "wedged" and result.signature is None


def test_a_loopback_pile_up_of_re_requests_is_decided_on_a_finer_clock() -> None:
    """Lost-control recovery's re-requests outrun the loopback's 1 ms step (a livelock of
    pending actions with no fault); on a 0.1 ms step the same schedule completes."""
    data = json.loads((Path(__file__).parent / "data" / "loopback-rerequest-trial.json")
                      .read_text())
    assert data["trial"]["schedule"] and not data["trial"]["faults"]
    result = run_trial(Base.from_json(data["base"]), Trial.from_json(data["trial"]))
    assert (result.status, result.signature) == ("completed", None)
