"""Measured compute profiles: prefill forward and decode step times of a model on a GPU.

A profile holds, for one model, GPU and attention-TP size, the time of a prefill forward split
into attention and the rest, and of a decode step split the same way, on fixed grids
(``PREFILL_TOKENS`` x ``PREFILL_PREFIX``, ``DECODE_BATCH`` x ``DECODE_CTX``). A forward of a
batch of requests costs ``linear(total new tokens) + sum(attention(new tokens, cached prefix))``;
a decode step of ``b`` requests with ``ctx`` context tokens in all costs
``linear(b) + attention(b, ctx / b)``. Between grid points values are interpolated linearly;
past the ends they are extrapolated from the last segment.

The tables ship as package data (``profiles/<gpu>.json.gz``), derived from aiconfigurator's
measured per-operator tables by ``python -m twin.models.derive``; each file names its source.
"""

from __future__ import annotations

import functools
import gzip
import json
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_DIR = Path(__file__).with_name("profiles")

PREFILL_TOKENS: tuple[int, ...] = tuple(sorted({
    *range(16, 257, 16), *range(128, 8193, 128), *range(9216, 32769, 1024),
    # The source's GEMM tables are measured at m and m + 1 (either side of a tile boundary)
    # every 16 rows up to 256 and every 256 up to 4352; keep both so the steps survive.
    *(m + 1 for m in range(16, 257, 16)), *(m + d for m in range(512, 4353, 256) for d in (0, 1)),
    8193, 16385}))
PREFILL_PREFIX: tuple[int, ...] = (0, 2048, 8192, 32768, 131072)
DECODE_BATCH: tuple[int, ...] = tuple(sorted({
    1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 320, 384, 448,
    *(m + d for m in (*range(16, 257, 16), 512) for d in (0, 1))}))
DECODE_CTX: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536,
                               131072)


def interp(xs: tuple[int, ...] | list[int], ys: list[float], x: float) -> float:
    """Linear interpolation on increasing ``xs``; linear extrapolation from the end segments
    (never below zero)."""
    i = bisect_right(xs, x)
    if i <= 0:
        i = 1
    elif i >= len(xs):
        i = len(xs) - 1
    x0, x1 = xs[i - 1], xs[i]
    y0, y1 = ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class Profile:
    """One model on one GPU at one attention-TP size (times in milliseconds in the tables)."""

    model: str
    gpu: str
    tp: int
    provenance: dict[str, Any]
    prefill_linear_ms: list[float]
    prefill_attn_ms: list[list[float]]  # [prefix][tokens]
    decode_linear_ms: list[float]
    decode_attn_ms: list[list[float]]  # [ctx][batch]
    check: dict[str, list[list[float]]]
    _by_batch: dict[int, tuple[float, list[float]]] = field(default_factory=dict, repr=False,
                                                            compare=False)

    @property
    def source(self) -> str:
        p = self.provenance
        return (f"{p.get('source', '?')} ({p.get('framework', '?')} "
                f"{p.get('framework_version', '?')}, {p.get('system', self.gpu)})")

    def prefill_attention_s(self, tokens: int, prefix: int) -> float:
        cols = [interp(PREFILL_TOKENS, row, tokens) for row in self.prefill_attn_ms]
        return interp(PREFILL_PREFIX, cols, prefix) * 1e-3

    def prefill_s(self, batch: list[tuple[int, int]]) -> float:
        """One forward of ``(new tokens, cached prefix)`` per request."""
        total = sum(t for t, _ in batch)
        s = interp(PREFILL_TOKENS, self.prefill_linear_ms, total) * 1e-3
        for t, p in batch:
            s += self.prefill_attention_s(t, p)
        return s

    def decode_s(self, batch: int, ctx_tokens: int) -> float:
        """One decode step of ``batch`` requests holding ``ctx_tokens`` context tokens in all."""
        if batch <= 0:
            return 0.0
        at = self._by_batch.get(batch)
        if at is None:  # the attention column and linear part of this batch size, once
            cols = [interp(DECODE_BATCH, row, batch) for row in self.decode_attn_ms]
            at = self._by_batch[batch] = (interp(DECODE_BATCH, self.decode_linear_ms, batch),
                                          cols)
        return (at[0] + interp(DECODE_CTX, at[1], ctx_tokens / batch)) * 1e-3


@functools.lru_cache(maxsize=16)
def _load(gpu: str) -> dict[str, Any] | None:
    path = PROFILE_DIR / f"{gpu.lower()}.json.gz"
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(gzip.decompress(path.read_bytes()))
    return data


def find_profile(model: str, gpu: str, tp: int) -> Profile | None:
    """The shipped profile of ``model`` on ``gpu`` at attention TP ``tp``, or None."""
    data = _load(gpu)
    if data is None:
        return None
    entry = data["models"].get(model, {}).get(str(tp))
    if entry is None:
        return None
    return Profile(model=model, gpu=gpu, tp=tp, provenance=data["provenance"],
                   prefill_linear_ms=entry["prefill"]["linear_ms"],
                   prefill_attn_ms=entry["prefill"]["attn_ms"],
                   decode_linear_ms=entry["decode"]["linear_ms"],
                   decode_attn_ms=entry["decode"]["attn_ms"], check=entry["check"])


def available() -> dict[str, dict[str, list[int]]]:
    """GPU -> model -> TP sizes with a shipped profile."""
    out: dict[str, dict[str, list[int]]] = {}
    for path in sorted(PROFILE_DIR.glob("*.json.gz")):
        data = _load(path.name.removesuffix(".json.gz"))
        if data is None:
            continue
        out[data["gpu"]] = {m: sorted(int(t) for t in tps) for m, tps in data["models"].items()}
    return out
