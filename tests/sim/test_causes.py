"""A run that loses requests to a dead rank names the rank, the rooms it took with it and the
sends to it that blocked decode's threads, on root lines (``twin.sim.causes``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from twin.cli import cli
from twin.runtime.faults import parse_fault
from twin.sim.runner import run_sim
from twin.sim.scenarios import SCENARIOS
from twin.workloads.spec import parse_workload_spec

DP_ATTN = ["--prefill-args", "--tp-size 2 --dp-size 2 --enable-dp-attention",
           "--decode-args", "--tp-size 2"]


def test_a_dead_prefill_rank_is_the_root_of_the_failed_requests() -> None:
    r = CliRunner().invoke(cli, ["sim", *DP_ATTN, "--workload", "poisson:n=1500,rate=50",
                                 "--fault", "crash:p0g1r0:at=2"])
    assert r.exit_code != 0 and "status      failed" in r.output, r.output
    roots = [line for line in r.output.splitlines() if line.startswith("root ")]
    assert roots, r.output
    failed = int(re.search(r"(\d+) failed,", r.output)[1])  # type: ignore[index]
    head = re.match(r"root +(\d+) request\(s\) failed: p0g1r0 crashed by fault "
                    r"crash:p0g1r0:at=2 at t=2 s; its prefill group p0g1 served (\d+) of", roots[0])
    assert head is not None, roots[0]
    assert int(head[1]) == failed
    assert "blocked d0g0r0's scheduler" in roots[0]
    served = int(head[2])
    rest = re.search(r"the other (\d+) failed request\(s\) were served by live groups", r.output)
    assert served + (int(rest[1]) if rest else 0) == failed


def test_a_dead_decode_rank_names_the_rooms_it_left_unfinished() -> None:
    result = run_sim(SCENARIOS["default"].config, parse_workload_spec("poisson:n=300,rate=20"),
                     faults=[parse_fault("crash:d0g0r1:at=3")])
    roots = result.summary()["roots"]
    assert len(roots) == 1 and roots[0].startswith("d0g0r1 crashed by fault"), roots
    unfinished = result.summary()["unfinished"]
    assert unfinished > 0 and f"served 0 of the failed request(s) and {unfinished} " \
        "unfinished" in roots[0]


def test_a_run_with_no_dead_rank_has_no_root_lines() -> None:
    result = run_sim(SCENARIOS["default"].config, parse_workload_spec("poisson:n=50,rate=20"),
                     faults=[parse_fault("fail-transfer:p=0.2")])
    assert result.summary()["failed"] > 0
    assert result.summary()["roots"] == []


def _dead_server_run(env: dict[str, str] | None = None, scope: str = "",
                     **params: float) -> tuple[Any, float]:
    """Prefill TP4 -> decode TP2 under load, every prefill rank dead at t=1 s (by one
    ``scope=server`` crash, or by a crash per rank)."""
    from twin.runtime.params import SimParams

    faults = ([parse_fault("crash:p0g0r2:at=1:scope=server")] if scope else
              [parse_fault(f"crash:p0g0r{i}:at=1") for i in range(4)])
    result = run_sim(SCENARIOS["default"].config.replace(staging_pool_size_mb=4096),
                     parse_workload_spec("poisson:n=200,rate=100,input=16000"),
                     faults=faults, params=SimParams(**params))
    return result, 1.0


def test_decode_heartbeat_fails_a_dead_prefill_servers_rooms_in_its_window() -> None:
    """SGLang's decode heartbeat (SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL 5 s x
    ..._MAX_FAILURE 2): the rooms in flight on a dead prefill server fail 10 s after it died,
    not at the 300 s waiting timeout; requests that reach decode later fail at once (the
    server's bootstrap endpoint is gone)."""
    for interval, failures in ((5.0, 2), (1.0, 3)):
        result, died = _dead_server_run(heartbeat_interval_s=interval,
                                        heartbeat_max_failure=failures)
        s = result.summary()
        assert s["unfinished"] == 0 and s["failed"] > 0, s
        window = interval * failures
        by_heartbeat = [r for r in result.sim.metrics.done
                        if r.status == "Failed" and "heartbeat" in r.reason]
        assert by_heartbeat, s["failures"]
        for r in by_heartbeat:
            assert abs(r.kv_done_s - (died + window)) < 1e-6, (r.room, r.kv_done_s)
        late = [r for r in result.sim.metrics.done if r.status == "Failed"
                and "bootstrap endpoint" in r.reason]
        assert late and all(r.kv_done_s - r.arrival_s < 0.1 for r in late)
        assert s["sim_seconds"] <= died + window + 1.0


def test_a_crash_with_server_scope_takes_every_rank_of_the_server() -> None:
    result, _ = _dead_server_run(scope="server")
    crashed = result.sim.runtime.crashed
    assert set(crashed) == {"p0g0r0", "p0g0r1", "p0g0r2", "p0g0r3"}
    assert all("scope=server" in why for why in crashed.values())
    roots = result.summary()["roots"]
    assert roots[0].startswith(f"{result.summary()['failed']} request(s) failed: p0g0r0, "
                               "p0g0r1, p0g0r2, p0g0r3 crashed by fault"), roots


def test_heartbeat_settings_come_from_sglangs_environment_names() -> None:
    from twin.launch_args import env_changes

    _, params = env_changes({"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2.5",
                             "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "4"})
    assert params == {"heartbeat_interval_s": 2.5, "heartbeat_max_failure": 4}
    r = CliRunner().invoke(cli, ["sim", "--workload", "poisson:n=5,rate=5", "--env",
                                 "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE=0"])
    assert r.exit_code == 2 and "must be positive" in r.output, r.output
    r = CliRunner().invoke(cli, ["sim", "--workload", "poisson:n=5,rate=5", "--fault",
                                 "crash:p0g0r0:at=1:scope=pod"])
    assert r.exit_code == 2 and "key 'scope': expected one of rank, server" in r.output


def test_a_replay_names_the_same_dead_rank_from_the_trace(tmp_path: Path) -> None:
    from twin.replay import replay_sim

    path = tmp_path / "crash.jsonl.gz"
    result = run_sim(SCENARIOS["default"].config, parse_workload_spec("poisson:n=300,rate=20"),
                     faults=[parse_fault("crash:d0g0r1:at=3")], trace_out=path)
    replayed = replay_sim(str(path))
    assert replayed.divergence is None and replayed.same_outcome
    assert replayed.roots == result.summary()["roots"]  # no blocked sends on this one
    assert replayed.roots[0].startswith("d0g0r1 crashed by fault crash:d0g0r1:at=3 at t=3 s")
    r = CliRunner().invoke(cli, ["replay", str(path)])
    assert f"root        {replayed.roots[0]}" in r.output, r.output
