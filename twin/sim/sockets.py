"""How a send to a peer that is gone blocks SGLang's threads, in the simulator.

The sockets and their options are SGLang 0.5.23's (``twin.runtime.sockets``, one table for
both drivers). In the simulator (``Simulation``): every frame to a crashed rank counts against
its socket's high-water mark; past it the send blocks its thread for the send timeout and the frame is lost.
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

from twin.core import events as ev
from twin.core import wire
from twin.runtime.sockets import (
    LISTENER,
    MANAGER,
    PREFETCH,
    RECEIVER,
    SCHEDULER,
    SOCKETS,
    TRANSFER_WORKER,
    WATERMARK_SENDER,
    SocketSpec,
    socket_of,
    thread_of,
)

__all__ = ["LISTENER", "MANAGER", "PREFETCH", "RECEIVER", "SCHEDULER", "SOCKETS",
           "TRANSFER_WORKER", "WATERMARK_SENDER", "SendBlocking", "SocketSpec", "socket_of",
           "thread_of"]


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
