"""Replay with a forked trace reader (``twin.replay.forked``): the sequential replay's result
for every kind of run, and the sequential replay's divergence report and errors when the trace
is not what its cores do."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from twin.cli import cli
from twin.core.defects import Defects
from twin.replay import Replayer, forked
from twin.runtime.faults import parse_fault
from twin.sim.runner import run_sim
from twin.sim.scenarios import SCENARIOS
from twin.trace.codec import TraceError
from twin.trace.format import TraceReader


@pytest.fixture(autouse=True)
def any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forked, "MIN_BYTES", 0)
    monkeypatch.setattr(forked, "BATCH", 7)  # many batches even on a small trace


def _record(path: Path, name: str, defects_on: bool, faults: tuple[str, ...] = ()) -> Path:
    sc = SCENARIOS[name]
    names = sc.base_defects + (sc.defects if defects_on else ())
    run_sim(sc.config, sc.workload(), defects=Defects.of(names),
            faults=[*sc.fault_specs(), *map(parse_fault, faults)], params=sc.params,
            request_overrides=sc.overrides, max_concurrency=sc.max_concurrency, trace_out=path)
    return path


def _fields(result: Any) -> tuple[Any, ...]:
    return (result.inputs, result.divergence, result.status, result.completed, result.failed,
            result.diagnosis, result.corruption, result.recorded, result.same_outcome)


def _sequential(path: Path) -> tuple[Any, TraceReader]:
    reader = TraceReader(path, lazy=True)
    return Replayer(reader).run_here(), reader


@pytest.mark.parametrize(("name", "defects_on", "faults", "suffix"), [
    ("default", False, (), ".jsonl"),
    ("default", False, ("crash:d0g0r0:at=0.3", "drop:WATERMARK:nth=2"), ".jsonl.gz"),
    ("warmup-stall", True, (), ".jsonl.zst"),
    ("radix-grid", True, (), ".jsonl"),
    ("lost-staging-rsp", True, (), ".jsonl"),
])
def test_the_sequential_replays_result(tmp_path: Path, name: str, defects_on: bool,
                                       faults: tuple[str, ...], suffix: str) -> None:
    path = _record(tmp_path / f"t{suffix}", name, defects_on, faults)
    want, seq_reader = _sequential(path)
    reader = TraceReader(path, lazy=True)
    replayer = Replayer(reader)
    assert forked.can_run(replayer)
    got = forked.run(replayer)  # raises Fallback if it could not vouch for the result
    assert _fields(got) == _fields(want) and want.same_outcome
    assert want.inputs > 50
    # what the reader learnt reaches the reader the caller holds
    assert (reader.outcome, reader.warnings, reader.truncated, reader.counts, reader.first_t,
            reader.last_t) == (seq_reader.outcome, seq_reader.warnings, seq_reader.truncated,
                               seq_reader.counts, seq_reader.first_t, seq_reader.last_t)
    if suffix == ".jsonl":
        assert sum(reader.counts.values()) == len(path.read_bytes().splitlines()) - 1


def _tamper(path: Path, rtype: str, key: str, delta: int) -> int:
    """Change ``key`` of the first ``rtype`` effect line; its line number."""
    lines = path.read_text().splitlines(keepends=True)
    for i, text in enumerate(lines[1:], start=2):
        d = json.loads(text)
        if d.get("dir") == "out" and d.get("type") == rtype:
            d[key] += delta
            lines[i - 1] = json.dumps(d, separators=(",", ":")) + "\n"
            path.write_text("".join(lines))
            return i
    raise AssertionError(rtype)


def test_a_divergence_is_reported_by_the_sequential_replay(tmp_path: Path) -> None:
    path = _record(tmp_path / "t.jsonl", "default", False)
    line = _tamper(path, "Allocated", "offset", 4096)
    with pytest.raises(forked.Fallback):
        forked.run(Replayer(TraceReader(path, lazy=True)))
    want, _ = _sequential(path)
    assert want.divergence is not None and want.divergence.line == line
    got = Replayer(TraceReader(path, lazy=True)).run()  # forked, then sequential
    assert _fields(got) == _fields(want)
    r = CliRunner().invoke(cli, ["replay", str(path)])
    assert r.exit_code == 1 and f"trace line {line}" in r.output


def test_a_bad_input_line_raises_the_sequential_error(tmp_path: Path) -> None:
    path = _record(tmp_path / "t.jsonl", "default", False)
    lines = path.read_text().splitlines(keepends=True)
    i = next(k for k, text in enumerate(lines) if '"dir":"in","type":"ScatterDone"' in text)
    d = json.loads(lines[i])
    d["chunk_idx"] = "zero"
    lines[i] = json.dumps(d, separators=(",", ":")) + "\n"
    path.write_text("".join(lines))
    with pytest.raises(TraceError) as want:
        _sequential(path)
    assert f"t.jsonl:{i + 1}" in str(want.value) and "chunk_idx" in str(want.value)
    with pytest.raises(TraceError) as got:
        forked.run(Replayer(TraceReader(path, lazy=True)))
    assert str(got.value) == str(want.value)
    r = CliRunner().invoke(cli, ["replay", str(path)])
    assert r.exit_code == 2 and str(want.value) in r.output


def test_a_cut_trace_warns_as_the_sequential_reader(tmp_path: Path) -> None:
    full = _record(tmp_path / "t.jsonl.gz", "default", False).read_bytes()
    compared = 0
    # A cut inside one input's effect lines leaves the sequential replay a divergence at that
    # input and the forked one a Fallback (the public entry then replays sequentially); where
    # the cut falls depends on the bytes before it, so try several and compare those that fall
    # between inputs.
    for num, den in ((2, 3), (3, 5), (7, 10), (3, 4), (4, 5)):
        path = tmp_path / f"cut{num}-{den}.jsonl.gz"
        path.write_bytes(full[: len(full) * num // den])
        want, seq_reader = _sequential(path)
        reader = TraceReader(path, lazy=True)
        try:
            got = forked.run(Replayer(reader))
        except forked.Fallback:
            assert want.divergence is not None
            continue
        compared += 1
        assert _fields(got) == _fields(want)
        assert reader.warnings == seq_reader.warnings and reader.truncated
        assert any("truncated" in w for w in reader.warnings)
    assert compared >= 1


def test_the_reader_is_reaped_when_the_replay_stops(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = _record(tmp_path / "t.jsonl", "default", False)
    pids: list[int] = []
    fork = os.fork

    def recording_fork() -> int:
        pid = fork()
        if pid:
            pids.append(pid)
        return pid

    def interrupted(*_: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(forked.os, "fork", recording_fork)
    monkeypatch.setattr(forked, "_replay", interrupted)
    with pytest.raises(KeyboardInterrupt):
        forked.run(Replayer(TraceReader(path, lazy=True)))
    assert len(pids) == 1
    with pytest.raises(ChildProcessError):
        os.waitpid(pids[0], os.WNOHANG)


def test_small_traces_replay_in_one_process(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = _record(tmp_path / "t.jsonl", "default", False)
    monkeypatch.setattr(forked, "MIN_BYTES", path.stat().st_size + 1)
    assert not forked.can_run(Replayer(TraceReader(path, lazy=True)))
    monkeypatch.setattr(forked, "MIN_BYTES", 0)
    assert forked.can_run(Replayer(TraceReader(path, lazy=True)))
    assert not forked.can_run(Replayer(TraceReader(path)))  # strict: read here
