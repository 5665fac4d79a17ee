"""The host a hardware run ran on: its probe (a real forked process), its record in the trace,
and a calibration on it that ``twin replay`` recognises as this host's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from twin.calibrate.host import costs_host, same_host, trace_host
from twin.cli import cli
from twin.hw.probe import IDENTITY, fingerprint, probe
from twin.trace.format import read_trace

pytestmark = pytest.mark.hw

SMALL = Path(__file__).resolve().parents[2] / "examples" / "tp2-tp1-small.toml"


def test_the_probe_measures_this_host() -> None:
    rates = probe()
    assert set(rates) == {"py_ops_per_s", "memcpy_Bps", "scatter_Bps", "wakeup_s"}
    assert all(v > 0 for v in rates.values())
    assert rates["wakeup_s"] < 0.1  # a round trip to the forked echo process, which exited
    host = fingerprint()
    assert set(host) == set(IDENTITY) and host["cores"] >= 1 and host["hostname"]


def test_a_recorded_run_names_its_host_and_a_fit_on_it_checks_as_this_host(
        tmp_path: Path) -> None:
    trace_path = tmp_path / "hw.jsonl.gz"
    runner = CliRunner()
    r = runner.invoke(cli, ["hw", "--config", str(SMALL), "--workload",
                            "poisson:n=4,rate=20,input=300,output=1,seed=1", "--fix",
                            "drop-late-staging-req", "--trace-out", str(trace_path)])
    assert r.exit_code == 0, r.output
    host = trace_host(read_trace(trace_path))
    assert host is not None and same_host(host, fingerprint())
    assert host["probe"]["scatter_Bps"] > 0 and host["probe_s"] < 5
    costs = tmp_path / "costs.toml"
    r = runner.invoke(cli, ["calibrate", str(trace_path), "-o", str(costs), "--seeds", "1"])
    assert r.exit_code == 0, r.output
    assert f"fitted on {host['hostname']}" in r.output
    fitted = costs_host(costs)
    assert fitted is not None and same_host(fitted, host) and fitted["traces"] == 1
    assert fitted["probe"] == host["probe"]
    r = runner.invoke(cli, ["replay", str(trace_path), "--config", str(costs), "--json"])
    assert r.exit_code == 0, r.output
    checked = json.loads(r.output)["timing"]["host"]
    assert checked["same"] is True and checked["probe_ratio"] == 1.0 and "note" not in checked
