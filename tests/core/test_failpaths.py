"""Failure paths and sockets as SGLang 0.5.23 runs them by default.

Each test pins one place where the twin used to contradict SGLang: deferred decode KV release
(ABORT / ABORT_ACK, generations, poisoned rooms), a decode ABORT leaving a Success room alone,
STAGING_REQ on its own socket, decode ranks concluding together, a conclude on a failed room
still reporting Failed, and the bootstrap timeout failing only the prefill sender.
"""

from __future__ import annotations

from twin.core import events as ev
from twin.core import wire
from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.core.prefill import PrefillRank
from twin.core.states import PrefillRoomState
from twin.explore.loopback import Cluster

MODEL = ModelShape(num_layers=2, num_kv_heads=8, head_dim=4, dtype_bytes=2)
CFG = TwinConfig(prefill=ServerSide(tp_size=4), decode=ServerSide(tp_size=2), model=MODEL,
                 chunked_prefill_size=64, page_size=16, staging_pool_size_bytes=1 << 20)


def of(effects, kind):
    return [e for e in effects if isinstance(e, kind)]


def sent(effects, msg_kind):
    return [e for e in of(effects, ev.Send) if isinstance(e.msg, msg_kind)]


def prefill(cfg=CFG, pages=4):
    p = PrefillRank(cfg, "p0", 0, 0)
    p.handle(ev.RoomBootstrapped(room=1, targets=(ev.Target(
        session="d0", decode_rank=0, total_pages=pages, decode_prefix_len=0),)), 0.0)
    return p


def rsp(p, chunk, offset=0, now=0.0):
    return p.handle(ev.MessageArrived(src="d0", msg=wire.StagingRsp(
        room=1, chunk_idx=chunk, offset=offset, round=0, end=offset + 4096, session_id="d0")),
        now)


def abort(p, generation=5, now=0.0):
    return p.handle(ev.MessageArrived(src="d0", msg=wire.Abort(
        room=1, decode_ip="d0", decode_port=7, generation=generation)), now)


def one_chunk_in_flight(p):
    rsp(p, 0)
    out = p.handle(ev.SendKV(room=1, end_idx=64, last=True), 0.0)
    (xfer,) = of(out, ev.StartTransfer)
    return xfer


# -- deferred decode KV release: prefill acknowledges once drained ------------------------------
def test_prefill_acknowledges_a_decode_abort_only_after_its_writes_drained():
    p = prefill()
    xfer = one_chunk_in_flight(p)
    out = abort(p)
    assert of(out, ev.RoomConcluded)[0].status == "Failed"
    assert not sent(out, wire.AbortAck)  # the write is still in flight
    out = p.handle(ev.TransferDone(worker=xfer.worker), 0.001)
    (ack,) = sent(out, wire.AbortAck)
    assert ack.dst == "d0" and ack.msg == wire.AbortAck(room=1, prefill_rank=0, generation=5)


def test_abort_of_a_drained_or_unknown_room_is_acknowledged_at_once():
    p = prefill()
    out = abort(p)
    assert sent(out, wire.AbortAck)
    out = p.handle(ev.MessageArrived(src="d0", msg=wire.Abort(
        room=9, decode_ip="d0", decode_port=7, generation=2)), 0.0)
    assert [s.msg.room for s in sent(out, wire.AbortAck)] == [9]


def test_abort_without_generation_or_with_the_setting_off_is_not_acknowledged():
    p = prefill()
    one_chunk_in_flight(p)
    assert not sent(abort(p, generation=None), wire.AbortAck)
    q = prefill(CFG.replace(deferred_decode_kv_release=False))
    assert not sent(abort(q), wire.AbortAck)


def test_a_poisoned_room_never_acknowledges():
    """NIXL: a write that could not be proven to have stopped fails the room silently (decode
    finds out at its waiting timeout) and poisons its acknowledgement: decode releases only at
    the deadline."""
    p = prefill(CFG.replace(disaggregation_transfer_backend="nixl"))
    xfer = one_chunk_in_flight(p)
    out = p.handle(ev.TransferDone(worker=xfer.worker, ok=False, error="post rejected",
                                   settled=False), 0.001)
    assert of(out, ev.RoomConcluded)[0].status == "Failed"
    assert not sent(out, wire.TransferStatus)
    assert not sent(abort(p, now=0.002), wire.AbortAck)


def test_a_failed_mooncake_write_poisons_the_room_and_tells_decode():
    """Mooncake: batch_transfer_sync returned non-zero (on its timeout the batch may still be
    running): the room's drain ACK is poisoned and the room concludes Failed with KV_STATUS to
    decode (mooncake/conn.py ``_poison_unsettled_send``, then ``conclude_failure``)."""
    p = prefill(CFG.replace(disaggregation_transfer_backend="mooncake"))
    xfer = one_chunk_in_flight(p)
    out = p.handle(ev.TransferDone(worker=xfer.worker, ok=False, error="returned -1",
                                   settled=True), 0.001)
    assert of(out, ev.RoomConcluded)[0].status == "Failed"
    (st,) = sent(out, wire.TransferStatus)
    assert st.msg.status is wire.KVPoll.Failed and "Mooncake transfer failed" in \
        st.msg.failure_reason
    assert not sent(abort(p, now=0.002), wire.AbortAck)


# -- a decode ABORT leaves a Success room alone ---------------------------------------------------
def _success_with_deferred_chunk(p):
    """The last chunk finished (room at Success) while chunk 0 is still deferred."""
    rsp(p, 1, offset=4096)
    out = p.handle(ev.SendKV(room=1, end_idx=128, last=True), 0.0)
    assert [d.chunk_idx for d in of(out, ev.Deferred)] == [0]
    (xfer,) = of(p.handle(ev.WorkerPoll(worker=0), 0.001), ev.StartTransfer)
    out = p.handle(ev.TransferDone(worker=xfer.worker), 0.002)
    assert of(out, ev.RoomConcluded)[0].status == "Success"
    assert p.snapshot().rooms[1].state is PrefillRoomState.SUCCESS


def test_decode_abort_does_not_fail_a_success_room():
    p = prefill(pages=8)
    _success_with_deferred_chunk(p)
    out = abort(p, now=0.003)
    assert not of(out, ev.RoomConcluded) and not sent(out, wire.AbortAck)
    assert p.snapshot().rooms[1].state is PrefillRoomState.SUCCESS
    # the deferred chunk is still written and announced, then the ABORT is acknowledged
    rsp(p, 0, now=0.004)
    (xfer,) = of(p.handle(ev.WorkerPoll(worker=0), 0.005), ev.StartTransfer)
    assert xfer.chunk_idx == 0
    out = p.handle(ev.TransferDone(worker=xfer.worker), 0.006)
    assert [s.msg.chunk_idx for s in sent(out, wire.ChunkReady)] == [0]
    assert sent(out, wire.AbortAck) and of(out, ev.RoomTornDown)


def test_prefill_side_abort_fails_even_a_success_room():
    p = prefill(pages=8)
    _success_with_deferred_chunk(p)
    out = p.handle(ev.RoomAborted(room=1, reason="client abort"), 0.003)
    assert of(out, ev.RoomConcluded)[0].status == "Failed"


# -- conclude on an already-failed room still sends KV_STATUS Failed -----------------------------
def test_conclude_on_a_failed_room_reports_failed_again_with_the_first_reason():
    p = prefill()
    xfer = one_chunk_in_flight(p)
    p.handle(ev.RoomAborted(room=1, reason="client abort"), 0.001)
    out = p.handle(ev.TransferDone(worker=xfer.worker), 0.002)
    (st,) = sent(out, wire.TransferStatus)
    assert st.msg.status == wire.KVPoll.Failed and st.msg.failure_reason == "client abort"
    assert not of(out, ev.RoomConcluded)  # concluded once, when it failed


# -- STAGING_REQ on its own socket ----------------------------------------------------------------
def _tp2_tp1(ring_chunks: int = 2) -> Cluster:
    cfg = TwinConfig(prefill=ServerSide(tp_size=2), decode=ServerSide(tp_size=1), model=MODEL,
                     chunked_prefill_size=64, page_size=16,
                     staging_pool_size_bytes=ring_chunks * 64 * 8 * 8 * 2 * 2)
    return Cluster(cfg)


def _run(c: Cluster, blocked, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        ok = [i for i in c.choices() if not blocked(c.pending[i])]
        if not ok:
            if c.advance(timeouts=False) is None:
                return
            continue
        c.step(ok[0])
    raise AssertionError("no quiescence")


def test_sockets_are_separate_fifos():
    assert wire.socket_of(wire.StagingReq(room=1, chunk_idx=0, chunk_pages=1,
                                          session_id="d")) == wire.PREFETCH_SOCKET
    for msg in (wire.ChunkReady(room=1, chunk_idx=0, page_start=0, num_pages=1, writer_id="d",
                                prefill_rank=0),
                wire.TransferStatus(room=1, status=wire.KVPoll.Success, prefill_rank=0),
                wire.AbortAck(room=1, prefill_rank=0, generation=1),
                wire.StagingRsp(room=1, chunk_idx=0, offset=0, round=0, end=1, session_id="d"),
                wire.Watermark(round=0, tail=0, session_id="d"),
                wire.Abort(room=1, decode_ip="d", decode_port=1, generation=1)):
        assert wire.socket_of(msg) == wire.CONTROL_SOCKET


def test_upstream_staging_req_after_its_chunk_scattered_leaks_until_completion_timeout():
    """Prefill TP2 -> decode TP1: two writers per chunk. p1's STAGING_REQ rides its own socket
    and lands after the chunk was allocated for p0's request, written by both, scattered and
    freed; decode allocates the chunk again. That region is never written nor scattered, so the
    room cannot complete: it pins the ring until the completion timeout fails the room. With one
    FIFO per (source, destination), p1's CHUNK_READY could never overtake its STAGING_REQ."""
    c = _tp2_tp1()
    (d0,) = (n.id for n in c.topo.decode_groups[0].nodes)
    p1 = c.topo.prefill_groups[0].nodes[1].id
    c.add_request(0, 64)
    late = lambda a: a.kind == "msg" and a.src == p1 and isinstance(  # noqa: E731
        a.event.msg, (wire.StagingReq, wire.TransferStatus))
    _run(c, late)
    snap = c.ranks[d0].snapshot()
    assert not snap.live and snap.rooms[0].arrivals == {}  # chunk 0 scattered and freed
    _run(c, lambda a: a.kind == "msg" and a.src == p1 and isinstance(a.event.msg,
                                                                      wire.TransferStatus))
    assert len(c.ranks[d0].snapshot().live) == 1  # the late request's fresh allocation
    _run(c, lambda a: False)
    assert c.outcome(0) == "pending"  # every rank reported Success; the leak blocks completion
    c.run()
    assert c.outcome(0) == "Failed" and not c.ranks[d0].snapshot().live


def test_simulator_orders_frames_per_socket():
    """A CHUNK_READY queued behind a slow control socket does not hold back a STAGING_REQ from
    the same rank to the same peer (and vice versa)."""
    from twin.sim.engine import Simulation
    from twin.workloads import fixed

    sim = Simulation(CFG, fixed([(0.0, 64, 1, 0)]))
    arrived: list[tuple[float, str]] = []
    sim.feed = lambda node, e: arrived.append((sim.env.now, type(e.msg).__name__))  # type: ignore[method-assign]
    sim._link("p", "d").after(wire.CONTROL_SOCKET, 1.0)  # the control socket is busy until 1 s
    sim.transmit("p", "d", wire.ChunkReady(room=1, chunk_idx=0, page_start=0, num_pages=1,
                                           writer_id="d", prefill_rank=0))
    sim.transmit("p", "d", wire.StagingReq(room=1, chunk_idx=1, chunk_pages=1, session_id="d"))
    sim.run_pending()
    assert [k for _, k in arrived] == ["StagingReq", "ChunkReady"]
    assert arrived[0][0] < 0.01 and arrived[1][0] >= 1.0


# -- decode ranks conclude together --------------------------------------------------------------
def _fanout() -> tuple[Cluster, str, str]:
    """Prefill TP1 -> decode TP2: both decode ranks of a room form one group."""
    cfg = TwinConfig(prefill=ServerSide(tp_size=1), decode=ServerSide(tp_size=2), model=MODEL,
                     chunked_prefill_size=64, page_size=16, staging_pool_size_bytes=1 << 20)
    c = Cluster(cfg)
    d0, d1 = (n.id for n in c.topo.decode_groups[0].nodes)
    return c, d0, d1


def test_decode_ranks_conclude_success_together():
    c, d0, d1 = _fanout()
    c.add_request(0, 64)
    held = lambda a: a.kind == "scatter" and a.node == d1  # noqa: E731
    _run(c, held)
    assert c.ranks[d0].snapshot().rooms[0].state.value == "Done"  # every byte landed on d0
    assert c.rooms[0].decode_status == {}  # ... but the group has not agreed yet
    (i,) = [i for i in c.choices() if held(c.pending[i])]
    c.step(i)
    assert c.rooms[0].decode_status == {d0: "Success", d1: "Success"}  # in the same step


def test_one_ranks_failure_fails_the_room_on_every_rank_in_the_same_poll():
    c, d0, d1 = _fanout()
    c.add_request(0, 64)
    c._feed(d1, ev.RoomAborted(room=0, reason="decode abort on one rank"))
    assert c.rooms[0].decode_status == {d0: "Failed", d1: "Failed"}
    aborts = [(a.src, a.node) for a in c.pending
              if a.kind == "msg" and isinstance(a.event.msg, wire.Abort)]
    assert sorted(aborts) == [(d0, "p0g0r0"), (d1, "p0g0r0")]  # each rank notifies its writer
    c.run()
    for d in (d0, d1):
        assert not c.ranks[d].snapshot().rooms and not c.ranks[d].snapshot().live


def test_held_rooms_are_released_together():
    """Release is reduced too: a rank whose writers acknowledged waits for the other rank."""
    c, d0, d1 = _fanout()
    c.add_request(0, 64)
    c._feed(d1, ev.RoomAborted(room=0, reason="abort"))
    ack_to = lambda d: lambda a: (a.kind == "msg" and a.node == d  # noqa: E731
                                  and isinstance(a.event.msg, wire.AbortAck))
    _run(c, ack_to(d1))
    assert c.ranks[d0].snapshot().rooms[0].acks == {0}  # d0 may release ...
    assert 0 in c.ranks[d0].snapshot().rooms  # ... but waits for d1
    _run(c, lambda a: False)
    assert 0 not in c.ranks[d0].snapshot().rooms and 0 not in c.ranks[d1].snapshot().rooms


# -- the bootstrap timeout fails only the prefill sender -----------------------------------------
def test_bootstrap_timeout_fails_only_the_prefill_sender():
    """Prefill gives up on a room whose metadata has not arrived; decode is not told and fails
    the room only at its own waiting timeout."""
    from twin.runtime.params import SimParams
    from twin.sim.engine import Simulation
    from twin.workloads import fixed

    cfg = CFG.replace(bootstrap_timeout_s=1e-4, waiting_timeout_s=2.0)
    sim = Simulation(cfg, fixed([(0.0, 64, 1, 0)]), params=SimParams(wedge_window_s=10.0))
    assert sim.run() == "all requests ended"
    (req,) = sim.requests.values()
    assert req.status == "Failed" and "no transfer result" in req.reason
    assert req.kv_done_s >= 2.0  # decode's waiting timeout, not the bootstrap deadline


# -- finding: multi-target chunks deadlock on opposite allocation orders ------------------------
def _inverted_allocation_order(fixes: tuple[str, ...] = ()) -> Cluster:
    """Prefill DP attention (2 x TP1) -> decode TP2, one-chunk rings: both DP groups write
    each chunk to d0 and d1. Room 0 (group 0) learns d1 first; room 1 (group 1) learns d0
    first. d0 allocates room 0 before room 1, d1 the other way round."""
    cfg = TwinConfig(prefill=ServerSide(tp_size=2, dp_size=2, enable_dp_attention=True),
                     decode=ServerSide(tp_size=2), model=MODEL, chunked_prefill_size=64,
                     page_size=16, staging_pool_size_bytes=16 * 4 * 8 * 2 * 2, fixes=fixes)
    c = Cluster(cfg)
    d0, d1 = (n.id for n in c.topo.decode_groups[0].nodes)
    pa, pb = (g.nodes[0].id for g in c.topo.prefill_groups)

    def deliver(pred) -> None:
        (i,) = [i for i in c.choices() if pred(c.pending[i])][:1]
        c.step(i)

    def meta(d: str, p: str):
        return lambda a: a.kind == "meta" and a.src == d and a.node == p

    def req(p: str, d: str):
        return lambda a: (a.kind == "msg" and a.src == p and a.node == d
                          and isinstance(a.event.msg, wire.StagingReq))

    c.add_request(0, 16, prefill_group=0)
    c.add_request(1, 16, prefill_group=1)
    for d, p in ((d1, pa), (d0, pa), (d0, pb), (d1, pb)):
        deliver(meta(d, p))
    deliver(lambda a: a.kind == "send")
    deliver(lambda a: a.kind == "send")
    for p, d in ((pa, d0), (pb, d0), (pb, d1), (pa, d1)):
        deliver(req(p, d))
    _run(c, lambda a: False)
    return c


def test_upstream_multi_target_chunks_deadlock_on_opposite_allocation_orders():
    """Room 0's chunk waits on d1 (its first target) behind room 1's region, room 1's waits on
    d0 behind room 0's: SGLang's worker walks a chunk's targets in order and defers the whole
    chunk at the first one not ready, so neither writes the session that would free the other.
    Both rooms sit until decode's waiting timeout."""
    c = _inverted_allocation_order()
    assert c.outcome(0) == "pending" and c.outcome(1) == "pending"
    assert not c.integrity.violations
    c.run()
    assert c.outcome(0) == "Failed" and c.outcome(1) == "Failed"


def test_multi_target_retry_resume_fix_writes_ready_sessions_first():
    from twin.core.fixes import MULTI_TARGET_RETRY_RESUME

    c = _inverted_allocation_order((MULTI_TARGET_RETRY_RESUME,))
    assert c.outcome(0) == "Success" and c.outcome(1) == "Success"
    assert not c.integrity.violations



def test_a_legacy_abort_without_a_return_address_fails_the_room_and_is_never_acknowledged():
    """sglang 0.5.23 parses ``[ABORT, room]`` (``AbortNotification.from_zmq``): the room fails
    on prefill as for any decode ABORT, and with no return address no ABORT_ACK is sent."""
    p = prefill()
    xfer = one_chunk_in_flight(p)
    msg = wire.decode([b"ABORT", b"1"])
    assert msg == wire.Abort(room=1, decode_ip=wire.NO_RETURN_ADDRESS, decode_port=0)
    assert wire.encode(msg) == [b"ABORT", b"1"]
    out = p.handle(ev.MessageArrived(src="d0", msg=msg), 0.0)
    assert of(out, ev.RoomConcluded)[0].status == "Failed"
    out = p.handle(ev.TransferDone(worker=xfer.worker), 0.001)
    assert not sent(out, wire.AbortAck)


# -- PR #36707: ABORT_ACK while an errored transfer is unresolved ------------------------------
def _abort_then_unsettled_error_with_a_chunk_queued(fixes):
    """Room 1 has two chunks on one worker: chunk 0 in flight, chunk 1 queued. Decode aborts
    (a generation: ACK awaited), then chunk 0's WRITE errors without settling (a handle may
    still write into decode's pages); the worker then dequeues chunk 1 of the Failed room.
    Returns every ABORT_ACK sent. On NIXL's path: Mooncake poisons the room on any failed
    write, so the incident cannot happen there."""
    p = PrefillRank(CFG.replace(fixes=tuple(fixes), disaggregation_transfer_backend="nixl"),
                    "p0", 0, 0)
    p.handle(ev.RoomBootstrapped(room=1, targets=(ev.Target(
        session="d0", decode_rank=0, total_pages=8, decode_prefix_len=0),)), 0.0)
    rsp(p, 0)
    (xfer,) = of(p.handle(ev.SendKV(room=1, end_idx=128, last=True), 0.0), ev.StartTransfer)
    acks = sent(abort(p), wire.AbortAck)
    out = p.handle(ev.TransferDone(worker=xfer.worker, ok=False, error="handle still running",
                                   settled=False), 0.001)
    assert [s.page_start for s in of(out, ev.ChunkSkipped)] == [4]  # chunk 1, skipped
    return acks + sent(out, wire.AbortAck)


def test_pr36707_incident_abort_ack_while_an_errored_transfer_is_unresolved():
    """Keeping an unsettled transfer counted instead of poisoning the room (upstream after
    0.5.23) opens the incident: the Failed-room skip path pops the room's whole count, and
    ABORT_ACK goes out although the errored WRITE may still land in decode's pages."""
    (ack,) = _abort_then_unsettled_error_with_a_chunk_queued(["count-errored-transfers"])
    assert ack.msg == wire.AbortAck(room=1, prefill_rank=0, generation=5)


def test_pr36707_keeping_the_count_makes_abort_ack_wait():
    assert _abort_then_unsettled_error_with_a_chunk_queued(
        ["count-errored-transfers", "keep-errored-outstanding"]) == []


def test_pr36707_incident_is_absent_in_0_5_23_which_poisons_the_room():
    assert _abort_then_unsettled_error_with_a_chunk_queued([]) == []
    assert _abort_then_unsettled_error_with_a_chunk_queued(["keep-errored-outstanding"]) == []


def _lost_chunk0_request(cfg: TwinConfig, tokens: int):
    """Prefill TP1 -> decode TP2, one request of two chunks: the third STAGING_REQ the prefill
    rank sends (chunk 0 to the second decode rank) is lost."""
    from twin.runtime.faults import parse_fault
    from twin.sim.runner import run_sim
    from twin.workloads import fixed

    return run_sim(cfg.replace(prefill=ServerSide(tp_size=1)), fixed([(0.0, tokens, 1, 0)]),
                   faults=[parse_fault("drop:STAGING_REQ:nth=3")], seed=0)


def test_upstream_lost_staging_req_completes_the_room_with_pages_missing():
    """Chunk 0 finds no allocation on d0g0r1 and is re-enqueued; the last chunk is allocated,
    written and concludes Success (prefill's Success does not wait for re-enqueued chunks,
    nx ~1901-1902), and decode's completion gate counts only the allocations it made (sh
    ~391-393), so d0g0r1 completes the room with chunk 0's pages never written: silent
    corruption, not a wedge."""
    result = _lost_chunk0_request(CFG, 80)
    assert result.status.value == "corrupted"
    assert [v.kind for v in result.sim.integrity.violations] == ["incomplete"]
    assert "4 of 5 pages not landed" in result.corruption[0]


def test_lost_staging_req_corrupts_with_every_other_proposed_fix_when_the_last_chunk_is_quick():
    """The default deployment's model with a 256-token grid (17 pages): the last chunk
    concludes before lost-control recovery's re-request (50 ms) reaches decode, which has by
    then completed and unregistered the room; no other proposed fix closes the gap."""
    from twin.core.fixes import CATALOG, SUCCESS_AFTER_OUTSTANDING
    from twin.sim.scenarios import SCENARIOS

    others = tuple(f for f in CATALOG if f != SUCCESS_AFTER_OUTSTANDING)
    cfg = SCENARIOS["default"].config.replace(fixes=others, chunked_prefill_size=256)
    result = _lost_chunk0_request(cfg, 272)
    assert result.status.value == "corrupted"
    assert "16 of 17 pages not landed" in result.corruption[0]


def test_success_after_outstanding_turns_the_corruption_into_a_lost_frame_wedge():
    """With the room concluded only once no chunk is outstanding, the lost request leaves the
    room waiting (no page missing); lost-control recovery then sends it again and the room
    completes with every page."""
    from twin.core.fixes import LOST_CONTROL_RECOVERY, SUCCESS_AFTER_OUTSTANDING
    from twin.sim.scenarios import SCENARIOS

    cfg = SCENARIOS["default"].config.replace(chunked_prefill_size=256)
    alone = _lost_chunk0_request(cfg.replace(fixes=(SUCCESS_AFTER_OUTSTANDING,)), 272)
    assert alone.status.value == "wedged" and not alone.sim.integrity.violations
    assert any("STAGING_RSPs never reached prefill" in line for line in alone.diagnosis)
    both = _lost_chunk0_request(
        cfg.replace(fixes=(SUCCESS_AFTER_OUTSTANDING, LOST_CONTROL_RECOVERY)), 272)
    assert both.status.value == "completed" and not both.sim.integrity.violations


def test_lost_staging_req_of_the_last_chunk_only_wedges():
    """The same loss on the last chunk's request: decode holds chunk 0's allocation until the
    last chunk is scattered, so nothing completes early (a wedge, the lost-frame kind)."""
    from twin.runtime.faults import parse_fault
    from twin.sim.runner import run_sim
    from twin.workloads import fixed

    cfg = CFG.replace(prefill=ServerSide(tp_size=1))
    result = run_sim(cfg, fixed([(0.0, 80, 1, 0)]),
                     faults=[parse_fault("drop:STAGING_REQ:nth=2")], seed=0)
    assert result.status.value == "wedged" and not result.sim.integrity.violations
