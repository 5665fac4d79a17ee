"""How far the simulator's timings are from a trace's: the same run, simulated afresh.

For a trace recorded on hardware, the run (config, workload, defects, faults, placement) is
simulated with the cost model in the trace's ``[sim]`` table, and each room's measured phases
are compared with the simulated ones: time to all KV landed (arrival to the last decode
``RoomConcluded``) and transfer span (first ``StartTransfer`` to last ``TransferDone``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from twin.core.defects import Defects
from twin.runtime.faults import parse_fault
from twin.runtime.params import SimParams
from twin.trace.format import Trace, TraceReader, TraceSource, open_trace
from twin.workloads import Workload, WorkloadError


def room_phases(trace: Trace | TraceReader) -> dict[int, dict[str, float]]:
    """Per room: ``kv_done_s`` (from arrival) and ``transfer_s`` of a trace (read once)."""
    out: dict[int, dict[str, float]] = {}
    arrival: dict[int, float] = {}
    first: dict[int, float] = {}
    last_xfer: dict[int, float] = {}
    worker_room: dict[tuple[str, int], int] = {}
    for rec in trace:
        if rec.type == "RequestArrived":
            arrival[rec.data["room"]] = rec.t
        elif rec.type == "StartTransfer":
            e = rec.event
            first.setdefault(e.room, rec.t)
            worker_room[(rec.node, e.worker)] = e.room
        elif rec.type == "TransferDone":
            room = worker_room.get((rec.node, rec.event.worker))
            if room is not None:
                last_xfer[room] = rec.t
        elif rec.type == "RoomConcluded" and rec.node.startswith("d") and \
                rec.event.status == "Success" and rec.event.room in arrival:
            room = rec.event.room
            d = out.setdefault(room, {})
            d["kv_done_s"] = max(d.get("kv_done_s", 0.0), rec.t - arrival[room])
    for room, d in out.items():
        if room in first and room in last_xfer:
            d["transfer_s"] = last_xfer[room] - first[room]
    return out


def compare_with_simulation(source: TraceSource,
                            params: SimParams | None = None) -> dict[str, Any]:
    """Simulate the trace's run afresh and compare per-room timings (ratios sim / trace);
    ``params`` replaces the trace's own ``[sim]`` costs. A path is streamed."""
    from twin.sim.runner import run_sim

    trace = open_trace(source)
    header = trace.header
    try:
        workload = Workload.from_jsonable(header.get("workload", {}))
    except WorkloadError as exc:
        return {"error": f"the trace does not carry its workload: {exc}"}
    extra = trace.config.extra
    if params is None:
        params = SimParams.from_dict(extra.get("sim", {}), f"{trace.path} header")
    run = extra.get("run", {})
    overrides = {int(k): v for k, v in run.get("request_overrides", {}).items()}
    result = run_sim(trace.config, workload, defects=Defects.of(header.get("defects", [])),
                     faults=[parse_fault(f) for f in header.get("faults", [])],
                     seed=header.get("seed") or 0, params=params, request_overrides=overrides,
                     max_concurrency=run.get("max_concurrency"))
    simulated = {r.room: {"kv_done_s": r.kv_done_s - r.arrival_s,
                          "transfer_s": r.last_transfer_s - r.first_transfer_s}
                 for r in result.sim.metrics.done if r.status == "Success"}
    measured = room_phases(trace)
    report: dict[str, Any] = {"rooms_compared": 0, "simulated_status": result.status}
    for phase in ("kv_done_s", "transfer_s"):
        pairs = [(measured[r][phase], simulated[r][phase]) for r in measured
                 if r in simulated and phase in measured[r] and measured[r][phase] > 0]
        if not pairs:
            continue
        m = np.array([p[0] for p in pairs])
        s = np.array([p[1] for p in pairs])
        ratio = s / m
        report["rooms_compared"] = max(report["rooms_compared"], len(pairs))
        report[phase] = {
            "measured_p50": round(float(np.median(m)), 6),
            "simulated_p50": round(float(np.median(s)), 6),
            "ratio_p50": round(float(np.median(ratio)), 4),
            "ratio_p10": round(float(np.percentile(ratio, 10)), 4),
            "ratio_p90": round(float(np.percentile(ratio, 90)), 4),
        }
    return report
