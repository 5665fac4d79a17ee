"""A trace's run as an explorer trial, so that ``twin shrink`` can shrink any trace."""

from __future__ import annotations

from twin.explore.trial import Base, Req, Trial
from twin.runtime.params import SimParams


class TraceTrialError(ValueError):
    """The trace cannot be turned into a trial; the message names the file."""


def trial_from_trace(path: str) -> tuple[Base, Trial, str]:
    """``(base, trial, recorded status)`` from a trace's header: its config and cost
    parameters, defects, workload (arrivals and prompt lengths), per-request prefixes, faults
    and seed. ``TraceTrialError`` when the trace cannot be read or does not carry its
    workload."""
    from twin.trace.format import read_trace
    from twin.workloads import Workload, WorkloadError

    try:
        trace = read_trace(path)
        header = trace.header
        cfg = trace.config
    except (OSError, ValueError) as exc:
        raise TraceTrialError(f"{path}: {exc}") from None
    try:
        workload = Workload.from_jsonable(header.get("workload", {}))
    except WorkloadError as exc:
        raise TraceTrialError(f"{path}: the trace does not carry its workload ({exc})") from None
    run = cfg.extra.get("run", {})
    overrides = {int(k): v for k, v in run.get("request_overrides", {}).items()}
    params = SimParams.from_dict(cfg.extra.get("sim", {}), f"{path} header")
    reqs = tuple(Req(r.arrival_s, r.input_len,
                     overrides.get(r.rid, {}).get("decode_prefix_len", 0),
                     overrides.get(r.rid, {}).get("prefill_prefix_len", 0))
                 for r in workload.requests)
    base = Base(cfg.replace(extra={k: v for k, v in cfg.extra.items() if k != "run"}), params,
                tuple(header.get("defects", [])))
    recorded = trace.outcome.get("status", "") if trace.outcome is not None else ""
    return base, Trial(requests=reqs, faults=tuple(header.get("faults", [])),
                       seed=int(header.get("seed") or 0)), recorded
