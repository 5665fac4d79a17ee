"""Equal attention TP on real rank processes: no staging, each chunk one direct page write.

Prefill rank r writes its pages straight into decode rank r's KV pool pages of the room (the
indices its ``TWIN_META`` carried), one block per page, layer and K/V, as SGLang's
``send_kvcache`` does: no STAGING_REQ, ring or scatter, and every decode rank still checks every
byte of each finished room. The trace replays in simulation and on real ranks, and calibration
fits ``direct_write_s`` from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")

from twin.calibrate import calibrate, direct_params, direct_write_fit, measure  # noqa: E402
from twin.core import wire  # noqa: E402
from twin.core.config import ModelShape, ServerSide, TwinConfig  # noqa: E402
from twin.hw.kvpattern import fill_prefill_pool, rank_head_range, verify_decode_pool  # noqa: E402
from twin.hw.launcher import HwOptions  # noqa: E402
from twin.hw.mooncake_transport import choose_transport, engine_available  # noqa: E402
from twin.hw.nixl_transport import NixlEndpoint  # noqa: E402
from twin.hw.pools import KVPool, PoolLayout, direct_blocks  # noqa: E402
from twin.hw.replay import replay_hw  # noqa: E402
from twin.hw.run import pp_direct_refusal, run_hw  # noqa: E402
from twin.replay import replay_sim  # noqa: E402
from twin.runtime.params import SimParams  # noqa: E402
from twin.trace.format import Trace, read_trace  # noqa: E402
from twin.workloads import fixed  # noqa: E402

pytestmark = pytest.mark.hw

TINY = ModelShape(num_layers=2, num_kv_heads=4, head_dim=32, dtype_bytes=2)


def _cfg(**kw: Any) -> TwinConfig:
    """``--prefill-args "--tp-size 2" --decode-args "--tp-size 2"``, a tiny model."""
    return TwinConfig(prefill=ServerSide(tp_size=2), decode=ServerSide(tp_size=2), model=TINY,
                      chunked_prefill_size=64, page_size=16, staging_pool_size_mb=2, **kw)


LENGTHS = (150, 64, 900, 700, 97, 1000, 171, 810)
#: A decode cache of one 512-token block and a prefill cache of everything: the long requests
#: (a shared 640-token prefix) reuse 512 tokens on decode and their whole prefix on prefill, so
#: the direct writes start past a decode prefix and read pages a forward never wrote again.
PARAMS = SimParams(decode_radix_tokens=512, prefill_radix_tokens=100_000)


def _workload():  # type: ignore[no-untyped-def]
    # several chunks each, partial last pages, one request of exactly one chunk
    return fixed([(0.02 * i, n, 4, 640 if n > 640 else 0) for i, n in enumerate(LENGTHS)])


def _options() -> HwOptions:
    return HwOptions(wedge_window_s=15.0, timeout_s=180.0, kv_pool_pages=512)


def _run(tmp: Path, name: str, cfg: TwinConfig) -> tuple[dict[str, Any], Trace]:
    out = tmp / f"{name}.jsonl"
    result = run_hw(cfg, _workload(), params=PARAMS, options=_options(), trace_out=str(out),
                    max_concurrency=3)
    return result.summary(), read_trace(out)


def _transfers(trace: Trace) -> list[Any]:
    return [r.event for r in trace.events if r.dir == "out" and r.type == "StartTransfer"]


def _staging_reqs(trace: Trace) -> int:
    return sum(1 for r in trace.events if r.type in ("Send", "MessageArrived")
               and isinstance(r.event.msg, wire.StagingReq))


@pytest.fixture(scope="module")
def direct(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Trace]:
    """One direct-write run on NIXL, shared by the checks below."""
    return _run(tmp_path_factory.mktemp("direct"), "direct",
                _cfg(disaggregation_transfer_backend="nixl"))


def test_equal_tp_writes_pages_directly_and_every_byte_verifies(
        direct: tuple[dict[str, Any], Trace]) -> None:
    s, trace = direct
    assert s["status"] == "completed", s
    assert (s["completed"], s["verified"], s["corruption"]) == (8, 8, []), s
    assert not trace.config.stages
    writes = _transfers(trace)
    assert writes and all(not e.staged and e.dst_offset == -1 for e in writes)
    assert _staging_reqs(trace) == 0
    assert not any(r.type in ("StartScatter", "Allocated") for r in trace.events)
    # every page of every room past its decode prefix, from both prefill ranks (one per
    # decode rank)
    arrived = {r.data["room"]: r.data for r in trace.events if r.type == "RequestArrived"}
    assert any(a["decode_prefix_len"] > 0 for a in arrived.values()), "decode radix hit expected"
    pages = {(e.session, e.room): 0 for e in writes}
    for e in writes:
        pages[(e.session, e.room)] += e.num_pages
    assert {s for s, _ in pages} == {"d0g0r0", "d0g0r1"} and len(pages) == 16
    for (_, room), n in pages.items():
        a = arrived[room]
        assert n == -(-(a["input_len"] - a["decode_prefix_len"]) // 16), (room, n)


def test_the_direct_trace_replays_in_simulation_and_on_real_ranks(
        direct: tuple[dict[str, Any], Trace]) -> None:
    _, trace = direct
    sim = replay_sim(trace)
    assert sim.divergence is None and sim.same_outcome and sim.status == "completed"
    hw = replay_hw(trace, _options())
    assert hw.divergence is None, hw.divergence
    assert hw.same_outcome and hw.status == "completed" and hw.corruption == []


def test_calibration_fits_direct_write_s_from_direct_writes(
        direct: tuple[dict[str, Any], Trace]) -> None:
    _, trace = direct
    m = measure(trace)
    assert len(m.direct) == len(_transfers(trace)) and not m.transfers
    # one write per page, layer and K/V (matched in the order they finished)
    assert sorted((w, b) for w, b, _ in m.direct) == sorted(
        (e.num_pages * 2 * TINY.num_layers, e.nbytes) for e in _transfers(trace))
    p = direct_params([m])
    fitted, note = direct_write_fit([m], p)
    assert fitted and p.direct_write_s > 0 and p.direct_write_s != SimParams().direct_write_s
    assert "fitted" in note
    cal = calibrate([trace], seeds=(0,), steps=(1,))
    assert cal.params.direct_write_s == p.direct_write_s > 0
    assert "direct_write_s" in cal.report()["params"] and cal.notes == [note]


def test_calibration_keeps_direct_write_s_without_direct_writes() -> None:
    m = measure(read_trace(Path(__file__).resolve().parents[2] / "traces"
                           / "hw-tp2-tp1.jsonl.gz"))
    p = direct_params([m])
    fitted, note = direct_write_fit([m], p)
    assert not fitted and p.direct_write_s == SimParams().direct_write_s
    assert "kept" in note and "no direct page writes" in note


def test_stage_equal_tp_asked_for_still_stages(tmp_path: Path) -> None:
    """``stage_equal_tp`` in the config stages equal-TP rooms through the ring, on hardware
    as in simulation."""
    s, trace = _run(tmp_path, "staged",
                    _cfg(stage_equal_tp=True, disaggregation_transfer_backend="nixl"))
    assert (s["status"], s["verified"]) == ("completed", 8), s
    assert all(e.staged for e in _transfers(trace)) and _staging_reqs(trace) > 0


@pytest.mark.skipif(engine_available() is not None, reason=str(engine_available()))
def test_direct_writes_on_mooncake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same run with the Mooncake engine moving the pages (one batch per chunk)."""
    monkeypatch.setenv("TWIN_HW_TRANSPORT", "mooncake")
    assert choose_transport("mooncake")[0] == "mooncake"
    s, trace = _run(tmp_path, "mooncake", _cfg())
    assert (s["status"], s["verified"], s["corruption"]) == ("completed", 8, []), s
    assert all(not e.staged for e in _transfers(trace)) and _staging_reqs(trace) == 0


def test_a_pp_prefill_with_equal_tp_is_still_staged_on_hardware() -> None:
    pp = TwinConfig(prefill=ServerSide(tp_size=2, pp_size=2), decode=ServerSide(tp_size=2),
                    model=TINY, chunked_prefill_size=64)
    assert pp_direct_refusal(pp) is not None
    assert pp_direct_refusal(_cfg()) is None
    assert pp_direct_refusal(_cfg(stage_equal_tp=True)) is None


# -- the byte check catches a wrong direct write -------------------------------------------------

PAGE, PAGES, REQUEST = 4, 12, 7


def _pools() -> tuple[KVPool, KVPool, list[int], list[int]]:
    """A prefill and a decode pool of one TP rank's heads (equal TP: the same heads), the
    request's pages in each (scattered, different indices), the prefill pages filled."""
    cpu = torch.device("cpu")
    src = KVPool(2, PAGES, PAGE, 2, 8, torch.bfloat16, cpu)
    dst = KVPool(2, PAGES, PAGE, 2, 8, torch.bfloat16, cpu)
    src_pages, dst_pages = [3, 0, 7, 5], [9, 2, 4, 11]
    fill_prefill_pool(src.k, src.v, src_pages, PAGE, request=REQUEST, head_offset=2)
    return src, dst, src_pages, dst_pages


def _write_and_check(src: KVPool, dst: KVPool, src_pages: list[int],
                     dst_pages: list[int], room_pages: list[int]) -> Any:
    """A real NIXL WRITE of ``direct_blocks(src_pages -> dst_pages)`` between two agents,
    then the decode rank's check of the room's pages ``room_pages``, as ``RankProcess._verify``
    does at the room's conclusion (the first mismatch, or None)."""
    with NixlEndpoint("dw-prefill", progress_thread=False) as a, \
            NixlEndpoint("dw-decode", progress_thread=False) as b:
        a.register(src.storage)
        region = b.register(dst.storage)
        peer = a.add_peer(b.metadata())
        blocks = direct_blocks(src.layout, src_pages, dst.layout, dst_pages)
        nbytes = sum(n for _, _, n in blocks)
        assert len(blocks) == len(src_pages) * 2 * 2  # one per page, layer and K/V
        span = src.storage.numel() * src.storage.element_size()
        handle = a.write(src.storage, peer, region, 0, nbytes, blocks=blocks, local_span=span)
        a.wait(handle, timeout_s=10)
        a.release(handle)
    tokens = dst.token_indices(room_pages, 0, len(room_pages) * PAGE)
    return verify_decode_pool(dst.k, dst.v, REQUEST, range(len(room_pages) * PAGE), tokens,
                              rank_head_range(2, 1, 4))


def test_a_direct_write_lands_every_page_byte_for_byte() -> None:
    src, dst, sp, dp = _pools()
    assert _write_and_check(src, dst, sp, dp, dp) is None


def test_an_off_by_one_page_direct_write_fails_the_byte_check() -> None:
    """The decode page list shifted by one (page i's bytes land in page i + 1's slot): the
    check of the room's pages names the wrong bytes."""
    src, dst, sp, dp = _pools()
    wrong = _write_and_check(src, dst, sp, dp[1:] + [6], dp)
    assert wrong is not None
    assert wrong.token == 0  # the room's first page never got its bytes


def test_direct_blocks_refuse_pools_that_do_not_match() -> None:
    a = PoolLayout(layers=2, num_pages=8, page_bytes=512)
    # K of layers 0 and 1, then V of layers 0 and 1: tensor t starts at page t * 8
    assert direct_blocks(a, [1], a, [2]) == [((8 * t + 1) * 512, (8 * t + 2) * 512, 512)
                                             for t in range(4)]
    with pytest.raises(ValueError, match="same layers"):
        direct_blocks(a, [1], PoolLayout(2, 8, 256), [1])
    with pytest.raises(ValueError, match="destination pages"):
        direct_blocks(a, [1, 2], a, [1])
    with pytest.raises(IndexError):
        direct_blocks(a, [8], a, [1])
    assert PoolLayout.from_dict(a.to_dict()) == a
    with pytest.raises(ValueError):
        PoolLayout.from_dict({"layers": 2})
