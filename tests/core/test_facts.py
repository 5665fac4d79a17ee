"""The protocol facts of SGLang 0.5.23's staging buffer, one unit test each."""

from __future__ import annotations

import pytest

from twin.core import wire
from twin.core.allocator import ALLOC_OVERSIZED, StagingAllocator, is_watermark_ready
from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.core.grid import (
    chunk_index,
    compute_grid_segments,
    floor_to_grid,
    prefetch_chunks,
    staging_grid_tokens,
)
from twin.core.layout import compute_head_slice_params, compute_staging_layout, num_tp_writers


# -- grid ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("cps", "page", "want"), [
    (None, 1, 8192), (None, 16, 8192), (8192, 64, 8192), (100, 16, 96), (8, 16, 16),
    (0, 16, 8192), (256, 16, 256),
])
def test_staging_grid_tokens(cps, page, want):
    assert staging_grid_tokens(cps, page) == want


def test_grid_segments_split_at_base_plus_k_grid():
    assert compute_grid_segments(0, 300, 0, 128) == [(0, 128), (128, 256), (256, 300)]
    assert compute_grid_segments(32, 300, 32, 128) == [(32, 160), (160, 288), (288, 300)]
    # A send starting mid-slot (prefill radix hit) is split at the slot boundary.
    assert compute_grid_segments(100, 200, 32, 128) == [(100, 160), (160, 200)]


def test_grid_segments_empty_range_is_one_empty_segment():
    assert compute_grid_segments(256, 256, 0, 128) == [(256, 256)]


def test_non_last_send_floored_to_grid():
    assert floor_to_grid(300, 0, 128) == 256
    assert floor_to_grid(300, 32, 128) == 288
    assert floor_to_grid(100, 32, 128) == 32  # nothing whole yet: the rest rides with the next


def test_chunk_index_is_positional():
    assert [chunk_index(p, 8) for p in (0, 7, 8, 15, 16)] == [0, 0, 1, 1, 2]
    assert chunk_index(5, 0) == 0


def test_prefetch_one_req_per_grid_chunk():
    assert prefetch_chunks(20, 8) == [(0, 8), (1, 8), (2, 4)]
    assert prefetch_chunks(0, 8) == []


# -- layout -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("src", "dst", "want"), [(4, 2, 2), (8, 2, 4), (2, 2, 1), (1, 2, 1),
                                                  (2, 8, 1)])
def test_writers_per_chunk(src, dst, want):
    assert num_tp_writers(src, dst) == want


def test_config_writers_times_pp_stages():
    cfg = TwinConfig(prefill=ServerSide(tp_size=8), decode=ServerSide(tp_size=2))
    assert cfg.num_writers == 4


def test_head_slices_prefill_tp_larger():
    # 8 KV heads, prefill TP4 (2 heads each) -> decode TP2 (4 heads each).
    assert [compute_head_slice_params(4, 2, r, r // 2, 8) for r in range(4)] == [
        (0, 2, 0, 2), (0, 2, 2, 2), (0, 2, 0, 2), (0, 2, 2, 2)]


def test_head_slices_prefill_tp_smaller():
    # prefill TP1 holds all 8 heads; decode TP2 rank 1 takes heads 4..7 into head 0.
    assert compute_head_slice_params(1, 2, 0, 1, 8) == (4, 4, 0, 4)


def test_staging_layout_bytes():
    n, per, total = compute_staging_layout(4, 2, 0, 8, num_tokens=16, bytes_per_head_token=8,
                                           num_layers=2)
    assert (n, per, total) == (2, [16 * 2 * 8 * 2 * 2] * 2, 2 * 16 * 2 * 8 * 2 * 2)


# -- ring allocator -----------------------------------------------------------------------------
def test_ring_example_100_bytes():
    a = StagingAllocator(100)
    alloc_id, offset, rnd = a.assign(60)
    assert (offset, rnd) == (0, 0)
    a.free(alloc_id)
    assert a.get_watermark() == (1, 0)
    second = a.assign(70)
    assert second == (1, 0, 1)


def test_assign_wraps_when_it_does_not_fit():
    a = StagingAllocator(100)
    assert a.assign(60) == (0, 0, 0)
    assert a.assign(30) == (1, 60, 0)
    assert a.assign(20) == (2, 0, 1)  # 10 bytes left at the end: next round, offset 0


def test_assign_oversized_is_none():
    a = StagingAllocator(100)
    assert a.assign(101) is None
    assert a.assign(100) == (0, 0, 0)
    assert ALLOC_OVERSIZED == -2


def test_free_unknown_id_is_noop():
    a = StagingAllocator(100)
    a.assign(10)
    a.free(42)
    assert a.get_watermark() == (0, 0)
    assert len(a.live()) == 1


def test_watermark_is_oldest_live_allocation():
    a = StagingAllocator(100)
    ids = [a.assign(30)[0] for _ in range(3)]
    a.free(ids[1])
    assert a.get_watermark() == (0, 0)  # the oldest is still live
    a.free(ids[0])
    assert a.get_watermark() == (0, 60)
    x = a.assign(50)  # wraps to round 1
    a.free(ids[2])
    assert a.get_watermark() == (1, 0) and x[2] == 1


# -- readiness ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("wm", "rnd", "end", "ready"), [
    ((0, 0), 0, 100, True),    # round 0 never waits
    ((0, 0), 1, 10, False),    # round 1 needs round 0 drained up to its end
    ((0, 10), 1, 10, True),
    ((0, 10), 1, 11, False),
    ((1, 0), 1, 100, True),    # watermark already in round 1
    ((1, 50), 2, 50, True),
    ((1, 50), 2, 51, False),
    ((0, 99), 2, 1, False),    # two rounds ahead
])
def test_readiness_rule(wm, rnd, end, ready):
    assert is_watermark_ready(wm, rnd, end) is ready


# -- messages -----------------------------------------------------------------------------------
def test_message_frames():
    assert wire.encode(wire.StagingReq(room=7, chunk_idx=1, chunk_pages=16, session_id="d0")) == [
        b"STAGING_REQ", b"7", b"1", b"16", b"d0"]
    assert wire.encode(wire.StagingReq(room=7, chunk_idx=1, chunk_pages=16, session_id="d0",
                                       pp_rank=0))[-1] == b"0"
    assert wire.encode(wire.StagingRsp(room=7, chunk_idx=1, offset=-2, round=0, end=-1,
                                       session_id="d0")) == [
        b"STAGING_RSP", b"7", b"1", b"-2", b"0", b"-1", b"d0"]
    assert wire.encode(wire.Watermark(round=3, tail=4096, session_id="d0")) == [
        b"WATERMARK", b"3", b"4096", b"d0"]
    assert wire.encode(wire.ChunkReady(room=7, chunk_idx=2, page_start=32, num_pages=16,
                                       writer_id="d0", prefill_rank=3)) == [
        b"CHUNK_READY", b"7", b"2", b"32", b"16", b"d0", b"3"]


def test_message_roundtrip():
    msgs = [wire.StagingReq(room=1, chunk_idx=0, chunk_pages=2, session_id="s"),
            wire.StagingRsp(room=1, chunk_idx=0, offset=0, round=1, end=9, session_id="s"),
            wire.Watermark(round=1, tail=2, session_id="s"),
            wire.ChunkReady(room=1, chunk_idx=0, page_start=0, num_pages=2, writer_id="s",
                            prefill_rank=0),
            wire.TransferStatus(room=1, status=wire.KVPoll.Success, prefill_rank=0)]
    for m in msgs:
        assert wire.decode(wire.encode(m)) == m


def test_small_model_config():
    cfg = TwinConfig(model=ModelShape(num_layers=2, num_kv_heads=8, head_dim=4),
                     chunked_prefill_size=256, page_size=16)
    assert (cfg.grid_tokens, cfg.full_chunk_pages) == (256, 16)
