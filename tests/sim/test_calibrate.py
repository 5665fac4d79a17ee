"""Calibration: measuring a hardware-mode trace, fitting the [sim] costs, replaying with them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from twin.calibrate import calibrate, costs_from, direct_params, measure, write_costs
from twin.cli import cli
from twin.trace.format import read_trace

TRACES = Path(__file__).resolve().parents[2] / "traces"
HW = TRACES / "hw-tp2-tp1.jsonl.gz"


def test_measure_reads_every_part_of_the_cost_model() -> None:
    m = measure(read_trace(HW))
    s = m.summary()
    assert len(m.phases) == 12
    assert s["frames_s"]["n"] > 100  # every SGLang frame matched send -> arrival
    assert s["write_s"]["n"] == 72 and s["scatter_s"]["n"] == 36
    assert s["bootstrap_s"]["n"] == 12 and s["forward_gap_s"]["n"] > 0
    assert s["rank_skew_s"]["n"] > 0
    assert 0 < s["frames_s"]["p10"] <= s["frames_s"]["p50"] <= s["frames_s"]["p90"]


def test_direct_parameters_describe_the_hardware_mode() -> None:
    p = direct_params([measure(read_trace(HW))])
    # The hardware mode forwards one request at a time and decodes nothing.
    assert p.prefill_requests_per_forward == 1
    assert p.decode_step_s == p.decode_s_per_seq == p.decode_s_per_ctx_token == 0
    assert p.prefill_s_per_token == p.prefill_s_per_token_ctx == 0
    assert 0 < p.zmq_latency_s < p.forward_overhead_s < 0.1
    assert p.gather_bandwidth_Bps > 0 and p.scatter_bandwidth_Bps > 0


def test_calibration_reproduces_its_own_trace(tmp_path: Path) -> None:
    cal = calibrate([read_trace(HW)], seeds=(0,), steps=(1,))  # one coarse step size: fast
    (fit,) = cal.fit
    for phase in ("kv_done_s", "transfer_s"):
        assert 0.7 <= fit["ratio_p50"][phase] <= 1.5, fit
    assert fit["simulated_p50"]["mismatch"] == 0.0  # no fitted run wedges where it completed
    out = write_costs(cal, tmp_path / "costs.toml")
    text = out.read_text()
    assert text.startswith("# Cost model fitted by `twin calibrate`") and "[sim]" in text
    params = costs_from(str(out))
    assert params is not None
    assert params.forward_overhead_s == pytest.approx(cal.params.forward_overhead_s, rel=1e-5)


def test_the_prior_holds_the_fit_to_what_the_trace_measured() -> None:
    trace = read_trace(HW)
    free = calibrate([trace], seeds=(0,), steps=(1,), prior=0.0)
    held = calibrate([trace], seeds=(0,), steps=(1,), prior=1e3)
    assert any(v != 1.0 for v in free.scales.values()), free.scales  # the fit moves freely
    assert set(held.scales.values()) == {1.0}  # any move costs more than it gains
    assert held.params == held.direct


def test_the_timing_comparison_says_when_the_host_ran_at_another_speed() -> None:
    from twin.replay.timing import host_speed
    from twin.runtime.params import SimParams

    m = measure(read_trace(HW))
    fitted = direct_params([m])
    same = host_speed(m, fitted)
    assert same is not None and same["cost_ratio"] == pytest.approx(1.0, abs=1e-3)
    assert "note" not in same
    # costs from a host twice as fast: half the fixed cost, twice the bandwidth
    slow = host_speed(m, fitted.replace(scatter_bandwidth_Bps=fitted.scatter_bandwidth_Bps * 2,
                                        kernel_launch_s=fitted.kernel_launch_s / 2))
    assert slow is not None and slow["cost_ratio"] == pytest.approx(2.0, rel=1e-3)
    assert "another speed" in slow["note"]
    assert host_speed(m, SimParams()) is None  # not calibrated costs: nothing to compare


def test_calibrate_and_replay_commands(tmp_path: Path) -> None:
    runner = CliRunner()
    costs = tmp_path / "costs.toml"
    r = runner.invoke(cli, ["calibrate", str(HW), "-o", str(costs), "--seeds", "1", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    assert report["out"] == str(costs) and report["params"]["prefill_requests_per_forward"] == 1
    r = runner.invoke(cli, ["replay", str(HW), "--config", str(costs), "--json"])
    assert r.exit_code == 0, r.output
    timing = json.loads(r.output)["timing"]
    assert timing["rooms_compared"] == 12
    assert 0.5 < timing["kv_done_s"]["ratio_p50"] < 2.0
    sim_trace = TRACES / "clean-default.jsonl.gz"
    r = runner.invoke(cli, ["calibrate", str(sim_trace), "-o", str(costs)])
    assert r.exit_code == 2 and "hardware-mode traces" in r.output
    bad = tmp_path / "bad.toml"
    bad.write_text("[sim]\nnic_bandwidth_Bps = -1\n")
    r = runner.invoke(cli, ["replay", str(HW), "--config", str(bad)])
    assert r.exit_code == 2 and "sim.nic_bandwidth_Bps" in r.output


def test_timing_comparison_pools_seeds_and_names_a_wedge_the_hardware_did_not_have() -> None:
    """With frame and command jitter of 20 ms the late-STAGING_REQ race opens in simulation;
    the recorded hardware run completed, so the comparison says so and names the root."""
    from twin.replay.timing import compare_with_simulation
    from twin.runtime.params import SimParams

    trace = read_trace(HW)
    base = SimParams.from_dict(trace.config.extra.get("sim", {}), "header")
    calm = compare_with_simulation(trace, None)
    assert calm["runs"] == 3 and calm["simulated_status"] == "completed"
    assert calm["recorded_status"] == "completed" and "note" not in calm
    noisy = compare_with_simulation(
        trace, base.replace(zmq_jitter_s=0.02, prefill_command_jitter_s=0.02), seeds=4)
    assert noisy["simulated_statuses"].count("wedged") >= 1
    assert "wedged x" in noisy["simulated_status"]
    assert "where the recorded run completed; root: " in noisy["note"]
    assert "STAGING_REQ" in noisy["note"]
    assert noisy["rooms_compared"] == 12  # the completed runs' rooms still count


def test_calibrate_with_stalls_fits_per_process_stalls(tmp_path: Path) -> None:
    costs = tmp_path / "costs.toml"
    r = CliRunner().invoke(cli, ["calibrate", str(HW), "-o", str(costs), "--seeds", "1",
                                 "--stalls", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    assert report["params"]["process_stall_s"] > 0 and report["params"]["process_run_s"] > 0
    assert {"process_stall_s", "process_run_s"} <= set(report["scales"])
    params = costs_from(str(costs))
    assert params is not None and params.process_stall_s > 0
    (fit,) = report["traces"]
    assert 0.5 < fit["ratio_p50"]["kv_done_s"] < 2.0


def test_a_write_time_that_does_not_grow_with_size_is_latency_not_bandwidth() -> None:
    from twin.calibrate import _fit_line

    flat = [(49152, 1.6e-3), (49152, 1.7e-3), (131072, 1.5e-3), (131072, 1.6e-3)]
    intercept, per_byte = _fit_line(flat)
    assert per_byte == 0.0 and intercept == pytest.approx(1.6e-3)
    # A fixed cost and a cost per byte, over sizes far enough apart, are told apart.
    line = [(n, 1e-3 + n * 2e-9) for n in (50_000, 100_000, 200_000) for _ in range(3)]
    intercept, per_byte = _fit_line(line)
    assert intercept == pytest.approx(1e-3) and per_byte == pytest.approx(2e-9)
    # Sizes 6% apart (or one size) leave the slope to noise: the proportional line.
    close = [(122880, 1.4e-3), (131072, 1.7e-3)]
    assert _fit_line(close) == (0.0, pytest.approx(float(np.median([1.4e-3 / 122880,
                                                                   1.7e-3 / 131072]))))


def test_scatter_costs_split_a_fixed_cost_from_a_cost_per_byte() -> None:
    from twin.calibrate import _scatter_costs

    launch, per_byte, wait = 0.7e-3, 2e-9, 0.1e-3
    spans: list[tuple[float, float, int]] = []
    t = 0.0
    for i in range(40):  # each alone on the stream, seen a polling wait after it finished
        n = (100_000, 260_000)[i % 2]
        spans.append((t, t + launch + n * per_byte + wait, n))
        t += 0.01
    # Two scatters queued behind the one before them: their times hold the queue.
    a = t + 1.0
    spans += [(a, a + launch + 260_000 * per_byte + wait, 260_000),
              (a, a + 2 * (launch + 260_000 * per_byte) + wait, 260_000)]
    got_launch, got_per_byte, poll = _scatter_costs([{"d0g0r0": spans}])
    assert got_launch == pytest.approx(launch + wait, rel=1e-6)  # a poll's wait is fixed too
    assert got_per_byte == pytest.approx(per_byte, rel=1e-6)
    assert poll == pytest.approx(1e-4)  # nothing left once the queue is replayed
