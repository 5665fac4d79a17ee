"""Hardware runs across nodes: the coordinator's side of its agents.

``twin hw --listen HOST:PORT --agents N`` does not spawn ranks itself: it waits for ``N``
agents (``twin agent --join HOST:PORT``, ``twin/hw/agent.py``), one per node, each of which
starts that node's rank processes when the run begins. This module holds what the coordinator
needs for that:

* the coordinator <-> agent frames (``AGENT_*``), which travel on the coordinator's one control
  socket next to the ranks' own frames;
* the clock handshake: NTP-style round trips (coordinator send ``t1``, agent clock ``ta``,
  coordinator receive ``t2``); the round trip with the smallest ``t2 - t1`` gives the agent's
  offset ``ta - (t1 + t2) / 2`` to within half that round trip. It runs when the agents join and
  again when the run ends (the drift in between is reported);
* placement: which ranks run on which agent and GPU, from the config's ``[placement]`` table or
  by role (``twin agent --role prefill|decode``), checked and printed before the run;
* ``AgentHub``: joins, heartbeats both ways, rank exits reported by agents, agents that go
  silent (dead, or their network lost), and stopping every agent's ranks at the end;
* ``RemoteRank``: what the launcher sees of a rank process on another node (``is_alive``,
  ``exitcode``), fed by its agent's reports.

Each rank's clock origin is the coordinator's start time expressed in its host's clock (the
start time plus its agent's offset), so every time a rank records, its records' times and the
deadlines inside its effects alike, is already coordinator time; the launcher merges ranks'
records holding back by the offsets' uncertainty (half the best round trip).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from twin.core.topology import Topology
from twin.hw import messages
from twin.hw.auth import SECRET_FILE_ENV, RunKey, key_from_env, write_key_file
from twin.hw.control import ControlError, ControlSocket
from twin.hw.hostmem import RANK_OVERHEAD_BYTES, fits, host_need
from twin.hw.netutil import format_port_range, is_unspecified

# Coordinator <-> agent frames.
AGENT_JOIN = b"TWIN_AGENT_JOIN"        # agent: [tag, json info]
AGENT_WELCOME = b"TWIN_AGENT_WELCOME"  # coordinator: [tag, json {name, heartbeat_s, ...}]
AGENT_REJECT = b"TWIN_AGENT_REJECT"    # coordinator: [tag, json {reason}]
AGENT_PING = b"TWIN_AGENT_PING"        # coordinator: [tag, seq, t1]
AGENT_PONG = b"TWIN_AGENT_PONG"        # agent: [tag, name, seq, t1, t_agent]
AGENT_LAUNCH = b"TWIN_AGENT_LAUNCH"    # coordinator: [tag, msgpack twin.hw.messages.Launch]
AGENT_BEAT = b"TWIN_AGENT_BEAT"        # both ways: [tag, name]
AGENT_EXIT = b"TWIN_AGENT_EXIT"        # agent: [tag, name, json {node, exitcode, text, tail}]
AGENT_ERROR = b"TWIN_AGENT_ERROR"      # agent: [tag, name, json {detail}]
AGENT_STOP = b"TWIN_AGENT_STOP"        # coordinator: [tag] stop what is left and leave
AGENT_BYE = b"TWIN_AGENT_BYE"          # agent: [tag, name]
AGENT_TAGS = frozenset({AGENT_JOIN, AGENT_PONG, AGENT_BEAT, AGENT_EXIT, AGENT_ERROR,
                        AGENT_BYE})

CLOCK_ROUNDS = 8
HEARTBEAT_S = 0.5
DRIFT_WARN_S = 0.001


class NodesError(RuntimeError):
    """Agents did not join, or the placement cannot be carried out with those that did."""


class PlacementError(ValueError):
    """A ``[placement]`` table that cannot describe this deployment (bad input)."""


# -------------------------------------------------------------------------------------------
# Clocks
# -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClockEstimate:
    """An agent's clock minus the coordinator's, from the round trip with the smallest RTT."""

    offset_s: float
    rtt_s: float
    samples: int

    @property
    def uncertainty_s(self) -> float:
        return self.rtt_s / 2

    def to_dict(self) -> dict[str, Any]:
        return {"offset_s": round(self.offset_s, 9), "rtt_s": round(self.rtt_s, 9),
                "samples": self.samples}


def estimate_offset(samples: Sequence[tuple[float, float, float]]) -> ClockEstimate:
    """``samples``: (coordinator send ``t1``, agent clock ``ta``, coordinator receive ``t2``)."""
    if not samples:
        raise ValueError("no clock samples")
    t1, ta, t2 = min(samples, key=lambda s: s[2] - s[0])
    return ClockEstimate(offset_s=ta - (t1 + t2) / 2, rtt_s=max(0.0, t2 - t1),
                         samples=len(samples))


# -------------------------------------------------------------------------------------------
# Placement
# -------------------------------------------------------------------------------------------
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class PlacementEntry:
    """One agent's part of a ``[placement]`` table."""

    agent: str
    ranks: tuple[str, ...]
    gpus: tuple[int, ...] | None


def parse_placement(table: Any, topo: Topology, source: str = "[placement]"
                    ) -> list[PlacementEntry]:
    """Check a ``[placement]`` table against the deployment: every rank placed exactly once.

    ``[placement.NAME]`` (``NAME`` is an agent's ``--name``) has ``ranks``: ``"prefill"``,
    ``"decode"`` or a list of rank ids (``["p0g0r0", "p0g0r1"]``), and optionally ``gpus``:
    the GPUs of those ranks in order (ranks wrap over a shorter list)."""
    if not isinstance(table, Mapping) or not table:
        raise PlacementError(f"{source}: expected one table per agent, e.g. "
                             f"[placement.node-a] ranks = \"prefill\"")
    seen: dict[str, str] = {}
    out = []
    for name, entry in table.items():
        where = f"{source}.{name}"
        if not isinstance(entry, Mapping):
            raise PlacementError(f"{where}: expected a table with 'ranks' (and 'gpus')")
        unknown = set(entry) - {"ranks", "gpus"}
        if unknown:
            raise PlacementError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; "
                                 f"expected 'ranks' and 'gpus'")
        spec = entry.get("ranks")
        if spec in ROLES:
            ranks = [n.id for n in topo.nodes.values() if n.role == spec]
        elif isinstance(spec, list) and spec and all(isinstance(r, str) for r in spec):
            ranks = list(spec)
            bad = [r for r in ranks if r not in topo.nodes]
            if bad:
                raise PlacementError(f"{where}: no rank {bad[0]!r} in this deployment "
                                     f"(ranks: {', '.join(topo.nodes)})")
        else:
            raise PlacementError(f"{where}.ranks: expected \"prefill\", \"decode\" or a list "
                                 f"of rank ids, got {spec!r}")
        for r in ranks:
            if r in seen:
                raise PlacementError(f"{where}: rank {r} is already placed on {seen[r]}")
            seen[r] = str(name)
        gpus = entry.get("gpus")
        if gpus is not None and (not isinstance(gpus, list) or not gpus or
                                 not all(isinstance(g, int) and g >= 0 for g in gpus)):
            raise PlacementError(f"{where}.gpus: expected a list of GPU indices, got {gpus!r}")
        out.append(PlacementEntry(str(name), tuple(ranks), None if gpus is None
                                  else tuple(gpus)))
    missing = [n for n in topo.nodes if n not in seen]
    if missing:
        raise PlacementError(f"{source}: rank(s) {', '.join(missing)} placed on no agent")
    return out


@dataclass
class AgentInfo:
    """A joined agent, as the coordinator knows it."""

    name: str
    endpoint: str
    address: str
    hostname: str
    pid: int
    role: str | None
    gpus: list[int] | None
    cuda_devices: int
    gpu_free: list[int]
    mem_available: int | None
    log_dir: str
    data_ports: str
    control_ports: str
    ucx: dict[str, str]
    joined_at: float
    last_heard: float
    clock: ClockEstimate | None = None
    end_clock: ClockEstimate | None = None
    samples: list[tuple[float, float, float]] = field(default_factory=list)
    ranks: dict[str, str] = field(default_factory=dict)  # node -> device
    lost: str | None = None
    gone: bool = False  # said goodbye

    def describe(self) -> str:
        role = self.role or "any role"
        return f"{self.name} ({self.address}, host {self.hostname}, {role}, pid {self.pid})"

    def record(self) -> dict[str, Any]:
        """The agent in the trace header and the JSON summary."""
        out: dict[str, Any] = {
            "name": self.name, "address": self.address, "hostname": self.hostname,
            "role": self.role, "ranks": dict(self.ranks), "log_dir": self.log_dir,
            "clock": self.clock.to_dict() if self.clock else None}
        if self.end_clock is not None:
            out["end_clock"] = self.end_clock.to_dict()
        return out


def plan_placement(topo: Topology, agents: Sequence[AgentInfo], device: str,
                   table: Sequence[PlacementEntry] | None = None) -> dict[str, dict[str, str]]:
    """``{agent name: {rank id: device}}`` for the joined ``agents``.

    With a ``[placement]`` table the agents it names must be the ones that joined. Otherwise by
    role: prefill ranks go to agents started with ``--role prefill``, decode ranks to
    ``--role decode``; agents without a role take a side no agent claimed (with no role at all,
    the first half of the agents by name takes prefill, the rest decode; one agent takes both).
    Ranks of a side are dealt in contiguous blocks, each agent taking at most as many as it
    offers GPUs (``--gpus``) with ``--device cuda``. A rank's GPU is the next of its agent's
    ``--gpus`` (or of the table's ``gpus``; else GPU 0, 1, ... of those it sees)."""
    by_name = {a.name: a for a in agents}
    out: dict[str, dict[str, str]] = {a.name: {} for a in agents}
    if table:
        named = [e.agent for e in table]
        missing = [n for n in named if n not in by_name]
        extra = [a.name for a in agents if a.name not in named]
        if missing or extra:
            raise NodesError(
                "the [placement] table names agent(s) "
                f"{', '.join(named)} but {', '.join(a.name for a in agents)} joined"
                + (f"; missing: {', '.join(missing)}" if missing else "")
                + (f"; not in the table: {', '.join(extra)}" if extra else "")
                + " (start each agent with --name NAME)")
        for e in table:
            a = by_name[e.agent]
            gpus = list(e.gpus) if e.gpus else a.gpus
            for k, r in enumerate(e.ranks):
                out[a.name][r] = _device(a, device, gpus, k)
        return out
    ordered = sorted(agents, key=lambda a: a.name)
    for role in ROLES:
        ranks = [n.id for n in topo.nodes.values() if n.role == role]
        takers = [a for a in ordered if a.role == role]
        if not takers:
            free = [a for a in ordered if a.role is None]
            if not free:
                raise NodesError(f"no agent takes the {role} ranks ({', '.join(ranks)}): "
                                 f"start one with --role {role}, or without --role")
            if not any(a.role is not None for a in agents) and len(free) > 1:
                half = len(free) // 2
                free = free[:half] if role == "prefill" else free[half:]
            takers = free
        caps = [len(a.gpus) - len(out[a.name]) if device == "cuda" and a.gpus else None
                for a in takers]  # GPUs not taken by the other side's ranks
        left = list(ranks)
        for i, a in enumerate(takers):
            share = math.ceil(len(left) / (len(takers) - i))
            if caps[i] is not None:
                share = min(share, caps[i] or 0)
            block, left = left[:share], left[share:]
            k0 = len(out[a.name])
            for k, r in enumerate(block):
                out[a.name][r] = _device(a, device, a.gpus, k0 + k)
        if left:
            offered = sum(c or 0 for c in caps)
            raise NodesError(f"{len(ranks)} {role} ranks but the {role} agents offer "
                             f"{offered} GPUs (--gpus); add GPUs or agents")
    return out


def _device(agent: AgentInfo, device: str, gpus: Sequence[int] | None, k: int) -> str:
    if device != "cuda":
        return "cpu"
    if gpus:
        return f"cuda:{gpus[k % len(gpus)]}"
    if agent.cuda_devices <= 0:
        raise NodesError(f"agent {agent.name} sees no CUDA device but the run is "
                         f"--device cuda")
    return f"cuda:{k % agent.cuda_devices}"


def check_memory(agents: Sequence[AgentInfo], rank_bytes: Mapping[str, int]) -> None:
    """Every agent's ranks fit its host memory (CPU) or each GPU's free memory."""
    for a in agents:
        cpu = [rank_bytes.get(r, 0) for r, d in a.ranks.items() if d == "cpu"]
        host = host_need(cpu)
        if cpu and not fits(host, a.mem_available):
            assert a.mem_available is not None
            raise NodesError(f"agent {a.name}: its ranks would take "
                             f"{host / (1 << 30):.1f} GiB (with {RANK_OVERHEAD_BYTES >> 20} MiB "
                             f"per rank process) but {a.mem_available / (1 << 30):.1f}"
                             f" GiB is available on {a.hostname}; lower --max-concurrency or "
                             f"--kv-pool-pages, or spread the ranks over more agents")
        per_gpu: dict[int, int] = {}
        for r, d in a.ranks.items():
            if d.startswith("cuda:"):
                g = int(d.split(":")[1])
                per_gpu[g] = per_gpu.get(g, 0) + rank_bytes.get(r, 0)
        for g, need in per_gpu.items():
            if a.cuda_devices and g >= a.cuda_devices:
                raise NodesError(f"agent {a.name}: no GPU {g} ({a.cuda_devices} visible)")
            if g < len(a.gpu_free) and need > 0.95 * a.gpu_free[g]:
                raise NodesError(f"agent {a.name} cuda:{g}: its ranks would allocate "
                                 f"{need / (1 << 30):.1f} GiB but "
                                 f"{a.gpu_free[g] / (1 << 30):.1f} GiB is free")


# -------------------------------------------------------------------------------------------
# The coordinator's hub
# -------------------------------------------------------------------------------------------
class RemoteRank:
    """A rank process on an agent's node, as far as the coordinator knows (the launcher's
    view of a process: ``is_alive``, ``exitcode``)."""

    def __init__(self, node: str, agent: AgentInfo) -> None:
        self.node = node
        self.agent = agent
        self.exitcode: int | None = None
        self.exit_text = ""
        self.tail = ""

    def is_alive(self) -> bool:
        return self.exitcode is None and self.agent.lost is None and not self.agent.gone

    def reason(self) -> str:
        if self.exitcode is not None:
            return f"{self.exit_text} on agent {self.agent.name}"
        if self.agent.lost is not None:
            return f"agent {self.agent.name} lost: {self.agent.lost}"
        return f"agent {self.agent.name} left"

    def log(self) -> str:
        return f"{self.agent.name}:{os.path.join(self.agent.log_dir, self.node + '.log')}"


class Beater(threading.Thread):
    """Sends heartbeats (``[AGENT_BEAT, name]`` to each target endpoint) from a thread of its
    own (own zmq sockets, never blocking), so that a process busy for a while (the coordinator
    in a send to a dead rank, an agent starting its ranks) is not taken for a lost one."""

    def __init__(self, period_s: float, key: RunKey | None) -> None:
        super().__init__(name="twin-heartbeat", daemon=True)
        self.period_s = period_s
        self.key = key
        self.lock = threading.Lock()
        self.targets: dict[str, str] = {}  # agent name -> endpoint
        self.halt = threading.Event()

    def set(self, name: str, endpoint: str | None) -> None:
        with self.lock:
            if endpoint is None:
                self.targets.pop(name, None)
            else:
                self.targets[name] = endpoint

    def run(self) -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        socks: dict[str, zmq.Socket[Any]] = {}
        try:
            while not self.halt.wait(self.period_s):
                with self.lock:
                    targets = dict(self.targets)
                for name, endpoint in targets.items():
                    sock = socks.get(endpoint)
                    if sock is None:
                        sock = socks[endpoint] = ctx.socket(zmq.PUSH)
                        sock.setsockopt(zmq.LINGER, 0)
                        sock.setsockopt(zmq.SNDHWM, 4)
                        if self.key is not None:
                            self.key.join(sock)
                        sock.connect(endpoint)
                    # Unreachable for now: the peer's own timeout decides.
                    with contextlib.suppress(zmq.ZMQError):
                        sock.send_multipart([AGENT_BEAT, name.encode()], zmq.NOBLOCK)
        finally:
            for sock in socks.values():
                sock.close(0)
            ctx.term()


class AgentHub:
    """The coordinator's control socket (bound at ``--listen``) and the agents that joined.

    Not thread-safe; the launcher owns it once the run starts (``Launcher(hub=...)``), and its
    ``pump`` hands agent frames to :meth:`handle`."""

    def __init__(self, listen: tuple[str, int], expected: int, *,
                 join_timeout_s: float = 120.0, heartbeat_s: float = HEARTBEAT_S,
                 heartbeat_timeout_s: float = 10.0,
                 control_ports: tuple[int, int] | None = None,
                 data_ports: tuple[int, int] | None = None,
                 placement: Sequence[PlacementEntry] | None = None,
                 echo: Callable[[str], None] | None = None,
                 key: RunKey | None = None) -> None:
        host, port = listen
        # The run's key: given, or from TWIN_RUN_SECRET(_FILE), else a new one that agents
        # read from a file only this user can read (twin.hw.auth).
        self.key_file: str | None = None
        self._own_key_dir: str | None = None
        if key is None:
            key = key_from_env()
            self.key_file = os.environ.get(SECRET_FILE_ENV) if key is not None else None
        if key is None:
            key = RunKey.new()
            self._own_key_dir = tempfile.mkdtemp(prefix="twin-run-")
            self.key_file = str(write_key_file(key, os.path.join(self._own_key_dir, "secret")))
        self.key = key
        self.sock = ControlSocket(f"tcp://{host}:{port}", send_timeout_ms=5000, key=key)
        self.listen = listen
        self.endpoint = self.sock.endpoint
        self.expected = expected
        self.join_timeout_s = join_timeout_s
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.control_ports = control_ports
        self.data_ports = data_ports
        self.table = list(placement) if placement else None
        self.echo = echo or (lambda _line: None)
        self.agents: dict[str, AgentInfo] = {}
        self.by_endpoint: dict[str, str] = {}
        self.ranks: dict[str, RemoteRank] = {}
        self.newly_lost: list[AgentInfo] = []
        self.errors: list[str] = []
        self.dropped: list[str] = []  # one note per frame that did not decode
        self._last_tick = time.monotonic()
        self._beater = Beater(heartbeat_s, key)
        self._beater.start()
        self._ping_seq = 0
        self._pending_pings: dict[tuple[str, int], float] = {}
        self._sampling: str = "start"

    # -- joining -------------------------------------------------------------------------------
    def gather(self, topo: Topology, device: str,
               rank_bytes: Mapping[str, int] | None = None) -> None:
        """Wait for the agents, measure their clocks, place the ranks; print what was decided.
        Raises ``NodesError`` naming what is missing."""
        where, join = self.endpoint, f"{self.listen[0]}:{self.listen[1]}"
        if is_unspecified(self.listen[0]):
            where, join = where + " (every interface)", f"THIS_HOST:{self.listen[1]}"
        secret = (f"{SECRET_FILE_ENV}={self.key_file}" if self.key_file is not None
                  else "TWIN_RUN_SECRET=(this run's secret)")
        self.echo(f"listening   {where} for {self.expected} agent(s); start each with "
                  f"`{secret} twin agent --join {join}`")
        if self._own_key_dir is not None:
            self.echo(f"secret      {self.key_file} (mode 0600): copy it to each agent's node "
                      f"over a channel you trust; only holders of it can talk to this run")
        deadline = time.monotonic() + self.join_timeout_s
        while len(self.agents) < self.expected:
            left = deadline - time.monotonic()
            if left <= 0:
                raise NodesError(self._missing_text(topo))
            self.pump_agents(min(200, int(left * 1000) + 1))
            self.tick()
            if self.newly_lost:
                a = self.newly_lost[0]
                raise NodesError(f"agent {a.name} went silent before the run: {a.lost}")
        self.sync_clocks(self.pump_agents)
        for a in sorted(self.agents.values(), key=lambda a: a.name):
            c = a.clock
            clock = (f"clock offset {c.offset_s:+.6f} s (+/- {c.uncertainty_s * 1e3:.3f} ms)"
                     if c else "clock not measured")
            self.echo(f"agent       {a.describe()}: {clock}")
        placed = plan_placement(topo, list(self.agents.values()), device, self.table)
        for name, ranks in placed.items():
            self.agents[name].ranks = ranks
        if rank_bytes:
            check_memory(list(self.agents.values()), rank_bytes)
        for a in sorted(self.agents.values(), key=lambda a: a.name):
            devs = sorted(set(a.ranks.values()))
            ucx = " ".join(f"{k}={v}" for k, v in sorted(a.ucx.items())) or "UCX defaults"
            self.echo(f"placement   {a.name}: {' '.join(a.ranks) or '(no ranks)'} on "
                      f"{', '.join(devs) or '-'}; control ports {a.control_ports}, "
                      f"{ucx}")
        for a in self.agents.values():
            for node in a.ranks:
                self.ranks[node] = RemoteRank(node, a)

    def _missing_text(self, topo: Topology) -> str:
        joined = sorted(self.agents.values(), key=lambda a: a.name)
        have = ", ".join(a.describe() for a in joined) or "none"
        roles = {a.role for a in joined}
        hint = ""
        if self.table:
            names = [e.agent for e in self.table if e.agent not in self.agents]
            hint = f"; missing: {', '.join(names)} (from [placement])"
        else:
            lacking = [r for r in ROLES if r not in roles and None not in roles]
            if lacking:
                hint = "; no agent yet for the " + " and ".join(
                    f"{r} ranks ({', '.join(n.id for n in topo.nodes.values() if n.role == r)})"
                    for r in lacking)
        return (f"{len(joined)} of {self.expected} agent(s) joined {self.endpoint} within "
                f"{self.join_timeout_s:g} s (joined: {have}){hint}")

    def pump_agents(self, timeout_ms: int) -> None:
        """Receive and handle agent frames; other frames (ranks') are put back, in order."""
        others: list[list[bytes]] = []
        frames = self.sock.recv_frames(timeout_ms=timeout_ms)
        while frames is not None:
            if not self.handle(frames):
                others.append(frames)
            frames = self.sock.recv_frames(timeout_ms=0)
        if others:
            self.sock.unread(others)

    def handle(self, frames: list[bytes]) -> bool:
        """Process one agent frame; ``False`` if ``frames`` is not one (a rank's)."""
        tag = bytes(frames[0]) if frames else b""
        if tag not in AGENT_TAGS:
            return False
        now = time.monotonic()
        try:
            if tag == AGENT_JOIN:
                self._join(messages.json_object(frames[1]), now)
                return True
            a = self.agents.get(bytes(frames[1]).decode())
            if a is None:
                raise ValueError("from no agent of this run")
            a.last_heard = now
            if tag == AGENT_PONG:
                seq, t1, ta = int(frames[2]), float(frames[3]), float(frames[4])
                if self._pending_pings.pop((a.name, seq), None) is not None:
                    a.samples.append((t1, ta, now))
            elif tag == AGENT_EXIT:
                d = json.loads(frames[2])
                r = self.ranks.get(d["node"])
                if r is not None and r.exitcode is None:
                    r.exitcode, r.exit_text = int(d["exitcode"]), str(d["text"])
                    r.tail = str(d.get("tail", ""))
            elif tag == AGENT_ERROR:
                d = json.loads(frames[2])
                self.errors.append(f"agent {a.name}: {d.get('detail', '')}")
            elif tag == AGENT_BYE:
                a.gone = True
                self._beater.set(a.name, None)
        except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as exc:
            # A malformed agent frame is dropped, with one note, like a malformed rank frame.
            self.dropped.append(f"dropped a {tag.decode('ascii', 'replace')!r} frame on the "
                                f"coordinator's socket ({len(frames)} frames): "
                                f"{type(exc).__name__}: {str(exc)[:200]}")
        return True

    def _join(self, info: dict[str, Any], now: float) -> None:
        endpoint = str(info["endpoint"])
        if endpoint in self.by_endpoint:  # a repeated JOIN: answer again
            self._send(endpoint, [AGENT_WELCOME, self._welcome(self.by_endpoint[endpoint])])
            return
        if len(self.agents) >= self.expected or self.ranks:
            self._send(endpoint, [AGENT_REJECT, json.dumps(
                {"reason": f"the run at {self.endpoint} already has its {self.expected} "
                           f"agent(s)"}).encode()])
            return
        name = str(info.get("name") or info.get("hostname") or "agent")
        base, k = name, 2
        while name in self.agents:
            name, k = f"{base}-{k}", k + 1
        role = info.get("role")
        a = AgentInfo(
            name=name, endpoint=endpoint, address=str(info.get("address", "?")),
            hostname=str(info.get("hostname", "?")), pid=int(info.get("pid", 0)),
            role=role if role in ROLES else None,
            gpus=[int(g) for g in info["gpus"]] if info.get("gpus") else None,
            cuda_devices=int(info.get("cuda_devices", 0)),
            gpu_free=[int(x) for x in info.get("gpu_free", [])],
            mem_available=info.get("mem_available"), log_dir=str(info.get("log_dir", "?")),
            data_ports=str(info.get("data_ports", "")),
            control_ports=str(info.get("control_ports", "")),
            ucx={str(k): str(v) for k, v in dict(info.get("ucx", {})).items()},
            joined_at=now, last_heard=now)
        if self.control_ports is not None and a.control_ports == format_port_range(None):
            a.control_ports = format_port_range(self.control_ports)  # the agent takes ours
        if self.data_ports is not None and a.data_ports == format_port_range(None):
            a.data_ports = format_port_range(self.data_ports)
            a.ucx["UCX_TCP_PORT_RANGE"] = f"{self.data_ports[0]}-{self.data_ports[1]}"
        self.agents[name] = a
        self.by_endpoint[endpoint] = name
        self._send(endpoint, [AGENT_WELCOME, self._welcome(name)])
        self._beater.set(name, endpoint)

    def _welcome(self, name: str) -> bytes:
        return json.dumps({
            "name": name, "heartbeat_s": self.heartbeat_s,
            "heartbeat_timeout_s": self.heartbeat_timeout_s,
            "control_ports": list(self.control_ports) if self.control_ports else None,
            "data_ports": list(self.data_ports) if self.data_ports else None}).encode()

    def _send(self, endpoint: str, frames: list[bytes], timeout_ms: int = 0) -> bool:
        try:
            self.sock.send(endpoint, frames, timeout_ms=timeout_ms)
            return True
        except ControlError:
            return False

    # -- clocks --------------------------------------------------------------------------------
    def sync_clocks(self, pump: Callable[[int], Any], *, end: bool = False,
                    rounds: int = CLOCK_ROUNDS, round_timeout_s: float = 1.0) -> None:
        """``rounds`` ping-pongs with every live agent (``pump(timeout_ms)`` receives and hands
        agent frames to :meth:`handle`); sets each agent's ``clock`` (or ``end_clock``)."""
        live = [a for a in self.agents.values() if a.lost is None and not a.gone]
        for a in live:
            a.samples = []
        for _ in range(rounds):
            self._ping_seq += 1
            for a in live:
                t1 = time.monotonic()
                self._pending_pings[(a.name, self._ping_seq)] = t1
                self._send(a.endpoint, [AGENT_PING, str(self._ping_seq).encode(),
                                        repr(t1).encode()], timeout_ms=1000)
            deadline = time.monotonic() + round_timeout_s
            while any((a.name, self._ping_seq) in self._pending_pings for a in live) and \
                    time.monotonic() < deadline:
                pump(20)
        self._pending_pings.clear()
        for a in live:
            if a.samples:
                est = estimate_offset(a.samples)
                if end:
                    a.end_clock = est
                else:
                    a.clock = est

    def offset_of(self, node: str) -> float:
        """The clock offset of ``node``'s host (its agent's clock minus the coordinator's)."""
        r = self.ranks.get(node)
        return r.agent.clock.offset_s if r is not None and r.agent.clock else 0.0

    @property
    def margin_s(self) -> float:
        """How far apart two ranks' clocks may be after correction (half the worst best RTT)."""
        return max((a.clock.uncertainty_s for a in self.agents.values() if a.clock),
                   default=0.0)

    def clock_notes(self) -> list[str]:
        """The end-of-run re-check, one line per agent."""
        out = []
        for a in sorted(self.agents.values(), key=lambda a: a.name):
            if a.clock is None:
                continue
            if a.end_clock is None:
                out.append(f"clock of agent {a.name}: offset {a.clock.offset_s:+.6f} s at the "
                           f"handshake, not re-checked at the end (agent gone)")
                continue
            drift = a.end_clock.offset_s - a.clock.offset_s
            bound = DRIFT_WARN_S + a.clock.uncertainty_s + a.end_clock.uncertainty_s
            warn = (" - more than the handshake's uncertainty: records of this agent may be "
                    "out of order by that much" if abs(drift) > bound else "")
            out.append(f"clock of agent {a.name}: offset {a.clock.offset_s:+.6f} s at the "
                       f"handshake, {a.end_clock.offset_s:+.6f} s at the end (drift "
                       f"{drift * 1e3:+.3f} ms, round trip {a.end_clock.rtt_s * 1e3:.3f} ms)"
                       f"{warn}")
        return out

    # -- running -------------------------------------------------------------------------------
    def launch(self, specs: Iterable[Any]) -> None:
        """Send each agent the ``RankSpec``s of its ranks."""
        by_agent: dict[str, list[Any]] = {}
        for spec in specs:
            by_agent.setdefault(self.ranks[spec.node].agent.name, []).append(spec)
        for name, a in self.agents.items():
            if not self._send(a.endpoint, [AGENT_LAUNCH,
                                           messages.encode_launch(by_agent.get(name, []))],
                              timeout_ms=5000):
                a.lost = f"cannot reach it at {a.endpoint} to start its ranks"
                self.newly_lost.append(a)

    def tick(self) -> None:
        """Agents silent for ``heartbeat_timeout_s`` are lost (appended to ``newly_lost``).
        Call it after receiving what has arrived: if this process itself was busy for a while
        (the last tick is more than a second ago), the agents' queued heartbeats are read
        before anyone is judged."""
        now = time.monotonic()
        stalled = now - self._last_tick > 1.0
        self._last_tick = now
        if stalled:
            return
        for a in self.agents.values():
            if a.lost is None and not a.gone and now - a.last_heard > self.heartbeat_timeout_s:
                a.lost = (f"no heartbeat for {self.heartbeat_timeout_s:g} s (the agent died "
                          f"or its network is down)")
                self.newly_lost.append(a)
                self._beater.set(a.name, None)

    def take_lost(self) -> list[AgentInfo]:
        out, self.newly_lost = self.newly_lost, []
        return out

    def stop_agents(self) -> None:
        """Ask every agent still there to stop what is left of its ranks and leave."""
        for a in self.agents.values():
            if a.lost is None and not a.gone:
                self._send(a.endpoint, [AGENT_STOP], timeout_ms=500)

    def all_gone(self) -> bool:
        return all(a.gone or a.lost is not None for a in self.agents.values())

    def close(self) -> None:
        """Tell every agent still there to leave; close the socket."""
        self._beater.halt.set()
        if not self.sock.closed:
            self.stop_agents()
            self.sock.close(linger_ms=500)
        if self._own_key_dir is not None:
            shutil.rmtree(self._own_key_dir, ignore_errors=True)
        self._beater.join(5)

    def records(self) -> list[dict[str, Any]]:
        return [a.record() for a in sorted(self.agents.values(), key=lambda a: a.name)]

    def ports_line(self) -> str:
        return (f"control ports {format_port_range(self.control_ports)}, data ports "
                f"{format_port_range(self.data_ports)}")


def hostname() -> str:
    return socket.gethostname()
