"""Rows and the encoder process: the text from rows is the text from events, and a trace
encoded in a forked child is the trace encoded inline, byte for byte."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from test_format import ANY_EVENT, NODES, P, small_config, wait_for_group

from twin.core import events as ev
from twin.core.config import TwinConfig
from twin.core.defects import Defects
from twin.runtime.faults import parse_fault
from twin.runtime.header import trace_header
from twin.runtime.params import SimParams
from twin.sim.runner import run_sim
from twin.trace import format as fmt
from twin.trace.codec import TraceError, decode_event, encode, event_from_json
from twin.trace.format import TraceWriter, make_header, read_trace
from twin.workloads.spec import parse_workload_spec

ROOT = Path(__file__).resolve().parents[2]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ANY_EVENT)
def test_the_codec_reads_back_every_event_it_writes(event: Any) -> None:
    text = encode(event)
    assert decode_event(text, where="x") == event
    assert event_from_json(json.loads(text), where="x") == event
    line = b'{"seq":3,"t":0.25,"node":"p0g0r0","dir":"out",' + text[1:]
    assert decode_event(b"{" + line[line.index(b'"type"'):], where="x") == event


def test_the_codec_names_the_field_it_refuses() -> None:
    good = encode(ev.Allocated(room=1, chunk_idx=0, alloc_id=2, offset=0, round=0, size=64))
    with pytest.raises(TraceError, match="field 'room': expected an integer, got a string"):
        decode_event(good.replace(b'"room":1', b'"room":"1"'), where="t:2")
    with pytest.raises(TraceError, match="t:2: field 'colour': unknown field"):
        decode_event(good[:-1] + b',"colour":1}', where="t:2")
    with pytest.raises(TraceError, match="field 'size': missing"):
        decode_event(good.replace(b',"size":64', b""), where="t:2")
    with pytest.raises(TraceError, match="field 'type': unknown event type 'Nope'"):
        decode_event(b'{"type":"Nope"}', where="t:2")
    with pytest.raises(TraceError, match="field 'msg.kind': unknown message kind"):
        decode_event(b'{"type":"MessageArrived","src":"a","msg":{"kind":"HELLO"}}', where="t")
    with pytest.raises(TraceError, match="field 'msg.chunk_idx': missing"):
        decode_event(b'{"type":"MessageArrived","src":"a","msg":{"kind":"STAGING_REQ",'
                     b'"room":1}}', where="t")


def _record(path: Path, fork: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A simulated run recorded through ``run_sim``, whose writer forks its encoder or not."""
    monkeypatch.setattr(fmt, "can_fork", lambda: fork)
    workload = parse_workload_spec("poisson:n=40,rate=20,input=6000~3000,output=32,seed=3")
    cfg = TwinConfig()
    run_sim(cfg, workload, trace_out=path, faults=[parse_fault("delay:STAGING_REQ:ms=2")])


@pytest.mark.parametrize("name", ["run.jsonl", "run.jsonl.gz", "run.jsonl.zst"])
def test_process_and_inline_encoders_write_the_same_bytes(
        tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = tmp_path / "inline" / name, tmp_path / "process" / name
    a.parent.mkdir()
    b.parent.mkdir()
    _record(a, False, monkeypatch)
    _record(b, True, monkeypatch)
    assert a.read_bytes() == b.read_bytes()
    assert Path(f"{a}.idx").read_bytes() == Path(f"{b}.idx").read_bytes()
    trace = read_trace(b)
    assert trace.complete and len(trace.events) > 2000
    assert {"RequestArrived", "ForwardStart", "FaultInjected", "StartTransfer"} <= {
        r.type for r in trace.events}


def test_process_encoder_flush_puts_everything_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "f.jsonl"
    w = TraceWriter(path, make_header("sim", small_config(), NODES), encoder="process")
    for i in range(50):
        w.write_input(i * 1e-3, P, ev.WorkerPoll(worker=i % 3))
        w.write_effects(i * 1e-3, P, [ev.WorkerIdle(worker=i % 3)])
    w.flush()
    assert len(path.read_text().splitlines()) == 101  # the header and every line so far
    w.close()
    assert read_trace(path).status == "incomplete"


def test_a_record_that_is_not_plain_data_is_refused_where_it_is_written(
        tmp_path: Path) -> None:
    w = TraceWriter(tmp_path / "e.jsonl", make_header("sim", small_config(), NODES),
                    encoder="process")
    with pytest.raises(TypeError, match="not plain data: .*bytes is not JSON serializable"):
        w.write_sys(0.0, P, {"type": "Note", "text": "x", "blob": b"not json"})
    w.close()
    assert read_trace(tmp_path / "e.jsonl").events == []


_SCRIPT = textwrap.dedent("""
    import sys
    from twin.cli import main
    sys.argv = ["twin", "sim", "--workload",
                "poisson:n=400000,rate=50,input=4000~2000,output=64,seed=1",
                "--trace-out", sys.argv[1]]
    main()
""")


def test_a_ctrl_c_while_a_batch_is_shipped_is_raised_after_it() -> None:
    """``sigint_deferred`` (around ``TraceWriter._ship`` and every frame written to a pipe):
    a SIGINT inside the block is raised once the block is done, never in the middle (where it
    could land between a write and the note of what was written: a batch sent twice)."""
    from twin.trace.encoder import sigint_deferred

    done = []
    with pytest.raises(KeyboardInterrupt), sigint_deferred():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # a signal not held off would interrupt here
        done.append("the whole block")
    assert done == ["the whole block"]


def test_a_batch_cut_short_by_a_dying_writer_is_dropped(tmp_path: Path) -> None:
    """A run killed while it writes a batch leaves the child half a frame: the child writes
    every whole batch before it and ends the file properly (not a truncated stream)."""
    path = tmp_path / "cut.jsonl.zst"
    w = TraceWriter(path, make_header("sim", small_config(), NODES), encoder="process",
                    flush_every=10)
    for i in range(35):
        w.write_input(i * 0.5, P, ev.Tick())
    w._ship()
    os.write(w._back._w, struct.pack("<I", 5000) + b"\x01" * 100)  # the head, part of the body
    w._back.close()  # the pipe ends mid-frame; the child reports success
    trace = read_trace(path)
    assert not trace.truncated
    assert [r.type for r in trace.events] == ["Tick"] * 35
    assert trace.outcome is None


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_a_killed_or_interrupted_run_keeps_what_it_recorded(tmp_path: Path, sig: int) -> None:
    """The encoder outlives a killed run and writes every line it was sent; Ctrl-C (SIGINT to
    the process group) leaves it running until the run has written its outcome."""
    path = tmp_path / "k.jsonl.zst"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(path)], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while (not path.exists() or path.stat().st_size < 200_000) and time.monotonic() < deadline:
        time.sleep(0.05)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # Ctrl-C: the whole process group, the encoder included
    else:  # the run alone is killed (a SIGKILL to the group would kill the encoder too)
        os.kill(proc.pid, sig)
    proc.wait(timeout=60)
    wait_for_group(proc.pid)  # the encoder is in the same process group
    trace = read_trace(path)
    assert not trace.truncated  # the encoder finished the last block and the stream
    assert [r.seq for r in trace.events] == list(range(len(trace.events)))
    assert len(trace.events) > 1000
    if sig == signal.SIGINT:
        assert trace.status == "interrupted"
    else:
        assert trace.outcome is None and "incomplete" in trace.warnings[-1]


@pytest.mark.parametrize("encoder", ["inline", "process"])
def test_writer_errors_count_the_lines_a_runtime_appended(tmp_path: Path, encoder: str) -> None:
    """The runtime records one call per input (``record``); an error the writer raises
    afterwards still names the right line."""
    cfg = TwinConfig()
    workload = parse_workload_spec("poisson:n=5,rate=20,input=3000~1000,output=8,seed=2")
    header = trace_header(cfg, workload, defects=Defects(), faults=[], seed=0,
                          params=SimParams(), request_overrides={}, max_concurrency=None)
    path = tmp_path / "n.jsonl"
    w = TraceWriter(path, header, encoder=encoder, flush_every=50)
    run_sim(cfg, workload, recorder=w)
    with pytest.raises(TraceError, match=r"n\.jsonl:(\d+): field 'text'") as info:
        w.write_sys(1e9, "driver", {"type": "Note"})
    w.flush()
    lines = len(path.read_text().splitlines())
    assert lines > 100
    assert f"n.jsonl:{lines + 1}:" in str(info.value)  # the line the record would have been
    w.close()


def test_a_threaded_sink_is_never_forked(tmp_path: Path) -> None:
    header = make_header("sim", small_config(), NODES)
    with pytest.raises(ValueError, match="threaded"):
        TraceWriter(tmp_path / "a.jsonl", header, encoder="process", threaded=True)
    with TraceWriter(tmp_path / "b.jsonl", header, threaded=True) as w:
        assert w.encoder == "inline"
        w.write_input(0.0, P, ev.Tick())
    assert [r.type for r in read_trace(tmp_path / "b.jsonl").events] == ["Tick"]


_FULL = textwrap.dedent("""
    import resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, resource.RLIM_INFINITY))
    from twin.cli import main
    sys.argv = ["twin", "sim", "--workload",
                "poisson:n=300,rate=3.3,input=12000~8000,output=256,seed=1",
                "--trace-out", sys.argv[1]]
    main()
""")


def test_a_full_disk_in_the_encoder_process_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "full.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _FULL, str(path)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "cannot write: File too large" in out.stderr and "Traceback" not in out.stderr
    trace = read_trace(path)  # what fitted is readable
    assert len(trace.events) > 100 and trace.outcome is None
