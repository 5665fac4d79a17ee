"""Staging gather/scatter throughput against a plain ``dst.copy_(src)`` of the same bytes.

Example::

    python benchmarks/bench_kernels.py --device cpu --tokens 256 --repeat 20

Each row moves one staging block (all layers, K and V) and reports GB/s of staged bytes; the
baseline copies a contiguous uint8 tensor of the same size in the same run, and ``ratio`` is
kernel GB/s over copy GB/s. By default a buffer larger than the last-level cache is written before
every timed call (kernel and copy alike); ``--warm`` skips that, which lets a copy of a few tens of
MiB run from cache while the kernels still read a pool four times the chunk.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

try:
    from twin.hw.kernels import KernelBackend, get_kernels, staging_bytes
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from twin.hw.kernels import KernelBackend, get_kernels, staging_bytes


_FLUSH: dict[torch.device, torch.Tensor] = {}


def _flush_caches(device: torch.device) -> None:
    """Write a buffer larger than the last-level cache so every timed call starts cold."""
    if device not in _FLUSH:
        _FLUSH[device] = torch.zeros(256 * 2**20, dtype=torch.uint8, device=device)
    _FLUSH[device].add_(1)


def _timeit(fn: Callable[[], object], device: torch.device, repeat: int, cold: bool) -> float:
    """Median seconds per call after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        if cold:
            _flush_caches(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def _pool(
    layers: int, pool_tokens: int, heads: int, head_dim: int, dtype: torch.dtype, dev: torch.device
) -> list[torch.Tensor]:
    return [torch.randn(pool_tokens, heads, head_dim, device=dev).to(dtype) for _ in range(layers)]


def run(args: argparse.Namespace) -> list[tuple[str, int, float, float]]:
    """Return rows ``(label, bytes, kernel GB/s, copy GB/s)``."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    backend: KernelBackend = get_kernels(device, args.kernels)
    page_size, heads, head_dim = args.page_size, args.heads, args.head_dim
    num_pages = -(-args.tokens // page_size)
    num_tokens = num_pages * page_size
    pool_pages = 4 * num_pages
    gen = torch.Generator().manual_seed(0)
    pages = torch.randperm(pool_pages, generator=gen)[:num_pages].to(device)
    k = _pool(args.layers, pool_pages * page_size, heads, head_dim, dtype, device)
    v = _pool(args.layers, pool_pages * page_size, heads, head_dim, dtype, device)

    rows = []

    def copy_gbps(nbytes: int) -> float:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
        dst = torch.empty_like(src)
        return nbytes / _timeit(lambda: dst.copy_(src), device, args.repeat, args.cold) / 1e9

    # gather: all heads (prefill TP == decode TP) and half the heads (decode TP = 2 * prefill TP)
    for label, start, nh in (
        ("gather all heads", 0, heads),
        ("gather half heads", heads // 2, heads // 2),
    ):
        nbytes = staging_bytes(k, num_tokens, nh)
        out = torch.empty(nbytes, dtype=torch.uint8, device=device)
        t = _timeit(
            lambda s=start, n=nh, o=out: backend.gather_to_staging(k, v, pages, page_size, s, n, o),
            device,
            args.repeat,
            args.cold,
        )
        rows.append((label, nbytes, nbytes / t / 1e9, copy_gbps(nbytes)))

    # scatter: one writer with every head, and two writers with half the heads each
    for label, src_tp in (("scatter 1 writer", 1), ("scatter 2 writers", 2)):
        nbytes = staging_bytes(k, num_tokens, heads)
        region = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
        t = _timeit(
            lambda tp=src_tp, r=region: backend.scatter_from_staging(
                r, k, v, pages, page_size, tp, 1, 0, heads
            ),
            device,
            args.repeat,
            args.cold,
        )
        rows.append((label, nbytes, nbytes / t / 1e9, copy_gbps(nbytes)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--warm",
        dest="cold",
        action="store_false",
        help="skip the cache flush before each timed call (the copy baseline then runs in cache)",
    )
    parser.add_argument("--kernels", choices=["auto", "torch", "triton"], default="auto")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()

    backend = get_kernels(args.device, args.kernels).name
    print(
        f"backend={backend} device={args.device} layers={args.layers} heads={args.heads} "
        f"head_dim={args.head_dim} dtype={args.dtype} tokens={args.tokens} "
        f"page_size={args.page_size} repeat={args.repeat} caches={'cold' if args.cold else 'warm'}"
    )
    print(f"{'op':<20}{'MiB':>8}{'kernel GB/s':>13}{'copy GB/s':>11}{'ratio':>8}")
    rows = run(args)
    for label, nbytes, gbps, copy in rows:
        print(f"{label:<20}{nbytes / 2**20:>8.1f}{gbps:>13.2f}{copy:>11.2f}{gbps / copy:>8.2f}")
    if args.json:
        args.json.write_text(json.dumps({
            "backend": backend, "device": args.device,
            "rows": [{"op": label, "bytes": nbytes, "kernel_gbps": gbps, "copy_gbps": copy,
                      "ratio": gbps / copy} for label, nbytes, gbps, copy in rows]}, indent=2))


if __name__ == "__main__":
    main()
