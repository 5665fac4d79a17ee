"""Start, feed and stop the rank processes of a hardware run; merge their records into a trace.

``Launcher`` spawns one process per prefill and decode attention-TP rank (free ports picked
automatically), hands out the directory of endpoints, NIXL metadata and ring descriptors, and
starts every rank on one clock. It always tears everything down (success, failure, timeout,
Ctrl-C, SIGTERM, SIGHUP): ranks are told to stop, joined, and killed if they do not exit;
sockets are closed. Ranks also die with the coordinator if it is killed (``lifeline``). A rank
that dies or raises is named in ``errors``, one line each; its full output (tracebacks, NIXL
messages) is in its log file, ``log_dir/NODE.log``. Records stream in from the ranks and are
written to the trace in time order, a window behind.

``plan_pool`` sizes the KV pool of every rank before launch, or checks a given size, so that no
request can run a rank out of pages.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twin.core.config import TwinConfig
from twin.core.defects import Defects
from twin.core.grid import pages_for_tokens
from twin.core.topology import Topology
from twin.hw.control import ControlError, ControlSocket
from twin.hw.lifeline import LOG_ENV, PARENT_ENV, rank_log_path
from twin.hw.rank import (
    CMD,
    DIRECTORY,
    HELLO,
    RECORDS,
    REPORT,
    START,
    STATE,
    STOP,
    RankSpec,
    rank_main,
)


@dataclass
class HwOptions:
    """Placement and limits of a hardware run."""

    device: str = "cpu"
    prefill_gpus: list[int] | None = None
    decode_gpus: list[int] | None = None
    kv_pool_pages: int = 2048
    wedge_window_s: float | None = None  # None: the run's SimParams.wedge_window_s
    timeout_s: float = 120.0
    start_timeout_s: float = 120.0
    max_concurrency: int = 4
    forward_s: float = 0.002
    kernels: str = ""
    until_s: float | None = None
    log_dir: str | None = None

    def device_of(self, role: str, index: int) -> str:
        if self.device != "cuda":
            return "cpu"
        gpus = self.prefill_gpus if role == "prefill" else self.decode_gpus
        return f"cuda:{gpus[index % len(gpus)]}" if gpus else f"cuda:{index}"


class LaunchError(RuntimeError):
    """A rank failed to start or died."""


class PoolError(ValueError):
    """The KV pool cannot hold a request, or the ranks' memory does not fit the host."""


@dataclass(frozen=True)
class PoolPlan:
    """KV pool pages per rank and what the ranks will allocate."""

    pages: int
    largest_request_pages: int
    auto: bool
    bytes_per_rank: dict[str, int]

    def describe(self) -> str:
        total = sum(self.bytes_per_rank.values()) / (1 << 30)
        how = (f"sized for {self.pages // max(1, self.largest_request_pages)} of the longest "
               f"requests" if self.auto else "--kv-pool-pages")
        return (f"{self.pages} pages per rank ({how}; the longest request needs "
                f"{self.largest_request_pages}); {total:.2f} GiB in all ranks' pools, "
                f"buffers and rings")


def page_bytes(cfg: TwinConfig, role: str) -> int:
    """Bytes of one KV page (K and V, every layer) on one rank of ``role``."""
    m = cfg.model
    tp = getattr(cfg, role).attn_tp_size
    heads = max(1, m.num_kv_heads // tp)
    return 2 * m.num_layers * cfg.page_size * heads * m.head_dim * m.dtype_bytes


def _available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_gpu_memory(topo: Topology, per_rank: dict[str, int], options: HwOptions, pages: int,
                      longest: int) -> None:
    """Every GPU's ranks must fit in its free memory."""
    try:
        import torch

        if not torch.cuda.is_available():
            return
        counters = {"prefill": 0, "decode": 0}
        need: dict[str, int] = {}
        for n in topo.nodes.values():
            dev = options.device_of(n.role, counters[n.role])
            counters[n.role] += 1
            need[dev] = need.get(dev, 0) + per_rank[n.id]
        for dev, nbytes in need.items():
            index = int(dev.split(":")[1])
            if index >= torch.cuda.device_count():
                raise PoolError(f"{dev}: no such GPU ({torch.cuda.device_count()} visible)")
            free = torch.cuda.mem_get_info(index)[0]
            if nbytes > 0.95 * free:
                raise PoolError(f"{dev}: its ranks would allocate {nbytes / (1 << 30):.1f} GiB "
                                f"(KV pools of {pages} pages, buffers, rings) but "
                                f"{free / (1 << 30):.1f} GiB is free; lower --max-concurrency "
                                f"or --kv-pool-pages (at least {longest}), or spread the ranks "
                                f"over more GPUs")
    except PoolError:
        raise
    except Exception:  # noqa: BLE001 - a failed probe must not block a run
        return


def plan_pool(cfg: TwinConfig, workload: Any, params: Any, overrides: dict[int, dict[str, int]],
              options: HwOptions, pages: int | None, max_concurrency: int) -> PoolPlan:
    """The KV pool pages per rank: ``pages`` if given (it must hold the longest request),
    else ``max_concurrency`` times the longest request. Raises ``PoolError`` (a ``ValueError``)
    naming the ``--kv-pool-pages`` needed, or when the ranks would not fit in host memory."""
    from twin.core.prefill import PrefillRank
    from twin.core.topology import build_rank

    longest = max((pages_for_tokens(r.input_len, cfg.page_size) for r in workload.requests),
                  default=1)
    longest = max(longest, 1)
    auto = pages is None
    if pages is None:
        pages = longest * max(1, min(max_concurrency, len(workload.requests) or 1))
    elif pages < longest:
        raise PoolError(f"--kv-pool-pages {pages}: the longest request needs {longest} pages "
                        f"({longest * cfg.page_size} tokens at page size {cfg.page_size}); use "
                        f"--kv-pool-pages {longest} or more, or leave it out to size the pool "
                        f"for --max-concurrency requests")
    topo = Topology(cfg)
    per_rank: dict[str, int] = {}
    for n in topo.nodes.values():
        nbytes = pages * page_bytes(cfg, n.role)
        if n.role == "decode":
            nbytes += cfg.ring_bytes
        else:
            core = build_rank(cfg, n, Defects())
            if isinstance(core, PrefillRank):
                nbytes += core.buffer_bytes * core.num_workers
        per_rank[n.id] = nbytes
    plan = PoolPlan(pages, longest, auto, per_rank)
    if options.device == "cuda":
        _check_gpu_memory(topo, per_rank, options, pages, longest)
    else:
        avail = _available_host_bytes()
        total = sum(per_rank.values())
        if avail is not None and total > 0.9 * avail:
            raise PoolError(
                f"the ranks would allocate {total / (1 << 30):.1f} GiB of host memory (KV pools "
                f"of {pages} pages, staging buffers, {cfg.ring_bytes / (1 << 20):g} MiB rings) "
                f"but {avail / (1 << 30):.1f} GiB is available; lower --max-concurrency or "
                f"--kv-pool-pages (at least {longest}), cut the workload (--first-n), or use a "
                f"smaller model or ring in --config")
    return plan


@dataclass(order=True)
class _Pending:
    t: float
    order: int
    node: str = field(compare=False)
    kind: str = field(compare=False)
    payload: Any = field(compare=False)


class Launcher:
    """The coordinator's side of a hardware run (a context manager)."""

    def __init__(self, cfg: TwinConfig, *, defects: Defects, faults: list[str], seed: int,
                 options: HwOptions, writer: Any = None,
                 scripts: dict[str, list[Any]] | None = None,
                 requests: dict[str, list[dict[str, Any]]] | None = None) -> None:
        self.cfg = cfg
        self.topo = Topology(cfg)
        self.defects = defects
        self.faults = faults
        self.seed = seed
        self.options = options
        self.writer = writer
        self.scripts = scripts
        self.requests = requests or {}
        self.sock = ControlSocket()
        self.procs: dict[str, Any] = {}
        self.endpoints: dict[str, str] = {}
        self.t0 = 0.0
        self._pending: list[_Pending] = []
        self._order = 0
        self._written_t = 0.0
        self._sent_upto: dict[str, float] = {}  # node -> time up to which it sent every record
        self.clamped = 0
        self.inputs = 0
        self.states: dict[str, Any] = {}
        self.on_records: Callable[[str, list[Any]], None] | None = None
        self.on_report: Callable[[dict[str, Any]], None] | None = None
        self.errors: list[str] = []
        self.failed_nodes: set[str] = set()
        self.stopping = False
        self.log_dir = options.log_dir
        self._own_log_dir = options.log_dir is None
        self._set_frame_log = False

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> Launcher:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        if self.log_dir is None:
            self.log_dir = tempfile.mkdtemp(prefix="twin-hw-logs-")
        else:
            os.makedirs(self.log_dir, exist_ok=True)
        # Spawned ranks inherit these: they die with this process and log to their own file.
        os.environ[PARENT_ENV] = str(os.getpid())
        os.environ[LOG_ENV] = self.log_dir
        self._set_frame_log = not self._own_log_dir and "TWIN_HW_LOG_DIR" not in os.environ
        if self._set_frame_log:
            os.environ["TWIN_HW_LOG_DIR"] = self.log_dir  # --log-dir: frame logs there too
        ctx = mp.get_context("spawn")
        by_unique = {n.unique_rank: n.id for n in self.topo.nodes.values()
                     if n.role == "prefill"}
        counters = {"prefill": 0, "decode": 0}
        for n in self.topo.nodes.values():
            spec = RankSpec(
                node=n.id, role=n.role, rank=n.rank, unique_rank=n.unique_rank,
                config=self.cfg.to_dict(), defects=self.defects.sorted(), faults=self.faults,
                coordinator=self.sock.endpoint,
                device=self.options.device_of(n.role, counters[n.role]),
                kv_pool_pages=self.options.kv_pool_pages, seed=self.seed,
                kernels=self.options.kernels,
                script=None if self.scripts is None else self.scripts.get(n.id, []),
                requests=self.requests.get(n.id, []),
                nodes_by_unique=by_unique)
            counters[n.role] += 1
            proc = ctx.Process(target=rank_main, args=(spec,), name=f"twin-{n.id}", daemon=True)
            proc.start()
            self.procs[n.id] = proc
        hellos: dict[str, tuple[dict[str, Any], bytes]] = {}
        deadline = time.monotonic() + self.options.start_timeout_s
        while len(hellos) < len(self.procs):
            frames = self._recv(deadline, "start")
            if frames[0] == HELLO:
                info = json.loads(frames[1])
                hellos[info["node"]] = (info, frames[2])
            elif frames[0] == REPORT:
                raise LaunchError(self._start_error(frames))
        order = sorted(hellos)
        directory = [hellos[n][0] for n in order]
        metas = [hellos[n][1] for n in order]
        for info in directory:
            self.endpoints[info["node"]] = info["endpoint"]
        body = [DIRECTORY, json.dumps(directory).encode(), *metas]
        for node in order:
            self.sock.send(self.endpoints[node], body)
        ready: set[str] = set()
        while len(ready) < len(self.procs):
            frames = self._recv(deadline, "bootstrap")
            if frames[0] == b"TWIN_READY":
                ready.add(frames[1].decode())
            elif frames[0] == REPORT:
                raise LaunchError(self._start_error(frames))
        self.t0 = time.monotonic()
        for node in order:
            self.sock.send(self.endpoints[node], [START, repr(self.t0).encode()])

    def _recv(self, deadline: float, phase: str) -> list[bytes]:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchError(f"ranks did not {phase} within "
                                  f"{self.options.start_timeout_s:g} s")
            dead = [n for n, p in self.procs.items() if not p.is_alive()]
            if dead:
                self.failed_nodes.update(dead)
                raise LaunchError(f"rank {dead[0]} exited during {phase} "
                                  f"({_exit_text(self.procs[dead[0]].exitcode)}); its log: "
                                  f"{self.log_of(dead[0])}")
            frames = self.sock.recv_frames(timeout_ms=min(500, int(left * 1000) + 1))
            if frames is not None:
                return frames

    def _start_error(self, frames: list[bytes]) -> str:
        report = json.loads(frames[2])
        node = report.get("node", frames[1].decode())
        self.failed_nodes.add(node)
        return f"{node} failed to start: {_last_line(report.get('detail', ''))} (full " \
               f"traceback: {self.log_of(node)})"

    def log_of(self, node: str) -> str:
        """The log file of ``node`` (its stderr: tracebacks, NIXL messages)."""
        return rank_log_path(self.log_dir or ".", node)

    def check_alive(self) -> list[str]:
        """Name ranks whose process ended while the run goes on (an error each)."""
        dead = []
        for node, p in self.procs.items():
            if node in self.failed_nodes or p.is_alive():
                continue
            self.failed_nodes.add(node)
            dead.append(node)
            self.errors.append(f"{node}: rank process died ({_exit_text(p.exitcode)}); its "
                               f"log: {self.log_of(node)}")
        return dead

    def stop(self) -> None:
        """Stop every rank (gracefully, then by force), flush the trace, close the socket."""
        self.stopping = True
        for node, ep in self.endpoints.items():
            if self.procs.get(node) is not None and self.procs[node].is_alive():
                # A dead peer must not stop the teardown.
                with contextlib.suppress(Exception):
                    self.sock.send(ep, [STOP], timeout_ms=500)
        deadline = time.monotonic() + 10
        while any(p.is_alive() for p in self.procs.values()) and time.monotonic() < deadline:
            self.pump(50)
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
                p.join(3)
            if p.is_alive():
                p.kill()
                p.join(3)
        self.pump(0)
        if self.clamped and self.writer is not None:
            self.sys({"type": "Note", "text": f"{self.clamped} record(s) reached the coordinator "
                      f"after later ones were written; their times were raised to keep "
                      f"the trace in time order"}, t=self._written_t)
        self.flush_records(final=True)
        self.sock.close()
        for key in (PARENT_ENV, LOG_ENV) + (("TWIN_HW_LOG_DIR",) if self._set_frame_log else ()):
            os.environ.pop(key, None)
        if self._own_log_dir and self.log_dir and not self.failed_nodes:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    # -- talking to ranks ----------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    def command(self, node: str, cmd: dict[str, Any]) -> None:
        """Send ``cmd`` to ``node``; a rank that cannot take it is an error, not a raise."""
        if node in self.failed_nodes:
            return
        try:
            self.sock.send(self.endpoints[node], [CMD, pickle.dumps(cmd)])
        except ControlError as exc:
            self.failed_nodes.add(node)
            proc = self.procs.get(node)
            state = ("its process is gone" if proc is not None and not proc.is_alive()
                     else "it is stuck or unreachable")
            self.errors.append(f"{node}: the coordinator cannot reach it ({state}): {exc}")

    def feed(self, node: str, event: Any) -> None:
        self.command(node, {"op": "feed", "event": event})

    def request_states(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """Every rank's state: ``{"snapshot", "next" (replay), "held" (replay)}``."""
        self.states = {}
        for node in self.endpoints:
            self.command(node, {"op": "state"})
        deadline = time.monotonic() + timeout_s
        while len(self.states) < len(self.endpoints) and time.monotonic() < deadline:
            self.pump(50)
        return self.states

    def pump(self, timeout_ms: int) -> int:
        """Receive and dispatch rank messages for up to ``timeout_ms``; return how many."""
        n = 0
        frames = self.sock.recv_frames(timeout_ms=timeout_ms)
        while frames is not None:
            n += 1
            tag = bytes(frames[0])
            if tag == RECORDS:
                node = frames[1].decode()
                records, reports, upto = pickle.loads(frames[2])
                self._sent_upto[node] = upto
                self._records(node, records)
                for r in reports:
                    self._report(r)
            elif tag == REPORT:
                self._report(json.loads(frames[2]))
            elif tag == STATE:
                self.states[frames[1].decode()] = pickle.loads(frames[2])
            frames = self.sock.recv_frames(timeout_ms=0)
        self.flush_records()
        return n

    def _report(self, report: dict[str, Any]) -> None:
        if report.get("kind") == "error":
            node = str(report.get("node"))
            self.failed_nodes.add(node)
            self.errors.append(f"{node}: {_last_line(str(report.get('detail', '')))} (full "
                               f"traceback: {self.log_of(node)})")
        if self.on_report is not None:
            self.on_report(report)

    def _records(self, node: str, records: list[Any]) -> None:
        self.inputs += len(records)
        for t, event, effects in records:
            self._order += 1
            heapq.heappush(self._pending, _Pending(t, self._order, node, "core",
                                                   (event, effects)))
        if self.on_records is not None:
            self.on_records(node, records)

    def sys(self, record: dict[str, Any], t: float | None = None) -> None:
        self._order += 1
        heapq.heappush(self._pending, _Pending(self.now() if t is None else t, self._order,
                                               "driver", "sys", record))

    def flush_records(self, final: bool = False) -> None:
        """Write the records every rank has sent up to the same time (all of them when ``final``)."""
        if self.writer is None:
            self._pending.clear()
            return
        if final:
            horizon = float("inf")
        else:  # every rank has sent all its records up to the slowest one's report
            horizon = min((self._sent_upto.get(n, 0.0) for n in self.endpoints), default=0.0)
            horizon = min(horizon, self.now())
        while self._pending and self._pending[0].t <= horizon:
            p = heapq.heappop(self._pending)
            t = p.t
            if t < self._written_t:
                self.clamped += 1
                t = self._written_t
            self._written_t = t
            if p.kind == "sys":
                self.writer.write_sys(t, p.node, p.payload)
            else:
                event, effects = p.payload
                self.writer.write_input(t, p.node, event)
                self.writer.write_effects(t, p.node, effects)


def _last_line(text: str) -> str:
    """The exception line of a traceback."""
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    return lines[-1] if lines else "rank failed"


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
