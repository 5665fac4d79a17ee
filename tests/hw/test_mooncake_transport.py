"""The Mooncake transfer engine on this host: real engines (TCP, P2P handshake), real bytes.

Needs ``mooncake-transfer-engine-non-cuda`` (the ``mooncake`` extra) and the system's
``libibverbs.so.1`` on the loader's path when the test process starts (the engine links it even
for TCP; ``scripts/setup.sh`` installs it as root, or point ``LD_LIBRARY_PATH`` at a private
copy). Where the engine cannot load the tests are skipped with the loader's reason.
"""

from __future__ import annotations

import threading

import pytest
import torch

from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.hw.launcher import HwOptions
from twin.hw.mooncake_transport import MooncakeEndpoint, choose_transport, engine_available
from twin.hw.nixl_transport import TransferBoundsError
from twin.hw.run import run_hw
from twin.runtime.params import SimParams
from twin.trace.format import read_trace
from twin.workloads import fixed

pytestmark = [pytest.mark.hw,
              pytest.mark.skipif(engine_available() is not None,
                                 reason=str(engine_available()))]


@pytest.fixture
def pair():  # type: ignore[no-untyped-def]
    a, b = MooncakeEndpoint("a", workers=2), MooncakeEndpoint("b", workers=1)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_write_lands_every_byte_and_reports_through_poll(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    src = torch.arange(1 << 20, dtype=torch.int32).view(torch.uint8)[: 3 << 20]
    dst = torch.zeros(4 << 20, dtype=torch.uint8)
    a.register(src)
    region = b.register(dst)
    peer = a.add_peer(b.metadata())
    assert peer == b.session and region.agent == b.session
    h = a.write(src, peer, region, 4096, src.numel(), worker=1)
    a.wait(h, timeout_s=60)
    assert a.poll(h) == "DONE" and h.elapsed_s is not None
    assert torch.equal(dst[4096:4096 + src.numel()], src)
    assert int(dst[:4096].count_nonzero()) == 0  # nothing before the offset
    a.release(h)
    # PP stages write one block per layer slot: blocks land at their own offsets
    dst.zero_()
    h = a.write(src, peer, region, 0, 3000, blocks=[(0, 1000, 1000), (1000, 0, 1000),
                                                   (2000, 2000, 1000)])
    a.wait(h, timeout_s=60)
    assert torch.equal(dst[1000:2000], src[:1000]) and torch.equal(dst[:1000], src[1000:2000])
    with pytest.raises(TransferBoundsError):
        a.write(src, peer, region, dst.numel() - 10, 4096)


def test_a_worker_is_blocked_while_its_write_runs(pair) -> None:  # type: ignore[no-untyped-def]
    """Each worker runs its writes one after another on its own thread (SGLang's blocking
    batch_transfer_sync on the transfer worker): a second write on a busy worker only starts
    when the first returned."""
    a, b = pair
    src = torch.ones(32 << 20, dtype=torch.uint8)
    dst = torch.zeros(64 << 20, dtype=torch.uint8)
    a.register(src)
    region = b.register(dst)
    peer = a.add_peer(b.metadata())
    gate = threading.Event()
    a._pools[0].submit(gate.wait)  # worker 0's thread is busy until the gate opens
    h0 = a.write(src, peer, region, 0, src.numel(), worker=0)
    h1 = a.write(src, peer, region, 32 << 20, src.numel(), worker=1)
    a.wait(h1, timeout_s=60)
    assert a.poll(h1) == "DONE" and a.poll(h0) == "PROC"  # worker 0 still blocked
    gate.set()
    a.wait(h0, timeout_s=60)
    assert int(dst.sum()) == 64 << 20


def test_a_refused_write_is_an_unsettled_error(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    src = torch.ones(8192, dtype=torch.uint8)
    dst = torch.zeros(8192, dtype=torch.uint8)
    a.register(src)
    region = b.register(dst)
    peer = a.add_peer(b.metadata())
    b.deregister(region)  # the peer no longer accepts writes there: the call returns -1
    h = a.write(src, peer, region, 0, 4096)
    with pytest.raises(Exception, match="failed"):
        a.wait(h, timeout_s=60)
    assert a.poll(h) == "ERR" and h.settled is False  # SGLang poisons the room


def test_hw_run_on_mooncake_is_byte_verified(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert choose_transport("mooncake")[0] == "mooncake"
    tiny = ModelShape(num_layers=2, num_kv_heads=4, head_dim=32, dtype_bytes=2)
    cfg = TwinConfig(prefill=ServerSide(tp_size=2), decode=ServerSide(tp_size=1), model=tiny,
                     chunked_prefill_size=64, page_size=16, staging_pool_size_mb=2,
                     fixes=("drop-late-staging-req",))
    assert cfg.disaggregation_transfer_backend == "mooncake"
    out = tmp_path / "mc.jsonl"
    result = run_hw(cfg, fixed([(0.02 * i, 300 + 40 * i, 4, 0) for i in range(5)]),
                    params=SimParams(prefill_radix_tokens=0), trace_out=str(out),
                    options=HwOptions(wedge_window_s=15.0, timeout_s=180.0,
                                      kv_pool_pages=256))
    s = result.summary()
    assert s["status"] == "completed", s
    assert s["verified"] == 5 and s["corruption"] == []
    assert read_trace(out).config.disaggregation_transfer_backend == "mooncake"
