"""One rank process of the hardware mode: the core, driven by real sockets, NIXL and kernels.

A rank owns its core (``PrefillRank`` or ``DecodeRank``), a paged KV pool (a prefill PP
stage's: its layers only), its staging memory (prefill: one buffer per transfer worker, sized to
a chunk; decode: the ring), a NIXL agent or Mooncake engine with that memory registered, and a
PULL socket. Its loop receives SGLang frames from peers and commands from the coordinator, feeds
the core, and carries out the effects: frames go out over PUSH sockets, a ``StartTransfer``
gathers the head slice and posts one WRITE into the decode ring (polled, never blocking the
loop; a PP stage's WRITE is one block per layer slot, as SGLang's Mooncake staging writes it), a
``StartScatter`` scatters a ring region into KV pages. A deployment that does not stage (equal
attention TP) registers the KV pools instead of a ring: a direct ``StartTransfer`` is one WRITE
of a block per page, layer and K/V from the prefill pool into the decode rank's pages of the
room, which its ``TWIN_META`` carried (SGLang's ``send_kvcache`` and ``kv_indices``). Inputs and
effects stream to the coordinator, which writes the trace.

In replay mode the rank feeds its recorded inputs in order; a real arrival (frame, transfer or
scatter completion, metadata) is held until it is the next recorded input.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import random
import time
import traceback
from collections import deque
from itertools import groupby
from typing import Any

import msgspec
import torch

from twin.core import events as ev
from twin.core import wire
from twin.core.config import TwinConfig, pp_layer_range
from twin.core.decode import DecodeRank
from twin.core.defects import Defects
from twin.core.fixes import STALE_WATERMARK_SUBSCRIBERS
from twin.core.grid import pages_for_tokens
from twin.core.layout import compute_head_slice_params, pp_stage_write
from twin.core.prefill import PrefillRank
from twin.core.topology import Node, Topology, build_rank
from twin.hw import messages
from twin.hw.auth import RunKey
from twin.hw.control import ControlError, ControlSocket
from twin.hw.heartbeat import HealthPort, Heartbeat, server_up
from twin.hw.kernels import get_kernels, warm_up_rank
from twin.hw.kvpattern import fill_prefill_pool, rank_head_range, verify_decode_pool
from twin.hw.mooncake_transport import MooncakeEndpoint, MooncakeHandle, choose_transport
from twin.hw.netutil import LOOPBACK_HOST
from twin.hw.nixl_transport import NixlEndpoint, RegionDesc, TransferError
from twin.hw.pools import DTYPES, KVPool, PoolLayout, byte_buffer, direct_blocks
from twin.hw.rankspec import (
    ABORT,
    CMD,
    DIRECTORY,
    HELLO,
    META,
    PEER,
    RECORDS,
    REPORT,
    START,
    STATE,
    STOP,
    RankSpec,
)
from twin.hw.ringcheck import RingCheck
from twin.hw.warmup import WARMUP_BYTES, WarmUp, warm_plan
from twin.runtime.faults import FaultInjector, FaultSpec, in_scope, parse_fault
from twin.runtime.runtime import Runtime
from twin.runtime.sockets import configured, thread_of
from twin.runtime.sockets import socket_of as sglang_socket

IDLE_WAIT_MS = 20
#: A send that returned after this long sat blocked (a peer that is gone, a full queue).
BLOCKED_SEND_S = 0.05
FLUSH_IDLE_S = 0.05
REAL_INPUTS = (ev.MessageArrived, ev.TransferDone, ev.ScatterDone, ev.RoomBootstrapped)


def _match_key(e: Any) -> Any:
    t = type(e)
    if t is ev.MessageArrived:
        return ("msg", e.msg)
    if t is ev.TransferDone:
        return ("xfer", e.worker)
    if t is ev.ScatterDone:
        return ("scatter", e.room, e.chunk_idx, e.alloc_id)
    if t is ev.RoomBootstrapped:
        # Without the port: traces before format 3 carry none (the recorded event is fed).
        return ("boot", e.room, tuple((x.session, x.decode_rank, x.total_pages,
                                       x.decode_prefix_len) for x in e.targets))
    return None


class RankProcess:
    """The event loop of one rank; ``run()`` returns when the coordinator says stop."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.cfg = TwinConfig.from_dict(spec.config, source=f"{spec.node} config")
        cfg = self.cfg
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        node = Node(spec.node, spec.role, 0, 0, spec.rank, spec.unique_rank, spec.pp_rank)
        self.core: PrefillRank | DecodeRank = build_rank(cfg, node, Defects.of(spec.defects))
        self.runtime = Runtime({spec.node: self.core}, self, recorder=self,
                               hooks={ev.RoomConcluded: self._concluded,
                                      ev.RoomTornDown: self._torn_down,
                                      ev.RoomReleased: self._torn_down,
                                      ev.RankCrashed: self._crashed},
                               scripted=spec.script is not None)
        side = getattr(cfg, spec.role)
        m = cfg.model
        self.heads = rank_head_range(side.attn_tp_size, spec.rank, m.num_kv_heads)
        # The model layers this rank holds: a prefill PP stage's own slice, else every layer.
        self.layers = pp_layer_range(m.num_layers, spec.pp_rank, side.pp_size)
        self.pool = KVPool(self.layers[1] - self.layers[0], spec.kv_pool_pages, cfg.page_size,
                           len(self.heads), m.head_dim, DTYPES[m.dtype_bytes], self.device)
        self.kernels = get_kernels(self.device, spec.kernels or None)
        # Compile (Triton) before reporting ready, not inside the loop where it looks like a wedge.
        warm_up_rank(self.kernels, self.pool.k, self.pool.v, cfg.page_size, role=spec.role,
                     rank=spec.rank, prefill_attn_tp=cfg.prefill.attn_tp_size,
                     decode_attn_tp=cfg.decode.attn_tp_size, total_kv_heads=m.num_kv_heads)
        self.sock = ControlSocket(host=spec.bind_host, ports=spec.control_ports,
                                  send_timeout_ms=60_000, key=spec_key(spec))
        # SGLang's sockets between ranks, with its options (twin.runtime.sockets); the
        # twin's own frames to the coordinator keep the "control" socket.
        for sock_spec in configured(spec.zmq_send_timeout_s, spec.zmq_sndhwm).values():
            self.sock.configure(sock_spec)
        self.topo = Topology(cfg)
        self.watermark_sender = cfg.fix_set.on(STALE_WATERMARK_SUBSCRIBERS)
        # One CPU host (ranks on loopback, DRAM over shared memory): no NIXL progress thread,
        # which would spin a core per rank. Across nodes (TCP) and on GPUs it runs.
        # The same choice as the command's (VRAM on Mooncake only where the engine moves it).
        transport, _ = choose_transport(cfg.disaggregation_transfer_backend,
                                        self.device.type)
        self.nixl: NixlEndpoint | MooncakeEndpoint
        if transport == "mooncake":
            self.nixl = MooncakeEndpoint(spec.node, host=spec.bind_host,
                                         workers=cfg.transfer_queue_size)
        else:
            self.nixl = NixlEndpoint(spec.node, progress_thread=not (
                spec.bind_host == LOOPBACK_HOST and self.device.type == "cpu"))
        self.ring: torch.Tensor | None = None
        self.buffers: list[torch.Tensor] = []
        if isinstance(self.core, PrefillRank):
            self.buffers = [byte_buffer(self.core.buffer_bytes, self.device)
                            for _ in range(self.core.num_workers)]
            for b in self.buffers:
                self.nixl.register(b)
        elif cfg.stages:
            self.ring = byte_buffer(cfg.ring_bytes, self.device)
            self.ring_region = self.nixl.register(self.ring)
        # No staging (equal attention TP): pages go straight between the KV pools, which
        # both sides register (registered before the metadata is sent, so peers know it).
        self.pool_region = None if cfg.stages else self.nixl.register(self.pool.storage)
        # A decode rank's warm-up region (prefill peers' first WRITEs land there, never read;
        # twin.hw.warmup), and on a prefill rank each decode peer's.
        self.warm_region = (self.nixl.register(byte_buffer(WARMUP_BYTES, self.device))
                            if isinstance(self.core, DecodeRank) else None)
        self.warm_targets: dict[str, tuple[str, RegionDesc]] = {}
        specs = [parse_fault(f) for f in spec.faults]
        self.injector = FaultInjector(specs, random.Random(f"{spec.seed}:{spec.node}:faults"))
        # The first crash fault that takes this rank down (``scope=server``: its whole server).
        self.crash: FaultSpec | None = min(
            (f for f in specs if f.action == "crash" and in_scope(f, spec.node)),
            key=lambda f: f.at or 0.0, default=None)
        # Prefill: the server's health port decode's heartbeat probes. Decode: the heartbeat
        # (started with the run), each room's prefill server, and what it gave up on.
        self.health = HealthPort(spec.bind_host) if spec.role == "prefill" else None
        self.heartbeat: Heartbeat | None = None
        self.servers: dict[int, list[str]] = {}  # prefill instance -> its ranks' health ports
        self.room_server: dict[int, int] = {}
        self.failed_servers: set[int] = set()
        self.pruned: set[str] = set()  # dropped WATERMARK subscribers (the #36049 fix)
        self.endpoints: dict[str, str] = {}
        self.rings: dict[str, tuple[str, RegionDesc]] = {}
        # prefill, no staging: each decode node's KV pool, and its pages of each room (META)
        self.pools: dict[str, tuple[str, RegionDesc, PoolLayout]] = {}
        self.decode_pages: dict[tuple[int, str], list[int]] = {}
        self.coordinator = spec.coordinator
        self.t0 = 0.0
        self.timers: list[tuple[float, int, Any, tuple[Any, ...]]] = []
        self._timer_seq = 0
        self._held: dict[tuple[str, str], float] = {}  # (peer, socket) -> stalled until
        self._last_input: Any = None
        self._flushed_at = 0.0
        self.in_flight: dict[int, Any] = {}
        self.scatters_done: list[ev.ScatterDone] = []
        self.rooms: dict[int, dict[str, Any]] = {}
        self.computed: dict[int, int] = {}  # prefill: tokens of each room a forward has written
        # decode: a room's pages checked since they were last written, and the wrong ones
        # (the page range of one check, its first wrong element)
        self.verified: dict[int, set[int]] = {}
        self.mismatch: dict[int, list[tuple[range, str]]] = {}
        # decode, staged: ring regions written and not yet scattered, checked when they stop
        # being so without a scatter (twin.hw.ringcheck)
        self.ring_check = (RingCheck(self.ring, cfg, spec.rank, self.topo, self.rooms)
                           if self.ring is not None else None)
        self.outbox: list[tuple[float, Any, list[Any]]] = []
        self._refused_reported = 0  # connections refused for want of the run key, reported
        self.reports: list[dict[str, Any]] = []
        self.stopping = False
        self.script: deque[Any] | None = deque(spec.script) if spec.script is not None else None
        self.held: dict[Any, list[Any]] = {}
        self.script_done_sent = False
        for req in spec.requests:
            self._setup_request(req)
        log_dir = os.environ.get("TWIN_HW_LOG_DIR")
        self.log = (open(os.path.join(log_dir, f"{spec.node}.log"), "a", buffering=1)  # noqa: SIM115
                    if log_dir else None)

    # -- clock and timers --------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    time = now  # the runtime's driver clock

    def call_at(self, at: float, fn: Any, *args: Any) -> None:
        """Call ``fn(*args)`` at ``at`` (seconds since the run's start)."""
        self._timer_seq += 1
        heapq.heappush(self.timers, (at, self._timer_seq, fn, args))

    def feed_at(self, at: float, node: str, event: ev.Input, token: int) -> None:
        self.call_at(at, self.runtime.fire, node, event, token)

    # -- bootstrap -----------------------------------------------------------------------------
    def bootstrap(self) -> None:
        if self.device.type == "cuda":  # zeroed ring and pools land before a peer may write
            torch.cuda.synchronize(self.device)
        hello = {"node": self.spec.node, "endpoint": self.sock.endpoint,
                 "health": self.health.address if self.health is not None else None,
                 "ring": self.ring_region.to_dict() if self.ring is not None else None,
                 "pool": self._pool_entry(),
                 "warm": self.warm_region.to_dict() if self.warm_region is not None else None}
        self.sock.send(self.coordinator, [HELLO, json.dumps(hello).encode(),
                                          self.nixl.metadata()])
        early: list[list[bytes]] = []  # peers that started first may already be talking
        while True:
            frames = self.sock.recv_frames(timeout_ms=60_000)
            if frames is None:
                raise RuntimeError(f"{self.spec.node}: no directory from the coordinator")
            if frames[0] == DIRECTORY:
                break
            early.append(frames)  # a peer's warm-up ping
        directory = json.loads(frames[1])
        metas = frames[2:]
        for i, entry in enumerate(directory):
            self.endpoints[entry["node"]] = entry["endpoint"]
            health = entry.get("health")
            if isinstance(health, str) and entry["node"] in self.topo.nodes:
                inst = self.topo.nodes[entry["node"]].instance
                self.servers.setdefault(inst, []).append(health)
            if isinstance(self.core, PrefillRank):
                self._add_decode_peer(entry, metas[i])
        if isinstance(self.core, PrefillRank):
            # SGLang opens a prefetch socket (in a context of its own) at the first STAGING_REQ
            # to a decode endpoint. Opening it here instead keeps a loaded host's slow first
            # connect from letting the first request trail the chunk it asks for (which would
            # wedge the ring; docs/defects.md). The socket stays separate: frames on it may still
            # be overtaken. Its handshake is waited for (SGLang sets no ZMQ_IMMEDIATE on it).
            for node, endpoint in self.endpoints.items():
                if node in self.rings:
                    self.sock.connect(endpoint, "prefetch", wait_s=60.0)
        # Warm connections and transfer paths as a long-lived SGLang server's are, before any
        # request (twin.hw.warmup); the coordinator gets the report with TWIN_READY.
        warm = WarmUp(self.spec.node, self.sock, self.endpoints)
        report = warm.run(*warm_plan(self), self.nixl, early)
        self.sock.send(self.coordinator, [b"TWIN_READY", self.spec.node.encode(),
                                          json.dumps(report).encode()])
        while True:
            frames = self.sock.recv_frames(timeout_ms=60_000)
            if frames is None:
                raise RuntimeError(f"{self.spec.node}: no start from the coordinator")
            if frames[0] == START:
                self.t0 = float(frames[1].decode())
                self.sock.unread(early)
                self._start_faults()
                return
            if not warm.answer(frames):  # peers still warming up ping this rank
                early.append(frames)

    def _pool_entry(self) -> dict[str, Any] | None:
        """A decode rank's KV pool for the directory when nothing is staged (prefill ranks
        write its pages directly): the registered region and where pages lie in it."""
        if self.pool_region is None or not isinstance(self.core, DecodeRank):
            return None
        return {"region": self.pool_region.to_dict(), "layout": self.pool.layout.to_dict()}

    def _add_decode_peer(self, entry: dict[str, Any], meta: bytes) -> None:
        """Load a decode rank's agent from the directory, with its ring (staged deployments)
        or its KV pool (direct page writes)."""
        ring, pool, warm = entry.get("ring"), entry.get("pool"), entry.get("warm")
        if ring is None and pool is None:
            return
        peer = self.nixl.add_peer(meta)
        if warm is not None:
            self.warm_targets[entry["node"]] = (peer, RegionDesc.from_dict(warm))
        if ring is not None:
            self.rings[entry["node"]] = (peer, RegionDesc.from_dict(ring))
        if pool is not None:
            self.pools[entry["node"]] = (peer, RegionDesc.from_dict(pool["region"]),
                                         PoolLayout.from_dict(pool["layout"]))

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        while not self.stopping:
            # Block on the socket when idle; poll fast only while WRITEs are in flight.
            wait_ms = 1 if self.in_flight or self.scatters_done else IDLE_WAIT_MS
            if self.timers:
                # Rounded up: a timer less than a millisecond away is waited for (at most a
                # millisecond late), not spun on; spinning took a whole core per rank.
                until = math.ceil((self.timers[0][0] - self.now()) * 1000)
                wait_ms = max(0, min(wait_ms, until))
            frames = self.sock.recv_frames(timeout_ms=wait_ms)
            while frames is not None:
                self._frames(frames)
                if self.stopping:
                    break
                frames = self.sock.recv_frames(timeout_ms=0)
            self._poll_transfers()
            if self.heartbeat is not None:
                for inst in self.heartbeat.failed():
                    self._server_failed(inst)
            while self.scatters_done:
                self.input(self.scatters_done.pop(0))
            while self.timers and self.timers[0][0] <= self.now():
                _, _, fn, args = heapq.heappop(self.timers)
                fn(*args)
            self._advance_script()
            self._flush()

    def _frames(self, frames: list[bytes]) -> None:
        tag = bytes(frames[0])
        if self.log is not None:
            self.log.write(f"{self.now():.6f} recv {tag[:16]!r} ({len(frames)} frames)\n")
        try:
            if tag == CMD:
                self._command(messages.decode(frames[1], messages.Command))
            elif tag == META:
                d = messages.json_object(frames[1])
                target = ev.Target(**d["target"])
                self._keep_decode_pages(d["room"], target.session, d.get("pages"))
                self.input(ev.RoomBootstrapped(room=d["room"], targets=(target,)))
            elif tag == ABORT:
                d = messages.json_object(frames[1])
                self.input(ev.RoomAborted(room=d["room"], reason=d["reason"]))
            elif tag == PEER:
                d = messages.json_object(frames[1])
                self.input(ev.PeerPolled(room=d["room"], peer=d["peer"], poll=d["poll"]))
            elif tag == STOP:
                self.stopping = True
            else:
                msg = wire.decode(frames)
                src = ""
                rank = getattr(msg, "prefill_rank", None)
                if rank is not None:
                    src = self.spec.nodes_by_unique.get(rank, "")
                self.input(ev.MessageArrived(src=src, msg=msg))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            self.reports.append({"kind": "bad-frame", "node": self.spec.node,
                                 "detail": f"{tag[:24]!r}: {exc}"})

    def _keep_decode_pages(self, room: int, session: str, pages: Any) -> None:
        """Keep a decode node's KV pages of ``room`` from its META, for direct page writes
        (a deployment that stages needs none). ``ValueError`` for a list that is not one of
        page indices (the frame is then reported and dropped)."""
        if self.cfg.stages or pages is None:
            return
        if not isinstance(pages, list) or not all(type(x) is int and x >= 0 for x in pages):
            raise ValueError(f"META pages of room {room}: not a list of page indices")
        self.decode_pages[(room, session)] = pages

    def _command(self, cmd: messages.Command) -> None:
        if isinstance(cmd, messages.Feed):
            self.input(cmd.event)
        elif isinstance(cmd, messages.SetupRequest):
            self._setup_request(messages.request_dict(cmd))
        elif isinstance(cmd, messages.QueryState):
            self._flush()
            # The byte check's verdict so far on rooms not concluded: a wedged run can have
            # corrupted them too (the first wrong range of each, in page order).
            wrong = {room: first for room in self.mismatch
                     if (first := self._first_wrong(room)) is not None}
            if self.ring_check is not None:  # and written ring bytes no scatter read
                for room, text in self.ring_check.open_rooms().items():
                    wrong[room] = f"{wrong[room]}; {text}" if room in wrong else text
            state = messages.rank_state(self.core.snapshot(),
                                        self.script[0] if self.script else None,
                                        sum(len(v) for v in self.held.values()), wrong)
            self.sock.send(self.coordinator, [STATE, self.spec.node.encode(),
                                              messages.encode(state)])

    def _setup_request(self, cmd: dict[str, Any]) -> None:
        """KV pages for a room. A prefill room's pages hold the request's pattern up to
        ``computed`` (its cached prefix; the whole request when the command does not say),
        and each forward's ``SendKV`` fills its chunk first (``_compute``), as a forward
        writes the chunk's KV before sending it: a transfer that reads pages no forward has
        written yet sends what they held before (zeros, or an earlier request's KV), which the
        decode ranks' check reports."""
        page = self.cfg.page_size
        room = cmd["room"]
        self.rooms[room] = cmd
        if isinstance(self.core, PrefillRank):
            self.pool.alloc(room, pages_for_tokens(cmd["input_len"], page))
            self.computed[room] = 0
            self._compute(room, cmd.get("computed", cmd["input_len"]))
        else:
            suffix = cmd["input_len"] - cmd["decode_prefix_len"]
            self.pool.alloc(room, pages_for_tokens(suffix, page))
        self.reports.append({"kind": "setup-done", "node": self.spec.node, "room": room})

    def _compute(self, room: int, upto: int) -> None:
        """Fill the pattern into the room's pages holding tokens up to ``upto`` (whole pages:
        a partial page is written once, by the forward that reaches into it)."""
        req = self.rooms.get(room)
        done = self.computed.get(room)
        if req is None or done is None:
            return
        page = self.cfg.page_size
        first = done // page
        last = pages_for_tokens(min(upto, req["input_len"]), page)
        if last <= first:
            return
        pages = self.pool.pages_of(room)[first:last]
        fill_prefill_pool(self.pool.k, self.pool.v, pages, page, request=req["rid"],
                          token_offset=first * page, head_offset=self.heads.start,
                          layer_offset=self.layers[0])
        self.computed[room] = last * page

    # -- feeding the core ----------------------------------------------------------------------
    def input(self, event: Any) -> None:
        """A real happening or a driver input; in replay mode it may be held for its turn."""
        if self.ring_check is not None and type(event) is ev.MessageArrived and \
                type(event.msg) is wire.ChunkReady:
            self.ring_check.arrived(event.msg, event.src)  # the writer's WRITE completed
        if self.script is not None and type(event) in REAL_INPUTS:
            self.held.setdefault(_match_key(event), []).append(event)
            return
        if self.script is not None:
            return  # driver inputs come from the script in replay mode
        self.feed(event)

    def _advance_script(self) -> None:
        script = self.script
        if script is None:
            return
        while script:
            nxt = script[0]
            if type(nxt) in REAL_INPUTS:
                got = self.held.get(_match_key(nxt))
                if not got:
                    return
                got.pop(0)
            script.popleft()
            self.feed(nxt)
        if not self.script_done_sent:
            self.script_done_sent = True
            held = sum(len(v) for v in self.held.values())
            self.reports.append({"kind": "script-done", "node": self.spec.node,
                                 "held": held})

    def feed(self, event: Any) -> None:
        if type(event) is ev.SendKV:
            self._compute(event.room, event.end_idx)
        self.runtime.feed(self.spec.node, event)
        if type(event) is ev.DecodeRoomInit and event.prefill_ranks:
            self._room_started(event)

    # -- SGLang's heartbeat and a crash fault --------------------------------------------------
    def _start_faults(self) -> None:
        """At the run's start: a crash fault's timer, and a decode rank's heartbeat."""
        if self.crash is not None:
            self.call_at(self.crash.at or 0.0, self._die, self.crash)
        if isinstance(self.core, DecodeRank) and self.script is None and self.servers:
            self.heartbeat = Heartbeat(self.servers, self.spec.heartbeat_interval_s,
                                       self.spec.heartbeat_max_failure)
            self.heartbeat.start()

    def _room_started(self, e: ev.DecodeRoomInit) -> None:
        """Note a decode room's prefill server; a server the heartbeat suspects is probed, and
        one that is gone fails the room at once (its bootstrap query is refused)."""
        inst = self.topo.nodes[e.prefill_ranks[0]].instance
        self.room_server[e.room] = inst
        hb = self.heartbeat
        if inst in self.failed_servers or (
                hb is not None and hb.suspect(inst) and not server_up(self.servers[inst])):
            self.feed(ev.RoomAborted(room=e.room, reason=(
                f"prefill server p{inst} is gone: its bootstrap endpoint refused decode's "
                f"query")))

    def _server_failed(self, inst: int) -> None:
        """SGLang's ``_handle_node_failure``: the heartbeat gave up on prefill server
        ``inst``. Its cached sockets close (the next frame opens a fresh one), with the
        ``stale-watermark-subscribers`` fix its ranks stop getting WATERMARKs, and every room
        bootstrapped from it fails."""
        self.failed_servers.add(inst)
        reason = (f"prefill server p{inst} failed decode's heartbeat "
                  f"({self.spec.heartbeat_max_failure} probes "
                  f"{self.spec.heartbeat_interval_s:g} s apart)")
        self.reports.append({"kind": "heartbeat", "node": self.spec.node, "server": inst,
                             "detail": reason})
        for n in self.topo.nodes.values():
            if n.role == "prefill" and n.instance == inst and n.id in self.endpoints:
                self.sock.disconnect(self.endpoints[n.id])
                if self.watermark_sender:
                    self.pruned.add(n.id)
        for room in [r for r, i in self.room_server.items() if i == inst]:
            self.feed(ev.RoomAborted(room=room, reason=reason))

    def _die(self, spec: FaultSpec) -> None:
        """A crash fault: the process ends now, as a crash ends it. Its records so far and a
        ``died`` report reach the coordinator first; frames still queued to peers are lost."""
        self.reports.append({"kind": "died", "node": self.spec.node, "fault": spec.text,
                             "t": self.now()})
        self._flush()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.health is not None:
            self.health.close()
        self.sock.close(0, linger_for={self.coordinator: 5000})
        os._exit(0)

    # -- recorder: inputs and effects stream to the coordinator ---------------------------------
    def write_input(self, t: float, node: str, event: Any) -> None:
        self._last_input = event

    def write_effects(self, t: float, node: str, effects: list[Any]) -> None:
        self.outbox.append((t, self._last_input, effects))
        if self.ring_check is not None:
            self.ring_check.effects(effects)

    # -- driver: transport ---------------------------------------------------------------------
    def transmit(self, src: str, dst: str, msg: wire.Message) -> None:
        self.send_frames(dst, msg)

    def send_frames(self, dst: str, msg: wire.Message, delayed: bool = False) -> None:
        """Send ``msg`` to ``dst`` through the fault injector. A ``delay`` holds the sending
        socket's stream (later frames on it wait behind), a ``reorder`` only this frame."""
        if delayed:
            self._push(dst, msg)
            return
        copies, extra, hold = 1, 0.0, 0.0
        if self.injector.specs:
            fate = self.injector.message(self.spec.node, dst, msg)
            if fate.applied:
                self.reports.append({"kind": "fault", "node": self.spec.node,
                                     "fault": ";".join(fate.applied),
                                     "detail": f"{wire.tag_of(msg).decode()} -> {dst}",
                                     "room": getattr(msg, "room", -1)})
            if fate.send_failed:
                self.feed(ev.SendFailed(dst=dst, msg=msg))
                return
            copies, extra, hold = fate.copies, fate.extra_s, fate.hold_s
            msg = fate.frame(msg)  # a corrupt fault rewrites fields before the frame leaves
        at = now = self.now()
        if hold or self._held:  # a stalled socket holds this frame too
            link = (dst, wire.socket_of(msg))
            at = max(now + hold, self._held.get(link, 0.0))
            if hold:
                self._held[link] = at
        at += extra - hold
        for _ in range(copies):
            if at > now:
                self.call_at(at, self.send_frames, dst, msg, True)
            else:
                self._push(dst, msg)

    def _push(self, dst: str, msg: wire.Message) -> None:
        """Send one SGLang frame on the socket SGLang sends it on."""
        self._send_sglang(dst, wire.encode(msg), msg)

    def _send_sglang(self, dst: str, frames: list[bytes], msg: wire.Message | None) -> None:
        """Send ``frames`` (``msg``'s, or a metadata/abort notice's when ``msg`` is None) to
        ``dst`` on the socket SGLang uses, with its options. A send the peer's queue cannot
        take blocks the rank for the socket's timeout and the frame is lost, as SGLang
        swallows ``zmq.Again``; every send that sat blocked is reported (``send-blocked``:
        seconds by peer, frame and the SGLang thread that would have sent it)."""
        if msg is not None and dst in self.pruned and type(msg) is wire.Watermark:
            return  # the heartbeat dropped this subscriber (the #36049 fix)
        role = self.spec.role
        start = time.monotonic()
        lost = False
        try:
            self.sock.send(self.endpoints[dst], frames, socket=sglang_socket(role, msg).name)
        except ControlError:
            lost = True
        waited = time.monotonic() - start
        if lost or waited >= BLOCKED_SEND_S:
            thread = thread_of(role, msg, self.runtime.current, self.watermark_sender)
            self.reports.append({
                "kind": "send-blocked", "node": self.spec.node, "peer": dst,
                "thread": thread.split(":", 1)[0], "seconds": round(waited, 6),
                "frame": wire.tag_of(msg).decode() if msg is not None else "metadata/notice",
                "lost": lost, "t": round(self.now() - waited, 6)})

    def control(self, src: str, dst: str, event: ev.Input) -> None:
        """Bootstrap metadata and abort notices, in the twin's own frames."""
        if isinstance(event, ev.RoomBootstrapped):
            # Every field of the target, so the prefill core sees what the recorded one saw
            # (the port picks the transfer worker).
            # With the room's KV page indices, as SGLang's metadata carries ``kv_indices``
            # (a direct page write lands in them; the recorded event itself has none).
            target = msgspec.structs.asdict(event.targets[0])
            frames = [META, json.dumps({"room": event.room, "target": target,
                                        "pages": self.pool.pages_of(event.room)}).encode()]
        elif isinstance(event, ev.RoomAborted):
            frames = [ABORT, json.dumps({"room": event.room, "reason": event.reason}).encode()]
        elif isinstance(event, ev.PeerPolled):
            # The decode group's poll reduction (a gloo all-reduce in SGLang) between processes.
            frames = [PEER, json.dumps({"room": event.room, "peer": event.peer,
                                        "poll": event.poll}).encode()]
        else:
            raise TypeError(f"no control frame for {type(event).__name__}")
        if isinstance(event, ev.PeerPolled):
            self.sock.send(self.endpoints[dst], frames)  # a collective, not a ZMQ socket
        else:  # on the socket SGLang sends metadata and ABORT on, with its options
            self._send_sglang(dst, frames, None)

    # -- driver: data plane --------------------------------------------------------------------
    def start_transfer(self, node: str, e: ev.StartTransfer) -> None:
        """Carry out a chunk's WRITE: staged (gather, one WRITE into the ring) or, where the
        deployment does not stage, direct (the pages straight into the decode pool)."""
        assert isinstance(self.core, PrefillRank)
        if not e.staged:
            if self.cfg.stages:  # the per-slice fallback of a chunk that did not fit
                self.in_flight[e.worker] = ("error", "the per-slice fallback path is not "
                                            "executed on hardware")
            else:
                self._direct_write(node, e)
            return
        cfg = self.cfg
        page = cfg.page_size
        req = self.rooms.get(e.room)
        pages = self.pool.pages_of(e.room)
        first = (req["decode_prefix_len"] // page if req else 0) + e.page_start
        chunk_pages = pages[first:first + e.num_pages]
        src_head, nh, _, _ = compute_head_slice_params(
            cfg.prefill.attn_tp_size, cfg.decode.attn_tp_size, self.spec.rank, e.decode_rank,
            cfg.model.num_kv_heads)
        buf = self.buffers[e.worker]
        if len(chunk_pages) < e.num_pages or e.nbytes > buf.numel():
            self.in_flight[e.worker] = ("error", f"chunk {e.chunk_idx} of room {e.room} "
                                        f"does not fit this rank's pages or staging buffer")
            return
        n = self.kernels.gather_to_staging(self.pool.k, self.pool.v, chunk_pages, page,
                                           src_head, nh, buf)
        assert n == e.nbytes, (n, e.nbytes)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        peer, region = self.rings[e.session]
        remote_offset, blocks = e.dst_offset, None
        first, stop = self.layers
        if stop - first < cfg.model.num_layers:
            # A PP stage: one write per layer slot of its TP writer's block, as SGLang's
            # Mooncake staging does (the core's span starts 2 * first slots into the block).
            remote_offset, slots = pp_stage_write(e.dst_offset, e.nbytes,
                                                  cfg.model.num_layers, first, stop)
            blocks = list(slots)
        self._post_write(node, e, buf, peer, region, remote_offset, blocks)

    def _direct_write(self, node: str, e: ev.StartTransfer) -> None:
        """SGLang's ``send_kvcache`` (equal attention TP): this rank's pages ``[page_start,
        +num_pages)`` of the room (past the decode prefix) into the decode rank's pages of the
        room (its META's), every layer's K and V, one block per (page, layer, K/V), in one
        WRITE from the registered prefill pool. Prefill rank r holds decode rank r's heads, so
        page bytes map 1:1. A chunk outside either side's pages fails (settled, nothing
        posted); blocks that do not add up to the core's ``nbytes`` are a twin bug (raised)."""
        page = self.cfg.page_size
        req = self.rooms.get(e.room)
        prefix = req["decode_prefix_len"] if req else 0
        first = prefix // page + e.page_start
        src = self.pool.pages_of(e.room)[first:first + e.num_pages]
        dst = self.decode_pages.get((e.room, e.session), [])[e.page_start:
                                                             e.page_start + e.num_pages]
        target = self.pools.get(e.session)
        why = None
        if target is None:
            why = f"no KV pool of {e.session} in the directory"
        elif prefix % page:
            why = f"decode prefix {prefix} is not page-aligned (page size {page})"
        elif len(src) < e.num_pages or len(dst) < e.num_pages:
            why = (f"pages [{e.page_start}, +{e.num_pages}) are outside this rank's "
                   f"({len(self.pool.pages_of(e.room)) - prefix // page}) or {e.session}'s "
                   f"({len(self.decode_pages.get((e.room, e.session), []))}) pages of the room")
        if target is None or why is not None:
            self.in_flight[e.worker] = ("error", f"direct write of chunk {e.chunk_idx} of room "
                                        f"{e.room}: {why}")
            return
        peer, region, layout = target
        blocks = direct_blocks(self.pool.layout, src, layout, dst)
        nbytes = sum(n for _, _, n in blocks)
        if nbytes != e.nbytes:
            raise RuntimeError(f"direct write of chunk {e.chunk_idx} of room {e.room}: "
                               f"{nbytes} B of pages for the core's {e.nbytes} B")
        if self.device.type == "cuda":  # the forwards' pattern fills are queued on the stream
            torch.cuda.current_stream().synchronize()
        self._post_write(node, e, self.pool.storage, peer, region, 0, blocks,
                         local_span=self.pool.storage.numel() * self.pool.storage.element_size())

    def _post_write(self, node: str, e: ev.StartTransfer, local: torch.Tensor, peer: str,
                    region: RegionDesc, remote_offset: int,
                    blocks: list[tuple[int, int, int]] | None,
                    local_span: int | None = None) -> None:
        """Post the chunk's WRITE of ``e.nbytes`` (``blocks`` as the transports take them)
        and track it in ``in_flight``: an injected failure is settled and never posted, a
        post the transport rejects is unsettled (SGLang poisons the room)."""
        failed = self.injector.transfer_fails(node) if self.injector.specs else None
        if failed is not None:
            # An injected error, as NIXL reports a WRITE that ended in ERR: settled, not posted.
            self.reports.append({"kind": "fault", "node": node, "fault": failed,
                                 "detail": f"WRITE room {e.room} chunk {e.chunk_idx} -> "
                                           f"{e.session}", "room": e.room})
            self.in_flight[e.worker] = ("error", f"injected transfer failure ({failed})")
            return
        try:
            if isinstance(self.nixl, MooncakeEndpoint):  # blocking, on the worker's thread
                handle: Any = self.nixl.write(local, peer, region, remote_offset, e.nbytes,
                                              worker=e.worker, blocks=blocks,
                                              local_span=local_span)
            else:
                handle = self.nixl.write(local, peer, region, remote_offset, e.nbytes,
                                         blocks=blocks, local_span=local_span)
        except TransferError as exc:
            # A rejected post: SGLang cannot prove nothing of it lands, so it poisons the room.
            self.in_flight[e.worker] = ("unsettled", str(exc))
            return
        self.in_flight[e.worker] = ("handle", handle)

    def _poll_transfers(self) -> None:
        for worker, (kind, value) in list(self.in_flight.items()):
            if kind in ("error", "unsettled"):
                del self.in_flight[worker]
                self.input(ev.TransferDone(worker=worker, ok=False, error=value,
                                           settled=kind == "error"))
                continue
            state = self.nixl.poll(value)
            if state == "PROC":
                continue
            del self.in_flight[worker]
            self.nixl.release(value)
            if state == "DONE":
                self.input(ev.TransferDone(worker=worker))
            elif isinstance(value, MooncakeHandle):
                # batch_transfer_sync returned -1: the batch may still be writing (poisoned).
                self.input(ev.TransferDone(worker=worker, ok=False, error=value.error,
                                           settled=value.settled))
            else:
                self.input(ev.TransferDone(worker=worker, ok=False, error="NIXL_ERR"))

    def start_scatter(self, node: str, e: ev.StartScatter) -> None:
        assert self.ring is not None
        cfg = self.cfg
        pages = self.pool.pages_of(e.room)[e.page_start:e.page_start + e.num_pages]
        end = e.offset + e.nbytes
        if len(pages) == e.num_pages and end <= self.ring.numel():
            self.kernels.scatter_from_staging(
                self.ring[e.offset:end], self.pool.k, self.pool.v, pages, cfg.page_size,
                e.prefill_attn_tp, cfg.decode.attn_tp_size, self.spec.rank,
                cfg.model.num_kv_heads)
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            self._verify_pages(e.room, range(e.page_start, e.page_start + e.num_pages))
        else:
            self.reports.append({"kind": "bad-scatter", "node": self.spec.node,
                                 "detail": f"room {e.room} chunk {e.chunk_idx} pages "
                                           f"[{e.page_start}, +{e.num_pages}) outside the room "
                                           f"or region past the ring end"})
        self.scatters_done.append(ev.ScatterDone(room=e.room, chunk_idx=e.chunk_idx,
                                                 alloc_id=e.alloc_id))

    # -- hooks ---------------------------------------------------------------------------------
    def _concluded(self, node: str, e: ev.RoomConcluded) -> None:
        report: dict[str, Any] = {"kind": "concluded", "node": self.spec.node, "room": e.room,
                                  "status": e.status, "reason": e.reason}
        if isinstance(self.core, DecodeRank):
            req = self.rooms.get(e.room)
            if e.status == "Success" and req is not None:
                report["mismatch"] = self._verify(req)
            ring = self.ring_check.take(e.room) if self.ring_check is not None else None
            if ring is not None:  # written ring bytes of the room overwritten before a scatter
                report["mismatch"] = "; ".join(filter(None, (report.get("mismatch"), ring)))
            self.room_server.pop(e.room, None)
            if e.status == "Success" or not self.cfg.deferred_decode_kv_release:
                self.pool.release(e.room)  # a held failed room keeps its KV pages until released
            self.verified.pop(e.room, None)
            self.mismatch.pop(e.room, None)
        self.reports.append(report)

    def _verify_pages(self, room: int, pages: range) -> None:
        """Check the room's pages ``pages`` (indices into the room's suffix pages), just
        written, against the request's pattern. Called after every scatter, so a room's bytes
        are checked as they land (the decode loop's share of a room's cost) instead of all at
        once when it finishes. A check that overlaps a wrong range checked before drops it and
        marks its pages unchecked again (the newer write decides), so what ``_verify`` reports
        is always the room's final bytes."""
        req = self.rooms.get(room)
        if req is None:
            return
        seen = self.verified.setdefault(room, set())
        bad = self.mismatch.setdefault(room, [])
        for entry in [b for b in bad if b[0].start < pages.stop and pages.start < b[0].stop]:
            bad.remove(entry)
            seen.difference_update(entry[0])
        page = self.cfg.page_size
        start = req["decode_prefix_len"]
        first = pages.start * page
        count = min(len(pages) * page, req["input_len"] - start - first)
        if count > 0:
            tokens = self.pool.token_indices(self.pool.pages_of(room), first, count)
            wrong = verify_decode_pool(self.pool.k, self.pool.v, req["rid"],
                                       range(start + first, start + first + count), tokens,
                                       self.heads)
            if wrong is not None:
                bad.append((pages, str(wrong)))
        seen.update(pages)

    def _verify(self, req: dict[str, Any]) -> str | None:
        """Every byte of a finished room checked: the pages no check since their last write
        covered (never written, or re-checked after an overlapping wrong range) now; the
        room's first mismatch in page order, named, or None."""
        room = req["room"]
        total = pages_for_tokens(max(0, req["input_len"] - req["decode_prefix_len"]),
                                 self.cfg.page_size)
        seen = self.verified.get(room, set())
        missing = [i for i in range(total) if i not in seen]
        for _, run in groupby(enumerate(missing), key=lambda x: x[1] - x[0]):
            idx = [i for _, i in run]
            self._verify_pages(room, range(idx[0], idx[-1] + 1))
        return self._first_wrong(room)

    def _first_wrong(self, room: int) -> str | None:
        """The room's first mismatch in page order, as the checks found it, or None."""
        bad = self.mismatch.get(room)
        return min(bad, key=lambda b: b[0].start)[1] if bad else None

    def _torn_down(self, node: str, e: ev.RoomTornDown) -> None:
        self.pool.release(e.room)
        self.computed.pop(e.room, None)
        for key in [k for k in self.decode_pages if k[0] == e.room]:
            del self.decode_pages[key]

    def _crashed(self, node: str, e: ev.RankCrashed) -> None:
        self.reports.append({"kind": "crashed", "node": self.spec.node, "reason": e.reason})

    # -- streaming records to the coordinator --------------------------------------------------
    def _flush(self) -> None:
        """Send new records, and at least every ``FLUSH_IDLE_S`` the time up to which this
        rank has sent everything (the coordinator merges ranks' records up to the minimum)."""
        now = self.now()
        refused = self.sock.refused
        if refused > self._refused_reported:
            self._refused_reported = refused
            self.reports.append({"kind": "refused", "node": self.spec.node, "count": refused})
        if self.outbox or self.reports or now - self._flushed_at >= FLUSH_IDLE_S:
            body = messages.encode_records(self.outbox, self.reports, now)
            self.outbox, self.reports = [], []
            self._flushed_at = now
            self.sock.send(self.coordinator, [RECORDS, self.spec.node.encode(), body])

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.health is not None:
            self.health.close()
        try:
            self._flush()
        finally:
            self.nixl.close()
            self.sock.close(linger_ms=2000)




def spec_key(spec: RankSpec) -> RunKey | None:
    """The run key a rank's spec carries (``None``: an unauthenticated socket, tests only)."""
    return None if spec.secret is None else RunKey.from_text(spec.secret, f"{spec.node}'s spec")


def rank_main(spec: RankSpec) -> None:
    """Process entry point (started by the launcher, ``twin.hw.procs``)."""
    from twin.hw.lifeline import rank_setup

    if spec.env is not None:  # the launcher's environment at start (a forkserver's is older)
        os.environ.clear()
        os.environ.update(spec.env)
    rank_setup(spec.node)  # die with the coordinator; stderr to the rank's log
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    torch.set_num_threads(1)
    proc = None
    try:
        proc = RankProcess(spec)
        proc.bootstrap()
        proc.run()
    except Exception:
        text = traceback.format_exc()
        try:
            sock = proc.sock if proc is not None else ControlSocket(key=spec_key(spec))
            sock.send(spec.coordinator, [REPORT, spec.node.encode(), json.dumps(
                {"kind": "error", "node": spec.node, "detail": text}).encode()])
        except Exception:  # noqa: BLE001 - best effort while dying
            pass
        raise
    finally:
        if proc is not None:
            proc.close()
