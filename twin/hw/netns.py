"""Two network namespaces joined by a veth pair: two "nodes" on one Linux host.

Used by the tests and ``benchmarks/bench_nodes.py`` to run a hardware run across nodes for real
on one machine: each namespace has its own network stack (only ``lo`` and its end of the veth),
so traffic between them crosses the veth and nothing else is reachable. Creating them needs root
(``CAP_NET_ADMIN``); :func:`two_nodes` falls back to loopback (both "nodes" are this host, and
says so in ``reason``) where they cannot be created.

    with two_nodes() as net:
        net.popen("a", [...])      # in namespace a (address net.addr["a"])
        net.popen("b", [...], clock_offset_s=1000)  # in b, with its monotonic clock shifted

Everything is removed on exit, also when the block raises: processes started through
:meth:`TwoNodes.popen` are killed (their whole process group), then the namespaces deleted
(which deletes the veth pair).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from twin.hw.netutil import LOOPBACK_HOST

SUBNET = "10.213.0"  # a /30 that lives only inside the two namespaces


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def time_namespaces_work() -> bool:
    """Whether ``unshare --time --monotonic`` can shift a process's monotonic clock here."""
    if shutil.which("unshare") is None:
        return False
    try:
        r = subprocess.run(["unshare", "--time", "--monotonic", "5", "--fork", "true"],
                           capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


@dataclass
class TwoNodes:
    """Where the two nodes are and how to start processes on them."""

    namespaces: dict[str, str | None]  # node -> namespace (None: this host's network)
    addr: dict[str, str]
    iface: dict[str, str]
    reason: str = ""  # why loopback is used, if it is
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    @property
    def isolated(self) -> bool:
        return all(ns is not None for ns in self.namespaces.values())

    def prefix(self, node: str, clock_offset_s: float | None = None) -> list[str]:
        """The command prefix that runs a program on ``node``."""
        out: list[str] = []
        ns = self.namespaces[node]
        if ns is not None:
            out += ["ip", "netns", "exec", ns]
        if clock_offset_s:
            out += ["unshare", "--time", "--monotonic", f"{clock_offset_s:g}", "--fork", "--"]
        return out

    def popen(self, node: str, argv: Sequence[str], *, clock_offset_s: float | None = None,
              **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on ``node`` in its own process group (killed when the block ends)."""
        proc = subprocess.Popen([*self.prefix(node, clock_offset_s), *argv],
                                start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, node: str, argv: Sequence[str],
            **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        return subprocess.run([*self.prefix(node), *argv], **kwargs)

    def link(self, node: str, up: bool) -> None:
        """Take ``node``'s end of the veth down (its network is lost) or up again."""
        ns = self.namespaces[node]
        if ns is None:
            raise RuntimeError("no namespaces: the network cannot be cut over loopback")
        _ip("netns", "exec", ns, "ip", "link", "set", self.iface[node], "up" if up else "down")

    def rx_bytes(self, node: str) -> int:
        """Bytes ``node``'s end of the veth has received."""
        ns = self.namespaces[node]
        if ns is None:
            return 0
        r = subprocess.run(["ip", "netns", "exec", ns, "cat",
                            f"/sys/class/net/{self.iface[node]}/statistics/rx_bytes"],
                           capture_output=True, text=True, timeout=10, check=True)
        return int(r.stdout.strip())

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)


@contextlib.contextmanager
def two_nodes(tag: str | None = None) -> Iterator[TwoNodes]:
    """Namespaces ``a`` (10.213.0.1) and ``b`` (10.213.0.2) joined by a veth pair, or, where
    they cannot be created, both nodes on this host's loopback (``reason`` says why)."""
    tag = tag or f"{os.getpid() % 100000}"
    ns = {"a": f"twin-{tag}-a", "b": f"twin-{tag}-b"}
    iface = {"a": f"tw{tag}a", "b": f"tw{tag}b"}
    created: list[str] = []
    net: TwoNodes | None = None
    try:
        try:
            if os.geteuid() != 0:
                raise PermissionError("not root: network namespaces need CAP_NET_ADMIN")
            for n in ("a", "b"):
                _ip("netns", "add", ns[n])
                created.append(ns[n])
            _ip("link", "add", iface["a"], "type", "veth", "peer", "name", iface["b"])
            for k, n in enumerate(("a", "b"), start=1):
                _ip("link", "set", iface[n], "netns", ns[n])
                _ip("netns", "exec", ns[n], "ip", "addr", "add", f"{SUBNET}.{k}/30", "dev",
                    iface[n])
                _ip("netns", "exec", ns[n], "ip", "link", "set", "lo", "up")
                _ip("netns", "exec", ns[n], "ip", "link", "set", iface[n], "up")
            net = TwoNodes({"a": ns["a"], "b": ns["b"]},
                           {"a": f"{SUBNET}.1", "b": f"{SUBNET}.2"}, dict(iface))
            _wait_carrier(net)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            for name in reversed(created):
                with contextlib.suppress(Exception):
                    _ip("netns", "del", name)
            created.clear()
            net = TwoNodes({"a": None, "b": None}, {"a": LOOPBACK_HOST, "b": LOOPBACK_HOST},
                           {"a": "lo", "b": "lo"},
                           reason=f"network namespaces unavailable ({str(detail).strip()}); "
                                  f"both nodes run on this host's loopback")
        yield net
    finally:
        if net is not None:
            net.kill_all()
        for name in reversed(created):
            with contextlib.suppress(Exception):
                _ip("netns", "del", name)


def _wait_carrier(net: TwoNodes, timeout_s: float = 10.0) -> None:
    """Wait until both ends of the veth are up (the link needs a moment)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for n in ("a", "b"):
            r = subprocess.run(["ip", "netns", "exec", str(net.namespaces[n]), "cat",
                                f"/sys/class/net/{net.iface[n]}/operstate"],
                               capture_output=True, text=True, timeout=10)
            states.append(r.stdout.strip())
        if all(s == "up" for s in states):
            return
        time.sleep(0.1)
