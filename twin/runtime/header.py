"""The trace header of a run: everything needed to run it again, the same in every mode."""

from __future__ import annotations

from typing import Any

from twin.core.config import TwinConfig
from twin.core.defects import Defects
from twin.core.topology import Topology
from twin.runtime.faults import FaultSpec
from twin.runtime.params import SimParams
from twin.trace.format import make_header
from twin.workloads import Workload

INLINE_WORKLOAD_MAX = 50_000
"""Workloads up to this many requests are stored in the header; larger ones by digest only."""


def trace_header(cfg: TwinConfig, workload: Workload, *, defects: Defects, faults: list[FaultSpec],
                 seed: int, params: SimParams, request_overrides: dict[int, dict[str, int]],
                 max_concurrency: int | None, mode: str = "sim") -> dict[str, Any]:
    """The trace header of a run: everything needed to run it again."""
    run = {"max_concurrency": max_concurrency,
           "request_overrides": {str(k): v for k, v in sorted(request_overrides.items())}}
    full = cfg.replace(extra={**cfg.extra, "sim": params.to_dict(), "run": run})
    nodes = [{"id": n.id, "role": n.role, "instance": n.instance, "dp": n.dp, "rank": n.rank}
             for n in Topology(cfg).nodes.values()]
    small = len(workload.requests) <= INLINE_WORKLOAD_MAX
    wl = workload.to_jsonable(include_requests=small)
    return make_header(mode, full, nodes, defects=defects.sorted(),
                       faults=[f.text for f in faults], seed=seed, workload=wl)
