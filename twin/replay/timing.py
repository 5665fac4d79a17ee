"""How far the simulator's timings are from a trace's: the same run, simulated afresh.

For a trace recorded on hardware, the run (config, workload, defects, faults, placement) is
simulated with the cost model in the trace's ``[sim]`` table, and each room's measured phases
are compared with the simulated ones: time to all KV landed (arrival to the last decode
``RoomConcluded``) and transfer span (first ``StartTransfer`` to last ``TransferDone``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from twin.calibrate import Measured, measure, scatter_cost_per_byte
from twin.calibrate.host import host_check, trace_host
from twin.calibrate.phases import room_phases, simulate_recorded
from twin.runtime.params import SimParams
from twin.trace.format import Trace, TraceSource, open_trace, read_trace
from twin.workloads import WorkloadError

SEEDS = 3
"""Fresh simulations per comparison: the cost model's jitter is random, so one seed is one
sample (a race the jitter opens can end one seed's run in a wedge)."""


def compare_with_simulation(source: TraceSource, params: SimParams | None = None,
                            seeds: int = SEEDS, costs_host: Mapping[str, Any] | None = None
                            ) -> dict[str, Any]:
    """Simulate the trace's run afresh ``seeds`` times (from the trace's seed on) and compare
    per-room timings (ratios sim / trace, pooled over the runs' successful rooms); ``params``
    replaces the trace's own ``[sim]`` costs. The report says how each run ended, and names
    the root of a simulated wedge the recorded run did not have. A path is streamed.

    Costs from ``twin calibrate`` (``blocking_kernels``) are also checked against the trace's
    host (``host``: ``twin.calibrate.host.host_check``, with ``costs_host`` the host line of
    their file, ``costs_host()``): a note says when they were fitted elsewhere, or where
    either host is unrecorded, and the comparison is then no calibration check."""
    trace = open_trace(source)
    header = trace.header
    extra = trace.config.extra
    checked_host = None
    if params is None:
        params = SimParams.from_dict(extra.get("sim", {}), f"{trace.path} header")
    elif params.blocking_kernels or costs_host is not None:
        checked_host = host_check(trace_host(trace), costs_host)
    first = header.get("seed") or 0
    runs = []
    try:
        for seed in range(first, first + seeds):
            runs.append(simulate_recorded(trace, params, seed))
    except WorkloadError as exc:
        return {"error": f"the trace does not carry its workload: {exc}"}
    speed = None
    if params.blocking_kernels:  # calibrated costs: compare the host's speed too
        m = measure(trace if isinstance(trace, Trace) else read_trace(trace.path))
        measured, speed = m.phases, host_speed(m, params)
    else:
        measured = room_phases(trace)
    recorded = getattr(trace, "outcome", None) or {}
    statuses = [r.status for r in runs]
    report: dict[str, Any] = {
        "rooms_compared": 0, "runs": len(runs),
        "simulated_status": _tally(statuses), "simulated_statuses": statuses,
        "recorded_status": recorded.get("status", "incomplete")}
    if checked_host is not None:
        report["host"] = checked_host
    if speed is not None:
        report["host_speed"] = speed
    differing = [r for r in runs if r.status != report["recorded_status"]]
    if differing and report["recorded_status"] == "completed":
        roots = [line for line in differing[0].diagnosis if line.startswith("root:")]
        report["note"] = (f"{len(differing)} of {len(runs)} fresh simulation(s) ended "
                          f"{differing[0].status} where the recorded run completed"
                          + (f"; {roots[0]}" if roots else ""))
    simulated = [{r.room: {"kv_done_s": r.kv_done_s - r.arrival_s,
                           "transfer_s": r.last_transfer_s - r.first_transfer_s}
                  for r in run.sim.metrics.done if r.status == "Success"} for run in runs]
    for phase in ("kv_done_s", "transfer_s"):
        pairs = [(measured[room][phase], sim[room][phase]) for sim in simulated
                 for room in measured if room in sim and phase in measured[room]
                 and measured[room][phase] > 0]
        if not pairs:
            continue
        truth = np.array([p[0] for p in pairs])
        s = np.array([p[1] for p in pairs])
        ratio = s / truth
        rooms = {room for sim in simulated for room in measured if room in sim}
        report["rooms_compared"] = max(report["rooms_compared"], len(rooms))
        report[phase] = {
            "measured_p50": round(float(np.median([measured[r][phase] for r in rooms
                                                   if phase in measured[r]])), 6),
            "simulated_p50": round(float(np.median(s)), 6),
            "ratio_p50": round(float(np.median(ratio)), 4),
            "ratio_p10": round(float(np.percentile(ratio, 10)), 4),
            "ratio_p90": round(float(np.percentile(ratio, 90)), 4),
        }
    return report


SPEED_TOLERANCE = 0.15
"""How far a trace's scatter cost per byte may be from the costs' before the comparison says
the host ran at another speed."""


def host_speed(m: Measured, params: SimParams) -> dict[str, Any] | None:
    """The decode ranks' scatter speed in a measured hardware trace (``scatter_cost_per_byte``,
    fixed costs included) against the speed calibrated ``params`` assume for the same scatters
    (``blocking_kernels``: costs from ``twin calibrate``); None when either is missing. On a CPU host the scatter includes the byte
    check and runs on the rank's own core, so it tracks the host's speed during the run and the
    contention for its cores: a trace whose scatters ran slower (or faster) than during
    calibration says so in ``note``, since every timing ratio includes that."""
    per_byte = scatter_cost_per_byte(m)
    if not params.blocking_kernels or per_byte is None:
        return None
    assumed = scatter_cost_per_byte(m, params)
    assert assumed is not None  # the same scatters, charged by the costs
    measured_bps, costs_bps = 1.0 / per_byte, 1.0 / assumed
    ratio = per_byte / assumed  # this trace's cost per byte over the costs'
    out: dict[str, Any] = {"trace_scatter_Bps": round(measured_bps),
                           "costs_scatter_Bps": round(costs_bps), "cost_ratio": round(ratio, 3)}
    if not 1 / (1 + SPEED_TOLERANCE) <= ratio <= 1 + SPEED_TOLERANCE:
        out["note"] = (f"this trace's decode ranks scattered at {measured_bps / 1e6:.1f} MB/s, "
                       f"the costs assume {costs_bps / 1e6:.1f} MB/s for the same scatters "
                       f"({ratio:.2f}x the cost per byte): the host ran at another speed than "
                       f"during the calibration traces (or this run contended more for its "
                       f"cores), and every ratio below includes that")
    return out


def _tally(statuses: list[str]) -> str:
    """``completed`` when every run agrees, else ``completed x2, wedged x1``."""
    counts: dict[str, int] = {}
    for st in statuses:
        counts[st] = counts.get(st, 0) + 1
    if len(counts) == 1:
        return statuses[0]
    return ", ".join(f"{st} x{n}" for st, n in counts.items())
