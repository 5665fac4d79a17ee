"""Replaying simulator traces: same outcome, first divergence of a tampered trace, and a trace
cut short by a killed run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from twin.cli import cli
from twin.core.defects import Defects
from twin.replay import replay_sim
from twin.sim.runner import run_sim
from twin.sim.scenarios import SCENARIOS
from twin.trace.format import read_trace
from twin.trace.inspect import summary

TWIN = Path(sys.executable).parent / "twin"


def _record(name: str, path: Path, defects_on: bool) -> Path:
    sc = SCENARIOS[name]
    names = sc.base_defects + (sc.defects if defects_on else ())
    run_sim(sc.config, sc.workload(), defects=Defects.of(names), faults=sc.fault_specs(),
            params=sc.params, request_overrides=sc.overrides,
            max_concurrency=sc.max_concurrency, trace_out=path)
    return path


@pytest.mark.parametrize(("name", "defects_on", "status", "code"), [
    ("default", False, "completed", 0),
    ("warmup-stall", True, "wedged", 3),
    ("release-room", True, "wedged", 3),
    ("radix-grid", True, "corrupted", 4),
    ("completion-race", True, "corrupted", 4),
])
def test_replay_reaches_the_recorded_outcome(tmp_path: Path, name: str, defects_on: bool,
                                             status: str, code: int) -> None:
    trace = read_trace(_record(name, tmp_path / "t.jsonl", defects_on))
    assert trace.complete and trace.status == status
    result = replay_sim(trace)
    assert result.divergence is None
    assert result.status == status and result.same_outcome
    assert result.exit_code == code
    assert (result.completed, result.failed) == (trace.outcome["completed"],
                                                 trace.outcome["failed"])
    assert result.inputs == sum(r.dir == "in" for r in trace.events)
    if status == "wedged":
        assert result.diagnosis and any("room" in x for x in result.diagnosis)
    if status == "corrupted":
        assert result.corruption == trace.outcome["corruption"][:len(result.corruption)]


@pytest.mark.parametrize("defects_on", [True, False], ids=["defects", "fixed"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_scenario_replays_to_its_recorded_outcome(tmp_path: Path, name: str,
                                                        defects_on: bool) -> None:
    """Diagnosis included: a root's injected faults (from the ``FaultInjected`` records) and
    the inputs the ranks dropped (from their ``Dropped`` effects) are named as the run named
    them."""
    path = _record(name, tmp_path / "t.jsonl", defects_on)
    result = replay_sim(path)
    assert result.divergence is None and result.same_outcome, (result.status,
                                                               result.diagnosis[:3])
    assert result.recorded is not None and result.status == result.recorded["status"]


def _tamper_first(path: Path, out: Path, rtype: str, key: str, delta: int) -> tuple[int, int]:
    """Change ``key`` of the first ``rtype`` effect line; returns (line number, old value)."""
    lines = path.read_text().splitlines(keepends=True)
    for i, text in enumerate(lines[1:], start=2):
        d = json.loads(text)
        if d.get("dir") == "out" and d.get("type") == rtype:
            old = d[key]
            d[key] = old + delta
            lines[i - 1] = json.dumps(d, separators=(",", ":")) + "\n"
            out.write_text("".join(lines))
            return i, old
    raise AssertionError(f"no {rtype} effect in {path}")


def test_tampered_trace_stops_at_the_first_divergence(tmp_path: Path) -> None:
    clean = _record("default", tmp_path / "clean.jsonl", False)
    bad = tmp_path / "bad.jsonl"
    line, old = _tamper_first(clean, bad, "Allocated", "offset", 4096)
    trace = read_trace(bad)
    result = replay_sim(trace)
    div = result.divergence
    assert div is not None
    assert div.line == line
    assert f"offset={old + 4096}" in div.expected and "Allocated" in div.expected
    assert f"offset={old}" in div.got and "Allocated" in div.got
    assert not result.same_outcome and result.exit_code == 1
    # It stopped there: far fewer inputs than the whole trace holds.
    assert result.inputs < sum(r.dir == "in" for r in trace.events)
    text = str(div)
    assert f"trace line {line}" in text and "recorded:" in text and "replayed:" in text
    r = CliRunner().invoke(cli, ["replay", str(bad)])
    assert r.exit_code == 1 and f"trace line {line}" in r.output


def test_trace_diff_finds_the_tampered_line(tmp_path: Path) -> None:
    clean = _record("default", tmp_path / "clean.jsonl", False)
    bad = tmp_path / "bad.jsonl"
    line, _ = _tamper_first(clean, bad, "Allocated", "offset", 4096)
    r = CliRunner().invoke(cli, ["trace", "diff", str(clean), str(bad)])
    assert r.exit_code == 1 and str(line) in r.output


def test_missing_effect_is_a_divergence(tmp_path: Path) -> None:
    clean = _record("default", tmp_path / "clean.jsonl", False)
    lines = clean.read_text().splitlines(keepends=True)
    # Drop the first Freed effect and renumber seq so the file stays well-formed.
    out, seq, dropped = [lines[0]], 0, None
    for i, text in enumerate(lines[1:], start=2):
        d = json.loads(text)
        if dropped is None and d.get("dir") == "out" and d["type"] == "Freed":
            dropped = i
            continue
        d["seq"] = seq
        seq += 1
        out.append(json.dumps(d, separators=(",", ":")) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(out))
    result = replay_sim(read_trace(bad))
    assert result.divergence is not None and "Freed" in result.divergence.got


def test_killed_run_leaves_a_readable_trace(tmp_path: Path) -> None:
    trace = tmp_path / "killed.jsonl.gz"  # gzip: the cut also ends a compressed stream
    proc = subprocess.Popen([str(TWIN), "sim", "--json", "--trace-out", str(trace),
                             "--workload", "poisson:n=40000,rate=200,input=2048,output=8"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        # Wait until the run has flushed some events, then give it ~1.5 s more.
        while time.monotonic() < deadline and (not trace.exists()
                                               or trace.stat().st_size < 20_000):
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.05)
        time.sleep(1.5)
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    t = read_trace(trace)
    assert t.outcome is None and not t.complete and t.status == "incomplete"
    assert any("incomplete" in w for w in t.warnings), t.warnings
    assert len(t.events) > 1000
    assert summary(t).strip()
    r = CliRunner().invoke(cli, ["trace", "summary", str(trace)])
    assert r.exit_code == 0 and "warning:" in r.stderr and r.stdout.strip()


def test_a_run_stopped_at_until_replays_without_a_wedge_diagnosis(tmp_path: Path) -> None:
    """A run stopped with rooms in flight (``--until``, or interrupted) is not a wedge: the
    replay names the rooms in flight instead of diagnosing them."""
    path = tmp_path / "until.jsonl"
    r = CliRunner().invoke(cli, ["sim", "--workload",
                                 "poisson:n=40,rate=20,input=6000,output=64,seed=2",
                                 "--until", "0.5", "--trace-out", str(path)])
    assert r.exit_code == 0, r.output
    result = replay_sim(path)
    assert result.status == "until" and result.same_outcome
    assert result.diagnosis == []
    assert result.ended_early is not None
    assert "records a run that was stopped (until)" in result.ended_early
    assert "room(s) in flight" in result.ended_early
    out = CliRunner().invoke(cli, ["replay", str(path)]).output
    assert "\nwedge" not in out and "input       the trace records a run that was stopped" in out
