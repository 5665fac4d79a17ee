"""Deterministic KV value pattern for byte-exact transfer validation.

Every element of a request's KV cache gets a bit pattern that is a pure function
``pattern_value(request, layer, kv, token, head, dim)`` of its logical coordinates:

* ``kv`` is 0 for K and 1 for V, ``token`` the position inside the request, ``head`` the
  *global* KV head index (``0 .. total_kv_heads - 1``) and ``dim`` the index inside the head.
* The row coordinates ``(request, layer, kv, token, head)`` are hashed with a chain of bijective
  31-bit integer mixes, ``dim`` with one mix of its own, and the element's bit pattern is the low
  ``8 * element_size`` bits of their XOR. Bit ``nbits - 2`` (the top exponent bit of every IEEE
  and fp8 layout) is cleared so each value is a finite float; comparisons still use integer views,
  so they never depend on float semantics. The XOR makes a table cheap: one narrow-integer op
  per element over a row hash and a dim hash computed on their own (the decode ranks check
  every scatter against it while the run is timed).

A prefill pool is filled with :func:`fill_prefill_pool`; after a transfer a decode pool is checked
with :func:`verify_decode_pool`, which reports the first wrong element as a :class:`Mismatch`.
Which global heads a rank holds is given by :func:`rank_head_range`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from twin.core.layout import compute_head_slice_params
from twin.hw.kernels.common import PageIndices, int_view, pool_token_indices, staging_bytes

IntOrTensor = int | torch.Tensor

_M31 = (1 << 31) - 1
# Odd multipliers below 2**31: products of two 31-bit values stay inside int64.
_MUL_A = 0x2C1B3C6D
_MUL_B = 0x297A2D39
_SEEDS = (0x1B873593, 0x0CC9E2D5, 0x3A4F1B2C, 0x165667B1, 0x27D4EB2F, 0x085EBCA7)

__all__ = [
    "Mismatch",
    "TransferCase",
    "TransferResult",
    "expected_tokens",
    "fill_prefill_pool",
    "pattern_bits",
    "pattern_value",
    "rank_head_range",
    "run_transfer",
    "verify_decode_pool",
    "writer_ranks",
]


def rank_head_range(tp_size: int, tp_rank: int, total_kv_heads: int) -> range:
    """Global KV heads held by attention-TP rank ``tp_rank``.

    ``tp_size <= total_kv_heads``: a contiguous ``total_kv_heads // tp_size`` heads. Otherwise
    (GQA replication) ``tp_size // total_kv_heads`` consecutive ranks share head
    ``tp_rank // (tp_size // total_kv_heads)``.
    """
    if tp_size <= total_kv_heads:
        if total_kv_heads % tp_size:
            raise ValueError(f"{total_kv_heads} KV heads do not split over TP {tp_size}")
        per_rank = total_kv_heads // tp_size
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    if tp_size % total_kv_heads:
        raise ValueError(f"TP {tp_size} is not a multiple of {total_kv_heads} KV heads")
    head = tp_rank // (tp_size // total_kv_heads)
    return range(head, head + 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """Bijection on ``[0, 2**31)``: multiply-xorshift rounds kept inside int64."""
    x = (x * _MUL_A) & _M31
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _M31
    return x ^ (x >> 13)


def _row_hash(coords: Sequence[torch.Tensor], device: torch.device | str | None) -> torch.Tensor:
    h = torch.zeros((), dtype=torch.int64, device=device)
    for seed, c in zip(_SEEDS[:5], coords, strict=True):
        h = _mix((h + (c & _M31) + seed) & _M31)
    return h


def _dim_hash(dim: torch.Tensor) -> torch.Tensor:
    return _mix(((dim & _M31) + _SEEDS[5]) & _M31)


def _low_bits(h: torch.Tensor, nbits: int) -> torch.Tensor:
    bits = h & ((1 << min(nbits, 31)) - 1)
    return bits & ~(1 << (nbits - 2))


def pattern_bits(
    request: IntOrTensor,
    layer: IntOrTensor,
    kv: IntOrTensor,
    token: IntOrTensor,
    head: IntOrTensor,
    dim: IntOrTensor,
    nbits: int = 16,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Unsigned ``nbits``-bit pattern (int64 tensor) of the broadcast coordinates."""
    coords = [
        torch.as_tensor(c, dtype=torch.int64, device=device)
        for c in (request, layer, kv, token, head, dim)
    ]
    return _low_bits(_row_hash(coords[:5], device) ^ _dim_hash(coords[5]), nbits)


def _signed(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unsigned ``8 * element_size`` bit patterns as ``dtype``'s signed integer view."""
    nbits = 8 * torch.empty((), dtype=dtype).element_size()
    if nbits < 64:
        half = 1 << (nbits - 1)
        bits = (bits ^ half) - half  # sign-extend the top pattern bit
    return bits.to(int_view(torch.empty(0, dtype=dtype)).dtype)


def pattern_value(
    request: IntOrTensor,
    layer: IntOrTensor,
    kv: IntOrTensor,
    token: IntOrTensor,
    head: IntOrTensor,
    dim: IntOrTensor,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Pattern as a ``dtype`` tensor (broadcast shape of the coordinates)."""
    nbits = 8 * torch.empty((), dtype=dtype).element_size()
    bits = pattern_bits(request, layer, kv, token, head, dim, nbits, device)
    return _signed(bits, dtype).view(dtype)


def _as_range(x: int | Sequence[int]) -> Sequence[int]:
    return range(x) if isinstance(x, int) else x


def expected_tokens(
    request: int,
    layers: int | Sequence[int],
    token_range: Sequence[int],
    head_range: Sequence[int],
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Expected values ``[2 (K, V), layers, tokens, heads, head_dim]``.

    ``layers`` is a layer count (layers ``0..n-1``) or explicit layer ids; ``token_range`` and
    ``head_range`` list request token positions and global head ids.
    """
    lay = torch.as_tensor(list(_as_range(layers)), dtype=torch.int64, device=device)
    tok = torch.as_tensor(list(token_range), dtype=torch.int64, device=device)
    hd = torch.as_tensor(list(head_range), dtype=torch.int64, device=device)
    dims = torch.arange(head_dim, dtype=torch.int64, device=device)
    kv = torch.arange(2, dtype=torch.int64, device=device)
    req = torch.as_tensor(request, dtype=torch.int64, device=device)
    # pattern_bits, factored: the row hash on [2, layers, tokens, heads, 1] and the dim hash
    # on [head_dim], each masked and made signed, then one XOR per element in the narrow type.
    nbits = 8 * torch.empty((), dtype=dtype).element_size()
    row = _row_hash([req, lay.view(1, -1, 1, 1, 1), kv.view(-1, 1, 1, 1, 1),
                     tok.view(1, 1, -1, 1, 1), hd.view(1, 1, 1, -1, 1)], device)
    rows = _signed(_low_bits(row, nbits), dtype)
    cols = _signed(_low_bits(_dim_hash(dims), nbits), dtype)
    return (rows ^ cols).view(dtype)


def fill_prefill_pool(
    k_layers: Sequence[torch.Tensor],
    v_layers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    page_size: int,
    request: int,
    token_offset: int = 0,
    head_offset: int = 0,
    layer_offset: int = 0,
) -> None:
    """Write request ``request``'s pattern into the pool tokens named by ``page_indices``.

    Chunk token ``t`` holds request position ``token_offset + t``; local head ``h`` holds global
    head ``head_offset + h`` (use ``rank_head_range(...).start``); list index ``i`` is layer
    ``layer_offset + i``.
    """
    ref = k_layers[0]
    tok = pool_token_indices(page_indices, page_size, ref.device)
    heads, head_dim = ref.shape[1], ref.shape[2]
    values = expected_tokens(
        request,
        range(layer_offset, layer_offset + len(k_layers)),
        range(token_offset, token_offset + tok.numel()),
        range(head_offset, head_offset + heads),
        head_dim,
        ref.dtype,
        ref.device,
    )
    for kv, layers in enumerate((k_layers, v_layers)):
        for i, layer in enumerate(layers):
            int_view(layer).index_copy_(0, tok, int_view(values[kv, i]))


@dataclass(frozen=True)
class Mismatch:
    """First wrong element found by :func:`verify_decode_pool` (bit patterns as signed ints)."""

    request: int
    layer: int
    kv: str  # "k" or "v"
    token: int  # position inside the request
    head: int  # global KV head
    dim: int
    expected: int
    got: int
    count: int  # wrong elements in total

    def __str__(self) -> str:
        return (
            f"request {self.request} layer {self.layer} {self.kv.upper()} token {self.token} "
            f"head {self.head} dim {self.dim}: expected {self.expected:#x}, got {self.got:#x} "
            f"({self.count} wrong elements)"
        )


def verify_decode_pool(
    k_layers: Sequence[torch.Tensor],
    v_layers: Sequence[torch.Tensor],
    request: int,
    token_positions: Sequence[int] | torch.Tensor,
    pool_tokens: torch.Tensor,
    head_range: Sequence[int],
    layer_offset: int = 0,
) -> Mismatch | None:
    """Check that pool token ``pool_tokens[i]`` holds request position ``token_positions[i]``.

    Local head ``h`` of every layer must hold global head ``head_range[h]`` (pass
    :func:`rank_head_range` of the decode rank). Returns ``None`` if every bit matches.
    """
    ref = k_layers[0]
    if len(head_range) != ref.shape[1]:
        raise ValueError(f"head_range has {len(head_range)} heads, pool layers {ref.shape[1]}")
    if isinstance(token_positions, range):
        positions: Sequence[int] = token_positions
    else:
        positions = torch.as_tensor(token_positions, dtype=torch.int64).reshape(-1).tolist()
    idx = pool_tokens.to(device=ref.device, dtype=torch.int64).reshape(-1)
    if idx.numel() != len(positions):
        raise ValueError("token_positions and pool_tokens differ in length")
    got = torch.stack(
        [
            torch.stack([int_view(t).index_select(0, idx) for t in lay])
            for lay in (k_layers, v_layers)
        ]
    )
    want = int_view(
        expected_tokens(
            request,
            range(layer_offset, layer_offset + len(k_layers)),
            positions,
            head_range,
            ref.shape[2],
            ref.dtype,
            ref.device,
        )
    )
    if torch.equal(got, want):
        return None
    wrong = got != want
    count = int(wrong.sum())
    kv, layer, t, h, d = (int(i) for i in wrong.nonzero()[0])
    return Mismatch(
        request=request,
        layer=layer_offset + layer,
        kv="kv"[kv],
        token=positions[t],
        head=head_range[h],
        dim=d,
        expected=int(want[kv, layer, t, h, d]),
        got=int(got[kv, layer, t, h, d]),
        count=count,
    )


# --------------------------------------------------------------------------- round-trip harness

GatherFn = Callable[..., int]
ScatterFn = Callable[..., None]


@dataclass(frozen=True)
class TransferCase:
    """One chunk of one request moved from every prefill rank to every decode rank."""

    src_tp: int
    dst_tp: int
    total_kv_heads: int
    num_layers: int = 2
    head_dim: int = 8
    page_size: int = 16
    chunk_pages: int = 2
    pool_pages: int = 6
    dtype: torch.dtype = torch.bfloat16
    request: int = 7
    token_offset: int = 0
    seed: int = 0


@dataclass
class TransferResult:
    """Per decode rank: staging region, decode pool layers, page indices and verification."""

    regions: list[torch.Tensor]
    decode_k: list[list[torch.Tensor]]
    decode_v: list[list[torch.Tensor]]
    decode_pages: list[torch.Tensor]
    mismatches: list[Mismatch | None]


def _noise_pool(case: TransferCase, heads: int, gen: torch.Generator, device: str) -> torch.Tensor:
    shape = (case.pool_pages * case.page_size, heads, case.head_dim)
    dtype = int_view(torch.empty(0, dtype=case.dtype)).dtype
    info = torch.iinfo(dtype)
    noise = torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64)
    return noise.to(dtype).view(case.dtype).to(device)


def writer_ranks(src_tp: int, dst_tp: int, dst_rank: int) -> list[int]:
    """Prefill ranks writing decode rank ``dst_rank``'s region, in writer-block order."""
    if src_tp > dst_tp:
        writers = src_tp // dst_tp
        return [dst_rank * writers + w for w in range(writers)]
    return [dst_rank // (dst_tp // src_tp)]


def run_transfer(
    case: TransferCase, gather: GatherFn, scatter: ScatterFn, device: str = "cpu"
) -> TransferResult:
    """Fill prefill pools with the pattern, gather each writer, scatter each region, verify.

    Pools start as seeded noise and pages are seeded random choices, so two runs of the same case
    with different kernels must produce byte-identical regions and decode pools.
    """
    gen = torch.Generator().manual_seed(case.seed)
    num_tokens = case.chunk_pages * case.page_size
    prefill = []
    for r in range(case.src_tp):
        heads = rank_head_range(case.src_tp, r, case.total_kv_heads)
        k = [_noise_pool(case, len(heads), gen, device) for _ in range(case.num_layers)]
        v = [_noise_pool(case, len(heads), gen, device) for _ in range(case.num_layers)]
        pages = torch.randperm(case.pool_pages, generator=gen)[: case.chunk_pages].to(device)
        fill_prefill_pool(k, v, pages, case.page_size, case.request, case.token_offset, heads.start)
        prefill.append((k, v, pages))

    result = TransferResult([], [], [], [], [])
    positions = list(range(case.token_offset, case.token_offset + num_tokens))
    for d in range(case.dst_tp):
        heads = rank_head_range(case.dst_tp, d, case.total_kv_heads)
        k = [_noise_pool(case, len(heads), gen, device) for _ in range(case.num_layers)]
        v = [_noise_pool(case, len(heads), gen, device) for _ in range(case.num_layers)]
        pages = torch.randperm(case.pool_pages, generator=gen)[: case.chunk_pages].to(device)
        chunks = []
        for r in writer_ranks(case.src_tp, case.dst_tp, d):
            src_start, nh, _, _ = compute_head_slice_params(
                case.src_tp, case.dst_tp, r, d, case.total_kv_heads
            )
            pk, pv, ppages = prefill[r]
            out = torch.empty(staging_bytes(pk, num_tokens, nh), dtype=torch.uint8, device=device)
            assert gather(pk, pv, ppages, case.page_size, src_start, nh, out) == out.numel()
            chunks.append(out)
        region = torch.cat(chunks)
        scatter(
            region, k, v, pages, case.page_size, case.src_tp, case.dst_tp, d, case.total_kv_heads
        )
        tokens = pool_token_indices(pages, case.page_size, device)
        result.regions.append(region)
        result.decode_k.append(k)
        result.decode_v.append(v)
        result.decode_pages.append(pages)
        result.mismatches.append(verify_decode_pool(k, v, case.request, positions, tokens, heads))
    return result
