"""Run a list of points on an executor, streaming rows into a result file, resuming where an
earlier run of the same sweep stopped."""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from twin.advise.executors import Executor, Job
from twin.advise.results import ResultsFile
from twin.advise.space import Point, point_id


@dataclass
class SweepReport:
    """What a sweep did: points run now, points skipped as already done, outcomes, timing."""

    total: int
    skipped: int
    ran: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    wall_s: float = 0.0
    interrupted: bool = False

    @property
    def points_per_min(self) -> float:
        return 60.0 * self.ran / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"points": self.total, "skipped": self.skipped, "ran": self.ran,
                "outcomes": dict(sorted(self.outcomes.items())),
                "wall_s": round(self.wall_s, 3), "points_per_min": round(self.points_per_min, 2),
                "interrupted": self.interrupted}


def progress_bar(total: int | None, enabled: bool, desc: str) -> Any:
    """A tqdm bar on stderr (with time left when ``total`` is known), or None."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="pt", desc=desc, file=sys.stderr, smoothing=0.2,
                dynamic_ncols=True)


def run_sweep(job: Job, points: Sequence[Point], results: ResultsFile,
              make_executor: Callable[[], Executor], *, progress: bool = True,
              on_row: Callable[[dict[str, Any]], None] | None = None) -> SweepReport:
    """Run every point of ``points`` not already in ``results``; rows are appended as they
    arrive. Ctrl-C stops the sweep after writing what has finished (rerun to resume)."""
    fp = job.fingerprint
    done = results.done_ids()
    unique = list(dict.fromkeys(points))
    todo = [p for p in unique if point_id(fp, p) not in done]
    report = SweepReport(total=len(unique), skipped=len(unique) - len(todo))
    if not todo:
        return report
    t0 = time.perf_counter()
    bar = progress_bar(len(todo), progress, "sweep")
    executor = make_executor()
    queue = iter(todo)
    try:
        for point in queue:
            executor.submit(point)
            if executor.pending >= 2 * executor.slots:
                break
        while executor.pending:
            for _point, row in executor.wait():
                results.append(row)
                report.ran += 1
                report.outcomes[str(row.get("outcome"))] += 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix_str(" ".join(f"{k} {v}" for k, v in
                                                 sorted(report.outcomes.items())), refresh=False)
                if on_row is not None:
                    on_row(row)
                nxt = next(queue, None)
                if nxt is not None:
                    executor.submit(nxt)
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        executor.close()
        if bar is not None:
            bar.close()
        report.wall_s = time.perf_counter() - t0
    return report
