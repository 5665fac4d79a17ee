"""``twin sweep``, ``twin advise`` and ``twin plot`` on tiny workloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from twin.advise.results import read_results
from twin.cli import cli

RUN = ["--scenario", "default", "--workload",
       "shared-prefix:groups=2,per_group=3,system=1024,question=256,output=8,rate=20,seed=3"]
TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_dry_run_lists_the_points() -> None:
    r = invoke("sweep", *RUN, "--vary", "ring_mb=8,16", "--vary", "cps=512:1024:x2",
               "--seeds", "0,1", "-o", "unused.csv", "--dry-run")
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[-1] == "8 point(s)"
    assert "cps=512 ring_mb=8 seed=0" in r.output


@pytest.mark.parametrize("args, fragment", [
    (["--vary", "nonsense=1"], "axis 'nonsense': unknown"),
    (["--vary", "ring_mb=x"], "not a valid int"),
    (["--vary", "ring_mb=8", "--seeds", "a"], "seeds 'a'"),
    (["--vary", "ring_mb=8", "--workers", "0"], "--workers must be at least 1"),
    (["--vary", "ring_mb=8", "--address", "auto"], "--address needs --executor ray"),
])
def test_bad_sweep_input_exits_2(tmp_path: Path, args: list[str], fragment: str) -> None:
    r = invoke("sweep", *RUN, *args, "-o", str(tmp_path / "r.csv"))
    assert r.exit_code == 2 and fragment in r.output, r.output


def test_sweep_resumes_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "r.csv"
    args = ["sweep", *RUN, "--vary", "ring_mb=8,16", "--vary", "cps=512,1024", "-o", str(out),
            "--workers", "1"]
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    assert "4 point(s): 4 run now (4 clean), 0 already in" in r.output
    assert "\ncore        pure (TWIN_PURE_PYTHON is set)\n" in r.output  # the suite's path
    assert r.output.splitlines()[0].split() == ["ring_mb", "cps", "seed", "outcome", "TTFT",
                                                "p99", "deferrals/req"]
    r = invoke(*args[:-2], "--seeds", "0,1", "--workers", "1", "--json")
    report = json.loads(r.output)
    assert (report["points"], report["skipped"], report["ran"]) == (8, 4, 4)
    assert report["core"] == "pure"
    rows = read_results(out)
    assert len(rows) == 8 and {r["x.chunked_prefill_size"] for r in rows} == {512, 1024}
    r = invoke("sweep", *RUN, "--vary", "cps=512", "-o", str(out))
    assert r.exit_code == 2 and "other columns" in r.output
    r = invoke("plot", str(out), "-o", str(tmp_path / "plots"))
    assert r.exit_code == 0, r.output
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    # the simulator reports TPOT since it decodes, so the TPOT CDF is drawn too
    assert names == ["cdf_tpot.png", "cdf_ttft.png", "heatmap_deferral_wait.png",
                     "heatmap_ttft_p99.png", "heatmap_verdict.png", "pareto_ring_ttft.png"]
    r = invoke("plot", str(out), "-o", str(tmp_path / "p2"), "--x", "nonsense")
    assert r.exit_code == 2 and "not a swept field" in r.output


def test_advise_prints_a_table_and_a_recommendation(tmp_path: Path) -> None:
    out = tmp_path / "a.csv"
    args = ["advise", *RUN, "--cps", "512,1024", "--ttft", "0.5", "--seeds", "0",
            "--ring-max", "16", "--tolerance", "0.3", "--workers", "1", "-o", str(out)]
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    assert "| chunked_prefill_size |" in r.output and "Recommendation: " in r.output
    assert "SGLANG_DISAGG_STAGING_POOL_SIZE_MB=" in r.output
    assert "\ncore        pure (TWIN_PURE_PYTHON is set)\n" in r.output
    r = invoke(*args, "--json")
    advice = json.loads(r.output)
    assert advice["runs"] == 0 and advice["reused_runs"] > 0  # every probe came from the file
    assert advice["core"] == "pure"
    assert advice["recommendation"]["chunked_prefill_size"] in (512, 1024)
    r = invoke("plot", str(out), "-o", str(tmp_path / "plots"))
    assert r.exit_code == 0 and "pareto_ring_ttft.png" in r.output


def test_advise_without_a_passing_candidate_exits_1(tmp_path: Path) -> None:
    r = invoke("advise", *RUN, "--cps", "512", "--ttft", "0.0001", "--seeds", "0",
               "--ring-max", "8", "--workers", "1", "--capacity", "none")
    assert r.exit_code == 1, r.output
    assert "No recommendation: no candidate runs the workload cleanly" in r.output


@pytest.mark.parametrize("args, fragment", [
    (["--cps", "500"], "not a multiple of page_size"),
    (["--cps", "x"], "expected integers"),
    (["--ttft", "0"], "--ttft must be positive"),
    (["--tolerance", "1.5"], "--tolerance"),
    (["--ring-min", "10", "--ring-max", "5"], "--ring-min"),
])
def test_bad_advise_input_exits_2(args: list[str], fragment: str) -> None:
    r = invoke("advise", *RUN, *args)
    assert r.exit_code == 2 and fragment in r.output, r.output


@pytest.mark.skipif(not (TRACES / "mooncake" / "synthetic_trace.jsonl").exists(),
                    reason="production traces not present")
def test_sweep_over_a_production_trace_cut(tmp_path: Path) -> None:
    out = tmp_path / "m.csv"
    r = invoke("sweep", "--workload", str(TRACES / "mooncake" / "synthetic_trace.jsonl"),
               "--first-n", "30", "--prefill-args", "--tp-size 4", "--decode-args",
               "--tp-size 2", "--vary", "ring_mb=256,1024", "--vary", "rate_scale=1,4",
               "-o", str(out), "--workers", "1")
    assert r.exit_code == 0, r.output
    rows = read_results(out)
    assert {r["outcome"] for r in rows} <= {"clean", "failed"} and len(rows) == 4
    small = [r for r in rows if r["x.staging_pool_size_mb"] == 256]
    assert all(r["outcome"] == "failed" for r in small)  # a 8192-token chunk needs 512 MiB
