"""Hardware mode end to end: real rank processes, zmq, NIXL (DRAM) and torch kernels.

Every run verifies every byte of every finished request on the decode ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.core.defects import Defects
from twin.hw.launcher import HwOptions
from twin.hw.replay import replay_hw
from twin.hw.run import HwInputError, run_hw
from twin.runtime.params import SimParams
from twin.sim.scenarios import SCENARIOS
from twin.trace.format import read_trace
from twin.workloads import fixed

pytestmark = pytest.mark.hw

TINY = ModelShape(num_layers=2, num_kv_heads=4, head_dim=32, dtype_bytes=2)
#: With several writers per decode rank, a loaded host can make one writer's STAGING_REQ trail
#: its chunk and wedge the ring, as it would in SGLang: reproduced on purpose by
#: test_late_staging_req_wedges_real_ranks_and_the_trace_explains_it. Tests about other things
#: that expect a clean run switch on the fix, so that race cannot decide them.
LATE_REQ_FIX = ("drop-late-staging-req",)
TRACES = Path(__file__).resolve().parents[2] / "traces"


def _options() -> HwOptions:
    return HwOptions(wedge_window_s=15.0, timeout_s=180.0, kv_pool_pages=1024)


def _allocs(trace) -> list:  # type: ignore[no-untyped-def]
    return [r.event for r in trace.events if r.dir == "out" and r.type == "Allocated"]


def test_tp2_to_tp1_wraps_ring_with_radix_hits_and_a_dropped_watermark(tmp_path: Path) -> None:
    """Prefill TP2 -> decode TP1, page 16, a ring that wraps many times, prefix hits on both
    sides, one WATERMARK dropped: every request completes and every byte lands."""
    region = 2 * 4 * 32 * 2 * 2 * 64  # two writers' 64-token chunks, all layers, K and V
    cfg = TwinConfig(prefill=ServerSide(tp_size=2), decode=ServerSide(tp_size=1), model=TINY,
                     chunked_prefill_size=64, page_size=16,
                     staging_pool_size_bytes=5 * region, fixes=LATE_REQ_FIX)
    workload = fixed([(0.02 * i, 900 + 16 * (i % 3), 4, 640) for i in range(10)])
    # A decode cache of one 512-token block: decode reuses 512 tokens, prefill all 640.
    params = SimParams(decode_radix_tokens=512, prefill_radix_tokens=100_000)
    out = tmp_path / "hw.jsonl"
    result = run_hw(cfg, workload, faults=["drop:WATERMARK:nth=2"], params=params,
                    options=_options(), trace_out=str(out), max_concurrency=2)
    s = result.summary()
    assert s["status"] == "completed", s
    assert s["completed"] == 10 and not s["corruption"]
    trace = read_trace(out)
    assert trace.status == "completed"
    assert max(a.round for a in _allocs(trace)) >= 5, "the ring should wrap many times"
    arrived = [r.data for r in trace.events if r.type == "RequestArrived"]
    assert any(a["decode_prefix_len"] > 0 for a in arrived), "decode radix hit expected"
    assert any(a["prefill_prefix_len"] > a["decode_prefix_len"] for a in arrived)
    assert any(r.type == "FaultInjected" for r in trace.events)


def test_tp1_to_tp2_page_size_1() -> None:
    """Prefill TP1 -> decode TP2 (one writer feeds two decode ranks), page size 1."""
    cfg = TwinConfig(prefill=ServerSide(tp_size=1), decode=ServerSide(tp_size=2), model=TINY,
                     chunked_prefill_size=96, page_size=1, staging_pool_size_mb=2)
    workload = fixed([(0.01 * i, 150 + 31 * i, 4, 0) for i in range(5)])
    result = run_hw(cfg, workload, params=SimParams(prefill_radix_tokens=0),
                    options=_options())
    s = result.summary()
    assert s["status"] == "completed", s
    assert s["completed"] == 5 and s["corruption"] == []
    assert s["verified"] == 5  # both decode ranks checked every byte of every request


@pytest.mark.parametrize("defect_on", [True, False], ids=["no-grid-alignment", "aligned"])
def test_radix_grid_byte_check(defect_on: bool) -> None:
    """Seeds 000/003 on hardware: the byte check finds the corruption with the defect on and
    nothing with it off, in finished rooms or in the ones a wedge left unfinished."""
    sc = SCENARIOS["radix-grid"]
    defects = Defects.of(sc.defects if defect_on else ())
    result = run_hw(sc.config.replace(fixes=LATE_REQ_FIX), sc.workload(), defects=defects,
                    params=sc.params,
                    options=_options(), request_overrides=sc.overrides)
    s = result.summary()
    if defect_on:
        assert s["status"] == "corrupted", s
        first = s["corruption"][0]
        assert "room" in first and "layer" in first and "token" in first and "head" in first
        # The wrong bytes are in a finished room, or in one the run never finished (timing
        # decides whether the overrun's victims finish or the run wedges first).
        assert s["verified"] < s["completed"] or any("(unfinished)" in c
                                                     for c in s["corruption"]), s
    else:
        assert s["status"] == "completed", s
        assert s["completed"] == len(sc.workload().requests)


def test_warmup_stall_trace_wedges_on_hardware() -> None:
    """The simulator's warmup-stall trace, replayed on real processes, wedges with the same
    diagnosis as in simulation."""
    trace = read_trace(TRACES / "warmup-stall.jsonl.gz")
    result = replay_hw(trace, _options())
    assert result.divergence is None
    assert result.status == "wedged"
    assert result.same_outcome, (result.diagnosis, trace.outcome)
    assert any("never sent to this session" in line for line in result.diagnosis)


def test_unsupported_requests_are_rejected_before_starting() -> None:
    cfg = TwinConfig(model=TINY, chunked_prefill_size=64)
    with pytest.raises(HwInputError, match="silent-slice-fallback"):
        run_hw(cfg, fixed([(0.0, 100, 4, 0)]), defects=Defects.of(["silent-slice-fallback"]))
    with pytest.raises(HwInputError, match="restart"):
        run_hw(cfg, fixed([(0.0, 100, 4, 0)]), faults=["restart:d0g0r0:at=1:down=1"])


def test_multi_target_retry_race_corrupts_real_bytes(tmp_path: Path) -> None:
    """The race found in simulation (every defect off) corrupts real bytes on hardware, and the
    hardware trace replayed in simulation names the overwrite that caused it."""
    from twin.replay import replay_sim

    sc = SCENARIOS["multi-target-retry"]
    # Timing decides the race on a real host: on a loaded one a run sometimes completes clean,
    # and about 1 run in 10 under load (2 of about 20 here) corrupted bytes where the replay
    # found none: not yet explained; the likeliest gap is that the integrity model lands a
    # WRITE's bytes when its writer sees it done, where on the host they land somewhere between
    # post and done. Up to three runs for one that shows both.
    for attempt in range(3):
        out = tmp_path / f"race{attempt}.jsonl.gz"
        result = run_hw(sc.config, sc.workload(), faults=list(sc.faults), params=sc.params,
                        options=_options(), trace_out=str(out))
        s = result.summary()
        replayed = replay_sim(read_trace(out))
        if s["status"] == "corrupted" and replayed.same_outcome:
            break
    assert s["status"] == "corrupted", s
    assert all(" room " in c and " layer " in c and " token " in c for c in s["corruption"])
    assert replayed.divergence is None and replayed.same_outcome, (s, replayed.status)
    assert any(c.startswith("overwrite: ") for c in replayed.corruption)


def test_multi_target_retry_resume_fix_keeps_real_bytes_clean() -> None:
    """The same run with the proposed fix on: every byte of every room verifies."""
    from twin.core.fixes import MULTI_TARGET_RETRY_RESUME

    sc = SCENARIOS["multi-target-retry"]
    cfg = sc.config.replace(fixes=(MULTI_TARGET_RETRY_RESUME,))
    result = run_hw(cfg, sc.workload(), faults=list(sc.faults), params=sc.params,
                    options=_options())
    s = result.summary()
    assert s["status"] == "completed" and not s["corruption"], s


def test_late_staging_req_wedges_real_ranks_and_the_trace_explains_it(tmp_path: Path) -> None:
    """Found first on real transfers between two network namespaces: one writer's STAGING_REQs
    held back on its prefetch socket reach decode after the other writer's request got the
    allocation and both wrote the chunk; decode allocates it again, as SGLang does, and the
    allocation nothing will scatter pins the ring. The trace replays to the same outcome.

    The hold that opens the race depends on the host's speed (the late request must land
    after its chunk's scatter and before its room ends: on a fast host a 300 ms hold arrives
    after every room ended), so the run is tried at shorter holds until one wedges; a run that
    does not wedge must complete with every byte verified."""
    from twin.replay import replay_sim

    sc = SCENARIOS["radix-grid"]
    options = _options()
    options.wedge_window_s = 8.0
    tried = []
    for ms in (300, 150, 80, 40):
        out = tmp_path / f"late-{ms}.jsonl.gz"
        result = run_hw(sc.config, sc.workload(),
                        faults=[f"delay:STAGING_REQ:src=p0g0r1:ms={ms}"], params=sc.params,
                        options=options, request_overrides=sc.overrides, trace_out=str(out))
        s = result.summary()
        tried.append((ms, s["status"]))
        if s["status"] == "wedged":
            break
        assert s["status"] == "completed" and s["verified"] == s["requests"], s
    assert tried[-1][1] == "wedged", tried
    roots = [line for line in result.diagnosis if line.startswith("root: ")]
    assert any("arrived after they were scattered" in line for line in roots), result.diagnosis
    replayed = replay_sim(read_trace(out))
    assert replayed.divergence is None and replayed.same_outcome
    assert any("arrived after they were scattered" in line for line in replayed.diagnosis)


def test_a_lost_control_frame_is_named_on_its_root_by_the_run_and_both_replays(
        tmp_path: Path) -> None:
    """The faults that dropped room 1's STAGING_RSPs are named on the wedge's root: by the
    hardware run, by its replay on real ranks (which injects nothing and reads the faults from
    the trace) and by its replay in simulation."""
    from twin.replay import replay_sim

    sc = SCENARIOS["lost-staging-rsp"]
    options = _options()
    options.wedge_window_s = 6.0
    out = tmp_path / "lost.jsonl.gz"
    result = run_hw(sc.config, sc.workload(), faults=list(sc.faults), params=sc.params,
                    options=options, trace_out=str(out))
    assert result.summary()["status"] == "wedged", result.summary()
    fault = "drop:STAGING_RSP:dst=p0g0r0:room=1:chunk=0:nth=1"
    trace = read_trace(out)
    for diagnosis in (result.diagnosis, replay_hw(trace, options).diagnosis,
                      replay_sim(trace).diagnosis):
        roots = [line for line in diagnosis if line.startswith("root: ")]
        assert roots and all(f"injected fault on this path: {fault}" in r for r in roots), \
            diagnosis


def test_an_injected_transfer_failure_fails_its_request_only() -> None:
    """``fail-transfer:nth=1`` on hardware: the first WRITE of one prefill rank ends in error,
    its request fails on every side (status failed, exit 5), and every other request completes
    byte-verified."""
    cfg = TwinConfig(model=TINY, chunked_prefill_size=64, prefill=ServerSide(tp_size=2),
                     decode=ServerSide(tp_size=1))
    work = fixed([(0.05 * i, 160, 4, 0) for i in range(4)])
    cfg = cfg.replace(fixes=LATE_REQ_FIX)
    result = run_hw(cfg, work, faults=["fail-transfer:node=p0g0r1:nth=1"], options=_options())
    s = result.summary()
    assert (s["failed"], s["completed"], s["verified"]) == (1, 3, 3), s
    assert s["status"] == "failed" and result.exit_code == 5, s
    assert s["fault_report"] == [{"fault": "fail-transfer:node=p0g0r1:nth=1", "fired": 1}]
    assert s["failures"] == {"prefill p0g0r1 failed": 1}


def test_queued_requests_and_deferral_timers_do_not_spin_the_processes() -> None:
    """Sixteen long requests arrive at once with one slot: fifteen wait for it all run long, and
    the decode ring (1 MiB against 384 KiB chunks) defers WRITEs on millisecond timers.
    The coordinator waits on its ranks' messages instead of spinning on the waiting request's
    long-past arrival time (it took a whole core of this 2-core host from the ranks, halving
    their speed), so it uses a fraction of the run's time on the CPU."""
    cfg = TwinConfig(model=TINY, chunked_prefill_size=384, prefill=ServerSide(tp_size=2),
                     decode=ServerSide(tp_size=1), staging_pool_size_bytes=1 << 20,
                     fixes=LATE_REQ_FIX)
    result = run_hw(cfg, fixed([(0.0, 12_000, 4, 0)] * 16), max_concurrency=1,
                    options=_options())
    s = result.summary()
    assert (s["completed"], s["verified"]) == (16, 16), s
    assert result.run_seconds > 1.0, result.run_seconds  # long enough for a spin to show
    assert result.coordinator_cpu_s < 0.5 * result.run_seconds, (
        result.coordinator_cpu_s, result.run_seconds)


def test_a_corrupt_fault_rewrites_real_frames_and_pr39792_drops_them() -> None:
    """The ``corrupt`` fault on real ranks: p0g0r0's first STAGING_REQ leaves the socket with
    chunk_idx 100000; decode allocates for the phantom chunk, which holds room 0 (a wedge whose
    root names that chunk). With ``bound-staging-req-chunk`` (PR #39792) decode drops it."""
    from twin.core.fixes import BOUND_STAGING_REQ_CHUNK

    sc = SCENARIOS["malformed-chunk-idx"]
    result = run_hw(sc.config, sc.workload(), faults=list(sc.faults), params=sc.params,
                    options=_options())
    assert result.summary()["status"] == "wedged", result.summary()
    roots = [line for line in result.diagnosis if line.startswith("root: ")]
    assert any("room 0 chunks 100000 never got their CHUNK_READY" in r for r in roots), roots
    fixed_run = run_hw(sc.config.replace(fixes=(BOUND_STAGING_REQ_CHUNK,)), sc.workload(),
                       faults=list(sc.faults), params=sc.params, options=_options())
    assert fixed_run.summary()["status"] == "completed", fixed_run.summary()
