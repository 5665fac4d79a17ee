"""The serving loop around the transfer: the decode loop (continuous batching, scatter polling
at iteration boundaries, KV admission, retraction) and the prefill KV pool."""

from __future__ import annotations

from typing import Any

import pytest

from twin.core import events as ev
from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.runtime.params import SimParams
from twin.sim.engine import Simulation
from twin.sim.runner import run_sim
from twin.workloads import fixed, poisson

SMALL = ModelShape(num_layers=4, num_kv_heads=8, head_dim=64, dtype_bytes=2)
QUIET = SimParams(zmq_jitter_s=0.0, prefill_radix_tokens=0)


def _cfg(decode: dict[str, Any] | None = None, prefill: dict[str, Any] | None = None,
         **kw: Any) -> TwinConfig:
    serving = {"decode": decode or {}, "prefill": prefill or {}}
    base: dict[str, Any] = dict(model=SMALL, prefill=ServerSide(tp_size=4),
                                decode=ServerSide(tp_size=2), chunked_prefill_size=256,
                                staging_pool_size_mb=64, extra={"serving": serving})
    base.update(kw)
    return TwinConfig(**base)


class Inputs:
    """A recorder keeping when each core input was fed, by type."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}

    def write_input(self, t: float, node: str, event: Any) -> None:
        self.times.setdefault(type(event).__name__, []).append(t)

    def write_effects(self, t: float, node: str, effects: list[Any]) -> None:
        pass

    def write_sys(self, t: float, node: str, record: dict[str, Any]) -> None:
        pass


def test_one_request_decodes_its_output_at_the_step_time() -> None:
    """TPOT is the decode step time of a batch of one, from the cost model."""
    p = QUIET
    r = run_sim(_cfg(), fixed([(0.0, 1000, 50, 0)]), params=p)
    q = r.sim.metrics.done[0]
    assert q.status == "Success" and q.first_token_s >= q.kv_done_s
    step = p.decode_step_s + p.decode_s_per_seq
    ctx_mean = 1000 + 24  # context grows by one token per step: 1000..1048 over 49 steps
    expected = step + ctx_mean * p.decode_s_per_ctx_token
    assert q.tpot_s == pytest.approx(expected, rel=1e-6)
    assert q.e2e_s == pytest.approx(q.ttft_s + 49 * q.tpot_s, rel=1e-9)
    s = r.summary()
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        assert set(s["latency"][key]) == {"p50", "p90", "p99", "mean"}
    assert s["serving"]["decode"]["steps"] == 49


def test_decode_runs_per_batch_step_not_per_token() -> None:
    """Concurrent requests share decode steps: steps run far fewer than tokens decoded, and
    the batch grows past one."""
    wl = poisson(40, float("inf"), 512, 200, seed=1)
    r = run_sim(_cfg(), wl, params=QUIET)
    s = r.summary()
    assert s["completed"] == 40
    tokens = sum(q.output_len - 1 for q in r.sim.metrics.done)
    steps = s["serving"]["decode"]["steps"]
    assert steps < tokens / 10
    assert s["decode"]["0"]["peak_batch"] > 10
    # Larger batches decode slower per step (batch and context terms).
    assert s["latency"]["tpot_s"]["p50"] > QUIET.decode_step_s + QUIET.decode_s_per_seq


def test_scatter_completions_are_seen_at_loop_iterations() -> None:
    """ScatterDone is fed only when the decode loop polls: at an iteration boundary (a
    decode step's end while a batch runs, the idle grid otherwise)."""
    log = Inputs()
    wl = poisson(30, 50.0, 2048, 64, seed=2)
    sim = Simulation(_cfg(), wl, params=QUIET, recorder=log)
    sim.decode_loops[0].iterations = []
    assert sim.run() == "all requests ended"
    iterations = set(sim.decode_loops[0].iterations)
    assert set(log.times["ScatterDone"]) <= iterations


def test_runs_of_steps_equal_single_steps(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """The loop schedules a run of decode steps as one callback when nothing it polls can
    change in between; the trace is byte-identical to scheduling every step."""
    from twin.sim import decode_loop

    wl = poisson(40, 30.0, (2048.0, 900.0), (120.0, 60.0), seed=12)
    cfg = _cfg(decode={"max_total_tokens": 40000, "num_reserved_decode_tokens": 64})
    many, one = tmp_path / "many.jsonl", tmp_path / "one.jsonl"
    run_sim(cfg, wl, params=SimParams(), seed=1, trace_out=many)
    monkeypatch.setattr(decode_loop, "MAX_RUN", 1)
    run_sim(cfg, wl, params=SimParams(), seed=1, trace_out=one)
    assert many.read_bytes() == one.read_bytes()


def test_decode_admission_waits_for_kv_pages() -> None:
    """A small decode pool: requests queue for pre-allocation and the pool is never overrun."""
    cap = 6000
    wl = poisson(24, float("inf"), 1024, 32, seed=3)
    r = run_sim(_cfg(decode={"max_total_tokens": cap, "num_reserved_decode_tokens": 64}), wl,
                params=QUIET)
    s = r.summary()
    assert s["completed"] == 24 and s["serving"]["decode"]["max_total_tokens"] == cap
    d = s["decode"]["0"]
    assert d["peak_queued"] > 0 and d["peak_kv_tokens"] <= cap


def test_max_running_requests_caps_the_decode_batch() -> None:
    wl = poisson(30, float("inf"), 256, 100, seed=4)
    r = run_sim(_cfg(decode={"max_running_requests": 5}), wl, params=QUIET)
    assert r.summary()["completed"] == 30
    assert r.summary()["decode"]["0"]["peak_batch"] <= 5


def test_retraction_pauses_polling_and_every_request_still_finishes() -> None:
    """Long outputs outgrow a small pool: the newest requests are retracted, and while any is
    retracted the loop polls no scatter event (so frees no staging)."""
    log = Inputs()
    wl = poisson(16, float("inf"), 512, 600, seed=5)
    cfg = _cfg(decode={"max_total_tokens": 9000, "num_reserved_decode_tokens": 0})
    r = run_sim(cfg, wl, params=QUIET, recorder=log)
    s = r.summary()
    assert s["completed"] == 16 and s["status"] == "completed"
    assert s["serving"]["decode"]["retractions"] > 0
    assert any(q.retractions for q in r.sim.metrics.done)
    series = r.sim.decode_loops[0].series
    retracted_at = {t for t, n in zip(series.t, series.retracted, strict=True) if n > 0}
    assert retracted_at
    assert not retracted_at & set(log.times.get("ScatterDone", []))
    # Every request produced all its tokens: e2e covers output_len - 1 steps after the first.
    for q in r.sim.metrics.done:
        assert q.end_s > q.first_token_s > 0


def test_prefill_pool_backs_up_behind_a_slow_ring() -> None:
    """Prefill holds each request's KV until its transfer is done: with a tiny ring the
    transfers take longer, the prefill pool stays full longer and admission waits."""
    wl = poisson(40, 200.0, 2048, 8, seed=6)
    prefill = {"max_total_tokens": 8200}
    quick = QUIET.replace(forward_overhead_s=2e-4, prefill_s_per_token=1e-6)  # ring-bound
    fast = run_sim(_cfg(prefill=prefill), wl, params=quick)
    slow = run_sim(_cfg(prefill=prefill, staging_pool_size_bytes=1 << 20), wl, params=quick)
    for r in (fast, slow):
        s = r.summary()
        assert s["completed"] == 40
        assert s["serving"]["prefill"]["peak_kv_tokens"] <= 8200
    fs, ss = fast.summary(), slow.summary()
    assert ss["serving"]["prefill"]["blocked_s"] > fs["serving"]["prefill"]["blocked_s"]
    assert ss["latency"]["ttft_s"]["p90"] > fs["latency"]["ttft_s"]["p90"]


def test_prefill_max_running_requests_limits_admission() -> None:
    wl = poisson(20, float("inf"), 512, 4, seed=7)
    r = run_sim(_cfg(prefill={"max_running_requests": 2}), wl, params=QUIET)
    assert r.summary()["completed"] == 20
    assert max(n for _, _, n in r.sim.schedulers[0].series) <= 2


def test_an_aborted_request_waiting_for_kv_pages_fails_cleanly() -> None:
    from twin.runtime.faults import parse_fault

    wl = poisson(6, float("inf"), 4096, 400, seed=8)
    cfg = _cfg(decode={"max_total_tokens": 5000, "num_reserved_decode_tokens": 0})
    r = run_sim(cfg, wl, params=QUIET, faults=[parse_fault("abort:room=5:at=0.01")])
    s = r.summary()
    assert s["status"] == "failed" and s["failed"] == 1 and s["completed"] == 5
    assert [q.room for q in r.sim.metrics.done if q.status == "Failed"] == [5]


def test_same_seed_same_trace_with_a_named_model(tmp_path: Any) -> None:
    from twin.models.costs import configure

    cfg = configure(TwinConfig(), "Llama-3.1-8B", "H200")
    wl = poisson(30, 20.0, (2048.0, 800.0), (64.0, 30.0), seed=9)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    run_sim(cfg, wl, seed=4, trace_out=a)
    run_sim(cfg, wl, seed=4, trace_out=b)
    assert a.read_bytes() == b.read_bytes()
    head = a.read_text().splitlines()[0]
    assert "aiconfigurator-core" in head and "\"model\":\"Llama-3.1-8B\"" in head


def test_scatter_done_event_type_is_unchanged() -> None:
    """The loop feeds the core's own ScatterDone (no new input type in traces)."""
    assert ev.ScatterDone in ev.INPUT_TYPES


def test_a_run_stopped_while_requests_decode_replays_to_the_same_outcome(tmp_path: Any) -> None:
    """``completed`` counts transfers that completed (what a replay recounts), even when the
    request is still decoding at ``--until``."""
    from twin.replay import replay_sim
    from twin.trace.format import read_trace

    path = tmp_path / "until.jsonl"
    r = run_sim(_cfg(), poisson(40, 40.0, 1024, 400, seed=13), params=QUIET, until=0.6,
                trace_out=path)
    s = r.summary()
    assert s["status"] == "until" and s["decoding"] > 0
    assert s["completed"] + s["failed"] + s["unfinished"] == s["requests"]
    assert replay_sim(read_trace(path)).same_outcome
