"""``twin explore --confirm-hw``: a finding's shrunk trace replayed on real rank processes (zmq,
NIXL agents, the kernels on this host) and the findings table saying what came of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from twin.cli import cli
from twin.explore.confirm import CONFIRMED, confirm_on_hardware

pytestmark = pytest.mark.hw


def test_confirm_hw_replays_the_stale_watermark_wedge_on_real_ranks(tmp_path: Path) -> None:
    out = tmp_path / "camp"
    r = CliRunner().invoke(cli, [
        "explore", "--scenario", "stale-empty-ring", "--defect", "stale-empty-ring-watermark",
        "--no-faults", "--seed", "1", "--runs", "24", "--shrink-runs", "60", "--out", str(out),
        "--confirm-hw", "--json"], catch_exceptions=False)
    assert r.exit_code == 3, r.output
    data = json.loads(r.output)
    (stale,) = [f for f in data["findings"] if "stale" in f["root"]]
    assert stale["hw"] == CONFIRMED
    assert "| hardware |" in (out / "findings.md").read_text()
    assert "| confirmed |" in (out / "findings.md").read_text()
    # The verdict is kept in the campaign's state: a resumed campaign does not replay again.
    state = json.loads((out / "state.json").read_text())
    assert [f["hw"] for f in state["findings"]] == [f["hw"] for f in data["findings"]]


def test_a_trace_of_another_outcome_is_not_confirmed(tmp_path: Path) -> None:
    """The check can fail: a clean run's trace replays on real ranks to its recorded outcome
    (confirmed); with the recorded outcome changed to a wedge, the same replay, which still
    completes, does not confirm it."""
    import gzip

    from twin.explore.oracles import run_trial
    from twin.explore.trial import Base, Req, Trial
    from twin.runtime.params import SimParams
    from twin.sim.scenarios import SCENARIOS

    folder = tmp_path / "f"
    folder.mkdir()
    base = Base(SCENARIOS["stale-empty-ring"].config, SimParams(prefill_radix_tokens=0))
    res = run_trial(base, Trial(requests=(Req(0.0, 512),)),
                    trace_out=str(folder / "repro.jsonl.gz"))
    assert res.status == "completed"
    assert confirm_on_hardware(folder) == CONFIRMED
    with gzip.open(folder / "repro.jsonl.gz", "rt") as fh:
        lines = fh.read().splitlines()
    last = json.loads(lines[-1])
    assert last.get("status") == "completed", last
    last["status"] = "wedged"
    with gzip.open(folder / "repro.jsonl.gz", "wt") as fh:
        fh.write("\n".join([*lines[:-1], json.dumps(last)]) + "\n")
    assert confirm_on_hardware(folder).startswith("not confirmed: hardware ended completed")


@pytest.mark.parametrize("fixed", [False, True], ids=["today", "with-the-fix"])
def test_lost_staging_req_writes_wrong_bytes_on_real_ranks_unless_fixed(fixed: bool) -> None:
    """The explorer's finding on real processes: a lost STAGING_REQ completes a room whose
    first chunk never landed (the decode ranks' byte check finds it); with
    success-after-outstanding and lost-control-recovery every byte lands."""
    from twin.hw.launcher import HwOptions
    from twin.hw.run import run_hw
    from twin.sim.scenarios import SCENARIOS

    sc = SCENARIOS["lost-staging-req"]
    cfg = sc.config.replace(fixes=sc.fixes) if fixed else sc.config
    result = run_hw(cfg, sc.workload(), faults=list(sc.faults), params=sc.params,
                    options=HwOptions(wedge_window_s=15.0, timeout_s=120.0))
    s = result.summary()
    if fixed:
        assert s["status"] == "completed" and s["verified"] == 3, s
    else:
        assert s["status"] == "corrupted", s
        assert any("wrong elements" in c for c in s["corruption"]), s
