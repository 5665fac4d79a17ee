"""Torch staging kernels against the loop-based reference, byte for byte."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from twin.hw.kernels import (
    TORCH_BACKEND,
    gather_to_staging,
    get_kernels,
    int_view,
    pool_token_indices,
    reference_gather,
    reference_scatter,
    scatter_from_staging,
    staging_bytes,
    triton_available,
    warm_up,
    warm_up_rank,
)
from twin.hw.kernels.common import device_table, table_cache_misses
from twin.hw.kvpattern import TransferCase, TransferResult, run_transfer

# (prefill TP, decode TP, total KV heads)
TP_CONFIGS = [
    (2, 1, 8),
    (1, 2, 8),
    (4, 2, 8),
    (2, 4, 8),
    (2, 2, 4),
    (4, 1, 2),  # GQA replication on prefill
    (4, 2, 2),  # GQA replication on prefill, several writers per decode rank
    (1, 4, 2),  # GQA replication on decode
    (8, 4, 2),  # replicated on both sides
]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def assert_same_transfer(a: TransferResult, b: TransferResult) -> None:
    """Identical staging bytes and decode pools (including untouched noise), no mismatches."""
    assert a.mismatches == [None] * len(a.mismatches), a.mismatches
    assert b.mismatches == [None] * len(b.mismatches), b.mismatches
    for ra, rb in zip(a.regions, b.regions, strict=True):
        assert torch.equal(ra.cpu(), rb.cpu())
    for pa, pb in zip(a.decode_k + a.decode_v, b.decode_k + b.decode_v, strict=True):
        for x, y in zip(pa, pb, strict=True):
            assert torch.equal(int_view(x).cpu(), int_view(y).cpu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("src_tp,dst_tp,heads", TP_CONFIGS)
def test_torch_matches_reference(
    src_tp: int, dst_tp: int, heads: int, page_size: int, dtype: torch.dtype
) -> None:
    case = TransferCase(
        src_tp,
        dst_tp,
        heads,
        page_size=page_size,
        chunk_pages=3 if page_size > 1 else 20,
        pool_pages=5 if page_size > 1 else 48,
        dtype=dtype,
        token_offset=64,
        seed=src_tp * 100 + dst_tp * 10 + page_size,
    )
    got = run_transfer(case, gather_to_staging, scatter_from_staging)
    want = run_transfer(case, reference_gather, reference_scatter)
    assert_same_transfer(got, want)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float8_e4m3fn, torch.float64], ids=["fp32", "fp8", "fp64"]
)
def test_other_element_sizes(dtype: torch.dtype) -> None:
    case = TransferCase(4, 2, 8, dtype=dtype, seed=3)
    got = run_transfer(case, gather_to_staging, scatter_from_staging)
    want = run_transfer(case, reference_gather, reference_scatter)
    assert_same_transfer(got, want)


def _noise_layers(n: int, shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int32)
        .to(torch.int16)
        .view(torch.bfloat16)
        for _ in range(n)
    ]


def test_gather_head_slice_and_bounds() -> None:
    """Partial head slice of a noisy pool; bytes past the block stay untouched."""
    page_size, heads, head_dim = 4, 6, 8
    k = _noise_layers(3, (10 * page_size, heads, head_dim), 1)
    v = _noise_layers(3, (10 * page_size, heads, head_dim), 2)
    pages = torch.tensor([7, 2, 9, 0])
    need = staging_bytes(k, 4 * page_size, 2)
    out = torch.full((need + 64,), 0xAB, dtype=torch.uint8)
    ref = torch.full((need + 64,), 0xAB, dtype=torch.uint8)
    assert gather_to_staging(k, v, pages, page_size, 3, 2, out) == need
    assert reference_gather(k, v, pages.numpy(), page_size, 3, 2, ref) == need
    assert torch.equal(out, ref)
    assert bool((out[need:] == 0xAB).all())
    # first staged row is K layer 0, chunk token 0 = pool token 7 * 4, heads 3..4
    first = out[: 2 * head_dim * 2].view(torch.int16)
    assert torch.equal(first, int_view(k[0])[28, 3:5].reshape(-1))


def test_nan_payloads_survive() -> None:
    """Copies move bits, not float values: NaN payloads and -0.0 are kept."""
    bits = torch.tensor([0x7FC1, 0x7F81, -0x8000, 0xFFFF - 0x10000], dtype=torch.int16)
    k = [bits.repeat(8 * 2 * 2).view(8, 2, 8).view(torch.bfloat16).clone()]
    v = [bits.flip(0).repeat(8 * 2 * 2).view(8, 2, 8).view(torch.bfloat16).clone()]
    out = torch.empty(staging_bytes(k, 8, 2), dtype=torch.uint8)
    gather_to_staging(k, v, [1, 0], 4, 0, 2, out)
    dk = [torch.zeros_like(k[0])]
    dv = [torch.zeros_like(v[0])]
    scatter_from_staging(out, dk, dv, [0, 1], 4, 1, 1, 0, 2)
    assert torch.equal(int_view(dk[0]).view(2, 4, 2, 8), int_view(k[0]).view(2, 4, 2, 8).flip(0))
    assert torch.equal(int_view(dv[0]).view(2, 4, 2, 8), int_view(v[0]).view(2, 4, 2, 8).flip(0))


def test_pool_token_indices() -> None:
    assert pool_token_indices([3, 1], 4).tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
    assert pool_token_indices(torch.tensor([5, 2], dtype=torch.int32), 1).tolist() == [5, 2]


def test_size_and_shape_errors() -> None:
    k = _noise_layers(2, (16, 4, 8), 5)
    v = _noise_layers(2, (16, 4, 8), 6)
    small = torch.empty(staging_bytes(k, 8, 2) - 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="need"):
        gather_to_staging(k, v, [0, 1], 4, 0, 2, small)
    with pytest.raises(ValueError, match="uint8"):
        gather_to_staging(k, v, [0, 1], 4, 0, 2, torch.empty(4096, dtype=torch.int16))
    with pytest.raises(ValueError, match="head slice"):
        gather_to_staging(k, v, [0, 1], 4, 3, 2, torch.empty(4096, dtype=torch.uint8))
    with pytest.raises(ValueError, match="equal length"):
        gather_to_staging(k, v[:1], [0, 1], 4, 0, 2, torch.empty(4096, dtype=torch.uint8))
    # 2 writers of 2 heads each: a region of one writer block is too small
    with pytest.raises(ValueError, match="need"):
        scatter_from_staging(
            torch.empty(staging_bytes(k, 8, 2), dtype=torch.uint8), k, v, [0, 1], 4, 4, 2, 0, 8
        )


def test_get_kernels_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """By device, or by an explicit name; the environment plays no part."""
    monkeypatch.setenv("TWIN_KERNELS", "cutlass")  # ignored by the chooser
    assert get_kernels("cpu") is TORCH_BACKEND
    assert get_kernels("cpu", "auto") is TORCH_BACKEND
    assert get_kernels("cuda", "torch") is TORCH_BACKEND
    if triton_available():
        assert get_kernels("cuda").name == "triton"
        assert get_kernels("cpu", "triton").name == "triton"
    with pytest.raises(ValueError, match="cutlass"):
        get_kernels("cpu", "cutlass")


def test_without_triton_falls_back_to_torch() -> None:
    """With triton unimportable the Triton module still imports and selection picks torch."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from twin.hw.kernels import triton_backend as tk\n"
        "from twin.hw.kernels import get_kernels, triton_available\n"
        "assert not tk.HAS_TRITON and not triton_available()\n"
        "assert get_kernels('cuda').name == 'torch'\n"
        "try:\n"
        "    get_kernels('cuda', 'triton')\n"
        "except RuntimeError:\n"
        "    print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TWIN_KERNELS"}
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@needs_cuda
@pytest.mark.parametrize("src_tp,dst_tp,heads", [(2, 1, 8), (1, 2, 8), (4, 2, 2)])
def test_torch_cuda_matches_reference(src_tp: int, dst_tp: int, heads: int) -> None:
    case = TransferCase(src_tp, dst_tp, heads, seed=11)
    got = run_transfer(case, gather_to_staging, scatter_from_staging, device="cuda")
    want = run_transfer(case, reference_gather, reference_scatter)
    assert_same_transfer(got, want)


def test_backend_modules_import_only_common() -> None:
    """No cycles: every kernel module imports ``common`` at most, never the chooser or a peer."""
    pkg = Path(__file__).resolve().parents[2] / "twin" / "hw" / "kernels"
    allowed = {"common": set(), "reference": {"common"}, "torch_backend": {"common"},
               "triton_backend": {"common"}}
    for name, want in allowed.items():
        tree = ast.parse((pkg / f"{name}.py").read_text())
        got = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            for mod in mods:
                if mod == "twin.hw" or mod.startswith("twin.hw."):
                    got.add(mod.removeprefix("twin.hw.kernels").lstrip(".") or "<package>")
        assert got == want, (name, got)


def test_tables_are_built_once_per_layout() -> None:
    """Page-offset tables come from the cache; new chunks of one layout add no table."""
    k = _noise_layers(2, (16 * 8, 4, 8), 7)
    v = _noise_layers(2, (16 * 8, 4, 8), 8)
    out = torch.empty(staging_bytes(k, 32, 4), dtype=torch.uint8)
    gather_to_staging(k, v, [1, 2], 16, 0, 4, out)
    scatter_from_staging(out, k, v, [3, 4], 16, 1, 1, 0, 4)
    before = table_cache_misses()
    for pages in ([5, 0], [7, 6], [2, 3]):
        gather_to_staging(k, v, pages, 16, 0, 4, out)
        scatter_from_staging(out, k, v, pages[::-1], 16, 1, 1, 0, 4)
    assert table_cache_misses() == before
    table = device_table(range(16), "cpu")
    assert table is device_table(range(16), "cpu") and table.tolist() == list(range(16))
    device_table([12345, 678], "cpu")
    assert table_cache_misses() == before + 1


@pytest.mark.parametrize("role,rank", [("prefill", 0), ("prefill", 3), ("decode", 1)])
def test_warm_up_rank_leaves_the_pool_alone(role: str, rank: int) -> None:
    heads = 2 if role == "prefill" else 4  # 8 KV heads: prefill TP4, decode TP2
    k = _noise_layers(3, (16 * 4, heads, 8), 9)
    v = _noise_layers(3, (16 * 4, heads, 8), 10)
    before = [t.clone() for t in (*k, *v)]
    seconds = warm_up_rank(TORCH_BACKEND, k, v, 16, role=role, rank=rank, prefill_attn_tp=4,
                           decode_attn_tp=2, total_kv_heads=8)
    assert seconds >= 0
    for a, b in zip(before, (*k, *v), strict=True):
        assert torch.equal(int_view(a), int_view(b))


def test_warm_up_calls_each_layout_once() -> None:
    calls: list[tuple[str, tuple[int, ...]]] = []

    def gather(k, v, pages, page_size, head_start, nh, out):  # type: ignore[no-untyped-def]
        calls.append(("g", (head_start, nh, out.numel(), len(k), k[0].shape[0])))
        return gather_to_staging(k, v, pages, page_size, head_start, nh, out)

    def scatter(region, k, v, pages, page_size, *layout):  # type: ignore[no-untyped-def]
        calls.append(("s", (*layout, region.numel())))
        scatter_from_staging(region, k, v, pages, page_size, *layout)

    from twin.hw.kernels import KernelBackend

    k = _noise_layers(2, (64, 4, 8), 11)
    warm_up(KernelBackend("spy", gather, scatter), k, k, 16, gathers=[(0, 2), (2, 2), (0, 2)],
            scatters=[(4, 2, 1, 8)])
    per_head_token = 8 * 2 * 2 * 2  # head_dim * bf16 * layers * (K, V)
    assert calls == [("g", (0, 2, 16 * 2 * per_head_token, 2, 16)),
                     ("g", (2, 2, 16 * 2 * per_head_token, 2, 16)),
                     ("s", (4, 2, 1, 8, 2 * 16 * 2 * per_head_token))]


@needs_cuda
def test_cuda_auto_choice_and_warm_up() -> None:
    """On CUDA the chooser picks compiled Triton (when installed) and warm-up compiles it."""
    backend = get_kernels("cuda")
    if triton_available():
        assert backend.name == "triton"
    k = [t.cuda() for t in _noise_layers(4, (16 * 8, 4, 128), 12)]
    v = [t.cuda() for t in _noise_layers(4, (16 * 8, 4, 128), 13)]
    first = warm_up_rank(backend, k, v, 16, role="prefill", rank=0, prefill_attn_tp=2,
                         decode_attn_tp=1, total_kv_heads=8)
    again = warm_up_rank(backend, k, v, 16, role="prefill", rank=0, prefill_attn_tp=2,
                         decode_attn_tp=1, total_kv_heads=8)
    assert again <= max(first, 0.5)
