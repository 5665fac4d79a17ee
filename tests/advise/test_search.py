"""Searches on a fake executor (a known threshold), what-limits rules, and one real advise."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from twin.advise.evaluate import MiB, chunk_region_bytes
from twin.advise.executors import InlineExecutor, Job
from twin.advise.plots import pareto_front
from twin.advise.results import ResultsFile
from twin.advise.search import (
    AXES,
    CPS,
    RATE_SCALE,
    RING,
    Budgets,
    Context,
    Scheduler,
    _point,
    advise,
    capacity_search,
    capacity_steps,
    early_stop_for,
    first_ring,
    judge,
    limiting_factor,
    nice_ring,
    ring_search,
    ring_steps,
)
from twin.advise.space import Base, Point, point_id


def threshold_model(row_of, min_ring: dict[int, int], max_scale: dict[int, float],
                    unlucky_seed: int | None = None):
    """Clean iff ring >= min_ring[cps] and scale <= max_scale[cps] (seed ``unlucky_seed``
    needs 10% more ring)."""
    def model(p: Point) -> dict:
        cps, ring, scale = p.get(CPS), p.get(RING), p.get(RATE_SCALE)
        need = min_ring[cps] * (1.1 if p.seed == unlucky_seed else 1.0)
        ok = ring >= need and scale <= max_scale[cps]
        return row_of(p, "clean" if ok else "unfinished", ttft_p99=0.1 if ok else 9.0,
                      peak_ring_mb=3 * min_ring[cps], unfinished=0 if ok else 1,
                      prefill_busy=0.95 if scale > max_scale[cps] else 0.3)
    return model


def _drive(search, executor):
    gen = search
    rows = None
    req = next(gen)
    try:
        while True:
            for p in req:
                executor.submit(p)
            rows = []
            while executor.pending:
                rows += [r for _, r in executor.wait()]
            req = gen.send(rows)
    except StopIteration as stop:
        return stop.value


@pytest.mark.parametrize("true_min", [1, 7, 37, 300, 999])
def test_ring_search_brackets_the_smallest_passing_ring(fake_executor, row_of,
                                                        true_min: int) -> None:
    ex = fake_executor(threshold_model(row_of, {512: true_min}, {512: 4.0}), slots=1)
    ctx = Context((0, 1), Budgets(), lambda: 0)
    ans = _drive(ring_search(ctx, 512, 2.0, 1, 1024, 0.1), ex)
    assert true_min <= ans.min_ring <= max(true_min + 1, math.ceil(true_min * 1.1))
    assert ans.below is None or ans.below.value < true_min
    assert len(ans.probes) <= 14
    # a failing probe ran only its first seed; passing probes ran both
    for p in ans.probes:
        assert len(p.rows) == (2 if p.passed else 1)


def test_ring_search_reports_an_infeasible_candidate(fake_executor, row_of) -> None:
    ex = fake_executor(threshold_model(row_of, {512: 5000}, {512: 4.0}))
    ans = _drive(ring_search(Context((0,), Budgets(), lambda: 0), 512, 2.0, 1, 1024, 0.1), ex)
    assert not ans.feasible and ans.below.value == 1024
    assert [p.value for p in ans.probes] == [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def test_an_unlucky_seed_raises_the_answer(fake_executor, row_of) -> None:
    model = threshold_model(row_of, {512: 100}, {512: 4.0}, unlucky_seed=1)
    one = _drive(ring_search(Context((0,), Budgets(), lambda: 0), 512, 2.0, 1, 1024, 0.05),
                 fake_executor(model))
    two = _drive(ring_search(Context((0, 1), Budgets(), lambda: 0), 512, 2.0, 1, 1024, 0.05),
                 fake_executor(model))
    assert one.min_ring < 110 <= two.min_ring


def test_idle_slots_run_the_seeds_together(fake_executor, row_of) -> None:
    ex = fake_executor(threshold_model(row_of, {512: 37}, {512: 4.0}), slots=4)
    ans = _drive(ring_search(Context((0, 1, 2), Budgets(), lambda: 4), 512, 2.0, 1, 1024, 0.1),
                 ex)
    assert all(len(p.rows) == 3 for p in ans.probes)


@pytest.mark.parametrize("limit", [0.3, 1.0, 2.7, 5.0, 100.0])
def test_capacity_search_finds_the_largest_sustained_scale(fake_executor, row_of,
                                                           limit: float) -> None:
    ex = fake_executor(threshold_model(row_of, {512: 10}, {512: limit}))
    ans = _drive(capacity_search(Context((0,), Budgets(), lambda: 0), 512, 16, 8.0, 0.1), ex)
    if limit >= 8:
        assert ans.capped and ans.scale == 8.0
    else:
        assert ans.scale <= limit < ans.above.value <= ans.scale * 1.1 + 1e-3
        assert limiting_factor(ans.above.failing).kind == "prefill compute"


def test_judge_applies_budgets_at_the_percentile(row_of) -> None:
    p = Point.of({"cps": 512})
    row = row_of(p, ttft_p99=0.8, ttft_p50=0.1, tpot_p99=None)
    assert judge(row, Budgets(ttft_s=1.0, tpot_s=0.01)) == (True, "clean, within budgets")
    ok, why = judge(row, Budgets(ttft_s=0.5))
    assert not ok and why == "p99 TTFT 800 ms > 500 ms"
    assert judge(row, Budgets(ttft_s=0.5, percentile=50))[0]
    ok, why = judge(row_of(p, "wedged", root_cause="root: room 3: x"), Budgets())
    assert not ok and why == "wedge: root: room 3: x"


def test_limiting_factor_rules(row_of) -> None:
    p = Point.of({"cps": 512})
    assert limiting_factor(row_of(p, "failed", failures=json.dumps(
        {"staging allocation oversized: chunk exceeds the ring": 3}))).kind == "ring"
    assert limiting_factor(row_of(p, "wedged", root_cause="root: r")).kind == "protocol wedge"
    assert limiting_factor(row_of(p, prefill_busy=0.97, nic_util_max=0.1)).kind == \
        "prefill compute"
    assert limiting_factor(row_of(p, prefill_busy=0.2, nic_util_max=0.9)).kind == "NIC"
    assert limiting_factor(row_of(p, prefill_busy=0.2, nic_util_max=0.1, ttft_p99=2.0,
                                  kv_wait_p99=1.5, deferrals_per_request=40)).kind == "ring"
    kv = row_of(p, extra_json=json.dumps({"decode": {"retractions": 12}}))
    assert limiting_factor(kv) .kind == "decode KV"
    assert "retractions" in limiting_factor(kv).evidence


def test_nice_ring_and_pareto_front() -> None:
    assert [nice_ring(x) for x in (0.3, 5, 7.5, 40, 700, 875, 1024, 1025)] == \
        [1, 5, 8, 40, 704, 896, 1024, 1152]
    assert pareto_front([(8, 3.0), (4, 5.0), (16, 3.5), (32, 1.0), (2, 9.0)]) == \
        [(2, 9.0), (4, 5.0), (8, 3.0), (32, 1.0)]


def test_scheduler_runs_each_point_once_and_reuses_the_result_file(
        fake_executor, row_of, tiny_job: Job, tmp_path: Path) -> None:
    inner = threshold_model(row_of, {256: 20, 512: 37}, {256: 4.0, 512: 4.0})

    def model(p: Point) -> dict:
        return {**inner(p), "point_id": point_id(tiny_job.fingerprint, p)}

    path = tmp_path / "a.csv"
    answers = []
    for _ in range(2):
        ex = fake_executor(model)
        with ResultsFile(path, AXES) as results:
            sched = Scheduler(tiny_job, ex, results)
            ctx = Context((0, 1), Budgets(), sched.free_slots, sched.known)
            out = sched.run({c: ring_search(ctx, c, 2.0, 1, 256, 0.1) for c in (256, 512)})
        answers.append(({c: a.min_ring for c, a in out.items()}, len(ex.submitted)))
        assert len(set(ex.submitted)) == len(ex.submitted)
    assert answers[0][0] == answers[1][0] and answers[0][1] > 0 and answers[1][1] == 0


def test_advise_end_to_end_on_a_tiny_workload(tiny_job: Job) -> None:
    advice = advise(tiny_job, InlineExecutor(tiny_job), [256, 512], budgets=Budgets(ttft_s=0.5),
                    seeds=(0,), ring_max=16, tolerance=0.25)
    assert advice.pick is not None and advice.pick.recommended_ring >= advice.pick.ring.min_ring
    for c in advice.candidates:
        assert c.ring.min_ring >= math.floor(c.region_mb)  # a full chunk must fit
        assert c.ring.below is None or c.ring.below.value < c.ring.min_ring
    assert advice.pick.capacity is not None and advice.pick.capacity.best is not None
    table = advice.table()
    assert table.startswith("| chunked_prefill_size |") and "(pick)" in table
    assert "SGLANG_DISAGG_STAGING_POOL_SIZE_MB=" in advice.reasons[0]
    assert json.loads(json.dumps(advice.to_dict(), default=str))["recommendation"]


def test_searches_at_a_planned_rate_scale(fake_executor, row_of) -> None:
    ex = fake_executor(threshold_model(row_of, {512: 37}, {512: 3.0}))
    ctx = Context((0,), Budgets(), lambda: 0)
    ans = _drive(ring_search(ctx, 512, 2.0, 1, 1024, 0.1, scale=2.0), ex)
    assert {p.get(RATE_SCALE) for p in ex.submitted} == {2.0} and ans.min_ring >= 37
    cap = _drive(capacity_search(ctx, 512, 64, 8.0, 0.1, start=2.0), fake_executor(
        threshold_model(row_of, {512: 37}, {512: 3.0})))
    assert cap.probes[0].value == 2.0 and cap.scale <= 3.0 < cap.above.value


def test_searches_starting_together_share_the_slots(fake_executor, row_of,
                                                    tiny_job: Job) -> None:
    """Four searches on two slots: none may claim both slots for its seeds at the start."""
    ex = fake_executor(threshold_model(row_of, {c: 37 for c in (128, 256, 512, 1024)},
                                       {c: 4.0 for c in (128, 256, 512, 1024)}), slots=2)
    sched = Scheduler(tiny_job, ex, None)
    ctx = Context((0, 1), Budgets(), sched.free_slots, sched.known)
    sched.run({c: ring_search(ctx, c, 2.0, 1, 256, 0.1) for c in (128, 256, 512, 1024)})
    assert [p.seed for p in ex.submitted[:4]] == [0, 0, 0, 0]


# The fast searches against probing every value the searches name, in full ---------------------

def named(steps, passes) -> list[float]:
    """The values a decision procedure names when ``passes(value)`` answers."""
    out: list[float] = []
    try:
        value = next(steps)
        while True:
            out.append(value)
            value = steps.send(passes(value))
    except StopIteration:
        return out


@pytest.mark.parametrize("need, values", [  # as the searches probed before they were replayed
    (1, [2, 1]), (7, [2, 4, 8, 6, 7]), (37, [2, 4, 8, 16, 32, 64, 45, 38, 35]),
    (300, [2, 4, 8, 16, 32, 64, 128, 256, 512, 362, 304, 279]),
    (999, [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 724, 861, 939]),
    (5000, [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]),
])
def test_the_ring_procedure(need: int, values: list[int]) -> None:
    assert named(ring_steps(2, 1, 1024, 0.1), lambda r: r >= need) == values


@pytest.mark.parametrize("limit, values", [
    (0.05, [1.0, 0.5, 0.25, 0.125, 0.062]), (0.3, [1.0, 0.5, 0.25, 0.354, 0.297, 0.324]),
    (1.0, [1.0, 2.0, 1.414, 1.189, 1.09]), (1.5, [1.0, 2.0, 1.414, 1.682, 1.542]),
    (2.7, [1.0, 2.0, 4.0, 2.828, 2.378, 2.593]), (8.0, [1.0, 2.0, 4.0, 8.0]),
])
def test_the_capacity_procedure(limit: float, values: list[float]) -> None:
    assert named(capacity_steps(1.0, 8.0, 1 / 16, 0.1), lambda s: s <= limit) == values


def full_answer(run, cands: dict[int, int], budgets: Budgets, seeds, ring_max: int,
                tolerance: float = 0.1, headroom: float = 0.25, max_scale: float = 8.0):
    """What the searches answer when every value they name runs on every seed, with no verdict
    implied or guessed: ``(cps -> (smallest passing ring, largest failing ring under it)),
    pick, (largest passing scale, smallest failing scale))``. ``run(point)``: its row;
    ``cands``: cps -> first ring."""

    def drive(steps, make):
        gen, ran = steps, {}
        try:
            value = next(gen)
            while True:
                rows = [run(make(value, s)) for s in seeds]
                ran[value] = rows
                value = gen.send(all(judge(r, budgets)[0] for r in rows))
        except StopIteration as stop:
            return stop.value, ran

    rings, best_rows = {}, {}
    for cps, first in cands.items():
        (good, bad, _), ran = drive(ring_steps(first, 1, ring_max, tolerance),
                                    lambda v, s, c=cps: _point(c, int(v), 1.0, s))
        rings[cps] = (good, bad)
        best_rows[cps] = ran[good][0] if good is not None else None
    recs = {c: min(nice_ring(g * (1 + headroom)), max(ring_max, g))
            for c, (g, _) in rings.items() if g is not None}
    if not recs:
        return rings, None, None
    pick = min(recs, key=lambda c: (recs[c], best_rows[c].get("ttft_p99") or math.inf, -c))
    (good, bad, _), _ = drive(capacity_steps(1.0, max_scale, 1 / 16, tolerance),
                              lambda v, s: _point(pick, recs[pick], v, s))
    return rings, pick, (good, bad)


def fast_answer(advice):
    rings = {c.cps: (c.ring.min_ring, c.ring.below.value if c.ring.below else None)
             for c in advice.candidates}
    cap = advice.pick.capacity if advice.pick else None
    return rings, advice.pick.cps if advice.pick else None, \
        (cap.scale, cap.above.value if cap.above else None) if cap else None


def region_model(row_of, regions: dict[int, int], need: dict[int, int],
                 max_scale: dict[int, float], unlucky: int | None = None):
    """Clean iff the ring holds a chunk (``regions``) and meets ``need``, and the rate scale is
    at most ``max_scale`` (seed ``unlucky`` needs 10% more ring and sustains 10% less)."""
    def model(p: Point) -> dict:
        cps, ring, scale = p.get(CPS), p.get(RING), p.get(RATE_SCALE)
        worse = 1.1 if p.seed == unlucky else 1.0
        ok = ring >= regions[cps] and ring >= need[cps] * worse \
            and scale * worse <= max_scale[cps]
        return row_of(p, "clean" if ok else "unfinished", ttft_p99=0.1 if ok else 9.0,
                      unfinished=0 if ok else 1)
    return model


@pytest.mark.parametrize("limit", [0.9, 1.05, 1.834, 3.0, 20.0])
@pytest.mark.parametrize("need, unlucky", [
    ({128: 7, 256: 7, 512: 8, 1024: 8}, None),  # one need for every chunk size
    ({128: 7, 256: 7, 512: 8, 1024: 8}, 1),
    ({128: 30, 256: 6, 512: 4, 1024: 8}, None),  # smaller chunks need more, or less
    ({128: 1, 256: 5, 512: 4, 1024: 8}, None),
    ({128: 1, 256: 2, 512: 4, 1024: 8}, 1),  # every chunk fits its region
    ({128: 500, 256: 500, 512: 500, 1024: 500}, None),  # no ring helps
])
def test_the_fast_search_answers_as_probing_every_value_in_full(
        fake_executor, row_of, tiny_job: Job, need: dict[int, int], unlucky: int | None,
        limit: float) -> None:
    regions = {c: first_ring(chunk_region_bytes(tiny_job.base.cfg.replace(
        chunked_prefill_size=c)) / MiB, 1, 64) for c in need}
    assert regions == {128: 1, 256: 2, 512: 4, 1024: 8}
    model = region_model(row_of, regions, need, {c: limit for c in need}, unlucky)
    ex = fake_executor(model, slots=2)
    advice = advise(tiny_job, ex, list(need), seeds=(0, 1), ring_max=64)
    named: set[Point] = set()

    def run(point: Point) -> dict:
        named.add(point)
        return model(point)

    assert fast_answer(advice) == full_answer(run, regions, Budgets(), (0, 1), 64)
    assert len(set(ex.submitted)) == len(ex.submitted)
    pick = advice.pick
    if pick is not None:  # its ring search's pass stands for the workload's own rate
        assert _point(pick.cps, pick.recommended_ring, 1.0, 0) not in ex.submitted \
            or pick.recommended_ring in {p.value for p in pick.ring.probes}
    if unlucky is None and need[256] == need[128]:  # the larger chunks' runs stood in
        assert len(ex.submitted) < len(named)


def test_advise_on_a_small_workload_quotes_the_rows_of_probing_in_full() -> None:
    """The notebook's deployment, where smaller chunks need more ring than a chunk region (the
    larger chunk sizes' verdicts mislead the guesses): the answer, and the rows it quotes, are
    those of running every value the searches name on every seed, without early stops."""
    from twin.cli.common import resolve_run

    run = resolve_run(scenario="default", scenario_defects=(), config_path=None,
                      workload_spec="shared-prefix:groups=2,per_group=6,system=4096,"
                                    "question=512,output=16,rate=20,seed=7",
                      first_n=None, slowdown=None, defects=(), faults=(), prefill_args=None,
                      decode_args=None, env_items=(), max_concurrency=None)
    budgets = Budgets(ttft_s=0.5)
    full = Job(Base(cfg=run.cfg, params=run.params, horizon_s=30.0), run.workload)
    fast = Job(dataclasses.replace(full.base, early_stop=early_stop_for(budgets)), run.workload)
    cands = [256, 512, 1024, 2048]
    advice = advise(fast, InlineExecutor(fast), cands, budgets=budgets, seeds=(0, 1),
                    ring_max=16)
    regions = {c: first_ring(chunk_region_bytes(run.cfg.replace(chunked_prefill_size=c)) / MiB,
                             1, 16) for c in cands}
    rows: dict[Point, dict] = {}

    def run_full(point: Point) -> dict:
        rows[point] = full.run(point)
        return rows[point]

    answer = full_answer(run_full, regions, budgets, (0, 1), 16)
    assert fast_answer(advice) == answer
    assert answer[0][512][0] > regions[512] and answer[0][256][0] > regions[256]
    assert advice.ran < len(rows)
    volatile = ("wall_s", "finished_at", "host", "point_id", "sweep", "_ok")
    for c in advice.candidates:
        for row in c.ring.best.rows:  # a pass runs to the end: the same run
            ref = rows[_point(c.cps, c.ring.min_ring, 1.0, row["seed"])]
            assert {k: v for k, v in row.items() if k not in volatile} == \
                {k: v for k, v in ref.items() if k not in volatile}
        failing = c.ring.below.failing  # maybe stopped early, failing all the same
        assert not judge(rows[_point(c.cps, int(c.ring.below.value), 1.0, failing["seed"])],
                         budgets)[0]


def test_background_searches_run_in_idle_slots_until_promoted(fake_executor, row_of,
                                                             tiny_job: Job) -> None:
    ex = fake_executor(lambda p: row_of(p), slots=2)
    sched = Scheduler(tiny_job, ex, None)

    def search(rings, answer):
        for ring in rings:
            yield [_point(512, ring, 1.0, 0)]
        return answer

    sched.start({"bg": search((9, 10, 11), "bg"), "gone": search((20, 21), "gone")},
                background=True)
    assert sched.run({"fg": search((1, 2, 3), "fg")}) == {"fg": "fg"}
    sched.cancel("gone")
    sched.promote("bg")
    assert sched.wait_for(["bg"]) == {"bg": "bg"} and "gone" not in sched.done
    # the first background search took the one slot the foreground left; the other never ran
    assert [p.get(RING) for p in ex.submitted] == [1, 9, 2, 10, 3, 11]
