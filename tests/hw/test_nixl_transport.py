"""NixlEndpoint against a real second process: real NIXL agents, real zmq bootstrap."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")
pytest.importorskip("zmq")

from twin.hw.control import BootstrapInfo, ControlError, ControlSocket, exchange_bootstrap  # noqa: E402
from twin.hw.nixl_transport import (  # noqa: E402
    NixlEndpoint,
    RegionDesc,
    TransferBoundsError,
    TransferError,
    TransferTimeout,
)

pytestmark = pytest.mark.hw

TARGET_BYTES = 8 << 20
SOURCE_BYTES = 4 << 20
JOIN_S = 10.0


def _pattern(n: int, seed: int) -> Any:
    return ((torch.arange(n, dtype=torch.int64) * 131 + seed) % 251).to(torch.uint8)


def _settle(t: Any) -> None:
    """Wait for kernels queued on ``t``'s GPU: a WRITE reads and lands outside torch's stream."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def _verify(buf: Any, spec: dict[str, Any]) -> dict[str, Any]:
    off, n, seed = int(spec["off"]), int(spec["n"]), int(spec["seed"])
    host = buf.cpu()
    ok = bool(torch.equal(host[off : off + n], _pattern(n, seed)))
    before = off == 0 or int(host[off - 1]) == 0
    after = off + n >= host.numel() or int(host[off + n]) == 0
    return {"tag": spec.get("tag"), "ok": ok, "outside_zero": before and after}


def _target_main(parent_ep: str, name: str, shm: bool, device: str, size: int) -> None:
    """Target rank: register a zeroed buffer, bootstrap, then verify on request."""
    buf = torch.zeros(size, dtype=torch.uint8, device=device)
    _settle(buf)
    with ControlSocket() as cs, NixlEndpoint(name, shm=shm) as ep:
        region = ep.register(buf)
        info = BootstrapInfo(name, cs.endpoint, ep.metadata(), (region,), {"pid": os.getpid()})
        peer = exchange_bootstrap(cs, parent_ep, info, timeout_s=30)
        ep.add_peer(peer.metadata)
        while True:
            for src, msg in ep.get_notifs():
                if msg.startswith(b"verify|"):
                    res = _verify(buf, json.loads(msg[len(b"verify|") :]))
                    res["from"] = src
                    cs.send(peer.endpoint, [b"RESULT", json.dumps(res).encode()])
            frames = cs.recv_frames(2)
            if frames is None:
                continue
            if frames[0] == b"CHECK":
                res = _verify(buf, json.loads(frames[1]))
                cs.send(peer.endpoint, [b"RESULT", json.dumps(res).encode()])
            elif frames[0] == b"RESET":
                buf.zero_()
                _settle(buf)
                cs.send(peer.endpoint, [b"ACK"])
            elif frames[0] == b"STOP":
                break
        cs.close(linger_ms=1000)


@dataclass
class Rig:
    ep: NixlEndpoint
    cs: ControlSocket
    src: Any
    peer: str
    peer_ctl: str
    region: RegionDesc
    pid: int
    proc: Any

    def expect(self, kind: bytes, timeout_s: float = 10.0) -> list[bytes]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            frames = self.cs.recv_frames(100)
            if frames and frames[0] == kind:
                return frames
        raise TimeoutError(f"no {kind!r} from target")

    def reset(self) -> None:
        self.cs.send(self.peer_ctl, [b"RESET"])
        self.expect(b"ACK")

    def check(self, spec: dict[str, Any]) -> dict[str, Any]:
        self.cs.send(self.peer_ctl, [b"CHECK", json.dumps(spec).encode()])
        return json.loads(self.expect(b"RESULT")[1])


def _stop_process(proc: Any) -> None:
    proc.join(JOIN_S)
    if proc.is_alive():
        proc.terminate()
        proc.join(JOIN_S)
    if proc.is_alive():
        proc.kill()
        proc.join(JOIN_S)


@contextlib.contextmanager
def spawn_target(shm: bool, device: str = "cpu", tag: str = "") -> Iterator[Rig]:
    """Start a target rank, bootstrap with it, yield the initiator side; always clean up."""
    mode = f"{'shm' if shm else 'noshm'}-{device}{tag}"
    ctx = mp.get_context("spawn")
    cs = ControlSocket()
    ep = NixlEndpoint(f"init-{mode}", shm=shm)
    proc = ctx.Process(
        target=_target_main,
        args=(cs.endpoint, f"target-{mode}", shm, device, TARGET_BYTES),
        daemon=True,
    )
    peer: BootstrapInfo | None = None
    try:
        src = torch.zeros(SOURCE_BYTES, dtype=torch.uint8, device=device)
        _settle(src)
        ep.register(src)
        proc.start()
        peer = exchange_bootstrap(cs, None, BootstrapInfo(ep.name, cs.endpoint, ep.metadata()), 60)
        name = ep.add_peer(peer.metadata)
        assert name == peer.name
        rig = Rig(ep, cs, src, name, peer.endpoint, peer.regions[0], int(peer.extra["pid"]), proc)
        yield rig
    finally:
        if proc.pid is not None:
            if proc.is_alive() and peer is not None:
                with contextlib.suppress(ControlError):
                    cs.send(peer.endpoint, [b"STOP"], timeout_ms=1000)
            _stop_process(proc)
        ep.close()
        cs.close()


def _devices() -> list[Any]:
    cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    return [
        pytest.param((True, "cpu"), id="shm-cpu"),
        pytest.param((False, "cpu"), id="noshm-cpu"),
        pytest.param((True, "cuda"), id="shm-cuda", marks=cuda),
    ]


class TargetPool:
    """Live targets keyed by ``(shm, device)``, shared by the tests of this module.

    A target whose process died is replaced on the next :meth:`get`; ``untouched=True``
    replaces one that a test has already written to.
    """

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack = stack
        self._rigs: dict[tuple[bool, str], tuple[Rig, list[bool]]] = {}
        self._spawned = 0

    def get(self, shm: bool, device: str = "cpu", *, untouched: bool = False) -> Rig:
        entry = self._rigs.get((shm, device))
        if entry is None or not entry[0].proc.is_alive() or (untouched and entry[1][0]):
            self._spawned += 1
            rig = self._stack.enter_context(spawn_target(shm, device, tag=f"-{self._spawned}"))
            entry = (rig, [False])
            self._rigs[(shm, device)] = entry
        entry[1][0] = True
        return entry[0]


@pytest.fixture(scope="module")
def targets() -> Iterator[TargetPool]:
    with contextlib.ExitStack() as stack:
        yield TargetPool(stack)


@pytest.fixture(params=_devices())
def rig(request: pytest.FixtureRequest, targets: TargetPool) -> Rig:
    shm, device = request.param
    return targets.get(shm, device)


def _fill(rig: Rig, lo: int, n: int, seed: int) -> None:
    rig.src[lo : lo + n].copy_(_pattern(n, seed).to(rig.src.device))
    _settle(rig.src)


def _wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(1e-3)
    raise TimeoutError(f"process {pid} did not stop")


def test_stalled_peer_times_out(targets: TargetPool) -> None:
    """Without shm the first write needs the target's progress thread (TCP wire-up), so a
    SIGSTOPped fresh target keeps it in PROC until the target runs again."""
    rig = targets.get(False, untouched=True)
    os.kill(rig.pid, signal.SIGSTOP)
    try:
        _wait_stopped(rig.pid)
        _fill(rig, 0, 1 << 20, seed=11)
        h = rig.ep.write(rig.src, rig.peer, rig.region, 0, 1 << 20)
        assert rig.ep.poll(h) == "PROC"
        with pytest.raises(TransferTimeout, match="still in progress"):
            rig.ep.wait(h, timeout_s=0.3)
        assert rig.ep.poll(h) == "PROC"
    finally:
        os.kill(rig.pid, signal.SIGCONT)
    rig.ep.wait(h, timeout_s=10)
    rig.ep.release(h)
    rig.reset()  # leave the shared target zeroed for the next tests


def test_region_desc_matches_target_buffer(rig: Rig) -> None:
    assert rig.region.agent == rig.peer
    assert rig.region.length == TARGET_BYTES
    assert rig.region.mem == ("VRAM" if rig.src.is_cuda else "DRAM")


def test_subrange_write_lands_and_notifies(rig: Rig) -> None:
    rig.reset()
    lo, off, n = 4096 + 17, 1 << 20 | 333, (1 << 20) + 5
    _fill(rig, lo, n, seed=7)
    spec = {"off": off, "n": n, "seed": 7, "tag": "a"}
    h = rig.ep.write(
        rig.src[lo : lo + n], rig.peer, rig.region, off, n, b"verify|" + json.dumps(spec).encode()
    )
    rig.ep.wait(h, timeout_s=10)
    assert rig.ep.poll(h) == "DONE" and h.elapsed_s is not None
    rig.ep.release(h)
    rig.ep.release(h)  # idempotent
    assert h.released and rig.ep.outstanding == 0
    res = json.loads(rig.expect(b"RESULT")[1])
    assert res == {"tag": "a", "ok": True, "outside_zero": True, "from": rig.ep.name}


def test_write_from_raw_range_without_notification(rig: Rig) -> None:
    rig.reset()
    lo, off, n = 123, TARGET_BYTES - 4099, 4099  # ends exactly at the region end
    _fill(rig, lo, n, seed=3)
    h = rig.ep.write((rig.src.data_ptr() + lo, n), rig.peer, rig.region, off, n)
    rig.ep.wait(h, timeout_s=10)
    rig.ep.release(h)
    assert rig.check({"off": off, "n": n, "seed": 3}) == {
        "tag": None,
        "ok": True,
        "outside_zero": True,
    }


def test_many_writes_in_flight(rig: Rig) -> None:
    rig.reset()
    chunk, gap = 256 << 10, 4096
    handles = []
    for i in range(8):
        _fill(rig, i * chunk, chunk, seed=i)
        src = rig.src[i * chunk : (i + 1) * chunk]
        handles.append(rig.ep.write(src, rig.peer, rig.region, i * (chunk + gap), chunk))
    deadline = time.monotonic() + 10
    while any(rig.ep.poll(h) == "PROC" for h in handles):
        assert time.monotonic() < deadline, "writes did not finish"
        time.sleep(1e-3)
    assert [rig.ep.poll(h) for h in handles] == ["DONE"] * 8
    for h in handles:
        rig.ep.release(h)
    for i in range(8):
        res = rig.check({"off": i * (chunk + gap), "n": chunk, "seed": i})
        assert res["ok"] and res["outside_zero"], i


def test_a_write_in_blocks_lands_each_block_at_its_offset(rig: Rig) -> None:
    """A PP stage's WRITE is one descriptor per layer slot (``blocks``): each lands at its own
    remote offset, in any order, and nothing between them is touched; a block outside the
    bytes written or the region is refused before anything is posted."""
    rig.reset()
    base, n = 1 << 20, 64 << 10
    blocks = [(0, 3 * n, n), (n, 0, n), (2 * n, 6 * n, n)]  # (local, remote, length)
    for i, (lo, _, length) in enumerate(blocks):
        _fill(rig, lo, length, seed=20 + i)
    h = rig.ep.write(rig.src, rig.peer, rig.region, base, 3 * n, blocks=blocks)
    rig.ep.wait(h, timeout_s=10)
    rig.ep.release(h)
    for i, (_, ro, length) in enumerate(blocks):
        res = rig.check({"off": base + ro, "n": length, "seed": 20 + i})
        assert res["ok"] and res["outside_zero"], (i, res)
    with pytest.raises(TransferBoundsError, match="outside the 131072 B being written"):
        rig.ep.write(rig.src, rig.peer, rig.region, 0, 2 * n, blocks=[(n, 0, 2 * n)])
    with pytest.raises(TransferBoundsError, match="outside the"):
        rig.ep.write(rig.src, rig.peer, rig.region, TARGET_BYTES - n, n,
                     blocks=[(0, n, n)])
    with pytest.raises(TransferBoundsError, match="blocks of"):
        rig.ep.write(rig.src, rig.peer, rig.region, 0, 2 * n, blocks=[(0, 0, n)])
    assert rig.ep.outstanding == 0


def test_out_of_range_requests_rejected_before_posting(rig: Rig) -> None:
    ep, r = rig.ep, rig.region
    with pytest.raises(TransferBoundsError, match="outside"):
        ep.write(rig.src, rig.peer, r, TARGET_BYTES - 10, 11)
    with pytest.raises(TransferBoundsError):
        ep.write(rig.src, rig.peer, r, -1, 10)
    with pytest.raises(TransferBoundsError):
        ep.write(rig.src, rig.peer, r, 0, 0)
    with pytest.raises(TransferBoundsError, match="local source"):
        ep.write(rig.src[:10], rig.peer, r, 0, 11)
    unregistered = torch.zeros(64, dtype=torch.uint8, device=rig.src.device)
    with pytest.raises(TransferBoundsError, match="not inside a region"):
        ep.write(unregistered, rig.peer, r, 0, 64)
    with pytest.raises(TransferError, match="unknown peer"):
        ep.write(rig.src, "nobody", r, 0, 64)
    with pytest.raises(ValueError, match="empty notification"):
        ep.write(rig.src, rig.peer, r, 0, 64, b"")
    assert ep.outstanding == 0


def test_forged_region_refused_by_nixl(rig: Rig) -> None:
    """Bounds the wrapper cannot know about are still enforced by NIXL at posting."""
    r = rig.region
    forged = RegionDesc(r.agent, r.addr, r.length + (1 << 20), r.mem, r.dev_id)
    with pytest.raises(TransferError, match="NIXL refused") as ei:
        rig.ep.write(rig.src, rig.peer, forged, r.length - 100, 4096)
    assert not isinstance(ei.value, TransferBoundsError)
    assert rig.ep.outstanding == 0


def test_dead_peer_errors(targets: TargetPool) -> None:
    """Writing to a killed target fails with TransferError (at posting, in practice)."""
    rig = targets.get(False)
    os.kill(rig.pid, signal.SIGKILL)
    rig.proc.join(JOIN_S)
    with pytest.raises(TransferError):
        h = rig.ep.write(rig.src, rig.peer, rig.region, 0, 1 << 20)
        rig.ep.wait(h, timeout_s=10)


def test_close_is_idempotent_and_final() -> None:
    t = torch.zeros(1 << 16, dtype=torch.uint8)
    with NixlEndpoint("solo-close") as ep:
        r = ep.register(t)
        assert ep.regions == [r] and r.addr == t.data_ptr() and r.mem == "DRAM"
        assert isinstance(ep.metadata(), bytes)
        ep.close()
        ep.close()
        assert ep.closed and ep.regions == []
        with pytest.raises(TransferError, match="closed"):
            ep.register(t)
    ep.close()


def test_deregister_and_noncontiguous() -> None:
    with NixlEndpoint("solo-dereg", shm=False) as ep:
        t = torch.zeros((64, 64), dtype=torch.uint8)
        r = ep.register(t)
        ep.deregister(r)
        with pytest.raises(KeyError):
            ep.deregister(r)
        with pytest.raises(ValueError, match="contiguous"):
            ep.register(t.t())
        with pytest.raises(ValueError, match="empty"):
            ep.register(torch.zeros(0, dtype=torch.uint8))


def test_region_desc_json_round_trip() -> None:
    r = RegionDesc("a", 0x7F0000001000, 4096, "VRAM", 3)
    assert RegionDesc.from_json(r.to_json()) == r
    assert RegionDesc.from_json(r.to_json().encode()) == r
    assert r.contains(r.addr + 4095, 1) and not r.contains(r.addr + 4095, 2)
    for bad in (
        "",
        "[]",
        "{}",
        '{"agent":"a","addr":1,"length":0,"mem":"DRAM","dev_id":0}',
        '{"agent":"a","addr":1,"length":1,"mem":"HBM","dev_id":0}',
        "\xff",
    ):
        with pytest.raises(ValueError):
            RegionDesc.from_json(bad)


def test_in_process_pair_and_wait_notif() -> None:
    """Two endpoints in one process: notifications are matched by prefix and none is lost."""
    dst = torch.zeros(1 << 16, dtype=torch.uint8)
    src = _pattern(1 << 16, 5)
    with NixlEndpoint("pair-a") as a, NixlEndpoint("pair-b") as b:
        a.register(src)
        region = b.register(dst)
        assert a.add_peer(b.metadata()) == "pair-b"
        assert b.add_peer(a.metadata()) == "pair-a"
        for i, tag in enumerate((b"other-1", b"want", b"other-2")):
            h = a.write(src[i * 1000 :], "pair-b", region, i * 1000, 1000, tag)
            a.wait(h, timeout_s=10)
            a.release(h)
        assert b.wait_notif(b"want", timeout_s=10) == ("pair-a", b"want")
        with pytest.raises(TimeoutError):
            b.wait_notif(b"want", timeout_s=0.05)
        others: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(others) < 2 and time.monotonic() < deadline:
            others += [m for _, m in b.get_notifs()]
        assert sorted(others) == [b"other-1", b"other-2"]
        assert b.get_notifs() == []
        assert torch.equal(dst[:3000], src[:3000])
        assert a.outstanding == 0


def _thread_cpu_ticks() -> dict[str, int]:
    """CPU clock ticks (user + system) of each of this process's threads, by thread id."""
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks[tid] = int(fields[11]) + int(fields[12])
    return ticks


def test_an_idle_shm_endpoint_takes_no_cpu() -> None:
    """NIXL's progress thread spins without pause; an ``shm`` endpoint whose peers are all on
    this host runs without it (its writes complete on the initiator's polls), so an idle rank
    takes no core from the others.
    Only the threads the endpoint started are counted (an earlier test's ``noshm`` agents may
    still spin in this process). With the thread, it used about one CPU second per second."""
    t = torch.zeros(1 << 16, dtype=torch.uint8)
    before = set(_thread_cpu_ticks())
    hz = os.sysconf("SC_CLK_TCK")
    with NixlEndpoint("idle-cpu", progress_thread=False) as ep:
        ep.register(t)
        start, wall0 = _thread_cpu_ticks(), time.monotonic()
        time.sleep(1.0)
        end, wall = _thread_cpu_ticks(), time.monotonic() - wall0
    mine = [tid for tid in end if tid not in before]  # a progress thread would be new
    cpu = sum(end[tid] - start.get(tid, 0) for tid in mine) / hz
    assert cpu < 0.2 * wall, (cpu, wall)
