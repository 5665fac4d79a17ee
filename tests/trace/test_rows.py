"""The generated reducers (``twin/trace/reducers.py``): current with the classes, and rows that
build back to the objects they came from."""

from __future__ import annotations

import marshal

import pytest
from hypothesis import HealthCheck, given, settings
from test_format import ANY_EVENT

from twin.core import events as ev
from twin.core import factories, wire
from twin.trace import reducers
from twin.trace.reducegen import REDUCERS_PATH, reducers_source
from twin.trace.reducers import reduce_message
from twin.trace.rowdecgen import ROWDECODERS_PATH, rowdecoders_source
from twin.trace.rows import BUILD, CID, REDUCE

SAMPLES = [
    ev.MessageArrived(src="p0g0r0", msg=wire.StagingReq(room=3, chunk_idx=1, chunk_pages=4,
                                                        session_id="d0g0r0", pp_rank=0)),
    factories.new_send(dst="p0g0r0", msg=factories.new_staging_rsp(
        room=3, chunk_idx=1, offset=4096, round=2, end=8192, session_id="d0g0r0")),
    ev.RoomBootstrapped(room=3, targets=(ev.Target(session="d0g0r0", decode_rank=0,
                                                   total_pages=8, decode_prefix_len=16),)),
    ev.SendMetadata(room=3, prefill_ranks=("p0g0r0", "p0g0r1"), session="d0g0r0",
                    decode_rank=0, decode_prefix_len=0, total_pages=8, register_at=0.25),
    ev.SetTimer(at=300.000001),
    ev.MessageArrived(src="p0g0r0", msg=wire.TransferStatus(
        room=3, status=wire.KVPoll.Failed, prefill_rank=1, failure_reason="aborted")),
    ev.Tick(),
]


def test_the_generated_reducers_are_current() -> None:
    assert REDUCERS_PATH.read_text() == reducers_source(), (
        "run python scripts/generate_factories.py")


def test_the_generated_row_decoders_are_current() -> None:
    assert ROWDECODERS_PATH.read_text() == rowdecoders_source(), (
        "run python scripts/generate_factories.py")


@pytest.mark.parametrize("obj", SAMPLES, ids=lambda o: type(o).__name__)
def test_a_row_builds_back_to_its_object(obj: object) -> None:
    row = REDUCE[type(obj)](obj)
    assert row[0] == CID[type(obj)]
    assert BUILD[row[0]](row) == obj


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ANY_EVENT)
def test_the_generated_builders_build_any_row_back(event: object) -> None:
    """``reducers.BUILDERS``, ``BUILD`` where the core is compiled, also in the interpreter."""
    row = marshal.loads(marshal.dumps(REDUCE[type(event)](event)))
    built = reducers.BUILDERS[row[0]](row)
    assert type(built) is type(event) and built == event
    assert BUILD[row[0]](row) == event


def test_a_float_that_is_not_finite_is_refused() -> None:
    with pytest.raises(ValueError, match="finite"):
        REDUCE[ev.SetTimer](ev.SetTimer(at=float("inf")))


def test_only_control_messages_reduce_as_messages() -> None:
    with pytest.raises(TypeError, match="not a control message: Tick"):
        reduce_message(ev.Tick())
