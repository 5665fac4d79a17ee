"""Runs across nodes, the parts without processes: clock estimates, placement, port ranges."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from twin.core.config import ServerSide, TwinConfig
from twin.core.topology import Topology
from twin.hw.control import ControlError, ControlSocket
from twin.hw.netutil import (
    interface_of,
    local_address_towards,
    parse_host_port,
    parse_port_range,
)
from twin.hw.nodes import (
    AgentInfo,
    NodesError,
    PlacementError,
    estimate_offset,
    parse_placement,
    plan_placement,
)

TP4_TP2 = Topology(TwinConfig(prefill=ServerSide(tp_size=4), decode=ServerSide(tp_size=2)))


def _agent(name: str, role: str | None = None, gpus: list[int] | None = None,
           cuda: int = 0) -> AgentInfo:
    return AgentInfo(name=name, endpoint=f"tcp://127.0.0.1:{len(name)}", address="127.0.0.1",
                     hostname="h", pid=1, role=role, gpus=gpus, cuda_devices=cuda, gpu_free=[],
                     mem_available=None, log_dir="/tmp", data_ports="", control_ports="",
                     ucx={}, joined_at=0.0, last_heard=0.0)


def test_offset_comes_from_the_shortest_round_trip() -> None:
    # The agent's clock is 100 s ahead; the slow round trips would mislead.
    samples = [(0.0, 100.004, 0.010), (1.0, 101.0005, 1.001), (2.0, 102.02, 2.03)]
    est = estimate_offset(samples)
    assert est.rtt_s == pytest.approx(0.001)
    assert est.offset_s == pytest.approx(100.0, abs=est.uncertainty_s)
    assert est.samples == 3
    with pytest.raises(ValueError):
        estimate_offset([])


def test_placement_by_role_with_gpus() -> None:
    agents = [_agent("b", "decode", [4, 5]), _agent("a", "prefill", [0, 1, 2, 3])]
    placed = plan_placement(TP4_TP2, agents, "cuda")
    assert placed["a"] == {"p0g0r0": "cuda:0", "p0g0r1": "cuda:1", "p0g0r2": "cuda:2",
                           "p0g0r3": "cuda:3"}
    assert placed["b"] == {"d0g0r0": "cuda:4", "d0g0r1": "cuda:5"}


def test_placement_splits_a_side_over_its_agents_and_respects_gpu_counts() -> None:
    agents = [_agent("p1", "prefill"), _agent("p2", "prefill"), _agent("d", "decode")]
    placed = plan_placement(TP4_TP2, agents, "cpu")
    assert list(placed["p1"]) == ["p0g0r0", "p0g0r1"] and list(placed["p2"]) == ["p0g0r2",
                                                                                  "p0g0r3"]
    with pytest.raises(NodesError, match="4 prefill ranks but the prefill agents offer 3"):
        plan_placement(TP4_TP2, [_agent("p", "prefill", [0, 1, 2]), _agent("d", "decode", [0])],
                       "cuda")


def test_placement_without_roles_and_on_one_agent() -> None:
    two = plan_placement(TP4_TP2, [_agent("y"), _agent("x")], "cpu")
    assert set(two["x"]) == {"p0g0r0", "p0g0r1", "p0g0r2", "p0g0r3"}
    assert set(two["y"]) == {"d0g0r0", "d0g0r1"}
    with pytest.raises(NodesError, match="2 decode ranks but the decode agents offer 0"):
        plan_placement(TP4_TP2, [_agent("only", gpus=[0, 1, 2, 3])], "cuda")
    one = plan_placement(TP4_TP2, [_agent("only", cuda=8)], "cuda")
    # One node takes both sides: its GPUs in order, prefill first (the 8-GPU layout).
    assert one["only"]["p0g0r3"] == "cuda:3" and one["only"]["d0g0r1"] == "cuda:5"
    with pytest.raises(NodesError, match="no agent takes the decode ranks"):
        plan_placement(TP4_TP2, [_agent("p", "prefill")], "cpu")
    with pytest.raises(NodesError, match="sees no CUDA device"):
        plan_placement(TP4_TP2, [_agent("p", "prefill"), _agent("d", "decode")], "cuda")


def test_placement_table() -> None:
    table = parse_placement({"node-a": {"ranks": "prefill", "gpus": [0, 1, 2, 3]},
                             "node-b": {"ranks": ["d0g0r1", "d0g0r0"], "gpus": [7]}}, TP4_TP2)
    placed = plan_placement(TP4_TP2, [_agent("node-a"), _agent("node-b")], "cuda", table)
    assert placed["node-b"] == {"d0g0r1": "cuda:7", "d0g0r0": "cuda:7"}
    with pytest.raises(NodesError, match="missing: node-b"):
        plan_placement(TP4_TP2, [_agent("node-a"), _agent("other")], "cpu", table)
    bad = [({"a": {"ranks": "prefill"}}, "d0g0r0, d0g0r1 placed on no agent"),
           ({"a": {"ranks": ["p0g0r9"]}}, "no rank 'p0g0r9'"),
           ({"a": {"ranks": "prefill"}, "b": {"ranks": ["p0g0r0", "d0g0r0", "d0g0r1"]}},
            "p0g0r0 is already placed on a"),
           ({"a": {"ranks": "decode", "gpu": [1]}}, "unknown field"),
           ({"a": {"ranks": "all"}}, "expected \"prefill\""),
           ({"a": {"ranks": "decode", "gpus": [-1]}}, "list of GPU indices"),
           ({}, "one table per agent")]
    for data, message in bad:
        with pytest.raises(PlacementError, match=message):
            parse_placement(data, TP4_TP2)


def test_placement_table_is_accepted_in_a_config_file(tmp_path: Path) -> None:
    path = tmp_path / "two-nodes.toml"
    path.write_text('[prefill]\ntp_size = 4\n[decode]\ntp_size = 2\n'
                    '[placement.node-a]\nranks = "prefill"\n'
                    '[placement.node-b]\nranks = "decode"\n')
    cfg = TwinConfig.from_toml(path)
    assert [e.agent for e in parse_placement(cfg.extra["placement"], Topology(cfg))] == [
        "node-a", "node-b"]


def test_port_ranges_and_addresses() -> None:
    assert parse_port_range("20000-20099") == (20000, 20099)
    assert parse_port_range("20000") == (20000, 20000)
    assert parse_port_range(None) is None
    for bad in ("x", "10-5", "0-10", "70000"):
        with pytest.raises(ValueError):
            parse_port_range(bad)
    assert parse_host_port("127.0.0.1:29500") == ("127.0.0.1", 29500)
    assert parse_host_port("tcp://localhost:1") == ("127.0.0.1", 1)
    for bad in ("127.0.0.1", "h:x", "127.0.0.1:0", "no-such-host.invalid:1"):
        with pytest.raises(ValueError):
            parse_host_port(bad)
    assert interface_of("127.0.0.1") == "lo"
    assert local_address_towards("127.0.0.1", 9) == "127.0.0.1"


def test_control_socket_binds_inside_its_port_range() -> None:
    from twin.hw.netutil import free_port

    base = free_port()
    lo, hi = base, base  # one port: the second socket finds it taken
    with ControlSocket(ports=(lo, hi)) as first:
        assert first.endpoint == f"tcp://127.0.0.1:{lo}"
        with pytest.raises(ControlError, match=f"no free port in {lo}-{hi}"):
            ControlSocket(ports=(lo, hi))
        first.send(first.endpoint, [b"x"])
        deadline = time.monotonic() + 5
        got = None
        while got is None and time.monotonic() < deadline:
            got = first.recv_frames(100)
        assert got == [b"x"]


def test_bad_across_nodes_flags_are_rejected_before_anything_runs(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from twin.cli import cli

    bad_table = tmp_path / "bad.toml"
    bad_table.write_text('[placement.a]\nranks = "prefill"\n')
    small = ["hw", "--workload", "poisson:n=2,rate=5,input=64,output=1"]
    cases = [
        (["--agents", "2"], "--agents needs --listen"),
        (["--listen", "127.0.0.1"], "expected HOST:PORT"),
        (["--listen", "127.0.0.1:29500"], "--agents N"),
        (["--listen", "127.0.0.1:29500", "--agents", "2", "--data-ports", "9-1"],
         "--data-ports"),
        (["--listen", "127.0.0.1:29500", "--agents", "2", "--prefill-gpus", "0"],
         "--prefill-gpus"),
        (["--listen", "127.0.0.1:29500", "--config", str(bad_table)], "placed on no agent"),
    ]
    for extra, message in cases:
        r = CliRunner().invoke(cli, [*small, *extra])
        assert r.exit_code == 2, (extra, r.output)
        assert message in r.output and "Traceback" not in r.output, (extra, r.output)
    r = CliRunner().invoke(cli, ["agent", "--join", "nowhere"])
    assert r.exit_code == 2 and "expected HOST:PORT" in r.output
    stall = str(Path(__file__).resolve().parents[2] / "traces" / "warmup-stall.jsonl.gz")
    r = CliRunner().invoke(cli, ["replay", stall, "--listen", "127.0.0.1:1", "--agents", "2"])
    assert r.exit_code == 2 and "add --mode hw" in r.output, r.output


def test_data_ports_on_the_mooncake_engine_are_said_to_bound_ucx_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--data-ports bounds NIXL's UCX ports; on the Mooncake engine the run says, before it
    starts, that the engine picks its own ports (and how to keep every data port in range),
    and that an across-nodes coordinator's agents need the run's secret."""
    from click.testing import CliRunner

    from twin.cli import cli
    from twin.hw.netutil import free_port

    small = str(Path(__file__).resolve().parents[2] / "examples" / "tp2-tp1-small.toml")
    monkeypatch.setenv("TWIN_HW_TRANSPORT", "mooncake")
    monkeypatch.delenv("TWIN_RUN_SECRET", raising=False)
    monkeypatch.delenv("TWIN_RUN_SECRET_FILE", raising=False)
    args = ["hw", "--config", small, "--workload", "poisson:n=2,rate=1", "--listen",
            f"127.0.0.1:{free_port()}", "--agents", "1", "--agent-timeout", "1"]
    out = CliRunner().invoke(cli, [*args, "--data-ports", "29700-29709"]).output
    (line,) = [x for x in out.splitlines() if x.startswith("transfers ")]
    assert "--data-ports bounds NIXL's UCX ports only" in line, out
    assert "--disaggregation-transfer-backend nixl" in line
    assert "TWIN_RUN_SECRET_FILE=" in out and "(mode 0600)" in out, out
    out = CliRunner().invoke(cli, args).output  # no --data-ports: nothing to say
    assert "--data-ports" not in out, out
