"""``answer-requester-only``: lost-control recovery's re-requests answered to their sender
only, and backed off while a chunk stays deferred (docs/defects.md, "`lost-control-recovery`
answers every re-request to every writer")."""

from __future__ import annotations

from twin.core import events as ev
from twin.core import wire
from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.core.decode import DecodeRank
from twin.core.fixes import ANSWER_REQUESTER_ONLY, LOST_CONTROL_RECOVERY
from twin.core.prefill import PrefillRank

MODEL = ModelShape(num_layers=2, num_kv_heads=8, head_dim=4, dtype_bytes=2)
CFG = TwinConfig(prefill=ServerSide(tp_size=8), decode=ServerSide(tp_size=2), model=MODEL,
                 chunked_prefill_size=64, page_size=16, staging_pool_size_bytes=1 << 20,
                 waiting_timeout_s=4.0)
WRITERS = ("p0", "p1", "p2", "p3")  # prefill TP8 -> decode TP2: four writers per decode rank
BOTH = (LOST_CONTROL_RECOVERY, ANSWER_REQUESTER_ONLY)


def sends(effects, msg_kind):
    return [e for e in effects if isinstance(e, ev.Send) and isinstance(e.msg, msg_kind)]


def decode(fixes):
    d = DecodeRank(CFG.replace(fixes=fixes), "d0", 0)
    d.handle(ev.DecodeRoomInit(room=1, prefill_ranks=WRITERS, prefill_attn_tp=8,
                               decode_prefix_len=0, total_pages=8), 0.0)
    return d


def req(d, src, now=0.0):
    return d.handle(ev.MessageArrived(src=src, msg=wire.StagingReq(
        room=1, chunk_idx=0, chunk_pages=4, session_id="d0")), now)


def test_a_repeated_staging_req_is_answered_to_its_requester_only():
    for fixes, rsp_to, wm_to in (
            ((LOST_CONTROL_RECOVERY,), WRITERS, WRITERS),  # the recovery alone: everyone
            (BOTH, ("p2",), ("p2",)),
            ((ANSWER_REQUESTER_ONLY,), WRITERS, ())):  # alone: SGLang's answer, no re-send
        d = decode(fixes)
        first = req(d, "p0")
        # a first request keeps SGLang's answer: the allocation to every writer, and the
        # new subscriber's watermark snapshot to every writer
        assert [s.dst for s in sends(first, wire.StagingRsp)] == list(WRITERS)
        assert [s.dst for s in sends(first, wire.Watermark)] == list(WRITERS)
        again = req(d, "p2", now=0.05)
        rsps = sends(again, wire.StagingRsp)
        assert tuple(s.dst for s in rsps) == rsp_to, fixes
        assert {(s.msg.offset, s.msg.round) for s in rsps} == \
            {(m.msg.offset, m.msg.round) for m in sends(first, wire.StagingRsp)}
        assert tuple(s.dst for s in sends(again, wire.Watermark)) == wm_to, fixes


def test_a_requester_not_among_the_rooms_writers_gets_no_answer():
    """Only the ranks SGLang would answer can be answered: a stranger's repeat gets nothing."""
    d = decode(BOTH)
    req(d, "p0")
    again = req(d, "p9", now=0.05)
    assert not sends(again, wire.StagingRsp) and not sends(again, wire.Watermark)


# -- the writer's backoff ----------------------------------------------------------------------
def prefill(fixes):
    p = PrefillRank(CFG.replace(fixes=fixes), "p0", 0, 0)
    p.handle(ev.RoomBootstrapped(room=1, targets=(ev.Target(
        session="d0", decode_rank=0, total_pages=4, decode_prefix_len=0),)), 0.0)
    return p


def drive(p, out, until, rsp_at=None, rsp_round=0):
    """Feed the worker's polls (and a STAGING_RSP at ``rsp_at``) until ``until``; the times
    of the chunk's requests (the first: the prefetch at 0) and the polls."""
    asks, polls, now, poll_at = [], [], 0.0, -1.0
    while True:
        asks += [now for _ in sends(out, wire.StagingReq)]
        due = [e.retry_at for e in out if isinstance(e, ev.Deferred) and e.retry_at is not None]
        due += [e.at for e in out if isinstance(e, ev.WakeWorkers)]
        assert len(due) <= 1, out
        poll_at = due[0] if due else poll_at  # a poll already scheduled stays
        if rsp_at is not None and poll_at > rsp_at:
            now = rsp_at
            out = p.handle(ev.MessageArrived(src="d0", msg=wire.StagingRsp(
                room=1, chunk_idx=0, offset=0, round=rsp_round, end=4096, session_id="d0")),
                now)
            rsp_at = None
            continue
        now = poll_at
        if now > until:
            return asks, polls
        polls.append(now)
        out = p.handle(ev.WorkerPoll(worker=0), now)


def gaps(times):
    return [round(b - a, 6) for a, b in zip(times, times[1:], strict=False)]


def test_a_deferred_chunk_re_requests_every_control_retry_without_the_fix():
    p = prefill((LOST_CONTROL_RECOVERY,))
    asks, _ = drive(p, p.handle(ev.SendKV(room=1, end_idx=64, last=True), 0.0), 1.0)
    # a poll every 50 ms; each asks again (but where float rounding puts it a hair early)
    assert len(asks) > 15 and set(gaps(asks)) <= {0.05, 0.1}


def test_a_deferred_chunk_backs_off_doubling_up_to_a_tenth_of_the_waiting_timeout():
    p = prefill(BOTH)
    asks, polls = drive(p, p.handle(ev.SendKV(room=1, end_idx=64, last=True), 0.0), 3.0)
    # 50, 100, 200 ms, then capped at waiting_timeout_s / 10 = 400 ms
    assert gaps(asks) == [0.05, 0.1, 0.2, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4]
    assert polls == asks[1:]  # the worker's re-polls back off too: no poll that cannot ask


def test_the_backoff_starts_over_when_the_chunk_gets_its_allocation():
    """The STAGING_RSP arrives at 0.4 s (after re-requests at 0.05, 0.15 and 0.35 s), with a
    round the watermark has not reached: the chunk stays deferred, and re-requests for the
    watermark start over at control_retry_s."""
    p = prefill(BOTH)
    asks, _ = drive(p, p.handle(ev.SendKV(room=1, end_idx=64, last=True), 0.0), 1.5,
                    rsp_at=0.4, rsp_round=1)
    assert [round(t, 6) for t in asks[:4]] == [0.0, 0.05, 0.15, 0.35]
    # the allocation wakes the backed-off worker after its bounded wait (1 ms); 0.35 + 0.05
    # is past, so it asks at once, then 100, 200 ms later
    assert [round(t, 6) for t in asks[4:7]] == [0.401, 0.501, 0.701]


def test_the_backoff_starts_over_when_the_write_is_posted():
    """A chunk whose write was posted re-requests from control_retry_s again if a later
    deferral of the same chunk and session needs it (the gap is dropped, not kept)."""
    p = prefill(BOTH)
    drive(p, p.handle(ev.SendKV(room=1, end_idx=64, last=True), 0.0), 0.5)
    assert p._retry_gap[1][(0, "d0")] == 0.4
    out = p.handle(ev.MessageArrived(src="d0", msg=wire.StagingRsp(
        room=1, chunk_idx=0, offset=0, round=0, end=4096, session_id="d0")), 0.6)
    assert (0, "d0") not in p._retry_gap[1]
    out = p.handle(ev.WorkerPoll(worker=0), 0.601)
    assert [e for e in out if isinstance(e, ev.StartTransfer)]
