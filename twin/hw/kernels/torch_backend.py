"""Gather/scatter with plain torch ops (``index_select`` / ``index_copy_``), on CPU and CUDA.

Same contracts as every backend (see :mod:`twin.hw.kernels.common` for the layout): one op per
layer, through integer views, so copies are bit-exact for any 1/2/4/8-byte dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from twin.hw.kernels.common import (
    INT_DTYPES,
    KernelBackend,
    PageIndices,
    bytes_as_elems,
    check_heads,
    check_pools,
    check_staging,
    int_view,
    pool_token_indices,
    staging_bytes,
    writer_blocks,
)

__all__ = ["BACKEND", "gather_to_staging", "scatter_from_staging"]


def _word_size(raw: torch.Tensor, layers: Sequence[torch.Tensor], row_bytes: int) -> int:
    """Widest integer width dividing a head row and every base address.

    ``index_copy_`` moves one element at a time on CPU, so wider words scatter faster; the
    reinterpretation is still bit-exact.
    """
    for word in (8, 4, 2):
        if row_bytes % word == 0 and all(t.data_ptr() % word == 0 for t in (raw, *layers)):
            return word
    return 1


def gather_to_staging(
    k_layers: Sequence[torch.Tensor],
    v_layers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    page_size: int,
    head_start: int,
    num_heads: int,
    out: torch.Tensor,
) -> int:
    """Pack heads ``[head_start, head_start + num_heads)`` of every layer into ``out``.

    ``out`` is a 1-D uint8 tensor on the KV device with at least ``staging_bytes`` bytes and
    an offset aligned to the element size. Returns the number of bytes written.
    """
    check_pools(k_layers, v_layers)
    check_heads(k_layers, head_start, num_heads)
    ref = k_layers[0]
    tok = pool_token_indices(page_indices, page_size, ref.device)
    num_tokens = tok.numel()
    total = staging_bytes(k_layers, num_tokens, num_heads)
    check_staging(out, total, ref.device, "out")
    if total == 0:
        return 0
    dst = bytes_as_elems(out[:total], ref).view(
        2 * len(k_layers), num_tokens, num_heads, ref.shape[2]
    )
    for i, layer in enumerate((*k_layers, *v_layers)):
        src = int_view(layer)[:, head_start : head_start + num_heads]
        torch.index_select(src, 0, tok, out=dst[i])
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
    """Unpack every writer block of a decode staging region into the decode KV pool.

    ``staging`` is a 1-D uint8 view starting at the region; it must hold the
    ``compute_staging_layout`` total. Writer ``w`` lands at its ``dst_head_start``.
    """
    check_pools(k_layers, v_layers)
    ref = k_layers[0]
    tok = pool_token_indices(page_indices, page_size, ref.device)
    num_tokens = tok.numel()
    blocks = writer_blocks(k_layers, num_tokens, src_tp, dst_tp, dst_rank, total_kv_heads)
    layers = (*k_layers, *v_layers)
    for offset, nh, dst_head_start in blocks:
        check_heads(k_layers, dst_head_start, nh)
        nbytes = staging_bytes(k_layers, num_tokens, nh)
        check_staging(staging, offset + nbytes, ref.device, "staging")
        if nbytes == 0:
            continue
        raw = staging[offset : offset + nbytes]
        word = ref.element_size()
        if nh == ref.shape[1]:  # whole token rows: measured faster with wide words
            word = _word_size(raw, layers, ref.shape[2] * ref.element_size())
        block = raw.view(INT_DTYPES[word]).view(len(layers), num_tokens, nh, -1)
        for i, layer in enumerate(layers):
            dst = layer.view(INT_DTYPES[word])[:, dst_head_start : dst_head_start + nh]
            dst.index_copy_(0, tok, block[i])


BACKEND = KernelBackend("torch", gather_to_staging, scatter_from_staging)
