"""What every gather/scatter implementation shares: the layout contract, checks and tables.

Layout contract (same as sglang's staging buffer). A KV pool layer is a tensor
``[pool_tokens, heads, head_dim]``; chunk token ``t`` lives at pool token
``page_indices[t // page_size] * page_size + t % page_size``, so a chunk always has
``len(page_indices) * page_size`` tokens. One writer's staging block is every K layer then every
V layer, each ``[num_tokens, num_heads, head_dim]`` in the pool dtype, packed back to back. A
decode region holds ``num_writers`` such blocks, writer ``w`` at ``w * per_writer_bytes``; its
heads land at the ``dst_head_start`` given by :func:`compute_head_slice_params`.

All copies are bit-preserving: data is moved through an integer view of the element size, so NaN
payloads and signed zeros survive. Scatter assumes the page indices are distinct.

This module imports nothing from the other kernel modules; they all import it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from twin.core.layout import compute_head_slice_params, compute_staging_layout

PageIndices = torch.Tensor | np.ndarray | Sequence[int]
GatherFn = Callable[..., int]
ScatterFn = Callable[..., None]

INT_DTYPES: dict[int, torch.dtype] = {
    1: torch.int8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}
NP_INT_DTYPES: dict[int, type] = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}

# Device-resident index tables (layer pointers, writer head offsets, page offsets), by value.
_TABLE_CACHE_SIZE = 256

__all__ = [
    "GatherFn",
    "KernelBackend",
    "PageIndices",
    "ScatterFn",
    "bytes_as_elems",
    "check_heads",
    "check_pools",
    "check_staging",
    "device_table",
    "int_view",
    "pool_token_indices",
    "staging_bytes",
    "writer_blocks",
]


@dataclass(frozen=True)
class KernelBackend:
    """A gather/scatter implementation pair; both follow the torch functions' contracts."""

    name: str
    gather_to_staging: GatherFn
    scatter_from_staging: ScatterFn


def int_view(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret ``t`` as the signed integer dtype of the same element size (no copy)."""
    try:
        return t.view(INT_DTYPES[t.element_size()])
    except KeyError:
        raise TypeError(f"unsupported element size {t.element_size()} for {t.dtype}") from None


def bytes_as_elems(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """View uint8 ``buf`` as the integer dtype of ``like``'s element size (no copy)."""
    return buf.view(INT_DTYPES[like.element_size()])


class _TableCache:
    """Small LRU of int64 tensors keyed by their values and device.

    A table that a kernel reads (a layer pointer table, writer head offsets) depends only on the
    layout, not on the chunk, so it is built and copied to the device once per layout instead of
    on every call. Tables are never written after creation, so sharing them between calls (and
    queued kernels) is safe; the key is the values themselves, so a table is correct even if a
    tensor it points to is freed and another one is allocated at the same address.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.tables: OrderedDict[tuple[str, tuple[int, ...]], torch.Tensor] = OrderedDict()
        self.misses = 0

    def get(self, values: tuple[int, ...], device: torch.device) -> torch.Tensor:
        key = (str(device), values)
        table = self.tables.get(key)
        if table is not None:
            self.tables.move_to_end(key)
            return table
        self.misses += 1
        table = torch.tensor(values, dtype=torch.int64, device=device)
        self.tables[key] = table
        if len(self.tables) > self.size:
            self.tables.popitem(last=False)
        return table


_TABLES = _TableCache(_TABLE_CACHE_SIZE)


def device_table(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """An int64 tensor of ``values`` on ``device``, cached per (device, values); never write it."""
    return _TABLES.get(tuple(int(v) for v in values), torch.device(device))


def table_cache_misses() -> int:
    """How many tables were built so far (a test hook: repeated layouts must not add any)."""
    return _TABLES.misses


def pool_token_indices(
    page_indices: PageIndices, page_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Return the int64 pool token index of every chunk token, ``len(pages) * page_size`` long."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if isinstance(page_indices, torch.Tensor):
        pages = page_indices.to(device=device, dtype=torch.int64).reshape(-1)
    else:
        pages = torch.as_tensor(np.asarray(page_indices, dtype=np.int64).reshape(-1), device=device)
    if page_size == 1:
        return pages
    offsets = device_table(range(page_size), pages.device)
    return (pages.unsqueeze(1) * page_size + offsets).reshape(-1)


def check_pools(k_layers: Sequence[torch.Tensor], v_layers: Sequence[torch.Tensor]) -> None:
    """K and V layer lists: non-empty, equal length, one shape, dtype and device."""
    if not k_layers or len(k_layers) != len(v_layers):
        raise ValueError("k_layers and v_layers must be non-empty and of equal length")
    ref = k_layers[0]
    if ref.dim() != 3:
        raise ValueError(
            f"KV layers must be [pool_tokens, heads, head_dim], got {tuple(ref.shape)}"
        )
    for t in (*k_layers, *v_layers):
        if t.shape != ref.shape or t.dtype != ref.dtype or t.device != ref.device:
            raise ValueError("all KV layers must share shape, dtype and device")


def check_staging(buf: torch.Tensor, need: int, device: torch.device, what: str) -> None:
    """``buf`` is a 1-D uint8 tensor on ``device`` with at least ``need`` bytes."""
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError(f"{what} must be a 1-D uint8 tensor")
    if buf.numel() < need:
        raise ValueError(f"{what} holds {buf.numel()} bytes, need {need}")
    if buf.device != device:
        raise ValueError(f"{what} is on {buf.device}, KV layers on {device}")


def check_heads(k_layers: Sequence[torch.Tensor], head_start: int, num_heads: int) -> None:
    """``[head_start, head_start + num_heads)`` lies inside the pool's heads."""
    heads = k_layers[0].shape[1]
    if head_start < 0 or num_heads < 0 or head_start + num_heads > heads:
        raise ValueError(
            f"head slice [{head_start}, {head_start + num_heads}) outside {heads} heads"
        )


def staging_bytes(k_layers: Sequence[torch.Tensor], num_tokens: int, num_heads: int) -> int:
    """Bytes of one writer block: ``2 * layers * num_tokens * num_heads * head_dim * elem``."""
    ref = k_layers[0]
    return 2 * len(k_layers) * num_tokens * num_heads * ref.shape[2] * ref.element_size()


@lru_cache(maxsize=1024)
def _writer_blocks(
    num_layers: int,
    bytes_per_head_token: int,
    num_tokens: int,
    src_tp: int,
    dst_tp: int,
    dst_rank: int,
    total_kv_heads: int,
) -> tuple[tuple[int, int, int], ...]:
    num_writers, writer_bytes, _ = compute_staging_layout(
        src_tp, dst_tp, dst_rank, total_kv_heads, num_tokens, bytes_per_head_token, num_layers
    )
    blocks = []
    offset = 0
    for w in range(num_writers):
        _, nh, dst_head_start, _ = compute_head_slice_params(
            src_tp, dst_tp, w, dst_rank, total_kv_heads
        )
        blocks.append((offset, nh, dst_head_start))
        offset += writer_bytes[w]
    return tuple(blocks)


def writer_blocks(
    k_layers: Sequence[torch.Tensor],
    num_tokens: int,
    src_tp: int,
    dst_tp: int,
    dst_rank: int,
    total_kv_heads: int,
) -> tuple[tuple[int, int, int], ...]:
    """``(byte_offset, num_heads, dst_head_start)`` of every writer block in a decode region."""
    ref = k_layers[0]
    return _writer_blocks(len(k_layers), ref.shape[2] * ref.element_size(), num_tokens,
                          src_tp, dst_tp, dst_rank, total_kv_heads)
