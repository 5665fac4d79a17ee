"""Start, feed and stop the rank processes of a hardware run; merge their records into a trace.

``Launcher`` spawns one process per prefill and decode attention-TP rank (free ports picked
automatically), hands out the directory of endpoints, NIXL metadata and ring descriptors, and
starts every rank on one clock. It always tears everything down (success, failure, timeout,
Ctrl-C): ranks are told to stop, joined, and killed if they do not exit; sockets are closed.
Records stream in from the ranks and are written to the trace in time order, a window behind.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import multiprocessing as mp
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twin.core.config import TwinConfig
from twin.core.defects import Defects
from twin.core.topology import Topology
from twin.hw.control import ControlSocket
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
    wedge_window_s: float = 5.0
    timeout_s: float = 120.0
    start_timeout_s: float = 120.0
    max_concurrency: int = 4
    forward_s: float = 0.002
    kernels: str = ""

    def device_of(self, role: str, index: int) -> str:
        if self.device != "cuda":
            return "cpu"
        gpus = self.prefill_gpus if role == "prefill" else self.decode_gpus
        return f"cuda:{gpus[index % len(gpus)]}" if gpus else f"cuda:{index}"


class LaunchError(RuntimeError):
    """A rank failed to start or died."""


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
                raise LaunchError(json.loads(frames[2]).get("detail", "rank failed"))
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
                raise LaunchError(json.loads(frames[2]).get("detail", "rank failed"))
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
                raise LaunchError(f"rank {dead[0]} exited during {phase} "
                                  f"(exit code {self.procs[dead[0]].exitcode})")
            frames = self.sock.recv_frames(timeout_ms=min(500, int(left * 1000) + 1))
            if frames is not None:
                return frames

    def stop(self) -> None:
        """Stop every rank (gracefully, then by force), flush the trace, close the socket."""
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

    # -- talking to ranks ----------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    def command(self, node: str, cmd: dict[str, Any]) -> None:
        self.sock.send(self.endpoints[node], [CMD, pickle.dumps(cmd)])

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
            self.errors.append(f"{report.get('node')}: {report.get('detail')}")
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
