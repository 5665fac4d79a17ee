"""Each upstream defect, switched on, shows its symptom; switched off, the same run is clean.

Runs use the logical-time loopback cluster. ``settle`` takes actions until none is pending
without firing any timeout, so a room still pending afterwards is wedged; ``finish`` then fires
the timeouts. Where a race is needed, a pick function chooses among ``choices()``.
"""

from __future__ import annotations

import pytest

from twin.core import events as ev
from twin.core import wire
from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.core.decode import DecodeRank
from twin.core.defects import (
    COMPLETION_BEFORE_LAST_SCATTER,
    LATE_DECODE_REGISTRATION,
    NO_GRID_ALIGNMENT,
    NO_RELEASE_ROOM,
    NO_SUBSCRIBER_SNAPSHOT,
    RAISE_ON_UNALIGNED_PREFIX,
    SILENT_SLICE_FALLBACK,
    STALE_EMPTY_RING_WATERMARK,
    SWALLOWED_CHUNK_READY_ERROR,
    TEARDOWN_DROPS_DEFERRED,
    Defects,
)
from twin.explore.loopback import Cluster

MODEL = ModelShape(num_layers=2, num_kv_heads=8, head_dim=4, dtype_bytes=2)
GRID = 64  # tokens per grid slot (chunked_prefill_size), 4 pages of 16
REGION = GRID * 4 * 8 * 2 * 2  # one full chunk on a decode rank of prefill TP4 -> decode TP2


def config(ring_regions: float = 4, prefill: ServerSide | None = None, **kw) -> TwinConfig:
    return TwinConfig(prefill=prefill or ServerSide(tp_size=4), decode=ServerSide(tp_size=2),
                      model=MODEL, chunked_prefill_size=GRID, page_size=16,
                      staging_pool_size_bytes=int(ring_regions * REGION), **kw)


def cluster(cfg: TwinConfig, *defects: str) -> Cluster:
    return Cluster(cfg, Defects.of(defects))


def settle(c: Cluster, pick=None, max_steps: int = 20_000) -> None:
    """Take actions (oldest first, or ``pick(choices)``) until none is pending, the clock moving
    on to scheduled polls and registrations; no timeouts."""
    for _ in range(max_steps):
        cs = c.choices()
        if not cs:
            if c.advance(timeouts=False) is None:
                return
            continue
        c.step(cs[0] if pick is None else pick(cs))
    raise AssertionError("still busy after max_steps")


def finish(c: Cluster) -> None:
    c.run()


def avoid(c: Cluster, kind: str):
    """Pick function: any action but ``kind`` while there is one."""
    def pick(cs: list[int]) -> int:
        others = [i for i in cs if c.pending[i].kind != kind]
        return others[0] if others else cs[0]
    return pick


def outcomes(c: Cluster) -> dict[int, str]:
    return {r: c.outcome(r) for r in sorted(c.rooms)}


def kinds(c: Cluster) -> set[str]:
    return {v.kind for v in c.integrity.violations}


# -- stale-empty-ring-watermark ------------------------------------------------------------------
def _wrap_after_empty_ring(*defects: str) -> Cluster:
    # Ring of one full region: room 0 takes 3/4 of it and completes (ring empty); room 1 needs
    # the whole region, wraps to round 1 and must not wait for `end <= stale head`.
    c = cluster(config(ring_regions=1), *defects)
    c.add_request(0, 48)
    settle(c)
    assert c.outcome(0) == "Success"
    c.add_request(1, 64)
    settle(c)
    return c


def test_stale_empty_ring_watermark_on_wedges_the_wrapping_room():
    c = _wrap_after_empty_ring(STALE_EMPTY_RING_WATERMARK)
    assert c.outcome(1) == "pending"
    assert {r.watermark for r in c.ranks.values() if isinstance(r, DecodeRank)} \
        == {(0, REGION * 3 // 4)}
    finish(c)
    assert c.outcome(1) == "Failed"


def test_stale_empty_ring_watermark_off_wraps():
    c = _wrap_after_empty_ring()
    assert c.outcome(1) == "Success"


# -- no-subscriber-snapshot ----------------------------------------------------------------------
def _second_prefill_group(*defects: str) -> Cluster:
    c = cluster(config(ring_regions=1, prefill=ServerSide(tp_size=4, instances=2)), *defects)
    c.add_request(0, 64, prefill_group=0)  # empties the ring: decode watermark (1, 0)
    settle(c)
    c.add_request(1, 64, prefill_group=1)  # round 1: a new session needs the current watermark
    settle(c)
    return c


def test_no_subscriber_snapshot_on_new_group_waits_from_zero():
    c = _second_prefill_group(NO_SUBSCRIBER_SNAPSHOT)
    assert outcomes(c) == {0: "Success", 1: "pending"}
    second = [r for n, r in c.ranks.items() if n.startswith("p1")]
    assert all(r.snapshot().watermarks.get(s, (0, 0)) == (0, 0) for r in second for s in ("d0g0r0",))
    finish(c)
    assert c.outcome(1) == "Failed"


def test_no_subscriber_snapshot_off_new_group_proceeds():
    assert outcomes(_second_prefill_group()) == {0: "Success", 1: "Success"}


@pytest.mark.parametrize(("defects", "wedged"), [
    ((), False),
    ((STALE_EMPTY_RING_WATERMARK,), True),
    ((NO_SUBSCRIBER_SNAPSHOT,), True),
    ((STALE_EMPTY_RING_WATERMARK, NO_SUBSCRIBER_SNAPSHOT), True),
])
def test_warmup_needs_both_watermark_fixes(defects, wedged):
    # Warmup: requests one after another, alternating between two prefill instances.
    c = cluster(config(ring_regions=1.5, prefill=ServerSide(tp_size=4, instances=2)), *defects)
    done = 0
    for room in range(11):
        c.add_request(room, 48 + 16 * (room % 2), prefill_group=room % 2)
        settle(c)
        if c.outcome(room) != "Success":
            break
        done += 1
    assert (done < 11) is wedged, done


# -- late-decode-registration --------------------------------------------------------------------
def test_late_decode_registration_on_drops_staging_req():
    c = cluster(config(), LATE_DECODE_REGISTRATION)
    c.add_request(0, 128)
    settle(c, pick=avoid(c, "register"))  # registration comes after the STAGING_REQs
    dropped = [e for _, n, e in c.log if isinstance(e, ev.MessageArrived)
               and isinstance(e.msg, wire.StagingReq)]
    assert dropped and c.outcome(0) == "pending"
    assert all(not r.snapshot().live for n, r in c.ranks.items() if n.startswith("d"))
    finish(c)
    assert c.outcome(0) == "Failed"


def test_late_decode_registration_off_same_order_succeeds():
    c = cluster(config())
    c.add_request(0, 128)
    settle(c, pick=avoid(c, "register"))
    assert c.outcome(0) == "Success"


# -- no-release-room -----------------------------------------------------------------------------
def _abort_with_unscattered_allocation(*defects: str) -> Cluster:
    c = cluster(config(ring_regions=1), *defects)
    c.add_request(0, 64)
    # Decode allocates, but prefill never hears back: room 0 holds an unscattered allocation.
    c.pending[:] = []
    c.rooms[0].next_send = len(c.rooms[0].sends)
    for d in ("d0g0r0", "d0g0r1"):
        c._feed(d, ev.MessageArrived(src="p0g0r0", msg=wire.StagingReq(
            room=0, chunk_idx=0, chunk_pages=4, session_id=d)))
    c.pending[:] = []
    for d in ("d0g0r0", "d0g0r1"):
        c._feed(d, ev.RoomAborted(room=0, reason="client abort"))
    # Keep the watermarks and the ABORTs (the prefill ranks acknowledge them, so the held
    # room is released: deferred decode KV release).
    c.pending[:] = [a for a in c.pending if a.kind == "msg" and isinstance(
        a.event.msg, (wire.Watermark, wire.Abort))]
    settle(c)
    c.add_request(1, 64)
    settle(c)
    return c


def test_no_release_room_on_pins_watermark_and_wedges_later_rooms():
    c = _abort_with_unscattered_allocation(NO_RELEASE_ROOM)
    assert c.outcome(0) == "Failed" and c.outcome(1) == "pending"
    assert c.ranks["d0g0r0"].watermark == (0, 0)
    assert len(c.ranks["d0g0r0"].snapshot().live) == 2


def test_no_release_room_off_frees_and_later_rooms_run():
    c = _abort_with_unscattered_allocation()
    assert c.outcome(0) == "Failed" and c.outcome(1) == "Success"


# -- swallowed-chunk-ready-error -----------------------------------------------------------------
def _chunk_ready_send_fails(*defects: str) -> Cluster:
    c = cluster(config(), *defects)
    c.add_request(0, 128)
    failed = False
    for _ in range(10_000):
        cs = c.choices()
        if not cs:
            break
        a = c.pending[cs[0]]
        if (not failed and a.kind == "msg" and isinstance(a.event.msg, wire.ChunkReady)
                and a.event.msg.chunk_idx == 0):
            c.pending.pop(cs[0])  # the socket send raised: decode never sees it
            c._feed(a.src, ev.SendFailed(dst=a.node, msg=a.event.msg))
            failed = True
            continue
        c.step(cs[0])
    assert failed
    return c


def test_swallowed_chunk_ready_error_on_room_stalls_to_timeout():
    c = _chunk_ready_send_fails(SWALLOWED_CHUNK_READY_ERROR)
    assert c.outcome(0) == "pending"
    finish(c)
    assert c.outcome(0) == "Failed" and c.now >= c.cfg.waiting_timeout_s


def test_swallowed_chunk_ready_error_off_room_fails_at_once():
    c = _chunk_ready_send_fails()
    assert c.outcome(0) == "Failed"
    assert all(not r.snapshot().live for n, r in c.ranks.items() if n.startswith("d"))


# -- silent-slice-fallback -----------------------------------------------------------------------
def _oversized_first_send(*defects: str) -> Cluster:
    # Without grid alignment, a 160-token prefill radix hit is sent as one 10-page chunk, more
    # than the chunk-sized prefill staging buffer holds.
    c = cluster(config(), NO_GRID_ALIGNMENT, *defects)
    c.add_request(0, 200, prefill_prefix_len=160)
    settle(c)
    return c


def test_silent_slice_fallback_on_leaks_allocation_and_pins_watermark():
    c = _oversized_first_send(SILENT_SLICE_FALLBACK)
    assert c.outcome(0) == "pending"
    d = c.ranks["d0g0r0"]
    assert d.snapshot().live and d.watermark == (0, 0)


def test_silent_slice_fallback_off_fails_the_room():
    c = _oversized_first_send()
    assert c.outcome(0) == "Failed"
    assert all(not r.snapshot().live for n, r in c.ranks.items() if n.startswith("d"))


# -- no-grid-alignment ---------------------------------------------------------------------------
def _radix_hit(*defects: str) -> Cluster:
    cfg = config(prefill_staging_buffer_pages=64)  # the pre-fix era's large fixed buffer
    c = cluster(cfg, *defects)
    c.add_request(0, 300, prefill_prefix_len=160)
    c.add_request(1, 200, decode_prefix_len=32, prefill_prefix_len=112)
    settle(c)
    finish(c)
    return c


def test_no_grid_alignment_on_corrupts():
    c = _radix_hit(NO_GRID_ALIGNMENT)
    assert kinds(c) & {"overwrite", "overrun", "misplaced", "incomplete"}, outcomes(c)


def test_no_grid_alignment_off_clean():
    c = _radix_hit()
    assert not c.integrity.violations and outcomes(c) == {0: "Success", 1: "Success"}


# -- teardown-drops-deferred and completion-before-last-scatter ------------------------------------
def _last_chunk_overtakes(*defects: str) -> Cluster:
    # One send covers two grid slots (a 100-token prefill radix hit, not page-aligned, so no
    # early send). Chunk 0 defers while its allocation is pending; by the time the worker polls
    # again, the last chunk is at the head of the queue and goes first.
    c = cluster(config(), *defects)
    c.add_request(0, 128, prefill_prefix_len=100)
    settle(c, pick=avoid(c, "poll"))
    return c


def test_teardown_drops_deferred_on_skips_chunk_and_times_out():
    c = _last_chunk_overtakes(TEARDOWN_DROPS_DEFERRED)
    assert c.outcome(0) == "pending"
    finish(c)
    assert c.outcome(0) == "Failed"


def test_teardown_drops_deferred_off_succeeds():
    c = _last_chunk_overtakes()
    assert c.outcome(0) == "Success" and not c.integrity.violations


def test_completion_before_last_scatter_on_completes_before_data_landed():
    c = _last_chunk_overtakes(COMPLETION_BEFORE_LAST_SCATTER)
    assert "incomplete" in kinds(c), c.integrity.violations


def test_completion_before_last_scatter_off_waits_for_every_scatter():
    c = _last_chunk_overtakes()
    assert not c.integrity.violations


# -- raise-on-unaligned-prefix -------------------------------------------------------------------
def _unaligned_prefix(*defects: str) -> Cluster:
    c = cluster(config(), *defects)
    c.add_request(0, 100, decode_prefix_len=8)
    c.add_request(1, 100)
    settle(c)
    return c


def test_raise_on_unaligned_prefix_on_kills_the_rank():
    c = _unaligned_prefix(RAISE_ON_UNALIGNED_PREFIX)
    assert c.crashed
    finish(c)
    assert c.outcome(1) != "Success"


def test_raise_on_unaligned_prefix_off_fails_only_that_room():
    c = _unaligned_prefix()
    assert not c.crashed and outcomes(c) == {0: "Failed", 1: "Success"}
