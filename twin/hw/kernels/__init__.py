"""Staging-buffer gather/scatter kernels: one chooser over separate backend modules.

- :mod:`~twin.hw.kernels.common`: the layout contract, argument checks, cached device tables;
- :mod:`~twin.hw.kernels.reference`: the loop-based oracle the tests compare against;
- :mod:`~twin.hw.kernels.torch_backend`: ``index_select`` / ``index_copy_``, CPU and CUDA;
- :mod:`~twin.hw.kernels.triton_backend`: fused Triton kernels (CUDA, or CPU under
  ``TRITON_INTERPRET=1``), imported only when chosen.

Every backend module imports ``common`` and nothing else from this package; this file is the one
place that picks a backend (:func:`get_kernels`) and warms it up before a rank reports ready
(:func:`warm_up`, :func:`warm_up_rank`). The names below are the package's public interface.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterable, Sequence

import torch

from twin.core.layout import (
    compute_head_slice_params,
    num_tp_writers,
    target_decode_ranks,
)
from twin.hw.kernels.common import (
    KernelBackend,
    PageIndices,
    bytes_as_elems,
    int_view,
    pool_token_indices,
    staging_bytes,
)
from twin.hw.kernels.reference import reference_gather, reference_scatter
from twin.hw.kernels.torch_backend import BACKEND as TORCH_BACKEND
from twin.hw.kernels.torch_backend import gather_to_staging, scatter_from_staging

KERNEL_NAMES = ("torch", "triton")

__all__ = [
    "KERNEL_NAMES",
    "TORCH_BACKEND",
    "KernelBackend",
    "PageIndices",
    "bytes_as_elems",
    "compute_head_slice_params",
    "gather_to_staging",
    "get_kernels",
    "int_view",
    "pool_token_indices",
    "reference_gather",
    "reference_scatter",
    "scatter_from_staging",
    "staging_bytes",
    "triton_available",
    "warm_up",
    "warm_up_rank",
]


def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # blocked or half-imported module
        return False


def _triton_backend() -> KernelBackend:
    from twin.hw.kernels import triton_backend

    if not triton_backend.HAS_TRITON:
        raise RuntimeError("the triton kernels were asked for, but triton cannot be imported")
    return triton_backend.BACKEND


def get_kernels(device: torch.device | str, name: str | None = None) -> KernelBackend:
    """The kernel backend for ``device``.

    ``name`` is ``"torch"``, ``"triton"`` (raises if triton cannot be imported; on CPU tensors
    it needs ``TRITON_INTERPRET=1``), or ``None`` / ``""`` / ``"auto"``: Triton on CUDA when it
    is importable and compiled (not the interpreter), torch everywhere else.
    """
    choice = (name or "auto").strip().lower()
    if choice == "torch":
        return TORCH_BACKEND
    if choice == "triton":
        if not triton_available():
            raise RuntimeError("the triton kernels were asked for, but triton is not installed")
        return _triton_backend()
    if choice != "auto":
        raise ValueError(f"kernels must be one of auto, {', '.join(KERNEL_NAMES)}; got {name!r}")
    if torch.device(device).type == "cuda" and triton_available():
        from twin.hw.kernels import triton_backend

        if triton_backend.HAS_TRITON and not triton_backend.interpreted():
            return triton_backend.BACKEND
    return TORCH_BACKEND


def warm_up(
    backend: KernelBackend,
    k_layers: Sequence[torch.Tensor],
    v_layers: Sequence[torch.Tensor],
    page_size: int,
    *,
    gathers: Iterable[tuple[int, int]] = (),
    scatters: Iterable[tuple[int, int, int, int]] = (),
) -> float:
    """Run each gather ``(head_start, num_heads)`` and scatter ``(src_tp, dst_tp, dst_rank,
    total_kv_heads)`` once on one page of scratch layers shaped like the pool; return seconds.

    The first launch of a Triton kernel compiles it (seconds); done in a rank's loop it would
    stall the rank long enough to look like a wedge. The scratch layers have the pool's layer
    count, row shape, dtype and device, so the calls compile exactly the variants the rank will
    launch; the pool itself is not touched. Waits for the device before returning.
    """
    t0 = time.perf_counter()
    ref = k_layers[0]
    shape = (page_size, *ref.shape[1:])
    k = [torch.zeros(shape, dtype=ref.dtype, device=ref.device) for _ in k_layers]
    v = [torch.zeros(shape, dtype=ref.dtype, device=ref.device) for _ in v_layers]
    for head_start, num_heads in sorted(set(gathers)):
        out = torch.empty(max(1, staging_bytes(k, page_size, num_heads)), dtype=torch.uint8,
                          device=ref.device)
        backend.gather_to_staging(k, v, [0], page_size, head_start, num_heads, out)
    for src_tp, dst_tp, dst_rank, total_kv_heads in sorted(set(scatters)):
        _, nh, _, _ = compute_head_slice_params(src_tp, dst_tp, 0, dst_rank, total_kv_heads)
        region = torch.zeros(staging_bytes(k, page_size, nh) * num_tp_writers(src_tp, dst_tp),
                             dtype=torch.uint8, device=ref.device)
        backend.scatter_from_staging(region, k, v, [0], page_size, src_tp, dst_tp, dst_rank,
                                     total_kv_heads)
    if ref.device.type == "cuda":
        torch.cuda.synchronize(ref.device)
    return time.perf_counter() - t0


def warm_up_rank(
    backend: KernelBackend,
    k_layers: Sequence[torch.Tensor],
    v_layers: Sequence[torch.Tensor],
    page_size: int,
    *,
    role: str,
    rank: int,
    prefill_attn_tp: int,
    decode_attn_tp: int,
    total_kv_heads: int,
) -> float:
    """:func:`warm_up` with the layouts attention-TP rank ``rank`` of ``role`` will launch."""
    p, d = prefill_attn_tp, decode_attn_tp
    if role == "prefill":
        gathers = [compute_head_slice_params(p, d, rank, dst, total_kv_heads)[:2]
                   for dst in target_decode_ranks(p, d, rank)]
        return warm_up(backend, k_layers, v_layers, page_size, gathers=gathers)
    return warm_up(backend, k_layers, v_layers, page_size, scatters=[(p, d, rank, total_kv_heads)])
