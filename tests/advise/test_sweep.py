"""Sweeps end to end on the tiny deployment: rows, verdicts, resume, executors agree."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from twin.advise.evaluate import classify, root_cause, run_point, scaled
from twin.advise.executors import InlineExecutor, Job, LocalExecutor
from twin.advise.results import ResultsFile, read_results
from twin.advise.search import Budgets, early_stop_for, judge
from twin.advise.space import Base, Point, grid, parse_axis
from twin.advise.sweep import run_sweep
from twin.core.config import ServerSide, TwinConfig
from twin.runtime.faults import parse_fault
from twin.runtime.params import SimParams
from twin.sim.scenarios import SMALL
from twin.workloads import shared_prefix

AXES = [parse_axis("ring_mb=1,4"), parse_axis("cps=256,512")]
VOLATILE = ("wall_s", "finished_at", "host")


def test_a_point_row_holds_verdict_metrics_and_config(tiny_job: Job) -> None:
    row = tiny_job.run(Point.of({"ring_mb": 4, "cps": 512}, seed=1))
    assert row["outcome"] == "clean" and row["completed"] == 6 and row["failed"] == 0
    assert row["ring_mb"] == 4 and row["chunked_prefill_size"] == 512 and row["seed"] == 1
    assert row["layout"] == "TP2->TP1" and row["chunk_region_mb"] > 0
    assert 0 < row["ttft_p50"] <= row["ttft_p99"] and row["tpot_p99"] > 0
    assert len(json.loads(row["ttft_q"])) == 21 and row["sim_s"] > 0 and row["events"] > 0
    assert json.loads(row["config_json"])["staging_pool_size_mb"] == 4
    assert row["x.staging_pool_size_mb"] == 4 and row["point_id"]


def test_a_ring_smaller_than_a_chunk_fails_its_requests(tiny_job: Job) -> None:
    row = tiny_job.run(Point.of({"ring_mb": 1, "cps": 2048}))
    assert row["outcome"] == "failed" and row["failed"] > 0
    assert "oversized" in row["failures"]


def test_invalid_points_become_rows(tiny_job: Job) -> None:
    row = tiny_job.run(Point.of({"cps": 500}))
    assert row["outcome"] == "invalid" and "page_size" in row["error"]


def test_wedges_carry_their_root_cause(tiny_job: Job) -> None:
    base = Base(cfg=tiny_job.base.cfg, params=tiny_job.base.params,
                faults=(parse_fault("drop:STAGING_RSP:room=1"),))
    row = run_point(base, tiny_job.workload, Point.of({"ring_mb": 4}), "fp")
    assert row["outcome"] == "wedged" and row["root_cause"].startswith("root:")
    assert "STAGING_RSP" in row["root_cause"]


def test_classify_and_root_cause_read_summaries_defensively() -> None:
    assert classify({"status": "completed"}) == "clean"
    assert classify({"status": "failed", "failed": 2}) == "failed"  # a future status
    assert classify({"wedged": True}) == "wedged" and classify({"corrupted": True}) == "corrupted"
    assert classify({"unfinished": 3, "status": "until"}) == "unfinished"
    assert root_cause(["wedge: ...", "root: room 5", "x"]) == "root: room 5"
    assert root_cause([]) == ""


def test_rate_scaling_compresses_arrivals(tiny_job: Job) -> None:
    fast = scaled(tiny_job.workload, 2.0)
    assert fast.requests[-1].arrival_s == pytest.approx(tiny_job.workload.requests[-1].arrival_s
                                                        / 2)
    assert scaled(tiny_job.workload, 1.0) is tiny_job.workload


def test_sweep_writes_every_point_and_resumes(tiny_job: Job, tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    points = grid(AXES, (0, 1))
    seen = []

    def stop_after_three(row: dict[str, object]) -> None:
        seen.append(row)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with ResultsFile(path, [a.name for a in AXES]) as results:
        report = run_sweep(tiny_job, points, results, lambda: InlineExecutor(tiny_job),
                           progress=False, on_row=stop_after_three)
    assert report.interrupted and report.ran == 3
    with ResultsFile(path, [a.name for a in AXES]) as results:
        report = run_sweep(tiny_job, points, results, lambda: InlineExecutor(tiny_job),
                           progress=False)
    assert (report.total, report.skipped, report.ran) == (8, 3, 5)
    rows = read_results(path)
    assert len(rows) == 8 and len({r["point_id"] for r in rows}) == 8
    assert {r["outcome"] for r in rows} == {"clean", "failed"}


def test_process_pool_gives_the_same_rows_as_inline(tiny_job: Job, tmp_path: Path) -> None:
    points = grid(AXES, (0,))
    rows = {}
    for name, make in (("inline", lambda: InlineExecutor(tiny_job)),
                       ("pool", lambda: LocalExecutor(tiny_job, 2))):
        with ResultsFile(tmp_path / f"{name}.csv", [a.name for a in AXES]) as results:
            run_sweep(tiny_job, points, results, make, progress=False)
        rows[name] = {r["point_id"]: {k: v for k, v in r.items() if k not in VOLATILE}
                      for r in read_results(tmp_path / f"{name}.csv")}
    assert rows["inline"] == rows["pool"]


def test_early_stop_only_stops_points_the_full_run_fails() -> None:
    cfg = TwinConfig(model=SMALL, prefill=ServerSide(tp_size=2), decode=ServerSide(tp_size=1),
                     chunked_prefill_size=512, page_size=16, staging_pool_size_mb=8)
    wl = shared_prefix(2, 10, 2048, 256, 8, rate_per_s=40.0, seed=3)
    full = Job(Base(cfg=cfg, params=SimParams(wedge_window_s=5.0)), wl)
    budgets = Budgets(ttft_s=0.1)
    early = Job(dataclasses.replace(full.base, early_stop=early_stop_for(budgets)), wl)
    stopped = 0
    for p in grid([parse_axis("ring_mb=1,2,4,8"), parse_axis("cps=256,512")], (0,)):
        a, b = full.run(p), early.run(p)
        if b["note"]:
            stopped += 1
            assert b["outcome"] in ("over-budget", "failed", "wedged", "corrupted")
            assert not judge(a, budgets)[0] and not judge(b, budgets)[0]
            assert b["sim_s"] < a["sim_s"]  # stopped as soon as certain, not at the end
        else:
            assert {k: v for k, v in a.items() if k not in (*VOLATILE, "point_id", "sweep")} == \
                {k: v for k, v in b.items() if k not in (*VOLATILE, "point_id", "sweep")}
    assert stopped >= 2
    row = early.run(Point.of({"ring_mb": 2, "cps": 256}))
    assert row["outcome"] == "over-budget" and "TTFT budget" in row["note"]
