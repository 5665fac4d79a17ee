"""Rank processes forked from a preloaded server: each run's ranks see that run's environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.hw.launcher import HwOptions
from twin.hw.procs import forking, rank_context
from twin.hw.run import run_hw
from twin.runtime.params import SimParams
from twin.workloads import fixed

pytestmark = pytest.mark.hw

TINY = ModelShape(num_layers=2, num_kv_heads=4, head_dim=32, dtype_bytes=2)


@pytest.mark.skipif(not forking(), reason="ranks are forked on Linux only")
def test_two_runs_share_one_forkserver_and_each_logs_to_its_own_folder(tmp_path: Path) -> None:
    """The server is made once per process; what the launcher sets in the environment just
    before starting a run's ranks (here: where they log) reaches that run's ranks, not the
    environment the server was started with (the first run's)."""
    cfg = TwinConfig(prefill=ServerSide(tp_size=1), decode=ServerSide(tp_size=1), model=TINY,
                     chunked_prefill_size=64, page_size=16, staging_pool_size_mb=1)
    assert rank_context().get_start_method() == "forkserver"
    nodes = None
    for i in range(2):
        logs = tmp_path / f"logs{i}"
        result = run_hw(cfg, fixed([(0.0, 100, 2, 0), (0.01, 130, 2, 0)]),
                        params=SimParams(prefill_radix_tokens=0),
                        options=HwOptions(kv_pool_pages=64, log_dir=str(logs)))
        s = result.summary()
        assert (s["status"], s["verified"]) == ("completed", 2), s
        written = sorted(p.name for p in logs.glob("*.log"))
        nodes = nodes or written
        assert written == nodes and len(written) == 2, written
