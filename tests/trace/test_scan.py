"""The select reader's native pass over the lines it does not hand on (``twin.trace.scan``):
the same records, counts, passed effect payloads and errors as the reader's own check of every
envelope. Run against the compiled build too (``tests/test_compiled.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_streaming import record_sim_run

from twin.trace import format as fmt
from twin.trace.codec import INPUT_NAMES, TraceError
from twin.trace.format import TraceReader
from twin.trace.inspect import _SUMMARY_TYPES
from twin.trace.scan import NUMBER_RE, Kind, LineSkipper, is_number


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_sim_run(tmp_path_factory.mktemp("scan") / "run.jsonl")


def read(path: Path, select: Any, native: bool, monkeypatch: pytest.MonkeyPatch,
         passed: bool = False) -> Any:
    monkeypatch.setattr(fmt, "SKIP_NATIVELY", native)
    reader = TraceReader(path, select=select)
    bodies: list[tuple[str, bytes]] = []
    if passed:
        reader.passed_effects = lambda node, body: bodies.append((node, body))
    try:
        recs = [(r.seq, r.t, r.node, r.dir, r.type, r.line, r.raw) for r in reader]
    except TraceError as exc:
        return "error", str(exc), exc.field
    return (recs, dict(reader.counts), reader.first_t, reader.last_t, reader.outcome,
            reader.truncated, reader.warnings, bodies)


@pytest.mark.parametrize("select", [_SUMMARY_TYPES, INPUT_NAMES, frozenset()],
                         ids=["summary", "inputs", "driver"])
@pytest.mark.parametrize("passed", [False, True])
def test_the_same_records_with_and_without_the_native_pass(
        trace: Path, select: Any, passed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    native = read(trace, select, True, monkeypatch, passed)
    assert native == read(trace, select, False, monkeypatch, passed)
    assert len(native[0]) > 10 and sum(native[1].values()) > 1000
    assert not passed or len(native[7]) > 500


def _edit(trace: Path, tmp_path: Path, lineno: int, edit: Any) -> Path:
    lines = trace.read_bytes().split(b"\n")
    lines[lineno - 1] = edit(lines[lineno - 1])
    out = tmp_path / "edited.jsonl"
    out.write_bytes(b"\n".join(lines))
    return out


EDITS = {
    "seq": lambda raw: raw.replace(b'{"seq":', b'{"seq":1', 1),
    "time backwards": lambda raw: raw.replace(b',"t":', b',"t":-', 1),
    "time not a number": lambda raw: raw.replace(b',"t":', b',"t":1e', 1),
    "unknown node": lambda raw: raw.replace(b'"node":"', b'"node":"x', 1),
    "no pattern": lambda raw: raw.replace(b'"dir":', b'"dir" :', 1),
    "unknown dir": lambda raw: raw.replace(b'"dir":"out"', b'"dir":"up"', 1),
    "cut": lambda raw: raw[: len(raw) // 2],
}


@pytest.mark.parametrize("edit", EDITS, ids=list(EDITS))
def test_the_same_errors_with_and_without_the_native_pass(
        trace: Path, tmp_path: Path, edit: str, monkeypatch: pytest.MonkeyPatch) -> None:
    lineno = 1500  # an effect line well inside the trace
    assert b'"dir":"out"' in trace.read_bytes().split(b"\n")[lineno - 1]
    path = _edit(trace, tmp_path, lineno, EDITS[edit])
    native = read(path, _SUMMARY_TYPES, True, monkeypatch, passed=True)
    assert native == read(path, _SUMMARY_TYPES, False, monkeypatch, passed=True)
    assert (native[0] == "error") == (edit != "no pattern")  # that one is valid JSON still


def test_the_pass_stops_at_the_first_line_it_cannot_vouch_for() -> None:
    key = b'"node":"p0","dir":"out","type":"Tick"'
    skipper = LineSkipper(None)
    skipper.add(key, Kind("p0", "out", "Tick", 24, False, -1))
    lines = [b'{"seq":5,"t":1.5,' + key + b"}", b'{"seq":6,"t":1.25,' + key + b"}"]
    assert skipper.run(lines, 0, 6, 1.0, b"") == 1
    assert (skipper.last_t, skipper.last_tb) == (1.5, b"1.5")
    assert skipper.run(lines, 1, 7, 1.5, b"1.5") == 1  # time goes backwards: not here
    assert skipper.run([lines[0]], 0, 5, 1.0, b"") == 0  # seq out of order
    assert skipper.run([lines[0].replace(b"Tick", b"Tock")], 0, 6, 1.0, b"") == 0
    by_key = {key: 2}
    skipper.add_counts(by_key)
    assert by_key == {key: 3}
    got: list[tuple[str, bytes]] = []
    skipper = LineSkipper(lambda n, b: got.append((n, b)))
    skipper.add(key, Kind("p0", "out", "Tick", 24, False, 24))
    assert skipper.run(lines[:1], 0, 6, 1.0, b"") == 1
    assert got == [("p0", b'"type":"Tick"')] and skipper.hit is None
    wanted = Kind("p0", "out", "Tick", 24, True, -1)
    skipper.add(key, wanted)
    lines = [lines[0], lines[0].replace(b"5", b"6", 1)]
    assert skipper.run(lines, 0, 6, 1.0, b"") == 1  # stops after a wanted line
    assert skipper.hit is wanted and skipper.hit_at == 17 + 24 and wanted.n == 1


@pytest.mark.parametrize("text", [b"0", b"-0", b"12", b"1.5", b"-1.25e-7", b"3E+2", b"0.0", b"",
                                  b"-", b"01", b"1.", b".5", b"1e", b"1e+", b"+1", b"1.5.2",
                                  b"--1", b"1e5e5", b"3.3001121264000015"])
def test_a_number_is_what_the_pattern_says(text: bytes) -> None:
    raw = b"x" + text + b","
    assert is_number(raw, 1, 1 + len(text)) == (NUMBER_RE.match(text) is not None)
