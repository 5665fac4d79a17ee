"""Shared fixtures for the advisor's tests: a tiny deployment and workload (a run takes tens of
milliseconds) and a fake executor whose rows come from a function of the point."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import pytest

from twin.advise.evaluate import empty_row
from twin.advise.executors import Job
from twin.advise.space import Base, Point
from twin.core.config import ServerSide, TwinConfig
from twin.runtime.params import SimParams
from twin.sim.scenarios import SMALL
from twin.workloads import shared_prefix


@pytest.fixture(scope="session")
def tiny_job() -> Job:
    cfg = TwinConfig(model=SMALL, prefill=ServerSide(tp_size=2), decode=ServerSide(tp_size=1),
                     chunked_prefill_size=512, page_size=16, staging_pool_size_mb=8)
    workload = shared_prefix(2, 3, 1024, 256, 8, rate_per_s=20.0, seed=3)
    return Job(Base(cfg=cfg, params=SimParams(wedge_window_s=5.0)), workload)


class FakeExecutor:
    """Rows from ``model(point)``; finishes points in submission order, ``slots`` at a time."""

    def __init__(self, model: Callable[[Point], dict[str, Any]], slots: int = 2) -> None:
        self.model = model
        self.slots = slots
        self.queue: deque[Point] = deque()
        self.submitted: list[Point] = []

    def submit(self, point: Point) -> None:
        self.queue.append(point)
        self.submitted.append(point)

    def wait(self) -> list[tuple[Point, dict[str, Any]]]:
        out = []
        for _ in range(min(self.slots, len(self.queue))):
            p = self.queue.popleft()
            out.append((p, self.model(p)))
        return out

    @property
    def pending(self) -> int:
        return len(self.queue)

    def close(self) -> None:
        self.queue.clear()


def fake_row(point: Point, outcome: str = "clean", **values: Any) -> dict[str, Any]:
    row = empty_row()
    row.update(point_id=point.key(), seed=point.seed, outcome=outcome, failures="{}",
               **{f"x.{k}": v for k, v in point.assign})
    row.update(values)
    return row


@pytest.fixture
def fake_executor() -> type[FakeExecutor]:
    return FakeExecutor


@pytest.fixture
def row_of() -> Callable[..., dict[str, Any]]:
    return fake_row
