"""The campaign's main loop: rounds of trials on an executor, a progress line, a clean stop.

Trials run on the advisor's executors (``twin/advise/executors.py``: in this process, a local
process pool, or Ray tasks). A worker that dies is named (its pid and exit code, from the
pool) and every trial that was in flight on the pool is run again on a fresh pool; a trial
that kills its worker twice is recorded as a finding of kind ``crashed``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twin.explore.campaign import Campaign, ExploreJob, Finding
from twin.explore.trial import Trial

ExecutorFactory = Callable[[ExploreJob], Any]


@dataclass
class Report:
    interrupted: bool = False
    new: list[Finding] = field(default_factory=list)
    worker_deaths: list[str] = field(default_factory=list)


def _dead_workers(executor: Any) -> list[str]:
    pool = getattr(executor, "_pool", None)
    procs = getattr(pool, "_processes", None) or {}
    return [f"worker pid {p.pid} died (exit code {p.exitcode})"
            for p in list(procs.values()) if p.exitcode not in (None, 0)]


def _run_round(campaign: Campaign, trials: list[tuple[int, Trial]], make: ExecutorFactory,
               state: dict[str, Any], report: Report) -> dict[int, dict[str, Any]]:
    """Run one round; rows by trial index. Trials whose worker died are redone (twice at
    most) on a fresh executor."""
    rows: dict[int, dict[str, Any]] = {}
    todo = list(trials)
    attempts: dict[int, int] = {}
    while todo:
        ex = state.get("executor")
        if ex is None:
            ex = state["executor"] = make(ExploreJob(campaign.base))
        for index, trial in todo:
            ex.submit((index, trial.to_json()))
        todo_by_index = dict(todo)
        todo = []
        broken = False
        while ex.pending:
            for point, row in ex.wait():
                index = point[0]
                if "error" in row:
                    attempts[index] = attempts.get(index, 0) + 1
                    if attempts[index] >= 3:
                        rows[index] = {"status": "crashed", "signature": [
                            "crashed", f"a worker died running this trial: {row['error']}"[:160]],
                            "coverage": []}
                    else:
                        todo.append((index, todo_by_index[index]))
                        broken = True
                else:
                    rows[index] = row
        if broken:
            deaths = _dead_workers(ex) or ["a worker died (pid unknown)"]
            redo = ", ".join(f"#{i}" for i, _ in sorted(todo))
            for d in deaths:
                line = f"{d}; trial(s) {redo} redone on a fresh pool"
                report.worker_deaths.append(line)
                campaign.redone.append(line)
                print(f"explore: {line}", file=sys.stderr)
            ex.close()
            state["executor"] = None
    return rows


def explore(campaign: Campaign, make: ExecutorFactory, *, runs: int | None = None,
            budget_s: float | None = None, progress: bool = False,
            on_finding: Callable[[Finding], None] | None = None,
            on_round: Callable[[], None] | None = None) -> Report:
    """Run rounds until ``runs`` trials in all (counting earlier sessions) or ``budget_s``
    seconds of this session; Ctrl-C or SIGTERM ends it with what was found so far (the caller
    writes it). ``on_finding`` is called for each new finding, ``on_round`` after each round
    (the state is saved there)."""
    import time

    from twin.runtime.signals import signals_interrupt

    report = Report()
    state: dict[str, Any] = {"executor": None}
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm

        total = runs if runs is not None else None
        bar = tqdm(total=total, initial=campaign.runs, unit="run", file=sys.stderr,
                   leave=False, dynamic_ncols=True)

    def out_of_time() -> bool:
        return budget_s is not None and time.perf_counter() - t0 >= budget_s

    try:
        with signals_interrupt():
            while True:
                if runs is not None and campaign.runs >= runs:
                    break
                if out_of_time():
                    break
                size = 8 if runs is None else min(8, runs - campaign.runs)
                trials = campaign.make_round(size)
                rows = _run_round(campaign, trials, make, state, report)
                new = campaign.absorb(trials, rows, stop=out_of_time)
                for f in new:
                    report.new.append(f)
                    if on_finding is not None:
                        on_finding(f)
                if on_round is not None:
                    on_round()
                if bar is not None:
                    p = campaign.progress()
                    bar.n = p.runs
                    bar.set_postfix_str(f"findings {p.findings}, coverage {p.coverage}/"
                                        f"{p.coverage_total}, corpus {p.corpus}",
                                        refresh=False)
                    bar.refresh()
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        if bar is not None:
            bar.close()
        ex = state.get("executor")
        if ex is not None:
            ex.close()
    return report
