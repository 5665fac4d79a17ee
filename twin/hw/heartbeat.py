"""SGLang decode's heartbeat on real ranks: is a prefill server still there?

SGLang's decode KV manager probes each prefill server's bootstrap endpoint every
``SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL`` seconds (5) and, after
``SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE`` (2) failed probes in a row, runs
``_handle_node_failure`` (``common/conn.py`` ~2004-2083): it closes the cached sockets to the
server's ranks and fails the rooms bootstrapped from it. The simulator gives up exactly
``interval x max_failure`` after the server died (``Simulation._heartbeat_failed``); here the
probes are real, so the verdict comes between ``(max_failure - 1) x interval`` and
``max_failure x interval`` after the death, as SGLang's does.

The twin has no bootstrap server per prefill server: each prefill rank listens on a plain TCP
``health`` port (:class:`HealthPort`, accepted and closed at once, like an HTTP ``/health``), and
a server answers a probe when any of its ranks accepts a connection. A server whose every rank
is gone refuses them all.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections.abc import Mapping, Sequence

PROBE_TIMEOUT_S = 1.0


class HealthPort:
    """A listening TCP socket that accepts and closes every connection, on a daemon thread
    (a prefill rank's stand-in for its server's bootstrap endpoint)."""

    def __init__(self, host: str) -> None:
        self._sock = socket.create_server((host, 0), backlog=128)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, name="health", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            conn.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a process accepts a TCP connection at ``address`` (``host:port``)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def server_up(addresses: Sequence[str]) -> bool:
    """A server answers when any of its ranks does."""
    return any(probe(a) for a in addresses)


class Heartbeat:
    """Probes every prefill server (``servers``: instance -> its ranks' health addresses)
    every ``interval_s`` on a daemon thread; a server that failed ``max_failure`` probes in a
    row is reported once through :meth:`failed` (thread-safe; the rank's loop acts on it)."""

    def __init__(self, servers: Mapping[int, Sequence[str]], interval_s: float,
                 max_failure: int) -> None:
        self.servers = {k: list(v) for k, v in servers.items() if v}
        self.interval_s = interval_s
        self.max_failure = max_failure
        self.failures: dict[int, int] = dict.fromkeys(self.servers, 0)
        self._failed: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._given_up: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.servers and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        next_at = time.monotonic() + self.interval_s
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            next_at += self.interval_s
            for inst, addresses in self.servers.items():
                if inst in self._given_up:
                    continue
                if server_up(addresses):
                    self.failures[inst] = 0
                    continue
                self.failures[inst] += 1
                if self.failures[inst] >= self.max_failure:
                    self._given_up.add(inst)
                    self._failed.put(inst)

    def failed(self) -> list[int]:
        """Servers given up on since the last call."""
        out = []
        while True:
            try:
                out.append(self._failed.get_nowait())
            except queue.Empty:
                return out

    def suspect(self, instance: int) -> bool:
        """Whether the last probe of ``instance`` failed (or it was given up on)."""
        return instance in self._given_up or self.failures.get(instance, 0) > 0

    def stop(self) -> None:
        self._stop.set()
