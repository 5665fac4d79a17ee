"""A staged chunk end to end versus a raw WRITE of the same bytes, between two processes.

Staged = what a prefill transfer worker does for one chunk in the hardware mode: gather the
writer's head slice of every layer's K and V from scattered KV pages into its staging buffer
(torch kernel), then one NIXL WRITE into the decode ring, polled until DONE. The baseline is
``measure_raw_write`` (bench_transfer.py): the same number of bytes, already contiguous, written
between two processes in the same run. The decode-side scatter is timed separately, in process,
against a plain copy of the same bytes; on CUDA both are timed with CUDA events around the
kernels (after a synchronize), so the numbers are kernel time, not launch time.

``--backend mooncake`` does both WRITEs with the Mooncake transfer engine (TCP, blocking
``batch_transfer_sync_write``) instead of NIXL.

Run: ``python benchmarks/bench_staged.py [--sizes-mib 4 16 64] [--repeat 10] [--device cpu]
[--kernels auto|torch|triton] [--backend nixl|mooncake] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_transfer import _bench_target, _endpoint, _settle, measure_raw_write

from twin.hw.control import BootstrapInfo, ControlSocket, exchange_bootstrap
from twin.hw.kernels import get_kernels
from twin.hw.pools import KVPool

MIB = 1 << 20
LAYERS, HEADS, HEAD_DIM, PAGE = 8, 8, 128, 16
BYTES_PER_TOKEN = LAYERS * HEADS * HEAD_DIM * 2 * 2  # K and V, bf16


def _pool(tokens: int, device: torch.device) -> tuple[KVPool, list[int]]:
    pages = tokens // PAGE
    pool = KVPool(LAYERS, pages * 2, PAGE, HEADS, HEAD_DIM, torch.bfloat16, device)
    chosen = pool.alloc(0, pages)
    chosen = chosen[::2] + chosen[1::2]  # non-contiguous pages, as in a real pool
    for t in (*pool.k, *pool.v):
        t.normal_()
    return pool, chosen


def _timed(fn: Callable[[], object], dev: torch.device) -> float:
    """Seconds ``fn`` takes on ``dev``: CUDA events around it after a synchronize, else a clock."""
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(dev)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_staged(sizes: Sequence[int], repeat: int, device: str = "cpu",
                   warmup: int = 2, kernels_name: str | None = None, mode: str = "shm"
                   ) -> dict[int, dict[str, float]]:
    """Gather + WRITE + wait per chunk of each size; seconds and GB/s (median)."""
    dev = torch.device(device)
    kernels = get_kernels(dev, kernels_name)
    max_bytes = max(sizes)
    tag = f"staged-{os.getpid()}-{time.monotonic_ns()}"
    ctx = mp.get_context("spawn")
    out: dict[int, dict[str, float]] = {}
    with ControlSocket() as cs, _endpoint(f"{tag}-init", mode) as ep:
        staging = torch.zeros(max_bytes, dtype=torch.uint8, device=dev)
        _settle(staging)
        ep.register(staging)
        proc = ctx.Process(target=_bench_target,
                           args=(cs.endpoint, f"{tag}-ring", mode, device, max_bytes),
                           daemon=True)
        proc.start()
        try:
            me = BootstrapInfo(ep.name, cs.endpoint, ep.metadata())
            peer_info = exchange_bootstrap(cs, None, me, timeout_s=60)
            peer = ep.add_peer(peer_info.metadata)
            ring = peer_info.regions[0]
            if mode != "mooncake":
                ep.connect(peer)
            for n in sizes:
                pool, pages = _pool(n // BYTES_PER_TOKEN, dev)
                _settle(staging)
                samples = []
                for k in range(warmup + repeat):
                    t0 = time.perf_counter()
                    nbytes = kernels.gather_to_staging(pool.k, pool.v, pages, PAGE, 0, HEADS,
                                                       staging)
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    h = ep.write(staging, peer, ring, 0, nbytes)
                    ep.wait(h, timeout_s=60)
                    ep.release(h)
                    if k >= warmup:
                        samples.append(time.perf_counter() - t0)
                med = statistics.median(samples)
                out[n] = {"seconds_median": med, "gbps_median": n / med / 1e9}
            cs.send(peer_info.endpoint, [b"STOP"], timeout_ms=1000)
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    return out


def measure_scatter(sizes: Sequence[int], repeat: int, device: str = "cpu",
                    kernels_name: str | None = None, warmup: int = 2
                    ) -> dict[int, dict[str, float]]:
    """Decode-side scatter of a ring region into KV pages vs a plain copy of the bytes."""
    dev = torch.device(device)
    kernels = get_kernels(dev, kernels_name)
    out: dict[int, dict[str, float]] = {}
    for n in sizes:
        pool, pages = _pool(n // BYTES_PER_TOKEN, dev)
        region = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(region)

        def scatter_once(region: torch.Tensor = region, pool: KVPool = pool,
                         pages: list[int] = pages) -> None:
            kernels.scatter_from_staging(region, pool.k, pool.v, pages, PAGE, 1, 1, 0, HEADS)

        def copy_once(region: torch.Tensor = region, dst: torch.Tensor = dst) -> None:
            dst.copy_(region)

        scatter, copy = [], []
        for k in range(warmup + repeat):
            s, c = _timed(scatter_once, dev), _timed(copy_once, dev)
            if k >= warmup:
                scatter.append(s)
                copy.append(c)
        out[n] = {"scatter_gbps": n / statistics.median(scatter) / 1e9,
                  "copy_gbps": n / statistics.median(copy) / 1e9}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kernels", choices=["auto", "torch", "triton"], default="auto")
    ap.add_argument("--backend", choices=["nixl", "mooncake"], default="nixl")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    mode = "mooncake" if args.backend == "mooncake" else "shm"
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    torch.set_num_threads(1)
    sizes = [m * MIB for m in args.sizes_mib]
    raw = measure_raw_write(sizes, args.repeat, device=args.device, mode=mode)
    staged = measure_staged(sizes, args.repeat, args.device, kernels_name=args.kernels,
                            mode=mode)
    scat = measure_scatter(sizes, args.repeat, args.device, kernels_name=args.kernels)
    print(f"{'MiB':>5} | {'raw WRITE GB/s':>14} | {'staged GB/s':>11} | {'ratio':>5} | "
          f"{'scatter GB/s':>12} | {'copy GB/s':>9} | {'ratio':>5}")
    rows = []
    for n in sizes:
        r, s, c = raw[n]["gbps_median"], staged[n]["gbps_median"], scat[n]
        rows.append({"bytes": n, "raw_gbps": r, "staged_gbps": s, "staged_ratio": s / r,
                     **c, "scatter_ratio": c["scatter_gbps"] / c["copy_gbps"]})
        print(f"{n // MIB:5d} | {r:14.2f} | {s:11.2f} | {s / r:5.2f} | "
              f"{c['scatter_gbps']:12.2f} | {c['copy_gbps']:9.2f} | "
              f"{c['scatter_gbps'] / c['copy_gbps']:5.2f}")
    print(f"kernels: {get_kernels(args.device, args.kernels).name}; WRITEs: {args.backend}")
    print("targets: staged/raw >= 0.8 for 4 MiB and up; scatter/copy >= 0.5 on CPU")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
