"""Chrome/Perfetto export: structure, and content on a hand-built run with known times."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from twin.core import events as ev
from twin.core import wire
from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.trace.format import Trace, TraceWriter, make_header, read_trace
from twin.trace.perfetto import to_chrome_trace, write_perfetto

P, D = "p0g0r0", "d0g0r0"
RING = 10_000
NODES = [{"id": P, "role": "prefill", "instance": 0, "dp": 0, "rank": 0},
         {"id": D, "role": "decode", "instance": 0, "dp": 0, "rank": 0}]


def config() -> TwinConfig:
    return TwinConfig(model=ModelShape(num_layers=2, num_kv_heads=2, head_dim=4, dtype_bytes=2),
                      prefill=ServerSide(tp_size=1), decode=ServerSide(tp_size=1),
                      stage_equal_tp=True,  # these runs exercise the staging path
                      chunked_prefill_size=64, page_size=16, staging_pool_size_bytes=RING,
                      transfer_queue_size=2)


def known_run(path: Path, *, finish: bool = True) -> Trace:
    """Room 7, one chunk of 4 pages: defer, transfer on worker 1, scatter, conclude.

    transfer 4.0-4.5 ms on p0g0r0 worker 1; deferral 3.0-3.5 ms; forward 2.0-3.0 ms;
    CHUNK_READY sent at 4.5 ms, scatter 4.6-5.0 ms on d0g0r0; ring 4096 bytes 2.0-5.0 ms;
    watermark lag RING bytes from 5.0 ms until the WATERMARK arrives at 5.2 ms.
    """
    rsp = wire.StagingRsp(room=7, chunk_idx=0, offset=0, round=0, end=4096, session_id=D)
    ready = wire.ChunkReady(room=7, chunk_idx=0, page_start=0, num_pages=4, writer_id=D,
                            prefill_rank=0)
    status = wire.TransferStatus(room=7, status=wire.KVPoll.Success, prefill_rank=0)
    with TraceWriter(path, make_header("sim", config(), NODES, seed=0)) as w:
        w.write_sys(0.0, "driver", {
            "type": "RequestArrived", "room": 7, "rid": "r7", "input_len": 64, "output_len": 1,
            "decode_prefix_len": 0, "prefill_prefix_len": 0, "prefill_node": [P],
            "decode_node": [D]})
        w.write_input(0.001, D, ev.DecodeRoomInit(room=7, prefill_ranks=(P,), prefill_attn_tp=1,
                                                  decode_prefix_len=0, total_pages=4))
        w.write_effects(0.001, D, [ev.SendMetadata(room=7, prefill_ranks=(P,), session=D,
                                                   decode_rank=0, decode_prefix_len=0,
                                                   total_pages=4)])
        w.write_input(0.0015, P, ev.Prefetch(room=7))
        w.write_effects(0.0015, P, [ev.Send(dst=D, msg=wire.StagingReq(
            room=7, chunk_idx=0, chunk_pages=4, session_id=D))])
        w.write_input(0.002, D, ev.MessageArrived(src=P, msg=wire.StagingReq(
            room=7, chunk_idx=0, chunk_pages=4, session_id=D)))
        w.write_effects(0.002, D, [
            ev.Allocated(room=7, chunk_idx=0, alloc_id=3, offset=0, round=0, size=4096),
            ev.Send(dst=P, msg=rsp)])
        w.write_sys(0.002, P, {"type": "ForwardStart", "room": 7, "tokens": 64})
        w.write_sys(0.003, P, {"type": "ForwardEnd", "room": 7, "tokens": 64})
        w.write_input(0.003, P, ev.SendKV(room=7, end_idx=64, last=True))
        w.write_effects(0.003, P, [
            ev.ChunkQueued(worker=1, room=7, chunk_idx=0, page_start=0, num_pages=4,
                           is_last=True),
            ev.Deferred(worker=1, room=7, chunk_idx=0, session=D, reason="allocation pending",
                        all_blocked=True)])
        w.write_input(0.0035, P, ev.MessageArrived(src=D, msg=rsp))
        w.write_effects(0.0035, P, [ev.WakeWorkers(workers=(1,))])
        w.write_input(0.004, P, ev.WorkerPoll(worker=1))
        w.write_effects(0.004, P, [ev.StartTransfer(
            worker=1, room=7, chunk_idx=0, session=D, page_start=0, num_pages=4,
            region_offset=0, region_end=4096, dst_offset=0, nbytes=4096, writer=0, round=0,
            is_last=True)])
        w.write_input(0.0045, P, ev.TransferDone(worker=1))
        w.write_effects(0.0045, P, [ev.Send(dst=D, msg=ready),
                                    ev.RoomConcluded(room=7, status="Success"),
                                    ev.Send(dst=D, msg=status), ev.RoomTornDown(room=7)])
        if not finish:
            w.flush()
            return read_trace(path)
        w.write_input(0.0046, D, ev.MessageArrived(src=P, msg=ready))
        w.write_effects(0.0046, D, [ev.StartScatter(room=7, chunk_idx=0, alloc_id=3, offset=0,
                                                    nbytes=4096, page_start=0, num_pages=4)])
        w.write_input(0.005, D, ev.ScatterDone(room=7, chunk_idx=0, alloc_id=3))
        w.write_effects(0.005, D, [
            ev.Freed(alloc_id=3, room=7, chunk_idx=0, reason="scattered"),
            ev.WatermarkMoved(round=1, tail=0),
            ev.Send(dst=P, msg=wire.Watermark(round=1, tail=0, session_id=D))])
        w.write_input(0.0051, D, ev.MessageArrived(src=P, msg=status))
        w.write_effects(0.0051, D, [ev.RoomConcluded(room=7, status="Success")])
        w.write_input(0.0052, P, ev.MessageArrived(
            src=D, msg=wire.Watermark(round=1, tail=0, session_id=D)))
        w.write_sys(0.0052, "driver", {"type": "FaultInjected", "fault": "none", "detail": "-"})
        w.close({"status": "completed", "completed": 1, "failed": 0, "requests": 1,
                 "diagnosis": [], "corruption": []})
    return read_trace(path)


def check_structure(doc: dict[str, Any]) -> None:
    json.dumps(doc)
    assert doc["displayTimeUnit"] == "ms"
    events = doc["traceEvents"]
    for e in events:
        assert {"ph", "pid", "tid", "ts"} <= set(e), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
    starts = Counter(e["id"] for e in events if e["ph"] == "s")
    ends = Counter(e["id"] for e in events if e["ph"] == "f")
    assert starts == ends and all(n == 1 for n in starts.values())
    named = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    used = {(e["pid"], e["tid"]) for e in events if e["ph"] in "Xsfi"}
    assert used <= named


@pytest.fixture()
def trace(tmp_path: Path) -> Trace:
    return known_run(tmp_path / "known.trace.jsonl")


def _one(events: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    found = [e for e in events if all(e.get(k) == v for k, v in match.items())]
    assert len(found) == 1, (match, found)
    return found[0]


def test_structure_and_processes(trace: Trace, tmp_path: Path) -> None:
    doc = to_chrome_trace(trace)
    check_structure(doc)
    events = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {1: f"prefill {P}", 2: f"decode {D}", 3: "driver"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e["name"] == "thread_name"}
    assert threads[(1, 2)] == "transfer worker 1" and threads[(2, 1)] == "scatter"
    out = write_perfetto(trace, tmp_path / "known.json")
    assert json.loads(out.read_text()) == doc
    gz = write_perfetto(trace, tmp_path / "known.json.gz")
    assert gz.read_bytes()[:2] == b"\x1f\x8b"


def test_slices_counters_flows(trace: Trace) -> None:
    events = to_chrome_trace(trace)["traceEvents"]
    xfer = _one(events, ph="X", cat="transfer")
    assert (xfer["pid"], xfer["tid"], xfer["ts"], xfer["dur"]) == (1, 2, 4000.0, 500.0)
    assert xfer["args"]["room"] == 7 and xfer["args"]["nbytes"] == 4096
    scatter = _one(events, ph="X", cat="scatter")
    assert (scatter["pid"], scatter["tid"], scatter["ts"], scatter["dur"]) == (2, 1, 4600.0,
                                                                              400.0)
    defer = _one(events, ph="X", cat="deferral")
    assert (defer["pid"], defer["tid"], defer["ts"], defer["dur"]) == (1, 2, 3000.0, 500.0)
    fwd = _one(events, ph="X", cat="forward")
    assert (fwd["pid"], fwd["tid"], fwd["ts"], fwd["dur"]) == (1, 0, 2000.0, 1000.0)

    occupancy = [(e["ts"], e["args"]["bytes"]) for e in events
                 if e["ph"] == "C" and e["name"] == "ring occupancy"]
    assert occupancy == [(2000.0, 4096), (5000.0, 0)]
    assert all(e["pid"] == 2 for e in events if e.get("name") == "ring occupancy")
    lag = [(e["pid"], e["ts"], e["args"]["bytes"]) for e in events
           if e["ph"] == "C" and e["name"] == f"watermark lag {D}"]
    assert lag == [(1, 5000.0, RING), (1, 5200.0, 0)]

    start = _one(events, ph="s")
    finish = _one(events, ph="f")
    assert start["id"] == finish["id"] and finish["bp"] == "e"
    assert (start["pid"], start["tid"], start["ts"]) == (1, 2, 4500.0)
    assert (finish["pid"], finish["tid"], finish["ts"]) == (scatter["pid"], scatter["tid"],
                                                            scatter["ts"])
    marker = _one(events, ph="X", cat="chunk_ready")
    assert (marker["pid"], marker["tid"], marker["ts"], marker["dur"]) == (1, 2, 4500.0, 0.0)

    instants = Counter((e["pid"], e["name"]) for e in events if e["ph"] == "i")
    assert instants == {(1, "concluded Success"): 1, (2, "concluded Success"): 1,
                        (3, "fault none"): 1, (3, "Outcome: completed"): 1}


def test_unfinished_slices_close_at_trace_end(tmp_path: Path) -> None:
    trace = known_run(tmp_path / "cut.trace.jsonl", finish=False)
    assert trace.outcome is None
    doc = to_chrome_trace(trace)
    check_structure(doc)
    events = doc["traceEvents"]
    assert not [e for e in events if e["ph"] in "sf"]  # the scatter never started
    xfer = _one(events, ph="X", cat="transfer")
    assert xfer["dur"] == 500.0 and "unfinished" not in xfer["args"]
    assert doc["otherData"]["status"] == "incomplete"


def test_real_core_run_exports(tmp_path: Path) -> None:
    from twin.core.decode import DecodeRank

    # a decode rank on its own: a STAGING_REQ, a CHUNK_READY, a scatter left in flight
    cfg = config()
    rank = DecodeRank(cfg, D, 0)
    path = tmp_path / "decode.trace.jsonl.gz"
    with TraceWriter(path, make_header("sim", cfg, NODES)) as w:
        w.write_sys(0.0, "driver", {
            "type": "RequestArrived", "room": 1, "rid": "r1", "input_len": 64, "output_len": 1,
            "decode_prefix_len": 0, "prefill_prefix_len": 0, "prefill_node": [P],
            "decode_node": [D]})
        inputs = [
            ev.DecodeRoomInit(room=1, prefill_ranks=(P,), prefill_attn_tp=1,
                              decode_prefix_len=0, total_pages=4),
            ev.MessageArrived(src=P, msg=wire.StagingReq(room=1, chunk_idx=0, chunk_pages=4,
                                                         session_id=D)),
            ev.MessageArrived(src=P, msg=wire.ChunkReady(room=1, chunk_idx=0, page_start=0,
                                                         num_pages=4, writer_id=D,
                                                         prefill_rank=0)),
        ]
        for i, item in enumerate(inputs):
            w.write_input(i * 1e-3, D, item)
            w.write_effects(i * 1e-3, D, rank.handle(item, i * 1e-3))
    doc = to_chrome_trace(read_trace(path))
    check_structure(doc)
    scatter = _one(doc["traceEvents"], ph="X", cat="scatter")
    assert scatter["args"]["unfinished"] is True and scatter["ts"] == 2000.0
