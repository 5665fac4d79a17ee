"""ZeroMQ control plane for twin ranks: multipart messages over TCP (loopback by default).

Each rank owns one :class:`ControlSocket`: a PULL socket bound on loopback, or on the address
its node's agent was given, optionally within a port range (its ``endpoint`` is what peers
send to), plus lazily connected PUSH sockets, one per peer endpoint. Frames are raw
``bytes``; interpreting them is the caller's job, so the receive path
(:meth:`ControlSocket.recv_frames`) never raises because of message content.

The twin's own bootstrap (agent metadata and registered regions) travels as
``[b"TWIN_BOOTSTRAP", name, json, metadata]``: the first three frames follow the documented
``[tag, name, json]`` shape and the opaque NIXL metadata rides as a trailing binary frame
instead of being base64-encoded into the JSON. SGLang's staging frames are a separate
protocol and are not decoded here.

Sockets as SGLang opens them: ``send(..., socket=NAME)`` picks one PUSH socket per (peer,
name). SGLang's prefill sends STAGING_REQ on a prefetch socket created in a context of its own,
apart from the manager's cached socket that carries CHUNK_READY, KV_STATUS and ABORT_ACK; the
``"prefetch"`` sockets here live in a second context the same way, so frames on different
sockets reach the peer's PULL socket over separate connections and may overtake each other.

Authentication: with a ``key`` (:class:`twin.hw.auth.RunKey`; every run passes one) the PULL
socket is a CurveZMQ server that admits only holders of the run's key and every PUSH socket a
client with it, so frames from processes outside the run never arrive; their refused
handshakes are counted (:attr:`ControlSocket.refused`). Without a key (tests of the socket
itself, benchmarks) the sockets are plain TCP.

SGLang's own options: :meth:`ControlSocket.configure` gives a socket name the options of one
row of SGLang's socket table (``twin.runtime.sockets``: SNDHWM, SNDTIMEO, LINGER,
RECONNECT_IVL; no ``ZMQ_IMMEDIATE``, as SGLang sets none), so a rank's sends to a peer that is
gone queue up to the high-water mark and then block for the socket's timeout, as SGLang's do.
:meth:`ControlSocket.connect` opens such a socket ahead of its first frame and can wait until
the peer's handshake completed.

Delivery notes: the twin's own ``"control"`` PUSH sockets use ``ZMQ_IMMEDIATE`` so
:meth:`ControlSocket.send` blocks (up to its timeout) until the peer's PULL socket is reachable
instead of queueing silently. A send returns once the message is queued; ``close()`` defaults to linger 0, which drops
anything still queued, so a process that sends a last message and exits should close with
``linger_ms > 0``.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import zmq

from twin.hw.auth import RefusalCounter, RunKey, guard_context, unguard_context
from twin.hw.netutil import LOOPBACK_HOST
from twin.hw.nixl_transport import RegionDesc
from twin.runtime.sockets import SocketSpec

BOOTSTRAP_TAG = b"TWIN_BOOTSTRAP"


class ControlError(RuntimeError):
    """The control socket is closed, or a send could not be queued in time."""


class ControlSocket:
    """A bound PULL socket plus per-peer PUSH sockets; see the module docstring.

    ``bind``: a zmq endpoint to bind (``tcp://127.0.0.1:5555``); by default a free port on
    ``host``, within ``ports`` (first, last; inclusive) if given. ``context``: a shared zmq
    context (not terminated by :meth:`close`); by default the socket owns a private context and
    terminates it on close. ``key``: the run's key (see the module docstring); its ZAP handler
    runs on the context, so the owner of a shared context calls
    ``twin.hw.auth.unguard_context`` before terminating it. Not thread-safe.
    """

    def __init__(
        self,
        bind: str | None = None,
        *,
        host: str = LOOPBACK_HOST,
        ports: tuple[int, int] | None = None,
        context: zmq.Context[Any] | None = None,
        send_timeout_ms: int = 5000,
        key: RunKey | None = None,
    ) -> None:
        self._owns_ctx = context is None
        self.key = key
        self._ctx: zmq.Context[Any] = zmq.Context() if context is None else context
        self._send_timeout_ms = send_timeout_ms
        self._push: dict[tuple[str, str], zmq.Socket[Any]] = {}
        self._options: dict[str, SocketSpec] = {}  # socket name -> SGLang's options for it
        self._prefetch_ctx: zmq.Context[Any] | None = None
        self._backlog: deque[list[bytes]] = deque()
        self._closed = False
        self._pull: zmq.Socket[Any] = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._refusals: RefusalCounter | None = None
        try:
            if key is not None:
                guard_context(self._ctx, key)
                key.serve(self._pull)
                self._refusals = RefusalCounter(self._pull)
            if bind is None and ports is None:
                port = self._pull.bind_to_random_port(f"tcp://{host}")
                self.endpoint = f"tcp://{host}:{port}"
            elif bind is None:
                self.endpoint = _bind_in_range(self._pull, host, ports)
            else:
                self._pull.bind(bind)
                last = self._pull.getsockopt(zmq.LAST_ENDPOINT)
                self.endpoint = last.decode() if isinstance(last, bytes) else str(last)
        except Exception:
            if self._refusals is not None:
                self._refusals.close()
            self._pull.close(0)
            if self._owns_ctx:
                unguard_context(self._ctx)
                self._ctx.term()
            raise

    # ------------------------------------------------------------------ lifecycle
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def refused(self) -> int:
        """Connections refused so far because the peer did not prove the run's key."""
        return self._refusals.poll() if self._refusals is not None else 0

    @property
    def context(self) -> zmq.Context[Any]:
        return self._ctx

    def __enter__(self) -> ControlSocket:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self, linger_ms: int = 0, linger_for: Mapping[str, int] | None = None) -> None:
        """Close all sockets (and the private context). Idempotent.

        ``linger_ms`` bounds how long already-queued outgoing messages may still be sent;
        ``linger_for`` sets it per peer endpoint (a rank that crashes drops what it queued to
        its peers but lets its last records reach the coordinator).
        """
        if self._closed:
            return
        self._closed = True
        for (endpoint, _), sock in self._push.items():
            sock.close((linger_for or {}).get(endpoint, linger_ms))
        self._push.clear()
        if self._refusals is not None:
            self._refusals.close()
        self._pull.close(0)
        self._backlog.clear()
        if self._prefetch_ctx is not None:
            self._prefetch_ctx.term()
        if self._owns_ctx:
            unguard_context(self._ctx)
            self._ctx.term()

    def _check_open(self) -> None:
        if self._closed:
            raise ControlError("control socket is closed")

    # ------------------------------------------------------------------ send
    def configure(self, spec: SocketSpec) -> None:
        """PUSH sockets named ``spec.name`` opened from now on take SGLang's options of that
        row: SNDHWM, SNDTIMEO (none when infinite: a send blocks until the peer takes it),
        LINGER and RECONNECT_IVL, and no ``ZMQ_IMMEDIATE`` (frames queue while the peer is
        away, up to the high-water mark)."""
        self._options[spec.name] = spec

    def _push_for(self, endpoint: str, socket: str = "control",
                  wait_s: float | None = None) -> zmq.Socket[Any]:
        sock = self._push.get((endpoint, socket))
        if sock is None:
            ctx = self._ctx
            if socket == "prefetch":  # SGLang's prefetch socket lives in a context of its own
                if self._prefetch_ctx is None:
                    self._prefetch_ctx = zmq.Context()
                ctx = self._prefetch_ctx
            sock = ctx.socket(zmq.PUSH)
            spec = self._options.get(socket)
            if spec is None:
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.IMMEDIATE, 1)
            else:
                sock.setsockopt(zmq.SNDHWM, spec.sndhwm)
                sock.setsockopt(zmq.SNDTIMEO, _ms(spec.sndtimeo_s))
                sock.setsockopt(zmq.LINGER, _ms(spec.linger_s))
                sock.setsockopt(zmq.RECONNECT_IVL, _ms(spec.reconnect_ivl_s))
            if self.key is not None:
                self.key.join(sock)
            monitor = (sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
                       if wait_s is not None else None)
            try:
                sock.connect(endpoint)
                if monitor is not None and not monitor.poll(int((wait_s or 0) * 1000)):
                    raise ControlError(f"no connection to {endpoint!r} within {wait_s} s")
            except (zmq.ZMQError, ControlError) as e:
                sock.close(0)
                if isinstance(e, ControlError):
                    raise
                raise ControlError(f"cannot connect to {endpoint!r}: {e}") from e
            finally:
                if monitor is not None:
                    with contextlib.suppress(zmq.ZMQError):
                        sock.disable_monitor()
                    monitor.close(0)
            self._push[(endpoint, socket)] = sock
        return sock

    def connect(self, endpoint: str, socket: str, wait_s: float | None = None) -> None:
        """Open this side's ``socket`` to ``endpoint`` now (SGLang opens it at the first frame);
        with ``wait_s``, return only once the peer's handshake completed (``ControlError``
        after ``wait_s``), so a socket without ``ZMQ_IMMEDIATE`` is known to be up."""
        self._check_open()
        self._push_for(endpoint, socket, wait_s)

    def disconnect(self, endpoint: str) -> None:
        """Close every PUSH socket to ``endpoint`` and drop what they queued (SGLang's
        ``_handle_node_failure`` closing a dead server's cached sockets): the next frame
        opens a fresh one."""
        for key in [k for k in self._push if k[0] == endpoint]:
            self._push.pop(key).close(0)

    def send(
        self, endpoint: str, frames: Sequence[bytes], *, timeout_ms: int | None = None,
        socket: str = "control",
    ) -> None:
        """Queue one multipart message for ``endpoint`` on this side's ``socket`` to it.

        Blocks at most ``timeout_ms`` (default: the socket's ``send_timeout_ms``, or for a
        configured socket its SGLang SNDTIMEO) while the peer is unreachable or its queue is
        full, then raises :class:`ControlError`.
        """
        self._check_open()
        if not frames:
            raise ValueError("a message needs at least one frame")
        parts = [bytes(f) for f in frames]
        sock = self._push_for(endpoint, socket)
        if timeout_ms is not None or socket not in self._options:
            sock.setsockopt(zmq.SNDTIMEO,
                            self._send_timeout_ms if timeout_ms is None else timeout_ms)
        try:
            sock.send_multipart(parts, copy=True)
        except zmq.Again as e:
            raise ControlError(f"send to {endpoint!r} timed out (peer unreachable?)") from e

    # ------------------------------------------------------------------ receive
    def recv_frames(self, timeout_ms: int | None = None) -> list[bytes] | None:
        """Return the next multipart message as raw frames, or ``None`` on timeout.

        ``timeout_ms=None`` blocks; ``0`` does not block. Tolerant: the content is not
        inspected, so malformed messages never raise here. Raises :class:`ControlError` only
        if the socket is (or gets) closed.
        """
        self._check_open()
        if self._backlog:
            return self._backlog.popleft()
        try:
            if timeout_ms is None or timeout_ms > 0:
                if not self._pull.poll(timeout_ms, zmq.POLLIN):
                    return None
                return list(self._pull.recv_multipart(copy=True))
            return list(self._pull.recv_multipart(zmq.NOBLOCK, copy=True))
        except zmq.Again:
            return None
        except zmq.ContextTerminated as e:
            raise ControlError("control socket context terminated") from e

    recv = recv_frames

    def unread(self, messages: Iterable[list[bytes]]) -> None:
        """Put messages back so the next receives return them first, in the given order."""
        self._check_open()
        self._backlog.extendleft(reversed(list(messages)))


def _ms(seconds: float) -> int:
    """A zmq time option: milliseconds, -1 for infinite (and for SGLang's -1 settings)."""
    return -1 if seconds < 0 or math.isinf(seconds) else int(round(seconds * 1000))


def _bind_in_range(sock: zmq.Socket[Any], host: str, ports: tuple[int, int] | None) -> str:
    """Bind ``sock`` to the first free port of ``ports`` on ``host``, starting at a random
    one (so that processes starting together rarely collide); every port is tried once."""
    assert ports is not None
    lo, hi = ports
    count = hi - lo + 1
    start = random.randrange(count)
    for k in range(count):
        port = lo + (start + k) % count
        try:
            sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            if e.errno == zmq.EADDRINUSE:
                continue
            raise ControlError(f"cannot listen on {host}:{port}: {e}") from e
        return f"tcp://{host}:{port}"
    raise ControlError(f"no free port in {lo}-{hi} on {host} (all {count} in use)")


# ---------------------------------------------------------------------- bootstrap
@dataclass(frozen=True)
class BootstrapInfo:
    """What one rank tells another before transfers: who it is and where to write."""

    name: str
    endpoint: str
    metadata: bytes
    regions: tuple[RegionDesc, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)


def encode_bootstrap(info: BootstrapInfo) -> list[bytes]:
    """Frames ``[TWIN_BOOTSTRAP, name, json, metadata]`` for ``info``."""
    body = {
        "endpoint": info.endpoint,
        "regions": [r.to_dict() for r in info.regions],
        "extra": dict(info.extra),
    }
    return [
        BOOTSTRAP_TAG,
        info.name.encode(),
        json.dumps(body, separators=(",", ":")).encode(),
        bytes(info.metadata),
    ]


def decode_bootstrap(frames: Sequence[bytes]) -> BootstrapInfo | None:
    """Parse bootstrap frames; return ``None`` (never raise) for anything malformed."""
    try:
        if len(frames) != 4 or frames[0] != BOOTSTRAP_TAG:
            return None
        name = bytes(frames[1]).decode()
        body = json.loads(bytes(frames[2]))
        if not name or not isinstance(body, dict):
            return None
        endpoint = body["endpoint"]
        regions_raw = body.get("regions", [])
        extra = body.get("extra", {})
        if not isinstance(endpoint, str) or not isinstance(regions_raw, list):
            return None
        if not isinstance(extra, dict):
            return None
        regions = tuple(RegionDesc.from_dict(r) for r in regions_raw)
        return BootstrapInfo(name, endpoint, bytes(frames[3]), regions, extra)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def send_bootstrap(sock: ControlSocket, endpoint: str, info: BootstrapInfo) -> None:
    """Send ``info`` to the control socket at ``endpoint``."""
    sock.send(endpoint, encode_bootstrap(info))


def recv_bootstrap(
    sock: ControlSocket, timeout_s: float, *, name: str | None = None
) -> BootstrapInfo | None:
    """Wait for a valid bootstrap message (from ``name`` if given); ``None`` on timeout.

    Malformed bootstrap messages are dropped; other messages (different first frame, or a
    bootstrap from another rank) are put back on ``sock`` in arrival order.
    """
    deadline = time.monotonic() + timeout_s
    others: list[list[bytes]] = []
    try:
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                return None
            frames = sock.recv_frames(left_ms)
            if frames is None:
                return None
            if not frames or frames[0] != BOOTSTRAP_TAG:
                others.append(frames)
                continue
            info = decode_bootstrap(frames)
            if info is None:
                continue
            if name is not None and info.name != name:
                others.append(frames)
                continue
            return info
    finally:
        if others and not sock.closed:
            sock.unread(others)


def exchange_bootstrap(
    sock: ControlSocket,
    peer_endpoint: str | None,
    info: BootstrapInfo,
    timeout_s: float = 30.0,
) -> BootstrapInfo:
    """Swap bootstrap info with one peer and return the peer's.

    With ``peer_endpoint`` the caller speaks first, then waits for the reply; with ``None``
    it waits for the peer's message and replies to the endpoint that message names. Raises
    ``TimeoutError`` if the peer's message does not arrive within ``timeout_s``.
    """
    if peer_endpoint is not None:
        send_bootstrap(sock, peer_endpoint, info)
    peer = recv_bootstrap(sock, timeout_s)
    if peer is None:
        raise TimeoutError(f"no bootstrap message within {timeout_s:.3g} s on {sock.endpoint}")
    if peer_endpoint is None:
        send_bootstrap(sock, peer.endpoint, info)
    return peer
