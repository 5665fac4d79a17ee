"""Traces at scale: the text encoder, blocks (plain, gzip, zstd), the index, the lazy reader, and
the streamed views, replay and Perfetto export agreeing with their in-memory counterparts."""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from test_format import ANY_EVENT, NODES, D, P, arrival, record_core_run, small_config

from twin.core import events as ev
from twin.sim.runner import run_sim
from twin.sim.scenarios import SCENARIOS
from twin.trace.blocks import BlockSink, BlockSource
from twin.trace.codec import TraceError, body, encode, event_to_json
from twin.trace.format import TraceReader, TraceWriter, iter_trace, make_header, read_trace
from twin.trace.index import TraceIndex, index_path
from twin.trace.inspect import compare, diff, room_timeline, summary
from twin.trace.perfetto import to_chrome_trace, write_perfetto
from twin.workloads import poisson

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "traces"
AZURE = SHARED / "azure2023" / "AzureLLMInferenceTrace_code.csv"
NAMES = ["run.jsonl", "run.jsonl.gz", "run.jsonl.zst"]


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ANY_EVENT)
def test_an_events_line_is_what_json_would_write(event: Any) -> None:
    expected = json.dumps(event_to_json(event), separators=(",", ":"), allow_nan=False)
    assert json.loads(encode(event)) == json.loads(expected)
    assert body(event) == encode(event)[1:-1]


def test_the_writer_refuses_what_json_cannot_hold(tmp_path: Path) -> None:
    from test_format import NODES, P, small_config

    from twin.trace.format import TraceWriter, make_header

    w = TraceWriter(tmp_path / "inf.jsonl", make_header("sim", small_config(), NODES),
                    encoder="inline")
    w.write_input(0.0, P, ev.Tick())
    w.write_effects(0.0, P, [ev.SetTimer(at=float("inf"))])
    with pytest.raises(ValueError, match="field 'at'.*not a finite number"):
        w.flush()
    assert encode(ev.SetTimer(at=3)) == b'{"type":"SetTimer","at":3}'


# ---------------------------------------------------------------------------------------------
# Blocks and the index
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["none", "gzip", "zstd"])
def test_blocks_read_from_any_block(tmp_path: Path, codec: str) -> None:
    path = tmp_path / "b"
    spans: list[tuple[int, int, int]] = []
    sink = BlockSink(path, codec, on_block=lambda meta, off, end: spans.append((meta, off, end)))
    blocks = [b"".join(b"block %d line %d\n" % (i, j) for j in range(300)) for i in range(6)]
    for i, data in enumerate(blocks):
        sink.write(data, i)
    sink.close()
    assert b"".join(BlockSource(path)) == b"".join(blocks)
    for i, off, end in spans[1:]:
        assert b"".join(BlockSource(path, start=off, end=end)) == blocks[i]
        rest = BlockSource(path, start=off)
        assert b"".join(rest) == b"".join(blocks[i:]) and not rest.cut
    if codec != "none":  # a stream cut mid-block reads as cut, up to the last whole block
        data = path.read_bytes()
        path.write_bytes(data[: spans[3][1] + (spans[3][2] - spans[3][1]) // 2])
        src = BlockSource(path)
        got = b"".join(src)
        assert src.cut and got.startswith(b"".join(blocks[:3]))


@pytest.mark.parametrize("name", NAMES)
def test_index_blocks_cover_the_trace(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    record_core_run(path, rooms=tuple((100 + i, 64 + 16 * i) for i in range(12)))
    full = read_trace(path)
    head = TraceReader(path, lazy=True)
    head.close()
    index = TraceIndex.load(path, head.header_line, path.stat().st_size)
    assert index is not None and len(index.blocks) > 3
    assert index.blocks[0].seq == 0
    for a, b in zip(index.blocks, index.blocks[1:], strict=False):
        assert a.end == b.off and a.seq + a.n == b.seq and a.t1 <= b.t0
    assert sum(b.n for b in index.blocks) == len(full.events)
    # reading any range of blocks gives exactly those records
    blk = index.blocks
    part = list(TraceReader(path, lazy=True, span=(blk[2], blk[3])))
    want = full.events[blk[2].seq: blk[3].seq + blk[3].n]
    assert [(r.seq, r.t, r.node, r.dir, r.data) for r in part] == [
        (r.seq, r.t, r.node, r.dir, r.data) for r in want]
    # every block lists exactly the rooms its lines name
    listed = [rooms for _, rooms in index._scan(lambda d: d["rooms"])]
    for b, rooms in zip(blk, listed, strict=True):
        named = {r.data.get("room", (r.data.get("msg") or {}).get("room"))
                 for r in full.events[b.seq: b.seq + b.n]} - {None}
        assert named == set(rooms)
    assert index.room_blocks(105) is not None and index.room_blocks(999) is None
    # a stale index (another trace's) is ignored; a trace written without one removes it
    other = tmp_path / ("other-" + name)
    with TraceWriter(other, make_header("sim", small_config(), NODES, seed=8)) as w:
        w.write_sys(0.0, "driver", arrival(5))
    os.replace(index_path(other), index_path(path))
    assert TraceIndex.load(path, head.header_line, path.stat().st_size) is None
    TraceWriter(path, make_header("sim", small_config(), NODES), index=False).close()
    assert not index_path(path).exists()


@pytest.mark.parametrize("name", ["killed.jsonl.zst"])
def test_zstd_trace_killed_mid_block_reads_its_prefix(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    record_core_run(path, rooms=tuple((100 + i, 64) for i in range(8)))
    full = read_trace(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    part = read_trace(path)
    assert part.truncated and part.outcome is None and 0 < len(part.events) < len(full.events)
    assert "zstd stream ends early" in " ".join(part.warnings)
    assert [r.data for r in part.events] == [r.data for r in full.events[: len(part.events)]]


# ---------------------------------------------------------------------------------------------
# The lazy reader
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_lazy_reader_reads_what_the_strict_one_does(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    record_core_run(path, ring_bytes=9000, scatter_s=2e-3)
    strict = read_trace(path)
    lazy = TraceReader(path, lazy=True)
    records = list(lazy)
    assert [(r.seq, r.t, r.node, r.dir, r.type, r.line) for r in records] == [
        (r.seq, r.t, r.node, r.dir, r.type, r.line) for r in strict.events]
    assert [r.event for r in records] == [r.event for r in strict.events]
    assert [r.data for r in records] == [r.data for r in strict.events]
    assert lazy.outcome == strict.outcome and lazy.warnings == strict.warnings
    assert sum(lazy.counts.values()) == len(records)
    assert (lazy.first_t, lazy.last_t) == (strict.events[0].t, strict.events[-1].t)
    # body: the payload text as written
    for r in records:
        if r.dir != "sys":
            assert json.loads(b"{" + r.body + b"}") == r.data
    # select: only those types (and driver records) come out; everything is counted
    sel = TraceReader(path, select={"StartTransfer"})
    got = list(sel)
    assert {r.type for r in got if r.dir != "sys"} == {"StartTransfer"}
    assert sel.counts == lazy.counts


def _lines(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "good.jsonl"
    with TraceWriter(path, make_header("sim", small_config(), NODES, seed=1)) as w:
        w.write_sys(0.0, "driver", arrival(5))
        w.write_input(0.001, D, ev.RoomAborted(room=5))
        w.write_effects(0.001, D, [ev.Dropped(what="RoomAborted", room=5, reason="r")])
        w.write_input(0.002, P, ev.WorkerPoll(worker=1))
        w.write_effects(0.002, P, [ev.WorkerIdle(worker=1)])
        w.close({"status": "completed", "completed": 0, "failed": 0, "requests": 1,
                 "diagnosis": [], "corruption": []})
    return [json.loads(x) for x in path.read_text().splitlines()]


def _write(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x, separators=(",", ":")))
                            + "\n" for x in lines))
    return path


@pytest.mark.parametrize(("edit", "line", "field", "text"), [
    (lambda ls: ls[2].update(seq=5), 3, "seq", "expected 1, got 5"),
    (lambda ls: ls[3].update(t=0.0005), 4, "t", "time goes backwards"),
    (lambda ls: ls[2].update(node="p9g9r9"), 3, "node", "unknown node"),
    (lambda ls: ls[4].update(type="Nope"), 5, "type", "unknown input type"),
    (lambda ls: ls[5].update(type="Nope"), 6, "type", "unknown effect type"),
    (lambda ls: ls[1].update(rid=5), 2, "rid", "expected a string"),
])
def test_lazy_reader_checks_every_envelope(tmp_path: Path, edit: Any, line: int,
                                           field: str, text: str) -> None:
    lines = _lines(tmp_path)
    edit(lines)
    path = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(TraceError) as info:
        list(TraceReader(path, lazy=True))
    assert info.value.where.endswith(f":{line}") and info.value.field == field
    assert text in str(info.value)


def test_lazy_reader_checks_payloads_when_used(tmp_path: Path) -> None:
    lines = _lines(tmp_path)
    lines[4]["worker"] = "one"
    path = _write(tmp_path / "bad.jsonl", lines)
    records = list(TraceReader(path, lazy=True))  # envelopes are fine
    with pytest.raises(TraceError, match=r"bad\.jsonl:5: field 'worker'"):
        _ = records[3].event
    with pytest.raises(TraceError, match=r"bad\.jsonl:5: field 'worker'"):
        read_trace(path)
    text = (tmp_path / "bad.jsonl").read_text().replace('"worker":"one"}', '"worker":}')
    (tmp_path / "bad.jsonl").write_text(text)
    records = list(TraceReader(path, lazy=True))
    with pytest.raises(TraceError, match="not valid JSON"):
        _ = records[3].data


# ---------------------------------------------------------------------------------------------
# Views, replay and Perfetto streamed from files
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sim_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_sim_run(tmp_path_factory.mktemp("sim") / "run.jsonl.zst")


def record_sim_run(path: Path) -> Path:
    """A simulated run of 60 requests on the default scenario, recorded with small blocks
    (200 lines) to ``path``."""
    from twin.core.defects import Defects
    from twin.sim.runner import outcome_record, trace_header

    sc = SCENARIOS["default"]
    wl = poisson(60, 40.0, 700, 4, seed=3)
    header = trace_header(sc.config, wl, defects=Defects(), faults=[], seed=0, params=sc.params,
                          request_overrides={}, max_concurrency=None)
    with TraceWriter(path, header, flush_every=200) as w:
        result = run_sim(sc.config, wl, params=sc.params, recorder=w)
        w.close(outcome_record(result))
    return path


def test_views_from_a_path_match_the_in_memory_trace(sim_trace: Path) -> None:
    trace = read_trace(sim_trace)
    assert summary(sim_trace) == summary(trace)
    assert summary(sim_trace, max_rooms=5) == summary(trace, max_rooms=5)
    assert "... 55 more rooms" in summary(sim_trace, max_rooms=5)
    for room in (0, 17, 59, 999):
        assert room_timeline(sim_trace, room) == room_timeline(trace, room)
    assert compare(sim_trace, trace).divergence is None
    assert diff(sim_trace, trace) == diff(trace, read_trace(sim_trace))


def test_room_timeline_seeks_with_the_index(sim_trace: Path, tmp_path: Path) -> None:
    plain = tmp_path / "noindex.jsonl.zst"
    plain.write_bytes(sim_trace.read_bytes())  # no index beside it: a full scan
    for room in (0, 30, 59):
        assert room_timeline(sim_trace, room).splitlines()[1:] == room_timeline(
            plain, room).splitlines()[1:]


def test_replay_streams_from_a_path(sim_trace: Path) -> None:
    from twin.replay import replay_sim

    a, b = replay_sim(sim_trace), replay_sim(read_trace(sim_trace))
    assert a.divergence is None and a.same_outcome and a.status == "completed"
    assert (a.inputs, a.status, a.completed, a.failed) == (b.inputs, b.status, b.completed,
                                                           b.failed)


def _proto_check(path: Path) -> dict[str, Any]:
    """Check a Perfetto protobuf file as trace processor reads it: tracks described before use,
    interned names defined before use, each flow with one start and one end, and slices that
    nest on their tracks once sorted by time (each END closes the BEGIN written with it)."""
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    trace = pb.Trace()
    trace.ParseFromString(path.read_bytes())
    tracks: dict[int, Any] = {}
    interned: dict[str, set[int]] = defaultdict(set)
    events = []
    flows_out: Counter[int] = Counter()
    flows_in: Counter[int] = Counter()
    kinds: Counter[str] = Counter()
    for i, p in enumerate(trace.packet):
        assert p.trusted_packet_sequence_id == 1
        assert bool(p.sequence_flags & 1) == (i == 0)
        for field in ("event_names", "event_categories", "debug_annotation_names"):
            interned[field].update(e.iid for e in getattr(p.interned_data, field))
        if p.HasField("track_descriptor"):
            d = p.track_descriptor
            assert d.uuid not in tracks and (not d.parent_uuid or d.parent_uuid in tracks)
            tracks[d.uuid] = d
            continue
        te = p.track_event
        assert te.track_uuid in tracks
        assert all(c in interned["event_categories"] for c in te.category_iids)
        assert not te.name_iid or te.name_iid in interned["event_names"]
        assert all(a.name_iid in interned["debug_annotation_names"]
                   for a in te.debug_annotations)
        if te.type == te.TYPE_COUNTER:
            assert tracks[te.track_uuid].HasField("counter")
            kinds[tracks[te.track_uuid].name] += 1
        flows_out.update(te.flow_ids)
        flows_in.update(te.terminating_flow_ids)
        events.append((p.timestamp, i, te.track_uuid, te.type))
        if te.type == te.TYPE_SLICE_BEGIN:
            kinds[f"slice:{te.category_iids[0]}"] += 1
    assert set(flows_out) == set(flows_in)
    assert all(n == 1 for n in (*flows_out.values(), *flows_in.values()))
    stacks: dict[int, list[int]] = defaultdict(list)
    for _, i, track, kind in sorted(events):
        if kind == 1:
            stacks[track].append(i)
        elif kind == 2:
            assert stacks[track].pop() == i - 1, "a slice would nest wrongly"
    assert not any(stacks.values())
    return {"flows": len(flows_out), "kinds": kinds}


def test_perfetto_protobuf_matches_the_json(sim_trace: Path, tmp_path: Path) -> None:
    out = write_perfetto(sim_trace, tmp_path / "run.pftrace")
    got = _proto_check(out)
    doc = to_chrome_trace(sim_trace)
    events = doc["traceEvents"]
    assert got["flows"] == sum(e["ph"] == "s" for e in events) > 0
    slices = sum(n for k, n in got["kinds"].items() if k.startswith("slice:"))
    assert slices == sum(e["ph"] == "X" and e["cat"] != "chunk_ready" for e in events)
    counters = sum(n for k, n in got["kinds"].items() if not k.startswith("slice:"))
    assert counters == sum(e["ph"] == "C" for e in events)
    js = write_perfetto(sim_trace, tmp_path / "run.json")
    assert json.loads(js.read_text())["traceEvents"] == events
    assert out.stat().st_size * 3 <= js.stat().st_size


@pytest.mark.parametrize("window", [
    {"t_from": 0.5, "t_to": 1.0}, {"t_from": 1.2}, {"t_to": 0.3}, {"room": 33},
    {"room": 33, "t_from": 0.0, "t_to": 5.0}, {"room": 12345},
])
def test_perfetto_window_seeks_to_the_same_result(sim_trace: Path, tmp_path: Path,
                                                  window: dict[str, Any]) -> None:
    plain = tmp_path / "noindex.jsonl.zst"
    plain.write_bytes(sim_trace.read_bytes())

    def events(path: Path) -> list[str]:
        doc = to_chrome_trace(path, **window)
        return sorted(json.dumps(e, sort_keys=True) for e in doc["traceEvents"] if e["ph"] != "M")

    seeked = events(sim_trace)
    assert seeked == events(plain)
    full = to_chrome_trace(read_trace(sim_trace), **window)["traceEvents"]
    assert seeked == sorted(json.dumps(e, sort_keys=True) for e in full if e["ph"] != "M")
    t_from, t_to = window.get("t_from", 0.0) * 1e6, window.get("t_to", 1e9) * 1e6
    for e in map(json.loads, seeked):
        if e["ph"] in ("C", "i"):
            assert t_from <= e["ts"] <= t_to
        elif e["ph"] == "X":
            assert e["ts"] <= t_to and e["ts"] + e["dur"] >= t_from
        if "room" in window and e["ph"] in ("X", "i") and "room" in e["args"]:
            assert e["args"]["room"] == window["room"]
    _proto_check(write_perfetto(sim_trace, tmp_path / "w.pftrace", **window))


@pytest.mark.skipif(not AZURE.exists(), reason="shared/traces/ not found next to the repository")
def test_production_trace_records_and_streams(tmp_path: Path) -> None:
    """The first 300 requests of the Azure code trace: recorded as .zst, replayed streamed."""
    from twin.cli.common import cut_workload
    from twin.core.config import TwinConfig
    from twin.replay import replay_sim
    from twin.workloads import load_trace

    wl = cut_workload(load_trace(AZURE), 300, None)
    path = tmp_path / "azure.jsonl.zst"
    result = run_sim(TwinConfig(), wl, trace_out=path)
    assert result.status.value == "completed"
    replayed = replay_sim(path)
    assert replayed.same_outcome and replayed.inputs == result.sim.inputs
    text = summary(path)
    assert "300/300 completed" in text
    with iter_trace(path, lazy=True) as reader:
        assert sum(1 for _ in reader) > 10 * 300


@pytest.mark.parametrize("name", NAMES)
def test_threaded_writer_writes_the_same_trace(tmp_path: Path, name: str) -> None:
    import twin.trace.format as fmt

    plain = tmp_path / name
    record_core_run(plain)
    original = fmt.TraceWriter.__init__

    def threaded(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **{**kwargs, "threaded": True})

    threaded_path = tmp_path / ("t-" + name)
    fmt.TraceWriter.__init__ = threaded  # type: ignore[method-assign]
    try:
        record_core_run(threaded_path)
    finally:
        fmt.TraceWriter.__init__ = original  # type: ignore[method-assign]
    assert threaded_path.read_bytes() == plain.read_bytes()
    assert index_path(threaded_path).read_bytes() == index_path(plain).read_bytes()
