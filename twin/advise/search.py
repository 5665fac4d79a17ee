"""``twin advise``: searches instead of blind grids.

For each candidate ``chunked_prefill_size`` a **ring search** finds the smallest decode staging
ring (MiB per decode rank) that runs the workload with no wedge, no corruption, no failed or
unfinished request and latency within the budgets, on every seed. It is a bisection over the
ring size (geometric midpoints, stopping when the bracket is within ``tolerance``). The first
probe is the smallest ring that holds one full chunk's staging region; if it passes, one MiB
less comes next (usually the boundary: no full chunk fits); if it fails, the ring doubles until
a probe passes (if none up to the largest ring does, no ring helps).

A **capacity search** then finds the largest request-rate scaling (arrival times divided by the
scale) that a ring sustains under the same criteria: doubling until a failure, then bisection.

Each probe runs its first seed alone and the others only if it passed (a failing ring is
usually found on the first seed), unless slots would otherwise sit idle, in which case the
seeds run together. The searches of all candidates run at once, sharing one executor; every
probe is a sweep point, so the probes land in an ordinary result file, and a rerun with the
same file reuses them.

What limits an answer is read from the run at the failing edge: a wedge or corruption (a
protocol finding), an oversized chunk (ring), decode KV pressure (retractions, a full KV pool:
when the simulator reports them), an estimated prefill busy fraction near one (prefill
compute), a NIC busy fraction near one (NIC), or time spent waiting for KV with deferrals
(ring).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from twin.advise.evaluate import MiB, chunk_region_bytes
from twin.advise.executors import Executor, Job
from twin.advise.results import ResultsFile, json_cell
from twin.advise.space import RATE_SCALE, EarlyStop, Point, point_id

CPS = "chunked_prefill_size"
RING = "staging_pool_size_mb"
AXES = (CPS, RATE_SCALE, RING)
"""The axes of every advise probe (the columns of its result file)."""

THIN_MARGIN = 1.2
"""A sustained rate scale below this is called out as a thin margin."""

Rows = list[dict[str, Any]]
Search = Generator[list[Point], Rows, Any]


# Budgets and judging ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Budgets:
    """Latency budgets in seconds at one percentile (50, 90 or 99); None: no budget."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    percentile: int = 99

    def __post_init__(self) -> None:
        if self.percentile not in (50, 90, 99):
            raise ValueError(f"percentile must be 50, 90 or 99, got {self.percentile}")

    def describe(self) -> str:
        parts = [f"p{self.percentile} {name} <= {fmt_s(v)}"
                 for name, v in (("TTFT", self.ttft_s), ("TPOT", self.tpot_s)) if v is not None]
        return ", ".join(parts) or "no latency budget"


def fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1e3:.0f} ms" if v < 1 else f"{v:.2f} s"


def failure_text(row: dict[str, Any]) -> str:
    """Why a run is not clean, in a few words."""
    outcome = row.get("outcome")
    if outcome == "wedged":
        return f"wedge: {row.get('root_cause') or 'no diagnosis'}"
    if outcome == "corrupted":
        return f"corruption: {row.get('root_cause') or ''}".rstrip(": ")
    if outcome == "failed":
        failures = json_cell(row, "failures") or {}
        reasons = ", ".join(f"{n} x {str(k).split(';')[0][:70]}"
                            for k, n in list(failures.items())[:3])
        return f"{row.get('failed')} request(s) failed" + (f" ({reasons})" if reasons else "")
    if outcome == "over-budget":
        return str(row.get("note") or "over the TTFT budget before the end")
    if outcome == "unfinished":
        return f"{row.get('unfinished')} request(s) unfinished at the horizon"
    if outcome in ("invalid", "error"):
        return f"{outcome}: {row.get('error')}"
    return str(outcome)


def judge(row: dict[str, Any], budgets: Budgets) -> tuple[bool, str]:
    """Whether one run meets the criteria, and why not."""
    if row.get("outcome") != "clean":
        return False, failure_text(row)
    pct = budgets.percentile
    for name, label, budget in (("ttft", "TTFT", budgets.ttft_s), ("tpot", "TPOT",
                                                                    budgets.tpot_s)):
        value = row.get(f"{name}_p{pct}")
        if budget is not None and isinstance(value, (int, float)) and value > budget:
            return False, f"p{pct} {label} {fmt_s(value)} > {fmt_s(budget)}"
    return True, "clean, within budgets"


# What limits an answer --------------------------------------------------------------------------

def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix.rstrip(".")] = obj
    return out


def decode_kv_signal(row: dict[str, Any]) -> str | None:
    """Evidence of decode KV-memory pressure in a run, if the simulator reports any
    (retractions, a KV pool near full, failures naming the KV pool)."""
    flat = _flatten(json_cell(row, "extra_json") or {})
    for key, value in flat.items():
        low = key.lower()
        if "retract" in low and isinstance(value, (int, float)) and value > 0:
            return f"{key} = {value:g}"
    for key, value in flat.items():
        low = key.lower()
        if ("kv_pool" in low or "kv_usage" in low or "kv_util" in low or "token_usage" in low) \
                and isinstance(value, float) and 0.95 <= value <= 1.5:
            return f"{key} = {value:.0%}"
    for reason in json_cell(row, "failures") or {}:
        low = str(reason).lower()
        if "kv" in low and any(w in low for w in ("pool", "memory", "retract", "token")):
            return f"failures: {reason}"
    return None


@dataclass(frozen=True)
class Limit:
    """What limits a run: ``kind`` is ring, NIC, prefill compute, decode KV, protocol wedge,
    corruption, invalid or error; ``evidence`` the numbers behind it."""

    kind: str
    evidence: str

    def __str__(self) -> str:
        return f"{self.kind} ({self.evidence})" if self.evidence else self.kind


def _pct(v: Any) -> str:
    return f"{v:.0%}" if isinstance(v, (int, float)) else "-"


def limiting_factor(row: dict[str, Any]) -> Limit:
    """The resource (or protocol failure) that makes ``row`` fail or come closest to it."""
    outcome = row.get("outcome")
    if outcome == "wedged":
        return Limit("protocol wedge", str(row.get("root_cause") or ""))
    if outcome == "corrupted":
        return Limit("corruption", str(row.get("root_cause") or ""))
    if outcome in ("invalid", "error"):
        return Limit(str(outcome), str(row.get("error") or ""))
    failures = json_cell(row, "failures") or {}
    if any("OVERSIZED" in str(k).upper() for k in failures):
        return Limit("ring", f"a chunk's staging region ({row.get('chunk_region_mb')} MiB) does "
                             f"not fit a {row.get('ring_mb')} MiB ring: ALLOC_OVERSIZED")
    kv = decode_kv_signal(row)
    if kv:
        return Limit("decode KV", kv)
    busy = row.get("prefill_busy")
    nic = row.get("nic_util_max")
    dpr = row.get("deferrals_per_request") or 0.0
    ttft = row.get("ttft_p99")
    kvw = row.get("kv_wait_p99")
    share = (kvw / ttft) if isinstance(kvw, (int, float)) and isinstance(ttft, (int, float)) \
        and ttft > 0 else 0.0
    evidence = (f"prefill busy ~{_pct(busy)}, NIC busy {_pct(nic)}, {dpr:.2f} deferrals per "
                f"request, KV wait p99 {fmt_s(kvw)} of TTFT p99 {fmt_s(ttft)}")
    busy_f = float(busy) if isinstance(busy, (int, float)) else 0.0
    nic_f = float(nic) if isinstance(nic, (int, float)) else 0.0
    if busy_f >= 0.85:
        return Limit("prefill compute", evidence)
    if nic_f >= 0.75:
        return Limit("NIC", evidence)
    if share >= 0.3 and dpr >= 0.05:
        return Limit("ring", evidence)
    scores = {"prefill compute": busy_f, "NIC": nic_f, "ring": share if dpr > 0 else 0.0}
    kind = max(scores, key=lambda k: scores[k])
    return Limit(kind, evidence + "; nothing saturated")


# Probes -------------------------------------------------------------------------------------------

@dataclass
class Probe:
    """One setting checked on the seeds: passed on all of them, or why not."""

    value: float
    passed: bool
    why: str
    rows: Rows

    @property
    def first(self) -> dict[str, Any]:
        return self.rows[0]

    @property
    def failing(self) -> dict[str, Any]:
        for r in self.rows:
            if r.get("outcome") != "clean" or not r.get("_ok", True):
                return r
        return self.rows[-1]


class Context:
    """What the searches share: the seeds, budgets and a view of free executor slots."""

    def __init__(self, seeds: Sequence[int], budgets: Budgets,
                 free_slots: Callable[[], int],
                 known: Callable[[Point], dict[str, Any] | None] | None = None) -> None:
        self.seeds = tuple(seeds)
        self.budgets = budgets
        self.free_slots = free_slots
        self.known = known or (lambda p: None)

    def check(self, make: Callable[[int], Point], value: float) -> Generator[list[Point], Rows,
                                                                               Probe]:
        """Run ``make(seed)`` on the seeds: the first seed alone unless slots are idle."""
        seeds = self.seeds
        together = self.free_slots() >= len(seeds) and self.known(make(seeds[0])) is None
        first = seeds if together else seeds[:1]
        rows = yield [make(s) for s in first]
        rows = list(rows)
        for r in rows:
            ok, why = judge(r, self.budgets)
            r["_ok"] = ok
            if not ok:
                return Probe(value, False, f"{why} (seed {r.get('seed')})", rows)
        if not together and len(seeds) > 1:
            more = list((yield [make(s) for s in seeds[1:]]))
            rows += more
            for r in more:
                ok, why = judge(r, self.budgets)
                r["_ok"] = ok
                if not ok:
                    return Probe(value, False, f"{why} (seed {r.get('seed')})", rows)
        return Probe(value, True, "passed", rows)


def _point(cps: int, ring: int, scale: float, seed: int) -> Point:
    return Point(((CPS, int(cps)), (RATE_SCALE, float(scale)), (RING, int(ring))), seed)


@dataclass
class RingAnswer:
    """The ring search of one candidate."""

    cps: int
    region_mb: float
    ring_min: int
    ring_max: int
    best: Probe | None = None       # the smallest passing ring
    below: Probe | None = None      # the largest failing ring under it
    probes: list[Probe] = field(default_factory=list)

    @property
    def feasible(self) -> bool:
        return self.best is not None

    @property
    def min_ring(self) -> int | None:
        return int(self.best.value) if self.best else None


def ring_search(ctx: Context, cps: int, region_mb: float, ring_min: int, ring_max: int,
                tolerance: float, scale: float = 1.0
                ) -> Generator[list[Point], Rows, RingAnswer]:
    """The smallest passing ring in ``[ring_min, ring_max]`` MiB for ``cps`` with the workload
    at rate ``scale``: one chunk region first, then doubling (failure) or one MiB less
    (success), then bisection."""
    ans = RingAnswer(cps, region_mb, ring_min, ring_max)
    passes: dict[int, Probe] = {}
    fails: dict[int, Probe] = {}

    def probe(ring: int) -> Generator[list[Point], Rows, Probe]:
        p = yield from ctx.check(lambda s: _point(cps, ring, scale, s), ring)
        ans.probes.append(p)
        (passes if p.passed else fails)[ring] = p
        return p

    hi = ring_max
    lo = ring_min - 1  # largest ring known to fail (ring_min - 1: none tested yet)
    region = min(max(math.ceil(region_mb), ring_min), ring_max)
    first = yield from probe(region)
    if first.passed:
        hi = region
        if region - 1 >= ring_min:  # usually the boundary: a full chunk no longer fits
            p = yield from probe(region - 1)
            if p.passed:
                hi = region - 1
            else:
                lo = region - 1
    else:
        lo = region
        ring = region
        found = False
        while ring < ring_max:  # gallop: 2, 4, 8, ... regions, then the largest ring
            ring = min(ring * 2, ring_max)
            p = yield from probe(ring)
            if p.passed:
                hi, found = ring, True
                break
            lo = ring
        if not found:
            ans.below = fails[lo]
            return ans
    while hi - lo > 1 and hi > max(lo, 1) * (1 + tolerance):
        mid = round(math.sqrt(max(lo, ring_min / 2, 0.5) * hi))
        mid = min(max(mid, lo + 1), hi - 1)
        p = yield from probe(mid)
        if p.passed:
            hi = mid
        else:
            lo = mid
    ans.best = passes[hi]
    ans.below = fails.get(lo)
    return ans


@dataclass
class CapacityAnswer:
    """The capacity search of one (cps, ring) pair."""

    cps: int
    ring: int
    best: Probe | None = None      # the largest passing rate scale
    above: Probe | None = None     # the smallest failing scale over it
    capped: bool = False           # every scale up to max_scale passed
    probes: list[Probe] = field(default_factory=list)

    @property
    def scale(self) -> float | None:
        return self.best.value if self.best else None


def capacity_search(ctx: Context, cps: int, ring: int, max_scale: float, tolerance: float,
                    min_scale: float = 1 / 16, start: float = 1.0
                    ) -> Generator[list[Point], Rows, CapacityAnswer]:
    """The largest request-rate scale that ``ring`` MiB sustains with ``cps``: ``start``, then
    doubling until a failure (halving when ``start`` fails), then bisection."""
    ans = CapacityAnswer(cps, ring)

    def probe(scale: float) -> Generator[list[Point], Rows, Probe]:
        scale = round(scale, 3)
        p = yield from ctx.check(lambda s: _point(cps, ring, scale, s), scale)
        ans.probes.append(p)
        return p

    lo: Probe | None = None
    hi: Probe | None = None
    first = yield from probe(start)
    if first.passed:
        lo = first
        scale = 2.0 * start
        while scale <= max_scale * (1 + 1e-9):
            p = yield from probe(scale)
            if not p.passed:
                hi = p
                break
            lo = p
            scale *= 2
        if hi is None:
            if lo.value < max_scale:
                p = yield from probe(max_scale)
                if p.passed:
                    lo = p
                else:
                    hi = p
            if hi is None:
                ans.best, ans.capped = lo, True
                return ans
    else:
        hi = first
        scale = 0.5 * start
        while scale >= min_scale:
            p = yield from probe(scale)
            if p.passed:
                lo = p
                break
            hi = p
            scale /= 2
        if lo is None:
            ans.above = hi
            return ans
    while hi.value > lo.value * (1 + tolerance):
        mid = round(math.sqrt(lo.value * hi.value), 3)
        if not lo.value < mid < hi.value:
            break
        p = yield from probe(mid)
        if p.passed:
            lo = p
        else:
            hi = p
    ans.best, ans.above = lo, hi
    return ans


# Running searches on an executor ----------------------------------------------------------------

class Scheduler:
    """Advances search coroutines: submits the points they ask for (each point once, reusing
    rows already in the result file) and sends rows back when all of a request has finished."""

    def __init__(self, job: Job, executor: Executor, results: ResultsFile | None,
                 bar: Any = None) -> None:
        self.job = job
        self.executor = executor
        self.results = results
        self.bar = bar
        self.fp = job.fingerprint
        self.cache: dict[Point, dict[str, Any]] = {}
        self._known = results.done_rows() if results is not None else {}
        self._inflight: set[Point] = set()
        self._reserved = 0  # searches about to ask for points in this round
        self.ran = 0
        self.reused = 0

    def free_slots(self) -> int:
        """Slots no point occupies and no search about to ask in this round will claim."""
        return max(0, self.executor.slots - len(self._inflight) - self._reserved)

    def known(self, point: Point) -> dict[str, Any] | None:
        """The row of ``point`` if it already ran (now or in the result file)."""
        return self._lookup(point)

    def _lookup(self, point: Point) -> dict[str, Any] | None:
        row = self.cache.get(point)
        if row is None:
            known = self._known.get(point_id(self.fp, point))
            if known is not None:
                row = self.cache[point] = dict(known)
                self.reused += 1
        return row

    def run(self, searches: dict[Any, Search]) -> dict[Any, Any]:
        waiting: dict[Any, list[Point]] = {}
        out: dict[Any, Any] = {}

        def advance(key: Any, send: Rows | None) -> None:
            gen = searches[key]
            try:
                while True:
                    req = next(gen) if send is None else gen.send(send)
                    rows = [self._lookup(p) for p in req]
                    if all(r is not None for r in rows):
                        send = [dict(r) for r in rows if r is not None]
                        continue
                    waiting[key] = req
                    for p, r in zip(req, rows, strict=True):
                        if r is None and p not in self._inflight:
                            self._inflight.add(p)
                            self.executor.submit(p)
                    return
            except StopIteration as stop:
                out[key] = stop.value

        self._reserved = len(searches)
        for key in searches:
            self._reserved -= 1
            advance(key, None)
        while waiting:
            for point, row in self.executor.wait():
                self._inflight.discard(point)
                self.cache[point] = row
                self.ran += 1
                if self.results is not None:
                    self.results.append(row)
                if self.bar is not None:
                    self.bar.update(1)
            ready = [k for k, req in waiting.items() if all(p in self.cache for p in req)]
            self._reserved = len(ready)
            for key in ready:
                self._reserved -= 1
                req = waiting.pop(key)
                advance(key, [dict(self.cache[p]) for p in req])
        return out


# The advice -------------------------------------------------------------------------------------

def nice_ring(mb: float) -> int:
    """``mb`` rounded up to a size a person would configure: a multiple of an eighth of the
    power of two below it (700 -> 704, 875 -> 896, 1025 -> 1152)."""
    if mb <= 8:
        return max(1, math.ceil(mb))
    step = 2 ** math.floor(math.log2(mb)) / 8
    return int(math.ceil(mb / step) * step)


@dataclass
class Candidate:
    cps: int
    region_mb: float
    ring: RingAnswer | None = None
    recommended_ring: int | None = None
    capacity: CapacityAnswer | None = None

    @property
    def feasible(self) -> bool:
        if self.ring is not None:
            return self.ring.feasible
        return self.capacity is not None and self.capacity.best is not None


@dataclass
class Advice:
    """Everything ``twin advise`` found: one candidate per chunk size and the pick."""

    candidates: list[Candidate]
    budgets: Budgets
    seeds: tuple[int, ...]
    headroom: float
    pick: Candidate | None
    reasons: list[str]
    ran: int
    reused: int
    wall_s: float
    notes: list[str] = field(default_factory=list)

    def table(self) -> str:
        """A Markdown table of the candidates, to paste into a review."""
        pct = self.budgets.percentile
        head = ["chunked_prefill_size", "chunk region (MiB)", "smallest ring (MiB)",
                f"TTFT p{pct} there", "deferrals/req", "fails below because",
                "recommended ring (MiB)", "max rate x", "limited by"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for c in self.candidates:
            r = c.ring
            best = r.best.first if r and r.best else None
            below = r.below.why if r and r.below else "-"
            if r and not r.feasible:
                below = f"fails even at {r.ring_max} MiB: {r.below.why if r.below else '?'}"
            cap = c.capacity
            if cap and cap.best:
                scale = f">= {cap.best.value:g}" if cap.capped else f"{cap.best.value:g}"
            elif cap:
                scale = "< 1/16" if cap.above else "-"
            else:
                scale = "-"
            limit = "-"
            if cap and cap.above:
                limit = limiting_factor(cap.above.failing).kind
            elif r and not r.feasible and r.below:
                limit = limiting_factor(r.below.failing).kind
            elif r and r.below:
                limit = "ring"
            mark = " (pick)" if c is self.pick else ""
            cells = [f"{c.cps}{mark}", f"{c.region_mb:g}",
                     str(r.min_ring) if r and r.min_ring else ("-" if r is None else "none"),
                     fmt_s(best.get(f"ttft_p{pct}")) if best else "-",
                     f"{best.get('deferrals_per_request') or 0:.2f}" if best else "-",
                     below.replace("|", "/"),
                     str(c.recommended_ring or "-"), scale, limit]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        def probe(p: Probe | None) -> dict[str, Any] | None:
            if p is None:
                return None
            r = p.first
            return {"value": p.value, "passed": p.passed, "why": p.why,
                    "ttft_p99": r.get("ttft_p99"), "tpot_p99": r.get("tpot_p99"),
                    "deferrals_per_request": r.get("deferrals_per_request"),
                    "limit": str(limiting_factor(p.failing)) if not p.passed else None}

        cands = []
        for c in self.candidates:
            cands.append({
                "chunked_prefill_size": c.cps, "chunk_region_mb": c.region_mb,
                "smallest_ring_mb": c.ring.min_ring if c.ring else None,
                "at_smallest_ring": probe(c.ring.best) if c.ring else None,
                "below_smallest_ring": probe(c.ring.below) if c.ring else None,
                "ring_probes": len(c.ring.probes) if c.ring else 0,
                "recommended_ring_mb": c.recommended_ring,
                "max_rate_scale": c.capacity.scale if c.capacity else None,
                "rate_scale_capped": c.capacity.capped if c.capacity else None,
                "first_failing_scale": probe(c.capacity.above) if c.capacity else None,
            })
        pick = None
        if self.pick is not None:
            pick = {"chunked_prefill_size": self.pick.cps,
                    "staging_pool_size_mb": self.pick.recommended_ring,
                    "env": f"SGLANG_DISAGG_STAGING_POOL_SIZE_MB={self.pick.recommended_ring}",
                    "max_rate_scale": self.pick.capacity.scale if self.pick.capacity else None}
        return {"budgets": {"ttft_s": self.budgets.ttft_s, "tpot_s": self.budgets.tpot_s,
                            "percentile": self.budgets.percentile},
                "seeds": list(self.seeds), "headroom": self.headroom, "candidates": cands,
                "recommendation": pick, "reasons": self.reasons, "notes": self.notes,
                "runs": self.ran, "reused_runs": self.reused, "wall_s": round(self.wall_s, 2)}


def advise(job: Job, executor: Executor, cps_candidates: Sequence[int], *,
           budgets: Budgets = Budgets(), seeds: Sequence[int] = (0, 1),
           ring_min: int = 1, ring_max: int | None = None, ring: int | None = None,
           tolerance: float = 0.1, headroom: float = 0.25, capacity: str = "pick",
           rate_scale: float = 1.0,
           max_scale: float = 8.0, prefer: str = "ring",
           results: ResultsFile | None = None, progress: bool = False) -> Advice:
    """Search ring sizes and capacities for each candidate and recommend a pair.

    ``ring``: skip the ring search and compare the candidates at this ring (capacity search for
    each). ``rate_scale``: size for the workload arriving this many times faster (growth). ``capacity``: ``pick`` (the recommended pair only), ``all`` or ``none``. ``prefer``:
    ``ring`` (the smallest recommended ring wins; ties go to the lower TTFT) or ``capacity``
    (the largest sustained rate scale wins; implies capacity searches for all).
    Give ``job`` an :class:`~twin.advise.space.EarlyStop` (see :func:`early_stop_for`) to stop
    runs as soon as they have failed for certain; it must be no stricter than ``budgets``.
    """
    from twin.advise.sweep import progress_bar

    if capacity not in ("pick", "all", "none"):
        raise ValueError(f"capacity must be pick, all or none, got {capacity!r}")
    if prefer not in ("ring", "capacity"):
        raise ValueError(f"prefer must be ring or capacity, got {prefer!r}")
    es = job.base.early_stop
    if es is not None and (budgets.ttft_s is None or es.ttft_s < budgets.ttft_s
                           or es.percentile > budgets.percentile):
        raise ValueError(f"the job's early stop (p{es.percentile} TTFT {es.ttft_s:g} s) is "
                         f"stricter than the budgets ({budgets.describe()})")
    if prefer == "capacity" or ring is not None:
        capacity = "all"
    t0 = time.perf_counter()
    cfg = job.base.cfg
    if ring_max is None:
        ring_max = max(64, 4 * math.ceil(cfg.ring_bytes / MiB))
    notes: list[str] = []
    bar = progress_bar(None, progress, "advise")
    sched = Scheduler(job, executor, results, bar)
    ctx = Context(seeds, budgets, sched.free_slots, sched.known)
    candidates = []
    for cps in dict.fromkeys(int(c) for c in cps_candidates):
        region = chunk_region_bytes(cfg.replace(chunked_prefill_size=cps)) / MiB
        candidates.append(Candidate(cps, round(region, 3)))
    try:
        if ring is None:
            answers = sched.run({c.cps: ring_search(ctx, c.cps, c.region_mb, ring_min, ring_max,
                                                    tolerance, rate_scale)
                                 for c in candidates})
            for c in candidates:
                c.ring = answers[c.cps]
                if c.ring.min_ring is not None:
                    c.recommended_ring = min(nice_ring(c.ring.min_ring * (1 + headroom)),
                                             max(ring_max, c.ring.min_ring))
        else:
            for c in candidates:
                c.recommended_ring = ring
        chosen = [c for c in candidates if c.recommended_ring is not None]
        if capacity == "pick" and prefer == "ring":
            pick0 = _pick_by_ring(chosen)
            chosen = [pick0] if pick0 else []
        if capacity != "none" and chosen:
            caps = sched.run({c.cps: capacity_search(ctx, c.cps, int(c.recommended_ring or 0),
                                                     max(max_scale, rate_scale), tolerance,
                                                     start=rate_scale) for c in chosen})
            for c in chosen:
                c.capacity = caps[c.cps]
    finally:
        if bar is not None:
            bar.close()
    if budgets.tpot_s is not None and not any(
            isinstance(r.get(f"tpot_p{budgets.percentile}"), (int, float))
            for r in sched.cache.values()):
        notes.append("the simulator reports no TPOT for these runs; the TPOT budget was not "
                     "applied")
    pick, reasons = _recommend(candidates, prefer, budgets, seeds, headroom, ring is not None)
    if rate_scale != 1.0:
        notes.append(f"sized for the workload arriving {rate_scale:g}x as fast as recorded")
    return Advice(candidates, budgets, tuple(seeds), headroom, pick, reasons, sched.ran,
                  sched.reused, time.perf_counter() - t0, notes)


def early_stop_for(budgets: Budgets) -> EarlyStop | None:
    """The early stop that matches ``budgets`` (None without a TTFT budget)."""
    if budgets.ttft_s is None:
        return None
    return EarlyStop(ttft_s=budgets.ttft_s, percentile=budgets.percentile)


def _ttft_at(c: Candidate) -> float:
    if c.ring and c.ring.best:
        v = c.ring.best.first.get("ttft_p99")
        return float(v) if isinstance(v, (int, float)) else math.inf
    return math.inf


def _scale(c: Candidate) -> float:
    return (c.capacity.scale if c.capacity else None) or 0.0


def _pick_by_ring(cands: list[Candidate]) -> Candidate | None:
    ok = [c for c in cands if c.recommended_ring is not None and c.feasible]
    if not ok:
        return None
    return min(ok, key=lambda c: (c.recommended_ring, _ttft_at(c), -c.cps))


def _recommend(candidates: list[Candidate], prefer: str, budgets: Budgets, seeds: Sequence[int],
               headroom: float, fixed_ring: bool) -> tuple[Candidate | None, list[str]]:
    seeds_txt = ", ".join(map(str, seeds))
    if prefer == "capacity" or fixed_ring:
        ok = [c for c in candidates if c.capacity and c.capacity.best]
        pick = max(ok, key=lambda c: (_scale(c), -(c.recommended_ring or 0)),
                   default=None) if ok else None
    else:
        pick = _pick_by_ring(candidates)
    if pick is None:
        reasons = [f"no candidate runs the workload cleanly within {budgets.describe()} on "
                   f"seeds {seeds_txt}"]
        for c in candidates:
            failing = None
            if c.ring and c.ring.below:
                failing = c.ring.below
            elif c.capacity and c.capacity.above:
                failing = c.capacity.above
            if failing is not None:
                reasons.append(f"chunked_prefill_size {c.cps}: {failing.why}; limited by "
                               f"{limiting_factor(failing.failing)}")
        return None, reasons
    ring_mb = pick.recommended_ring or 0
    pct = budgets.percentile
    reasons = [f"chunked_prefill_size {pick.cps} with a {ring_mb} MiB staging ring per decode "
               f"rank (SGLANG_DISAGG_STAGING_POOL_SIZE_MB={ring_mb})."]
    if pick.ring and pick.ring.best:
        best = pick.ring.best.first
        smallest = pick.ring.min_ring or 1
        reasons.append(
            f"The smallest ring that passes ({budgets.describe()}; no wedge, failure or "
            f"corruption; seeds {seeds_txt}) is {smallest} MiB "
            f"({smallest / pick.region_mb:.1f} chunk regions of {pick.region_mb:g} MiB), "
            f"with TTFT p{pct} {fmt_s(best.get(f'ttft_p{pct}'))}; the recommendation adds "
            f"{ring_mb / smallest - 1:.0%} headroom.")
        if pick.ring.below:
            reasons.append(f"At {int(pick.ring.below.value)} MiB it fails: {pick.ring.below.why}.")
    others = [c for c in candidates if c is not pick and c.ring is not None]
    if others and prefer == "ring" and not fixed_ring:
        parts = []
        for c in others:
            if c.ring and c.ring.min_ring:
                parts.append(f"{c.cps}: {c.ring.min_ring} MiB")
            else:
                parts.append(f"{c.cps}: none up to {c.ring.ring_max if c.ring else '?'} MiB")
        reasons.append("Smallest passing rings of the other candidates: " + "; ".join(parts) + ".")
    cap = pick.capacity
    if cap is not None and cap.best is not None:
        if cap.capped:
            reasons.append(f"Margin: it sustains at least {cap.best.value:g}x the workload's "
                           f"request rate (the largest scale tried).")
        else:
            lim = limiting_factor(cap.above.failing) if cap.above else None
            reasons.append(
                f"Margin: it sustains {cap.best.value:g}x the workload's request rate; at "
                f"{cap.above.value if cap.above else '?':g}x it fails "
                f"({cap.above.why if cap.above else '?'}), limited by {lim}.")
            if cap.best.value < THIN_MARGIN:
                reasons.append(
                    f"That margin is thin: to leave room for {THIN_MARGIN - 1:.0%} more traffic, "
                    f"size for it (--rate-scale {THIN_MARGIN:g}) or raise the headroom.")
    elif cap is not None and cap.above is not None:
        reasons.append(f"Warning: at the recommended ring the workload itself fails on a seed "
                       f"({cap.above.why}); the ring search's answer is not stable.")
    return pick, reasons


def probes_json(advice: Advice) -> str:
    return json.dumps(advice.to_dict(), indent=2, sort_keys=True, default=str)
