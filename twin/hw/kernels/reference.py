"""The reference gather/scatter: explicit loops through host numpy arrays, the tests' oracle.

Slow on purpose and written from the layout contract in :mod:`twin.hw.kernels.common` alone, so
the torch and Triton backends are checked against something that shares none of their indexing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from twin.core.layout import compute_head_slice_params
from twin.hw.kernels.common import NP_INT_DTYPES, PageIndices, int_view

__all__ = ["reference_gather", "reference_scatter"]


def _host_ints(t: torch.Tensor) -> np.ndarray:
    """Integer numpy copy of ``t`` (same bits)."""
    return int_view(t).detach().cpu().numpy().copy()


def _page_list(page_indices: PageIndices) -> list[int]:
    if isinstance(page_indices, torch.Tensor):
        return [int(p) for p in page_indices.reshape(-1).tolist()]
    return [int(p) for p in np.asarray(page_indices).reshape(-1)]


def reference_gather(
    k_layers: Sequence[torch.Tensor],
    v_layers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    page_size: int,
    head_start: int,
    num_heads: int,
    out: torch.Tensor,
) -> int:
    """Oracle for ``gather_to_staging``: one token at a time, through host numpy arrays."""
    pages = _page_list(page_indices)
    num_tokens = len(pages) * page_size
    elem = k_layers[0].element_size()
    head_dim = k_layers[0].shape[2]
    chunk = []
    for layer in (*k_layers, *v_layers):
        src = _host_ints(layer)
        for t in range(num_tokens):
            pool_token = pages[t // page_size] * page_size + t % page_size
            chunk.append(src[pool_token, head_start : head_start + num_heads, :].tobytes())
    data = b"".join(chunk)
    assert len(data) == 2 * len(k_layers) * num_tokens * num_heads * head_dim * elem
    if len(data):
        out[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return len(data)


def reference_scatter(
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
    """Oracle for ``scatter_from_staging``: explicit loops over writers, layers, tokens."""
    pages = _page_list(page_indices)
    num_tokens = len(pages) * page_size
    ref = k_layers[0]
    head_dim, elem = ref.shape[2], ref.element_size()
    np_int = NP_INT_DTYPES[elem]
    raw = staging.detach().cpu().numpy()
    num_writers = src_tp // max(1, dst_tp) if src_tp > dst_tp else 1
    layers = [*k_layers, *v_layers]
    hosts = [_host_ints(t) for t in layers]
    offset = 0
    for w in range(num_writers):
        _, nh, dst_head_start, _ = compute_head_slice_params(
            src_tp, dst_tp, w, dst_rank, total_kv_heads
        )
        token_bytes = nh * head_dim * elem
        for host in hosts:
            for t in range(num_tokens):
                pool_token = pages[t // page_size] * page_size + t % page_size
                piece = raw[offset : offset + token_bytes].view(np_int).reshape(nh, head_dim)
                host[pool_token, dst_head_start : dst_head_start + nh, :] = piece
                offset += token_bytes
    for layer, host in zip(layers, hosts, strict=True):
        int_view(layer).copy_(torch.from_numpy(host))
