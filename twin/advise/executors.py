"""Where points run: in this process, on a local process pool, or as Ray tasks.

Every executor is given the shared inputs once (:class:`Job`: the base config and the workload)
and then points one by one with :meth:`submit`; :meth:`wait` returns the rows that finished,
in the order they finish. The local pool hands the job to each worker process once, at start;
Ray puts it in the object store once and every task refers to it, so each node fetches it once
and each worker process deserialises it once.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from twin.advise.evaluate import error_row, run_point
from twin.advise.space import Base, Point
from twin.workloads import Workload


@dataclass(frozen=True)
class Job:
    """What every point of a sweep or search shares."""

    base: Base
    workload: Workload

    @property
    def fingerprint(self) -> str:
        return self.base.fingerprint(self.workload.digest)

    def run(self, point: Point) -> dict[str, Any]:
        return run_point(self.base, self.workload, point, self.fingerprint)

    def error_row(self, point: Point, message: str) -> dict[str, Any]:
        """The row of a point whose run never returned (its worker died)."""
        return error_row(self.fingerprint, point, message)


class Executor(Protocol):
    """Runs points of one job; rows come back as they finish."""

    slots: int
    """How many points run at once (submit at least this many to keep it busy)."""

    def submit(self, point: Point) -> None: ...

    def wait(self) -> list[tuple[Point, dict[str, Any]]]:
        """Block until at least one submitted point finished; return every finished one."""
        ...

    @property
    def pending(self) -> int: ...

    def close(self) -> None: ...


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else (os.cpu_count() or 1))


class InlineExecutor:
    """Runs each point in this process, one at a time (``--workers 1``)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.slots = 1
        self._queue: deque[Point] = deque()

    def submit(self, point: Point) -> None:
        self._queue.append(point)

    def wait(self) -> list[tuple[Point, dict[str, Any]]]:
        point = self._queue.popleft()
        return [(point, self.job.run(point))]

    @property
    def pending(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        self._queue.clear()


_WORKER_JOB: Job | None = None


def _init_worker(job: Job) -> None:
    global _WORKER_JOB
    _WORKER_JOB = job
    # Ctrl-C is the parent's to handle: it keeps what finished and ends the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_in_worker(point: Point) -> dict[str, Any]:
    assert _WORKER_JOB is not None, "worker started without its job"
    return _WORKER_JOB.run(point)


class LocalExecutor:
    """A process pool of ``workers`` processes (spawned, so safe under threads and notebooks);
    each receives the job once when it starts."""

    def __init__(self, job: Job, workers: int) -> None:
        self.slots = workers
        self._job = job
        ctx = multiprocessing.get_context("spawn")
        self._pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx,
                                         initializer=_init_worker, initargs=(job,))
        self._futures: dict[Future[dict[str, Any]], Point] = {}

    def submit(self, point: Point) -> None:
        self._futures[self._pool.submit(_run_in_worker, point)] = point

    def wait(self) -> list[tuple[Point, dict[str, Any]]]:
        done, _ = wait_futures(list(self._futures), return_when=FIRST_COMPLETED)
        out = []
        for f in done:
            point = self._futures.pop(f)
            exc = f.exception()
            out.append((point, f.result() if exc is None else
                        self._job.error_row(point, f"worker failed: {exc!r}")))
        return out

    @property
    def pending(self) -> int:
        return len(self._futures)

    def close(self) -> None:
        if self._futures:  # stopped early: end the points still running in our workers
            for proc in list(getattr(self._pool, "_processes", {}).values()):
                proc.terminate()
        # Wait for the pool's manager thread (the workers are idle or terminated, so this is
        # quick): left running, it can hit closed pipes at interpreter exit ("Bad file
        # descriptor" from threading after the answer was printed).
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._futures.clear()


# Ray ------------------------------------------------------------------------------------------

_RAY_JOBS: dict[str, Job] = {}


def _ray_run(job_ref: list[Any], point: Point) -> dict[str, Any]:
    """A Ray task: fetch and unpickle the job once per worker process, then run the point.

    ``job_ref`` is a one-element list so Ray passes the reference itself, not its value."""
    import ray

    key = job_ref[0].hex()
    job = _RAY_JOBS.get(key)
    if job is None:
        _RAY_JOBS.clear()
        job = _RAY_JOBS[key] = ray.get(job_ref[0])
    return job.run(point)


class RayUnavailable(RuntimeError):
    """Ray is not installed (it is the optional ``ray`` extra)."""


def twin_source_dir() -> Path:
    import twin

    return Path(twin.__file__).resolve().parent


class RayExecutor:
    """Points as Ray tasks (one CPU each) on a local Ray instance or a cluster.

    ``address``: join that cluster (``auto`` for the one ``ray start`` runs on this host); None
    starts a private local instance with ``num_cpus`` CPUs, which is shut down on close.
    ``ship_code``: send this checkout's ``twin`` package with the job (Ray's ``py_modules``) so
    every node runs the same code; off, the nodes import their installed ``twin``.
    """

    def __init__(self, job: Job, address: str | None = None, num_cpus: int | None = None,
                 ship_code: bool = True) -> None:
        try:
            import ray
        except ImportError:
            raise RayUnavailable(
                "--executor ray needs Ray: pip install 'staging-twin[ray]'") from None
        self._ray = ray
        self._job = job
        self._owned = False
        if not ray.is_initialized():
            runtime_env: dict[str, Any] = {}
            if ship_code:
                runtime_env["py_modules"] = [str(twin_source_dir())]
            kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False,
                                          configure_logging=False, runtime_env=runtime_env)
            if address is None:  # "local": a new instance, even if `ray start` ran here
                address = "local"
                kwargs["num_cpus"] = num_cpus or default_workers()
            ray.init(address=address, **kwargs)
            self._owned = True
        resources = getattr(ray, "cluster_resources")()  # noqa: B009 - untyped in Ray
        self.slots = max(1, int(resources.get("CPU", 1)))
        self._job_ref = ray.put(job)
        self._remote = ray.remote(num_cpus=1, max_retries=1)(_ray_run)
        self._refs: dict[Any, Point] = {}

    def submit(self, point: Point) -> None:
        self._refs[self._remote.remote([self._job_ref], point)] = point

    def wait(self) -> list[tuple[Point, dict[str, Any]]]:
        refs = list(self._refs)
        ready, rest = self._ray.wait(refs, num_returns=1)
        if rest:
            more, _ = self._ray.wait(rest, num_returns=len(rest), timeout=0)
            ready = [*ready, *more]
        out = []
        for ref in ready:
            point = self._refs.pop(ref)
            try:
                row = self._ray.get(ref)
            except Exception as exc:  # a task that raised or whose worker died
                row = self._job.error_row(point, f"ray task failed: {exc!r}"[:2000])
            out.append((point, row))
        return out

    @property
    def pending(self) -> int:
        return len(self._refs)

    def close(self) -> None:
        for ref in self._refs:
            self._ray.cancel(ref, force=True)
        self._refs.clear()
        if self._owned:
            self._ray.shutdown()


def make_executor(job: Job, kind: str = "local", workers: int | None = None,
                  address: str | None = None, ship_code: bool = True) -> Executor:
    """``local`` (``workers`` processes; 1 runs in this process) or ``ray``."""
    if kind == "ray":
        return RayExecutor(job, address=address, num_cpus=workers, ship_code=ship_code)
    if kind != "local":
        raise ValueError(f"unknown executor {kind!r}; known: local, ray")
    n = workers or default_workers()
    return InlineExecutor(job) if n == 1 else LocalExecutor(job, n)
