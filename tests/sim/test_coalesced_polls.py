"""Coalesced deferral polls (``TwinConfig.worker_polls``) give the fed polls' run exactly.

Every comparison holds a coalesced run to a fed one (``SimParams(coalesce_polls=False)``) of
the same deployment, workload, faults and seed: summaries, verdicts, diagnoses, per-node and
per-request deferral counts. Storm probes (thousands of 1 ms re-polls), a run cut by
``until``, a crash, every built-in scenario and an explore campaign's trials; then both forms'
traces replay clean.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from twin.core import events as ev
from twin.core.config import ConfigError, TwinConfig
from twin.core.defects import Defects
from twin.core.fixes import LOST_CONTROL_RECOVERY
from twin.runtime.faults import parse_fault
from twin.runtime.params import SimParams
from twin.sim.engine import Simulation, sim_config
from twin.sim.runner import SimResult, run_sim
from twin.sim.scenarios import SCENARIOS
from twin.workloads.spec import parse_workload_spec

STORM = "shared_prefix:groups=2,per_group=40,system=24000,question=2000,output=8,rate=40,seed=1"
STORM_CFG = TwinConfig(chunked_prefill_size=4096, staging_pool_size_mb=256)
FED = SimParams(coalesce_polls=False)
CO = SimParams()
_FORM_KEYS = ("wall_seconds", "events", "worker_polls", "polls_accounted")


def _same_run(result: SimResult) -> dict[str, Any]:
    """What must not depend on the form of polls: the summary (less its wall time and input
    counts), each request's deferrals and the nodes' deferral counts."""
    s = {k: v for k, v in result.summary().items() if k not in _FORM_KEYS}
    sim = result.sim
    s["request_deferrals"] = {r.room: r.deferrals for r in sim.requests.values()}
    s["node_deferrals"] = dict(sim.metrics.deferrals)
    s["polls"] = sim.polls
    return s


def _both(cfg: TwinConfig, workload: str, **kw: Any) -> tuple[SimResult, SimResult]:
    runs = []
    for params in (FED, CO):
        runs.append(run_sim(cfg, parse_workload_spec(workload), params=params, **kw))
    return runs[0], runs[1]


def test_a_deferral_storm_is_the_same_run_with_far_fewer_inputs() -> None:
    fed, co = _both(STORM_CFG, STORM)
    assert fed.summary()["worker_polls"] == "fed"
    assert co.summary()["worker_polls"] == "coalesced"
    assert _same_run(co) == _same_run(fed)
    deferrals = sum(fed.sim.metrics.deferrals.values())
    assert deferrals > 100_000  # a real storm
    assert co.sim.inputs * 5 < fed.sim.inputs
    assert co.sim.polls == fed.sim.inputs


def test_a_run_cut_by_until_counts_the_polls_due_before_the_stop() -> None:
    fed, co = _both(STORM_CFG, STORM, until=7.5)
    assert fed.summary()["status"] == "until"
    assert _same_run(co) == _same_run(fed)


def test_recording_reports_each_deferral_and_gives_the_same_run() -> None:
    """A recorded coalesced run reports a ``Deferred`` per accounted poll (an unrecorded one
    counts them): the same counts as fed, the same effects bar the poll requests."""

    class Effects:
        def __init__(self) -> None:
            self.deferred = 0
            self.counted = 0

        def write_input(self, t: float, node: str, event: Any) -> None:
            pass

        def write_effects(self, t: float, node: str, effects: list[Any]) -> None:
            for e in effects:
                if type(e) is ev.Deferred:
                    self.deferred += 1
                elif type(e) is ev.DeferralsCounted:
                    self.counted += sum(e.counts)

        def write_sys(self, t: float, node: str, record: dict[str, Any]) -> None:
            pass

    seen = Effects()
    wl = parse_workload_spec(STORM)
    recorded = run_sim(STORM_CFG, wl, params=CO, recorder=seen, until=7.5)
    fed = run_sim(STORM_CFG, wl, params=FED, until=7.5)
    assert seen.counted == 0
    assert seen.deferred == sum(fed.sim.metrics.deferrals.values())
    assert _same_run(recorded) == _same_run(fed)


def test_a_crash_and_a_fault_give_the_same_run() -> None:
    cfg = TwinConfig(chunked_prefill_size=4096, staging_pool_size_mb=256)
    wl = "poisson:n=300,rate=60,input=12000~6000,output=16,seed=4"
    for fault in ("crash:p0g0r1:at=1.5", "drop:WATERMARK:nth=40", "fail-transfer:p=0.02"):
        fed, co = _both(cfg, wl, faults=[parse_fault(fault)], seed=3)
        assert _same_run(co) == _same_run(fed), fault


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_scenario_with_its_defects_is_the_same_run(name: str) -> None:
    sc = SCENARIOS[name]
    runs = []
    for coalesce in (False, True):
        params = sc.params.replace(coalesce_polls=coalesce)
        runs.append(run_sim(sc.config, sc.workload(),
                            defects=Defects.of(sc.base_defects + sc.defects),
                            faults=sc.fault_specs(), params=params,
                            request_overrides=sc.overrides, max_concurrency=sc.max_concurrency))
    assert _same_run(runs[1]) == _same_run(runs[0])


def test_an_explore_campaigns_trials_judge_the_same() -> None:
    """The trials a campaign draws from its seed (faults, deployments, workloads, orderings)
    end with the same status, signature, diagnosis and coverage in both forms."""
    import random

    from twin.explore.oracles import run_trial
    from twin.explore.strategies import Strategies, generate
    from twin.explore.trial import Base
    from twin.sim.scenarios import SCENARIOS as SC

    sc = SC["default"]
    params = sc.params.replace(prefill_radix_tokens=0, decode_radix_tokens=0,
                               wedge_window_s=min(sc.params.wedge_window_s, 5.0))
    fed = Base(sc.config, params.replace(coalesce_polls=False))
    co = Base(sc.config, params)
    rng = random.Random(7)
    statuses = set()
    for _ in range(16):
        trial = generate(rng, fed, Strategies())
        a, b = run_trial(fed, trial), run_trial(co, trial)
        assert (a.status, a.signature, a.diagnosis, a.coverage) == \
            (b.status, b.signature, b.diagnosis, b.coverage), trial
        statuses.add(a.status)
    assert len(statuses) > 1  # the seed drew more than clean runs


def test_both_forms_traces_replay_clean(tmp_path: Path) -> None:
    """A trace file written by ``trace_out`` feeds every poll (real ranks replay it too); a
    coalesced run's own recording says so in its header and replays clean in simulation,
    while the hardware replay refuses it with a clear error."""
    from twin.hw.replay import replay_hw
    from twin.hw.run import HwInputError
    from twin.replay import replay_sim
    from twin.runtime.header import trace_header
    from twin.sim.runner import outcome_record
    from twin.trace.format import TraceWriter, open_trace, read_trace

    wl = parse_workload_spec(STORM)
    fed_path = tmp_path / "fed.jsonl.gz"
    run_sim(STORM_CFG, wl, params=CO, until=4.0, trace_out=fed_path)
    co_path = tmp_path / "coalesced.jsonl.gz"
    header = trace_header(sim_config(STORM_CFG, CO), wl, defects=Defects(), faults=[], seed=0,
                          params=CO, request_overrides={}, max_concurrency=None)
    with TraceWriter(co_path, header) as writer:
        writer.close(outcome_record(run_sim(STORM_CFG, wl, params=CO, until=4.0,
                                            recorder=writer)))
    for path, form in ((fed_path, "fed"), (co_path, "coalesced")):
        assert open_trace(str(path)).config.worker_polls == form
        result = replay_sim(str(path))
        assert result.divergence is None, (form, result.divergence)
        assert result.status == "until"
    with pytest.raises(HwInputError, match="coalesced deferral polls"):
        replay_hw(read_trace(co_path))


def test_coalescing_is_off_where_it_cannot_be_exact() -> None:
    assert sim_config(STORM_CFG, CO).worker_polls == "coalesced"
    assert sim_config(STORM_CFG, FED).worker_polls == "fed"
    assert sim_config(STORM_CFG, CO.replace(process_stall_s=0.01)).worker_polls == "fed"
    assert sim_config(STORM_CFG, CO.replace(blocking_kernels=True)).worker_polls == "fed"
    recovery = STORM_CFG.replace(fixes=(LOST_CONTROL_RECOVERY,))
    assert sim_config(recovery, CO).worker_polls == "fed"
    with pytest.raises(ConfigError, match="worker_polls"):
        recovery.replace(worker_polls="coalesced")
    with pytest.raises(ConfigError, match="worker_polls"):
        STORM_CFG.replace(worker_polls="sometimes")


def test_a_config_feeds_every_poll_unless_a_simulation_coalesces() -> None:
    """The config's default (the hardware mode's, the explorer's loopback) feeds every poll;
    a Simulation built directly coalesces where its params allow."""
    assert TwinConfig().worker_polls == "fed"
    sim = Simulation(STORM_CFG, parse_workload_spec(STORM), params=CO)
    assert sim.cfg.worker_polls == "coalesced"
