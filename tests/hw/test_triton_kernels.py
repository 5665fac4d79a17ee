"""Fused Triton kernels against the reference, byte for byte.

The interpreter (``TRITON_INTERPRET=1``) only takes effect for kernels decorated after it is set,
and setting it here would leak into every later test of the session. So in the normal pytest run
this module has a single test that re-runs this same file in a child pytest process with the
variable set; the child (``TWIN_TRITON_CHILD=1``) defines the real interpreter tests. Tests of the
compiled kernels run in the parent and need CUDA.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from twin.hw.kernels import int_view, reference_gather, reference_scatter, triton_available
from twin.hw.kvpattern import TransferCase, TransferResult, run_transfer

CHILD = os.environ.get("TWIN_TRITON_CHILD") == "1"
REPO = Path(__file__).resolve().parents[2]

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TP_CONFIGS = [
    (2, 1, 8),
    (1, 2, 8),
    (4, 2, 8),
    (2, 4, 8),
    (4, 1, 2),
    (4, 2, 2),
    (1, 4, 2),
]


def assert_same_transfer(a: TransferResult, b: TransferResult) -> None:
    assert a.mismatches == [None] * len(a.mismatches), a.mismatches
    for ra, rb in zip(a.regions, b.regions, strict=True):
        assert torch.equal(ra.cpu(), rb.cpu())
    for pa, pb in zip(a.decode_k + a.decode_v, b.decode_k + b.decode_v, strict=True):
        for x, y in zip(pa, pb, strict=True):
            assert torch.equal(int_view(x).cpu(), int_view(y).cpu())


def check_case(case: TransferCase, device: str) -> None:
    from twin.hw.kernels import triton_backend as tk

    got = run_transfer(case, tk.gather_to_staging, tk.scatter_from_staging, device=device)
    want = run_transfer(case, reference_gather, reference_scatter)
    assert_same_transfer(got, want)


if CHILD:

    def test_kernels_are_interpreted() -> None:
        from twin.hw.kernels import triton_backend as tk

        assert tk.interpreted()

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
    @pytest.mark.parametrize("page_size", [1, 16])
    @pytest.mark.parametrize("src_tp,dst_tp,heads", TP_CONFIGS)
    def test_interpreted_matches_reference(
        src_tp: int, dst_tp: int, heads: int, page_size: int, dtype: torch.dtype
    ) -> None:
        case = TransferCase(
            src_tp,
            dst_tp,
            heads,
            page_size=page_size,
            chunk_pages=2 if page_size > 1 else 24,
            pool_pages=4 if page_size > 1 else 40,
            dtype=dtype,
            token_offset=16,
            seed=src_tp * 100 + dst_tp * 10 + page_size,
        )
        check_case(case, "cpu")

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "fp8"])
    def test_interpreted_other_element_sizes(dtype: torch.dtype) -> None:
        check_case(TransferCase(4, 2, 8, dtype=dtype, seed=5), "cpu")

    def test_interpreted_head_dim_not_power_of_two() -> None:
        check_case(TransferCase(2, 1, 4, head_dim=96, num_layers=3, chunk_pages=3), "cpu")

    @pytest.mark.parametrize("src_tp,dst_tp,heads", [(1, 1, 16), (2, 1, 32), (1, 2, 32)])
    def test_interpreted_several_element_blocks(src_tp: int, dst_tp: int, heads: int) -> None:
        """Rows of 2048 elements (16 heads x 128): two element blocks per token."""
        from twin.hw.kernels import triton_backend as tk

        assert tk._blocks(16 * 128)[1] * 2 == 16 * 128
        check_case(TransferCase(src_tp, dst_tp, heads, head_dim=128, num_layers=1,
                                page_size=16, chunk_pages=1, pool_pages=2, seed=3), "cpu")

    @pytest.mark.parametrize(
        "src_tp,dst_tp,heads,head_dim,page_size",
        [
            (2, 1, 4, 32, 16),  # examples/tp2-tp1-small.toml (the GPU check's run)
            (4, 2, 8, 128, 16),  # examples/8gpu-tp4-tp2.toml
            (4, 2, 8, 128, 64),
            (2, 4, 8, 128, 64),
            (8, 2, 8, 128, 1),
        ],
    )
    def test_interpreted_twin_hw_geometries(
        src_tp: int, dst_tp: int, heads: int, head_dim: int, page_size: int
    ) -> None:
        pages = max(1, 32 // page_size)
        check_case(TransferCase(src_tp, dst_tp, heads, head_dim=head_dim, num_layers=2,
                                page_size=page_size, chunk_pages=pages, pool_pages=2 * pages,
                                token_offset=page_size, seed=page_size), "cpu")

    def test_interpreted_tables_cached_and_warm_up() -> None:
        from twin.hw.kernels import get_kernels, warm_up_rank
        from twin.hw.kernels.common import table_cache_misses

        backend = get_kernels("cpu", "triton")
        assert backend.name == "triton"
        k = [torch.zeros(16 * 6, 2, 32, dtype=torch.bfloat16) for _ in range(2)]
        v = [torch.zeros(16 * 6, 2, 32, dtype=torch.bfloat16) for _ in range(2)]
        warm_up_rank(backend, k, v, 16, role="prefill", rank=1, prefill_attn_tp=2,
                     decode_attn_tp=1, total_kv_heads=4)
        assert not any(bool(t.any()) for t in (*k, *v))  # scratch layers, not the pool
        out = torch.empty(2 * 2 * 32 * 2 * 2 * 32, dtype=torch.uint8)
        backend.gather_to_staging(k, v, [0, 1], 16, 0, 2, out)
        backend.scatter_from_staging(out, k, v, [2, 3], 16, 1, 1, 0, 2)
        before = table_cache_misses()
        for pages in ([4, 5], [3, 1], [0, 2]):
            backend.gather_to_staging(k, v, pages, 16, 0, 2, out)
            backend.scatter_from_staging(out, k, v, pages[::-1], 16, 1, 1, 0, 2)
        assert table_cache_misses() == before

else:

    @needs_triton
    def test_triton_interpreter_in_subprocess() -> None:
        env = dict(os.environ, TRITON_INTERPRET="1", TWIN_TRITON_CHILD="1")
        env.pop("TWIN_KERNELS", None)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-o",
                "addopts=",
                "-q",
                "-p",
                "no:cacheprovider",
                __file__,
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
        assert re.search(r"\b\d+ passed", proc.stdout), proc.stdout[-2000:]
        assert "skipped" not in proc.stdout, proc.stdout[-2000:]

    @needs_triton
    def test_cpu_tensors_rejected_without_interpreter() -> None:
        from twin.hw.kernels import triton_backend as tk

        if tk.interpreted():
            pytest.skip("kernels were built for the interpreter in this process")
        k = [torch.zeros(16, 2, 8, dtype=torch.bfloat16)]
        out = torch.empty(1024, dtype=torch.uint8)
        with pytest.raises(RuntimeError, match="CUDA"):
            tk.gather_to_staging(k, k, [0], 16, 0, 2, out)

    @needs_triton
    @pytest.mark.parametrize(
        "int_type,page_size,elems",
        [("i16", 16, 2 * 32), ("i16", 16, 2 * 128), ("i16", 1, 16 * 128), ("i8", 64, 4 * 128)],
        ids=["bf16-tp2tp1-small", "bf16-8gpu", "bf16-page1-two-blocks", "fp8-page64"],
    )
    def test_kernels_compile_for_hopper(int_type: str, page_size: int, elems: int) -> None:
        """Both kernels compile to an sm_90 cubin (the H200) with no GPU present, with the block
        sizes the wrappers pick, so a kernel that cannot compile fails here, not on the GPU."""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from twin.hw.kernels import triton_backend as tk

        if tk.interpreted():
            pytest.skip("kernels were built for the interpreter in this process")
        block_t, block_e = tk._blocks(elems)
        consts = {"PAGE_SIZE": page_size, "BLOCK_T": block_t, "BLOCK_E": block_e}
        common = {"layer_ptrs": "*i64", "pages": "*i64", "staging": f"*{int_type}"}
        gather = {**common, "num_tokens": "i32", "elems_per_token": "i32",
                  "token_stride": "i32", "head_offset": "i32"}
        scatter = {**common, "writer_head_offsets": "*i64", "num_layers_x2": "i32",
                   "num_tokens": "i32", "elems_per_token": "i32", "token_stride": "i32"}
        for fn, sig in ((tk._gather_kernel, gather), (tk._scatter_kernel, scatter)):
            sig = {**sig, **dict.fromkeys(consts, "constexpr")}
            compiled = triton.compile(ASTSource(fn, sig, constexprs=consts),
                                      target=GPUTarget("cuda", 90, 32))
            assert compiled.asm["cubin"], fn

    @needs_cuda
    @needs_triton
    @pytest.mark.parametrize("page_size", [1, 16])
    @pytest.mark.parametrize("src_tp,dst_tp,heads", TP_CONFIGS)
    def test_cuda_matches_reference(src_tp: int, dst_tp: int, heads: int, page_size: int) -> None:
        case = TransferCase(
            src_tp,
            dst_tp,
            heads,
            page_size=page_size,
            chunk_pages=2 if page_size > 1 else 24,
            pool_pages=4 if page_size > 1 else 40,
            seed=7,
        )
        check_case(case, "cuda")

    @needs_cuda
    @needs_triton
    def test_cuda_large_chunk() -> None:
        """Several token and element blocks per layer, realistic head size."""
        case = TransferCase(2, 1, 8, num_layers=4, head_dim=128, chunk_pages=20, pool_pages=40)
        check_case(case, "cuda")
