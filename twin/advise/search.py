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

Both searches are decision procedures replayed against the runs so far: a verdict is read
from a run, or implied by one (a larger ring never fails, nor a lower rate, where a run passed;
the monotonicity every bisection assumes), or guessed (a ring search borrows the larger chunk
sizes' first verdicts: a workload's ring need hardly depends on the chunk size once a chunk
fits). Guesses only decide which probes run first; the answer is the one probing every value
the procedure names would give. The capacity search starts from the ring search's verdict.

Each probe runs its first seed alone and the others only if it passed (a failing ring is
usually found on the first seed), unless slots would otherwise sit idle, in which case the
seeds run together. The searches of all candidates run at once, sharing one executor, the
provisional pick's capacity search in slots the ring searches leave idle; every probe is a
sweep point, so the probes land in an ordinary result file, and a rerun with the same file
reuses them.

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
from collections.abc import Callable, Generator, Iterable, Sequence
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
        """The first seed's row (empty for a verdict implied by other runs)."""
        return self.rows[0] if self.rows else {}

    @property
    def failing(self) -> dict[str, Any]:
        for r in self.rows:
            if r.get("outcome") != "clean" or not r.get("_ok", True):
                return r
        return self.rows[-1]


class Need(list[Point]):
    """What a search asks for: the points it needs before it can go on (the list itself), and
    points it may need next, which the scheduler runs only in slots that would otherwise sit
    idle (a point started that way is kept for whoever asks for it later): ``maybe``, new
    settings, and ``spare``, the other seeds of a setting asked for on its first seed."""

    def __init__(self, points: Iterable[Point] = (), maybe: Iterable[Point] = (),
                 spare: Iterable[Point] = ()) -> None:
        super().__init__(points)
        self.maybe = tuple(maybe)
        self.spare = tuple(spare)


Check = tuple[Callable[[int], Point], float, bool]
"""A setting to probe: the point of each seed, its value, and whether to run every seed at
once (a setting expected to pass) rather than the first seed alone."""


def _point(cps: int, ring: int, scale: float, seed: int) -> Point:
    return Point(((CPS, int(cps)), (RATE_SCALE, float(scale)), (RING, int(ring))), seed)


def _seeds_of(point: Point) -> Callable[[int], Point]:
    """``point`` with another seed."""
    return lambda seed: Point(point.assign, seed)


def _coords(point: Point) -> tuple[int, float, int]:
    """``(cps, rate scale, ring)`` of an advise point."""
    values = dict(point.assign)
    return int(values[CPS]), float(values[RATE_SCALE]), int(values[RING])


class Context:
    """What the searches share: the seeds, budgets, a view of free executor slots, and every
    row any of them received (``rows``), from which verdicts are read and implied."""

    def __init__(self, seeds: Sequence[int], budgets: Budgets,
                 free_slots: Callable[[], int],
                 known: Callable[[Point], dict[str, Any] | None] | None = None) -> None:
        self.seeds = tuple(seeds)
        self.budgets = budgets
        self.free_slots = free_slots
        self.known = known or (lambda p: None)
        self.rows: dict[Point, dict[str, Any]] = {}
        self._by_cps: dict[int, list[tuple[float, int, int, bool]]] = {}

    def passes(self, row: dict[str, Any]) -> bool:
        """Whether ``row`` passes, noted in the row (``_ok``) for :attr:`Probe.failing`."""
        if "_ok" not in row:
            row["_ok"] = judge(row, self.budgets)[0]
        return bool(row["_ok"])

    def receive(self, points: Sequence[Point], rows: Rows) -> Rows:
        """Note the rows of ``points`` (advise points: cps, rate scale and ring axes)."""
        rows = list(rows)
        for point, row in zip(points, rows, strict=True):
            if point not in self.rows:
                self.rows[point] = row
                cps, scale, ring = _coords(point)
                self._by_cps.setdefault(cps, []).append((scale, ring, point.seed,
                                                         self.passes(row)))
        return rows

    def verdict(self, cps: int, ring: int, scale: float) -> bool | None:
        """Whether ``cps`` with a ``ring`` MiB ring at rate ``scale`` passes on every seed, from
        the rows run: a seed passes where it passed with no larger rate and no smaller ring,
        and fails where it failed with no smaller rate and no larger ring (the monotonicity
        every bisection here assumes). False once a seed fails; None while unknown, or where
        the rows contradict each other."""
        unknown = False
        for seed in self.seeds:
            ok = self.seed_verdict(cps, ring, scale, seed)
            if ok is False:
                return False
            unknown = unknown or ok is None
        return None if unknown else True

    def seed_verdict(self, cps: int, ring: int, scale: float, seed: int) -> bool | None:
        """:meth:`verdict` on one seed."""
        row = self.rows.get(_point(cps, ring, scale, seed))
        if row is not None:
            return self.passes(row)
        runs = self._by_cps.get(cps, ())
        up = any(ok for s, r, sd, ok in runs if sd == seed and ok and r <= ring and s >= scale)
        down = any(not ok for s, r, sd, ok in runs
                   if sd == seed and not ok and r >= ring and s <= scale)
        return up if up != down else None

    def probe(self, make: Callable[[int], Point], value: float) -> Probe | None:
        """The probe of ``value`` from the rows run (in seed order): failed on the first seed
        that failed, passed if every seed ran and passed; None without a row."""
        rows = [r for r in (self.rows.get(make(s)) for s in self.seeds) if r is not None]
        if not rows:
            return None
        for row in rows:
            if not self.passes(row):
                why = f"{judge(row, self.budgets)[1]} (seed {row.get('seed')})"
                return Probe(value, False, why, rows)
        return Probe(value, len(rows) == len(self.seeds), "passed", rows)

    def settled(self, make: Callable[[int], Point], ok: bool) -> bool:
        """Whether rows were run that show the verdict ``ok`` themselves: every seed passed, or
        one failed."""
        rows = [self.rows.get(make(s)) for s in self.seeds]
        if ok:
            return all(r is not None and self.passes(r) for r in rows)
        return any(r is not None and not self.passes(r) for r in rows)

    def probes_of(self, which: Callable[[Point], bool], value: Callable[[Point], float]
                  ) -> list[Probe]:
        """The probes of the points ``which`` selects, one per ``value``, in the order run."""
        out: dict[float, Probe] = {}
        for point in self.rows:
            if which(point) and value(point) not in out:
                v = value(point)
                probe = self.probe(_seeds_of(point), v)
                if probe is not None:
                    out[v] = probe
        return list(out.values())

    def check_all(self, checks: Sequence[Check], spare: bool = False,
                  maybe: Sequence[Point] = (), complete: bool = True
                  ) -> Generator[list[Point], Rows, None]:
        """Run several settings at once (see :data:`Check`) and note their rows; a setting
        that passed its first seed then runs its other seeds, unless not ``complete``
        (``spare``: offered to idle slots meanwhile, after the points ``maybe``)."""
        seeds = self.seeds
        heads = [seeds if every else seeds[:1] for _, _, every in checks]
        points = [make(s) for (make, _, _), h in zip(checks, heads, strict=True) for s in h]
        later = [make(s) for (make, _, _), h in zip(checks, heads, strict=True)
                 for s in seeds[len(h):]] if spare else []
        self.receive(points, (yield Need(points, maybe, later)))
        more = [make(s) for (make, _, _), h in zip(checks, heads, strict=True)
                if len(h) < len(seeds) and all(self.passes(self.rows[make(s)]) for s in h)
                for s in seeds[len(h):]]
        if more and complete:
            self.receive(more, (yield more))


# The searches' decisions ------------------------------------------------------------------------
#
# Each search is a decision procedure (it names a value, is told whether it passes, and names the
# next) replayed against verdicts read and implied from the rows run so far. Where a verdict is
# unknown, a guess may stand in for it: the replay then runs the most telling guessed values (the
# largest guessed failure and the smallest guessed pass, which imply every other guess on the
# path when they come true) and replays again. A wrong guess costs probes, never the answer: the
# answer is the procedure's own on real and implied verdicts, the one probing every value it
# names would give.

Steps = Generator[float, bool, tuple[float | None, float | None, bool]]
"""A decision procedure: yields the value to judge, receives its verdict; returns (the passing
end, the failing end, whether the passing end is the largest value allowed)."""


def ring_steps(region: int, ring_min: int, ring_max: int, tolerance: float) -> Steps:
    """The ring search: the region (one full chunk), then one MiB less if it passed (usually
    the boundary: a full chunk no longer fits), else doubling until a ring passes (none up to
    ``ring_max``: no ring helps), then bisection with geometric midpoints until the bracket is
    within ``tolerance``."""
    hi: int | None = None
    lo = ring_min - 1  # the largest failing ring (ring_min - 1: none tested)
    if (yield region):
        hi = region
        if region - 1 >= ring_min:
            if (yield region - 1):
                hi = region - 1
            else:
                lo = region - 1
    else:
        lo = ring = region
        while ring < ring_max:
            ring = min(ring * 2, ring_max)
            if (yield ring):
                hi = ring
                break
            lo = ring
        if hi is None:
            return None, lo, False
    while hi - lo > 1 and hi > max(lo, 1) * (1 + tolerance):
        mid = round(math.sqrt(max(lo, ring_min / 2, 0.5) * hi))
        mid = min(max(mid, lo + 1), hi - 1)
        if (yield mid):
            hi = mid
        else:
            lo = mid
    return hi, (lo if lo >= ring_min else None), False


def capacity_steps(start: float, max_scale: float, min_scale: float, tolerance: float) -> Steps:
    """The capacity search: ``start``, then doubling until a failure (halving when ``start``
    fails), then bisection with geometric midpoints; values rounded to 1/1000."""
    lo: float | None = None
    hi: float | None = None
    first = round(start, 3)
    if (yield first):
        lo = first
        scale = 2.0 * start
        while scale <= max_scale * (1 + 1e-9):
            value = round(scale, 3)
            if not (yield value):
                hi = value
                break
            lo = value
            scale *= 2
        if hi is None:
            if lo < max_scale:
                value = round(max_scale, 3)
                if (yield value):
                    lo = value
                else:
                    hi = value
            if hi is None:
                return lo, None, True
    else:
        hi = first
        scale = 0.5 * start
        while scale >= min_scale:
            value = round(scale, 3)
            if (yield value):
                lo = value
                break
            hi = value
            scale /= 2
        if lo is None:
            return None, hi, False
    while hi > lo * (1 + tolerance):
        mid = round(math.sqrt(lo * hi), 3)
        if not lo < mid < hi:
            break
        if (yield mid):
            lo = mid
        else:
            hi = mid
    return lo, hi, False


Verdict = Callable[[float], bool | None]


def replay(ctx: Context, steps: Callable[[], Steps],
           make: Callable[[float], Callable[[int], Point]], verdict: Verdict, guess: Verdict,
           upward: bool, quoted: Callable[[tuple[float | None, float | None]],
                                          list[tuple[float, bool]]], ahead: bool = False
           ) -> Generator[list[Point], Rows, tuple[float | None, float | None, bool]]:
    """Replay ``steps`` until every verdict on its path is known (run, or implied by runs),
    running what it needs, and return its result. ``verdict``: the known verdict of a value;
    ``guess``: a stand-in for an unknown one (None: none); ``upward``: passing is monotone
    upward in the value (ring), not downward (rate scale). ``quoted((passing end, failing
    end))``: the values whose rows the answer quotes, with whether they pass, run if only
    implied so far. ``ahead``: a value with neither runs on its first seed alone, with the
    value named next should it pass offered to idle slots before its other seeds, and guesses
    are run only once the path is complete."""
    while True:
        guessed: list[tuple[float, bool]] = []
        needed: float | None = None
        spare = False  # offer the other seeds of a first seed to idle slots
        lead = False  # run a first seed alone, its verdict standing in for the others'
        after: list[Point] = []
        result: tuple[float | None, float | None, bool] = (None, None, False)
        gen = steps()
        try:
            value = next(gen)
            while True:
                known = verdict(value)
                if known is None:
                    known = guess(value)
                    if known is None:
                        needed = value
                        if ahead:
                            after = [make(gen.send(True))(ctx.seeds[0])]
                        break
                    guessed.append((value, known))
                value = gen.send(known)
        except StopIteration as stop:
            result = stop.value
        if guessed and (needed is None or not ahead):
            # the largest guessed failure and smallest guessed pass (downward: the reverse)
            # imply every other guess on the path when they come true
            fails = [v for v, ok in guessed if not ok]
            passes = [v for v, ok in guessed if ok]
            worst, best = (max, min) if upward else (min, max)
            checks = [(make(worst(fails)), worst(fails), False)] if fails else []
            if passes:  # every seed at once if slots are free for them (beside the failure)
                room = ctx.free_slots() >= len(ctx.seeds) + bool(fails)
                checks.append((make(best(passes)), best(passes), room))
            spare = True
        elif needed is not None:
            together = not ahead and ctx.free_slots() >= len(ctx.seeds) \
                and ctx.known(make(needed)(ctx.seeds[0])) is None
            checks = [(make(needed), needed, together)]
            spare, lead = True, ahead
        else:
            checks = [(make(v), v, ok) for v, ok in quoted(result[:2])
                      if not ctx.settled(make(v), ok)]
            if not checks:
                return result
        yield from ctx.check_all(checks, spare, after, complete=not lead)


def first_ring(region_mb: float, ring_min: int, ring_max: int) -> int:
    """A ring search's first probe: one chunk region (the smallest ring that holds a full
    chunk), within the bounds."""
    return min(max(math.ceil(region_mb), ring_min), ring_max)


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
                tolerance: float, scale: float = 1.0, firsts: dict[int, int] | None = None
                ) -> Generator[list[Point], Rows, RingAnswer]:
    """The smallest passing ring in ``[ring_min, ring_max]`` MiB for ``cps`` with the workload
    at rate ``scale``: the decisions of :func:`ring_steps`, with verdicts implied by any run of
    ``cps`` where they can be.

    ``firsts``: the first ring (region) of every candidate by chunk size. Before its first
    decision the search waits for the first probes (first seed) of the candidates with larger
    regions, largest first, down to the first that failed; these stand in for this candidate's
    unknown verdicts, on the rule that a workload's ring need, once a chunk fits, hardly
    depends on the chunk size: a ring passes from the smallest of them that passed up, and
    fails up to one that failed. Between the two, the guess is a failure (the need is probably
    the passing one's: a bisection there is settled by its last probe), except at this
    candidate's own region, which is probed; below the region, a failure (no full chunk
    fits). Once this candidate's own verdicts contradict the larger regions' (or a ring below
    the passing region passes), those guesses (or the failure between) stop. Guesses only
    choose which probes run: the answer is the decisions' own on real and implied verdicts."""
    firsts = firsts or {}
    region = first_ring(region_mb, ring_min, ring_max)
    seed0 = ctx.seeds[0]
    # What the larger chunk sizes' regions say of the need (first seed; largest first, down to
    # the first that failed): it is at most the smallest that passed, more than one that failed.
    need_hi = need_lo = None
    larger = sorted(((r, c) for c, r in firsts.items() if r > region), reverse=True)
    for k, (ring, other) in enumerate(larger):
        point = _point(other, ring, scale, seed0)
        rows = ctx.receive([point], (yield Need([point], [_point(c, r, scale, seed0)
                                                          for r, c in larger[k + 1:]])))
        if not ctx.passes(rows[0]):
            need_lo = ring
            break
        need_hi = ring

    def make(ring: float) -> Callable[[int], Point]:
        return lambda s: _point(cps, int(ring), scale, s)

    def verdict(ring: float) -> bool | None:
        return ctx.verdict(cps, int(ring), scale)

    def guess(ring: float) -> bool | None:
        if ring < region:
            return False  # no full chunk fits
        own = [(r, verdict(r)) for r in {_coords(p)[2] for p in ctx.rows
                                         if _coords(p)[:2] == (cps, scale)}]
        if any(ok is False and need_hi is not None and r >= need_hi
               or ok and need_lo is not None and r <= need_lo for r, ok in own):
            return None  # the rule does not hold here: guess nothing more
        if need_hi is not None and ring >= need_hi:
            return True
        if need_lo is not None and ring <= need_lo:
            return False
        if ring == region or need_hi is None or any(ok and r < need_hi for r, ok in own):
            return None  # the need is below the passing region: no more first guesses
        return False

    good, bad, _ = yield from replay(
        ctx, lambda: ring_steps(region, ring_min, ring_max, tolerance), make, verdict, guess,
        True, lambda ends: [(v, ok) for v, ok in zip(ends, (True, False), strict=True)
                            if v is not None])
    ans = RingAnswer(cps, region_mb, ring_min, ring_max)
    ans.best = ctx.probe(make(good), good) if good is not None else None
    ans.below = ctx.probe(make(bad), bad) if bad is not None else None
    ans.probes = ctx.probes_of(lambda p: _coords(p)[0] == cps and _coords(p)[1] == scale,
                               lambda p: _coords(p)[2])
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
    """The largest request-rate scale that ``ring`` MiB sustains with ``cps``: the decisions
    of :func:`capacity_steps`, with verdicts implied by any run of ``cps`` where they can be (a
    pass at a smaller ring, such as the ring search's smallest passing ring at ``start``,
    stands for a pass at ``start``). The first seed leads: a scale runs on it alone (the next
    scale should it pass, then its other seeds, offered to idle slots), and its verdict stands
    in until the path is complete; then the largest scale guessed to pass runs on every seed,
    which implies the others below it. The largest passing scale may be implied only; the
    smallest failing one is run."""

    def make(scale: float) -> Callable[[int], Point]:
        return lambda s: _point(cps, ring, scale, s)

    good, bad, capped = yield from replay(
        ctx, lambda: capacity_steps(start, max_scale, min_scale, tolerance), make,
        lambda scale: ctx.verdict(cps, ring, scale),
        lambda scale: ctx.seed_verdict(cps, ring, scale, ctx.seeds[0]), False,
        lambda ends: [(ends[1], False)] if ends[1] is not None else [], ahead=True)
    ans = CapacityAnswer(cps, ring, capped=capped)
    if good is not None:
        ans.best = ctx.probe(make(good), good)
        if ans.best is None or not ans.best.passed:
            ans.best = Probe(good, True, "implied by a pass at a smaller ring or a higher rate",
                             ans.best.rows if ans.best else [])
    ans.above = ctx.probe(make(bad), bad) if bad is not None else None
    ans.probes = ctx.probes_of(lambda p: _coords(p)[0] == cps and _coords(p)[2] == ring,
                               lambda p: _coords(p)[1])
    return ans


# Running searches on an executor ----------------------------------------------------------------

class Scheduler:
    """Advances search coroutines: runs the points they need (each point once, reusing rows
    already in the result file), at most as many at a time as the executor has slots, and sends
    rows back once all of a request has finished.

    Needed points start longest first (the smallest chunk size: the most chunks to simulate),
    then in the order asked. A slot that would otherwise sit idle runs, in this order, a new
    setting a search may need next (:class:`Need` ``maybe``), a point a background search needs
    (one whose answer may not be used: :meth:`start`, :meth:`promote`), one it may need next,
    or another seed of a setting being run on its first (``spare``)."""

    def __init__(self, job: Job, executor: Executor, results: ResultsFile | None,
                 bar: Any = None) -> None:
        self.job = job
        self.executor = executor
        self.results = results
        self.bar = bar
        self.fp = job.fingerprint
        self.cache: dict[Point, dict[str, Any]] = {}
        self.done: dict[Any, Any] = {}
        self.on_done: Callable[[Any, Any], None] | None = None
        """Called with a search's key and answer when it finishes (it may start others)."""
        self._known = results.done_rows() if results is not None else {}
        self._searches: dict[Any, Search] = {}
        self._background: dict[Any, None] = {}  # in the order started
        self._waiting: dict[Any, list[Point]] = {}
        self._queue: dict[Point, int] = {}  # needed points not started: the order asked
        self._asked = 0
        self._inflight: set[Point] = set()
        self._reserved = 0  # searches about to ask for points in this round
        self.ran = 0
        self.reused = 0

    def free_slots(self) -> int:
        """Slots no point occupies or is queued for and no search about to ask will claim."""
        return max(0, self.executor.slots - len(self._inflight) - len(self._queue)
                   - self._reserved)

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

    def _open(self, point: Point) -> bool:
        """Whether ``point`` is neither done, running, nor in the result file."""
        return point not in self.cache and point not in self._inflight \
            and point_id(self.fp, point) not in self._known

    def _next(self) -> Point | None:
        while self._queue:
            point = min(self._queue, key=lambda p: (p.get(CPS, 0), self._queue[p]))
            del self._queue[point]
            if self._open(point):
                return point
        fore = [r for k, r in self._waiting.items() if isinstance(r, Need)
                and k not in self._background]
        back = [self._waiting[k] for k in self._background if k in self._waiting]
        extra = [r for r in back if isinstance(r, Need)]
        idle = [*(p for r in fore for p in r.maybe), *(p for r in back for p in r),
                *(p for r in extra for p in r.maybe), *(p for r in fore for p in r.spare),
                *(p for r in extra for p in r.spare)]
        return next((p for p in idle if self._open(p)), None)

    def _fill(self) -> None:
        while len(self._inflight) < self.executor.slots:
            point = self._next()
            if point is None:
                return
            self._inflight.add(point)
            self.executor.submit(point)

    def _ask(self, key: Any, req: list[Point]) -> None:
        self._waiting[key] = req
        if key not in self._background:
            for p in req:
                if self._open(p) and p not in self._queue:
                    self._queue[p] = self._asked
                    self._asked += 1

    def _advance(self, key: Any, send: Rows | None) -> None:
        gen = self._searches[key]
        try:
            while True:
                req = next(gen) if send is None else gen.send(send)
                rows = [self._lookup(p) for p in req]
                if all(r is not None for r in rows):
                    send = [dict(r) for r in rows if r is not None]
                    continue
                self._ask(key, req)
                return
        except StopIteration as stop:
            del self._searches[key]
            self._background.pop(key, None)
            self.done[key] = stop.value
            if self.on_done is not None:
                self.on_done(key, stop.value)

    def start(self, searches: dict[Any, Search], background: bool = False) -> None:
        """Start ``searches``; a background search's points run only in idle slots until it
        is promoted."""
        self._reserved += len(searches)
        for key, search in searches.items():
            self._reserved -= 1
            self._searches[key] = search
            if background:
                self._background[key] = None
            self._advance(key, None)

    def promote(self, key: Any) -> None:
        """Run a background search's points like any other search's from now on."""
        if key in self._background:
            del self._background[key]
            if key in self._waiting:
                self._ask(key, self._waiting[key])

    def cancel(self, key: Any) -> None:
        """Drop a search (its running points still finish and are kept)."""
        self._searches.pop(key, None)
        self._background.pop(key, None)
        req = self._waiting.pop(key, None) or []
        wanted = {p for k, r in self._waiting.items() if k not in self._background for p in r}
        for p in req:
            if p not in wanted:
                self._queue.pop(p, None)

    def run(self, searches: dict[Any, Search]) -> dict[Any, Any]:
        """Start ``searches`` and run until they finished; their answers by key."""
        self.start(searches)
        return self.wait_for(list(searches))

    def wait_for(self, keys: Sequence[Any]) -> dict[Any, Any]:
        """Run until the searches ``keys`` finished; their answers by key."""
        while any(k not in self.done for k in keys):
            self._fill()
            if not self._inflight:
                raise RuntimeError(f"searches {sorted(map(str, self._waiting))} wait on nothing")
            for point, row in self.executor.wait():
                self._inflight.discard(point)
                self.cache[point] = row
                self.ran += 1
                if self.results is not None:
                    self.results.append(row)
                if self.bar is not None:
                    self.bar.update(1)
            ready = [k for k, req in self._waiting.items() if all(p in self.cache for p in req)]
            self._reserved = len(ready)
            for key in ready:
                self._reserved -= 1
                req = self._waiting.pop(key, None)
                if req is not None and key in self._searches:
                    self._advance(key, [dict(self.cache[p]) for p in req])
        return {k: self.done[k] for k in keys}


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
    top_scale = max(max_scale, rate_scale)
    started: set[Any] = set()

    def capacity_of(c: Candidate) -> Search:
        return capacity_search(ctx, c.cps, int(c.recommended_ring or 0), top_scale, tolerance,
                               start=rate_scale)

    def ring_done(key: Any, answer: Any) -> None:
        """A candidate's ring is known: its capacity search may start (in the background for
        the provisional pick, whose answer is needed only if it stays the pick)."""
        if key[0] != "ring":
            return
        c = next(c for c in candidates if c.cps == key[1])
        c.ring = answer
        if c.ring.min_ring is not None:
            c.recommended_ring = min(nice_ring(c.ring.min_ring * (1 + headroom)),
                                     max(ring_max, c.ring.min_ring))
        if capacity == "all" and c.recommended_ring is not None:
            started.add(("capacity", c.cps))
            sched.start({("capacity", c.cps): capacity_of(c)})
        elif capacity == "pick":
            best = _pick_by_ring([d for d in candidates if d.ring is not None])
            for d in candidates:
                k = ("capacity", d.cps)
                if d is best and k not in started:
                    started.add(k)
                    sched.start({k: capacity_of(d)}, background=True)
                elif d is not best and k in started:
                    sched.cancel(k)

    try:
        if ring is None:
            firsts = {c.cps: first_ring(c.region_mb, ring_min, ring_max) for c in candidates}
            sched.on_done = ring_done
            # largest regions first: their first probes are the cheapest and steer the others'
            sched.run({("ring", c.cps): ring_search(ctx, c.cps, c.region_mb, ring_min, ring_max,
                                                    tolerance, rate_scale, firsts)
                       for c in sorted(candidates, key=lambda c: -firsts[c.cps])})
            sched.on_done = None
        else:
            for c in candidates:
                c.recommended_ring = ring
        chosen = [c for c in candidates if c.recommended_ring is not None]
        if capacity == "pick":
            pick0 = _pick_by_ring(chosen)
            chosen = [pick0] if pick0 else []
            for k in started - {("capacity", c.cps) for c in chosen}:
                sched.cancel(k)
        if capacity != "none" and chosen:
            keys = [("capacity", c.cps) for c in chosen]
            sched.start({k: capacity_of(c) for k, c in zip(keys, chosen, strict=True)
                         if k not in started})
            for k in keys:
                sched.promote(k)
            caps = sched.wait_for(keys)
            for k, c in zip(keys, chosen, strict=True):
                c.capacity = caps[k]
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
