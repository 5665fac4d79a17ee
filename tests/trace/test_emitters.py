"""The generated trace text of rows (``twin/trace/emitters.py``) and the encoder that writes it
(``twin.trace.rowenc``): current with the classes, the codec's text for every event, its room,
and the live state the index keeps. Run against the compiled build too
(``tests/test_compiled.py``)."""

from __future__ import annotations

import marshal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from test_format import ANY_EVENT

from twin.core import events as ev
from twin.core import factories, wire
from twin.trace import emitters
from twin.trace.codec import BODY_TEXT, LINE_TEXT, ROOM_OF
from twin.trace.emitgen import EMITTERS_PATH, emitters_source
from twin.trace.rowenc import LiveState
from twin.trace.rows import CID, REDUCE

HEAD = '"t":0.25,"node":"p0g0r0","dir":"out",'
SAMPLES = [
    ev.MessageArrived(src="p0g0r0", msg=wire.StagingReq(room=3, chunk_idx=1, chunk_pages=4,
                                                        session_id="d0g0r0", pp_rank=0)),
    ev.MessageArrived(src="d0g0r0", msg=wire.Watermark(round=2, tail=4096,
                                                       session_id="d\u00e9\"0")),
    factories.new_send(dst="p0g0r0", msg=factories.new_staging_rsp(
        room=3, chunk_idx=1, offset=4096, round=2, end=8192, session_id="d0g0r0")),
    ev.RoomBootstrapped(room=3, targets=(ev.Target(session="d0g0r0", decode_rank=0,
                                                   total_pages=8, decode_prefix_len=16),)),
    ev.SendMetadata(room=3, prefill_ranks=("p0g0r0", "p0g0r1"), session="d0g0r0",
                    decode_rank=0, decode_prefix_len=0, total_pages=8, register_at=0.25),
    ev.SendMetadata(room=4, prefill_ranks=(), session="d0g0r0", decode_rank=1,
                    decode_prefix_len=0, total_pages=8, register_at=None),
    ev.SetTimer(at=300.000001),
    ev.SetTimer(at=1e-7),
    ev.WakeWorkers(workers=(0, 3), at=2.5),
    ev.MessageArrived(src="p0g0r0", msg=wire.TransferStatus(
        room=3, status=wire.KVPoll.Failed, prefill_rank=1, failure_reason="aborted")),
    ev.MessageArrived(src="p0g0r0", msg=wire.Abort(room=3, decode_ip="10.0.0.1",
                                                   decode_port=7, generation=None)),
    ev.Tick(),
]


def test_the_generated_emitters_are_current() -> None:
    assert EMITTERS_PATH.read_text() == emitters_source(), (
        "run python scripts/generate_factories.py")


def _check(event: Any) -> None:
    row = marshal.loads(marshal.dumps(REDUCE[type(event)](event)))  # what crosses the pipe
    assert emitters.event_line(row, 17, HEAD) == LINE_TEXT[type(event)](event, 17, HEAD)
    room = ROOM_OF[type(event)]
    assert emitters.event_room(row) == (None if room is None else room(event))
    assert emitters.event_body(event) == BODY_TEXT[type(event)](event)


@pytest.mark.parametrize("event", SAMPLES, ids=lambda o: type(o).__name__)
def test_a_rows_line_is_its_events_line(event: Any) -> None:
    _check(event)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ANY_EVENT)
def test_any_rows_line_is_its_events_line(event: Any) -> None:
    _check(event)


def test_a_float_that_is_not_finite_is_refused() -> None:
    row = (CID[ev.SetTimer], float("nan"))
    with pytest.raises(ValueError, match="finite"):
        emitters.event_line(row, 0, HEAD)
    assert emitters.float_text(3) == "3"
    assert emitters.float_text(0.1) == "0.1"


def test_only_core_events_have_a_body() -> None:
    with pytest.raises(TypeError, match="not a core event: StagingReq"):
        emitters.event_body(wire.StagingReq(room=1, chunk_idx=0, chunk_pages=1,
                                            session_id="s"))


def test_a_row_of_no_event_is_refused() -> None:
    with pytest.raises(KeyError):
        emitters.event_line((CID[wire.Watermark], 1, 2, "s"), 0, HEAD)
    with pytest.raises(KeyError):
        emitters.msg_text((CID[ev.Tick],))


def test_the_live_state_follows_what_is_open() -> None:
    live = LiveState()

    def note(event: Any, node: str = "p0g0r0", seq: int = 0) -> None:
        row = REDUCE[type(event)](event)
        live.on_row(row[0], node, row, seq, f"line {seq}\n")

    note(ev.StartTransfer(worker=1, room=3, chunk_idx=0, session="d0g0r0", page_start=0,
                          num_pages=4, region_offset=0, region_end=4, dst_offset=0,
                          nbytes=64, writer=0, round=0, staged=True, is_last=False,
                          decode_rank=0), seq=1)
    note(ev.Allocated(room=3, chunk_idx=0, alloc_id=9, offset=0, round=0, size=64),
         node="d0g0r0", seq=2)
    note(factories.new_send(dst="d0g0r0", msg=wire.StagingReq(
        room=3, chunk_idx=0, chunk_pages=4, session_id="d0g0r0", pp_rank=0)), seq=3)
    note(ev.MessageArrived(src="d0g0r0", msg=wire.Watermark(round=1, tail=5,
                                                            session_id="d0g0r0")), seq=4)
    note(ev.MessageArrived(src="d0g0r0", msg=wire.Watermark(round=0, tail=9,
                                                            session_id="d0g0r0")), seq=5)
    live.on_sys("ForwardStart", "p0g0r0", 3, 6, "line 6\n")
    assert sorted(live.lines.values()) == [(1, "line 1\n"), (3, "line 3\n"), (4, "line 4\n"),
                                           (6, "line 6\n")]
    assert live.snapshot_text() == (
        '{"alloc":{"d0g0r0":[[9,64]]},"lines":[line 1,line 3,line 4,line 6]}')
    note(ev.TransferDone(worker=1, ok=True, error="", settled=True), seq=7)
    note(ev.Freed(alloc_id=9, room=3, chunk_idx=0, reason="done"), node="d0g0r0", seq=8)
    live.on_sys("ForwardEnd", "p0g0r0", 3, 9, "line 9\n")
    assert live.snapshot_text() == '{"alloc":{},"lines":[line 3,line 4]}'
