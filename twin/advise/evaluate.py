"""Run one sweep point and flatten what it found into one result row.

A row holds the point (its axes and seed), the verdict (``outcome``: clean, failed, wedged,
corrupted, unfinished, invalid or error; the wedge's first root cause), counts, ring occupancy,
deferrals and deferral wait, latency percentiles and a quantile sketch for CDFs, resource use,
simulated and wall time, and the full resolved config. Summary keys are read defensively:
series the simulator does not report (for example ``tpot_s`` before the decode loop exists)
leave their columns empty.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import socket
import time
import traceback
from typing import Any

from twin.advise.space import Base, EarlyStop, Point, build_run, point_id
from twin.core.config import ConfigError, TwinConfig
from twin.workloads import Workload

MiB = 1024 * 1024
SERIES = ("ttft_s", "tpot_s", "e2e_s", "transfer_s", "kv_wait_s")
"""Latency series with their own columns (``ttft_p50`` ...); others go to ``latency_json``."""
STATS = ("p50", "p90", "p99", "mean")
QUANTILES = tuple(q / 20 for q in range(21))
"""Levels of the per-point quantile sketch (``ttft_q``) that CDF plots draw from."""

OUTCOMES = ("clean", "failed", "over-budget", "wedged", "corrupted", "unfinished", "invalid",
            "error")


def scaled(workload: Workload, scale: float) -> Workload:
    """``workload`` with requests arriving ``scale`` times as fast (arrival times / scale)."""
    if scale == 1.0:
        return workload
    reqs = tuple(dataclasses.replace(r, arrival_s=r.arrival_s / scale) for r in workload.requests)
    return Workload(name=f"{workload.name}x{scale:g}", requests=reqs,
                    source=f"{workload.source} (rate x{scale:g})")


def _col(series: str, stat: str) -> str:
    return f"{series[:-2]}_{stat}"


LATENCY_COLUMNS = tuple(_col(s, st) for s in SERIES for st in STATS)


def root_cause(diagnosis: list[str]) -> str:
    """The first ``root:`` line of a wedge diagnosis, else its first line."""
    for line in diagnosis:
        if line.startswith("root:"):
            return line
    return diagnosis[0] if diagnosis else ""


def classify(summary: dict[str, Any]) -> str:
    """One word for how a run ended, from its summary alone."""
    if summary.get("corrupted") or summary.get("status") == "corrupted":
        return "corrupted"
    if summary.get("wedged") or summary.get("status") == "wedged":
        return "wedged"
    if summary.get("unfinished", 0):
        return "unfinished"
    if summary.get("failed", 0):
        return "failed"
    if summary.get("status") not in (None, "completed", "failed"):
        return str(summary.get("status"))
    return "clean"


def describe_layout(cfg: TwinConfig) -> str:
    def side(x: Any) -> str:
        dp = f"DP{x.dp_size}" if x.enable_dp_attention else ""
        inst = f"x{x.instances}" if x.instances > 1 else ""
        pp = f"PP{x.pp_size}" if x.pp_size > 1 else ""
        return f"TP{x.tp_size}{pp}{dp}{inst}"

    return f"{side(cfg.prefill)}->{side(cfg.decode)}"


def chunk_region_bytes(cfg: TwinConfig) -> int:
    """Bytes of one full grid chunk's staging region on the busiest decode rank: a ring smaller
    than this cannot hold a full chunk (SGLang answers ALLOC_OVERSIZED)."""
    return max(cfg.region_layout(r, cfg.full_chunk_pages)[2]
               for r in range(cfg.decode.attn_tp_size))


def _quantiles(values: list[float]) -> list[float] | None:
    if not values:
        return None
    import numpy as np

    return [round(float(v), 6) for v in np.quantile(np.asarray(values), QUANTILES)]


def _prefill_busy(sim: Any, cfg: TwinConfig, span: float) -> float | None:
    """Estimated busy fraction of the prefill groups: the cost model's forward time of every
    ended request's uncached tokens over the run's span (an estimate, not a measurement)."""
    try:
        p = sim.params
        groups = cfg.prefill.attn_dp_size * cfg.prefill.instances
        busy = 0.0
        for r in sim.metrics.done:
            new = max(0, r.input_len - max(0, r.prefill_prefix_len))
            chunks = max(1, math.ceil(new / cfg.chunked_prefill_size))
            ctx = max(0, r.prefill_prefix_len) + new / 2
            busy += (chunks * p.forward_overhead_s + new * p.prefill_s_per_token
                     + new * ctx * p.prefill_s_per_token_ctx)
        return round(busy / (span * groups), 4) if span > 0 else None
    except Exception:  # the engine is free to change its internals; this is only an estimate
        return None


def _series(sim: Any, attr: str) -> list[float]:
    out = []
    try:
        for r in sim.metrics.done:
            if r.status == "Success":
                v = getattr(r, attr, None)
                if isinstance(v, (int, float)) and v >= 0:
                    out.append(float(v))
    except Exception:
        return []
    return out


_NODE_PREFIX = re.compile(r"^(prefill|decode) \S+ failed: ")


def failure_details(sim: Any) -> dict[str, int] | None:
    """Failed requests counted by reason, without the node that reported it (the summary's
    ``failures`` keeps only that node)."""
    out: dict[str, int] = {}
    try:
        for r in sim.metrics.done:
            if r.status == "Failed":
                key = _NODE_PREFIX.sub("", str(r.reason))[:160] or "failed"
                out[key] = out.get(key, 0) + 1
    except Exception:
        return None
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


class LateWatch:
    """The stop check of a run with a TTFT budget (:class:`EarlyStop`), asked every half budget
    of simulated time (``every``).

    It answers a stop reason once the run's verdict is certain: corruption found, a request
    failed, or so many requests past the budget (finished over it, or still without their KV
    longer than it) that the ``percentile`` cannot meet it whatever happens later; ``verdict``
    then holds ``(outcome, note)``. Counting is incremental (each finished request once; the
    requests older than the budget whose KV had not landed when last asked), so a check costs
    little next to the run. Late counts only grow, so a stopped run is one the full run fails.
    """

    def __init__(self, es: EarlyStop, requests: int) -> None:
        self.es = es
        self.requests = requests
        # numpy's interpolated percentile of n values exceeds the budget once more than
        # (1 - q) * (n - 1) + 1 of them do; n <= requests, so this bound is safe.
        self.allowed = (1 - es.percentile / 100) * (requests - 1) + 1
        self.verdict: tuple[str, str] | None = None
        self.every = es.ttft_s / 2  # how often the run asks, in simulated seconds
        self._counted = 0  # entries of ``metrics.done`` looked at
        self._late_done = 0
        self._order: list[Any] = []  # request states in the order they arrived
        self._next = 0  # the first of ``_order`` not yet known to be older than the budget
        self._waiting: list[Any] = []  # older than the budget, KV not landed when last asked

    def late(self, sim: Any) -> int:
        """Requests of ``sim`` already past the budget (a lower bound of the final count)."""
        done = sim.metrics.done
        budget = self.es.ttft_s
        for r in done[self._counted:]:
            if r.status == "Success" and r.ttft_s > budget:
                self._late_done += 1
        self._counted = len(done)
        if len(self._order) < len(sim.requests):
            self._order = list(sim.requests.values())
        order, k, before = self._order, self._next, sim.env.now - budget
        while k < len(order) and order[k].arrival_s < before:
            self._waiting.append(order[k])
            k += 1
        self._next = k
        self._waiting = [r for r in self._waiting if r.status == "pending"]
        return self._late_done + len(self._waiting)

    def __call__(self, sim: Any) -> str:
        at = sim.env.now
        if sim.integrity.violations:
            self.verdict = ("corrupted", f"corrupted before {at:.1f} s simulated")
            return "early stop: corrupted"
        failed = sum(1 for r in sim.metrics.done[self._counted:] if r.status == "Failed")
        if failed:
            self.verdict = ("failed", f"stopped at {at:.1f} s: {failed} request(s) had "
                                      "already failed")
            return "early stop: failed"
        late = self.late(sim)
        if late >= self.allowed:
            es = self.es
            self.verdict = ("over-budget", f"stopped at {at:.1f} s: {late} request(s) already "
                                           f"over the {es.ttft_s:g} s TTFT budget "
                                           f"(p{es.percentile} of {self.requests} allows < "
                                           f"{math.ceil(self.allowed)})")
            return "early stop: over the TTFT budget"
        return ""


def empty_row() -> dict[str, Any]:
    return {c: None for c in BASE_COLUMNS}


BASE_COLUMNS = (
    "point_id", "sweep", "seed", "outcome", "status", "root_cause", "error", "note",
    "requests", "completed", "failed", "unfinished", "failures",
    "layout", "chunked_prefill_size", "page_size", "ring_mb", "chunk_region_mb", "rate_scale",
    "peak_ring_mb", "peak_ring_frac", "deferrals", "deferrals_per_request", "deferral_wait_s",
    *LATENCY_COLUMNS, "ttft_q", "tpot_q",
    "nic_util_max", "prefill_busy", "sim_s", "wall_s", "events", "host", "finished_at",
    "latency_json", "extra_json", "diagnosis_json", "config_json",
)
"""Columns of every result row, after the axis columns (``x.NAME``)."""

_KNOWN_SUMMARY = {
    "status", "requests", "arrived", "completed", "failed", "unfinished", "wedged", "corrupted",
    "diagnosis", "corruption", "stop_reason", "sim_seconds", "wall_seconds", "events", "seed",
    "defects", "faults", "failures", "latency", "deferrals", "nic_bytes", "peak_ring_bytes",
    "bytes_moved", "nic_utilisation",
}


def error_row(fingerprint: str, point: Point, message: str) -> dict[str, Any]:
    """A row for ``point`` that could not be run at all (``outcome`` error)."""
    row = empty_row()
    row.update(point_id=point_id(fingerprint, point), sweep=fingerprint, seed=point.seed,
               outcome="error", error=message, finished_at=round(time.time(), 3),
               **{f"x.{k}": v for k, v in point.assign})
    return row


def run_point(base: Base, workload: Workload, point: Point, fingerprint: str) -> dict[str, Any]:
    """Run ``point`` and return its result row (never raises for a bad point: an invalid
    combination or a crash becomes a row with ``outcome`` invalid or error)."""
    from twin.sim.runner import run_sim

    row = empty_row()
    row.update(point_id=point_id(fingerprint, point), sweep=fingerprint, seed=point.seed,
               host=socket.gethostname(), **{f"x.{k}": v for k, v in point.assign})
    t0 = time.perf_counter()
    try:
        cfg, params, scale = build_run(base, point)
    except (ConfigError, ValueError) as exc:
        row.update(outcome="invalid", error=str(exc), wall_s=0.0,
                   finished_at=round(time.time(), 3))
        return row
    row.update(layout=describe_layout(cfg), chunked_prefill_size=cfg.chunked_prefill_size,
               page_size=cfg.page_size, ring_mb=round(cfg.ring_bytes / MiB, 3), rate_scale=scale,
               chunk_region_mb=round(chunk_region_bytes(cfg) / MiB, 3),
               config_json=json.dumps({**cfg.to_dict(), "sim": params.to_dict(),
                                       "defects": base.defects.sorted(),
                                       "faults": [f.text for f in base.faults],
                                       "max_concurrency": base.max_concurrency,
                                       "rate_scale": scale, "horizon_s": base.horizon_s},
                                      sort_keys=True, default=str))
    override = None
    try:
        wl = scaled(workload, scale)
        until = None
        if base.horizon_s is not None and wl.requests:
            until = wl.requests[-1].arrival_s + base.horizon_s

        es = base.early_stop
        watch = LateWatch(es, len(wl.requests)) if es is not None and len(wl.requests) > 1 \
            else None
        result = run_sim(cfg, wl, defects=base.defects, faults=list(base.faults),
                         seed=point.seed, params=params, until=until,
                         request_overrides=base.request_overrides,
                         max_concurrency=base.max_concurrency, stop_check=watch)
        if watch is not None and watch.verdict is not None:
            override, row["note"] = watch.verdict
        s = result.summary()
    except Exception as exc:
        row.update(outcome="error", error=f"{type(exc).__name__}: {exc}",
                   extra_json=json.dumps({"traceback": traceback.format_exc()[-4000:]}),
                   wall_s=round(time.perf_counter() - t0, 3), finished_at=round(time.time(), 3))
        return row
    fill_from_summary(row, s, cfg, cfg.deferral_wait_s)
    if override is not None:
        row["outcome"] = override
    sim = result.sim
    details = failure_details(sim)
    if details:
        row["failures"] = json.dumps(details)
    row["ttft_q"] = json.dumps(_quantiles(_series(sim, "ttft_s")))
    tpot = _quantiles(_series(sim, "tpot_s"))
    row["tpot_q"] = json.dumps(tpot) if tpot else None
    span = float(s.get("sim_seconds") or 0.0) - (wl.requests[0].arrival_s if wl.requests else 0)
    row["prefill_busy"] = _prefill_busy(sim, cfg, span)
    row["wall_s"] = round(time.perf_counter() - t0, 3)
    row["finished_at"] = round(time.time(), 3)
    return row


def fill_from_summary(row: dict[str, Any], s: dict[str, Any], cfg: TwinConfig,
                      deferral_wait_s: float) -> None:
    """Copy a run summary's findings into ``row`` (every key read defensively)."""
    requests = int(s.get("requests") or 0)
    diagnosis = list(s.get("diagnosis") or [])
    deferrals = sum((s.get("deferrals") or {}).values())
    peak = max((s.get("peak_ring_bytes") or {}).values(), default=0)
    row.update(
        outcome=classify(s), status=s.get("status"), root_cause=root_cause(diagnosis),
        requests=requests, completed=s.get("completed"), failed=s.get("failed"),
        unfinished=s.get("unfinished"), failures=json.dumps(s.get("failures") or {}),
        peak_ring_mb=round(peak / MiB, 3),
        peak_ring_frac=round(peak / cfg.ring_bytes, 4) if cfg.ring_bytes else None,
        deferrals=deferrals,
        deferrals_per_request=round(deferrals / requests, 4) if requests else None,
        deferral_wait_s=round(deferrals * deferral_wait_s, 6),
        nic_util_max=max((s.get("nic_utilisation") or {}).values(), default=None),
        sim_s=s.get("sim_seconds"), events=s.get("events"),
        latency_json=json.dumps(s.get("latency") or {}, sort_keys=True),
        diagnosis_json=json.dumps(diagnosis[:40] + list(s.get("corruption") or [])[:10]),
        extra_json=json.dumps({k: v for k, v in s.items() if k not in _KNOWN_SUMMARY},
                              sort_keys=True, default=str),
    )
    if row["outcome"] == "corrupted" and not row["root_cause"]:
        row["root_cause"] = next(iter(s.get("corruption") or []), "")
    latency = s.get("latency") or {}
    for series in SERIES:
        stats = latency.get(series) or {}
        for stat in STATS:
            v = stats.get(stat)
            row[_col(series, stat)] = v if isinstance(v, (int, float)) else None
