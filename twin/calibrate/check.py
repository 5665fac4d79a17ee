"""Is a calibration as good as a repeat? A fit's prediction error against the host's own spread.

A fit on one hardware run (A) predicts another run (B): a fresh simulation of B's workload on
the fitted costs. The host never reproduces a run exactly, so the error is read against the
spread between B and a repeat of it (B2, the same workload recorded again on the same host).
Both are medians over B's requests of how far another estimate of each request's time is from
B's measured time, so they compare like with like:

* **error** of a phase = p50 over B's requests of ``|predicted / measured - 1|``, where a
  request's prediction is the median of its phase over the fresh simulations (seeds): the
  simulated jitter stands in for the host's noise, it is not part of the prediction;
* **spread** of a phase = p50 over B's requests of ``|repeat / measured - 1|``, each request of
  B matched with the same request id in B2.

A request counts where B and the other side completed it (the prediction: on at least one
seed). The ratio of the two runs' p50s is not the spread: it is one sample of the runs'
overall shift, which can fall arbitrarily close to 0, and an unbiased prediction would miss it
about half the time. The per-request median is stable; where the host's noise is independent
per request, a prediction right on average scores about 0.7 of the spread (the repeat carries
two runs' noise, the prediction one). ``ratio_p50`` keeps the p50 of the per-request ratios as
``twin replay`` reports it (the seeds pooled).

Phases, per request: ``ttft_s`` (arrival to first token: the hardware mode streams no token,
so there it is arrival to all KV landed, as ``twin hw`` reports TTFT; the simulator's TTFT
adds its decode loop's pick-up), ``kv_done_s`` (arrival to the last decode rank's
conclusion) and ``transfer_s`` (first ``StartTransfer`` to last ``TransferDone``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from twin.calibrate.phases import room_phases, simulate_recorded
from twin.runtime.params import SimParams
from twin.trace.format import Trace, TraceReader

CHECKED = ("ttft_s", "kv_done_s", "transfer_s")
"""The phases a check compares, per request."""

GOAL = 1.1
"""A prediction is good enough when its error is at most this many times the repeat spread."""

Phases = Mapping[str, Mapping[str, float]]
"""Per request id: phase -> seconds."""


def request_phases(trace: Trace | TraceReader) -> dict[str, dict[str, float]]:
    """Per request id (``RequestArrived``'s ``rid``, as a string) of a hardware trace: its
    ``kv_done_s``, ``transfer_s`` and ``ttft_s`` (equal to ``kv_done_s``: no token streams)."""
    rid: dict[int, str] = {}
    for rec in trace:
        if rec.type == "RequestArrived":
            rid[rec.data["room"]] = str(rec.data["rid"])
    out: dict[str, dict[str, float]] = {}
    for room, phases in room_phases(trace).items():
        if room in rid and "kv_done_s" in phases:
            out[rid[room]] = {**phases, "ttft_s": phases["kv_done_s"]}
    return out


def simulated_phases(trace: Trace | TraceReader, params: SimParams, seeds: Sequence[int]
                     ) -> list[dict[str, dict[str, float]]]:
    """Per seed, per request id: the phases of ``trace``'s run simulated afresh with ``params``
    (successful requests only)."""
    runs = []
    for seed in seeds:
        result = simulate_recorded(trace, params, seed)
        runs.append({str(r.rid): {"ttft_s": r.ttft_s, "kv_done_s": r.kv_done_s - r.arrival_s,
                                  "transfer_s": r.last_transfer_s - r.first_transfer_s}
                     for r in result.sim.metrics.done if r.status == "Success"
                     and r.first_transfer_s >= 0})
    return runs


@dataclass(frozen=True)
class Deviation:
    """How far estimates of B's requests are from B's measured times, for one phase."""

    median_abs: float
    """p50 over the requests of ``|estimate / measured - 1|``."""
    ratio_p50: float
    """p50 of the per-request ratios ``estimate / measured`` (every sample pooled)."""
    requests: int


def deviation(estimates: Sequence[Phases], measured: Phases, phase: str) -> Deviation | None:
    """``estimates`` (one or more runs, per request id) against ``measured``: a request's
    estimate is its median over the runs that have it (a simulated run that wedged lacks
    some); requests no run has, or without a positive measured time, are left out. None when
    no request is left."""
    points: list[float] = []
    ratios: list[float] = []
    for rid, m in measured.items():
        truth = m.get(phase, 0.0)
        got = [e[rid][phase] for e in estimates if rid in e and phase in e[rid]]
        if truth <= 0 or not got:
            continue
        points.append(float(np.median(got)) / truth)
        ratios += [g / truth for g in got]
    if not points:
        return None
    return Deviation(median_abs=float(np.median(np.abs(np.asarray(points) - 1.0))),
                     ratio_p50=float(np.median(ratios)), requests=len(points))


def prediction_error(predicted: Sequence[Phases], measured: Phases, phase: str
                     ) -> Deviation | None:
    """The prediction's error for ``phase``: ``predicted`` holds one run per seed."""
    return deviation(predicted, measured, phase)


def repeat_spread(repeat: Phases, measured: Phases, phase: str) -> Deviation | None:
    """The spread between a run and its repeat for ``phase``, matched by request id."""
    return deviation([repeat], measured, phase)


def compare(predicted: Sequence[Phases], measured: Phases, repeat: Phases,
            phases: Sequence[str] = CHECKED, goal: float = GOAL) -> dict[str, Any]:
    """Per phase: ``error``, ``spread`` (``Deviation``s as dicts), ``ratio`` (error / spread,
    None when the spread is 0 or either is missing) and ``met`` (ratio at most ``goal``);
    and ``met`` overall (every phase)."""
    out: dict[str, Any] = {}
    for phase in phases:
        err = prediction_error(predicted, measured, phase)
        spr = repeat_spread(repeat, measured, phase)
        ratio = (err.median_abs / spr.median_abs if err is not None and spr is not None
                 and spr.median_abs > 0 else None)
        out[phase] = {"error": None if err is None else asdict(err),
                      "spread": None if spr is None else asdict(spr), "ratio": ratio,
                      "met": ratio is not None and ratio <= goal}
    return {"phases": out, "goal": goal, "met": all(v["met"] for v in out.values())}
