"""A recorded run's phases, and the same run simulated afresh: what ``twin calibrate`` fits
and ``twin replay`` compares (``twin.replay.timing``)."""

from __future__ import annotations

from typing import Any

from twin.core.defects import Defects
from twin.runtime.faults import parse_fault
from twin.runtime.params import SimParams
from twin.trace.format import Trace, TraceReader
from twin.workloads import Workload


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


def simulate_recorded(trace: Trace | TraceReader, params: SimParams, seed: int,
                      recorder: Any = None) -> Any:
    """Simulate ``trace``'s run afresh (its config, workload, defects, faults, placement and
    client model) with ``params`` and ``seed``; the ``SimResult``. Raises ``WorkloadError``
    when the trace does not carry its workload."""
    from twin.sim.runner import run_sim

    header = trace.header
    workload = Workload.from_jsonable(header.get("workload", {}))
    run = trace.config.extra.get("run", {})
    overrides = {int(k): v for k, v in run.get("request_overrides", {}).items()}
    return run_sim(trace.config, workload, defects=Defects.of(header.get("defects", [])),
                   faults=[parse_fault(f) for f in header.get("faults", [])], seed=seed,
                   params=params, request_overrides=overrides,
                   max_concurrency=run.get("max_concurrency"), recorder=recorder)
