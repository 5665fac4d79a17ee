"""Staging-buffer gather/scatter kernels (torch backend, reference oracle, backend selector).

Layout contract (same as sglang's staging buffer). A KV pool layer is a tensor
``[pool_tokens, heads, head_dim]``; chunk token ``t`` lives at pool token
``page_indices[t // page_size] * page_size + t % page_size``, so a chunk always has
``len(page_indices) * page_size`` tokens. One writer's staging block is every K layer then every
V layer, each ``[num_tokens, num_heads, head_dim]`` in the pool dtype, packed back to back. A
decode region holds ``num_writers`` such blocks, writer ``w`` at ``w * per_writer_bytes``; its
heads land at the ``dst_head_start`` given by :func:`compute_head_slice_params`.

All copies are bit-preserving: data is moved through an integer view of the element size, so NaN
payloads and signed zeros survive. Scatter assumes the page indices are distinct.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from twin.core.layout import compute_head_slice_params, compute_staging_layout

PageIndices = torch.Tensor | np.ndarray | Sequence[int]

_INT_DTYPES: dict[int, torch.dtype] = {
    1: torch.int8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}
_NP_INT_DTYPES: dict[int, type] = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}

__all__ = [
    "KernelBackend",
    "PageIndices",
    "compute_head_slice_params",
    "gather_to_staging",
    "bytes_as_elems",
    "get_kernels",
    "int_view",
    "pool_token_indices",
    "reference_gather",
    "reference_scatter",
    "scatter_from_staging",
    "staging_bytes",
    "triton_available",
]


def int_view(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret ``t`` as the signed integer dtype of the same element size (no copy)."""
    try:
        return t.view(_INT_DTYPES[t.element_size()])
    except KeyError:
        raise TypeError(f"unsupported element size {t.element_size()} for {t.dtype}") from None


def bytes_as_elems(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """View uint8 ``buf`` as the integer dtype of ``like``'s element size (no copy)."""
    return buf.view(_INT_DTYPES[like.element_size()])


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
    offsets = torch.arange(page_size, dtype=torch.int64, device=pages.device)
    return (pages.unsqueeze(1) * page_size + offsets).reshape(-1)


def _check_pools(k_layers: Sequence[torch.Tensor], v_layers: Sequence[torch.Tensor]) -> None:
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


def _check_staging(buf: torch.Tensor, need: int, device: torch.device, what: str) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError(f"{what} must be a 1-D uint8 tensor")
    if buf.numel() < need:
        raise ValueError(f"{what} holds {buf.numel()} bytes, need {need}")
    if buf.device != device:
        raise ValueError(f"{what} is on {buf.device}, KV layers on {device}")


def staging_bytes(k_layers: Sequence[torch.Tensor], num_tokens: int, num_heads: int) -> int:
    """Bytes of one writer block: ``2 * layers * num_tokens * num_heads * head_dim * elem``."""
    ref = k_layers[0]
    return 2 * len(k_layers) * num_tokens * num_heads * ref.shape[2] * ref.element_size()


def _writer_blocks(
    k_layers: Sequence[torch.Tensor],
    num_tokens: int,
    src_tp: int,
    dst_tp: int,
    dst_rank: int,
    total_kv_heads: int,
) -> list[tuple[int, int, int]]:
    """``(byte_offset, num_heads, dst_head_start)`` of every writer block in a decode region."""
    ref = k_layers[0]
    bytes_per_head_token = ref.shape[2] * ref.element_size()
    num_writers, writer_bytes, _ = compute_staging_layout(
        src_tp, dst_tp, dst_rank, total_kv_heads, num_tokens, bytes_per_head_token, len(k_layers)
    )
    blocks = []
    offset = 0
    for w in range(num_writers):
        _, nh, dst_head_start, _ = compute_head_slice_params(
            src_tp, dst_tp, w, dst_rank, total_kv_heads
        )
        blocks.append((offset, nh, dst_head_start))
        offset += writer_bytes[w]
    return blocks


def _word_size(raw: torch.Tensor, layers: Sequence[torch.Tensor], row_bytes: int) -> int:
    """Widest integer width dividing a head row and every base address.

    ``index_copy_`` moves one element at a time on CPU, so wider words scatter faster; the
    reinterpretation is still bit-exact.
    """
    for word in (8, 4, 2):
        if row_bytes % word == 0 and all(t.data_ptr() % word == 0 for t in (raw, *layers)):
            return word
    return 1


def _check_heads(k_layers: Sequence[torch.Tensor], head_start: int, num_heads: int) -> None:
    heads = k_layers[0].shape[1]
    if head_start < 0 or num_heads < 0 or head_start + num_heads > heads:
        raise ValueError(
            f"head slice [{head_start}, {head_start + num_heads}) outside {heads} heads"
        )


# --------------------------------------------------------------------------- torch backend


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

    ``out`` is a 1-D uint8 tensor on the KV device with at least :func:`staging_bytes` bytes and
    an offset aligned to the element size. Returns the number of bytes written.
    """
    _check_pools(k_layers, v_layers)
    _check_heads(k_layers, head_start, num_heads)
    ref = k_layers[0]
    tok = pool_token_indices(page_indices, page_size, ref.device)
    num_tokens = tok.numel()
    total = staging_bytes(k_layers, num_tokens, num_heads)
    _check_staging(out, total, ref.device, "out")
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
    _check_pools(k_layers, v_layers)
    ref = k_layers[0]
    tok = pool_token_indices(page_indices, page_size, ref.device)
    num_tokens = tok.numel()
    blocks = _writer_blocks(k_layers, num_tokens, src_tp, dst_tp, dst_rank, total_kv_heads)
    layers = (*k_layers, *v_layers)
    for offset, nh, dst_head_start in blocks:
        _check_heads(k_layers, dst_head_start, nh)
        nbytes = staging_bytes(k_layers, num_tokens, nh)
        _check_staging(staging, offset + nbytes, ref.device, "staging")
        if nbytes == 0:
            continue
        raw = staging[offset : offset + nbytes]
        word = ref.element_size()
        if nh == ref.shape[1]:  # whole token rows: measured faster with wide words
            word = _word_size(raw, layers, ref.shape[2] * ref.element_size())
        block = raw.view(_INT_DTYPES[word]).view(len(layers), num_tokens, nh, -1)
        for i, layer in enumerate(layers):
            dst = layer.view(_INT_DTYPES[word])[:, dst_head_start : dst_head_start + nh]
            dst.index_copy_(0, tok, block[i])


# --------------------------------------------------------------------------- reference oracle


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
    """Oracle for :func:`gather_to_staging`: one token at a time, through host numpy arrays."""
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
    """Oracle for :func:`scatter_from_staging`: explicit loops over writers, layers, tokens."""
    pages = _page_list(page_indices)
    num_tokens = len(pages) * page_size
    ref = k_layers[0]
    head_dim, elem = ref.shape[2], ref.element_size()
    np_int = _NP_INT_DTYPES[elem]
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


# --------------------------------------------------------------------------- backend selection


GatherFn = Callable[..., int]
ScatterFn = Callable[..., None]


@dataclass(frozen=True)
class KernelBackend:
    """A gather/scatter implementation pair; both follow the torch functions' contracts."""

    name: str
    gather_to_staging: GatherFn
    scatter_from_staging: ScatterFn


TORCH_BACKEND = KernelBackend("torch", gather_to_staging, scatter_from_staging)


def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # blocked or half-imported module
        return False


def _triton_backend() -> KernelBackend:
    from twin.hw import triton_kernels

    return KernelBackend(
        "triton", triton_kernels.gather_to_staging, triton_kernels.scatter_from_staging
    )


def get_kernels(device: torch.device | str, prefer_triton: bool = True) -> KernelBackend:
    """Pick the kernel backend for ``device``.

    ``TWIN_KERNELS=torch|triton`` forces a backend (``triton`` raises if it is not installed; on
    CPU tensors it needs ``TRITON_INTERPRET=1``). Otherwise Triton is used on CUDA when
    ``prefer_triton`` and triton is importable, and torch everywhere else.
    """
    forced = os.environ.get("TWIN_KERNELS", "").strip().lower()
    if forced == "torch":
        return TORCH_BACKEND
    if forced == "triton":
        if not triton_available():
            raise RuntimeError("TWIN_KERNELS=triton but triton is not installed")
        return _triton_backend()
    if forced:
        raise ValueError(f"TWIN_KERNELS must be 'torch' or 'triton', got {forced!r}")
    if prefer_triton and torch.device(device).type == "cuda" and triton_available():
        from twin.hw import triton_kernels

        if triton_kernels.HAS_TRITON:
            return _triton_backend()
    return TORCH_BACKEND
