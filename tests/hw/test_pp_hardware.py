"""A pipeline-parallel prefill on real rank processes (Mooncake; SGLang stages PP only there).

Each PP stage's prefill rank process holds its own layers' KV pool, gathers them and writes its
layer slots of the staged chunk; each decode rank scatters every layer and checks every byte.
The data mover is the Mooncake transfer engine where it loads (NIXL's UCX otherwise, as
``twin hw`` does and says), and NIXL when ``TWIN_HW_TRANSPORT=nixl`` forces it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from twin.cli import cli
from twin.core import wire
from twin.core.config import ModelShape, ServerSide, TwinConfig, pp_layer_range
from twin.core.defects import Defects
from twin.core.topology import Topology
from twin.hw.launcher import HwOptions
from twin.hw.mooncake_transport import choose_transport
from twin.hw.replay import replay_hw
from twin.hw.run import run_hw
from twin.replay import replay_sim
from twin.runtime.params import SimParams
from twin.sim.runner import run_sim
from twin.sim.scenarios import SCENARIOS
from twin.trace.format import read_trace
from twin.workloads import fixed

pytestmark = pytest.mark.hw

# Three layers over two stages: stage 0 holds layer 0, stage 1 layers 1-2 (SGLang's split).
MODEL = ModelShape(num_layers=3, num_kv_heads=4, head_dim=32, dtype_bytes=2)
LATE_REQ_FIX = ("drop-late-staging-req",)  # see tests/hw/test_hw_mode.py


def _cfg(decode_tp: int = 1, **kw) -> TwinConfig:  # type: ignore[no-untyped-def]
    return TwinConfig(prefill=ServerSide(tp_size=2, pp_size=2),
                      decode=ServerSide(tp_size=decode_tp), model=MODEL,
                      chunked_prefill_size=64, page_size=16, staging_pool_size_mb=2,
                      fixes=LATE_REQ_FIX, **kw)


def _options() -> HwOptions:
    return HwOptions(wedge_window_s=15.0, timeout_s=240.0, kv_pool_pages=256)


def _workload():  # type: ignore[no-untyped-def]
    # several chunks each, a partial last page, one request of exactly one chunk
    return fixed([(0.02 * i, (64, 200, 130, 333, 96, 250)[i], 4, 0) for i in range(6)])


def test_pp2_prefill_on_real_ranks_is_byte_verified_and_replays_in_simulation(
        tmp_path: Path) -> None:
    cfg = _cfg()
    assert cfg.disaggregation_transfer_backend == "mooncake"
    out = tmp_path / "pp2.jsonl"
    result = run_hw(cfg, _workload(), params=SimParams(prefill_radix_tokens=0),
                    options=_options(), trace_out=str(out), max_concurrency=3)
    s = result.summary()
    assert s["status"] == "completed", s
    assert (s["completed"], s["verified"], s["corruption"]) == (6, 6, []), s
    trace = read_trace(out)
    stages = {"p0g0s0r0", "p0g0s0r1", "p0g0s1r0", "p0g0s1r1"}
    assert stages <= set(trace.nodes)
    # Both stages wrote every chunk, each its own layers' share of its TP writer's block.
    writes = [(r.node, r.event) for r in trace.events
              if r.dir == "out" and r.type == "StartTransfer"]
    slot = {n: pp_layer_range(3, int(n[5]), 2) for n in stages}
    by_stage = {n: [e for m, e in writes if m == n] for n in stages}
    assert all(by_stage.values()), {n: len(v) for n, v in by_stage.items()}
    for node, events in by_stage.items():
        first, stop = slot[node]
        for e in events:
            per_layer = e.nbytes // (2 * (stop - first))  # one layer's K of this chunk
            block = 2 * MODEL.num_layers * per_layer  # the TP writer's block, every layer
            assert e.nbytes == per_layer * 2 * (stop - first)
            assert e.dst_offset - e.region_offset == e.writer * block + 2 * first * per_layer
    # A chunk is ready on decode only after every writer of every stage said so.
    ready = [r.event.msg for r in trace.events if r.dir == "in" and r.node == "d0g0r0"
             and r.type == "MessageArrived" and isinstance(r.event.msg, wire.ChunkReady)]
    assert len(ready) == 4 * len(by_stage["p0g0s0r0"])  # 2 TP writers x 2 stages a chunk
    assert {m.prefill_rank for m in ready} == {n.unique_rank for n in
                                               Topology(cfg).prefill_groups[0].nodes}
    replay = replay_sim(trace)
    assert replay.divergence is None and replay.same_outcome
    assert replay.status == "completed"


def test_pp2_with_an_upstream_defect_corrupts_real_bytes() -> None:
    """radix-grid's no-grid-alignment defect with a PP2 prefill: the byte check, which now
    compares layers written by two different processes, finds the wrong bytes (exit 4)."""
    sc = SCENARIOS["radix-grid"]
    cfg = sc.config.replace(prefill=ServerSide(tp_size=2, pp_size=2),
                            decode=ServerSide(tp_size=1), fixes=LATE_REQ_FIX)
    result = run_hw(cfg, sc.workload(), defects=Defects.of(sc.defects), params=sc.params,
                    options=_options(), request_overrides=sc.overrides)
    s = result.summary()
    assert s["status"] == "corrupted" and result.exit_code == 4, s
    first = s["corruption"][0]
    assert "room" in first and "layer" in first and "token" in first, first


def test_a_pp2_simulator_trace_replays_on_real_ranks(tmp_path: Path) -> None:
    """``twin replay --mode hw`` of a PP2 simulation (decode TP4: each prefill rank writes
    two decode ranks): the recorded inputs drive real ranks, every byte is checked, and the
    outcome is the recorded one."""
    cfg = _cfg(decode_tp=4)
    out = tmp_path / "sim.jsonl"
    sim = run_sim(cfg, _workload(), params=SimParams(prefill_radix_tokens=0),
                  trace_out=str(out))
    assert sim.summary()["status"] == "completed"
    trace = read_trace(out)
    result = replay_hw(trace, _options())
    assert result.divergence is None, result.divergence
    assert result.status == "completed" and result.same_outcome
    assert result.corruption == []


def test_pp2_bytes_move_over_nixl_when_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TWIN_HW_TRANSPORT=nixl`` (what a host without the Mooncake engine runs): the stages'
    layer slots go as multi-descriptor NIXL WRITEs and land byte for byte."""
    monkeypatch.setenv("TWIN_HW_TRANSPORT", "nixl")
    assert choose_transport("mooncake")[0] == "nixl"
    result = run_hw(_cfg(), _workload(), params=SimParams(prefill_radix_tokens=0),
                    options=_options(), max_concurrency=3)
    s = result.summary()
    assert s["status"] == "completed", s
    assert (s["completed"], s["verified"]) == (6, 6), s


def test_twin_hw_pp2_on_nixl_is_rejected_with_sglangs_reason() -> None:
    r = CliRunner().invoke(cli, [
        "hw", "--prefill-args", "--tp-size 2 --pp-size 2 --disaggregation-transfer-backend nixl",
        "--decode-args", "--tp-size 1 --disaggregation-transfer-backend nixl",
        "--workload", "poisson:n=2,rate=5,input=128,output=4"])
    assert r.exit_code == 2, r.output
    assert "pp_size > 1 is only supported by Mooncake" in r.output
    assert "Traceback" not in r.output

