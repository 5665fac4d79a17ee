"""Decode rank state machine, fed by hand through ``handle()``."""

from __future__ import annotations

from twin.core import events as ev
from twin.core import wire
from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.core.decode import DecodeRank
from twin.core.defects import Defects

MODEL = ModelShape(num_layers=2, num_kv_heads=8, head_dim=4, dtype_bytes=2)
CFG = TwinConfig(prefill=ServerSide(tp_size=4), decode=ServerSide(tp_size=2), model=MODEL,
                 chunked_prefill_size=64, page_size=16, staging_pool_size_bytes=3 * 8192)
WRITERS = ("p0", "p1")  # prefill TP4 -> decode TP2: two writers per decode rank
REGION = 64 * 4 * 8 * 2 * 2  # one full chunk: 64 tokens x 4 heads x 8 B x 2 layers x K,V


def of(effects, kind):
    return [e for e in effects if isinstance(e, kind)]


def sent(effects, msg_kind):
    return [e for e in of(effects, ev.Send) if isinstance(e.msg, msg_kind)]


NO_DEFER = CFG.replace(deferred_decode_kv_release=False)


def rank(defects=(), cfg=CFG):
    return DecodeRank(cfg, "d0", 0, Defects.of(defects))


def ack(d, room=1, rank_id=0, generation=1, now=0.0):
    return d.handle(ev.MessageArrived(src=f"p{rank_id}", msg=wire.AbortAck(
        room=room, prefill_rank=rank_id, generation=generation)), now)


def aborts(effects):
    return [(e.dst, e.msg) for e in of(effects, ev.Send) if isinstance(e.msg, wire.Abort)]


def init(d, room=1, total_pages=8, prefix=0, writers=WRITERS, now=0.0):
    return d.handle(ev.DecodeRoomInit(room=room, prefill_ranks=writers, prefill_attn_tp=4,
                                      decode_prefix_len=prefix, total_pages=total_pages), now)


def req(d, room=1, chunk=0, pages=4, src="p0", session="d0", now=0.0):
    return d.handle(ev.MessageArrived(src=src, msg=wire.StagingReq(
        room=room, chunk_idx=chunk, chunk_pages=pages, session_id=session)), now)


def ready(d, room=1, chunk=0, pages=4, src="p0", rank_id=0, now=0.0):
    return d.handle(ev.MessageArrived(src=src, msg=wire.ChunkReady(
        room=room, chunk_idx=chunk, page_start=chunk * 4, num_pages=pages, writer_id="d0",
        prefill_rank=rank_id)), now)


def status(d, room=1, src="p0", st=wire.KVPoll.Success, now=0.0):
    return d.handle(ev.MessageArrived(src=src, msg=wire.TransferStatus(
        room=room, status=st, prefill_rank=0)), now)


def test_registration_sends_metadata_and_arms_timeout():
    d = rank()
    out = init(d)
    (meta,) = of(out, ev.SendMetadata)
    assert meta.prefill_ranks == WRITERS and meta.total_pages == 8
    assert of(out, ev.SetTimer)[0].at > CFG.waiting_timeout_s
    assert d.snapshot().rooms[1].registered


def test_unaligned_decode_prefix_fails_only_that_room():
    d = rank()
    init(d, room=1)
    out = init(d, room=2, prefix=8)
    (done,) = of(out, ev.RoomConcluded)
    assert done.status == "Failed" and "page-aligned" in done.reason
    # SGLang's failed path: ABORT (armed generation) to every writer, then hold the room
    assert [dst for dst, m in aborts(out)] == list(WRITERS)
    assert {m.generation for _, m in aborts(out)} == {1}
    (held,) = of(out, ev.RoomHeld)
    assert held.required_acks == 2 and d.snapshot().rooms[2].held
    assert 1 in d.snapshot().rooms and d.snapshot().crashed is None
    assert of(req(d, room=1), ev.Allocated)  # room 1 still served


def test_staging_req_allocates_once_and_answers_every_writer():
    d = rank()
    init(d)
    first = req(d, src="p0")
    second = req(d, src="p1")
    (alloc,) = of(first, ev.Allocated)
    assert (alloc.offset, alloc.round, alloc.size) == (0, 0, REGION)
    assert not of(second, ev.Allocated)
    for out in (first, second):
        rsps = sent(out, wire.StagingRsp)
        assert sorted(s.dst for s in rsps) == sorted(WRITERS)
        assert {(s.msg.offset, s.msg.round, s.msg.end) for s in rsps} == {(0, 0, REGION)}


def test_oversized_answers_minus_two():
    d = DecodeRank(CFG.replace(staging_pool_size_bytes=REGION - 1), "d0", 0)
    init(d)
    out = req(d)
    assert not of(out, ev.Allocated)
    assert {s.msg.offset for s in sent(out, wire.StagingRsp)} == {-2}
    assert {s.msg.offset for s in sent(req(d, src="p1"), wire.StagingRsp)} == {-2}


def test_staging_req_dropped_when_room_not_registered():
    d = rank()
    out = req(d, room=9)
    assert of(out, ev.Dropped) and not sent(out, wire.StagingRsp)


def test_first_staging_req_of_a_group_gets_watermark_snapshot():
    d = rank()
    init(d, room=1)
    init(d, room=2, writers=("p2", "p3"))
    out = req(d, room=1)
    assert sorted(s.dst for s in sent(out, wire.Watermark)) == ["p0", "p1"]
    assert not sent(req(d, room=1, chunk=1), wire.Watermark)  # already subscribed
    out = req(d, room=2, src="p2")
    assert sorted(s.dst for s in sent(out, wire.Watermark)) == ["p2", "p3"]


def test_chunk_ready_fan_in_then_scatter():
    d = rank()
    init(d)
    req(d)
    assert not of(ready(d, src="p0"), ev.StartScatter)
    (sc,) = of(ready(d, src="p1", rank_id=1), ev.StartScatter)
    assert (sc.room, sc.chunk_idx, sc.offset, sc.nbytes, sc.page_start, sc.num_pages) == (
        1, 0, 0, REGION, 0, 4)
    assert not sc.blind


def test_scatter_done_frees_and_broadcasts_to_every_subscriber():
    d = rank()
    init(d, room=1)
    init(d, room=2, writers=("p2", "p3"))
    req(d, room=1)
    req(d, room=2, src="p2")
    ready(d, src="p0")
    (sc,) = of(ready(d, src="p1"), ev.StartScatter)
    out = d.handle(ev.ScatterDone(room=1, chunk_idx=0, alloc_id=sc.alloc_id), 0.0)
    assert of(out, ev.Freed)[0].reason == "scattered"
    assert of(out, ev.WatermarkMoved) == [ev.WatermarkMoved(round=0, tail=REGION, lag_bytes=REGION)]
    assert sorted(s.dst for s in sent(out, wire.Watermark)) == ["p0", "p1", "p2", "p3"]


def test_completion_needs_all_success_and_every_scatter():
    d = rank()
    init(d, total_pages=4)
    req(d)
    status(d, src="p0")
    out = status(d, src="p1")
    assert not of(out, ev.RoomConcluded)  # chunk 0 not scattered yet
    ready(d, src="p0")
    (sc,) = of(ready(d, src="p1"), ev.StartScatter)
    assert not of(d.handle(ev.Tick(), 1.0), ev.RoomConcluded)  # scatter in flight
    out = d.handle(ev.ScatterDone(room=1, chunk_idx=0, alloc_id=sc.alloc_id), 1.0)
    assert ev.RoomConcluded(room=1, status="Success") in out
    assert 1 not in d.snapshot().rooms


def test_completion_timeout_after_success():
    d = rank()
    init(d, total_pages=4)
    req(d)
    status(d, src="p0", now=5.0)
    out = status(d, src="p1", now=5.0)
    (timer,) = of(out, ev.SetTimer)
    assert timer.at > 5.0 + CFG.waiting_timeout_s
    assert not of(d.handle(ev.Tick(), timer.at - 1.0), ev.RoomConcluded)
    out = d.handle(ev.Tick(), timer.at)
    (done,) = of(out, ev.RoomConcluded)
    assert done.status == "Failed" and "not complete" in done.reason
    # a completion timeout after all-ranks Success sends ABORT, then holds the staging
    assert [dst for dst, _ in aborts(out)] == list(WRITERS)
    assert not of(out, ev.Freed) and d.snapshot().live
    ack(d, rank_id=0, now=timer.at)
    out = ack(d, rank_id=1, now=timer.at)
    assert of(out, ev.RoomReleased) == [ev.RoomReleased(room=1, drained=True)]
    # release_room freed the never-scattered allocation
    assert [f.reason for f in of(out, ev.Freed)] == ["released"]
    assert not d.snapshot().live


def test_waiting_timeout_without_result_fails_and_notifies_prefill():
    d = rank()
    (timer,) = of(init(d), ev.SetTimer)
    out = d.handle(ev.Tick(), timer.at)
    assert [dst for dst, _ in aborts(out)] == list(WRITERS)
    assert of(out, ev.RoomConcluded)[0].status == "Failed"


def test_waiting_clock_starts_at_send_metadata_and_fails_at_elapsed_equal_timeout():
    """SGLang starts a room's waiting clock at the end of ``send_metadata`` (``init_time``,
    common/conn.py ~2886) and fails it once ``elapsed >= timeout`` in WaitingForInput
    (~2603-2611, ~2888-2893). The twin sends the metadata in the room's DecodeRoomInit, so
    the clock starts there even when registration comes later (late-decode-registration);
    an input that polls the room at exactly the timeout fails it (``>``, as the twin had,
    waited past that poll)."""
    t = CFG.waiting_timeout_s
    d = rank(defects=("late-decode-registration",))
    out = init(d, now=1.0)
    (meta,) = of(out, ev.SendMetadata)
    assert meta.register_at is not None and meta.register_at > 1.0
    d.handle(ev.DecodeRoomRegister(room=1), meta.register_at)  # registered later
    req(d, now=2.0)
    assert not of(ready(d, now=1.0 + t - 0.5), ev.RoomConcluded)
    out = ready(d, src="p1", rank_id=1, now=1.0 + t)  # polls the room at exactly the timeout
    (done,) = of(out, ev.RoomConcluded)
    assert done.status == "Failed" and "no transfer result" in done.reason


def test_prefill_failure_releases_unscattered_allocations_without_deferred_release():
    d = rank(cfg=NO_DEFER)
    init(d)
    req(d, chunk=0)
    req(d, chunk=1)
    assert len(d.snapshot().live) == 2
    out = status(d, src="p1", st=wire.KVPoll.Failed)
    assert of(out, ev.RoomConcluded)[0].status == "Failed"
    assert not aborts(out)  # a failure decode did not start: no ABORT with the setting off
    assert sorted(f.chunk_idx for f in of(out, ev.Freed)) == [0, 1]
    assert not d.snapshot().live
    assert d.watermark == (1, 0)


def test_prefill_failure_holds_until_every_writer_acknowledged():
    d = rank()
    init(d)
    req(d, chunk=0)
    req(d, chunk=1)
    out = status(d, src="p1", st=wire.KVPoll.Failed)
    assert of(out, ev.RoomConcluded)[0].status == "Failed"
    assert [dst for dst, _ in aborts(out)] == list(WRITERS)  # ensure_abort_notified(force_arm)
    assert not of(out, ev.Freed) and len(d.snapshot().live) == 2
    assert of(ack(d, rank_id=0, generation=7), ev.Dropped)  # another generation's ACK
    assert not of(ack(d, rank_id=0), ev.Freed)
    out = ack(d, rank_id=1)
    assert sorted(f.chunk_idx for f in of(out, ev.Freed)) == [0, 1]
    assert not d.snapshot().live and 1 not in d.snapshot().rooms


def test_held_room_is_released_at_the_deadline_without_acks():
    d = rank()
    init(d)
    req(d)
    out = d.handle(ev.RoomAborted(room=1), 1.0)
    (held,) = of(out, ev.RoomHeld)
    assert held.release_at == 1.0 + CFG.deferred_decode_kv_release_timeout_s
    assert not of(d.handle(ev.Tick(), held.release_at - 0.5), ev.Freed)
    out = d.handle(ev.Tick(), held.release_at + 1e-3)
    assert of(out, ev.RoomReleased) == [ev.RoomReleased(room=1, drained=False)]
    assert of(out, ev.Freed) and not d.snapshot().live


def test_abort_releases_room():
    d = rank(cfg=NO_DEFER)
    init(d)
    req(d)
    out = d.handle(ev.RoomAborted(room=1), 0.0)
    assert [m.generation for _, m in aborts(out)] == [None, None]  # no acknowledgement awaited
    assert of(out, ev.Freed) and not d.snapshot().live


def test_late_chunk_ready_after_unregister_is_dropped():
    d = rank(cfg=NO_DEFER)
    init(d)
    d.handle(ev.RoomAborted(room=1), 0.0)
    out = ready(d)
    assert of(out, ev.Dropped) and not of(out, ev.StartScatter)


def test_held_room_still_scatters_and_frees_only_at_release():
    """A held room stays registered: CHUNK_READY still scatters, and the finished scatter's
    allocation is freed by release_room, not by the poll (the room left the queue)."""
    d = rank()
    init(d, total_pages=4)
    req(d)
    d.handle(ev.RoomAborted(room=1), 0.0)
    ready(d, src="p0")
    (sc,) = of(ready(d, src="p1"), ev.StartScatter)
    out = d.handle(ev.ScatterDone(room=1, chunk_idx=0, alloc_id=sc.alloc_id), 0.1)
    assert not of(out, ev.Freed) and d.snapshot().live
    ack(d, rank_id=0, now=0.2)
    out = ack(d, rank_id=1, now=0.2)
    assert [f.alloc_id for f in of(out, ev.Freed)] == [sc.alloc_id]


def test_failed_status_after_all_ranks_success_is_not_seen():
    """SGLang's receiver caches Success once every rank reported it; a later KV_STATUS Failed
    (a deferred chunk that failed after the last one succeeded) is not seen, and the room
    waits for the chunk until the completion timeout (found by the differential test)."""
    d = rank(cfg=NO_DEFER)
    init(d, total_pages=4)
    req(d)
    status(d, src="p0")
    status(d, src="p1")
    out = status(d, src="p1", st=wire.KVPoll.Failed)
    assert of(out, ev.Dropped) and not of(out, ev.RoomConcluded)
    assert d.snapshot().rooms[1].state.value == "AllSuccess"


def test_release_drains_in_flight_scatters_and_frees_them_with_the_room():
    """release_room synchronizes the scatter stream, then frees the unscattered allocations
    and every submitted scatter's; the scatter's own completion afterwards changes nothing."""
    d = rank(cfg=NO_DEFER)
    init(d, total_pages=8)
    req(d, chunk=0)
    req(d, chunk=1)
    ready(d, src="p0")
    (sc,) = of(ready(d, src="p1"), ev.StartScatter)
    out = d.handle(ev.RoomAborted(room=1), 0.0)
    assert [f.alloc_id for f in of(out, ev.Freed)] == [1, sc.alloc_id]  # unscattered first
    assert not d.snapshot().live
    assert d.handle(ev.ScatterDone(room=1, chunk_idx=0, alloc_id=sc.alloc_id), 0.1) == []


def _scattered_chunk_then_late_req(d):
    """Chunk 0 of a two-writer room: p0's STAGING_REQ allocates, both writers (p1 has the RSP
    too) write and report, the scatter completes; then p1's own STAGING_REQ arrives."""
    init(d, total_pages=8)
    req(d, src="p0")
    ready(d, src="p0")
    (sc,) = of(ready(d, src="p1", rank_id=1), ev.StartScatter)
    d.handle(ev.ScatterDone(room=1, chunk_idx=0, alloc_id=sc.alloc_id), 0.0)
    return req(d, src="p1")


def test_late_staging_req_after_scatter_allocates_again_as_sglang_does():
    d = rank()
    late = _scattered_chunk_then_late_req(d)
    (alloc,) = of(late, ev.Allocated)
    assert alloc.chunk_idx == 0 and alloc.alloc_id == 1  # a second, fresh allocation
    assert sorted(s.dst for s in sent(late, wire.StagingRsp)) == sorted(WRITERS)
    snap = d.snapshot()
    assert snap.rooms[1].chunks[0].late
    assert [a.alloc_id for a in snap.live] == [1]  # live: it pins the watermark


def test_drop_late_staging_req_fix_ignores_it():
    d = DecodeRank(CFG.replace(fixes=("drop-late-staging-req",)), "d0", 0, Defects())
    late = _scattered_chunk_then_late_req(d)
    assert not of(late, ev.Allocated) and not sent(late, wire.StagingRsp)
    (dropped,) = of(late, ev.Dropped)
    assert "already scattered" in dropped.reason
    assert 0 not in d.snapshot().rooms[1].chunks


def test_negative_chunk_idx_is_a_python_index_into_the_chunk_list():
    """0.5.23 indexes ``chunk_staging_infos`` with the wire's chunk_idx: -1 after chunk 0 was
    allocated is chunk 0, answered with chunk 0's region (no new allocation)."""
    d = rank()
    init(d)
    first = sent(req(d, chunk=0), wire.StagingRsp)[0].msg
    out = req(d, chunk=-1, src="p1")
    assert not of(out, ev.Allocated)
    rsp = sent(out, wire.StagingRsp)[0].msg
    assert (rsp.chunk_idx, rsp.offset, rsp.end) == (-1, first.offset, first.end)


def test_negative_chunk_idx_past_the_list_leaks_ring_space_and_ends_the_listener():
    """On a room with no chunk yet, ``infos[-5] = ...`` raises IndexError after the ring space
    was assigned: the allocation is recorded nowhere (never freed) and the exception ends
    decode_listener_thread. The rank then drops every frame; its scheduler goes on, so the
    waiting timeout still fails the room. PR #39792 drops the request instead."""
    d = rank()
    init(d)
    out = req(d, chunk=-5)
    (leak,) = of(out, ev.Allocated)
    assert "IndexError" in of(out, ev.Dropped)[0].reason and not sent(out, wire.StagingRsp)
    assert d.snapshot().listener_dead and [a.alloc_id for a in d.snapshot().live] == [
        leak.alloc_id]
    assert of(req(d, chunk=0, now=1.0), ev.Dropped)[0].reason == "decode listener thread ended"
    out = d.handle(ev.Tick(), CFG.waiting_timeout_s + 1.0)
    (done,) = of(out, ev.RoomConcluded)
    assert done.status == "Failed" and [a.alloc_id for a in d.snapshot().live] == [
        leak.alloc_id]  # release_room walks the chunk list: the leak stays

    f = rank(cfg=CFG.replace(fixes=("bound-staging-req-chunk",)))
    init(f)
    out = req(f, chunk=-5)
    assert not of(out, ev.Allocated) and "out of range" in of(out, ev.Dropped)[0].reason
    assert f.snapshot().listener_dead is None and sent(req(f, chunk=0), wire.StagingRsp)
