"""Hardware runs across two nodes, for real: two network namespaces joined by a veth pair.

The coordinator and the prefill agent run in namespace ``a`` (10.213.0.1), the decode agent in
namespace ``b`` (10.213.0.2), whose monotonic clock is also shifted by 10000 s (a time
namespace) so that the clock handshake has something to correct. NIXL moves the KV bytes over
UCX's TCP transport across the veth (``UCX_TLS=tcp``: both namespaces share one kernel, so UCX
would otherwise take shared memory between them), every byte is verified, and the trace is
replayed in simulation. Only the two addresses the test assigns inside its own namespaces are
used; the namespaces are deleted afterwards, also on failure. Where namespaces cannot be
created (not root) the same agents run over loopback and the test says so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from twin.hw.auth import SECRET_FILE_ENV, RunKey, write_key_file
from twin.hw.netns import TwoNodes, time_namespaces_work, two_nodes
from twin.hw.netutil import free_port
from twin.runtime.outcome import EXIT_CORRUPTION, EXIT_ERROR, EXIT_OK, EXIT_WEDGE
from twin.trace.format import read_trace

pytestmark = pytest.mark.hw

ROOT = Path(__file__).resolve().parents[2]
SMALL = str(ROOT / "examples" / "tp2-tp1-small.toml")
#: These tests are about nodes, not about the protocol's races. On a loaded host a writer's
#: STAGING_REQ can reach decode after its chunk was scattered, which wedges the ring as it would
#: in SGLang (tests/hw/test_hw_mode.py reproduces it on purpose); the fix keeps them clean.
LATE_REQ_FIX = ["--fix", "drop-late-staging-req"]
STALL = str(ROOT / "traces" / "warmup-stall.jsonl.gz")
SKEW_S = 10000.0
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "UCX_TLS": "tcp"}


@pytest.fixture
def net() -> Iterator[TwoNodes]:
    with two_nodes() as n:
        if not n.isolated:
            warnings.warn(n.reason, stacklevel=1)
            print(f"note: {n.reason}", file=sys.stderr)
        yield n


class Run:
    """A coordinator in namespace a and one agent per role; their output in ``tmp``."""

    def __init__(self, net: TwoNodes, tmp: Path, *, skew: bool = False,
                 agents: tuple[str, ...] = ("prefill", "decode"), heartbeat_s: float = 10.0):
        self.net, self.tmp = net, tmp
        port = 29517 if net.isolated else free_port()
        self.join = f"{net.addr['a']}:{port}"
        self.heartbeat_s = heartbeat_s
        self.skew = SKEW_S if skew and net.isolated and time_namespaces_work() else 0.0
        self.agents: dict[str, subprocess.Popen[Any]] = {}
        # The run's secret, for the coordinator and its agents alike (twin.hw.auth).
        secret = write_key_file(RunKey.new(), tmp / "run-secret")
        self.env = {**ENV, SECRET_FILE_ENV: str(secret)}
        for role in agents:
            node = "a" if role == "prefill" else "b"
            out = open(tmp / f"agent-{role}.log", "w")  # noqa: SIM115 - closed by the process
            self.agents[role] = net.popen(
                node, [sys.executable, "-m", "twin", "agent", "--join", self.join, "--role",
                       role, "--name", f"node-{node}", "--log-dir", str(tmp / f"logs-{role}")],
                clock_offset_s=self.skew if node == "b" else None, env=self.env, stdout=out,
                stderr=subprocess.STDOUT, cwd=tmp)

    def coordinator(self, args: list[str]) -> subprocess.Popen[str]:
        return self.net.popen("a", [sys.executable, "-m", "twin", *args, "--listen", self.join,
                                    "--agents", "2", "--heartbeat-timeout",
                                    f"{self.heartbeat_s:g}"],
                              env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=self.tmp)

    def finish(self, proc: subprocess.Popen[str], timeout: float = 240) -> tuple[int, str]:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out

    def agent_log(self, role: str) -> str:
        return (self.tmp / f"agent-{role}.log").read_text()

    def rank_pids(self) -> list[int]:
        pids = []
        for role in self.agents:
            pids += [int(p) for p in re.findall(r"pid (\d+)\)", self.agent_log(role))]
        return pids

    def wait_chunks(self, proc: subprocess.Popen[str], n: int, timeout: float = 150) -> None:
        """Until the decode rank has received ``n`` CHUNK_READY frames (its frame log); fails
        at once, with the coordinator's output, if the coordinator exits first."""
        log = self.tmp / "logs-decode" / "d0g0r0.log"
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            if log.exists():
                seen = log.read_text(errors="replace").count("CHUNK_READY")
                if seen >= n:
                    return
            if proc.poll() is not None:
                out, _ = proc.communicate()
                raise AssertionError(f"the coordinator exited ({proc.returncode}) after {seen} "
                                     f"chunks:\n{out[-3000:]}")
            time.sleep(0.5)
        raise AssertionError(f"only {seen} of {n} chunks in {timeout:g} s; agents:\n"
                             + "\n".join(self.agent_log(r)[-1500:] for r in self.agents))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


def _check_trace(path: Path, status: str, skew: float) -> None:
    """The trace's agents and clocks, causal order across nodes, and a replay in simulation
    that reaches the recorded outcome."""
    from twin.replay import replay_sim

    trace = read_trace(path)
    assert trace.warnings == [], trace.warnings
    assert trace.status == status
    agents = {a["name"]: a for a in trace.header["agents"]}
    assert set(agents["node-a"]["ranks"]) == {n for n in trace.nodes if n.startswith("p")}
    assert set(agents["node-b"]["ranks"]) == {n for n in trace.nodes if n.startswith("d")}
    offset = agents["node-b"]["clock"]["offset_s"]
    assert abs(offset - skew) < 0.05, (offset, skew)
    # Every frame arrives after it was sent, across the two hosts' clocks, within what the
    # clocks' handshakes could tell apart (half each agent's best round trip) and 2 ms. The
    # trace is merged by corrected time, so an arrival may be written before its send when the
    # correction is off by more than the frame's flight: look sends up over the whole trace.
    slack = 0.002 + sum(a["clock"]["rtt_s"] / 2 for a in agents.values() if a.get("clock"))
    sent: dict[str, float] = {}
    for rec in trace.events:
        if rec.dir == "out" and rec.type == "Send":
            sent.setdefault(repr(rec.event.msg), rec.t)
    arrivals = [(repr(rec.event.msg), rec.t) for rec in trace.events
                if rec.dir == "in" and rec.type == "MessageArrived"]
    assert arrivals
    never_sent = [m for m, _ in arrivals if m not in sent]
    assert never_sent == [], never_sent[:3]
    late = [(m, sent[m] - t) for m, t in arrivals if sent[m] > t + slack]
    assert late == [], (slack, late[:3])
    replayed = replay_sim(trace)
    assert replayed.divergence is None and replayed.same_outcome, replayed.divergence


@pytest.mark.slow
@pytest.mark.parametrize("defect_on", [False], ids=["aligned"])
def test_radix_grid_across_two_nodes(net: TwoNodes, tmp_path: Path, defect_on: bool) -> None:
    """Prefill TP4 on node a, decode TP2 on node b: exit 0, every room byte-verified, the KV
    bytes crossed the veth. With ``defect_on=True`` (no-grid-alignment) it exits 4 as the byte
    check finds the corruption; that case is not run by default, for the suite's time: the same
    byte check finds it on one node (``test_hw_mode.py::test_radix_grid_byte_check``)."""
    run = Run(net, tmp_path, skew=True)
    (tmp_path / "slack.toml").write_text("[sim]\nwedge_window_s = 30.0\n")  # a loaded host
    rx0 = net.rx_bytes("b")
    args = ["hw", "--scenario", "radix-grid", "--config", "slack.toml", *LATE_REQ_FIX,
            "--trace-out", "run.jsonl.gz"] + (["--scenario-defects"] if defect_on else [])
    code, out = run.finish(run.coordinator(args))
    assert code == (EXIT_CORRUPTION if defect_on else EXIT_OK), out
    assert "placement   node-a: p0g0r0 p0g0r1 p0g0r2 p0g0r3" in out
    assert "placement   node-b: d0g0r0 d0g0r1" in out
    assert re.search(r"agent +node-b .*clock offset [+-]\d+\.\d+ s", out), out
    if defect_on:
        assert "corruption  d0g0r" in out and " layer " in out
    else:
        assert "8 completed (8 byte-verified)" in out
    assert all(a.wait(30) == 0 for a in run.agents.values())
    trace_path = tmp_path / "run.jsonl.gz"
    _check_trace(trace_path, "corrupted" if defect_on else "completed", run.skew)
    if net.isolated:
        moved = sum(r.event.nbytes for r in read_trace(trace_path).events
                    if r.dir == "out" and r.type == "StartTransfer")
        assert net.rx_bytes("b") - rx0 >= moved > 0  # NIXL's bytes went over the veth


@pytest.mark.slow
def test_a_pp2_prefill_across_two_nodes(net: TwoNodes, tmp_path: Path) -> None:
    """Prefill TP2 x PP2 on node a (a process per stage, each with its own layers), decode TP1
    on node b: every stage's layer slots cross to node b and every byte is verified; the trace
    replays in simulation."""
    run = Run(net, tmp_path)
    (tmp_path / "slack.toml").write_text("[sim]\nwedge_window_s = 30.0\n")  # a loaded host
    args = ["hw", "--scenario", "radix-grid", "--config", "slack.toml", *LATE_REQ_FIX,
            "--prefill-args", "--tp-size 2 --pp-size 2", "--decode-args", "--tp-size 1",
            "--trace-out", "run.jsonl.gz"]
    code, out = run.finish(run.coordinator(args))
    assert code == EXIT_OK, out
    assert "placement   node-a: p0g0s0r0 p0g0s0r1 p0g0s1r0 p0g0s1r1" in out, out
    assert "placement   node-b: d0g0r0" in out, out
    assert "8 completed (8 byte-verified)" in out, out
    assert all(a.wait(30) == 0 for a in run.agents.values())
    _check_trace(tmp_path / "run.jsonl.gz", "completed", run.skew)


@pytest.mark.slow
def test_warmup_stall_replays_across_two_nodes(net: TwoNodes, tmp_path: Path) -> None:
    """The simulator's warmup-stall trace replayed on hardware across the two nodes (4 prefill
    ranks on a, 8 decode ranks on b) wedges with the same diagnosis."""
    run = Run(net, tmp_path, skew=True)
    code, out = run.finish(run.coordinator(["replay", STALL, "--mode", "hw"]))
    assert code == EXIT_WEDGE, out
    assert "same outcome as recorded" in out, out
    assert "never sent to this session" in out, out
    assert "placement   node-b: d0g0r0 d0g0r1 d0g0r2 d0g0r3 d0g0r4 d0g0r5 d0g0r6 d0g0r7" in out


def test_an_agent_that_never_joins_is_named(net: TwoNodes, tmp_path: Path) -> None:
    run = Run(net, tmp_path, agents=("prefill",))
    t0 = time.monotonic()
    proc = run.coordinator(["hw", "--config", SMALL, "--agent-timeout", "8",
                            "--trace-out", "run.jsonl.gz"])
    code, out = run.finish(proc, timeout=120)
    assert code == EXIT_ERROR, out
    assert time.monotonic() - t0 < 60
    assert "1 of 2 agent(s) joined" in out and "decode ranks (d0g0r0)" in out, out
    assert "Traceback" not in out
    assert run.agents["prefill"].wait(30) == 0  # told to leave
    trace = read_trace(tmp_path / "run.jsonl.gz")
    assert trace.status == "crashed" and "decode ranks (d0g0r0)" in trace.outcome["diagnosis"][0]


def _mid_run(net: TwoNodes, tmp_path: Path, *extra: str) -> tuple[Run, subprocess.Popen[str]]:
    run = Run(net, tmp_path, heartbeat_s=3.0)
    proc = run.coordinator(["hw", "--config", SMALL, *LATE_REQ_FIX, "--workload",
                            "poisson:n=400,rate=5,input=600,output=4", "--timeout", "150",
                            "--trace-out", "run.jsonl.gz", *extra])
    run.wait_chunks(proc, 100)  # requests flow
    assert proc.poll() is None
    return run, proc


def _named_and_cleaned_up(run: Run, proc: subprocess.Popen[str], tmp_path: Path,
                          t_fault: float, pids: list[int]) -> str:
    code, out = run.finish(proc, timeout=120)
    took = time.monotonic() - t_fault
    assert code == EXIT_ERROR, out
    assert "error       agent node-b (" in out and "ranks d0g0r0" in out, out
    assert "no heartbeat for 3 s" in out and "Traceback" not in out
    assert took < 30, took  # heartbeat timeout plus teardown
    assert _gone(pids, 20), "rank processes outlived the run"
    trace = read_trace(tmp_path / "run.jsonl.gz")
    assert trace.status == "crashed"
    assert any("agent node-b" in d for d in trace.outcome["diagnosis"])
    assert {r.node for r in trace.events if r.dir == "in"} == set(trace.nodes)
    return out


@pytest.mark.slow
def test_a_node_that_loses_its_network_is_named(net: TwoNodes, tmp_path: Path) -> None:
    if not net.isolated:
        pytest.skip(f"cutting a node's network needs namespaces: {net.reason}")
    run, proc = _mid_run(net, tmp_path)
    pids = run.rank_pids()
    net.link("b", up=False)
    t_fault = time.monotonic()
    _named_and_cleaned_up(run, proc, tmp_path, t_fault, pids)
    assert run.agents["decode"].wait(30) == EXIT_ERROR  # it lost the coordinator
    assert "no word from the coordinator" in run.agent_log("decode")
    assert run.agents["prefill"].wait(30) == 0


@pytest.mark.slow
def test_a_killed_agent_is_named_and_its_ranks_die(net: TwoNodes, tmp_path: Path) -> None:
    run, proc = _mid_run(net, tmp_path)
    pids = run.rank_pids()
    run.agents["decode"].kill()
    t_fault = time.monotonic()
    _named_and_cleaned_up(run, proc, tmp_path, t_fault, pids)
    assert run.agents["prefill"].wait(30) == 0


@pytest.mark.slow
def test_ranks_on_every_node_end_with_a_killed_coordinator(net: TwoNodes, tmp_path: Path) -> None:
    run, proc = _mid_run(net, tmp_path)
    pids = run.rank_pids()
    proc.kill()
    proc.communicate(timeout=30)
    for role in ("prefill", "decode"):  # each agent notices, stops its ranks, exits 1
        assert run.agents[role].wait(30) == EXIT_ERROR
        assert "no word from the coordinator" in run.agent_log(role)
    assert _gone(pids, 20), "rank processes outlived the coordinator"
    assert read_trace(tmp_path / "run.jsonl.gz").status == "incomplete"


def _listening(net: TwoNodes, node: str, pids: set[int]) -> set[int]:
    """TCP ports the processes ``pids`` listen on, seen from ``node``."""
    out = net.run(node, ["ss", "-ltnpH"], capture_output=True, text=True, timeout=30).stdout
    ports = set()
    for line in out.splitlines():
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if owners & pids:
            ports.add(int(line.split()[3].rsplit(":", 1)[1]))
    return ports


@pytest.mark.slow
def test_a_killed_rank_on_a_node_is_named_with_its_agent(net: TwoNodes, tmp_path: Path) -> None:
    """Also: the decode rank listens only on the coordinator's port ranges (on NIXL, whose
    UCX data port --data-ports bounds; the Mooncake engine picks its own ports)."""
    run, proc = _mid_run(net, tmp_path, "--control-ports", "29600-29609", "--data-ports",
                         "29700-29709", "--prefill-args",
                         "--disaggregation-transfer-backend nixl", "--decode-args",
                         "--disaggregation-transfer-backend nixl")
    decode = [int(p) for p in re.findall(r"pid (\d+)\)", run.agent_log("decode"))]
    ports = sorted(_listening(net, "b", set(decode)))
    assert len(ports) == 2 and 29600 <= ports[0] <= 29609 and 29700 <= ports[1] <= 29709, ports
    pids = run.rank_pids()
    os.kill(decode[0], 9)
    code, out = run.finish(proc, timeout=120)
    assert code == EXIT_ERROR, out
    assert "error       d0g0r0: rank process died (killed by SIGKILL) on agent node-b; its " \
           "log: node-b:" in out, out
    assert _gone(pids, 20)
    assert all(a.wait(30) == 0 for a in run.agents.values())


def _listen_addresses(pids: set[int]) -> set[str]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[3].rsplit(":", 1)[0] for line in out.splitlines()
            if {int(p) for p in re.findall(r"pid=(\d+)", line)} & pids}


@pytest.mark.slow
def test_a_single_node_run_listens_on_loopback_only(tmp_path: Path) -> None:
    """Without --listen nothing listens beyond loopback: control sockets and UCX alike."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "twin", "hw", "--config", SMALL, "--workload",
         "poisson:n=400,rate=5,input=600,output=4", "--timeout", "60", "--log-dir", "logs"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, cwd=tmp_path, start_new_session=True)
    try:
        log = tmp_path / "logs" / "d0g0r0.log"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
                log.exists() and "CHUNK_READY" in log.read_text(errors="replace")):
            time.sleep(0.5)
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                  text=True).stdout.split()
        addresses = _listen_addresses({proc.pid, *map(int, children)})
        assert addresses == {"127.0.0.1"}, addresses
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
