"""Sends to a dead peer: high-water mark, send timeout, the thread they block (sglang #36049).

Prefill TP2 DP2 with DP attention (two prefill groups of one rank) feeds decode TP2. Prefill
group 1's rank dies; every decode free still broadcasts WATERMARK to it from the decode
scheduler thread. Once decode's socket to it holds its high-water mark, each send blocks the
scheduler for the send timeout, so requests of the healthy group 0 wait too.
"""

from __future__ import annotations

import math

from twin.core import events as ev
from twin.core import wire
from twin.core.config import ServerSide, TwinConfig
from twin.core.fixes import STALE_WATERMARK_SUBSCRIBERS
from twin.runtime.faults import parse_fault
from twin.runtime.params import SimParams
from twin.sim.runner import SimResult, run_sim
from twin.sim.sockets import (
    LISTENER,
    SCHEDULER,
    TRANSFER_WORKER,
    WATERMARK_SENDER,
    SendBlocking,
    thread_of,
)
from twin.workloads import poisson

CRASH_AT = 1.0


def _cfg(*fixes: str) -> TwinConfig:
    return TwinConfig(prefill=ServerSide(tp_size=2, dp_size=2, enable_dp_attention=True),
                      decode=ServerSide(tp_size=2), fixes=fixes)


def _run(*fixes: str, hwm: int = 20) -> SimResult:
    wl = poisson(240, 40.0, 1024, 32, seed=3)
    # After the crash the router sends nothing to the dead group: only WATERMARK broadcasts
    # (to the subscriber it left behind) go to the dead rank.
    overrides = {r.rid: {"prefill_group": 0} for r in wl.requests if r.arrival_s > CRASH_AT - 0.5}
    return run_sim(_cfg(*fixes), wl, faults=[parse_fault(f"crash:p0g1r0:at={CRASH_AT}")],
                   params=SimParams(zmq_sndhwm=hwm), request_overrides=overrides)


def _late_ttft(r: SimResult) -> list[float]:
    return sorted(q.ttft_s for q in r.sim.metrics.done
                  if q.status == "Success" and q.arrival_s > CRASH_AT + 1.0)


def test_watermarks_to_a_dead_prefill_block_the_decode_scheduler_until_the_fix() -> None:
    stalled = _run()
    blocked = stalled.summary()["send_blocked_s"]
    # both decode ranks' schedulers sat in WATERMARK sends, a second (the send timeout) each
    assert set(blocked) == {"d0g0r0", "d0g0r1"}
    assert all(v >= 1.0 for v in blocked.values())
    assert stalled.sim.sockets.blocked_until("d0g0r0", SCHEDULER) > CRASH_AT
    assert set(stalled.summary()["send_blocked_by_thread"]) == {SCHEDULER}
    assert set(stalled.summary()["send_blocked_by_frame"]) == {"WATERMARK"}
    fixed = _run(STALE_WATERMARK_SUBSCRIBERS)
    assert fixed.sim.sockets.blocked_until("d0g0r0", SCHEDULER) == 0.0
    # the sender to the dead subscriber blocks; the one to the live prefill never waits
    assert fixed.sim.sockets.blocked_until("d0g0r0", f"{WATERMARK_SENDER}:p0g1r0") > CRASH_AT
    assert fixed.sim.sockets.blocked_until("d0g0r0", f"{WATERMARK_SENDER}:p0g0r0") == 0.0
    assert SCHEDULER not in fixed.summary()["send_blocked_by_thread"]
    late_stalled, late_fixed = _late_ttft(stalled), _late_ttft(fixed)
    assert late_stalled and late_fixed
    # healthy-group requests after the crash: TTFT climbs by whole send timeouts without the
    # fix, and stays at its usual tens of milliseconds with it
    assert late_stalled[len(late_stalled) // 2] > 0.5
    assert late_fixed[-1] < 0.2
    assert stalled.status == fixed.status == "completed"


def test_below_the_high_water_mark_nothing_blocks() -> None:
    r = _run(hwm=100_000)
    assert r.summary()["send_blocked_s"] == {}
    assert _late_ttft(r)[-1] < 0.2


def test_send_blocking_queues_then_blocks_for_the_timeout() -> None:
    s = SendBlocking(send_timeout_s=1.0, sndhwm=2, fix=False, heartbeat_s=10.0)
    wm = wire.Watermark(round=0, tail=0, session_id="s")
    # two frames queue on the socket to the dead peer, the third blocks the scheduler 1 s
    assert s.send(5.0, "d0g0r0", "decode", "p0g1r0", True, wm, None) < 0
    assert s.send(5.0, "d0g0r0", "decode", "p0g1r0", True, wm, None) < 0
    assert s.blocked_until("d0g0r0") == 0.0
    assert s.send(5.0, "d0g0r0", "decode", "p0g1r0", True, wm, None) < 0
    assert s.blocked_until("d0g0r0") == 6.0
    # a frame to a live peer from the same thread leaves when the thread is back
    assert s.send(5.5, "d0g0r0", "decode", "p0g0r0", False, wm, None) == 6.0
    assert s.totals(5.5) == {"d0g0r0": 0.5}
    assert s.totals(10.0) == {"d0g0r0": 1.0}


def test_prefetch_socket_has_no_send_timeout() -> None:
    s = SendBlocking(send_timeout_s=1.0, sndhwm=1, fix=False, heartbeat_s=10.0)
    req = wire.StagingReq(room=1, chunk_idx=0, chunk_pages=4, session_id="s")
    s.send(1.0, "p0g0r0", "prefill", "d0g0r0", True, req, None)
    s.send(1.0, "p0g0r0", "prefill", "d0g0r0", True, req, None)
    assert math.isinf(s.blocked_until("p0g0r0", SCHEDULER))
    assert s.totals(4.0) == {"p0g0r0": 3.0}


def test_threads_follow_sglang() -> None:
    wm = wire.Watermark(round=0, tail=0, session_id="s")
    req = wire.StagingReq(room=1, chunk_idx=0, chunk_pages=4, session_id="s")
    snapshot_cause = ev.MessageArrived(src="p0g0r0", msg=req)
    assert thread_of("decode", wm, None, False) == SCHEDULER
    assert thread_of("decode", wm, None, True) == WATERMARK_SENDER
    assert thread_of("decode", wm, snapshot_cause, False) == LISTENER
    rsp = wire.StagingRsp(room=1, chunk_idx=0, offset=0, round=0, end=1, session_id="s")
    assert thread_of("decode", rsp, snapshot_cause, False) == LISTENER
    assert thread_of("decode", None, None, False) == SCHEDULER  # metadata
    assert thread_of("prefill", req, None, False) == SCHEDULER
    ready = wire.ChunkReady(room=1, chunk_idx=0, page_start=0, num_pages=4, writer_id="w",
                            prefill_rank=0)
    assert thread_of("prefill", ready, None, False) == TRANSFER_WORKER


def test_heartbeat_prunes_a_dead_servers_subscriber_only_with_the_fix() -> None:
    wm = wire.Watermark(round=0, tail=0, session_id="s")
    for fix, blocks in ((False, True), (True, False)):
        s = SendBlocking(send_timeout_s=1.0, sndhwm=1, fix=fix, heartbeat_s=10.0)
        s.send(0.0, "d0g0r0", "decode", "p0g0r0", True, wm, None, server_dead=True)
        # past the heartbeat's detection: the socket was re-created; with the fix the
        # subscriber is gone and nothing is sent at all
        for _ in range(3):
            s.send(20.0, "d0g0r0", "decode", "p0g0r0", True, wm, None, server_dead=True)
        thread = f"{WATERMARK_SENDER}:p0g0r0" if fix else SCHEDULER
        assert (s.blocked_until("d0g0r0", thread) > 20.0) is blocks
