"""Trace codec, writer, reader, schema and documentation tables."""

from __future__ import annotations

import gzip
import heapq
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twin.core import events as ev
from twin.core import wire
from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.core.decode import DecodeRank
from twin.core.prefill import PrefillRank
from twin.trace import codec
from twin.trace.codec import TraceError, event_from_json, event_to_json
from twin.trace.format import (
    FORMAT_VERSION,
    SCHEMA_PATH,
    SYS_TYPES,
    TraceWriter,
    build_schema,
    iter_trace,
    make_header,
    markdown_event_tables,
    node_id,
    read_trace,
    schema_text,
    update_doc_tables,
)

ROOT = Path(__file__).resolve().parents[2]
P, D = "p0g0r0", "d0g0r0"
NODES = [{"id": P, "role": "prefill", "instance": 0, "dp": 0, "rank": 0},
         {"id": D, "role": "decode", "instance": 0, "dp": 0, "rank": 0}]
OUTCOME = {"status": "completed", "completed": 1, "failed": 0, "requests": 1, "diagnosis": [],
           "corruption": []}


def small_config(ring_bytes: int = 1 << 16) -> TwinConfig:
    return TwinConfig(model=ModelShape(num_layers=2, num_kv_heads=2, head_dim=4, dtype_bytes=2),
                      prefill=ServerSide(tp_size=1), decode=ServerSide(tp_size=1),
                      stage_equal_tp=True,  # these runs exercise the staging path
                      chunked_prefill_size=64, page_size=16, staging_pool_size_bytes=ring_bytes,
                      transfer_queue_size=2)


def arrival(room: int) -> dict[str, Any]:
    return {"type": "RequestArrived", "room": room, "rid": f"r{room}", "input_len": 100,
            "output_len": 4, "decode_prefix_len": 0, "prefill_prefix_len": 0,
            "prefill_node": [P], "decode_node": [D]}


# ---------------------------------------------------------------------------------------------
# A real run of the core, recorded (one prefill rank, one decode rank, hand-delivered messages)
# ---------------------------------------------------------------------------------------------
def record_core_run(path: Path, *, rooms: tuple[tuple[int, int], ...] = ((101, 200), (102, 130)),
                    ring_bytes: int = 1 << 16, scatter_s: float = 5e-5,
                    log: list[tuple[str, str, Any]] | None = None) -> TwinConfig:
    """Drive a PrefillRank and a DecodeRank through ``rooms`` ((room, input_len), ...)."""
    cfg = small_config(ring_bytes)
    ranks: dict[str, Any] = {P: PrefillRank(cfg, P, 0, 0), D: DecodeRank(cfg, D, 0)}
    lengths = dict(rooms)
    queue: list[tuple[float, int, str, Any]] = []
    counter = [0]

    def at(t: float, node: str, item: Any) -> None:
        counter[0] += 1
        heapq.heappush(queue, (t, counter[0], node, item))

    for i, (room, _) in enumerate(rooms):
        at(i * 1e-3, "driver", ("arrive", room))
    with TraceWriter(path, make_header("sim", cfg, NODES, seed=7), flush_every=64) as w:
        while queue:
            t, _, node, item = heapq.heappop(queue)
            if isinstance(item, tuple):
                kind, room, *rest = item
                if kind == "arrive":
                    w.write_sys(t, "driver", {**arrival(room), "input_len": lengths[room]})
                    at(t, D, ev.DecodeRoomInit(room=room, prefill_ranks=(P,), prefill_attn_tp=1,
                                               decode_prefix_len=0,
                                               total_pages=-(-lengths[room] // cfg.page_size)))
                elif kind == "forward":
                    start, end = rest
                    w.write_sys(t, P, {"type": "ForwardStart", "room": room, "tokens": end - start})
                    at(t + 2e-4, "driver", ("forward_end", room, start, end))
                else:
                    start, end = rest
                    w.write_sys(t, P, {"type": "ForwardEnd", "room": room, "tokens": end - start})
                    at(t, P, ev.SendKV(room=room, end_idx=end, last=end >= lengths[room]))
                    if end < lengths[room]:
                        at(t, "driver", ("forward", room, end, min(lengths[room], end + 64)))
                continue
            w.write_input(t, node, item)
            effects = ranks[node].handle(item, t)
            w.write_effects(t, node, effects)
            if log is not None:
                log.append(("in", node, item))
                log.extend(("out", node, e) for e in effects)
            for e in effects:
                if isinstance(e, ev.Send):
                    at(t + 1e-5, e.dst, ev.MessageArrived(src=node, msg=e.msg))
                elif isinstance(e, ev.SendMetadata):
                    target = ev.Target(session=e.session, decode_rank=e.decode_rank,
                                       total_pages=e.total_pages,
                                       decode_prefix_len=e.decode_prefix_len)
                    at(t + 1e-5, P, ev.RoomBootstrapped(room=e.room, targets=(target,)))
                    at(t + 2e-5, P, ev.Prefetch(room=e.room))
                    at(t + 3e-5, "driver", ("forward", e.room, 0, min(64, lengths[e.room])))
                elif isinstance(e, ev.StartTransfer):
                    at(t + 1e-4, node, ev.TransferDone(worker=e.worker))
                elif isinstance(e, ev.StartScatter):
                    at(t + scatter_s, node, ev.ScatterDone(room=e.room, chunk_idx=e.chunk_idx,
                                                           alloc_id=e.alloc_id))
                elif isinstance(e, ev.WakeWorkers):
                    for worker in e.workers:
                        at(t, node, ev.WorkerPoll(worker=worker))
                elif isinstance(e, ev.Deferred) and not e.all_blocked:
                    at(t + 1e-4, node, ev.WorkerPoll(worker=e.worker))
        w.close({"status": "completed", "completed": len(w.succeeded), "failed": len(w.failed),
                 "requests": w.requests, "diagnosis": [], "corruption": []})
    return cfg


# ---------------------------------------------------------------------------------------------
# Codec
# ---------------------------------------------------------------------------------------------
_text = st.text(max_size=12)


def _strategy(spec: tuple[Any, ...]) -> st.SearchStrategy[Any]:
    kind = spec[0]
    if kind == "int":
        return st.integers(min_value=-(2**63), max_value=2**64)
    if kind == "str":
        return _text
    if kind == "bool":
        return st.booleans()
    if kind == "float":
        return st.floats(allow_nan=False, allow_infinity=False)
    if kind == "opt":
        return st.none() | _strategy(spec[1])
    if kind == "list":
        return st.lists(_strategy(spec[1]), max_size=3).map(tuple)
    if kind == "enum":
        return st.sampled_from(list(spec[1]))
    if kind == "msg":
        return st.one_of([_instances(cls) for cls in codec.MESSAGE_KINDS.values()])
    if kind == "event":
        return _instances(spec[1])
    raise AssertionError(spec)


def _instances(cls: type) -> st.SearchStrategy[Any]:
    return st.builds(cls, **{f.name: _strategy(f.spec) for f in codec.field_specs(cls)})


ANY_EVENT = st.one_of([_instances(cls) for cls in ev.EVENT_TYPES.values()])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ANY_EVENT)
def test_codec_round_trips_every_event_type(event: Any) -> None:
    d = event_to_json(event)
    assert d["type"] == type(event).__name__
    back = event_from_json(json.loads(json.dumps(d)), where="t:1")
    assert back == event
    assert type(back) is type(event)
    assert codec.decode_event(codec.encode(event), where="t:1") == event  # from the text


_PLAIN: dict[str, Any] = {"int": 1, "str": "s", "bool": True, "float": 1.5, "list": (),
                          "msg": wire.Watermark(round=1, tail=2, session_id=D)}


def test_codec_covers_every_class_and_nested_shapes() -> None:
    for cls in ev.EVENT_TYPES.values():  # required fields only: defaults come back
        kwargs = {f.name: _PLAIN[f.spec[0]] for f in codec.field_specs(cls) if f.required}
        event = cls(**kwargs)
        assert event_from_json(event_to_json(event), where="x") == event
    msg = wire.TransferStatus(room=3, status=wire.KVPoll.Failed, prefill_rank=1,
                              failure_reason="x")
    assert event_to_json(ev.Send(dst=D, msg=msg)) == {
        "type": "Send", "dst": D, "msg": {"kind": "KV_STATUS", "room": 3, "status": "Failed",
                                          "prefill_rank": 1, "failure_reason": "x"}}
    boot = ev.RoomBootstrapped(room=1, targets=(ev.Target(session=D, decode_rank=0,
                                                          total_pages=2, decode_prefix_len=0),))
    assert event_to_json(boot)["targets"][0]["session"] == D
    assert event_to_json(ev.WakeWorkers(workers=(0, 2))) == {"type": "WakeWorkers",
                                                             "workers": [0, 2], "at": 0.0}
    with pytest.raises(TypeError):
        event_to_json(object())


@pytest.mark.parametrize(("payload", "field", "text"), [
    ({"type": "Nope"}, "type", "unknown event type"),
    ({"type": "WorkerPoll"}, "worker", "missing"),
    ({"type": "WorkerPoll", "worker": "1"}, "worker", "expected an integer"),
    ({"type": "WorkerPoll", "worker": True}, "worker", "expected an integer"),
    ({"type": "WorkerPoll", "worker": 1, "extra": 2}, "extra", "unknown field"),
    ({"type": "SetTimer", "at": "soon"}, "at", "finite number"),
    ({"type": "WakeWorkers", "workers": [0, "x"]}, "workers[1]", "expected an integer"),
    ({"type": "Send", "dst": D, "msg": {"kind": "HELLO"}}, "msg.kind", "unknown message kind"),
    ({"type": "Send", "dst": D, "msg": {"kind": "KV_STATUS", "room": 1, "status": "Done",
                                       "prefill_rank": 0}}, "msg.status", "one of"),
    ({"type": "Send", "dst": D, "msg": {"kind": "WATERMARK", "round": 0, "tail": 0}},
     "msg.session_id", "missing"),
    ({"type": "RoomBootstrapped", "room": 1, "targets": [{"type": "Target"}]},
     "targets[0].session", "missing"),
])
def test_codec_errors_name_where_and_field(payload: dict[str, Any], field: str,
                                           text: str) -> None:
    with pytest.raises(TraceError) as info:
        event_from_json(payload, where="run.trace.jsonl:17")
    assert info.value.where == "run.trace.jsonl:17"
    assert info.value.field == field
    assert text in str(info.value) and str(info.value).startswith("run.trace.jsonl:17: ")


# ---------------------------------------------------------------------------------------------
# Writer and reader
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["run.trace.jsonl", "run.trace.jsonl.gz"])
def test_core_run_round_trips(tmp_path: Path, name: str) -> None:
    log: list[tuple[str, str, Any]] = []
    path = tmp_path / name
    cfg = record_core_run(path, ring_bytes=9000, scatter_s=2e-3, log=log)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == name.endswith(".gz")
    trace = read_trace(path)
    assert trace.complete and trace.status == "completed" and not trace.warnings
    assert trace.config == cfg and trace.header["seed"] == 7
    assert [r.seq for r in trace.events] == list(range(len(trace.events)))
    core = [(r.dir, r.node, r.event) for r in trace.events if r.dir != "sys"]
    assert core == log
    types = {r.type for r in trace.events}
    assert {"Deferred", "StartTransfer", "StartScatter", "WatermarkMoved"} <= types
    assert trace.outcome == {"type": "Outcome", **OUTCOME, "completed": 2, "requests": 2}
    with iter_trace(path) as streamed:
        assert streamed.header == trace.header
        assert [r.seq for r in streamed] == [r.seq for r in trace.events]
        assert streamed.outcome == trace.outcome
    with iter_trace(path) as header_only:
        assert header_only.config == cfg


def write_lines(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def good_lines(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "good.jsonl"
    with TraceWriter(path, make_header("sim", small_config(), NODES, seed=1)) as w:
        w.write_sys(0.0, "driver", arrival(5))
        w.write_input(0.001, D, ev.RoomAborted(room=5))
        w.write_effects(0.001, D, [ev.Dropped(what="RoomAborted", room=5, reason="r")])
        w.close(OUTCOME)
    return [json.loads(x) for x in path.read_text().splitlines()]


def _bad(tmp_path: Path, edit: Any) -> TraceError:
    lines = good_lines(tmp_path)
    edit(lines)
    with pytest.raises(TraceError) as info:
        read_trace(write_lines(tmp_path / "bad.jsonl", lines))
    return info.value


def test_reader_accepts_good_and_reports_incomplete(tmp_path: Path) -> None:
    lines = good_lines(tmp_path)
    trace = read_trace(write_lines(tmp_path / "a.jsonl", lines))
    assert trace.complete and [r.type for r in trace.events] == [
        "RequestArrived", "RoomAborted", "Dropped", "Outcome"]
    assert trace.events[1].event == ev.RoomAborted(room=5)
    trace = read_trace(write_lines(tmp_path / "b.jsonl", lines[:-1]))
    assert trace.outcome is None and not trace.complete and not trace.truncated
    assert trace.status == "incomplete" and "trace is incomplete" in trace.warnings[-1]


def _set(i: int, key: str, value: Any) -> Any:
    def edit(lines: list[dict[str, Any]]) -> None:
        lines[i][key] = value
    return edit


@pytest.mark.parametrize(("edit", "line", "field", "text"), [
    (_set(0, "format", "other"), 1, None, "not a staging-twin trace"),
    (_set(0, "version", FORMAT_VERSION + 1), 1, None,
     f"written by a newer staging-twin (version {FORMAT_VERSION + 1}); this reader supports "
     f"{FORMAT_VERSION}"),
    (_set(0, "mode", "lab"), 1, "mode", "expected one of"),
    (lambda ls: ls[0]["config"].update(page_size=0), 1, "config.page_size", "must be positive"),
    (lambda ls: ls[0]["config"].update(bogus_knob=1), 1, "config.bogus_knob", "unknown"),
    (lambda ls: ls[0]["config"].update(model={"num_layers": "x"}), 1, "config.model.num_layers",
     "expected an integer"),
    (lambda ls: ls[0]["nodes"][1].update(id=P), 1, "nodes[1].id", "duplicate"),
    (_set(0, "seed", "x"), 1, "seed", "integer or null"),
    (_set(2, "node", "p9g9r9"), 3, "node", "unknown node"),
    (_set(2, "node", "driver"), 3, "node", "sys records"),
    (_set(2, "seq", 5), 3, "seq", "expected 1, got 5"),
    (_set(2, "t", -1.0), 3, "t", "time goes backwards"),
    (_set(2, "dir", "sideways"), 3, "dir", "expected one of"),
    (_set(2, "type", "Explode"), 3, "type", "unknown input type"),
    (_set(2, "type", "Dropped"), 3, "type", "unknown input type"),
    (_set(3, "type", "RoomAborted"), 4, "type", "unknown effect type"),
    (_set(2, "room", "5"), 3, "room", "expected an integer"),
    (lambda ls: ls[2].pop("room"), 3, "room", "missing"),
    (_set(2, "room", 6), 3, "room", "never introduced"),
    (_set(1, "type", "Bogus"), 2, "type", "unknown sys record type"),
    (lambda ls: ls[1].pop("rid"), 2, "rid", "missing"),
    (_set(1, "decode_node", ["d5g0r0"]), 2, "decode_node", "unknown node"),
    (_set(4, "status", "fine"), 5, "status", "expected one of"),
    (lambda ls: ls.append({**ls[3], "seq": 4}), 6, None, "after the Outcome"),
])
def test_reader_errors_name_line_and_field(tmp_path: Path, edit: Any, line: int,
                                           field: str | None, text: str) -> None:
    err = _bad(tmp_path, edit)
    assert err.where == f"{tmp_path / 'bad.jsonl'}:{line}"
    assert err.field == field
    assert text in str(err)


def test_room_rule_exemptions(tmp_path: Path) -> None:
    """Frames about unknown rooms may arrive (and be dropped); ranks may not act on them."""
    lines = good_lines(tmp_path)
    frame = {"kind": "CHUNK_READY", "room": 99, "chunk_idx": 0, "page_start": 0, "num_pages": 1,
             "writer_id": D, "prefill_rank": 0}
    extra = [
        {"seq": 3, "t": 0.002, "node": D, "dir": "in", "type": "MessageArrived", "src": P,
         "msg": frame},
        {"seq": 4, "t": 0.002, "node": D, "dir": "out", "type": "Dropped", "what": "CHUNK_READY",
         "room": 99, "reason": "room not registered"},
        {"seq": 5, "t": 0.002, "node": P, "dir": "in", "type": "SendFailed", "dst": D,
         "msg": frame},
    ]
    outcome = {**lines[-1], "seq": 6, "t": 0.002}
    assert read_trace(write_lines(tmp_path / "ok.jsonl", [*lines[:-1], *extra, outcome])).complete
    send = {"seq": 3, "t": 0.002, "node": P, "dir": "out", "type": "Send", "dst": D, "msg": frame}
    with pytest.raises(TraceError, match="room 99 was never introduced"):
        read_trace(write_lines(tmp_path / "bad.jsonl", [*lines[:-1], send]))


def test_truncated_last_line_is_a_warning_but_malformed_middle_is_an_error(
        tmp_path: Path) -> None:
    path = tmp_path / "cut.jsonl"
    text = write_lines(path, good_lines(tmp_path)).read_text()
    path.write_text(text[: text.rindex('"status"')])  # cut inside the Outcome line
    trace = read_trace(path)
    assert trace.truncated and trace.outcome is None and len(trace.events) == 3
    assert "line 5 truncated: trace ends at line 4" in trace.warnings[0]
    lines = text.splitlines()
    lines[2] = lines[2][:20]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=r"cut\.jsonl:3: not valid JSON"):
        read_trace(path)
    for content, message in [("", "empty"), ("hello\n", "not JSON"), ("[1]\n", "not a staging")]:
        path.write_text(content)
        with pytest.raises(TraceError, match=message):
            read_trace(path)


def test_gzip_cut_mid_stream_reads_prefix(tmp_path: Path) -> None:
    path = tmp_path / "cut.jsonl.gz"
    record_core_run(path)
    full = read_trace(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    part = read_trace(path)
    assert part.truncated and part.outcome is None and 0 < len(part.events) < len(full.events)
    assert [r.data for r in part.events] == [r.data for r in full.events[: len(part.events)]]


def test_writer_rejects_bad_input(tmp_path: Path) -> None:
    w = TraceWriter(tmp_path / "w.jsonl", make_header("sim", small_config(), NODES, seed=None))
    with pytest.raises(TraceError, match="unknown node"):
        w.write_input(0.0, "p7g0r0", ev.Tick())
    with pytest.raises(TraceError, match="unknown node"):
        w.write_input(0.0, "driver", ev.Tick())
    w.write_input(1.0, P, ev.Tick())
    with pytest.raises(TypeError, match="not a core input"):
        w.write_input(1.0, P, ev.WorkerIdle(worker=0))
    with pytest.raises(TypeError, match="not a core effect"):
        w.write_effects(1.0, P, [ev.Tick()])
    with pytest.raises(TraceError, match="before"):
        w.write_input(0.5, P, ev.Tick())
    with pytest.raises(TraceError, match="not finite"):
        w.write_input(float("nan"), P, ev.Tick())
    with pytest.raises(TraceError, match="unknown sys record type"):
        w.write_sys(1.0, "driver", {"type": "Whatever"})
    with pytest.raises(TraceError, match="'text'"):
        w.write_sys(1.0, "driver", {"type": "Note"})
    w.write_sys(1.0, P, {"type": "Note", "text": "hi", "extra": [1]})
    w.close()
    trace = read_trace(tmp_path / "w.jsonl")
    assert [r.type for r in trace.events] == ["Tick", "Note"]
    assert trace.events[1].data == {"type": "Note", "text": "hi", "extra": [1]}
    with pytest.raises(TraceError, match="newer"):
        TraceWriter(tmp_path / "x.jsonl", {**make_header("hw", small_config(), NODES),
                                           "version": 99})


@pytest.mark.parametrize(("exc", "status"), [(RuntimeError("boom"), "crashed"),
                                             (KeyboardInterrupt(), "interrupted")])
def test_context_manager_records_crash(tmp_path: Path, exc: BaseException, status: str) -> None:
    path = tmp_path / "crash.jsonl.gz"
    with pytest.raises(type(exc)), TraceWriter(path, make_header("sim", small_config(),
                                                                  NODES)) as w:
        w.write_sys(0.5, "driver", arrival(1))
        raise exc
    trace = read_trace(path)
    assert trace.complete and trace.status == status
    assert trace.outcome is not None and trace.outcome["requests"] == 1
    assert trace.outcome["diagnosis"][0].startswith(type(exc).__name__)


_CHILD = textwrap.dedent("""
    import sys, time
    from twin.core import events as ev
    from twin.core.config import TwinConfig
    from twin.trace.format import TraceWriter, make_header
    nodes = [{"id": "p0g0r0", "role": "prefill", "instance": 0, "dp": 0, "rank": 0}]
    w = TraceWriter(sys.argv[1], make_header("hw", TwinConfig(), nodes), flush_every=100,
                    encoder=sys.argv[4])
    for i in range(int(sys.argv[2])):
        w.write_input(i * 1e-6, "p0g0r0", ev.WorkerPoll(worker=i % 4))
    if sys.argv[3] == "wait":
        w.flush()
        print("ready", flush=True)
        time.sleep(60)
    else:
        print("ready", flush=True)
        i = int(sys.argv[2])
        while True:
            w.write_input(i * 1e-6, "p0g0r0", ev.WorkerPoll(worker=i % 4))
            i += 1
""")


def wait_for_group(pgid: int, timeout: float = 30.0) -> None:
    """Return once no process is left in process group ``pgid`` (or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


@pytest.mark.parametrize("name", ["killed.jsonl", "killed.jsonl.gz", "killed.jsonl.zst"])
@pytest.mark.parametrize("mode", ["wait", "busy"])
@pytest.mark.parametrize("encoder", ["inline", "process"])
def test_sigkill_leaves_readable_trace(tmp_path: Path, name: str, mode: str,
                                       encoder: str) -> None:
    path = tmp_path / name
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), "250", mode, encoder],
                             stdout=subprocess.PIPE, env=env, cwd=ROOT, start_new_session=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        if mode == "busy":
            # let it write (and flush) for a moment, then kill it mid-stream
            time.sleep(0.3)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    wait_for_group(child.pid)  # a forked encoder finishes what it was sent, then exits
    trace = read_trace(path)
    assert trace.outcome is None and "incomplete" in trace.warnings[-1]
    assert [r.seq for r in trace.events] == list(range(len(trace.events)))
    if mode == "wait":
        assert len(trace.events) == 250
        # an unfinished gzip member always reads as cut short, even at a line boundary; a
        # forked encoder outlives the killed writer and finishes the member
        assert trace.truncated == (name.endswith(".gz") and encoder == "inline")
    else:
        assert len(trace.events) >= 200


# ---------------------------------------------------------------------------------------------
# Header helpers, schema, documentation
# ---------------------------------------------------------------------------------------------
def test_header_helpers() -> None:
    assert node_id("prefill", 0, 1, 2) == "p0g1r2" and node_id("decode", 3, 0, 0) == "d3g0r0"
    h = make_header("sim", small_config(), NODES, defects=["no-release-room"], faults=["f"],
                    seed=3, workload={"name": "w", "digest": "ab"}, created="today")
    assert {"twin", "python", "simpy"} <= set(h["software"])
    assert TwinConfig.from_dict(h["config"]) == small_config()
    assert h["created"] == "today" and h["version"] == FORMAT_VERSION


def test_schema_file_is_in_sync() -> None:
    assert SCHEMA_PATH.read_text(encoding="utf-8") == schema_text(), (
        "run: python -m twin.trace.format schema")
    assert json.loads(schema_text()) == build_schema()


def test_schema_validates_real_lines(tmp_path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = build_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    path = tmp_path / "s.jsonl.gz"
    record_core_run(path, ring_bytes=9000, scatter_s=2e-3)
    with gzip.open(path, "rt") as f:
        lines = [json.loads(x) for x in f]
    for line in lines:
        errors = list(validator.iter_errors(line))
        assert not errors, (line, errors[0].message)
    bad = {**lines[5], "unexpected": 1}
    assert list(validator.iter_errors(bad))


def test_markdown_tables_and_docs_name_every_type() -> None:
    tables = markdown_event_tables()
    doc = (ROOT / "docs" / "trace-format.md").read_text(encoding="utf-8")
    names = [*ev.EVENT_TYPES, *codec.MESSAGE_KINDS, *SYS_TYPES]
    for name in names:
        assert f"`{name}`" in tables, name
        assert name in doc, name
    assert update_doc_tables(doc) == doc, "run: python -m twin.trace.format docs"
