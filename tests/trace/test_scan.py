"""The select reader's native pass over the lines it does not hand on (``twin.trace.scan``):
the same records, counts, passed effect payloads and errors as the reader's own check of every
envelope. Run against the compiled build too (``tests/test_compiled.py``)."""

from __future__ import annotations

import marshal
from pathlib import Path
from typing import Any

import pytest
from test_streaming import record_sim_run

from twin.replay import forked
from twin.trace import format as fmt
from twin.trace.codec import INPUT_NAMES, TraceError
from twin.trace.format import TraceReader
from twin.trace.inspect import _SUMMARY_TYPES
from twin.trace.rows import REDUCE
from twin.trace.scan import NUMBER_RE, SEP, Collector, Kind, LineSkipper, is_number


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
    "seq beyond i64": lambda raw: raw.replace(b'{"seq":', b'{"seq":' + b"9" * 25, 1),
    "seq of 19 digits": lambda raw: raw.replace(b'{"seq":', b'{"seq":1' + b"0" * 18, 1),
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


def test_the_pass_leaves_a_line_that_may_be_cut_short_to_the_reader() -> None:
    """A line as the writer writes it ends in '}', and with an object inside in '}}' or ']}':
    any other goes to the reader, which parses it (a line cut short is an error there)."""
    key = b'"node":"p0","dir":"out","type":"Send"'
    skipper = LineSkipper(None)
    skipper.add(key, Kind("p0", "out", "Send", 24, False, -1, nested=True))
    whole = b'{"seq":5,"t":1.5,' + key + b',"dst":"d0","msg":{"kind":"WATERMARK","round":1}}'
    assert skipper.run([whole], 0, 6, 1.0, b"") == 1
    for cut in (whole[:-1], whole[:-9], whole[:-2] + b"]"):
        assert skipper.run([cut], 0, 6, 1.0, b"") == 0, cut
    assert skipper.run([whole.replace(b"}}", b"]}")], 0, 6, 1.0, b"") == 1  # targets last
    flat = b'{"seq":5,"t":1.5,"node":"p0","dir":"out","type":"Tick"}'
    skipper.add(flat[17:-1], Kind("p0", "out", "Tick", 24, False, -1))
    assert skipper.run([flat], 0, 6, 1.0, b"") == 1
    assert skipper.run([flat[:-1]], 0, 6, 1.0, b"") == 0


@pytest.mark.parametrize("text", [b"0", b"-0", b"12", b"1.5", b"-1.25e-7", b"3E+2", b"0.0", b"",
                                  b"-", b"01", b"1.", b".5", b"1e", b"1e+", b"+1", b"1.5.2",
                                  b"--1", b"1e5e5", b"3.3001121264000015"])
def test_a_number_is_what_the_pattern_says(text: bytes) -> None:
    raw = b"x" + text + b","
    assert is_number(raw, 1, 1 + len(text)) == (NUMBER_RE.match(text) is not None)


def batches(path: Path, native: bool, monkeypatch: pytest.MonkeyPatch, replayed: Any = None,
            batch: int = 7) -> Any:
    """What a replay's reader ships (``forked.read_batches``), with or without the native
    pass: every batch's items and text, and what the reader learnt; or the error."""
    monkeypatch.setattr(fmt, "SKIP_NATIVELY", native)
    monkeypatch.setattr(forked, "BATCH", batch)
    if replayed is None:
        replayed = frozenset(TraceReader(path).nodes)
    shipped: list[tuple[Any, ...]] = []

    def ship(col: Collector) -> None:
        shipped.append((marshal.loads(marshal.dumps(col.items)), b"\n".join(col.text),
                        col.inputs))  # as the replaying process gets them
        col.reset()

    try:
        reader = forked.read_batches(str(path), replayed, ship)
    except TraceError as exc:
        return "error", str(exc), exc.field
    return (shipped, dict(reader.counts), reader.first_t, reader.last_t, reader.outcome,
            reader.truncated, reader.warnings)


@pytest.mark.parametrize("batch", [1, 7, 10_000])
def test_a_replays_batches_are_the_same_with_and_without_the_native_pass(
        trace: Path, batch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    native = batches(trace, True, monkeypatch, batch=batch)
    assert native == batches(trace, False, monkeypatch, batch=batch)
    shipped = native[0]
    assert all(n >= batch for *_, n in shipped[:-1]) and len(shipped) > (1 if batch < 100 else 0)
    items = [x for s in shipped for x in s[0]]
    inputs = [x for x in items if x[0] == 1]
    assert len(inputs) == sum(n for (_, d, _), n in native[1].items() if d == "in") > 100
    # every input row is the row of the event its line decodes to
    events = [r for r in TraceReader(trace) if r.dir == "in"]
    assert [x[3] for x in inputs] == [REDUCE[type(r.event)](r.event) for r in events]
    # every input's effect payloads, then SEP
    text = b"\n".join(s[1] for s in shipped if s[1])
    assert text.count(SEP) == len(inputs)
    assert sum(n for (_, d, _), n in native[1].items() if d == "out") == (
        text.count(b"\n") + 1 - len(inputs))


def test_nodes_not_replayed_have_no_rows(trace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = sorted(TraceReader(trace).nodes)
    some = frozenset(nodes[:1])
    native = batches(trace, True, monkeypatch, some)
    assert native == batches(trace, False, monkeypatch, some)
    items = [x for s in native[0] for x in s[0]]
    assert {x[2] for x in items if x[0] == 1} == set(some)


ROW_EDITS = {  # an input line the native pass must hand back to the reader, which raises
    "field type": (b'"dir":"in","type":"ScatterDone"', b'"chunk_idx":', b'"chunk_idx":"0",'
                   b'"x":'),
    "room never introduced": (b'"dir":"in","type":"ScatterDone"', b'"room":', b'"room":9999'),
    "unknown field": (b'"dir":"in","type":"SendKV"', b'"room":', b'"roomy":1,"room":'),
}


@pytest.mark.parametrize("edit", ROW_EDITS, ids=list(ROW_EDITS))
def test_a_bad_input_raises_the_same_error_with_the_native_pass(
        trace: Path, tmp_path: Path, edit: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kind, old, new = ROW_EDITS[edit]
    lines = trace.read_bytes().split(b"\n")
    # the second such line: the native pass knows the kind by then
    i = [k for k, raw in enumerate(lines) if kind in raw][1]
    lines[i] = lines[i].replace(old, new, 1)
    path = tmp_path / "edited.jsonl"
    path.write_bytes(b"\n".join(lines))
    native = batches(path, True, monkeypatch)
    assert native == batches(path, False, monkeypatch)
    assert native[0] == "error" and f":{i + 1}:" in native[1]
