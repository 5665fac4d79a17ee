"""Warm a rank's control connections and transfer paths before the run's first request.

SGLang's prefill and decode ranks are long-lived servers: by the time a request arrives, their
ZMQ sockets to each peer are connected and their transfer engine has written to each peer
before. A rank process of the hardware mode starts fresh with every run, so without this the
run's first requests paid for set-up that SGLang's never see: the first frame on each socket
(connect and CurveZMQ handshake) and the first WRITE to each decode peer (UCX endpoint
wire-up and the first use of each registered buffer; on Mooncake the peer handshake and the
transfer worker's thread) took 4-12 ms where later WRITEs take about 2, and the first two
requests of a run came out 1.5-1.9x what the simulator predicts (docs/simulator.md).

After the directory and before it reports ready, every rank (``WarmUp.run``):

1. opens each socket it sends on to each peer and waits for the handshake: a prefill rank its
   prefetch and manager sockets to every decode rank it may write to; a decode rank its
   receiver socket to every prefill rank, and its control socket to the other ranks of its
   attention-TP group (the poll reduction);
2. sends one ``TWIN_WARM`` frame on each and waits for the peer's ``TWIN_WARM_ACK`` (on its
   control socket back): a round trip over every connection, answering its peers' pings
   meanwhile;
3. (prefill) posts one WRITE (at most ``WARMUP_BYTES``) from each transfer worker's
   registered buffer (a direct writer: its KV pool) into each decode peer's warm-up region, a
   buffer the decode rank registers for this alone and never reads, and waits for each to
   finish (on Mooncake, on the worker's own thread);
4. runs the hardware mode's own work on a chunk once, on scratch pages (``warm_byte_check``):
   the pattern fill a prefill rank does at each ``SendKV``, and on a decode rank the byte
   check of a chunk that landed;
5. freezes what it allocated so far out of the garbage collector's reach (``gc.freeze()``, as
   SGLang's ``freeze_gc`` after warm-up requests does), and asks for a short scheduler slice
   on each of its threads (``twin.hw.pacing.short_slices``).

None of it reaches the core: no input, no room, no record. The rank reports what it did
(``WarmUp.report``) with its ``TWIN_READY``; the coordinator writes it into the trace header
(``config.run.warmup``, ``twin.hw.launcher.Launcher.warmup``).
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

from twin.hw import messages
from twin.hw.control import ControlSocket
from twin.hw.mooncake_transport import MooncakeEndpoint
from twin.hw.nixl_transport import NixlEndpoint, RegionDesc
from twin.hw.pacing import short_slices
from twin.hw.rankspec import WARM, WARM_ACK

# The rank process these functions warm (``twin.hw.rank.RankProcess``, which imports this
# module): typed loosely so that the two modules do not import each other.
RankProcess = Any

#: Bytes of a decode rank's warm-up region, and of each warm-up WRITE into it (at most: a
#: smaller source buffer bounds it): about a chunk's WRITE (128 KiB per writer in
#: examples/tp2-tp1-small.toml), so that it takes the path a chunk's takes.
WARMUP_BYTES = 256 * 1024
WARMUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class WarmWrite:
    """One warm-up WRITE: ``nbytes`` from ``local`` (registered) into ``region`` of the
    decode rank ``peer_node`` (agent ``peer``), on transfer worker ``worker``."""

    peer_node: str
    peer: str
    region: RegionDesc
    local: Any  # a registered torch.Tensor
    nbytes: int
    worker: int


class WarmUp:
    """One rank's warm-up (module docstring): ``run`` it once, ``answer`` peers' pings until
    the run starts."""

    def __init__(self, node: str, sock: ControlSocket, endpoints: dict[str, str]) -> None:
        self.node = node
        self.sock = sock
        self.endpoints = endpoints
        self._seq = 0
        self._waiting: dict[int, str] = {}  # ping seq -> peer that has not answered yet
        self.report: dict[str, Any] = {}

    def answer(self, frames: list[bytes]) -> bool:
        """Take a peer's ``WARM`` (answer it) or ``WARM_ACK`` (note it); False for any other
        frame (the caller keeps it). A malformed one is dropped."""
        tag = bytes(frames[0]) if frames else b""
        if tag not in (WARM, WARM_ACK):
            return False
        try:
            d = messages.json_object(frames[1])
            peer, seq = str(d["node"]), int(d["seq"])
        except (messages.BadFrame, IndexError, KeyError, TypeError, ValueError):
            return True
        if tag == WARM_ACK:
            self._waiting.pop(seq, None)
        elif peer in self.endpoints:
            self.sock.send(self.endpoints[peer], [WARM_ACK, json.dumps(
                {"node": self.node, "seq": seq}).encode()])
        return True

    def run(self, sockets: Iterable[tuple[str, str]], writes: Iterable[WarmWrite],
            local: Callable[[], None], transfers: NixlEndpoint | MooncakeEndpoint,
            backlog: list[list[bytes]]) -> dict[str, Any]:
        """Warm ``sockets`` (``(peer node, socket name)``: connect, then one round trip each),
        post ``writes`` through ``transfers`` (the rank's NIXL or Mooncake endpoint) and run
        ``local`` (the rank's own first-use work, on scratch memory). ``backlog``: frames
        that arrived before; pings among them are answered, the rest kept (in order) with any
        other frame that arrives meanwhile. Returns the report; raises ``RuntimeError`` when
        a peer does not answer or a WRITE fails."""
        t0 = time.monotonic()
        backlog[:] = [f for f in backlog if not self.answer(f)]
        pairs = list(sockets)
        for peer, name in pairs:
            self.sock.connect(self.endpoints[peer], name, wait_s=WARMUP_TIMEOUT_S)
        connected = time.monotonic()
        for peer, name in pairs:
            self._seq += 1
            self._waiting[self._seq] = peer
            self.sock.send(self.endpoints[peer], [WARM, json.dumps(
                {"node": self.node, "seq": self._seq}).encode()], socket=name)
        slowest = 0.0
        posted = 0
        for w in writes:
            start = time.monotonic()
            if isinstance(transfers, MooncakeEndpoint):  # each worker's thread, as it writes
                handle: Any = transfers.write(w.local, w.peer, w.region, 0, w.nbytes,
                                              worker=w.worker)
            else:
                handle = transfers.write(w.local, w.peer, w.region, 0, w.nbytes)
            try:
                transfers.wait(handle, timeout_s=WARMUP_TIMEOUT_S)
            except Exception as exc:
                raise RuntimeError(f"{self.node}: warm-up WRITE of {w.nbytes} B to "
                                   f"{w.peer_node} failed: {exc}") from exc
            finally:
                if handle.state != "PROC":
                    transfers.release(handle)
            slowest = max(slowest, time.monotonic() - start)
            posted += 1
            self._drain(backlog, 0)
        local_t0 = time.monotonic()
        local()
        local_s = time.monotonic() - local_t0
        wrote = time.monotonic()
        deadline = wrote + WARMUP_TIMEOUT_S
        while self._waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                silent = sorted(set(self._waiting.values()))
                raise RuntimeError(f"{self.node}: no answer to its warm-up frames from "
                                   f"{', '.join(silent)} within {WARMUP_TIMEOUT_S:g} s")
            self._drain(backlog, max(1, int(left * 1000)))
        # What the rank set up lives for the run: keep the collector off it, so that a full
        # collection cannot stall the rank's loop mid-run (SGLang's freeze_gc after warm-up).
        gc.freeze()
        # Its threads (loop, transfer engine, workers: all started by now) wake promptly on a
        # core another rank's kernel holds (twin.hw.pacing).
        threads = short_slices()
        done = time.monotonic()
        self.report = {"seconds": round(done - t0, 6), "connect_s": round(connected - t0, 6),
                       "sockets": len(pairs), "writes": posted,
                       "slowest_write_s": round(slowest, 6), "byte_check_s": round(local_s, 6),
                       "short_slice_threads": threads}
        return self.report

    def _drain(self, backlog: list[list[bytes]], timeout_ms: int) -> None:
        """Read what arrived (waiting up to ``timeout_ms`` for the first): pings answered,
        acks noted, anything else kept in ``backlog``."""
        frames = self.sock.recv_frames(timeout_ms=timeout_ms)
        while frames is not None:
            if not self.answer(frames):
                backlog.append(frames)
            frames = self.sock.recv_frames(timeout_ms=0)


def warm_plan(rank: RankProcess) -> tuple[list[tuple[str, str]], list[WarmWrite],
                                         Callable[[], None]]:
    """What ``rank`` warms: ``(peer, socket)`` for each socket it sends SGLang's frames on
    (a prefill rank: prefetch, when it stages, and manager to each decode rank it may write
    to; a decode rank: receiver to each prefill rank, and control to the rest of its
    attention-TP group), a prefill rank's WRITEs: one from each transfer worker's buffer
    (without staging: from its KV pool) into each decode peer's warm-up region, and its byte
    check's first use (``warm_byte_check``)."""
    from twin.core.prefill import PrefillRank

    local = partial(warm_byte_check, rank)
    if isinstance(rank.core, PrefillRank):
        decode = sorted(rank.rings.keys() | rank.pools.keys())
        sockets = [(n, name) for n in decode for name in ("prefetch", "manager")
                   if name == "manager" or n in rank.rings]
        writes = []
        for node, (peer, region) in sorted(rank.warm_targets.items()):
            for w in range(rank.core.num_workers):
                buf = rank.buffers[w] if rank.buffers else rank.pool.storage
                size = buf.numel() * buf.element_size()
                writes.append(WarmWrite(node, peer, region, buf, min(size, region.length), w))
        return sockets, writes, local
    me = rank.topo.nodes[rank.spec.node]
    prefill = [n.id for n in rank.topo.nodes.values()
               if n.role == "prefill" and n.id in rank.endpoints]
    group = [n for n in rank.topo.decode_group_of(me) if n != me.id and n in rank.endpoints]
    return [(n, "receiver") for n in prefill] + [(n, "control") for n in group], [], local


def warm_byte_check(rank: RankProcess) -> None:
    """The hardware mode's own work on a chunk, once, on a scratch pool of a chunk's pages
    shaped like the rank's (its pool is not touched): a prefill rank fills a chunk's pattern as
    a forward's ``SendKV`` has it do; a decode rank also checks it as a scatter's landing is
    checked. The first call of each cost the run's first chunk a few milliseconds more (the
    pattern's tables, torch's first calls at these shapes)."""
    from twin.core.prefill import PrefillRank
    from twin.hw.kvpattern import fill_prefill_pool, verify_decode_pool
    from twin.hw.pools import KVPool

    pool, cfg = rank.pool, rank.cfg
    pages = max(1, cfg.chunked_prefill_size // cfg.page_size)
    scratch = KVPool(len(pool.k), pages, cfg.page_size, len(rank.heads), cfg.model.head_dim,
                     pool.k[0].dtype, pool.k[0].device)
    owned = scratch.alloc(0, pages)
    fill_prefill_pool(scratch.k, scratch.v, owned, cfg.page_size, request=0,
                      head_offset=rank.heads.start, layer_offset=rank.layers[0])
    if not isinstance(rank.core, PrefillRank):
        tokens = scratch.token_indices(owned, 0, pages * cfg.page_size)
        verify_decode_pool(scratch.k, scratch.v, 0, range(pages * cfg.page_size), tokens,
                           rank.heads, layer_offset=rank.layers[0])
