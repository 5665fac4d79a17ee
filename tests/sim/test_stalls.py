"""Per-process stalls (``twin/sim/stalls.py``): when a stalled rank can run again, drawn per
node and independent of the order nodes are asked about; a stalled rank's inputs wait, in
order, and a run with stalls is as deterministic as one without."""

from __future__ import annotations

from pathlib import Path

import pytest

from twin.core.config import TwinConfig
from twin.runtime.params import SimParams
from twin.sim.runner import run_sim
from twin.sim.stalls import ProcessStalls
from twin.workloads import poisson


def test_end_is_the_stall_end_inside_a_stall_and_the_time_itself_outside() -> None:
    s = ProcessStalls(0.01, 0.01, seed=3)
    inside = outside = 0
    t = 0.0
    while t < 2.0:
        end = s.end("p0g0r0", t)
        assert end >= t
        if end > t:
            inside += 1
        else:
            outside += 1
        t += 0.0007
    # Equal means: about half the time stalled.
    assert 0.3 < inside / (inside + outside) < 0.7
    assert s.delayed == inside and s.stalled_s > 0
    end = s.end("p0g0r0", t)
    while end == t:
        t += 0.0007
        end = s.end("p0g0r0", t)
    assert s.end("p0g0r0", end) == end  # at its stall's end the process runs


def test_periods_are_per_node_and_do_not_depend_on_the_order_of_questions() -> None:
    times = [i * 0.003 for i in range(500)]
    a, b = ProcessStalls(0.02, 0.05, seed=1), ProcessStalls(0.02, 0.05, seed=1)
    first = [a.end("d0g0r0", t) for t in times]
    for t in times:  # interleave another node's questions
        b.end("p0g0r0", t)
    assert [b.end("d0g0r0", t) for t in times] == first
    other = ProcessStalls(0.02, 0.05, seed=2)
    assert [other.end("d0g0r0", t) for t in times] != first


def test_stall_periods_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ProcessStalls(0.0, 0.1, seed=0)


def _run(tmp_path: Path, name: str, **params: float):
    wl = poisson(60, rate_per_s=40, input_len=3000, output_len=8, seed=4)
    trace = tmp_path / f"{name}.jsonl"
    result = run_sim(TwinConfig(), wl, params=SimParams().replace(**params), seed=5,
                     trace_out=trace)
    return result, trace.read_bytes()


def test_a_run_with_stalls_is_deterministic_and_slower(tmp_path: Path) -> None:
    calm, _ = _run(tmp_path, "calm")
    one, trace_one = _run(tmp_path, "one", process_stall_s=0.005, process_run_s=0.005)
    two, trace_two = _run(tmp_path, "two", process_stall_s=0.005, process_run_s=0.005)
    assert one.status == calm.status == "completed"
    assert trace_one == trace_two
    stalls = one.sim.stalls
    assert stalls is not None and stalls.delayed > 100 and stalls.stalled_s > 0
    assert calm.sim.stalls is None
    ttft = [r["ttft_s"]["p50"] for r in (calm.summary()["latency"], one.summary()["latency"])]
    assert ttft[1] > ttft[0]


def test_blocking_kernels_hold_the_rank_until_they_finish(tmp_path: Path) -> None:
    """``blocking_kernels`` (the hardware mode's torch copies in the rank's loop): while a
    decode rank scatters, it takes no input, and the run is deterministic and slower than
    with the same scatters on a device stream."""
    from twin.trace.format import read_trace

    slow = {"scatter_bandwidth_Bps": 2e8, "gather_bandwidth_Bps": 2e8}
    stream, _ = _run(tmp_path, "stream", **slow)
    one, trace_one = _run(tmp_path, "one", **slow, blocking_kernels=True)
    _, trace_two = _run(tmp_path, "two", **slow, blocking_kernels=True)
    assert one.status == stream.status == "completed"
    assert trace_one == trace_two
    busy: list[tuple[float, float]] = []  # one decode rank's scatters, start to finish
    inputs: list[float] = []
    free = 0.0
    for rec in read_trace(tmp_path / "one.jsonl").events:
        if rec.node != "d0g0r0":
            continue
        # The decode group's poll reduction between TP peers is delivered inside the
        # runtime, instantly (a gloo all-reduce): a busy peer's share of it is not modelled.
        if rec.dir == "in" and rec.type != "PeerPolled":
            inputs.append(rec.t)
        elif rec.type == "StartScatter":
            start = max(rec.t, free)
            free = start + 15e-6 + rec.event.nbytes / 2e8
            busy.append((start, free))
    assert len(busy) >= 50
    inside = [t for t in inputs for a, b in busy if a + 1e-9 < t < b - 1e-9]
    assert inside == []
    ttft = [r.summary()["latency"]["ttft_s"]["p50"] for r in (stream, one)]
    assert ttft[1] > ttft[0]
