"""Prefill rank state machine, fed by hand through ``handle()``."""

from __future__ import annotations

from twin.core import events as ev
from twin.core import wire
from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.core.prefill import PrefillRank

MODEL = ModelShape(num_layers=2, num_kv_heads=8, head_dim=4, dtype_bytes=2)
CFG = TwinConfig(prefill=ServerSide(tp_size=4), decode=ServerSide(tp_size=2), model=MODEL,
                 chunked_prefill_size=64, page_size=16, staging_pool_size_bytes=1 << 20)
CFG_FANOUT = CFG.replace(prefill=ServerSide(tp_size=1))  # one prefill rank -> two decode ranks


def of(effects, kind):
    return [e for e in effects if isinstance(e, kind)]


def sent(effects, msg_kind):
    return [e for e in of(effects, ev.Send) if isinstance(e.msg, msg_kind)]


def boot(p, room=1, pages=8, prefix=0, sessions=(("d0", 0),)):
    targets = tuple(ev.Target(session=s, decode_rank=r, total_pages=pages,
                              decode_prefix_len=prefix) for s, r in sessions)
    return p.handle(ev.RoomBootstrapped(room=room, targets=targets), 0.0)


def rsp(p, room=1, chunk=0, offset=0, rnd=0, end=4096, session="d0"):
    return p.handle(ev.MessageArrived(src=session, msg=wire.StagingRsp(
        room=room, chunk_idx=chunk, offset=offset, round=rnd, end=end, session_id=session)), 0.0)


def wm(p, rnd, tail, session="d0"):
    return p.handle(ev.MessageArrived(src=session, msg=wire.Watermark(
        round=rnd, tail=tail, session_id=session)), 0.0)


def send(p, room=1, end=128, last=False):
    return p.handle(ev.SendKV(room=room, end_idx=end, last=last), 0.0)


def done(p, worker=0, ok=True):
    return p.handle(ev.TransferDone(worker=worker, ok=ok, error="" if ok else "boom"), 0.0)


def test_prefetch_one_req_per_chunk_and_session_deduplicated():
    p = PrefillRank(CFG_FANOUT, "p0", 0, 0)
    boot(p, pages=9, sessions=(("d0", 0), ("d1", 1)))
    out = p.handle(ev.Prefetch(room=1), 0.0)
    reqs = sent(out, wire.StagingReq)
    assert sorted((s.dst, s.msg.chunk_idx, s.msg.chunk_pages) for s in reqs) == [
        ("d0", 0, 4), ("d0", 1, 4), ("d0", 2, 1), ("d1", 0, 4), ("d1", 1, 4), ("d1", 2, 1)]
    assert not sent(p.handle(ev.Prefetch(room=1), 0.0), wire.StagingReq)
    assert not sent(send(p, end=64), wire.StagingReq)  # the send path prefetches only once


def test_staging_rsp_bookkeeping():
    p = PrefillRank(CFG, "p0", 0, 0)
    boot(p)
    rsp(p, chunk=1, offset=4096, rnd=2, end=8192)
    assert p.snapshot().rooms[1].targets[0].staging == {1: (4096, 2, 8192)}
    assert of(rsp(p, room=99), ev.Dropped)


def test_watermark_is_monotonic_per_session():
    p = PrefillRank(CFG, "p0", 0, 0)
    wm(p, 1, 100)
    wm(p, 1, 50)
    wm(p, 0, 999)
    assert p.snapshot().watermarks == {"d0": (1, 100)}
    wm(p, 2, 0, session="d1")
    assert p.snapshot().watermarks == {"d0": (1, 100), "d1": (2, 0)}


def test_sends_floored_to_grid_anchored_at_decode_prefix():
    p = PrefillRank(CFG, "p0", 0, 0)
    boot(p, pages=11, prefix=32)  # grid 64 tokens = 4 pages, base 32
    out = send(p, end=150)
    assert [(q.page_start, q.num_pages, q.chunk_idx) for q in of(out, ev.ChunkQueued)] == [
        (0, 4, 0)]
    assert p.snapshot().rooms[1].start_send_idx == 96
    out = send(p, end=200, last=True)
    assert [(q.page_start, q.num_pages, q.chunk_idx, q.is_last)
            for q in of(out, ev.ChunkQueued)] == [(4, 4, 1, False), (8, 3, 2, True)]


def test_non_last_send_shorter_than_a_slot_sends_nothing():
    p = PrefillRank(CFG, "p0", 0, 0)
    boot(p)
    out = send(p, end=60)  # floored to the base: an empty chunk, no write
    assert [q.num_pages for q in of(out, ev.ChunkQueued)] == [0]
    assert not of(out, ev.StartTransfer) and not of(out, ev.Deferred)
    assert p.snapshot().rooms[1].start_send_idx == 0 and p.snapshot().rooms[1].outstanding == 0


def test_prefill_radix_hit_early_send_split_per_slot():
    p = PrefillRank(CFG, "p0", 0, 0)
    boot(p, pages=16)
    out = send(p, end=200)  # cached prefix of 200 tokens sent before the first forward
    assert [(q.page_start, q.num_pages, q.chunk_idx) for q in of(out, ev.ChunkQueued)] == [
        (0, 4, 0), (4, 4, 1), (8, 4, 2)]


def test_deferral_requeues_at_tail_without_head_of_line_blocking():
    p = PrefillRank(CFG, "p0", 0, 0)
    boot(p, room=1)
    boot(p, room=2)
    out = send(p, room=1, end=64)  # no allocation yet
    (d,) = of(out, ev.Deferred)
    assert (d.room, d.reason, d.all_blocked) == (1, "allocation pending", True)
    # A STAGING_RSP does not wake the sleeping worker at once: it polls after the bounded wait.
    assert of(rsp(p, room=2, chunk=0), ev.WakeWorkers) == [
        ev.WakeWorkers(workers=(0,), at=CFG.deferral_wait_s)]
    out = send(p, room=2, end=64)
    assert not of(out, ev.StartTransfer) and not of(out, ev.WakeWorkers)
    out = p.handle(ev.WorkerPoll(worker=0), 0.001)  # room 1 again: re-put at the tail
    out += p.handle(ev.WorkerPoll(worker=0), 0.002)
    starts = of(out, ev.StartTransfer)
    assert [s.room for s in starts] == [2]
    deferred = of(out, ev.Deferred)
    assert [x.room for x in deferred] == [1]
    assert [c.room for c in p.snapshot().workers[0].queue] == [1]


def test_every_watermark_wakes_a_deferred_worker_even_when_it_does_not_advance():
    p = PrefillRank(CFG, "p0", 0, 0)
    boot(p)
    rsp(p, offset=0, rnd=1, end=4096)
    send(p, end=64)
    wm(p, 0, 100)
    p.handle(ev.WorkerPoll(worker=0), 0.0)  # still behind: deferred again
    out = wm(p, 0, 100)  # the same watermark again
    assert of(out, ev.WakeWorkers) == [ev.WakeWorkers(workers=(0,))]


def test_eager_wake_is_the_model_of_older_traces():
    p = PrefillRank(CFG.replace(worker_wake="eager"), "p0", 0, 0)
    boot(p)
    send(p, end=64)
    assert of(rsp(p), ev.WakeWorkers) == [ev.WakeWorkers(workers=(0,))]


def test_watermark_behind_defers_until_it_moves():
    p = PrefillRank(CFG, "p0", 0, 0)
    boot(p)
    rsp(p, offset=0, rnd=1, end=4096)
    (d,) = of(send(p, end=64), ev.Deferred)
    assert "watermark" in d.reason
    out = wm(p, 0, 4096)
    assert of(out, ev.WakeWorkers) == [ev.WakeWorkers(workers=(0,))]
    assert of(p.handle(ev.WorkerPoll(worker=0), 0.0), ev.StartTransfer)


def test_oversized_fails_the_room():
    p = PrefillRank(CFG, "p0", 0, 0)
    boot(p)
    rsp(p, offset=-2, rnd=0, end=-1)
    out = send(p, end=128, last=True)
    (c,) = of(out, ev.RoomConcluded)
    assert c.status == "Failed" and "oversized" in c.reason
    (st,) = sent(out, wire.TransferStatus)
    assert st.msg.status == wire.KVPoll.Failed
    assert not of(out, ev.StartTransfer)


def test_chunk_ready_only_after_transfer_done():
    p = PrefillRank(CFG, "p0", 0, 0)
    boot(p)
    rsp(p)
    out = send(p, end=64)
    (t,) = of(out, ev.StartTransfer)
    assert (t.region_offset, t.dst_offset, t.writer) == (0, 0, 0)
    assert not sent(out, wire.ChunkReady)
    (cr,) = sent(done(p), wire.ChunkReady)
    assert (cr.dst, cr.msg.chunk_idx, cr.msg.page_start, cr.msg.num_pages) == ("d0", 0, 0, 4)


def test_writer_block_offset_inside_region():
    p = PrefillRank(CFG, "p1", 1, 1)  # prefill rank 1 is writer 1 of decode rank 0
    boot(p)
    rsp(p, offset=1000)
    (t,) = of(send(p, end=64), ev.StartTransfer)
    assert t.writer == 1 and t.dst_offset == 1000 + t.nbytes


def test_failed_transfer_fails_the_room():
    p = PrefillRank(CFG, "p0", 0, 0)
    boot(p)
    rsp(p)
    send(p, end=64, last=True)
    out = done(p, ok=False)
    assert of(out, ev.RoomConcluded)[0].status == "Failed"
    assert not sent(out, wire.ChunkReady)


def test_last_chunk_concludes_success_to_each_target_then_tears_down():
    p = PrefillRank(CFG_FANOUT, "p0", 0, 0)
    boot(p, pages=4, sessions=(("d0", 0), ("d1", 1)))
    rsp(p, session="d0")
    rsp(p, session="d1")
    out = send(p, end=64, last=True)
    w = of(out, ev.StartTransfer)[0].worker
    assert [t.session for t in of(out, ev.StartTransfer)] == ["d0"]
    out = done(p, worker=w)
    assert [s.dst for s in sent(out, wire.ChunkReady)] == ["d0"]
    assert [t.session for t in of(out, ev.StartTransfer)] == ["d1"]
    assert not of(out, ev.RoomConcluded)
    out = done(p, worker=w)
    assert [s.dst for s in sent(out, wire.ChunkReady)] == ["d1"]
    assert of(out, ev.RoomConcluded) == [ev.RoomConcluded(room=1, status="Success")]
    assert sorted((s.dst, s.msg.status) for s in sent(out, wire.TransferStatus)) == [
        ("d0", wire.KVPoll.Success), ("d1", wire.KVPoll.Success)]
    assert of(out, ev.RoomTornDown) and 1 not in p.snapshot().rooms


def test_teardown_waits_for_outstanding_deferred_chunk():
    p = PrefillRank(CFG, "p0", 0, 0)
    boot(p, pages=8)
    rsp(p, chunk=1, offset=4096, end=8192)  # chunk 1 allocated, chunk 0 still pending
    out = send(p, end=128, last=True)
    assert [d.chunk_idx for d in of(out, ev.Deferred)] == [0]
    out = p.handle(ev.WorkerPoll(worker=0), 0.0)
    assert [t.chunk_idx for t in of(out, ev.StartTransfer)] == [1]
    assert p.snapshot().rooms[1].outstanding == 2
    out = done(p)
    assert of(out, ev.RoomConcluded)[0].status == "Success"
    assert not of(out, ev.RoomTornDown) and p.snapshot().rooms[1].outstanding == 1
    rsp(p, chunk=0)
    out = p.handle(ev.WorkerPoll(worker=0), 0.0)
    assert [t.chunk_idx for t in of(out, ev.StartTransfer)] == [0]
    out = done(p)
    assert [s.msg.chunk_idx for s in sent(out, wire.ChunkReady)] == [0]
    assert of(out, ev.RoomTornDown) and 1 not in p.snapshot().rooms


def test_abort_skips_queued_chunks_and_tears_down():
    p = PrefillRank(CFG, "p0", 0, 0)
    boot(p)
    send(p, end=64)
    out = p.handle(ev.RoomAborted(room=1), 0.0)
    assert of(out, ev.RoomConcluded)[0].status == "Failed"
    out = p.handle(ev.WorkerPoll(worker=0), 0.0)
    assert of(out, ev.ChunkSkipped) and of(out, ev.RoomTornDown) and 1 not in p.snapshot().rooms


def test_failed_chunk_ready_send_fails_the_room():
    p = PrefillRank(CFG, "p0", 0, 0)
    boot(p)
    msg = wire.ChunkReady(room=1, chunk_idx=0, page_start=0, num_pages=4, writer_id="d0",
                          prefill_rank=0)
    out = p.handle(ev.SendFailed(dst="d0", msg=msg), 0.0)
    assert of(out, ev.RoomConcluded)[0].status == "Failed"
