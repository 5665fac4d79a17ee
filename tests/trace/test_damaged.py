"""Damaged traces on the command line: a line cut mid-file, flipped bytes in a compressed
trace, a truncated trace, a file that is no trace. Every view (``trace summary``, ``trace
room``, ``perfetto``, ``replay``) tells the same story: bad input (exit 2, naming the file and
the line, or the block and byte offset) or, for a trace cut short, the warning that says so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from twin.cli import cli
from twin.trace.blocks import BlockSource

WORKLOAD = "poisson:n=20,rate=10,input=1024,output=4,seed=1"


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=True)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One short run, recorded as plain text, gzip and zstd (three blocks each, indexed)."""
    folder = tmp_path_factory.mktemp("damaged")
    for name in ("run.jsonl", "run.jsonl.gz", "run.jsonl.zst"):
        r = invoke("sim", "--workload", WORKLOAD, "--trace-out", str(folder / name))
        assert r.exit_code == 0, r.output
    return folder


def copy(recorded: Path, name: str, tmp_path: Path, *, index: bool = True) -> Path:
    out = tmp_path / name
    shutil.copy(recorded / name, out)
    if index:
        shutil.copy(recorded / f"{name}.idx", tmp_path / f"{name}.idx")
    return out


def blocks(path: Path) -> list[dict]:  # type: ignore[type-arg]
    lines = Path(f"{path}.idx").read_text().splitlines()
    return [json.loads(x) for x in lines[1:]]


def views(path: Path, tmp_path: Path, room: int = 3) -> dict[str, Result]:
    return {
        "summary": invoke("trace", "summary", str(path)),
        "room": invoke("trace", "room", str(path), str(room)),
        "perfetto": invoke("perfetto", str(path), "-o", str(tmp_path / "out.pftrace")),
        "replay": invoke("replay", str(path)),
    }


def assert_bad_input(results: dict[str, Result], *texts: str) -> None:
    for view, r in results.items():
        assert r.exit_code == 2, (view, r.exit_code, r.output)
        assert "Traceback" not in r.output, (view, r.output)
        for text in texts:
            assert text in r.output, (view, text, r.output)


def test_a_line_cut_mid_file_is_bad_input_in_every_view(recorded: Path, tmp_path: Path) -> None:
    """The summary passes over most lines without parsing them; a line cut short (or one whose
    closing brace is gone) must still be an error there, as it is in the views that parse."""
    lines = (recorded / "run.jsonl").read_bytes().split(b"\n")
    cut = tmp_path / "cut.jsonl"
    lines[150] = lines[150][: len(lines[150]) // 2]  # line 151
    cut.write_bytes(b"\n".join(lines))
    assert_bad_input(views(cut, tmp_path), "cut.jsonl:151: not valid JSON")
    assert not (tmp_path / "out.pftrace").exists()

    lines = (recorded / "run.jsonl").read_bytes().split(b"\n")
    k = next(i for i, x in enumerate(lines) if i > 200 and x.endswith(b"}}"))
    lines[k] = lines[k][:-1]  # ends in '}' still, one '{' left open
    cut.write_bytes(b"\n".join(lines))
    r = invoke("trace", "summary", str(cut))
    assert r.exit_code == 2 and f"cut.jsonl:{k + 1}: not valid JSON" in r.output, r.output


def test_a_brace_inside_a_string_is_no_cut_line(recorded: Path, tmp_path: Path) -> None:
    text = (recorded / "run.jsonl").read_text()
    assert '"reason":"scattered"' in text
    odd = tmp_path / "odd.jsonl"
    odd.write_text(text.replace('"reason":"scattered"', '"reason":"scat{tered"'))
    r = invoke("trace", "summary", str(odd))
    assert r.exit_code == 0 and "complete, status completed" in r.output, r.output


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at:at + 8] = bytes(b ^ 0xFF for b in data[at:at + 8])
    path.write_bytes(bytes(data))


def test_flipped_bytes_in_a_zstd_trace_are_corruption(recorded: Path, tmp_path: Path) -> None:
    """8 bytes flipped inside block 2: every view reports the corruption with the block and
    its byte offset (exit 2), instead of reading the trace as one that ends early."""
    trace = copy(recorded, "run.jsonl.zst", tmp_path)
    second = blocks(trace)[1]
    assert second["b"] == 2
    _flip(trace, (second["off"] + second["end"]) // 2)
    # room 0 lies in block 1: its timeline reads on to block 2 and meets the damage too
    assert_bad_input(views(trace, tmp_path, room=0), "run.jsonl.zst: zstd data corrupt in block 2",
                     f"starts at byte {second['off']}")
    assert not (tmp_path / "out.pftrace").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".part")]
    (tmp_path / "run.jsonl.zst.idx").unlink()  # without the index: the same
    assert_bad_input(views(trace, tmp_path, room=0), "zstd data corrupt in block 2")


def test_every_flipped_bit_in_a_zstd_block_is_found(recorded: Path, tmp_path: Path) -> None:
    """zstd frames carry a checksum of their content and a frame's text is handed on only once
    it matched: a flip that still decodes (about half of them, without the checksum) is found
    as well, in its block, and none of that block's text is read."""
    whole = (recorded / "run.jsonl.zst").read_bytes()
    second = blocks(recorded / "run.jsonl.zst")[1]
    good = b"".join(BlockSource(recorded / "run.jsonl.zst"))
    first_text = len(b"".join(BlockSource(recorded / "run.jsonl.zst", end=second["off"])))
    trace = tmp_path / "flip.jsonl.zst"
    for k in range(24):
        at = second["off"] + (second["end"] - second["off"]) * k // 24
        data = bytearray(whole)
        data[at] ^= 0x20
        trace.write_bytes(bytes(data))
        source = BlockSource(trace)
        text = b"".join(source)
        assert source.corrupt is not None and source.corrupt.block == 2, (at, source.corrupt)
        assert source.corrupt.offset == second["off"] and not source.cut
        assert text == good[:first_text]


def test_flipped_bytes_in_a_gzip_trace_are_corruption(recorded: Path, tmp_path: Path) -> None:
    """A gzip trace has one checksum, at its end: the damaged text reads wrong first, and the
    summary names the corruption behind it."""
    trace = copy(recorded, "run.jsonl.gz", tmp_path)
    second = blocks(trace)[1]
    _flip(trace, (second["off"] + second["end"]) // 2)
    r = invoke("trace", "summary", str(trace))
    assert r.exit_code == 2 and "run.jsonl.gz: gzip data corrupt at byte" in r.output, r.output
    assert "the damage shows first at" in r.output and "Traceback" not in r.output


def test_a_zstd_trace_cut_short_reads_as_truncated(recorded: Path, tmp_path: Path) -> None:
    """A killed writer leaves a prefix of the stream (or, after a crash, a prefix filled up
    with zero bytes): that is a trace that ends early, not corruption."""
    whole = (recorded / "run.jsonl.zst").read_bytes()
    second = blocks(recorded / "run.jsonl.zst")[1]
    for tail in (b"", b"\0" * 4096):
        trace = tmp_path / "short.jsonl.zst"
        trace.write_bytes(whole[: (second["off"] + second["end"]) // 2] + tail)
        r = invoke("trace", "summary", str(trace))
        assert r.exit_code == 0, r.output
        assert "truncated, status incomplete" in r.output
        assert "zstd stream ends early: trace ends at line 1003" in r.output


def test_trace_room_of_a_truncated_trace_warns(recorded: Path, tmp_path: Path) -> None:
    whole = (recorded / "run.jsonl.zst").read_bytes()
    second = blocks(recorded / "run.jsonl.zst")[1]
    trace = tmp_path / "short.jsonl.zst"
    trace.write_bytes(whole[: (second["off"] + second["end"]) // 2])
    r = invoke("trace", "room", str(trace), "19")  # arrives after the cut
    assert r.exit_code == 0, r.output
    assert "(no records up to where the trace ends early)" in r.stdout
    assert "warning: " in r.stderr and "stream ends early: trace ends at line 1003" in r.stderr
    r = invoke("trace", "room", str(trace), "3")  # before it: shown, with the warning
    assert r.exit_code == 0 and "RequestArrived" in r.stdout, r.output
    assert "stream ends early" in r.stderr


def test_replay_of_a_truncated_trace_says_the_input_ended_early(recorded: Path,
                                                               tmp_path: Path) -> None:
    """Rooms in flight where the trace stops are the recording's end, not a wedge: the replay
    says so and blames no rank."""
    whole = (recorded / "run.jsonl.zst").read_bytes()
    second = blocks(recorded / "run.jsonl.zst")[1]
    trace = tmp_path / "short.jsonl.zst"
    trace.write_bytes(whole[: (second["off"] + second["end"]) // 2])
    r = invoke("replay", str(trace))
    assert r.exit_code == 1, r.output
    assert "the trace is cut short (truncated): it ends at line 1003" in r.stdout, r.output
    assert "not diagnosed as a wedge" in r.stdout
    assert "wedge" not in r.stdout.replace("not diagnosed as a wedge", ""), r.stdout
    assert "waits for" not in r.stdout
    r = invoke("replay", str(trace), "--json")
    doc = json.loads(r.stdout)
    assert doc["diagnosis"] == [] and "ends at line 1003" in doc["ended_early"]


@pytest.mark.parametrize(("name", "content", "says"), [
    ("zstd.bin", b"\x28\xb5\x2f\xfd" + bytes(range(256)) * 2, "zstd data that cannot be decoded"),
    ("gzip.bin", b"\x1f\x8b" + bytes(range(7, 256)) * 2, "gzip data that cannot be decoded"),
    ("lines.txt", b"\n" * 500, "line 1 is empty"),
])
def test_a_file_that_is_no_trace_says_so(tmp_path: Path, name: str, content: bytes,
                                         says: str) -> None:
    path = tmp_path / name
    path.write_bytes(content[:500])
    r = invoke("trace", "summary", str(path))
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert f"{name}:1: not a staging-twin trace ({says}" in r.output, r.output
    assert "empty file" not in r.output
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    r = invoke("trace", "summary", str(empty))
    assert r.exit_code == 2 and "empty.jsonl:1: not a staging-twin trace (empty file)" in r.output


def test_perfetto_writes_nothing_when_the_trace_is_bad(recorded: Path, tmp_path: Path) -> None:
    """The export goes to a temporary name and is renamed when complete: a bad trace leaves
    neither a partial file nor the temporary, and an older file of that name as it was."""
    lines = (recorded / "run.jsonl").read_bytes().split(b"\n")
    lines[1500] = lines[1500][:40]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\n".join(lines))
    out = tmp_path / "out.json.gz"
    out.write_bytes(b"before")
    r = invoke("perfetto", str(bad), "-o", str(out))
    assert r.exit_code == 2 and "bad.jsonl:1501: not valid JSON" in r.output, r.output
    assert out.read_bytes() == b"before"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "out.json.gz"]
    r = invoke("perfetto", str(recorded / "run.jsonl"), "-o", str(out))
    assert r.exit_code == 0, r.output
    import gzip

    with gzip.open(out, "rt") as f:
        assert json.load(f)["traceEvents"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "out.json.gz"]
