"""SGLang's ZMQ sockets on the staging path, and what a send to a peer that is gone does.

Every frame the twin sends leaves one rank's socket from one of the rank's threads. While the
peer is alive a send returns at once (the frame is queued and flushed). Once the peer's process
is gone, libzmq keeps queueing on a socket that keeps its pipe (a socket that reconnects): up to
the send high-water mark (``SNDHWM``, 1000 messages unless set; a multipart frame is one
message). Past it ``send_multipart`` blocks the sending thread until ``SNDTIMEO`` expires (then
raises ``zmq.Again``, which the staging code swallows: the frame is lost) or forever when no
timeout is set; everything else that thread does waits meanwhile.

The table below is SGLang 0.5.23's (paths under ``sglang/srt/disaggregation/``):

==========================  =====================================  ==============================
socket (twin name)          frames, thread                         options
==========================  =====================================  ==============================
decode receiver socket      WATERMARK after a free: decode          ``common/conn.py`` ~2739-2754
(``receiver``), one per     scheduler (``advance_scatter``          (``CommonKVReceiver._connect``,
prefill endpoint, shared    ``staging_handler.py`` ~372-386, from   class-level cache): LINGER 0,
by every request of the     ``utils.py`` ~346; ``release_room``     SNDTIMEO
decode process              ~249). WATERMARK snapshot to a new      ``SGLANG_DISAGGREGATION_ZMQ_
                            subscriber and STAGING_RSP: the KV      SEND_TIMEOUT`` (1 s,
                            manager's listener thread (~958,        ``environ.py`` ~760), SNDHWM
                            ~892-911). Metadata and ABORT: decode   and RECONNECT_IVL left at
                            scheduler (conn.py ~2566-2576,          libzmq's defaults (1000
                            ~2818-2830, ~2988-2998)                 messages, 100 ms: queues)
prefill manager socket      CHUNK_READY: transfer worker            ``common/conn.py`` ~1664-1703
(``manager``), one per      (conn.py ~826-833); KV_STATUS           (``CommonKVManager._connect``):
decode endpoint             (~795-806) and ABORT_ACK (~1030-1040):  LINGER 0, RECONNECT_IVL -1,
                            transfer worker / scheduler             SNDTIMEO 30 s (1 s with
                                                                    ``prefill_complete``
                                                                    allocation), SNDHWM 1000
prefill prefetch socket     STAGING_REQ: prefill scheduler, before  ``staging_handler.py``
(``prefetch``), its own     the forward (``nixl/conn.py``           ~1000-1007: a bare
context, one per decode     ~1045-1082)                             ``zmq.Context().socket(PUSH)``:
endpoint                                                            no SNDTIMEO (blocks forever),
                                                                    LINGER -1, SNDHWM 1000,
                                                                    RECONNECT_IVL 100 ms
==========================  =====================================  ==============================

In the simulator (``Simulation``): every frame to a crashed rank counts against its socket's
high-water mark; past it the send blocks its thread for the send timeout and the frame is lost.
A blocked thread's later frames leave when it unblocks, and a blocked decode scheduler runs no
decode step, admits nothing and frees nothing until then (``DecodeLoop``). Blocked seconds are
summed per rank (``send_blocked_s``). The prefill manager socket (RECONNECT_IVL -1) drops its
pipe when the connection fails, so it blocks without queueing first; the twin counts its
high-water mark all the same (its ``_connect`` re-creates the socket on a disconnect, and the
new pipe queues until the failed connect; a simplification of a few frames).

With the fix ``stale-watermark-subscribers`` (sglang PR #36049, not merged in 0.5.23), WATERMARK
broadcasts leave off the scheduler thread, from a sender per subscriber (the twin's reading of
"off the scheduler path": a single sender thread would make a dead subscriber's timeouts delay
every live one's WATERMARK, which a wrapped ring needs to go on), and a dead
prefill's subscriber is dropped once decode's heartbeat gives up on the prefill server
(``SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL`` 5 s x ``..._HEARTBEAT_MAX_FAILURE`` 2,
``environ.py`` ~761-762). The heartbeat probes the server's bootstrap endpoint, so it notices
only a whole prefill server gone, not one dead rank of a server that still answers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from twin.core import events as ev
from twin.core import wire

SCHEDULER: Final = "scheduler"
LISTENER: Final = "listener"
TRANSFER_WORKER: Final = "transfer-worker"
WATERMARK_SENDER: Final = "watermark-sender"  # with the #36049 fix, one per subscriber


@dataclass(frozen=True, slots=True)
class SocketSpec:
    """One kind of socket: its options as SGLang sets them, and where."""

    name: str
    sndhwm: int  # messages queued to a peer before a send blocks
    sndtimeo_s: float  # math.inf: no timeout, the send blocks forever
    linger_s: float  # math.inf: -1
    reconnect_ivl_s: float  # -1: no reconnect
    source: str


#: SGLang's defaults; ``SimParams.zmq_send_timeout_s`` and ``zmq_sndhwm`` replace the first two.
RECEIVER = SocketSpec("receiver", 1000, 1.0, 0.0, 0.1, "common/conn.py ~2739-2754")
MANAGER = SocketSpec("manager", 1000, 30.0, 0.0, -1.0, "common/conn.py ~1664-1703")
PREFETCH = SocketSpec("prefetch", 1000, math.inf, math.inf, 0.1,
                      "common/staging_handler.py ~1000-1007")
SOCKETS: Final = (RECEIVER, MANAGER, PREFETCH)



def socket_of(role: str, msg: wire.Message | None) -> SocketSpec:
    """The socket a ``role`` rank sends ``msg`` on (``None``: a control notice, metadata)."""
    if role == "decode":
        return RECEIVER
    return PREFETCH if type(msg) is wire.StagingReq else MANAGER


def thread_of(role: str, msg: wire.Message | None, cause: ev.Input | None,
              watermark_sender: bool) -> str:
    """The thread of a ``role`` rank that sends ``msg`` while it handles ``cause``."""
    if role == "decode":
        if type(msg) is wire.StagingRsp:
            return LISTENER
        if type(msg) is wire.Watermark:
            if type(cause) is ev.MessageArrived and type(cause.msg) is wire.StagingReq:
                return LISTENER  # the snapshot to a new subscriber
            return WATERMARK_SENDER if watermark_sender else SCHEDULER
        return SCHEDULER  # metadata, ABORT
    if type(msg) is wire.StagingReq:
        return SCHEDULER
    return TRANSFER_WORKER  # CHUNK_READY, KV_STATUS, ABORT_ACK


class SendBlocking:
    """Per-socket queues to dead peers and per-thread blocked time of one simulation."""

    __slots__ = ("busy", "by_frame", "by_peer", "by_thread", "died", "first_full",
                 "forever", "busy_peer", "heartbeat_s", "hwm", "lost", "prune", "queued",
                 "receiver_timeout_s", "reset", "watermark_sender")

    def __init__(self, *, send_timeout_s: float, sndhwm: int, fix: bool,
                 heartbeat_s: float) -> None:
        self.receiver_timeout_s = send_timeout_s
        self.heartbeat_s = heartbeat_s  # a dead prefill server's detection by the heartbeat
        self.hwm = sndhwm
        self.watermark_sender = fix
        self.prune = fix
        self.busy: dict[tuple[str, str], float] = {}  # (node, thread) -> blocked until
        self.forever: dict[tuple[str, str], float] = {}  # (node, thread) -> blocked since
        self.by_frame: dict[str, float] = {}  # frame kind -> blocked seconds (all ranks)
        self.by_thread: dict[str, float] = {}  # thread (scheduler, ...) -> seconds (all ranks)
        # (src, dead peer, thread) -> seconds blocked in sends to that peer (timed-out sends)
        self.by_peer: dict[tuple[str, str, str], float] = {}
        self.first_full: dict[tuple[str, str], float] = {}  # (src, peer) -> first blocked send
        self.busy_peer: dict[tuple[str, str], str] = {}  # (node, thread) -> peer it blocks on
        self.queued: dict[tuple[str, str, str], int] = {}  # (src, dst, socket) -> frames
        self.died: dict[str, float] = {}  # dead prefill server -> when first seen all gone
        self.reset: set[tuple[str, str, str]] = set()  # sockets the heartbeat re-created
        self.lost = 0  # frames that never reached their peer

    def timeout_of(self, spec: SocketSpec) -> float:
        return self.receiver_timeout_s if spec is RECEIVER else spec.sndtimeo_s

    def send(self, now: float, src: str, role: str, dst: str, dead: bool,
             msg: wire.Message | None, cause: ev.Input | None,
             server_dead: bool = False) -> float:
        """A send from ``src`` at ``now``: the time it leaves (after its thread unblocks), or
        -1 when it never reaches ``dst`` (queued to a dead peer, timed out, or pruned).

        ``server_dead``: every rank of ``dst``'s prefill server is gone, so decode's heartbeat
        (an HTTP probe of the server's bootstrap endpoint, ``common/conn.py`` ~2004-2050) fails
        and, ``heartbeat_s`` later (interval x allowed failures), ``_handle_node_failure`` closes the cached sockets
        (~2057-2083: a re-created socket queues afresh) and, with the fix, drops the
        subscriber. One dead rank of a server that still answers its probe is never
        detected: its sockets stay, and so does its subscriber."""
        thread = thread_of(role, msg, cause, self.watermark_sender)
        if thread == WATERMARK_SENDER:  # one sender per subscriber: a dead one holds no other
            thread = f"{WATERMARK_SENDER}:{dst}"
        key = (src, thread)
        start = self.busy.get(key, 0.0)
        if start < now:
            start = now
        elif math.isinf(start):  # the thread never comes back from an earlier send
            self.lost += 1
            return -1.0
        if not dead:
            return start
        self.lost += 1
        spec = socket_of(role, msg)
        sock = (src, dst, spec.name)
        if server_dead and role == "decode":
            detected = self.died.setdefault(dst, now) + self.heartbeat_s
            if start >= detected:
                if self.prune and type(msg) is wire.Watermark:
                    return -1.0  # the subscriber was dropped: nothing is sent
                if sock not in self.reset:  # disconnect_endpoint: a fresh socket
                    self.reset.add(sock)
                    self.queued.pop(sock, None)
        n = self.queued.get(sock, 0)
        if n < self.hwm:
            self.queued[sock] = n + 1
            return -1.0
        wait = self.timeout_of(spec)
        self.busy[key] = start + wait
        self.first_full.setdefault((src, dst), start)
        name = thread.split(":", 1)[0]
        self.busy_peer[key] = dst
        if math.isinf(wait):
            self.forever.setdefault(key, start)
        else:
            peer = (src, dst, name)
            self.by_peer[peer] = self.by_peer.get(peer, 0.0) + wait
            kind = wire.tag_of(msg).decode() if msg is not None else "metadata/notice"
            self.by_frame[kind] = self.by_frame.get(kind, 0.0) + wait
            self.by_thread[name] = self.by_thread.get(name, 0.0) + wait
        return -1.0

    def blocked_on(self, end: float) -> dict[tuple[str, str, str], float]:
        """Seconds each (rank, dead peer, thread) sat in sends to that peer by ``end``: a send
        still blocked at ``end`` counts up to ``end``, one blocked forever from its start."""
        out = dict(self.by_peer)
        for key, until in self.busy.items():
            peer = (key[0], self.busy_peer.get(key, "?"), key[1].split(":", 1)[0])
            if math.isinf(until):
                out[peer] = out.get(peer, 0.0) + max(0.0, end - self.forever[key])
            elif until > end:
                out[peer] = out.get(peer, 0.0) - (until - end)
        return {k: v for k, v in out.items() if v > 0}

    def blocked_until(self, node: str, thread: str = SCHEDULER) -> float:
        return self.busy.get((node, thread), 0.0)

    def revived(self, node: str) -> None:
        """``node`` runs again (a restart): its peers' queues to it drain into the new
        process, and its own threads start anew."""
        self.died.pop(node, None)
        for sock in [s for s in self.queued if s[1] == node]:
            del self.queued[sock]
        self.reset = {s for s in self.reset if s[1] != node}
        for key in [k for k in self.busy if k[0] == node]:
            self.busy.pop(key)
            self.forever.pop(key, None)
            self.busy_peer.pop(key, None)

    def totals(self, end: float) -> dict[str, float]:
        """Seconds each rank's threads sat in blocked sends by ``end``: a send still blocked
        at ``end`` counts up to ``end``, one blocked forever from when it started (the sum of
        ``blocked_on`` over peers and threads)."""
        out: dict[str, float] = {}
        for (node, _peer, _thread), s in self.blocked_on(end).items():
            out[node] = out.get(node, 0.0) + s
        return {n: round(v, 6) for n, v in sorted(out.items()) if v > 0}
