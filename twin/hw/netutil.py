"""Small networking helpers for the hardware-backed twin (loopback only)."""

from __future__ import annotations

import socket

LOOPBACK_HOST = "127.0.0.1"


def free_port(host: str = LOOPBACK_HOST) -> int:
    """Return a TCP port that was free on ``host`` at the time of the call.

    The port is released before returning, so another process may grab it first; prefer
    binding with port 0 (or zmq's ``bind_to_random_port``) where the API allows it.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def loopback_endpoint(port: int, host: str = LOOPBACK_HOST) -> str:
    """Return the zmq TCP endpoint string ``tcp://host:port``."""
    if not 0 < port < 65536:
        raise ValueError(f"port out of range: {port}")
    return f"tcp://{host}:{port}"


def parse_tcp_endpoint(endpoint: str) -> tuple[str, int]:
    """Split ``tcp://host:port`` into ``(host, port)``; raise ``ValueError`` otherwise."""
    prefix = "tcp://"
    if not endpoint.startswith(prefix):
        raise ValueError(f"not a tcp endpoint: {endpoint!r}")
    host, sep, port_s = endpoint[len(prefix) :].rpartition(":")
    if not sep or not host or not port_s.isdigit():
        raise ValueError(f"malformed tcp endpoint: {endpoint!r}")
    port = int(port_s)
    if not 0 < port < 65536:
        raise ValueError(f"port out of range in {endpoint!r}")
    return host, port
