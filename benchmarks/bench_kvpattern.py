"""The hardware mode's byte check against the scatter it checks.

Example::

    python benchmarks/bench_kvpattern.py --tokens 256 --repeat 30

A decode rank checks every scatter's pages against the request's pattern in its own loop, and a
prefill rank writes each chunk's pattern before sending it, so both are part of the hardware
mode's transfer cost on a CPU host. For one chunk of ``--tokens`` tokens of a pool shaped by
``--layers``, ``--heads`` and ``--head-dim`` (the defaults are ``examples/tp2-tp1-small.toml``'s
decode rank), it times in the same run: the scatter of the chunk from a staging region (the
baseline), ``verify_decode_pool`` (the check), ``fill_prefill_pool`` (the fill), and the
pattern built element by element from ``pattern_value`` (the reference definition, which the
table ``expected_tokens`` factors). Prints milliseconds and the ratio to the scatter.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

try:
    from twin.hw.kernels import get_kernels
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from twin.hw.kernels import get_kernels
from twin.hw.kvpattern import (
    fill_prefill_pool,
    pattern_value,
    rank_head_range,
    verify_decode_pool,
)
from twin.hw.pools import DTYPES, KVPool, byte_buffer


def best_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=256, help="tokens in the chunk")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4, help="KV heads on the rank")
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (ranks use 1)")
    args = ap.parse_args(argv)
    if min(args.tokens, args.layers, args.heads, args.head_dim, args.page_size, args.repeat) < 1:
        ap.error("every size and --repeat must be at least 1")
    torch.set_num_threads(args.threads)
    dev = torch.device("cpu")
    page = args.page_size
    num_pages = -(-args.tokens // page)
    pool = KVPool(args.layers, 2 * num_pages + 2, page, args.heads, args.head_dim, DTYPES[2], dev)
    pages = pool.alloc(1, num_pages)
    heads = rank_head_range(1, 0, args.heads)
    nbytes = 2 * args.layers * num_pages * page * args.heads * args.head_dim * 2
    ring = byte_buffer(nbytes, dev)
    kernels = get_kernels(dev, None)
    tokens = pool.token_indices(pages, 0, args.tokens)

    def reference() -> torch.Tensor:
        return pattern_value(
            7,
            torch.arange(args.layers).view(1, -1, 1, 1, 1),
            torch.arange(2).view(-1, 1, 1, 1, 1),
            torch.arange(args.tokens).view(1, 1, -1, 1, 1),
            torch.tensor(list(heads)).view(1, 1, 1, -1, 1),
            torch.arange(args.head_dim).view(1, 1, 1, 1, -1),
        )

    rows = {
        "scatter (baseline)": lambda: kernels.scatter_from_staging(
            ring, pool.k, pool.v, pages, page, 1, 1, 0, args.heads),
        "check (verify_decode_pool)": lambda: verify_decode_pool(
            pool.k, pool.v, 7, range(args.tokens), tokens, heads),
        "fill (fill_prefill_pool)": lambda: fill_prefill_pool(
            pool.k, pool.v, pages, page, request=7),
        "pattern, per element (reference)": reference,
    }
    print(f"one chunk: {args.tokens} tokens x {args.layers} layers x {args.heads} heads x "
          f"{args.head_dim} dims, bf16, {nbytes / 1024:.0f} KiB; best of {args.repeat}, "
          f"{args.threads} thread(s)")
    base = None
    for name, fn in rows.items():
        if base is not None:  # the scatter wrote the staging region's zeros: the pattern back
            fill_prefill_pool(pool.k, pool.v, pages, page, request=7)
            assert verify_decode_pool(pool.k, pool.v, 7, range(args.tokens), tokens,
                                      heads) is None
        ms = best_ms(fn, args.repeat)
        base = base or ms
        print(f"  {name:34s} {ms:8.3f} ms  {ms / base:6.2f}x the scatter")
    return 0


if __name__ == "__main__":
    sys.exit(main())
