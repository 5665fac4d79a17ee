"""Raw NIXL and Mooncake WRITE throughput between two processes versus an in-process memcpy.

Run: ``python benchmarks/bench_transfer.py [--sizes-mib 1 4 16 64] [--repeat 20]
[--modes shm noshm mooncake] [--json out.json]``.

Modes: ``shm`` is ``NixlEndpoint(shm=True)`` (UCX error handling ``none``), ``noshm`` is
``shm=False`` (UCX default ``peer``), ``mooncake`` is a ``MooncakeEndpoint`` (the Mooncake
transfer engine, TCP unless ``TWIN_MOONCAKE_PROTOCOL`` says otherwise, one blocking
``batch_transfer_sync_write`` per WRITE; needs the ``mooncake`` extra and the system's
libibverbs; with ``--device cuda`` an engine built with CUDA, which registers the VRAM). On one host both move bulk data with CMA; set
``UCX_TLS=tcp`` in the environment to measure a TCP-only path instead (on a host with NVIDIA GPUs
NIXL rejects a ``UCX_TLS`` without CUDA support: use ``UCX_TLS=tcp,cuda_copy``).

On CUDA, buffers are zeroed or filled by kernels on torch's stream while the WRITE reads and
lands through UCX's own CUDA stream or copy engine, so every fill is followed by a device
synchronize before its bytes are written or its metadata is sent.

:func:`measure_raw_write` is the baseline the staged-chunk benchmark reuses: one WRITE of
``n`` contiguous bytes from a registered source in this process into a registered buffer
of a spawned target process, timed from posting (descriptor creation included) until the
initiator observes ``DONE``; the target checks every byte of the last WRITE against a
position-dependent pattern (:func:`pattern`), so a piece landed at the wrong offset fails. :func:`measure_memcpy` times ``dst.copy_(src)`` of the same
bytes within one process.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from twin.hw.control import BootstrapInfo, ControlSocket, exchange_bootstrap
from twin.hw.nixl_transport import NixlEndpoint


def _endpoint(name: str, mode: str) -> Any:
    """The endpoint of ``mode``: NIXL with or without shm, or the Mooncake engine."""
    if mode == "mooncake":
        from twin.hw.mooncake_transport import MooncakeEndpoint

        return MooncakeEndpoint(name, workers=1)
    return NixlEndpoint(name, shm=mode == "shm")

MIB = 1 << 20
DEFAULT_SIZES = (1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB)


def _stats(nbytes: int, seconds: Sequence[float]) -> dict[str, float]:
    med = statistics.median(seconds)
    best = min(seconds)
    return {
        "seconds_median": med,
        "seconds_best": best,
        "gbps_median": nbytes / med / 1e9,
        "gbps_best": nbytes / best / 1e9,
    }


def pattern(n: int, value: int, device: torch.device | str) -> torch.Tensor:
    """``n`` bytes that depend on their offset and on ``value``: a 4099-byte period (prime,
    so no power-of-two piece of a WRITE matches another offset's bytes)."""
    period = torch.arange(4099, dtype=torch.int32, device=device)
    tile = ((period * 131 + value * 7) % 251).to(torch.uint8)
    return tile.repeat(-(-n // 4099))[:n]


def _settle(t: torch.Tensor) -> None:
    """Wait for the kernels queued on ``t``'s device (no-op on CPU)."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def _bench_target(parent_ep: str, name: str, mode: str, device: str, nbytes: int) -> None:
    """Target rank: expose one buffer, answer CHECK (value fill test) until STOP."""
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    _settle(buf)  # zero before the initiator learns where to write
    with ControlSocket() as cs, _endpoint(name, mode) as ep:
        region = ep.register(buf)
        info = BootstrapInfo(name, cs.endpoint, ep.metadata(), (region,))
        peer = exchange_bootstrap(cs, parent_ep, info, timeout_s=60)
        ep.add_peer(peer.metadata)
        while True:
            frames = cs.recv_frames(60_000)
            if frames is None or frames[0] == b"STOP":
                break
            if frames[0] == b"CHECK":
                n, value = int(frames[1]), int(frames[2])
                ok = torch.equal(buf[:n], pattern(n, value, buf.device))
                cs.send(peer.endpoint, [b"CHECKED", b"1" if ok else b"0"])
        cs.close(linger_ms=1000)


def measure_raw_write(
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeat: int = 20,
    *,
    shm: bool = True,
    device: str = "cpu",
    warmup: int = 3,
    mode: str | None = None,
) -> dict[int, dict[str, float]]:
    """Time single WRITEs of each size into a spawned target process (``mode``: ``shm``,
    ``noshm`` or ``mooncake``; default from ``shm``).

    Returns ``{nbytes: {"seconds_median", "seconds_best", "gbps_median", "gbps_best"}}``
    (GB/s = 1e9 bytes/s). Each size gets ``warmup`` untimed writes, then ``repeat`` timed
    ones; the target verifies the last write's bytes and a mismatch raises
    ``RuntimeError``. The target process is always stopped before returning.
    """
    if not sizes or repeat < 1:
        raise ValueError("need at least one size and repeat >= 1")
    max_bytes = max(sizes)
    mode = mode or ("shm" if shm else "noshm")
    tag = f"{mode}-{os.getpid()}-{time.monotonic_ns()}"
    ctx = mp.get_context("spawn")
    results: dict[int, dict[str, float]] = {}
    with ControlSocket() as cs, _endpoint(f"bench-init-{tag}", mode) as ep:
        src = torch.zeros(max_bytes, dtype=torch.uint8, device=device)
        ep.register(src)
        proc = ctx.Process(
            target=_bench_target,
            args=(cs.endpoint, f"bench-target-{tag}", mode, device, max_bytes),
            daemon=True,
        )
        proc.start()
        try:
            me = BootstrapInfo(ep.name, cs.endpoint, ep.metadata())
            peer_info = exchange_bootstrap(cs, None, me, timeout_s=60)
            peer = ep.add_peer(peer_info.metadata)
            region = peer_info.regions[0]
            if mode != "mooncake":
                ep.connect(peer)
            for i, n in enumerate(sizes):
                value = 1 + i % 250
                src[:n].copy_(pattern(n, value, src.device))
                _settle(src)  # the WRITE reads src outside torch's stream
                samples: list[float] = []
                for k in range(warmup + repeat):
                    t0 = time.perf_counter()
                    h = ep.write(src, peer, region, 0, n)
                    ep.wait(h, timeout_s=60)
                    dt = time.perf_counter() - t0
                    ep.release(h)
                    if k >= warmup:
                        samples.append(dt)
                cs.send(peer_info.endpoint, [b"CHECK", str(n).encode(), str(value).encode()])
                reply = None
                deadline = time.monotonic() + 30
                while reply is None and time.monotonic() < deadline:
                    frames = cs.recv_frames(1000)
                    if frames and frames[0] == b"CHECKED":
                        reply = frames[1]
                if reply != b"1":
                    raise RuntimeError(f"target saw wrong bytes after {n} B writes")
                results[n] = _stats(n, samples)
            cs.send(peer_info.endpoint, [b"STOP"], timeout_ms=1000)
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    return results


def measure_memcpy(
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeat: int = 20,
    *,
    device: str = "cpu",
    warmup: int = 3,
    threads: int | None = 1,
) -> dict[int, dict[str, float]]:
    """Time ``dst[:n].copy_(src[:n])`` within this process; same result shape as above.

    ``threads`` pins torch's intra-op thread count while measuring (``None`` keeps it). The
    default of 1 matches NIXL's single-threaded copy and avoids thread-pool wake-up noise.
    """
    max_bytes = max(sizes)
    src = torch.ones(max_bytes, dtype=torch.uint8, device=device)
    dst = torch.zeros(max_bytes, dtype=torch.uint8, device=device)
    sync = torch.cuda.synchronize if dst.is_cuda else (lambda: None)
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    results: dict[int, dict[str, float]] = {}
    try:
        for n in sizes:
            samples: list[float] = []
            for k in range(warmup + repeat):
                sync()
                t0 = time.perf_counter()
                dst[:n].copy_(src[:n])
                sync()
                dt = time.perf_counter() - t0
                if k >= warmup:
                    samples.append(dt)
            results[n] = _stats(n, samples)
    finally:
        torch.set_num_threads(saved)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--modes", nargs="+", choices=["shm", "noshm", "mooncake"],
                    default=["shm", "noshm"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--copy-threads", type=int, default=1, help="torch threads for memcpy")
    ap.add_argument("--json", type=Path, help="also write the raw numbers here")
    args = ap.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    sizes = [int(s * MIB) for s in args.sizes_mib]

    copy = measure_memcpy(sizes, args.repeat, device=args.device, threads=args.copy_threads)
    report: dict[str, Any] = {"memcpy": copy, "repeat": args.repeat, "device": args.device}
    print(
        f"repeat={args.repeat} device={args.device} cpus={os.cpu_count()} "
        f"copy_threads={args.copy_threads}"
    )
    header = (
        f"{'mode':<8} {'size':>8} | {'write med':>9} {'best':>6} | {'memcpy med':>10} {'best':>6}"
        f" | {'ratio med':>9} {'best':>6}"
    )
    print(header)
    print("-" * len(header))
    if "mooncake" in args.modes:
        from twin.hw.mooncake_transport import mooncake_protocol

        report["mooncake_protocol"] = mooncake_protocol()
    for mode in args.modes:
        raw = measure_raw_write(sizes, args.repeat, mode=mode, device=args.device)
        report[mode] = raw
        for n in sizes:
            r, c = raw[n], copy[n]
            print(
                f"{mode:<8} {n / MIB:>5.0f}MiB | {r['gbps_median']:>9.2f} {r['gbps_best']:>6.2f} | "
                f"{c['gbps_median']:>10.2f} {c['gbps_best']:>6.2f} | "
                f"{r['gbps_median'] / c['gbps_median']:>9.2f} "
                f"{r['gbps_best'] / c['gbps_best']:>6.2f}"
            )
    print("GB/s = 1e9 B/s; ratio = write / memcpy (shm, noshm: NIXL; mooncake: Mooncake "
          f"{report.get('mooncake_protocol', 'tcp')})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
