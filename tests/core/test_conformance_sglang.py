"""Differential tests: the twin's protocol core against SGLang 0.5.23's own functions.

``twin.reference.sglang_wheel`` executes SGLang's source from the released wheel; every test here feeds the same
inputs to both and compares every result.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twin.core import (
    ALLOC_OVERSIZED,
    StagingAllocator,
    compute_grid_segments,
    compute_head_slice_params,
    compute_staging_layout,
    is_watermark_ready,
    staging_grid_tokens,
)
from twin.core.defects import STALE_EMPTY_RING_WATERMARK, Defects
from twin.core.grid import prefetch_chunks
from twin.core.wire import StagingReq, encode
from twin.reference import sglang_wheel

SETTINGS = settings(
    derandomize=True, database=None, deadline=None, max_examples=300,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.fixture(scope="module", autouse=True)
def ref(sglang_reference):
    return sglang_reference


def _state(alloc) -> tuple:
    """Everything the ring's future behaviour depends on."""
    return (
        alloc.head, alloc.round, dict(alloc.allocations), list(alloc.alloc_order),
        alloc.next_alloc_id, alloc.get_watermark(),
    )


# --- allocator --------------------------------------------------------------------------------


def test_reference_is_sglang_code(ref):
    assert ref.wheel.name.startswith(f"sglang-{sglang_wheel.SGLANG_VERSION}-")
    assert ref.StagingAllocator.__module__ == "sglang_ref_staging_buffer"
    assert ALLOC_OVERSIZED == ref.StagingAllocator.ALLOC_OVERSIZED == -2
    assert StagingAllocator.ALLOC_OVERSIZED == ALLOC_OVERSIZED


def _run_ops(data, total: int, twin: StagingAllocator, sg, max_ops: int = 60) -> None:
    sizes = st.one_of(
        st.integers(0, total),                          # fits (incl. zero, exactly the ring)
        st.integers(total + 1, 2 * total + 8),          # oversized
        st.integers(1, max(1, total // 3)),             # small: several per round
    )
    issued: list[int] = []
    for _ in range(data.draw(st.integers(0, max_ops), label="n_ops")):
        op = data.draw(st.sampled_from(["assign", "assign", "free_live", "free_any"]))
        if op == "assign":
            n = data.draw(sizes, label="size")
            got, want = twin.assign(n), sg.assign(n)
            assert got == want, f"assign({n})"
            if want is not None:
                issued.append(want[0])
                alloc_id, offset, rnd = want
                end = offset + n
                wm = sg.get_watermark()
                assert is_watermark_ready(twin.get_watermark(), rnd, end) == (
                    sglang_wheel.is_watermark_ready(wm, rnd, end)
                ), f"ready after assign({n}) wm={wm}"
        else:
            live = [a for a in issued if a in sg.allocations]
            if op == "free_live" and live:
                alloc_id = data.draw(st.sampled_from(live), label="free")
            else:
                alloc_id = data.draw(st.integers(-2, len(issued) + 2), label="free_any")
            assert twin.free(alloc_id) is None
            sg.free(alloc_id)
        assert twin.get_watermark() == sg.get_watermark(), op
        assert _state(twin) == _state(sg), op
        assert [a for a, *_ in twin.live()] == [a for a in sg.alloc_order if a in sg.allocations]


@SETTINGS
@given(total=st.integers(1, 512), data=st.data())
def test_allocator_matches_sglang(total, data):
    twin, sg = StagingAllocator(total), sglang_wheel.make_allocator(total)
    assert _state(twin) == _state(sg)
    _run_ops(data, total, twin, sg)


@SETTINGS
@given(total=st.integers(1, 512), data=st.data())
def test_stale_watermark_defect_only_differs_once_the_ring_empties(total, data):
    """With the pre-fix switch on, the twin equals SGLang until the ring first empties."""
    twin = StagingAllocator(total, defects=Defects.of([STALE_EMPTY_RING_WATERMARK]))
    sg = sglang_wheel.make_allocator(total)
    first = data.draw(st.integers(0, total), label="first")
    assert twin.assign(first) == sg.assign(first)  # keep one allocation pinned all along
    pinned = 0
    for _ in range(data.draw(st.integers(0, 40), label="n_ops")):
        if data.draw(st.booleans(), label="assign?"):
            n = data.draw(st.integers(0, total + 4), label="size")
            assert twin.assign(n) == sg.assign(n)
        else:
            victims = [a for a in sg.alloc_order if a in sg.allocations and a != pinned]
            if victims:
                a = data.draw(st.sampled_from(victims), label="free")
                twin.free(a)
                sg.free(a)
        assert _state(twin) == _state(sg)


def test_oversized_request_is_refused_without_side_effects(ref):
    twin, sg = StagingAllocator(100), sglang_wheel.make_allocator(100)
    for a in (twin, sg):
        assert a.assign(40) == (0, 0, 0)
        assert a.assign(101) is None
        assert a.assign(100) == (1, 0, 1)  # wraps: 60 bytes left at the end is not enough
    assert _state(twin) == _state(sg)


def test_empty_ring_example_fixed_matches_sglang(ref):
    """100-byte ring: assign 60, free, assign 70 -> the wrapping allocation is writable."""
    twin, sg = StagingAllocator(100), sglang_wheel.make_allocator(100)
    for a in (twin, sg):
        assert a.assign(60) == (0, 0, 0)
        a.free(0)
        assert a.get_watermark() == (1, 0)
        assert a.assign(70) == (1, 0, 1)  # fresh round at offset 0: no wrap needed
        assert a.get_watermark() == (1, 0)
    assert _state(twin) == _state(sg)
    assert is_watermark_ready((1, 0), 1, 70)
    assert sglang_wheel.is_watermark_ready((1, 0), 1, 70)


def test_empty_ring_example_pre_fix_defect():
    """Pre-fix: the watermark stays at (0, 60); the wrap to round 1 then waits forever."""
    twin = StagingAllocator(100, defects=Defects.of([STALE_EMPTY_RING_WATERMARK]))
    assert twin.assign(60) == (0, 0, 0)
    twin.free(0)
    assert twin.get_watermark() == (0, 60)
    alloc_id, offset, rnd = twin.assign(70)
    assert (alloc_id, offset, rnd) == (1, 0, 1)
    assert is_watermark_ready(twin.get_watermark(), rnd, offset + 70) is False
    assert is_watermark_ready((0, 60), 1, 70) is False
    assert sglang_wheel.is_watermark_ready((0, 60), 1, 70) is False  # same rule, same verdict
    twin.free(alloc_id)  # nothing else ever advances it
    assert twin.get_watermark() == (1, 70)


# --- readiness --------------------------------------------------------------------------------


@SETTINGS
@given(
    wm_round=st.integers(0, 6), wm_tail=st.integers(0, 300),
    alloc_round=st.integers(-2, 8), alloc_end=st.integers(-1, 300),
)
def test_readiness_matches_sglang(wm_round, wm_tail, alloc_round, alloc_end):
    wm = (wm_round, wm_tail)
    assert is_watermark_ready(wm, alloc_round, alloc_end) == sglang_wheel.is_watermark_ready(
        wm, alloc_round, alloc_end
    )


@SETTINGS
@given(alloc_round=st.integers(-2, 8), alloc_end=st.integers(-1, 300))
def test_readiness_without_any_watermark_is_sglang_default(alloc_round, alloc_end):
    """A session that never received a WATERMARK is judged against (0, 0)."""
    assert is_watermark_ready((0, 0), alloc_round, alloc_end) == sglang_wheel.is_watermark_ready(
        None, alloc_round, alloc_end
    )


# --- grid -------------------------------------------------------------------------------------

cps_values = st.one_of(st.none(), st.just(0), st.integers(1, 20000))
page_sizes = st.integers(1, 64)


@SETTINGS
@given(cps=cps_values, page_size=page_sizes)
def test_grid_tokens_match_sglang(ref, cps, page_size):
    assert staging_grid_tokens(cps, page_size) == ref.staging_grid_tokens(cps, page_size)


@SETTINGS
@given(
    cps=cps_values, page_size=page_sizes, small_grid=st.integers(1, 64),
    use_small=st.booleans(), base=st.integers(0, 3000), start_off=st.integers(-64, 3000),
    length=st.integers(-32, 3000),
)
def test_grid_segments_match_sglang(ref, cps, page_size, small_grid, use_small, base,
                                    start_off, length):
    grid = small_grid if use_small else staging_grid_tokens(cps, page_size)
    start = base + start_off
    end = start + length  # length <= 0: empty or inverted range
    got = compute_grid_segments(start, end, base, grid)
    want = ref.compute_grid_segments(start, end, base, grid)
    assert got == want
    assert all(type(s) is tuple for s in got)


def test_grid_segments_examples(ref):
    cases = [
        (0, 0, 0, 16),          # empty: one metadata-only segment
        (48, 16, 0, 16),        # inverted
        (5, 40, 3, 16),         # unaligned start after a decode prefix of 3
        (0, 8192 * 2 + 5, 0, 8192),
    ]
    for args in cases:
        assert compute_grid_segments(*args) == ref.compute_grid_segments(*args), args


@SETTINGS
@given(
    cps=cps_values, page_size=page_sizes, total_pages=st.integers(0, 3000),
    pp_rank=st.one_of(st.none(), st.integers(0, 3)),
)
def test_prefetch_requests_match_sglang(cps, page_size, total_pages, pp_rank):
    """The STAGING_REQs a prefill sends before its forward: chunk count, sizes and frames."""
    grid_pages = staging_grid_tokens(cps, page_size) // page_size
    twin_frames = [
        encode(StagingReq(room=77, chunk_idx=i, chunk_pages=n, session_id="s", pp_rank=pp_rank))
        for i, n in prefetch_chunks(total_pages, grid_pages)
    ]
    assert twin_frames == sglang_wheel.prefetch_frames(77, {"s": total_pages}, cps, page_size,
                                                     pp_rank)


# --- head slicing and layout ------------------------------------------------------------------

tp_sizes = st.sampled_from([1, 2, 4, 8, 16])
kv_heads = st.one_of(st.sampled_from([1, 2, 4, 8, 16, 32, 64]), st.integers(1, 64))


@SETTINGS
@given(src_tp=tp_sizes, dst_tp=tp_sizes, heads=kv_heads, data=st.data())
def test_head_slice_params_match_sglang(ref, src_tp, dst_tp, heads, data):
    # Ranks beyond the group: global ranks under DP attention are taken modulo the group.
    src_rank = data.draw(st.integers(0, 2 * src_tp - 1), label="src_rank")
    dst_rank = data.draw(st.integers(0, 2 * dst_tp - 1), label="dst_rank")
    args = (src_tp, dst_tp, src_rank, dst_rank, heads)
    assert compute_head_slice_params(*args) == ref.compute_head_slice_params(*args)


def test_head_slice_params_every_small_config(ref):
    """Exhaustive over the TP pairs and head counts deployments use, GQA replication included."""
    for src_tp in (1, 2, 4, 8, 16):
        for dst_tp in (1, 2, 4, 8, 16):
            for heads in (1, 2, 4, 8, 16, 64):
                for src_rank in range(src_tp):
                    for dst_rank in range(dst_tp):
                        args = (src_tp, dst_tp, src_rank, dst_rank, heads)
                        got = compute_head_slice_params(*args)
                        assert got == ref.compute_head_slice_params(*args), args


@SETTINGS
@given(
    src_tp=tp_sizes, dst_tp=tp_sizes, heads=kv_heads, data=st.data(),
    num_tokens=st.integers(0, 8192), bpht=st.sampled_from([1, 2, 64, 128, 256, 576]),
    num_layers=st.integers(1, 96),
)
def test_staging_layout_matches_sglang(ref, src_tp, dst_tp, heads, data, num_tokens, bpht,
                                       num_layers):
    dst_rank = data.draw(st.integers(0, 2 * dst_tp - 1), label="dst_rank")
    args = (src_tp, dst_tp, dst_rank, heads, num_tokens, bpht, num_layers)
    got = compute_staging_layout(*args)
    want = ref.compute_staging_layout(*args)
    assert got == want
    assert type(got) is tuple and type(got[1]) is list


# --- ABORT frames -----------------------------------------------------------------------------


def _sglang_abort_notification():
    """SGLang's ``AckTarget`` and ``AbortNotification`` (common/conn.py), run from the wheel."""
    import ast
    from typing import NamedTuple

    import msgspec

    from twin.reference.sglang_wheel import exec_definitions, read_sources, top_level

    wheel = sglang_wheel.wheel_path()
    src = read_sources(wheel, [sglang_wheel.CONN])[sglang_wheel.CONN]
    tree = ast.parse(src)
    body = [top_level(tree, name, sglang_wheel.CONN)
            for name in ("AckTarget", "AbortNotification")]
    ns = exec_definitions("sglang_sm_conn_abort", sglang_wheel.CONN, src, body,
                          {"msgspec": msgspec, "ABORT_TAG": b"ABORT", "NamedTuple": NamedTuple},
                          wheel)
    return ns["AbortNotification"]


def _abort_view(n) -> tuple:
    """What an ABORT means to prefill: the room, and where an ACK goes (None: nowhere)."""
    target = n.deferred_ack_target()
    return n.room, None if target is None else (target.ip, target.port, target.generation)


ABORT_CASES = [
    [b"ABORT", b"7"],  # legacy: no return address
    [b"ABORT", b"7", b"d0g0r1"],  # an address cut short: legacy
    [b"ABORT", b"7", b"d0g0r1", b"4242"],  # an address, no generation: nothing to ACK
    [b"ABORT", b"7", b"d0g0r1", b"4242", b"3"],
    [b"ABORT", b"7", b"d0g0r1", b"port", b"3"],  # a bad port: legacy
    [b"ABORT", b"7", b"d0g0r1", b"4242", b"gen"],  # a bad generation: None
    [b"ABORT", b"7", b"d0g0r1", b"4242", b"3", b"extra"],  # extra frames are ignored
]


@pytest.mark.parametrize("frames", ABORT_CASES, ids=range(len(ABORT_CASES)))
def test_abort_frames_parse_as_sglang_parses_them(frames):
    """``AbortNotification.from_zmq`` accepts a legacy ``[ABORT, room]`` and every shorter or
    malformed return address; the twin's decoder means the same (room, ACK target) by each."""
    from twin.core.wire import NO_RETURN_ADDRESS, Abort, decode

    sgl = _sglang_abort_notification().from_zmq(frames)
    twin = decode(frames)
    assert isinstance(twin, Abort)
    ack = None
    if twin.decode_ip != NO_RETURN_ADDRESS and twin.generation is not None:
        ack = (twin.decode_ip, twin.decode_port, twin.generation)
    assert (twin.room, ack) == _abort_view(sgl)
    # what the twin would send again for it is what SGLang's to_zmq sends
    assert encode(twin) == sgl.to_zmq()


def test_abort_without_a_room_is_rejected_by_both():
    from twin.core.wire import decode

    assert _sglang_abort_notification().from_zmq([b"ABORT"]) is None
    with pytest.raises(ValueError, match="ABORT: missing field 'room'"):
        decode([b"ABORT"])
