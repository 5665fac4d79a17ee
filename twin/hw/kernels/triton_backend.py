"""Fused Triton gather/scatter kernels for the staging buffer.

Same signatures and contracts as the torch backend. Gather is one launch over
``(2 * layers) x token blocks x element blocks``; scatter is one launch over
``(writers * 2 * layers) x token blocks x element blocks``.

Per-layer addressing uses a device int64 *pointer table* (``data_ptr`` of every K layer, then
every V layer) that the kernel loads and casts to a typed pointer, as sglang does. The KV pool
keeps one tensor per layer, so stacking them into an ``[L, ...]`` tensor would cost a full copy of
the pool; the table keeps the launch fused with no copy. It works compiled on CUDA and under the
interpreter (``TRITON_INTERPRET=1``) with CPU tensors, where pointers are real host addresses.
The interpreter with CUDA tensors is not supported: it copies arguments to the host, so the table
would point at device memory.

Compilations. A kernel is compiled once per set of constexprs and specialised arguments, and the
first compile takes seconds. The block sizes depend on the row length only (``num_heads *
head_dim``, fixed per rank), and the arguments that change per chunk (token count, head offset)
are not specialised, so one warm-up call per rank layout (:func:`twin.hw.kernels.warm_up`)
compiles everything a rank will launch. The layer pointer table and the writer head offsets
depend on the layout only and are cached on the device (:func:`device_table`); only the page
indices travel to the device per call.

Copies move integer views of the element size, so they are bit-exact for any 1/2/4/8-byte dtype.
Importing this module never fails: without triton, ``HAS_TRITON`` is false and the wrappers raise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from twin.hw.kernels.common import (
    KernelBackend,
    PageIndices,
    bytes_as_elems,
    check_heads,
    check_pools,
    check_staging,
    device_table,
    pool_token_indices,
    staging_bytes,
    writer_blocks,
)

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["BACKEND", "HAS_TRITON", "gather_to_staging", "interpreted", "scatter_from_staging"]

# Elements handled by one program; the token block shrinks as the per-token row grows.
_BLOCK_ELEMS = 4096
_MAX_BLOCK_E = 1024


if HAS_TRITON:

    @triton.jit(do_not_specialize=["num_tokens", "head_offset"])
    def _gather_kernel(
        layer_ptrs,  # int64[2L]: data_ptr of K layers then V layers
        pages,  # int64[num_pages]
        staging,  # int view of the staging block
        num_tokens,
        elems_per_token,  # num_heads * head_dim
        token_stride,  # pool elements between consecutive pool tokens
        head_offset,  # head_start * head_dim
        PAGE_SIZE: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        lkv = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        e = tl.program_id(2) * BLOCK_E + tl.arange(0, BLOCK_E)
        t_mask = t < num_tokens
        mask = t_mask[:, None] & (e < elems_per_token)[None, :]

        src = tl.load(layer_ptrs + lkv).to(staging.dtype)
        page = tl.load(pages + t // PAGE_SIZE, mask=t_mask, other=0).to(tl.int64)
        pool_token = page * PAGE_SIZE + t % PAGE_SIZE
        src_off = pool_token[:, None] * token_stride + head_offset + e[None, :]
        vals = tl.load(src + src_off, mask=mask)

        row = lkv * num_tokens + t.to(tl.int64)
        dst_off = row[:, None] * elems_per_token + e[None, :]
        tl.store(staging + dst_off, vals, mask=mask)

    @triton.jit(do_not_specialize=["num_tokens"])
    def _scatter_kernel(
        layer_ptrs,  # int64[2L]: data_ptr of K layers then V layers
        pages,  # int64[num_pages]
        staging,  # int view of the whole region
        writer_head_offsets,  # int64[W]: dst_head_start * head_dim per writer
        num_layers_x2,
        num_tokens,
        elems_per_token,
        token_stride,
        PAGE_SIZE: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        writer = pid // num_layers_x2
        lkv = pid % num_layers_x2
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        e = tl.program_id(2) * BLOCK_E + tl.arange(0, BLOCK_E)
        t_mask = t < num_tokens
        mask = t_mask[:, None] & (e < elems_per_token)[None, :]

        row = (writer * num_layers_x2 + lkv) * num_tokens + t.to(tl.int64)
        vals = tl.load(staging + row[:, None] * elems_per_token + e[None, :], mask=mask)

        dst = tl.load(layer_ptrs + lkv).to(staging.dtype)
        head_offset = tl.load(writer_head_offsets + writer)
        page = tl.load(pages + t // PAGE_SIZE, mask=t_mask, other=0).to(tl.int64)
        pool_token = page * PAGE_SIZE + t % PAGE_SIZE
        dst_off = pool_token[:, None] * token_stride + head_offset + e[None, :]
        tl.store(dst + dst_off, vals, mask=mask)


def interpreted() -> bool:
    """Whether the kernels were built for the Triton interpreter (``TRITON_INTERPRET=1``)."""
    return HAS_TRITON and type(_gather_kernel).__name__ == "InterpretedFunction"


def _require_triton(device: torch.device) -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use the torch kernels")
    if interpreted():
        if device.type != "cpu":
            raise RuntimeError("the Triton interpreter path needs CPU tensors")
    elif device.type != "cuda":
        raise RuntimeError(
            f"Triton kernels need CUDA tensors (got {device.type}); "
            "set TRITON_INTERPRET=1 before importing triton to run them on CPU"
        )


def _check_row_major(k_layers: Sequence[torch.Tensor]) -> int:
    """Kernels address ``pool_token * token_stride + head * head_dim + dim``; return stride."""
    ref = k_layers[0]
    for t in k_layers:
        if t.stride(2) != 1 or t.stride(1) != ref.shape[2] or t.stride(0) != ref.stride(0):
            raise ValueError("Triton kernels need KV layers with contiguous [heads, head_dim] rows")
    return ref.stride(0)


def _blocks(elems_per_token: int) -> tuple[int, int]:
    """``(BLOCK_T, BLOCK_E)`` from the row length alone, so chunk sizes share one compile."""
    block_e = min(triton.next_power_of_2(max(elems_per_token, 1)), _MAX_BLOCK_E)
    return max(1, _BLOCK_ELEMS // block_e), block_e


def _layer_table(layers: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    return device_table([t.data_ptr() for t in layers], device)


def gather_to_staging(
    k_layers: Sequence[torch.Tensor],
    v_layers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    page_size: int,
    head_start: int,
    num_heads: int,
    out: torch.Tensor,
) -> int:
    """Fused-kernel version of the torch backend's ``gather_to_staging``."""
    check_pools(k_layers, v_layers)
    check_heads(k_layers, head_start, num_heads)
    ref = k_layers[0]
    _require_triton(ref.device)
    token_stride = _check_row_major([*k_layers, *v_layers])
    pages = pool_token_indices(page_indices, 1, ref.device)
    num_tokens = pages.numel() * page_size
    total = staging_bytes(k_layers, num_tokens, num_heads)
    check_staging(out, total, ref.device, "out")
    if total == 0:
        return 0
    head_dim = ref.shape[2]
    elems_per_token = num_heads * head_dim
    block_t, block_e = _blocks(elems_per_token)
    grid = (
        2 * len(k_layers),
        triton.cdiv(num_tokens, block_t),
        triton.cdiv(elems_per_token, block_e),
    )
    _gather_kernel[grid](
        _layer_table([*k_layers, *v_layers], ref.device),
        pages,
        bytes_as_elems(out[:total], ref),
        num_tokens,
        elems_per_token,
        token_stride,
        head_start * head_dim,
        PAGE_SIZE=page_size,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
    )
    return total


def scatter_from_staging(
    staging: torch.Tensor,
    k_layers: Sequence[torch.Tensor],
    v_layers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    page_size: int,
    src_tp: int,
    dst_tp: int,
    dst_rank: int,
    total_kv_heads: int,
) -> None:
    """Fused-kernel version of the torch backend's ``scatter_from_staging``."""
    check_pools(k_layers, v_layers)
    ref = k_layers[0]
    _require_triton(ref.device)
    token_stride = _check_row_major([*k_layers, *v_layers])
    pages = pool_token_indices(page_indices, 1, ref.device)
    num_tokens = pages.numel() * page_size
    blocks = writer_blocks(k_layers, num_tokens, src_tp, dst_tp, dst_rank, total_kv_heads)
    num_heads = blocks[0][1]
    if any(nh != num_heads for _, nh, _ in blocks):
        raise ValueError("writer blocks of one region must carry the same number of heads")
    for _, nh, dst_head_start in blocks:
        check_heads(k_layers, dst_head_start, nh)
    per_writer = staging_bytes(k_layers, num_tokens, num_heads)
    total = per_writer * len(blocks)
    check_staging(staging, total, ref.device, "staging")
    if total == 0:
        return
    head_dim = ref.shape[2]
    elems_per_token = num_heads * head_dim
    head_offsets = device_table([start * head_dim for _, _, start in blocks], ref.device)
    block_t, block_e = _blocks(elems_per_token)
    grid = (
        len(blocks) * 2 * len(k_layers),
        triton.cdiv(num_tokens, block_t),
        triton.cdiv(elems_per_token, block_e),
    )
    _scatter_kernel[grid](
        _layer_table([*k_layers, *v_layers], ref.device),
        pages,
        bytes_as_elems(staging[:total], ref),
        head_offsets,
        2 * len(k_layers),
        num_tokens,
        elems_per_token,
        token_stride,
        PAGE_SIZE=page_size,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
    )


BACKEND = KernelBackend("triton", gather_to_staging, scatter_from_staging)
