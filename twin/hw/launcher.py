"""Start, feed and stop the rank processes of a hardware run; merge their records into a trace.

``Launcher`` spawns one process per prefill and decode attention-TP rank (free ports picked
automatically), or, across nodes, has each node's agent start that node's ranks
(``twin.hw.nodes.AgentHub``); it hands out the directory of endpoints, NIXL metadata and ring
descriptors, and starts every rank on one clock (on another host: the coordinator's start time
in that host's clock, from its agent's measured offset). It always tears everything down
(success, failure, timeout, Ctrl-C, SIGTERM, SIGHUP): ranks are told to stop, joined, and
killed if they do not exit; on other nodes their agents stop what is left;
sockets are closed. Ranks also die with the coordinator if it is killed (``lifeline``). A rank
that dies or raises is named in ``errors``, one line each; its full output (tracebacks, NIXL
messages) is in its log file, ``log_dir/NODE.log``. Records stream in from the ranks and are
written to the trace in time order, a window behind.

``plan_pool`` sizes the KV pool of every rank before launch, or checks a given size, so that no
request can run a rank out of pages.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twin.core.config import TwinConfig, pp_layer_range
from twin.core.defects import Defects
from twin.core.grid import pages_for_tokens
from twin.core.topology import Topology, build_rank
from twin.hw import messages
from twin.hw.auth import RunKey
from twin.hw.control import ControlError, ControlSocket
from twin.hw.hostmem import RANK_OVERHEAD_BYTES, available_host_bytes, fits, host_need
from twin.hw.lifeline import LOG_ENV, PARENT_ENV, rank_log_path
from twin.hw.netutil import has_rdma_devices
from twin.hw.nodes import AgentHub, NodesError, PlacementEntry, RemoteRank
from twin.hw.pacing import prompt_wakeups
from twin.hw.procs import start_rank
from twin.hw.rankspec import (
    CMD,
    DIRECTORY,
    HELLO,
    RECORDS,
    REPORT,
    START,
    STATE,
    STOP,
    RankSpec,
)
from twin.runtime.faults import parse_fault, scope_nodes
from twin.runtime.params import SimParams


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
    # Across nodes (``twin hw --listen``): agents start the ranks.
    listen: tuple[str, int] | None = None
    agents: int | None = None
    agent_timeout_s: float = 120.0
    heartbeat_timeout_s: float = 10.0
    control_ports: tuple[int, int] | None = None
    data_ports: tuple[int, int] | None = None
    placement: list[PlacementEntry] | None = None
    rank_bytes: dict[str, int] | None = None  # plan_pool's, checked against each agent's host

    @property
    def across_nodes(self) -> bool:
        return self.listen is not None

    def device_of(self, role: str, index: int) -> str:
        if self.device != "cuda":
            return "cpu"
        gpus = self.prefill_gpus if role == "prefill" else self.decode_gpus
        return f"cuda:{gpus[index % len(gpus)]}" if gpus else f"cuda:{index}"


class LaunchError(RuntimeError):
    """A rank failed to start or died, or agents did not join."""


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


def page_bytes(cfg: TwinConfig, role: str, pp_rank: int = 0) -> int:
    """Bytes of one KV page (K and V of every layer the rank holds: a prefill PP stage's
    layers only) on one rank of ``role``."""
    m = cfg.model
    side = getattr(cfg, role)
    heads = max(1, m.num_kv_heads // side.attn_tp_size)
    first, stop = pp_layer_range(m.num_layers, pp_rank, side.pp_size)
    return 2 * (stop - first) * cfg.page_size * heads * m.head_dim * m.dtype_bytes


def _check_gpu_memory(topo: Topology, per_rank: dict[str, int], options: HwOptions, pages: int,
                      remedy: str) -> None:
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
                                f"{free / (1 << 30):.1f} GiB is free; {remedy}, or spread "
                                f"the ranks over more GPUs")
    except PoolError:
        raise
    except Exception:  # noqa: BLE001 - a failed probe must not block a run
        return


def plan_pool(cfg: TwinConfig, workload: Any, params: Any, overrides: dict[int, dict[str, int]],
              options: HwOptions, pages: int | None, max_concurrency: int) -> PoolPlan:
    """The KV pool pages per rank: ``pages`` if given (it must hold the longest request),
    else ``max_concurrency`` times the longest request. Raises ``PoolError`` (a ``ValueError``)
    naming the ``--kv-pool-pages`` needed, or when the ranks would not fit in host memory."""
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
    plan = PoolPlan(pages, longest, auto, rank_allocations(cfg, pages))
    check_fits(cfg, plan.bytes_per_rank, options, pages,
               f"lower --max-concurrency or --kv-pool-pages (at least {longest}), cut the "
               f"workload (--first-n), or use a smaller model or ring in --config")
    return plan


def rank_allocations(cfg: TwinConfig, pages: int) -> dict[str, int]:
    """Bytes each rank allocates: its KV pool of ``pages`` pages, and the decode ranks' ring
    (none when nothing is staged) or the prefill ranks' staging buffers."""
    from twin.core.prefill import PrefillRank

    per_rank: dict[str, int] = {}
    for n in Topology(cfg).nodes.values():
        nbytes = pages * page_bytes(cfg, n.role, n.pp_rank)
        if n.role == "decode":
            nbytes += cfg.ring_bytes if cfg.stages else 0
        else:
            core = build_rank(cfg, n, Defects())
            if isinstance(core, PrefillRank):
                nbytes += core.buffer_bytes * core.num_workers
        per_rank[n.id] = nbytes
    return per_rank


def check_fits(cfg: TwinConfig, per_rank: dict[str, int], options: HwOptions, pages: int,
               remedy: str) -> None:
    """Raise ``PoolError`` (saying what to do: ``remedy``) when the ranks' allocations would
    not fit this host's memory or GPUs. Across nodes each agent checks its own host."""
    if options.across_nodes:
        return
    if options.device == "cuda":
        _check_gpu_memory(Topology(cfg), per_rank, options, pages, remedy)
        return
    avail = available_host_bytes()
    total = host_need(per_rank.values())
    if not fits(total, avail):
        assert avail is not None
        rings = f"{cfg.ring_bytes / (1 << 20):g} MiB rings" if cfg.stages else "no rings"
        raise PoolError(
            f"the ranks would take {total / (1 << 30):.1f} GiB of host memory (KV pools "
            f"of {pages} pages, staging buffers, {rings}, "
            f"{RANK_OVERHEAD_BYTES >> 20} MiB per rank process) but "
            f"{avail / (1 << 30):.1f} GiB is available; {remedy}")


def open_hub(cfg: TwinConfig, options: HwOptions,
             echo: Callable[[str], None] | None = None) -> AgentHub | None:
    """Across nodes: listen, wait for the agents, measure their clocks and place the ranks
    (printed through ``echo``). ``None`` for a single-node run. Raises ``LaunchError``."""
    if options.listen is None:
        return None
    hub = AgentHub(options.listen, options.agents or len(options.placement or []) or 1,
                   join_timeout_s=options.agent_timeout_s,
                   heartbeat_timeout_s=options.heartbeat_timeout_s,
                   control_ports=options.control_ports, data_ports=options.data_ports,
                   placement=options.placement, echo=echo)
    try:
        hub.gather(Topology(cfg), options.device, options.rank_bytes)
    except NodesError as exc:
        hub.close()
        raise LaunchError(str(exc)) from None
    except BaseException:
        hub.close()
        raise
    return hub


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
                 requests: dict[str, list[dict[str, Any]]] | None = None,
                 hub: AgentHub | None = None, params: SimParams | None = None,
                 open_writer: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self.cfg = cfg
        # Opens the trace once the ranks are ready, given the facts of the start-up for its
        # header's [run] table: ``{"warmup": ..., "pacing": ...}``.
        self.open_writer = open_writer
        self._gc_frozen = False
        # What the coordinator asked of the kernel for its timers (twin.hw.pacing), and how to
        # undo it when the run ends.
        self.pacing: dict[str, Any] = {}
        self._restore_pacing: Callable[[], None] | None = None
        self.topo = Topology(cfg)
        self.params = params or SimParams()
        self.defects = defects
        self.faults = faults
        self.seed = seed
        self.options = options
        self.writer = writer
        self.scripts = scripts
        self.requests = requests or {}
        self.hub = hub
        # The run's key: every socket of the run proves it (twin.hw.auth).
        self.key = hub.key if hub is not None else RunKey.new()
        self.sock = hub.sock if hub is not None else ControlSocket(key=self.key)
        # One note per control frame that did not decode (the hub's list, across nodes).
        self.dropped: list[str] = hub.dropped if hub is not None else []
        self.procs: dict[str, Any] = {}  # node -> multiprocessing.Process, or RemoteRank
        self.endpoints: dict[str, str] = {}
        self.t0 = 0.0
        self._pending: list[_Pending] = []
        self._order = 0
        self._written_t = 0.0
        self._sent_upto: dict[str, float] = {}  # node -> time up to which it sent every record
        self.clock_margin = 0.0  # how far two hosts' corrected clocks may disagree
        self.clamped = 0
        self.inputs = 0
        self.states: dict[str, Any] = {}
        self.on_records: Callable[[str, list[Any]], None] | None = None
        self.on_report: Callable[[dict[str, Any]], None] | None = None
        self.errors: list[str] = []
        self.failed_nodes: set[str] = set()
        # node -> index in ``errors`` of "cannot reach it": its death may be reported later
        self._unreachable: dict[str, int] = {}
        self.stopping = False
        self.log_dir = options.log_dir
        self._own_log_dir = options.log_dir is None
        self._set_frame_log = False
        self._set_env: list[str] = []
        self.clock_notes: list[str] = []
        # Ranks a crash fault ends (node -> its time): their exits are the run's, not errors.
        self.crash_plan: dict[str, float] = {}
        for text in faults:
            spec = parse_fault(text)
            if spec.action == "crash" and spec.target in self.topo.nodes:
                for node in scope_nodes(self.topo, spec):
                    at = spec.at or 0.0
                    self.crash_plan[node] = min(at, self.crash_plan.get(node, at))
        # What the ranks' warm-up took before the first request (``twin.hw.warmup``), for
        # the trace header: {"ran", "seconds", "ranks": {node: report}}; empty until started.
        self.warmup: dict[str, Any] = {}
        self.dead: dict[str, float] = {}  # node -> when a crash fault's exit was seen
        self.gone: set[str] = set()  # dead ranks whose last records arrived

    @property
    def departed(self) -> set[str]:
        """Ranks a crash fault ended: their exit seen, or their last records in."""
        return self.dead.keys() | self.gone

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
        if self.hub is None:
            self._spawn_local()
        else:
            self._launch_remote()
        hellos: dict[str, tuple[dict[str, Any], bytes]] = {}
        deadline = time.monotonic() + self.options.start_timeout_s
        while len(hellos) < len(self.procs):
            frames = self._recv(deadline, "start")
            info = self._starting(frames, HELLO, "start",
                                  lambda f: _hello(f, set(self.procs)))
            if info is not None:
                hellos[info["node"]] = (info, frames[2])
        order = sorted(hellos)
        directory = [hellos[n][0] for n in order]
        metas = [hellos[n][1] for n in order]
        for info in directory:
            self.endpoints[info["node"]] = info["endpoint"]
        body = [DIRECTORY, json.dumps(directory).encode(), *metas]
        warm_t0 = time.monotonic()
        for node in order:
            self.sock.send(self.endpoints[node], body)
        ready: dict[str, dict[str, Any]] = {}  # node -> its warm-up report
        while len(ready) < len(self.procs):
            frames = self._recv(deadline, "bootstrap")
            got = self._starting(frames, b"TWIN_READY", "bootstrap", self._ready)
            if got is not None:
                ready[got[0]] = got[1]
        ready_at = time.monotonic()
        # Every rank warmed its connections and transfer paths before it said ready
        # (twin.hw.warmup): from the directory to the last rank ready, and each rank's own.
        self.warmup = {"ran": True, "seconds": round(ready_at - warm_t0, 6),
                       "ranks": dict(sorted(ready.items()))}
        # The forward timers of this thread wake on time (twin.hw.pacing), and what this
        # process set up so far lives for the run: the collector is kept off it, so that a
        # full collection cannot hold a forward (SGLang's freeze_gc after warm-up).
        self.pacing, self._restore_pacing = prompt_wakeups()
        gc.freeze()
        self._gc_frozen = True
        if self.open_writer is not None:  # the header records both: the trace starts after
            self.writer = self.open_writer({"warmup": self.warmup, "pacing": self.pacing})
        self.t0 = time.monotonic()
        for node in order:
            # Each rank's clock origin in its own host's clock: its records are our time.
            t0 = self.t0 + (self.hub.offset_of(node) if self.hub is not None else 0.0)
            self.sock.send(self.endpoints[node], [START, repr(t0).encode()])

    def _ready(self, frames: list[bytes]) -> tuple[str, dict[str, Any]]:
        """A rank's ``TWIN_READY``: its node and its warm-up report (``twin.hw.warmup``)."""
        node = self._node_of(frames)
        report = messages.json_object(frames[2]) if len(frames) > 2 else {}
        return node, {k: v for k, v in report.items()
                      if isinstance(k, str) and isinstance(v, (int, float))}

    def _starting(self, frames: list[bytes], tag: bytes, phase: str,
                  take: Callable[[list[bytes]], Any]) -> Any:
        """``take(frames)`` for the frame kind a start-up phase waits for; a rank's error
        report ends the start (``LaunchError``); anything else is dropped with a note (None)."""
        try:
            if frames[0] == tag:
                return take(frames)
            if frames[0] == REPORT:
                raise LaunchError(self._start_error(frames))
            raise messages.BadFrame(f"not expected while ranks {phase}")
        except (messages.BadFrame, IndexError, UnicodeDecodeError) as exc:
            self.drop(frames, exc)
            return None

    def _specs(self, device_of: Callable[[Any, int], str]) -> list[RankSpec]:
        by_unique = {n.unique_rank: n.id for n in self.topo.nodes.values()
                     if n.role == "prefill"}
        counters = {"prefill": 0, "decode": 0}
        specs = []
        for n in self.topo.nodes.values():
            specs.append(RankSpec(
                node=n.id, role=n.role, rank=n.rank, unique_rank=n.unique_rank,
                pp_rank=n.pp_rank,
                config=self.cfg.to_dict(), defects=self.defects.sorted(), faults=self.faults,
                coordinator=self.sock.endpoint, device=device_of(n, counters[n.role]),
                kv_pool_pages=self.options.kv_pool_pages, seed=self.seed,
                kernels=self.options.kernels,
                script=None if self.scripts is None else self.scripts.get(n.id, []),
                requests=self.requests.get(n.id, []),
                nodes_by_unique=by_unique,
                zmq_send_timeout_s=self.params.zmq_send_timeout_s,
                zmq_sndhwm=self.params.zmq_sndhwm,
                heartbeat_interval_s=self.params.heartbeat_interval_s,
                heartbeat_max_failure=self.params.heartbeat_max_failure))
            counters[n.role] += 1
        return specs

    def _spawn_local(self) -> None:
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
        if self.options.device == "cpu" and "UCX_NET_DEVICES" not in os.environ and \
                not has_rdma_devices():
            # One host: UCX's TCP transport listens on loopback only, not on every interface.
            os.environ["UCX_NET_DEVICES"] = "lo"
            self._set_env.append("UCX_NET_DEVICES")
        for spec in self._specs(lambda n, k: self.options.device_of(n.role, k)):
            spec.secret = self.key.secret
            self.procs[spec.node] = start_rank(spec)

    def _launch_remote(self) -> None:
        hub = self.hub
        assert hub is not None
        specs = self._specs(lambda n, k: hub.ranks[n.id].agent.ranks[n.id])
        hub.launch(specs)
        for spec in specs:
            self.procs[spec.node] = hub.ranks[spec.node]
        self.clock_margin = hub.margin_s

    def _recv(self, deadline: float, phase: str) -> list[bytes]:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchError(f"ranks did not {phase} within "
                                  f"{self.options.start_timeout_s:g} s")
            if self.hub is not None:
                self.hub.pump_agents(0)  # heartbeats and rank exits first, then judge
                self._tick_agents()
                if self.errors:
                    raise LaunchError(self.errors[0])
            dead = [n for n, p in self.procs.items() if not p.is_alive()]
            if dead:
                self.failed_nodes.update(dead)
                raise LaunchError(f"rank {dead[0]} exited during {phase} "
                                  f"({self._death(dead[0])}); its log: {self.log_of(dead[0])}"
                                  f"{self._tail(dead[0])}")
            frames = self.sock.recv_frames(timeout_ms=min(500, int(left * 1000) + 1))
            if frames is not None and not (self.hub is not None and self.hub.handle(frames)):
                return frames

    def _death(self, node: str) -> str:
        p = self.procs[node]
        return p.reason() if isinstance(p, RemoteRank) else _exit_text(p.exitcode)

    def _tail(self, node: str) -> str:
        p = self.procs.get(node)
        if isinstance(p, RemoteRank) and p.tail:
            return f"; its last log line: {p.tail.splitlines()[-1].strip()[:300]}"
        return ""

    def _tick_agents(self) -> None:
        """Heartbeats; an agent gone silent or reporting an error is an error naming it (its
        ranks are stopped by the agent itself)."""
        hub = self.hub
        if hub is None:
            return
        hub.tick()
        for a in hub.take_lost():
            ranks = sorted(a.ranks)
            self.failed_nodes.update(ranks)
            if self.stopping:
                continue
            self.errors.append(f"agent {a.name} ({a.address}, ranks {', '.join(ranks) or '-'}):"
                               f" {a.lost}; its ranks end with the agent (which stops them "
                               f"when it loses the coordinator)")
        while hub.errors:
            text = hub.errors.pop(0)
            if not self.stopping:
                self.errors.append(text)

    def _start_error(self, frames: list[bytes]) -> str:
        self._node_of(frames)
        report = messages.json_object(frames[2])
        node = report.get("node", frames[1].decode())
        self.failed_nodes.add(node)
        return f"{node} failed to start: {_last_line(report.get('detail', ''))} (full " \
               f"traceback: {self.log_of(node)})"

    def log_of(self, node: str) -> str:
        """The log file of ``node`` (its stderr: tracebacks, NIXL messages); on another node
        ``AGENT:PATH`` on that agent's host."""
        p = self.procs.get(node)
        if isinstance(p, RemoteRank):
            return p.log()
        return rank_log_path(self.log_dir or ".", node)

    def check_alive(self) -> list[str]:
        """Name ranks whose process ended while the run goes on (an error each), and agents
        that went silent (an error each, naming their ranks)."""
        self._tick_agents()
        dead = []
        for node, p in self.procs.items():
            if node in self.failed_nodes or node in self.dead or p.is_alive():
                continue
            if self.now() >= self.crash_plan.get(node, float("inf")) - 0.5:
                self.dead[node] = self.now()  # its crash fault: the run goes on without it
                continue
            self.failed_nodes.add(node)
            dead.append(node)
            self.errors.append(self._death(node))
        return dead

    def _death(self, node: str) -> str:
        """The error naming why ``node``'s process ended (it has)."""
        p = self.procs[node]
        if isinstance(p, RemoteRank):
            return f"{node}: {p.reason()}; its log: {p.log()}{self._tail(node)}"
        return f"{node}: rank process died ({_exit_text(p.exitcode)}); its log: {self.log_of(node)}"

    def settle_unreachable(self, grace_s: float = 2.0) -> None:
        """Before stopping on errors: a rank the coordinator could not reach may have died (on
        a loaded host the send can time out before its agent reports the death). Wait up to
        ``grace_s`` for that news; a rank known dead is then named by its death, not by the
        failed send. One that is still alive stays "stuck or unreachable". Nothing to do (no
        wait) when every send went through."""
        waiting = [n for n in self._unreachable if n in self.procs]
        deadline = time.monotonic() + grace_s
        while any(self.procs[n].is_alive() for n in waiting) and time.monotonic() < deadline:
            self.pump(50)
        for node in waiting:
            if not self.procs[node].is_alive():
                self.errors[self._unreachable[node]] = self._death(node)

    def stop(self) -> None:
        """Stop every rank (gracefully, then by force; on other nodes through their agents),
        flush the trace, close the socket."""
        if self.hub is not None and self.t0 and not self.stopping:
            with contextlib.suppress(Exception):  # the re-check must not stop the teardown
                self.hub.sync_clocks(self.pump, end=True, rounds=4, round_timeout_s=0.5)
                self.clock_notes = self.hub.clock_notes()
                for note in self.clock_notes:
                    self.sys({"type": "Note", "text": note})
        self.stopping = True
        if self._gc_frozen:
            gc.unfreeze()
            self._gc_frozen = False
        if self._restore_pacing is not None:
            self._restore_pacing()
            self._restore_pacing = None
        for node, ep in self.endpoints.items():
            if self.procs.get(node) is not None and self.procs[node].is_alive():
                # A dead peer must not stop the teardown.
                with contextlib.suppress(Exception):
                    self.sock.send(ep, [STOP], timeout_ms=500)
        # Wait for the ranks told to stop (on other nodes: those that know they are in a run;
        # their agents stop the others).
        told = [p for n, p in self.procs.items()
                if n in self.endpoints or not isinstance(p, RemoteRank)]
        deadline = time.monotonic() + 10
        while any(p.is_alive() for p in told) and time.monotonic() < deadline:
            self.pump(50)
        if self.hub is not None:  # agents stop what is left of their ranks, then leave
            self.hub.stop_agents()
            deadline = time.monotonic() + 15
            while not self.hub.all_gone() and time.monotonic() < deadline:
                self.pump(50)
        for p in self.procs.values():
            if isinstance(p, RemoteRank):
                continue
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
        if self.hub is not None:
            self.hub.close()
        else:
            self.sock.close()
        for key in (PARENT_ENV, LOG_ENV, *self._set_env) + \
                (("TWIN_HW_LOG_DIR",) if self._set_frame_log else ()):
            os.environ.pop(key, None)
        if self._own_log_dir and self.log_dir and not self.failed_nodes:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    # -- talking to ranks ----------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    def command(self, node: str, cmd: messages.Command) -> None:
        """Send ``cmd`` to ``node``; a rank that cannot take it is an error, not a raise."""
        if node in self.failed_nodes or node in self.departed:
            return  # a crashed rank takes no more commands (the simulator drops its inputs)
        try:
            self.sock.send(self.endpoints[node], [CMD, messages.encode(cmd)])
        except ControlError as exc:
            self.failed_nodes.add(node)
            proc = self.procs.get(node)
            state = ("its process is gone" if proc is not None and not proc.is_alive()
                     else "it is stuck or unreachable")
            self._unreachable[node] = len(self.errors)
            self.errors.append(f"{node}: the coordinator cannot reach it ({state}): {exc}")

    def feed(self, node: str, event: Any) -> None:
        self.command(node, messages.feed(event))

    def request_states(self, timeout_s: float = 10.0) -> dict[str, messages.RankState]:
        """Every rank's state (``messages.RankState``: snapshot, next scripted input, held)."""
        self.states = {}
        departed = self.departed
        live = [n for n in self.endpoints if n not in departed]
        for node in live:
            self.command(node, messages.QueryState())
        deadline = time.monotonic() + timeout_s
        while len(self.states) < len(live) and time.monotonic() < deadline:
            self.pump(50)
        return self.states

    def pump(self, timeout_ms: int, *, flush: bool = True, until: float | None = None) -> int:
        """Receive and dispatch rank messages for up to ``timeout_ms``; return how many.
        ``until`` (run time): stop reading at it, leaving the rest queued, so that a timer due
        then is not held behind a backlog of records; ``flush``: write the records every rank
        has sent up to a common time to the trace (the caller does it later otherwise)."""
        n = 0
        frames = self.sock.recv_frames(timeout_ms=timeout_ms)
        while frames is not None:
            n += 1
            try:
                self._dispatch(frames)
            except (messages.BadFrame, IndexError, UnicodeDecodeError) as exc:
                self.drop(frames, exc)
            if until is not None and self.now() >= until:
                break
            frames = self.sock.recv_frames(timeout_ms=0)
        if self.hub is not None:
            self._tick_agents()  # after reading what arrived, heartbeats included
        if flush:
            self.flush_records()
        return n

    def _dispatch(self, frames: list[bytes]) -> None:
        tag = bytes(frames[0])
        if self.hub is not None and self.hub.handle(frames):
            return
        if tag == RECORDS:
            node = self._node_of(frames)
            records, reports, upto = messages.decode_records(frames[2], f"TWIN_REC from {node}")
            self._sent_upto[node] = upto
            self._records(node, records)
            for r in reports:
                self._report(r)
        elif tag == REPORT:
            self._node_of(frames)
            report = messages.json_object(frames[2])
            try:
                self._report(report)
            except (KeyError, TypeError, ValueError) as exc:
                raise messages.BadFrame(f"a report lacking what its kind needs: {exc!r}"
                                        ) from None
        elif tag == STATE:
            node = self._node_of(frames)
            self.states[node] = messages.decode(frames[2], messages.RankState)
        else:
            raise messages.BadFrame("not a frame kind the coordinator takes")

    def _node_of(self, frames: list[bytes]) -> str:
        node = bytes(frames[1]).decode()
        if node not in self.endpoints and node not in self.procs:
            raise messages.BadFrame(f"no rank {node[:40]!r} in this run")
        return node

    def drop(self, frames: list[bytes], exc: Exception) -> None:
        """One note for a frame that does not decode; the run goes on."""
        tag = bytes(frames[0][:32]) if frames else b""
        self.dropped.append(f"dropped a {tag.decode('ascii', 'replace')!r} frame on the "
                            f"coordinator's socket ({len(frames)} frames): {str(exc)[:200]}")

    def _report(self, report: dict[str, Any]) -> None:
        if report.get("kind") == "died":  # its last records came with it
            self.gone.add(str(report.get("node")))
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
            horizon = min((self._sent_upto.get(n, 0.0) for n in self.endpoints
                           if n not in self.gone and
                           self.now() - self.dead.get(n, self.now()) < 2.0), default=0.0)
            horizon = min(horizon, self.now()) - self.clock_margin
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


def _hello(frames: list[bytes], nodes: set[str]) -> dict[str, Any]:
    """A rank's HELLO: ``[tag, json {node, endpoint, ring, pool, warm}, nixl metadata]``
    (``ring``: a decode rank's staging ring; ``pool``: its KV pool when nothing is staged;
    ``warm``: its warm-up region, ``twin.hw.warmup``; else null)."""
    info = messages.json_object(frames[1])
    if len(frames) != 3 or info.get("node") not in nodes or \
            not isinstance(info.get("endpoint"), str) or \
            not isinstance(info.get("ring"), (dict, type(None))) or \
            not isinstance(info.get("warm"), (dict, type(None))) or \
            not isinstance(info.get("pool"), (dict, type(None))):
        raise messages.BadFrame("not a HELLO of one of this run's ranks")
    return info


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
