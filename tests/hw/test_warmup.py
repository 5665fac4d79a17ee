"""Every rank warms its control connections and transfer paths before the run's first request
(``twin/hw/warmup.py``), as a long-lived SGLang server's are warm; the trace header says so and
how long it took, and nothing of it is recorded: no room, no request, no transfer."""

from __future__ import annotations

from pathlib import Path

import pytest

from twin.calibrate import measure
from twin.calibrate.check import request_phases
from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.hw.launcher import HwOptions
from twin.hw.mooncake_transport import engine_available
from twin.hw.run import run_hw
from twin.runtime.params import SimParams
from twin.trace.format import read_trace
from twin.workloads import fixed

pytestmark = pytest.mark.hw

TINY = ModelShape(num_layers=2, num_kv_heads=4, head_dim=32, dtype_bytes=2)
WORKERS = 4  # transfer_queue_size: a prefill rank's transfer workers


@pytest.mark.parametrize("backend,prefill_tp,decode_tp", [
    ("nixl", 2, 1),
    pytest.param("mooncake", 2, 1, marks=pytest.mark.skipif(
        engine_available() is not None, reason=str(engine_available()))),
    ("nixl", 1, 1),  # equal attention TP: direct page writes, from the KV pool
], ids=["nixl-staged", "mooncake-staged", "nixl-direct"])
def test_ranks_warm_up_before_the_first_request_and_record_nothing(
        tmp_path: Path, backend: str, prefill_tp: int, decode_tp: int) -> None:
    cfg = TwinConfig(prefill=ServerSide(tp_size=prefill_tp), decode=ServerSide(tp_size=decode_tp),
                     model=TINY, chunked_prefill_size=256, page_size=16, staging_pool_size_mb=2,
                     disaggregation_transfer_backend=backend,
                     fixes=("drop-late-staging-req",))
    workload = fixed([(0.01 * i, 600, 1, 0) for i in range(6)])
    out = tmp_path / "hw.jsonl.gz"
    result = run_hw(cfg, workload, params=SimParams(prefill_radix_tokens=0), trace_out=str(out),
                    options=HwOptions(wedge_window_s=15.0, timeout_s=120.0))
    s = result.summary()
    assert (s["status"], s["completed"], s["verified"]) == ("completed", 6, 6), s

    trace = read_trace(out)
    # The header, written once every rank was ready and before the run's clock started,
    # records each rank's finished warm-up: it ran before the first request.
    warm = trace.config.extra["run"]["warmup"]
    assert warm["ran"] is True and warm["seconds"] > 0
    assert all(r["seconds"] > 0 and r["short_slice_threads"] >= 0
               for r in warm["ranks"].values())
    # and what the coordinator asked of the kernel for its forward timers (twin.hw.pacing)
    assert set(trace.config.extra["run"]["pacing"]) == {"slice_s", "timer_slack_ns"}
    prefill = [n for n in trace.nodes if n.startswith("p")]
    decode = [n for n in trace.nodes if n.startswith("d")]
    assert sorted(warm["ranks"]) == sorted(trace.nodes)
    for node in prefill:  # prefetch and manager sockets (manager only without staging)
        rank = warm["ranks"][node]
        assert rank["writes"] == WORKERS * len(decode), rank
        assert rank["sockets"] == (2 if cfg.stages else 1) * len(decode), rank
        assert rank["slowest_write_s"] > 0
    for node in decode:  # its receiver socket to every prefill rank; it writes nothing
        rank = warm["ranks"][node]
        assert (rank["writes"], rank["sockets"]) == (0, len(prefill)), rank

    # Nothing of it is in the records: the first one is the first request's arrival, every
    # room is a request's, every WRITE a chunk of one.
    assert trace.events[0].type == "RequestArrived" and trace.events[0].data["room"] == 0
    rooms = {r.data["room"] for r in trace.events if r.type == "RequestArrived"}
    assert rooms == set(range(6))
    touched = {r.event.room for r in trace.events
               if r.dir in ("in", "out") and hasattr(r.event, "room")}
    assert touched == rooms
    starts = [r for r in trace.events if r.dir == "out" and r.type == "StartTransfer"]
    dones = [r for r in trace.events if r.dir == "in" and r.type == "TransferDone"]
    assert len(starts) == len(dones) == len(measure(trace).transfers) + len(
        measure(trace).direct)
    assert sorted(request_phases(trace)) == sorted(str(i) for i in range(6))
