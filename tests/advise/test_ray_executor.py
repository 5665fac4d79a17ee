"""The Ray executor on a private local Ray instance (2 CPUs, no dashboard), shut down after:
the same rows as the local executor, and a search driven through it."""

from __future__ import annotations

from pathlib import Path

import pytest

from twin.advise.executors import InlineExecutor, Job, RayExecutor
from twin.advise.results import ResultsFile, read_results
from twin.advise.search import Budgets, advise
from twin.advise.space import grid, parse_axis
from twin.advise.sweep import run_sweep

ray = pytest.importorskip("ray")
VOLATILE = ("wall_s", "finished_at", "host")


@pytest.fixture(scope="module")
def ray_executor(tiny_job: Job):  # type: ignore[no-untyped-def]
    ex = RayExecutor(tiny_job, num_cpus=2)
    yield ex
    ex.close()
    assert not ray.is_initialized()


def test_ray_sweep_matches_the_local_one(tiny_job: Job, ray_executor: RayExecutor,
                                         tmp_path: Path) -> None:
    axes = [parse_axis("ring_mb=1,4"), parse_axis("cps=256,512")]
    points = grid(axes, (0, 1))
    rows = {}
    for name, make in (("inline", lambda: InlineExecutor(tiny_job)),
                       ("ray", lambda: _Borrowed(ray_executor))):
        with ResultsFile(tmp_path / f"{name}.csv", [a.name for a in axes]) as results:
            report = run_sweep(tiny_job, points, results, make, progress=False)
        assert report.ran == 8
        rows[name] = {r["point_id"]: {k: v for k, v in r.items() if k not in VOLATILE}
                      for r in read_results(tmp_path / f"{name}.csv")}
    assert rows["inline"] == rows["ray"]


def test_a_search_runs_on_ray(tiny_job: Job, ray_executor: RayExecutor) -> None:
    advice = advise(tiny_job, ray_executor, [512], budgets=Budgets(ttft_s=0.5), seeds=(0,),
                    ring_max=16, tolerance=0.3, capacity="none")
    local = advise(tiny_job, InlineExecutor(tiny_job), [512], budgets=Budgets(ttft_s=0.5),
                   seeds=(0,), ring_max=16, tolerance=0.3, capacity="none")
    assert advice.pick is not None
    assert advice.pick.ring.min_ring == local.pick.ring.min_ring


class _Borrowed:
    """The module's Ray executor, not closed by the sweep (one Ray start for the module)."""

    def __init__(self, ex: RayExecutor) -> None:
        self.ex = ex
        self.slots = ex.slots

    def submit(self, point):  # type: ignore[no-untyped-def]
        self.ex.submit(point)

    def wait(self):  # type: ignore[no-untyped-def]
        return self.ex.wait()

    @property
    def pending(self) -> int:
        return self.ex.pending

    def close(self) -> None:
        pass


def test_the_sweep_command_on_ray(ray_executor: RayExecutor, tmp_path: Path) -> None:
    """``--executor ray`` joins the Ray instance already running in this process."""
    from click.testing import CliRunner

    from twin.cli import cli

    out = tmp_path / "r.csv"
    r = CliRunner().invoke(cli, [
        "sweep", "--scenario", "default", "--workload",
        "shared-prefix:groups=2,per_group=3,system=1024,question=256,output=8,rate=20,seed=3",
        "--vary", "ring_mb=8,16", "--executor", "ray", "-o", str(out)],
        catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "2 point(s): 2 run now (2 clean)" in r.output
    assert ray.is_initialized()  # not shut down: the fixture owns it
