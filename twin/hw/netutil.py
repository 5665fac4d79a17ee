"""Small networking helpers for the hardware-backed twin.

Loopback is the default everywhere; a non-loopback address is used only where a command names
one (``twin hw --listen``, ``twin agent --join/--address``). Port ranges (``20000-20099``) bound
what a process may listen on, so that a firewall can be opened for exactly those ports.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import MutableMapping

LOOPBACK_HOST = "127.0.0.1"
SIOCGIFADDR = 0x8915


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


def parse_host_port(text: str, *, allow_zero: bool = False) -> tuple[str, int]:
    """``HOST:PORT`` (or ``tcp://HOST:PORT``) as ``(ipv4 address, port)``; a host name is
    resolved. Raises ``ValueError`` naming what is wrong."""
    raw = text[len("tcp://"):] if text.startswith("tcp://") else text
    host, sep, port_s = raw.rpartition(":")
    if not sep or not host or not port_s.isdigit():
        raise ValueError(f"{text!r}: expected HOST:PORT, e.g. 10.0.0.1:29500")
    port = int(port_s)
    if not (0 if allow_zero else 1) <= port < 65536:
        raise ValueError(f"{text!r}: port {port} out of range")
    try:
        addr = socket.gethostbyname(host)
    except OSError as exc:
        raise ValueError(f"{text!r}: cannot resolve {host!r}: {exc}") from None
    return addr, port


def parse_port_range(text: str | None) -> tuple[int, int] | None:
    """``"20000-20099"`` (or one port ``"20000"``) as ``(20000, 20099)``; ``None``/empty: any."""
    if text is None or not text.strip():
        return None
    lo_s, sep, hi_s = text.strip().partition("-")
    try:
        lo = int(lo_s)
        hi = int(hi_s) if sep else lo
    except ValueError:
        raise ValueError(f"{text!r}: expected a port range like 20000-20099") from None
    if not 1 <= lo <= hi < 65536:
        raise ValueError(f"{text!r}: expected 1 <= FIRST <= LAST <= 65535")
    return lo, hi


def format_port_range(ports: tuple[int, int] | None) -> str:
    return "any free port" if ports is None else f"{ports[0]}-{ports[1]}"


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def is_unspecified(host: str) -> bool:
    """``0.0.0.0``: every interface."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def local_address_towards(host: str, port: int) -> str:
    """The local IPv4 address this host would use to reach ``host:port`` (no packet is sent:
    connecting a UDP socket only chooses the route)."""
    if is_loopback(host):
        return LOOPBACK_HOST
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


def interface_addresses() -> dict[str, str]:
    """IPv4 address of every interface that has one: ``{name: address}`` (Linux)."""
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _index, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                res = fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)
            except OSError:
                continue
            out[name] = socket.inet_ntoa(res[20:24])
    return out


def interface_of(address: str) -> str | None:
    """The name of the interface that holds ``address`` (``lo`` for loopback), or ``None``."""
    if is_loopback(address):
        return "lo"
    for name, addr in interface_addresses().items():
        if addr == address:
            return name
    return None


def has_rdma_devices() -> bool:
    """Whether the host has RDMA devices (InfiniBand, RoCE): UCX then picks them itself."""
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def choose_ucx_modules(environ: MutableMapping[str, str] | None = None) -> str:
    """Keep UCX's InfiniBand modules out of a process on a host without RDMA devices, and say
    what was chosen.

    The NIXL wheel bundles its own rdma-core and libnl; where the system's libibverbs1 and
    ibverbs-providers are installed too, UCX's ``ib`` modules (``libuct_ib_efa`` needs the
    system's ``libefa.so.1``) load the system's ``libnl-route-3`` beside the bundled one, and
    every process that created a UCX agent segfaults at exit (``rtnl_tc_unregister`` in
    ``_dl_fini``; exit status 139 instead of the real one). Without RDMA devices those modules
    have nothing to drive, so ``UCX_MODULES=^ib`` is set; a host with RDMA devices keeps them
    (its IB transport is the point), and a ``UCX_MODULES`` already set wins. Must run before
    the first UCX agent of the process (UCX reads it once); children inherit it."""
    env = os.environ if environ is None else environ
    if "UCX_MODULES" in env:
        return f"UCX_MODULES={env['UCX_MODULES']} (from the environment)"
    if has_rdma_devices():
        return ("UCX ib modules kept: RDMA devices in /sys/class/infiniband ("
                + ", ".join(sorted(os.listdir("/sys/class/infiniband"))) + ")")
    env["UCX_MODULES"] = "^ib"
    return ("UCX_MODULES=^ib: no RDMA devices (/sys/class/infiniband), so UCX's InfiniBand "
            "modules stay unloaded (with the system's rdma-core installed they crash the "
            "process at exit)")
