"""Terminal views: summary, room timeline, diff and first divergence."""

from __future__ import annotations

from pathlib import Path

from twin.core import events as ev
from twin.core import wire
from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.trace.format import Trace, TraceWriter, make_header, read_trace
from twin.trace.inspect import diff, first_divergence, room_timeline, summary

P, D = "p0g0r0", "d0g0r0"
NODES = [{"id": P, "role": "prefill", "instance": 0, "dp": 0, "rank": 0},
         {"id": D, "role": "decode", "instance": 0, "dp": 0, "rank": 0}]


def config(ring: int = 10_000) -> TwinConfig:
    return TwinConfig(model=ModelShape(num_layers=2, num_kv_heads=2, head_dim=4, dtype_bytes=2),
                      prefill=ServerSide(tp_size=1), decode=ServerSide(tp_size=1),
                      stage_equal_tp=True,  # these runs exercise the staging path
                      chunked_prefill_size=64, page_size=16, staging_pool_size_bytes=ring,
                      transfer_queue_size=2)


def run(path: Path, *, shift: float = 0.0, size: int = 4096, fail_room: int | None = None,
        created: str = "monday", ring: int = 10_000, outcome: bool = True) -> Trace:
    """Two rooms (7 and 8), one chunk each; ``fail_room`` concludes Failed on decode."""
    header = make_header("sim", config(ring), NODES, seed=1, created=created)
    with TraceWriter(path, header) as w:
        for k, room in enumerate((7, 8)):
            t = k * 0.01 + shift
            w.write_sys(t, "driver", {
                "type": "RequestArrived", "room": room, "rid": f"r{room}", "input_len": 64,
                "output_len": 1, "decode_prefix_len": 0, "prefill_prefix_len": 0,
                "prefill_node": [P], "decode_node": [D]})
            req = wire.StagingReq(room=room, chunk_idx=0, chunk_pages=4, session_id=D)
            w.write_input(t + 0.001, D, ev.MessageArrived(src=P, msg=req))
            w.write_effects(t + 0.001, D, [ev.Allocated(room=room, chunk_idx=0, alloc_id=k,
                                                        offset=0, round=k, size=size)])
            w.write_input(t + 0.002, P, ev.SendKV(room=room, end_idx=64, last=True))
            w.write_effects(t + 0.002, P, [ev.Deferred(
                worker=0, room=room, chunk_idx=0, session=D, reason="allocation pending",
                all_blocked=True)])
            w.write_input(t + 0.003, P, ev.WorkerPoll(worker=0))
            w.write_effects(t + 0.003, P, [ev.StartTransfer(
                worker=0, room=room, chunk_idx=0, session=D, page_start=0, num_pages=4,
                region_offset=0, region_end=size, dst_offset=0, nbytes=size, writer=0, round=k,
                is_last=True)])
            w.write_input(t + 0.004, P, ev.TransferDone(worker=0))
            ready = wire.ChunkReady(room=room, chunk_idx=0, page_start=0, num_pages=4,
                                    writer_id=D, prefill_rank=0)
            w.write_effects(t + 0.004, P, [ev.Send(dst=D, msg=ready),
                                           ev.RoomConcluded(room=room, status="Success")])
            w.write_input(t + 0.005, D, ev.ScatterDone(room=room, chunk_idx=0, alloc_id=k))
            status = "Failed" if room == fail_room else "Success"
            w.write_effects(t + 0.005, D, [ev.RoomConcluded(room=room, status=status)])
        failed = int(fail_room is not None)
        w.close({"status": "completed" if not failed else "corrupted", "completed": 2 - failed,
                 "failed": failed, "requests": 2, "diagnosis": [],
                 "corruption": [f"room {fail_room}"] if failed else []} if outcome else None)
    return read_trace(path)


def test_summary(tmp_path: Path) -> None:
    text = summary(run(tmp_path / "a.trace.jsonl"))
    assert "status completed" in text and "outcome: completed: 2/2 completed, 0 failed" in text
    assert "Deferred (out)" in text and "RequestArrived (sys)" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.startswith("  7 ") or line.startswith("  8 ")}
    # room arrival 1st-transfer last-scatter decode prefill deferrals
    assert rows["7"] == ["7", "0.000", "3.000", "5.000", "Success@5.000", "Success@4.000", "1"]
    assert rows["8"][1:4] == ["10.000", "13.000", "15.000"]
    assert max(len(line) for line in text.splitlines()) <= 100
    incomplete = summary(run(tmp_path / "b.trace.jsonl", outcome=False, fail_room=8))
    assert "outcome: none" in incomplete and "Failed@15.000" in incomplete


def test_room_timeline(tmp_path: Path) -> None:
    text = room_timeline(run(tmp_path / "a.trace.jsonl"), 8)
    lines = text.splitlines()
    assert lines[0].startswith("room 8 in ")
    body = "\n".join(lines[1:])
    assert "room=7" not in body and "alloc_id=0" not in body
    assert "** RequestArrived" in lines[1]
    assert any("<- WorkerPoll worker=0" in x for x in lines)  # the poll that started it
    assert any("<- TransferDone" in x for x in lines)
    assert any("-> Send dst=d0g0r0 msg=CHUNK_READY(room=8" in x for x in lines)
    assert lines[-1].split()[:3] == ["15.000", "d0g0r0", "->"]
    assert "(no records)" in room_timeline(run(tmp_path / "b.trace.jsonl"), 99)


def test_identical_runs_do_not_diverge(tmp_path: Path) -> None:
    a = run(tmp_path / "a.trace.jsonl")
    b = run(tmp_path / "b.trace.jsonl.gz", created="tuesday")  # created is ignored
    assert first_divergence(a, b) is None
    text = diff(a, b)
    assert "header: identical" in text and "events: identical" in text
    assert "outcome: identical (completed)" in text


def test_time_tolerance(tmp_path: Path) -> None:
    a = run(tmp_path / "a.trace.jsonl")
    b = run(tmp_path / "b.trace.jsonl", shift=1e-7)
    assert first_divergence(a, b, t_tol=1e-6) is None
    index, line_a, line_b = first_divergence(a, b, t_tol=1e-9)
    assert index == 0 and line_a is not None and line_b is not None
    assert "max time difference" in diff(a, b, t_tol=1e-6)


def test_divergence_and_summary_of_differences(tmp_path: Path) -> None:
    a = run(tmp_path / "a.trace.jsonl")
    b = run(tmp_path / "b.trace.jsonl", size=2048, ring=20_000, fail_room=8)
    index, line_a, line_b = first_divergence(a, b)
    assert index == 2 and "size=4096" in line_a and "size=2048" in line_b
    text = diff(a, b)
    assert "config.staging_pool_size_bytes: 10000 != 20000" in text
    assert "created" not in text and "software" not in text
    assert "first divergence at event #2 (line 4" in text
    assert "status: \"completed\" != \"corrupted\"" in text
    assert "counts by type: identical" in text  # same types, different contents


def test_shorter_trace_and_counts(tmp_path: Path) -> None:
    a = run(tmp_path / "a.trace.jsonl")
    b = run(tmp_path / "b.trace.jsonl", outcome=False)
    index, line_a, line_b = first_divergence(a, b)
    assert index == len(b.events) and line_b is None and "Outcome" in line_a
    text = diff(a, b)
    assert "<trace ended>" in text and "Outcome" in text and "outcome differs" in text
