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
    from twin.hw import triton_kernels as tk

    got = run_transfer(case, tk.gather_to_staging, tk.scatter_from_staging, device=device)
    want = run_transfer(case, reference_gather, reference_scatter)
    assert_same_transfer(got, want)


if CHILD:

    def test_kernels_are_interpreted() -> None:
        from twin.hw import triton_kernels as tk

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
        from twin.hw import triton_kernels as tk

        if tk.interpreted():
            pytest.skip("kernels were built for the interpreter in this process")
        k = [torch.zeros(16, 2, 8, dtype=torch.bfloat16)]
        out = torch.empty(1024, dtype=torch.uint8)
        with pytest.raises(RuntimeError, match="CUDA"):
            tk.gather_to_staging(k, k, [0], 16, 0, 2, out)

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
