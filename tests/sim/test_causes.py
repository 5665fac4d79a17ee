"""A run that loses requests to a dead rank names the rank, the rooms it took with it and the
sends to it that blocked decode's threads, on root lines (``twin.sim.causes``)."""

from __future__ import annotations

import re

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
