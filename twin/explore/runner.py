"""The campaign's main loop: rounds of trials on an executor, a progress line, a clean stop.

Trials run on the advisor's executors (``twin/advise/executors.py``: in this process, a local
process pool, or Ray tasks). A worker that dies is named (its pid and exit code, from the
pool) and every trial that was in flight on the pool is run again on a fresh pool; a trial
that kills its worker twice is recorded as a finding of kind ``crashed``.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from twin.explore.campaign import Campaign, ExploreJob, Finding
from twin.explore.trial import Trial
from twin.runtime.signals import HANDLED, signals_handled

ExecutorFactory = Callable[[ExploreJob], Any]


@dataclass
class Report:
    interrupted: bool = False
    new: list[Finding] = field(default_factory=list)
    worker_deaths: list[str] = field(default_factory=list)


def _workers(executor: Any) -> list[Any]:
    """The local pool's worker processes (none for other executors); kept before a wait, as a
    broken pool forgets its processes."""
    pool = getattr(executor, "_pool", None)
    return list((getattr(pool, "_processes", None) or {}).values())


def _dead_workers(procs: list[Any]) -> list[str]:
    for p in procs:
        p.join(timeout=1.0)
    # The pool ends the others itself (SIGTERM) once one died.
    return [f"worker pid {p.pid} died (exit code {p.exitcode})"
            for p in procs if p.exitcode not in (None, 0, -signal.SIGTERM)]


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
        procs = _workers(ex)
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
            deaths = _dead_workers(procs) or ["a worker died (pid unknown)"]
            redo = ", ".join(f"#{i}" for i, _ in sorted(todo))
            for d in deaths:
                line = f"{d}; trial(s) {redo} redone on a fresh pool"
                report.worker_deaths.append(line)
                campaign.redone.append(line)
                print(f"explore: {line}", file=sys.stderr)
            ex.close()
            state["executor"] = None
    return rows


@contextlib.contextmanager
def stop_requests(flag: dict[str, str]) -> Iterator[None]:
    """Within the block, SIGINT, SIGTERM and SIGHUP ask the campaign to stop (``flag["stop"]``
    names the signal) instead of raising: a simulation catches ``KeyboardInterrupt`` itself and
    would turn a stop into one interrupted trial. The campaign stops after the trial running;
    a second signal raises ``KeyboardInterrupt`` at once."""
    def ask(signum: int, frame: object) -> None:
        if flag.get("stop"):
            raise KeyboardInterrupt
        flag["stop"] = signal.Signals(signum).name

    with signals_handled(ask, (signal.SIGINT, *HANDLED)):
        yield


def explore(campaign: Campaign, make: ExecutorFactory, *, runs: int | None = None,
            budget_s: float | None = None, progress: bool = False,
            on_finding: Callable[[Finding], None] | None = None,
            on_round: Callable[[], None] | None = None) -> Report:
    """Run rounds until ``runs`` trials in all (counting earlier sessions) or ``budget_s``
    seconds of this session (a finding's shrink stops when they are spent); Ctrl-C or SIGTERM
    ends it with what was found so far (the caller writes it). ``on_finding`` is called for each new finding, ``on_round`` after each round
    (the state is saved there)."""
    import time

    report = Report()
    flag: dict[str, str] = {}
    state: dict[str, Any] = {"executor": None}
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm

        total = runs if runs is not None else None
        bar = tqdm(total=total, initial=campaign.runs, unit="run", file=sys.stderr,
                   leave=False, dynamic_ncols=True)

    def out_of_time() -> bool:
        return bool(flag) or (budget_s is not None and time.perf_counter() - t0 >= budget_s)

    try:
        with stop_requests(flag):
            while True:
                if runs is not None and campaign.runs >= runs:
                    break
                if out_of_time():
                    break
                size = 8 if runs is None else min(8, runs - campaign.runs)
                trials = campaign.make_round(size)
                rows = _run_round(campaign, trials, make, state, report)
                if flag:
                    break  # a round cut short by a stop is not taken: resume redoes it
                # Shrinking stops with a stop request, or once a budget in seconds is spent
                # (the finding keeps the smallest repro found by then).
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
        report.interrupted = report.interrupted or bool(flag)
        if bar is not None:
            bar.close()
        ex = state.get("executor")
        if ex is not None:
            ex.close()
    return report
