"""The sample traces in traces/ replay in simulation to their recorded outcomes."""

from __future__ import annotations

from pathlib import Path

import pytest

from twin.replay import replay_sim
from twin.trace.format import read_trace

TRACES = Path(__file__).resolve().parents[2] / "traces"


@pytest.mark.parametrize("name, status", [
    ("clean-default.jsonl.gz", "completed"),
    ("warmup-stall.jsonl.gz", "wedged"),
    ("hw-tp2-tp1.jsonl.gz", "completed"),
])
def test_sample_replays_to_its_outcome(name: str, status: str) -> None:
    trace = read_trace(TRACES / name)
    assert trace.complete and trace.status == status
    result = replay_sim(trace)
    assert result.divergence is None
    assert result.same_outcome
    assert result.status == status


def test_warmup_stall_sample_diagnosis_names_the_stuck_session() -> None:
    result = replay_sim(read_trace(TRACES / "warmup-stall.jsonl.gz"))
    lines = "\n".join(result.diagnosis)
    assert "room 2 chunk 0" in lines and "never sent to this session" in lines


def test_hardware_trace_reports_how_far_simulated_timings_are() -> None:
    result = replay_sim(read_trace(TRACES / "hw-tp2-tp1.jsonl.gz"))
    timing = result.timing
    assert timing is not None and timing["rooms_compared"] == 12
    for phase in ("kv_done_s", "transfer_s"):
        t = timing[phase]
        assert t["measured_p50"] > 0 and t["simulated_p50"] > 0
        assert t["ratio_p10"] <= t["ratio_p50"] <= t["ratio_p90"]
