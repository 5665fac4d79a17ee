"""The room lifecycles: every state paired with every trigger, against the one table."""

from __future__ import annotations

import itertools

import pytest

from twin.core import events as ev
from twin.core import wire
from twin.core.config import TwinConfig
from twin.core.decode import DecodeRank
from twin.core.prefill import PrefillRank
from twin.core.states import (
    DECODE_CONCLUDED,
    DECODE_TRANSITIONS,
    PREFILL_CONCLUDED,
    PREFILL_TRANSITIONS,
    DecodeRoomState,
    DecodeTrigger,
    PrefillRoomState,
    PrefillTrigger,
    ProtocolError,
    decode_next,
    prefill_next,
)


@pytest.mark.parametrize("state,trigger", list(itertools.product(PrefillRoomState, PrefillTrigger)))
def test_prefill_every_state_and_trigger(state: PrefillRoomState, trigger: PrefillTrigger) -> None:
    if (state, trigger) in PREFILL_TRANSITIONS:
        nxt = prefill_next(state, trigger)
        assert nxt is PREFILL_TRANSITIONS[(state, trigger)]
        assert state is not PrefillRoomState.FAILED or nxt is PrefillRoomState.FAILED
        if trigger is PrefillTrigger.FAIL:
            assert nxt is PrefillRoomState.FAILED
    else:
        with pytest.raises(ProtocolError, match=state.value):
            prefill_next(state, trigger)


@pytest.mark.parametrize("state,trigger", list(itertools.product(DecodeRoomState, DecodeTrigger)))
def test_decode_every_state_and_trigger(state: DecodeRoomState, trigger: DecodeTrigger) -> None:
    if (state, trigger) in DECODE_TRANSITIONS:
        nxt = decode_next(state, trigger)
        assert nxt is DECODE_TRANSITIONS[(state, trigger)]
        if trigger is DecodeTrigger.FAIL:
            assert nxt is DecodeRoomState.FAILED
    else:
        with pytest.raises(ProtocolError, match=state.value):
            decode_next(state, trigger)


def test_concluded_states_are_terminal() -> None:
    """Nothing leaves Success or Failed except a failure (prefill: a later send failure)."""
    for (state, trigger), nxt in PREFILL_TRANSITIONS.items():
        if state is PrefillRoomState.FAILED:
            assert nxt is PrefillRoomState.FAILED
        if state is PrefillRoomState.SUCCESS:
            assert nxt in PREFILL_CONCLUDED, (state, trigger, nxt)
    assert not any(s in DECODE_CONCLUDED and n is not DecodeRoomState.FAILED
                   for (s, _), n in DECODE_TRANSITIONS.items())
    # every state is reachable from the initial one
    for table, start in ((PREFILL_TRANSITIONS, PrefillRoomState.BOOTSTRAPPING),
                         (DECODE_TRANSITIONS, DecodeRoomState.WAITING)):
        reach, frontier = {start}, [start]
        while frontier:
            s = frontier.pop()
            for (a, _), b in table.items():
                if a is s and b not in reach:
                    reach.add(b)
                    frontier.append(b)
        assert reach == set(type(start)), reach


CFG = TwinConfig.from_dict({"prefill": {"tp_size": 1}, "decode": {"tp_size": 1},
                            "chunked_prefill_size": 64, "page_size": 16,
                            "staging_pool_size_mb": 64,
                            "stage_equal_tp": True})  # the exchange below is the staged one


def test_rooms_move_through_the_table_in_a_real_exchange() -> None:
    """Drive one prefill and one decode rank by hand and read each room's state."""
    p = PrefillRank(CFG, "p", 0, 0)
    d = DecodeRank(CFG, "d", 0)
    d.handle(ev.DecodeRoomInit(room=1, prefill_ranks=("p",), prefill_attn_tp=1,
                               decode_prefix_len=0, total_pages=4), 0.0)
    assert d.snapshot().rooms[1].state is DecodeRoomState.WAITING
    out = p.handle(ev.RoomBootstrapped(room=1, targets=(ev.Target(
        session="d", decode_rank=0, total_pages=4, decode_prefix_len=0),)), 0.0)
    assert out == [ev.TargetsKnown(room=1, sessions=("d",))]
    assert p.snapshot().rooms[1].state is PrefillRoomState.BOOTSTRAPPING
    sends = [e for e in p.handle(ev.SendKV(room=1, end_idx=64, last=True), 0.0)
             if isinstance(e, ev.Send)]
    for s in sends:
        for e in d.handle(ev.MessageArrived(src="p", msg=s.msg), 0.0):
            if isinstance(e, ev.Send):
                p.handle(ev.MessageArrived(src="d", msg=e.msg), 0.0)
    out = p.handle(ev.WorkerPoll(worker=0), 0.001)
    (xfer,) = [e for e in out if isinstance(e, ev.StartTransfer)]
    assert xfer.decode_rank == 0
    assert p.snapshot().rooms[1].state is PrefillRoomState.TRANSFERRING
    out = p.handle(ev.TransferDone(worker=xfer.worker), 0.002)
    assert [e.status for e in out if isinstance(e, ev.RoomConcluded)] == ["Success"]
    msgs = [e.msg for e in out if isinstance(e, ev.Send)]
    assert [type(m) for m in msgs] == [wire.ChunkReady, wire.TransferStatus]
    (sc,) = [e for e in d.handle(ev.MessageArrived(src="p", msg=msgs[0]), 0.003)
             if isinstance(e, ev.StartScatter)]
    assert sc.writer_bytes and sum(sc.writer_bytes) == sc.nbytes and sc.prefill_attn_tp == 1
    d.handle(ev.MessageArrived(src="p", msg=msgs[1]), 0.003)
    assert d.snapshot().rooms[1].state is DecodeRoomState.ALL_SUCCESS
    out = d.handle(ev.ScatterDone(room=1, chunk_idx=sc.chunk_idx, alloc_id=sc.alloc_id), 0.004)
    assert [e.status for e in out if isinstance(e, ev.RoomConcluded)] == ["Success"]
    assert 1 not in d.snapshot().rooms
