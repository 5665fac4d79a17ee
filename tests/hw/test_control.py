"""ControlSocket and the twin bootstrap over real zmq sockets and a spawned process."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")

from twin.hw.control import (  # noqa: E402
    BOOTSTRAP_TAG,
    BootstrapInfo,
    ControlError,
    ControlSocket,
    decode_bootstrap,
    encode_bootstrap,
    exchange_bootstrap,
    recv_bootstrap,
)
from twin.hw.netutil import free_port, loopback_endpoint, parse_tcp_endpoint  # noqa: E402
from twin.hw.nixl_transport import RegionDesc  # noqa: E402

pytestmark = pytest.mark.hw

JOIN_S = 10.0
BIG = bytes(range(256)) * 4096  # 1 MiB


def _echo_main(parent_ep: str, rounds: int) -> None:
    """Announce ourselves, then echo every message back with an ``ECHO`` frame in front."""
    with ControlSocket() as cs:
        cs.send(parent_ep, [b"HELLO", cs.endpoint.encode()])
        for _ in range(rounds):
            frames = cs.recv_frames(10_000)
            if frames is None:
                break
            cs.send(parent_ep, [b"ECHO", *frames])
        cs.close(linger_ms=1000)


def _bootstrap_main(parent_ep: str) -> None:
    """Send junk around a valid bootstrap, then do the exchange properly."""
    region = RegionDesc("child", 0x1000, 4096, "DRAM", 0)
    info = BootstrapInfo("child", "", b"\x00meta\xff", (region,), {"rank": 1})
    with ControlSocket() as cs:
        info = BootstrapInfo(info.name, cs.endpoint, info.metadata, info.regions, info.extra)
        cs.send(parent_ep, [BOOTSTRAP_TAG])
        cs.send(parent_ep, [BOOTSTRAP_TAG, b"\xff\xfe", b"{", b""])
        cs.send(parent_ep, [BOOTSTRAP_TAG, b"child", b'{"endpoint": 5}', b""])
        cs.send(parent_ep, [b"STAGING", b"\x01\x02"])
        peer = exchange_bootstrap(cs, parent_ep, info, timeout_s=10)
        cs.send(parent_ep, [b"GOT", peer.name.encode(), peer.metadata])
        cs.close(linger_ms=1000)


@pytest.fixture
def spawn() -> Iterator[Any]:
    procs: list[Any] = []
    ctx = mp.get_context("spawn")

    def start(target: Any, *args: Any) -> Any:
        p = ctx.Process(target=target, args=args, daemon=True)
        p.start()
        procs.append(p)
        return p

    try:
        yield start
    finally:
        for p in procs:
            p.join(JOIN_S)
            if p.is_alive():
                p.terminate()
                p.join(JOIN_S)
            if p.is_alive():
                p.kill()
                p.join(JOIN_S)


def test_multipart_round_trip_across_processes(spawn: Any) -> None:
    with ControlSocket() as cs:
        proc = spawn(_echo_main, cs.endpoint, 3)
        hello = cs.recv_frames(20_000)
        assert hello is not None and hello[0] == b"HELLO"
        child = hello[1].decode()
        messages = [[b"a", b"", b"\x00\xff"], [BIG], [b"x" * 3, b"y"]]
        for m in messages:
            cs.send(child, m)
        got = [cs.recv(10_000) for _ in messages]
        assert got == [[b"ECHO", *m] for m in messages]
        proc.join(JOIN_S)
        assert proc.exitcode == 0


def test_recv_timeouts() -> None:
    with ControlSocket() as cs:
        assert cs.recv_frames(0) is None
        t0 = time.monotonic()
        assert cs.recv_frames(150) is None
        assert 0.1 <= time.monotonic() - t0 < 2.0


def test_send_to_unreachable_peer_times_out() -> None:
    with ControlSocket() as cs:
        dead = loopback_endpoint(free_port())
        t0 = time.monotonic()
        with pytest.raises(ControlError, match="timed out"):
            cs.send(dead, [b"x"], timeout_ms=200)
        assert time.monotonic() - t0 < 2.0
        with pytest.raises(ValueError):
            cs.send(dead, [])


def test_self_send_explicit_bind_and_unread() -> None:
    port = free_port()
    with ControlSocket(bind=loopback_endpoint(port)) as cs:
        assert parse_tcp_endpoint(cs.endpoint) == ("127.0.0.1", port)
        cs.send(cs.endpoint, [b"one"])
        cs.send(cs.endpoint, [b"two"])
        first = cs.recv_frames(5000)
        assert first == [b"one"]
        cs.unread([first, [b"zero"]])
        assert [cs.recv_frames(5000) for _ in range(3)] == [[b"one"], [b"zero"], [b"two"]]


def test_prefetch_frames_ride_their_own_socket_and_context() -> None:
    """SGLang's prefill sends STAGING_REQ on a prefetch PUSH socket in a context of its own;
    the rank's other frames share the cached control socket. Both reach the same PULL socket."""
    with ControlSocket() as a, ControlSocket() as b:
        a.send(b.endpoint, [b"STAGING_REQ"], socket="prefetch")
        a.send(b.endpoint, [b"CHUNK_READY"])
        got = sorted(tuple(b.recv_frames(5000) or ()) for _ in range(2))
        assert got == [(b"CHUNK_READY",), (b"STAGING_REQ",)]
        prefetch = a._push[(b.endpoint, "prefetch")]
        control = a._push[(b.endpoint, "control")]
        assert prefetch is not control and prefetch.context is not control.context


def test_close_terminates_private_context() -> None:
    cs = ControlSocket()
    cs.send(cs.endpoint, [b"queued"])
    ctx = cs.context
    cs.close()
    cs.close()
    assert cs.closed and ctx.closed
    with pytest.raises(ControlError):
        cs.recv_frames(0)
    with pytest.raises(ControlError):
        cs.send(cs.endpoint, [b"x"])


def test_close_with_shared_context_lets_term_return() -> None:
    ctx = zmq.Context()
    a = ControlSocket(context=ctx)
    b = ControlSocket(context=ctx)
    a.send(b.endpoint, [b"hi"])
    assert b.recv_frames(5000) == [b"hi"]
    a.close()
    b.close()
    assert not ctx.closed
    done = threading.Event()
    t = threading.Thread(target=lambda: (ctx.term(), done.set()), daemon=True)
    t.start()
    t.join(5.0)
    assert done.is_set(), "zmq context term() blocked: a socket was left open"


def test_decode_bootstrap_is_tolerant() -> None:
    region = RegionDesc("r", 0x2000, 64, "VRAM", 1)
    info = BootstrapInfo("r", "tcp://127.0.0.1:9", b"\x00\x01", (region,), {"k": [1, 2]})
    assert decode_bootstrap(encode_bootstrap(info)) == info
    good = encode_bootstrap(info)
    bad: list[list[bytes]] = [
        [],
        [BOOTSTRAP_TAG],
        good[:3],
        [*good, b"extra"],
        [b"OTHER", *good[1:]],
        [BOOTSTRAP_TAG, b"", good[2], good[3]],
        [BOOTSTRAP_TAG, b"\xff", good[2], good[3]],
        [BOOTSTRAP_TAG, b"r", b"not json", good[3]],
        [BOOTSTRAP_TAG, b"r", b"[1]", good[3]],
        [BOOTSTRAP_TAG, b"r", b'{"regions": []}', good[3]],
        [BOOTSTRAP_TAG, b"r", b'{"endpoint": "e", "regions": [{"agent": "r"}]}', good[3]],
        [BOOTSTRAP_TAG, b"r", b'{"endpoint": "e", "regions": {}}', good[3]],
        [BOOTSTRAP_TAG, b"r", b'{"endpoint": "e", "extra": 3}', good[3]],
        [BOOTSTRAP_TAG, b"r", b"[" * 100_000, good[3]],
    ]
    for frames in bad:
        assert decode_bootstrap(frames) is None, frames


def test_bootstrap_exchange_skips_junk_and_keeps_other_traffic(spawn: Any) -> None:
    with ControlSocket() as cs:
        proc = spawn(_bootstrap_main, cs.endpoint)
        mine = BootstrapInfo("parent", cs.endpoint, b"parent-meta")
        peer = exchange_bootstrap(cs, None, mine, timeout_s=20)
        assert peer.name == "child" and peer.metadata == b"\x00meta\xff"
        assert peer.regions == (RegionDesc("child", 0x1000, 4096, "DRAM", 0),)
        assert peer.extra == {"rank": 1}
        assert cs.recv_frames(5000) == [b"STAGING", b"\x01\x02"]
        assert cs.recv_frames(5000) == [b"GOT", b"parent", b"parent-meta"]
        proc.join(JOIN_S)
        assert proc.exitcode == 0


def test_recv_bootstrap_times_out_and_filters_by_name() -> None:
    with ControlSocket() as cs:
        assert recv_bootstrap(cs, 0.1) is None
        other = BootstrapInfo("other", cs.endpoint, b"m")
        cs.send(cs.endpoint, encode_bootstrap(other))
        assert recv_bootstrap(cs, 0.3, name="wanted") is None
        assert recv_bootstrap(cs, 1.0, name="other") == other
        with pytest.raises(TimeoutError):
            exchange_bootstrap(cs, None, other, timeout_s=0.1)


def test_netutil_helpers() -> None:
    port = free_port()
    assert 0 < port < 65536
    assert loopback_endpoint(port) == f"tcp://127.0.0.1:{port}"
    for bad in ("udp://x:1", "tcp://x", "tcp://:1", "tcp://x:99999", "tcp://x:abc"):
        with pytest.raises(ValueError):
            parse_tcp_endpoint(bad)
    with pytest.raises(ValueError):
        loopback_endpoint(0)
