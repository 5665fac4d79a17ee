"""The host-memory check before ranks start: pools, buffers and rings plus each rank process's
own footprint must fit in 90% of the memory available, or the run is refused with the knobs."""

from __future__ import annotations

import pytest

from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.hw.hostmem import RANK_OVERHEAD_BYTES, fits, host_need
from twin.hw.launcher import HwOptions, PoolError, plan_pool
from twin.runtime.params import SimParams
from twin.workloads import fixed

MODEL = ModelShape(num_layers=4, num_kv_heads=8, head_dim=64, dtype_bytes=2)
CFG = TwinConfig(model=MODEL, chunked_prefill_size=256, prefill=ServerSide(tp_size=2),
                 decode=ServerSide(tp_size=1), staging_pool_size_bytes=64 << 20)
WORK = fixed([(0.0, 4096, 4, 0)] * 4)


def test_need_counts_each_rank_process() -> None:
    assert host_need([1 << 30, 2 << 30]) == (3 << 30) + 2 * RANK_OVERHEAD_BYTES
    assert fits(100, None) and fits(90, 100) and not fits(91, 100)


def _plan(monkeypatch: pytest.MonkeyPatch, available: int):  # type: ignore[no-untyped-def]
    monkeypatch.setattr("twin.hw.launcher.available_host_bytes", lambda: available)
    return plan_pool(CFG, WORK, SimParams(), {}, HwOptions(), None, 4)


def test_ranks_that_fit_only_without_their_process_overhead_are_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan(monkeypatch, 1 << 50)
    buffers = sum(plan.bytes_per_rank.values())
    need = host_need(plan.bytes_per_rank.values())
    assert need == buffers + 3 * RANK_OVERHEAD_BYTES  # two prefill ranks and one decode rank
    # Enough for the buffers alone (with the 10% margin), not with the processes:
    with pytest.raises(PoolError, match=r"per rank process.*lower --max-concurrency"):
        _plan(monkeypatch, int(buffers / 0.9) + 1)
    assert _plan(monkeypatch, int(need / 0.9) + 1).pages == plan.pages
