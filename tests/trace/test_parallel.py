"""The two-process select scan of an indexed trace (``twin trace summary``): the same records,
counts and text as the sequential reader, and the sequential reader's errors whenever the
trace is not what its index says."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_streaming import record_sim_run

from twin.trace import parallel
from twin.trace.codec import TraceError
from twin.trace.format import TraceReader
from twin.trace.index import TraceIndex, index_path
from twin.trace.inspect import _SUMMARY_TYPES, _summary, summary_of_file

NAMES = ["run.jsonl", "run.jsonl.gz", "run.jsonl.zst"]


@pytest.fixture(autouse=True)
def small_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups of two 200-line blocks, so a small trace has many of them."""
    monkeypatch.setattr(parallel, "GROUP_BLOCKS", 2)
    monkeypatch.setattr(parallel, "MIN_BLOCKS", 8)


def sequential(path: Path) -> tuple[str, list[str]]:
    reader = TraceReader(path, select=_SUMMARY_TYPES)
    return _summary(reader, 200), reader.warnings


def blocks(path: Path) -> list:  # type: ignore[type-arg]
    head = TraceReader(path, lazy=True)
    head.close()
    index = TraceIndex.load(path, head.header_line, path.stat().st_size)
    assert index is not None
    return index.blocks


@pytest.mark.parametrize("name", NAMES)
def test_same_records_counts_and_summary(tmp_path: Path, name: str) -> None:
    path = record_sim_run(tmp_path / name)
    assert len(blocks(path)) >= 16
    scan = parallel.parallel_scan(path, _SUMMARY_TYPES)
    assert scan is not None
    got = [(r.seq, r.t, r.node, r.dir, r.type, r.line, r.data) for r in scan]
    assert scan.helper_pid is not None
    with pytest.raises(ChildProcessError):  # reaped
        os.waitpid(scan.helper_pid, os.WNOHANG)
    reader = TraceReader(path, select=_SUMMARY_TYPES)
    want = [(r.seq, r.t, r.node, r.dir, r.type, r.line, r.data) for r in reader]
    assert got == want and len(got) > 100
    assert {r[4] for r in got} >= {"RequestArrived", "StartTransfer", "RoomConcluded", "Outcome"}
    assert scan.counts == reader.counts
    assert (scan.first_t, scan.last_t, scan.outcome, scan.truncated, scan.warnings) == (
        reader.first_t, reader.last_t, reader.outcome, reader.truncated, reader.warnings)
    assert summary_of_file(path) == sequential(path)


def test_short_traces_and_unindexed_ones_are_read_sequentially(tmp_path: Path) -> None:
    path = record_sim_run(tmp_path / "run.jsonl.zst")
    plain = tmp_path / "noindex.jsonl.zst"
    plain.write_bytes(path.read_bytes())
    assert parallel.parallel_scan(plain, _SUMMARY_TYPES) is None
    assert summary_of_file(plain)[0] == sequential(path)[0].replace(str(path), str(plain))
    parallel.MIN_BLOCKS = len(blocks(path)) + 1
    assert parallel.parallel_scan(path, _SUMMARY_TYPES) is None


def test_a_consumer_that_stops_early_reaps_the_helper(tmp_path: Path) -> None:
    path = record_sim_run(tmp_path / "run.jsonl.zst")
    scan = parallel.parallel_scan(path, _SUMMARY_TYPES)
    assert scan is not None
    it = iter(scan)
    next(it)
    pid = scan.helper_pid
    assert pid is not None
    it.close()  # type: ignore[attr-defined]
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _edit_line(path: Path, lineno: int, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` (same length: the index stays right) in line ``lineno``."""
    assert len(old) == len(new)
    lines = path.read_bytes().split(b"\n")
    assert old in lines[lineno - 1], lines[lineno - 1][:120]
    lines[lineno - 1] = lines[lineno - 1].replace(old, new, 1)
    path.write_bytes(b"\n".join(lines))


@pytest.mark.parametrize("group", [1, 2], ids=["helper", "own"])
def test_a_bad_line_gives_the_sequential_error(tmp_path: Path, group: int) -> None:
    """In a group the helper reads (odd) and in one this process reads (even)."""
    path = record_sim_run(tmp_path / "run.jsonl")
    blk = blocks(path)[group * parallel.GROUP_BLOCKS + 1]
    seq = blk.seq + 7
    other = seq - 1 if seq % 10 == 9 else seq + 1
    _edit_line(path, seq + 2, b'{"seq":%d,' % seq, b'{"seq":%d,' % other)
    with pytest.raises(TraceError) as want:
        sequential(path)
    assert f"{path}:{seq + 2}" in str(want.value) and "seq" in str(want.value)
    scan = parallel.parallel_scan(path, _SUMMARY_TYPES)
    assert scan is not None
    with pytest.raises(parallel.Fallback):
        list(scan)
    with pytest.raises(TraceError) as got:
        summary_of_file(path)
    assert str(got.value) == str(want.value)


def test_a_room_introduced_in_two_groups_gives_the_sequential_error(tmp_path: Path) -> None:
    path = record_sim_run(tmp_path / "run.jsonl")
    arrivals = [r for r in TraceReader(path, select=_SUMMARY_TYPES)
                if r.type == "RequestArrived"]
    first, late = arrivals[10], arrivals[-5]  # rooms of two digits, far apart
    assert len(str(first.data["room"])) == len(str(late.data["room"])) == 2
    assert late.seq - first.seq > 4 * 200 * parallel.GROUP_BLOCKS
    _edit_line(path, late.line, b'"room":%d,' % late.data["room"],
               b'"room":%d,' % first.data["room"])
    with pytest.raises(TraceError, match=f"room {first.data['room']} introduced twice") as want:
        sequential(path)
    with pytest.raises(TraceError) as got:
        summary_of_file(path)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("name", NAMES)
def test_blocks_past_the_index_and_a_missing_outcome(tmp_path: Path, name: str) -> None:
    """A killed writer's index ends before its trace: the rest is read as the tail."""
    path = record_sim_run(tmp_path / name)
    idx = index_path(path)
    lines = idx.read_bytes().splitlines(keepends=True)
    idx.write_bytes(b"".join(lines[:-5]))
    scan = parallel.parallel_scan(path, _SUMMARY_TYPES)
    assert scan is not None and len(scan._blocks) == len(lines) - 6
    reader = TraceReader(path, select=_SUMMARY_TYPES)
    assert [r.seq for r in scan] == [r.seq for r in reader]  # no Fallback
    assert (scan.counts, scan.last_t, scan.outcome) == (reader.counts, reader.last_t,
                                                        reader.outcome)
    assert summary_of_file(path) == sequential(path)
    if name == "run.jsonl":  # and without its Outcome: the same warning
        data = path.read_bytes()
        path.write_bytes(data[: data.rindex(b'{"seq"')])
        text, warnings = summary_of_file(path)
        assert (text, warnings) == sequential(path)
        assert any("no Outcome record" in w for w in warnings)


@pytest.mark.parametrize("max_rooms", [1, 5, 59, 60, 200])
def test_past_the_first_rooms_only_driver_records_are_selected(tmp_path: Path,
                                                               max_rooms: int) -> None:
    """The summary's table needs the first ``max_rooms`` rooms only: later groups yield driver
    records alone, and the text is still the sequential reader's."""
    path = record_sim_run(tmp_path / "run.jsonl.zst")
    scan = parallel.parallel_scan(path, _SUMMARY_TYPES, first_rooms=max_rooms)
    assert scan is not None
    if max_rooms <= 5:
        assert scan._full_groups < len(scan._groups) // 2
    elif max_rooms > 60:  # fewer rooms than that: everything selected
        assert scan._full_groups == len(scan._groups)
    got = [r for r in scan if r.dir != "sys"]
    assert got and {r.type for r in got} <= _SUMMARY_TYPES
    reader = TraceReader(path, select=_SUMMARY_TYPES)
    want = (_summary(reader, max_rooms), reader.warnings)
    assert summary_of_file(path, max_rooms=max_rooms) == want
