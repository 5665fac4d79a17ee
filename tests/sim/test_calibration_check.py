"""A calibration's prediction error against the host's repeat spread, and where costs were
fitted against where a trace ran (``twin.calibrate.check``, ``twin.calibrate.host``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from twin.calibrate import calibrate, costs_from, write_costs
from twin.calibrate.check import (
    CHECKED,
    compare,
    deviation,
    prediction_error,
    repeat_spread,
    request_phases,
    simulated_phases,
)
from twin.calibrate.host import (
    costs_host,
    fitted_host,
    host_check,
    host_line,
    same_host,
    trace_host,
)
from twin.cli import cli
from twin.replay.timing import compare_with_simulation
from twin.trace.format import Trace, read_trace

HW = Path(__file__).resolve().parents[2] / "traces" / "hw-tp2-tp1.jsonl.gz"

HERE = {"hostname": "bench", "cpu": "Some CPU", "cores": 2,
        "probe": {"py_ops_per_s": 1.6e7, "memcpy_Bps": 1.4e10, "scatter_Bps": 2e10,
                  "wakeup_s": 3e-6}}
ELSEWHERE = {**HERE, "hostname": "laptop", "cores": 8}


def phases(**ms: float) -> dict[str, dict[str, float]]:
    """Per request id: kv_done_s in milliseconds."""
    return {rid: {"kv_done_s": v / 1e3} for rid, v in ms.items()}


# -- the arithmetic ------------------------------------------------------------------------------
def test_error_is_the_median_over_requests_of_each_requests_median_prediction() -> None:
    measured = phases(r0=10, r1=20, r2=40)
    # three seeds; request r0's prediction is its median 12 ms (ratio 1.2), r1's 20 (1.0),
    # r2's 30 (0.75): the per-request |ratio - 1| are 0.2, 0, 0.25, their median 0.2
    predicted = [phases(r0=12, r1=18, r2=30), phases(r0=11, r1=20, r2=50),
                 phases(r0=30, r1=22, r2=20)]
    err = prediction_error(predicted, measured, "kv_done_s")
    assert err is not None and err.requests == 3
    assert err.median_abs == pytest.approx(0.2)
    # the p50 of all nine per-request ratios, pooled as twin replay pools its seeds
    ratios = sorted([1.2, 1.1, 3.0, 0.9, 1.0, 1.1, 0.75, 1.25, 0.5])
    assert err.ratio_p50 == pytest.approx(ratios[4])


def test_spread_matches_requests_by_id_and_skips_what_one_side_lacks() -> None:
    measured = {**phases(a=10, b=20, c=30, d=40), "e": {"transfer_s": 0.01}}
    repeat = phases(b=25, a=9, d=40, z=99)  # c never completed in the repeat; z not in B
    spr = repeat_spread(repeat, measured, "kv_done_s")
    assert spr is not None and spr.requests == 3  # a, b, d
    assert spr.median_abs == pytest.approx(0.1)  # |0.9-1|, |1.25-1|, 0 -> 0.1
    assert spr.ratio_p50 == pytest.approx(1.0)
    assert repeat_spread(repeat, measured, "transfer_s") is None  # nothing to compare


def test_a_request_missing_from_some_simulations_uses_the_others() -> None:
    measured = phases(a=10, b=10)
    predicted = [phases(a=15, b=10), phases(b=10)]  # the second run wedged before a ended
    err = deviation(predicted, measured, "kv_done_s")
    assert err is not None and err.requests == 2
    assert err.median_abs == pytest.approx(0.25)  # a: 0.5, b: 0 -> median 0.25
    assert deviation([phases(c=1)], measured, "kv_done_s") is None
    assert deviation(predicted, {"a": {"kv_done_s": 0.0}}, "kv_done_s") is None


def test_compare_reads_error_against_spread_per_phase() -> None:
    measured = {r: {"ttft_s": v, "kv_done_s": v, "transfer_s": v / 2}
                for r, v in (("0", 0.010), ("1", 0.020), ("2", 0.030))}

    def scaled(k: float, xfer: float) -> dict[str, dict[str, float]]:
        return {r: {"ttft_s": v["ttft_s"] * k, "kv_done_s": v["kv_done_s"] * k,
                    "transfer_s": v["transfer_s"] * xfer} for r, v in measured.items()}
    out = compare([scaled(1.1, 1.5)], measured, scaled(0.9, 1.0), goal=1.1)
    kv = out["phases"]["kv_done_s"]
    assert kv["error"]["median_abs"] == pytest.approx(0.1)
    assert kv["spread"]["median_abs"] == pytest.approx(0.1)
    assert kv["ratio"] == pytest.approx(1.0) and kv["met"]
    xfer = out["phases"]["transfer_s"]  # the repeat agrees exactly: no spread to read against
    assert xfer["spread"]["median_abs"] == 0 and xfer["ratio"] is None and not xfer["met"]
    assert set(out["phases"]) == set(CHECKED) and out["goal"] == 1.1 and not out["met"]
    assert compare([scaled(1.1, 1.1)], measured, scaled(0.9, 0.9))["met"]
    assert not compare([scaled(1.2, 1.1)], measured, scaled(0.9, 0.9))["met"]  # 2x the spread


def test_request_phases_of_a_hardware_trace_and_of_its_simulation() -> None:
    trace = read_trace(HW)
    measured = request_phases(trace)
    assert len(measured) == 12 and set(measured) == {str(i) for i in range(12)}
    for v in measured.values():
        assert v["ttft_s"] == v["kv_done_s"] > v["transfer_s"] > 0  # no token streams
    costs = calibrate([trace], seeds=(0,), steps=(1,)).params
    runs = simulated_phases(trace, costs, seeds=(0, 1))
    assert len(runs) == 2 and all(set(run) == set(measured) for run in runs)
    # the simulator's TTFT is its first token: at or after all KV landed
    assert all(v["ttft_s"] >= v["kv_done_s"] > 0 for run in runs for v in run.values())
    out = compare(runs, measured, measured)  # a perfect repeat: nothing is within its spread
    assert not out["met"] and out["phases"]["kv_done_s"]["error"]["requests"] == 12


# -- the host ------------------------------------------------------------------------------------
def test_the_fitted_host_is_the_traces_common_one() -> None:
    other_probe = {**HERE, "probe": {**HERE["probe"], "scatter_Bps": 4e10}}
    host, why = fitted_host([HERE, other_probe, HERE])
    assert host is not None and why == "" and same_host(host, HERE)
    assert host["traces"] == 3 and host["probe"]["scatter_Bps"] == 2e10  # the median
    host, why = fitted_host([HERE, ELSEWHERE])
    assert host is None and "several hosts" in why and "laptop" in why
    host, why = fitted_host([HERE, None])
    assert host is None and "does not record its host" in why


def test_the_costs_file_carries_its_host(tmp_path: Path) -> None:
    trace = read_trace(HW)  # recorded before hosts were: the costs say so
    assert trace_host(trace) is None
    cal = calibrate([trace], seeds=(0,), steps=(1,))
    out = write_costs(cal, tmp_path / "costs.toml")
    assert "# host: unknown (a calibration trace does not record its host)" in out.read_text()
    assert costs_host(out) is None and costs_from(str(out)) is not None
    cal.host = dict(HERE)
    write_costs(cal, out)
    assert costs_host(out) == HERE
    params = costs_from(str(out))  # still a plain [sim] config
    assert params is not None
    assert params.forward_overhead_s == pytest.approx(cal.params.forward_overhead_s, rel=1e-5)
    assert costs_host(None) is None
    assert host_line(None, "why") == "# host: unknown (why)"


def test_host_check_says_when_costs_were_fitted_elsewhere() -> None:
    same = host_check(HERE, {**HERE, "traces": 2})
    assert same["same"] is True and "note" not in same and same["probe_ratio"] == 1.0
    other = host_check(HERE, ELSEWHERE)
    assert other["same"] is False
    assert "fitted on another host, laptop (Some CPU, 8 cores)" in other["note"]
    assert "bench (Some CPU, 2 cores)" in other["note"]
    assert "not a calibration check" in other["note"]
    unknown = host_check(HERE, None)
    assert unknown["same"] is None and "do not record the host" in unknown["note"]
    assert "not known to be a calibration check" in unknown["note"]
    untraced = host_check(None, HERE)
    assert untraced["same"] is None and "this trace does not record its host" in untraced["note"]
    slow = host_check({**HERE, "probe": {k: v / 2 for k, v in HERE["probe"].items()}}, HERE)
    assert slow["same"] and slow["probe_ratio"] == 0.5 and "another speed" in slow["note"]


def with_host(host: dict[str, Any] | None) -> Trace:
    """The stored hardware trace as if recorded on ``host``."""
    trace = copy.copy(read_trace(HW))
    run = dict(trace.config.extra.get("run", {}))
    if host is not None:
        run["host"] = host
    trace.config = trace.config.replace(extra={**trace.config.extra, "run": run})
    return trace


def test_replay_notes_costs_from_another_host(tmp_path: Path) -> None:
    trace = read_trace(HW)
    costs = calibrate([trace], seeds=(0,), steps=(1,)).params
    here = compare_with_simulation(with_host(HERE), costs, seeds=1, costs_host=HERE)
    assert here["host"]["same"] is True and "note" not in here["host"]
    away = compare_with_simulation(with_host(HERE), costs, seeds=1, costs_host=ELSEWHERE)
    assert "not a calibration check" in away["host"]["note"]
    assert "kv_done_s" in away  # the comparison itself still runs
    plain = compare_with_simulation(trace, None, seeds=1)  # the trace's own costs: no check
    assert "host" not in plain
    # the command: a costs file fitted elsewhere, the stored trace (no host record)
    cal = calibrate([trace], seeds=(0,), steps=(1,))
    cal.host = ELSEWHERE
    path = write_costs(cal, tmp_path / "costs.toml")
    r = CliRunner().invoke(cli, ["replay", str(HW), "--config", str(path)])
    assert r.exit_code == 0, r.output
    assert "note: the costs were fitted on laptop (Some CPU, 8 cores)" in r.output
    assert "this trace does not record its host" in r.output
    r = CliRunner().invoke(cli, ["replay", str(HW), "--config", str(path), "--json"])
    assert json.loads(r.output)["timing"]["host"]["costs"] == "laptop (Some CPU, 8 cores)"
