"""The host a hardware run ran on: its fingerprint and a short probe of its speed.

``host_record()`` is what ``twin hw --trace-out`` writes into the trace header (its config's
``[run]`` table, key ``host``) before any rank starts, when every rank runs on this host:

* ``hostname``, ``cpu`` (the model name) and ``cores`` (usable by this process): the host's
  identity (``twin calibrate`` copies it into the costs it writes, and ``twin replay`` says so
  when the costs were fitted on another host);
* ``probe``: rates measured in about 0.2 s, with the host as it is when the run starts:
  ``py_ops_per_s`` (dictionary updates, the rank loops' kind of work), ``memcpy_Bps`` (a
  4 MiB copy), ``scatter_Bps`` (a 128 KiB chunk scattered into random rows, as a decode
  rank's scatter moves it) and ``wakeup_s`` (median round trip of one byte to a forked
  process over pipes: what a frame between two rank processes waits for the scheduler).

A probe is a sample of the host before the run, not of the run: on a host shared with other
work the run's own timings drift further than the probe does (``docs/simulator.md``).
"""

from __future__ import annotations

import os
import platform
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np

IDENTITY = ("hostname", "cpu", "cores")
"""The fingerprint's fields that name a host (the probe's rates are measurements)."""

PROBE_S = 0.03
"""Seconds each rate of the probe is measured for (at least 5 repetitions)."""


def fingerprint() -> dict[str, Any]:
    """``hostname``, ``cpu`` model and usable ``cores`` of this host."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 0
    return {"hostname": socket.gethostname(), "cpu": cpu or platform.processor()
            or platform.machine(), "cores": cores}


def _median_s(fn: Callable[[], object], budget_s: float = PROBE_S, at_least: int = 5) -> float:
    """Median seconds of one call of ``fn`` over ``budget_s`` (``at_least`` calls)."""
    times: list[float] = []
    end = time.perf_counter() + budget_s
    while time.perf_counter() < end or len(times) < at_least:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _py_ops() -> float:
    ops = 2000

    def work() -> None:
        d: dict[int, int] = {}
        for i in range(ops):
            d[i % 97] = d.get(i % 97, 0) + i
    return ops / _median_s(work)


def _memcpy() -> float:
    src = np.ones(4 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    return src.nbytes / _median_s(lambda: np.copyto(dst, src))


def _scatter() -> float:
    rows, row_bytes = 4096, 256  # a pool of 1 MiB; a chunk of 512 rows, as a paged KV pool
    pool = np.zeros((rows, row_bytes), dtype=np.uint8)
    chunk = np.ones((512, row_bytes), dtype=np.uint8)
    idx = np.random.default_rng(0).permutation(rows)[:512]

    def scatter() -> None:
        pool[idx] = chunk
    return chunk.nbytes / _median_s(scatter)


def _wakeup(rounds: int = 200) -> float | None:
    """Median round trip of one byte to a forked echo process (None where ``fork`` is
    missing)."""
    if not hasattr(os, "fork"):
        return None
    down_r, down_w = os.pipe()
    up_r, up_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the echo: reads and writes only, then leaves without any clean-up
        os.close(down_w)
        os.close(up_r)
        try:
            while (b := os.read(down_r, 1)) not in (b"", b"q"):
                os.write(up_w, b)
        finally:
            os._exit(0)
    os.close(down_r)
    os.close(up_w)
    times = []
    try:
        for i in range(rounds + 5):
            t0 = time.perf_counter()
            os.write(down_w, b"x")
            os.read(up_r, 1)
            if i >= 5:  # the first rounds wake a process that has never run
                times.append(time.perf_counter() - t0)
    finally:
        os.write(down_w, b"q")
        os.close(down_w)
        os.close(up_r)
        os.waitpid(pid, 0)
    return float(np.median(times))


def probe() -> dict[str, float]:
    """The probe's rates (see the module docstring); about 0.2 s."""
    out = {"py_ops_per_s": _py_ops(), "memcpy_Bps": _memcpy(), "scatter_Bps": _scatter()}
    wake = _wakeup()
    if wake is not None:
        out["wakeup_s"] = wake
    return {k: float(f"{v:.4g}") for k, v in out.items()}


def host_record() -> dict[str, Any]:
    """This host's fingerprint with a fresh probe (``probe``) and how long it took."""
    t0 = time.perf_counter()
    rates = probe()
    return {**fingerprint(), "probe": rates,
            "probe_s": round(time.perf_counter() - t0, 3)}
