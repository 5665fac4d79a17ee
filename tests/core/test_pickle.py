"""Events and frames cross into processes the project starts itself pickled (a rank's start-up
spec, with its replay script, through ``multiprocessing``; never anything read from a socket,
which travels as typed msgpack, ``twin.hw.messages``): every kind round-trips to an equal object, in the pure-Python path and, run by
``tests/test_compiled.py``, beside the compiled core."""

from __future__ import annotations

import pickle

import pytest

from twin.core import events as ev
from twin.core import wire

MSG = wire.StagingReq(room=3, chunk_idx=1, chunk_pages=4, session_id="d0g0r0")
SAMPLES = [
    ev.MessageArrived(src="p0g0r0", msg=MSG),
    ev.MessageArrived(src="p0g0r0", msg=wire.StagingRsp(
        room=3, chunk_idx=1, offset=4096, round=2, end=8192, session_id="d0g0r0")),
    ev.Send(dst="d0g0r0", msg=MSG),
    ev.RoomBootstrapped(room=3, targets=(ev.Target(session="d0g0r0", decode_rank=0,
                                                   total_pages=8, decode_prefix_len=0),)),
    ev.StartTransfer(worker=0, room=3, chunk_idx=1, session="d0g0r0", page_start=4,
                                 num_pages=4, region_offset=0, region_end=4096,
                                 dst_offset=4096, nbytes=4096, writer=0, round=2),
    ev.SendMetadata(room=3, prefill_ranks=("p0g0r0",), session="d0g0r0", decode_rank=0,
                    decode_prefix_len=0, total_pages=8, register_at=0.5),
    ev.Tick(),
    wire.TransferStatus(room=3, status=wire.KVPoll.Success, prefill_rank=1),
    wire.Abort(room=3, decode_ip="127.0.0.1", decode_port=5000, generation=None),
]


@pytest.mark.parametrize("obj", SAMPLES, ids=lambda o: type(o).__name__)
def test_events_and_frames_round_trip_through_pickle(obj: object) -> None:
    back = pickle.loads(pickle.dumps(obj))
    assert type(back) is type(obj)
    assert back == obj and hash(back) == hash(obj)
