"""``twin explore`` and ``twin shrink``: determinism, findings and their repros, shrinking, the
long-running job's behaviour (resume, interrupt, a dying worker, bounded corpus) and bad flags."""

from __future__ import annotations

import json
import os
import runpy
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from twin.cli import cli
from twin.explore.campaign import Campaign, Finding
from twin.explore.oracles import judge, normalise, run_trial
from twin.explore.runner import explore
from twin.explore.shrink import shrink
from twin.explore.strategies import Strategies
from twin.explore.trial import Base, Deploy, Req, Trial
from twin.replay import replay_sim
from twin.runtime.params import SimParams
from twin.sim.scenarios import SCENARIOS

STALE = "stale-empty-ring-watermark"
GRID = "no-grid-alignment"  # found within a few runs: the determinism tests need findings
SC = SCENARIOS["stale-empty-ring"]
QUIET = SimParams(prefill_radix_tokens=0, wedge_window_s=5.0)


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def inline(job):  # type: ignore[no-untyped-def]
    from twin.advise.executors import InlineExecutor

    return InlineExecutor(job)  # type: ignore[arg-type]


def campaign(tmp: Path, defects: tuple[str, ...] = (STALE,), seed: int = 0,
             **kw: object) -> Campaign:
    return Campaign(Base(SC.config, QUIET, defects), tmp, seed=seed, shrink_runs=40,
                    **kw)  # type: ignore[arg-type]


def findings_of(c: Campaign) -> list[tuple[object, ...]]:
    return [(f.signature, f.first_run, f.shrunk.key(), f.hits) for f in c.findings.values()]


# -- oracles ----------------------------------------------------------------------------------
def test_judge_ranks_corruption_then_safety_then_wedge_then_unexplained_failure() -> None:
    wedge = ["wedge: 1 request(s) unfinished",
             "root: d0g0r0's watermark (0, 60) is stale [1 blocked item(s) of 1 room(s) wait "
             "on it]"]
    assert judge("corrupted", corruption_kinds=["overwrite", "misplaced"], safety=["x: y"],
                 diagnosis=wedge, failures={}, caused=False) == (
        "corrupted:misplaced+overwrite", "misplaced")
    assert judge("wedged", corruption_kinds=[], safety=[], diagnosis=wedge, failures={},
                 caused=True) == ("wedged", "RANK's watermark (N, N) is stale")
    assert judge("failed", corruption_kinds=[], safety=[], diagnosis=[],
                 failures={"decode timed out": 1}, caused=False) == (
        "failed-without-cause", "decode timed out")
    # A fault or a defect is a cause; so are SGLang's by-design failures.
    assert judge("failed", corruption_kinds=[], safety=[], diagnosis=[],
                 failures={"decode timed out": 1}, caused=True) is None
    assert judge("failed", corruption_kinds=[], safety=[], diagnosis=[],
                 failures={"staging allocation oversized: chunk exceeds the ring": 1},
                 caused=False) is None
    assert judge("completed", corruption_kinds=[], safety=[], diagnosis=[], failures={},
                 caused=False) is None


def test_normalise_drops_ranks_numbers_and_the_work_count() -> None:
    a = normalise("root: d0g0r1's watermark (3, 4096) is stale [6 blocked item(s) of 2 rooms]")
    b = normalise("root: d1g0r0's watermark (0, 60) is stale [1 blocked item(s) of 1 room]")
    assert a == b == "RANK's watermark (N, N) is stale"


def test_run_trial_finds_the_stale_watermark_wedge_and_needs_the_defect() -> None:
    trial = Trial(requests=(Req(0.0, 1536), Req(0.5, 1792), Req(1.0, 512)))
    on = run_trial(Base(SC.config, QUIET, (STALE,)), trial)
    assert on.status == "wedged" and on.signature is not None
    assert "stale" in on.signature[1]
    assert "tr:decode:Waiting>ALL_RANKS_SUCCESS" in on.coverage
    # every dequeue goes through the table, the one that leaves a room Transferring included
    assert {"tr:prefill:Bootstrapping>DEQUEUE", "tr:prefill:Transferring>DEQUEUE"} <= on.coverage
    assert {"al:alloc-wrap", "al:free-to-empty", "al:stale-watermark"} <= on.coverage
    off = run_trial(Base(SC.config, QUIET, ()), trial)
    assert (off.status, off.signature) == ("completed", None)


def test_a_failure_with_no_fault_and_no_defect_is_a_finding_but_not_with_a_fault() -> None:
    base = Base(SC.config, QUIET, ())
    trial = Trial(requests=(Req(0.0, 512),), faults=("fail-transfer:nth=1",))
    assert run_trial(base, trial).status == "failed"
    assert run_trial(base, trial).signature is None  # the fault explains it


# -- shrinking --------------------------------------------------------------------------------
def test_shrink_keeps_the_signature_and_drops_what_is_not_needed() -> None:
    base = Base(SC.config, QUIET, (STALE,))
    big = Trial(Deploy(page_size=16, ring_bytes=10 << 20), (Req(0.0, 1536), Req(0.5, 1792), Req(1.0, 512),
                                      Req(1.2, 300, prefill_prefix=100)),
                ("delay:CHUNK_READY:nth=2:ms=5",), seed=7)
    sig = run_trial(base, big).signature
    assert sig is not None and "stale" in sig[1]
    res = shrink(base, big, sig, max_runs=200)
    assert res.result.signature == sig
    small = res.trial
    assert len(small.requests) == 2 and small.faults == () and small.seed == 0
    assert small.deploy.fields() <= 1
    assert small.size() < big.size()
    # Every single request is needed: dropping either loses the wedge.
    for i in range(2):
        rest = small.with_(requests=small.requests[:i] + small.requests[i + 1:])
        assert run_trial(base, rest).signature != sig


# -- campaigns --------------------------------------------------------------------------------
def test_same_seed_and_runs_give_the_same_findings(tmp_path: Path) -> None:
    a = campaign(tmp_path / "a", (GRID,))
    explore(a, inline, runs=24)
    b = campaign(tmp_path / "b", (GRID,))
    explore(b, inline, runs=24)
    assert findings_of(a) == findings_of(b) and a.findings
    assert a.coverage == b.coverage
    assert [t.key() for t, _ in a.corpus] == [t.key() for t, _ in b.corpus]
    c = campaign(tmp_path / "c", (GRID,), seed=1)
    explore(c, inline, runs=24)
    assert [t.key() for t, _ in c.corpus] != [t.key() for t, _ in a.corpus]


def test_resume_continues_to_the_same_place(tmp_path: Path) -> None:
    whole = campaign(tmp_path / "whole", (GRID,))
    explore(whole, inline, runs=24)
    part = campaign(tmp_path / "part", (GRID,))
    explore(part, inline, runs=8)
    part.save()
    again = Campaign.resume(tmp_path / "part")
    assert again.runs == 8 and again.coverage == part.coverage
    explore(again, inline, runs=24)
    assert findings_of(again) == findings_of(whole)
    assert again.coverage == whole.coverage


def test_corpus_is_capped(tmp_path: Path) -> None:
    c = campaign(tmp_path, corpus_cap=3)
    explore(c, inline, runs=24)
    assert len(c.corpus) <= 3
    assert len(c.coverage) > 3  # more was new than the corpus keeps


def test_exit_status_ranks_findings() -> None:
    c = Campaign(Base(SC.config, QUIET), Path("unused"))
    assert c.exit_status() == 0

    def add(kind: str) -> None:
        t = Trial(requests=(Req(0.0, 16),))
        c.findings[(kind, "r")] = Finding((kind, "r"), "x", 1, 0.0, t, t)
    add("failed-without-cause")
    assert c.exit_status() == 5
    add("wedged")
    assert c.exit_status() == 3
    add("corrupted:overwrite")
    assert c.exit_status() == 4
    add("error")
    assert c.exit_status() == 1


def test_no_strategy_means_the_users_own_trial(tmp_path: Path) -> None:
    user = (Req(0.0, 1536), Req(0.5, 1792), Req(1.0, 512))
    c = campaign(tmp_path, strategies=Strategies(False, False, False, False), user_requests=user)
    trials = [t for _, t in c.make_round(4)]
    assert all(t == Trial(requests=user) for t in trials)


# -- the command ------------------------------------------------------------------------------
def test_explore_writes_findings_that_replay_and_reproduce(tmp_path: Path) -> None:
    out = tmp_path / "camp"
    r = invoke("explore", "--scenario", "stale-empty-ring", "--defect", STALE, "--no-faults",
               "--runs", "24", "--seed", "1", "--shrink-runs", "60", "--out", str(out), "--json")
    data = json.loads(r.output)
    kinds = {(f["kind"], f["root"]): f for f in data["findings"]}
    stale = [f for (k, root), f in kinds.items() if k == "wedged" and "stale" in root]
    assert stale, sorted(kinds)
    assert r.exit_code == data["exit_code"] == 3
    assert stale[0]["needs_defects"] == [STALE]
    assert stale[0]["shrunk_size"]["requests"] == 2
    folder = out / stale[0]["dir"]
    # The trace replays to the same verdict.
    assert replay_sim(str(folder / "repro.jsonl.gz")).status == "wedged"
    # The command line reproduces it where `twin sim` can say the trial (not prefix hits).
    checks = json.loads((folder / "checks.json").read_text())
    shrunk = Trial.from_json(stale[0]["shrunk"])
    if shrunk.overrides():
        assert not (folder / "command.txt").exists() and "prefix" in checks["command"]
    else:
        assert_command_reproduces(folder, 3, "stale")
    # The generated test passes, and the story tells what pinned what.
    runpy.run_path(str(folder / "test_repro.py"))["test_finding_reproduces"]()
    story = (folder / "story.md").read_text()
    assert "Allocated" in story and "stale" in story and "needed: " + STALE in story
    md = (out / "findings.md").read_text()
    assert "stale" in md and "| run " in md
    assert (out / "state.json").is_file()


def assert_command_reproduces(folder: Path, code: int, word: str) -> None:
    args = shlex.split((folder / "command.txt").read_text())
    assert args[:2] == ["twin", "sim"]
    again = invoke(*args[1:], "--json")
    assert again.exit_code == code
    assert any(word in line for line in json.loads(again.output)["diagnosis"])


@pytest.mark.parametrize("args, flag", [
    (["--runs", "0", "--out", "X"], "--runs"),
    (["--budget", "-1", "--out", "X"], "--budget"),
    (["--workers", "0", "--out", "X"], "--workers"),
    (["--runs", "1"], "--out"),
    (["--address", "auto", "--out", "X"], "--address"),
    (["--resume", "nowhere"], "--resume"),
    (["--defect", "no-such", "--out", "X"], "no-such"),
    (["--prefill-args", "--tp-size x", "--out", "X"], "tp-size"),
])
def test_bad_flags_exit_2_naming_the_flag(args: list[str], flag: str, tmp_path: Path) -> None:
    args = [str(tmp_path / "X") if a == "X" else a for a in args]
    r = CliRunner().invoke(cli, ["explore", *args])
    assert r.exit_code == 2, r.output
    assert flag in r.output
    assert "Traceback" not in r.output


def test_out_holding_a_campaign_asks_for_resume(tmp_path: Path) -> None:
    out = tmp_path / "c"
    assert invoke("explore", "--no-faults", "--runs", "1", "--out", str(out)).exit_code in (
        0, 3, 4, 5)
    r = CliRunner().invoke(cli, ["explore", "--runs", "1", "--out", str(out)])
    assert r.exit_code == 2 and "--resume" in r.output


def test_shrink_command_shrinks_a_scenario_trace(tmp_path: Path) -> None:
    trace = tmp_path / "stall.jsonl.gz"
    r = invoke("sim", "--scenario", "stale-empty-ring", "--scenario-defects", "--trace-out",
               str(trace), "--json")
    assert r.exit_code == 3
    r = invoke("shrink", str(trace), "-o", str(tmp_path / "s"), "--json")
    data = json.loads(r.output)
    assert r.exit_code == 3
    assert data["kind"] == "wedged" and "stale" in data["root"]
    assert data["before"]["requests"] == 3 and data["after"]["requests"] == 2
    assert data["checks"]["replay"] == "wedged"
    assert data["sglang_exposure"]["label"] == "not exposed"  # it needs the defect
    assert "stale-empty-ring-watermark" in data["sglang_exposure"]["detail"]
    assert_command_reproduces(Path(data["dir"]), 3, "stale")
    clean = tmp_path / "clean.jsonl.gz"
    invoke("sim", "--scenario", "stale-empty-ring", "--trace-out", str(clean), "--json")
    r = CliRunner().invoke(cli, ["shrink", str(clean)])
    assert r.exit_code == 2 and "nothing to shrink" in r.output


def test_sigterm_writes_findings_so_far_and_resume_continues(tmp_path: Path) -> None:
    out = tmp_path / "long"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "twin", "explore", "--scenario", "stale-empty-ring", "--defect",
         STALE, "--budget", "120", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 60
    state = out / "state.json"
    while time.time() < deadline and not (state.exists()
                                          and json.loads(state.read_text())["runs"] >= 8):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert "interrupted" in err
    data = json.loads((out / "findings.json").read_text())
    assert data["status"] == "interrupted" and data["runs"] >= 8
    runs = data["runs"]
    r = invoke("explore", "--resume", str(out), "--runs", str(runs + 8), "--json")
    again = json.loads(r.output)
    assert again["runs"] == runs + 8 and again["status"] == "completed"


def test_a_dying_worker_is_named_and_its_trials_redone(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from twin.advise.executors import LocalExecutor

    monkeypatch.setenv("TWIN_EXPLORE_CRASH_ONCE", f"{tmp_path / 'crashed'}:3")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    pooled = campaign(tmp_path / "pool")
    report = explore(pooled, lambda job: LocalExecutor(job, 2),  # type: ignore[arg-type]
                     runs=16)
    assert (tmp_path / "crashed").exists()
    assert report.worker_deaths and "exit code 17" in report.worker_deaths[0]
    assert "#3" in report.worker_deaths[0]
    monkeypatch.delenv("TWIN_EXPLORE_CRASH_ONCE")
    alone = campaign(tmp_path / "inline")
    explore(alone, inline, runs=16)
    assert findings_of(pooled) == findings_of(alone)
    assert pooled.coverage == alone.coverage


def test_corruption_root_names_the_first_violation_without_numbers() -> None:
    sig = judge("corrupted", corruption_kinds=["incomplete"], safety=[], diagnosis=[],
                failures={}, caused=False,
                corruption=["incomplete: d0g0r1 room 0: completed with 16 of 17 pages not "
                            "landed (first: page 0)"])
    assert sig == ("corrupted:incomplete",
                   "incomplete: completed with N of N pages not landed (first: page N)")


def test_a_wedge_the_waiting_timeout_settles_is_no_finding_when_caused() -> None:
    diag = ["wedge: 1 request(s) unfinished",
            "root: prefill dropped decode's metadata (room already failed): those rooms will "
            "get no transfer status, and decode fails each at its waiting timeout (X) [1]"]
    assert judge("wedged", corruption_kinds=[], safety=[], diagnosis=diag, failures={},
                 caused=True) is None
    sig = judge("wedged", corruption_kinds=[], safety=[], diagnosis=diag, failures={},
                caused=False)
    assert sig is not None and sig[0] == "failed-without-cause"


def test_pct_finds_the_overtaken_staging_req_on_the_loopback_cluster() -> None:
    """Today's protocol: a STAGING_REQ overtaken on its own socket arrives after its chunk was
    scattered and gets an allocation nothing scatters. A depth-1 PCT schedule (one channel
    always first) finds it; the same requests in the simulator's ordering do not."""
    base = Base(SC.config, QUIET, ())
    reqs = (Req(0.0, 1536), Req(0.5, 1792), Req(1.0, 512))
    found = run_trial(base, Trial(requests=reqs, schedule="pct:1:1"))
    assert found.signature is not None and found.signature[0] == "wedged"
    assert "STAGING_REQ" in found.signature[1] and "overtaken" in found.signature[1]
    assert run_trial(base, Trial(requests=reqs)).signature is None
    # Deterministic: the same schedule, the same run.
    again = run_trial(base, Trial(requests=reqs, schedule="pct:1:1"))
    assert (again.signature, again.coverage) == (found.signature, found.coverage)
    # The fix for it (drop a late STAGING_REQ) removes it.
    fixed = Base(SC.config.replace(fixes=("drop-late-staging-req",)), QUIET, ())
    assert run_trial(fixed, Trial(requests=reqs, schedule="pct:1:1")).signature is None


def test_explore_doc_commands(tmp_path: Path) -> None:
    """The commands docs/explore.md shows run and end with the exit status they claim."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_docs import ROOT, commands, run

    cmds = commands(ROOT / "docs" / "explore.md")
    assert len(cmds) >= 5 and {a[0] for a, _, _ in cmds} >= {"explore", "shrink"}
    for argv, want, line in cmds:
        code, output = run(argv, tmp_path)
        assert code == want, (line, code, output[-2000:])
        assert "Traceback" not in output, line
    assert (tmp_path / "stale" / "findings.md").is_file()
    assert "stale" in (tmp_path / "stale" / "findings.md").read_text()
