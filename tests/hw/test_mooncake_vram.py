"""GPU memory on the Mooncake transfer engine: when it is registered, and the refusals.

The decision (:func:`gpu_memory_support`) is tested from its inputs; the rest runs the engine
installed here (the build without CUDA on a CPU host: every VRAM path must refuse, up front and
with the reason, before a device pointer reaches it). Where a CUDA build and a GPU are present,
the last test moves VRAM between two real endpoints and checks every byte.
"""

from __future__ import annotations

import pytest
import torch

from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.hw.launcher import HwOptions
from twin.hw.mooncake_transport import (
    GPU_PROTOCOLS,
    MooncakeEndpoint,
    choose_transport,
    engine_available,
    engine_gpu_support,
    gpu_memory_support,
    mooncake_protocol,
    probe_vram,
)
from twin.hw.nixl_transport import TransferError
from twin.hw.run import HwInputError, run_hw
from twin.workloads import fixed

pytestmark = pytest.mark.hw
needs_engine = pytest.mark.skipif(engine_available() is not None,
                                  reason=str(engine_available()))
#: Why the engine here cannot register VRAM (None: a CUDA build whose protocol moves it).
VRAM_REFUSAL = engine_gpu_support()


def test_vram_needs_a_cuda_build_and_a_protocol_that_moves_it() -> None:
    for protocol in ("tcp", "rdma", "nvlink"):
        why = gpu_memory_support(protocol, cuda_build=False)
        assert why is not None and "built without CUDA" in why and "SUPPORT_CUDA" in why
        assert "mooncake-transfer-engine" in why and "NIXL" in why
    assert gpu_memory_support("rdma", cuda_build=True) is None
    assert gpu_memory_support("tcp", cuda_build=True) is None
    why = gpu_memory_support("nvlink", cuda_build=True)
    assert why is not None and "'nvlink'" in why and "TWIN_MOONCAKE_PROTOCOL" in why
    assert "NIXL" in why
    assert set(GPU_PROTOCOLS) == {"rdma", "tcp"}


def test_the_protocol_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TWIN_MOONCAKE_PROTOCOL", raising=False)
    assert mooncake_protocol() == "tcp"
    monkeypatch.setenv("TWIN_MOONCAKE_PROTOCOL", "rdma")
    assert mooncake_protocol() == "rdma"


def test_without_the_engine_vram_is_refused_for_that_reason() -> None:
    why = engine_available()
    if why is None:
        pytest.skip("the engine imports here")
    assert engine_gpu_support() == why and probe_vram() == why


@needs_engine
def test_the_engine_here_decides_from_its_build_flag() -> None:
    import mooncake.engine as engine

    cuda_build = bool(getattr(engine, "SUPPORT_CUDA", False))
    assert engine_gpu_support("tcp") == gpu_memory_support("tcp", cuda_build)
    assert engine_gpu_support("bogus") is not None
    if VRAM_REFUSAL is not None:  # the probe stops before CUDA is touched
        assert probe_vram() == VRAM_REFUSAL


@needs_engine
def test_transport_choice_for_cuda_ranks_follows_the_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TWIN_HW_TRANSPORT", raising=False)
    monkeypatch.delenv("TWIN_MOONCAKE_PROTOCOL", raising=False)
    assert choose_transport("mooncake", "cpu")[0] == "mooncake"  # host memory: unchanged
    assert choose_transport("nixl", "cuda")[0] == "nixl"
    transport, note = choose_transport("mooncake", "cuda:0")
    if VRAM_REFUSAL is None:
        assert transport == "mooncake" and "VRAM over tcp" in note
    else:  # the bytes move over NIXL, and the transfers line says why
        assert transport == "nixl" and VRAM_REFUSAL in note
    monkeypatch.setenv("TWIN_HW_TRANSPORT", "nixl")
    assert choose_transport("mooncake", "cuda")[0] == "nixl"
    # Mooncake forced: VRAM registered, or refused up front with the reason.
    monkeypatch.setenv("TWIN_HW_TRANSPORT", "mooncake")
    assert choose_transport("mooncake", "cpu")[0] == "mooncake"
    if VRAM_REFUSAL is None:
        assert choose_transport("mooncake", "cuda")[0] == "mooncake"
    else:
        with pytest.raises(ValueError, match="TWIN_HW_TRANSPORT=mooncake with ranks on cuda"):
            choose_transport("mooncake", "cuda")
    monkeypatch.setenv("TWIN_MOONCAKE_PROTOCOL", "bogus")
    with pytest.raises(ValueError, match="bogus|built without CUDA"):
        choose_transport("nixl", "cuda")


@needs_engine
def test_a_forced_mooncake_gpu_run_is_refused_before_any_rank_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    if VRAM_REFUSAL is None:
        pytest.skip("this engine registers VRAM")
    monkeypatch.setenv("TWIN_HW_TRANSPORT", "mooncake")
    tiny = ModelShape(num_layers=2, num_kv_heads=4, head_dim=32, dtype_bytes=2)
    cfg = TwinConfig(prefill=ServerSide(tp_size=2), decode=ServerSide(tp_size=1), model=tiny,
                     chunked_prefill_size=64, page_size=16, staging_pool_size_mb=2)
    with pytest.raises(HwInputError, match="SUPPORT_CUDA") as err:
        run_hw(cfg, fixed([(0.0, 300, 4, 0)]), options=HwOptions(device="cuda"))
    assert "NIXL" in str(err.value)


class _CudaLooking:
    """A host tensor that says it lives on ``cuda:0``: what the endpoint must refuse without
    handing its pointer to an engine that cannot move device memory."""

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t
        self.device = torch.device("cuda:0")

    def is_contiguous(self) -> bool:
        return True

    def data_ptr(self) -> int:
        return self._t.data_ptr()

    def numel(self) -> int:
        return self._t.numel()

    def element_size(self) -> int:
        return 1


@needs_engine
def test_the_endpoint_refuses_memory_it_cannot_move() -> None:
    with MooncakeEndpoint("vram-refusal", workers=1) as ep:
        assert ep.vram_refusal == engine_gpu_support(ep.protocol)
        if ep.vram_refusal is not None:
            with pytest.raises(TransferError, match="cannot register cuda:0 memory") as err:
                ep.register(_CudaLooking(torch.zeros(4096, dtype=torch.uint8)))  # type: ignore[arg-type]
            assert ep.vram_refusal in str(err.value)
        with pytest.raises(TransferError, match="not meta"):
            ep.register(torch.empty(4096, dtype=torch.uint8, device="meta"))
        assert ep.regions() == []
        region = ep.register(torch.zeros(4096, dtype=torch.uint8))  # host memory still works
        assert region.mem == "DRAM" and ep.regions() == [region]


@needs_engine
@pytest.mark.skipif(not torch.cuda.is_available() or VRAM_REFUSAL is not None,
                    reason=f"needs a GPU and an engine that registers VRAM: {VRAM_REFUSAL}")
def test_vram_to_vram_lands_every_byte() -> None:
    assert probe_vram("cuda:0") is None
    a, b = MooncakeEndpoint("vram-a", workers=1), MooncakeEndpoint("vram-b", workers=1)
    try:
        n = 3 << 20
        src = (torch.arange(n, dtype=torch.int32, device="cuda") % 251).to(torch.uint8)
        dst = torch.zeros(4 << 20, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        local = a.register(src)
        region = b.register(dst)
        assert local.mem == region.mem == "VRAM" and region.dev_id == dst.device.index
        peer = a.add_peer(b.metadata())
        h = a.write(src, peer, region, 4096, n)
        a.wait(h, timeout_s=60)
        assert torch.equal(dst[4096:4096 + n], src)
        assert int(dst[:4096].count_nonzero()) == 0
    finally:
        a.close()
        b.close()
