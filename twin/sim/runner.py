"""Run one simulation end to end and summarise it: outcome, diagnosis, metrics, exit code."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from twin.core.config import TwinConfig
from twin.core.defects import Defects
from twin.models.costs import Deployment
from twin.runtime.diagnosis import diagnose
from twin.runtime.faults import FaultSpec, fault_report
from twin.runtime.header import trace_header
from twin.runtime.outcome import RunStatus, Verdict, decide, exit_code
from twin.runtime.params import SimParams
from twin.runtime.runtime import Recorder
from twin.sim.causes import root_causes
from twin.sim.engine import Simulation, sim_config
from twin.workloads import Workload


class StopCheck(Protocol):
    """Asked every ``every`` simulated seconds: a non-empty stop reason ends the run there."""

    every: float

    def __call__(self, sim: Simulation) -> str: ...


@dataclass
class SimResult:
    """What a run found; ``summary()`` is the ``--json`` object."""

    sim: Simulation
    stop_reason: str
    wall_seconds: float
    diagnosis: list[str] = field(default_factory=list)
    stopped: RunStatus = RunStatus.UNTIL  # INTERRUPTED after Ctrl-C, SIGTERM or SIGHUP

    @property
    def wedged(self) -> bool:
        return self.stop_reason in ("wedge", "event queue empty") and self.sim.unfinished > 0

    @property
    def corruption(self) -> list[str]:
        return [str(v) for v in self.sim.integrity.violations]

    @property
    def exit_code(self) -> int:
        return exit_code(self.status)

    @property
    def status(self) -> RunStatus:
        failed = sum(r.status == "Failed" for r in self.sim.metrics.done)
        return decide(corrupted=bool(self.corruption), wedged=self.wedged,
                      unfinished=self.sim.unfinished, failed=failed, stopped=self.stopped)

    def _counts(self) -> tuple[int, int]:
        """Requests whose KV transfer completed, and that failed (the protocol's outcome, as
        a replay recounts it; a completed request may still be decoding at ``--until``)."""
        reqs = self.sim.requests.values()
        return (sum(r.status == "Success" for r in reqs), sum(r.status == "Failed" for r in reqs))

    @property
    def verdict(self) -> Verdict:
        sim = self.sim
        completed, failed = self._counts()
        return Verdict(status=self.status, requests=len(sim.workload.requests),
                       completed=completed, failed=failed,
                       unfinished=len(sim.workload.requests) - completed - failed,
                       diagnosis=list(self.diagnosis),
                       corruption=self.corruption[:50])

    def summary(self) -> dict[str, Any]:
        sim = self.sim
        completed, failed = self._counts()
        return {
            "status": self.status.value,
            "requests": len(sim.workload.requests),
            "arrived": sim.arrived,
            "completed": completed,
            "failed": failed,
            "unfinished": len(sim.workload.requests) - completed - failed,
            "decoding": sim.unfinished - (len(sim.workload.requests) - completed - failed),
            "wedged": self.wedged,
            "corrupted": bool(self.corruption),
            "diagnosis": self.diagnosis,
            "corruption": self.corruption[:50],
            "stop_reason": self.stop_reason,
            "sim_seconds": round(sim.env.now, 6),
            "wall_seconds": round(self.wall_seconds, 3),
            "events": sim.inputs,
            "worker_polls": sim.cfg.worker_polls,
            "polls_accounted": sim.runtime.polls_accounted,
            "seed": sim.seed,
            "defects": sim.defects.sorted(),
            "faults": [f.text for f in sim.injector.specs],
            "fault_report": fault_report(sim.injector.specs, _fired(sim)),
            "failures": _failure_reasons(sim),
            "roots": root_causes(sim),
            **sim.metrics.summary(),
            # Entries of decode's per-room chunk_staging_infos at their peak, per decode rank
            # (each a 5-tuple in SGLang): a malformed STAGING_REQ chunk_idx grows them (#39764).
            "peak_chunk_infos": {n: r.chunk_info_peak for n, r in sorted(sim.ranks.items())
                                 if hasattr(r, "chunk_info_peak")},
            "nic_utilisation": sim.metrics.nic_utilisation(sim.env.now),
        }


def _fired(sim: Simulation) -> list[int]:
    """How often each fault fired. Message and transfer faults are counted as they fire; a
    timed one fired if the run reached its time (an abort: if it aborted its room)."""
    fired = list(sim.injector.fired)
    aborted = {r.reason for r in sim.metrics.done if r.reason.startswith("aborted by fault ")}
    for i, spec in enumerate(sim.injector.specs):
        if spec.action == "abort":
            fired[i] = int(f"aborted by fault {spec.text}" in aborted)
        elif spec.action in ("crash", "restart"):
            fired[i] = int(sim.env.now >= (spec.at or 0.0))
    return fired


def _failure_reasons(sim: Simulation) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in sim.metrics.done:
        if r.status == "Failed":
            key = r.reason.split(":")[0][:80] or "failed"
            out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def with_cost_source(cfg: TwinConfig, params: SimParams) -> TwinConfig:
    """``cfg`` with ``serving.cost_source`` saying where compute costs come from (the trace
    header's record of it; a replay recomputes it)."""
    source = Deployment.build(cfg, params).source
    serving = {**cfg.extra.get("serving", {}), "cost_source": source}
    return cfg.replace(extra={**cfg.extra, "serving": serving})


def outcome_record(result: SimResult) -> dict[str, Any]:
    """The trace's closing ``Outcome`` record for ``result``."""
    v = result.verdict
    note = (f"stopped at --until {result.sim.env.now:g} s with {v.unfinished} request(s) in "
            f"flight" if v.status is RunStatus.UNTIL else "")
    return v.record(note)


def recorded_run(cfg: TwinConfig, workload: Workload, params: SimParams | None, *,
                 defects: Defects, faults: list[FaultSpec], seed: int,
                 request_overrides: dict[int, dict[str, int]],
                 max_concurrency: int | None) -> tuple[SimParams, dict[str, Any]]:
    """The params and trace header of a simulation that writes a trace file. Every deferral
    re-poll is fed (``TwinConfig.worker_polls = "fed"``): a trace file replays on real ranks
    too, which feed real polls."""
    params = (params or SimParams()).replace(coalesce_polls=False)
    header = trace_header(with_cost_source(sim_config(cfg, params), params), workload,
                          defects=defects, faults=faults, seed=seed, params=params,
                          request_overrides=request_overrides, max_concurrency=max_concurrency)
    return params, header


def run_sim(cfg: TwinConfig, workload: Workload, *, defects: Defects | None = None,
            faults: list[FaultSpec] | None = None, seed: int = 0,
            params: SimParams | None = None, until: float | None = None,
            recorder: Recorder | None = None, progress: bool = False,
            request_overrides: dict[int, dict[str, int]] | None = None,
            max_concurrency: int | None = None,
            trace_out: str | Path | None = None,
            stop_check: StopCheck | None = None) -> SimResult:
    """Build and run a simulation; the trace streams to ``trace_out`` (or ``recorder``).
    ``stop_check(sim)``, asked every ``stop_check.every`` simulated seconds, stops the run
    where it answers a non-empty stop reason."""
    if trace_out is not None:
        from twin.trace.format import TraceWriter

        params, header = recorded_run(cfg, workload, params, defects=defects or Defects(),
                                      faults=list(faults or []), seed=seed,
                                      request_overrides=request_overrides or {},
                                      max_concurrency=max_concurrency)
        with TraceWriter(trace_out, header) as writer:
            result = run_sim(cfg, workload, defects=defects, faults=faults, seed=seed,
                             params=params, until=until, recorder=writer, progress=progress,
                             request_overrides=request_overrides,
                             max_concurrency=max_concurrency, stop_check=stop_check)
            writer.close(outcome_record(result))
        return result
    sim = Simulation(cfg, workload, defects=defects, faults=faults, seed=seed, params=params,
                     recorder=recorder, request_overrides=request_overrides,
                     max_concurrency=max_concurrency)
    if stop_check is not None:
        sim.watch(lambda: stop_check(sim), stop_check.every)
    bar = None
    if progress and sys.stderr.isatty():
        from tqdm import tqdm

        total = until if until is not None else max(workload.duration_s, 1.0)
        bar = tqdm(total=round(total, 1), unit="sim s", leave=False, file=sys.stderr)

        def tick(now: float) -> None:
            bar.n = round(min(now, total), 1)
            bar.set_postfix(done=len(sim.metrics.done), refresh=False)
            bar.refresh()

        sim.progress_cb = tick
    t0 = time.perf_counter()
    stopped = RunStatus.UNTIL
    try:
        reason = sim.run(until=until)
    except KeyboardInterrupt:
        reason, stopped = "interrupted", RunStatus.INTERRUPTED
    finally:
        if bar is not None:
            bar.close()
    wall = time.perf_counter() - t0
    result = SimResult(sim, reason, wall, stopped=stopped)
    if result.wedged:
        unfinished = {r.room for r in sim.requests.values() if not r.finished}
        snapshots = {n: r.snapshot() for n, r in sim.ranks.items()}
        topo = sim.topo
        nodes_of = {r.room: tuple(n.id for n in (*topo.prefill_groups[r.prefill_group].nodes,
                                                *topo.decode_groups[r.decode_group].nodes))
                    for r in sim.requests.values() if not r.finished}
        result.diagnosis = diagnose(snapshots, sim.crashed, unfinished, sim.last_dropped,
                                    sim.fault_notes, nodes_of, sim.restarted).lines()
        waiting = sorted(unfinished)
        head = (f"wedge: {len(waiting)} request(s) unfinished with no progress for "
                f"{sim.params.wedge_window_s:g} s" if reason == "wedge" else
                f"wedge: the event queue emptied with {len(waiting)} request(s) unfinished")
        queued = len(workload.requests) - sim.arrived
        tail = f"; {queued} more not yet sent" if queued else ""
        result.diagnosis.insert(0, head + f" (rooms {_abbrev(waiting)}){tail}")
    return result


def _abbrev(rooms: list[int], limit: int = 12) -> str:
    text = ", ".join(str(r) for r in rooms[:limit])
    return text + (f", ... ({len(rooms) - limit} more)" if len(rooms) > limit else "")
