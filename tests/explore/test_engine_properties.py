"""Properties of the explorer's engine itself, over trials Hypothesis draws through the
explorer's own strategies: a trial's run is a pure function of the trial, a simulated finding's
trace replays to the same verdict, and a shrink never trades the signature nor grows."""

from __future__ import annotations

import random
from pathlib import Path

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from twin.explore.oracles import run_trial
from twin.explore.shrink import rank, shrink
from twin.explore.strategies import Strategies, gen_request, generate
from twin.explore.trial import Base, Req, Trial
from twin.replay import replay_sim
from twin.runtime.params import SimParams
from twin.sim.scenarios import SCENARIOS

SC = SCENARIOS["default"]
BASE = Base(SC.config, SimParams(prefill_radix_tokens=0, wedge_window_s=5.0))
SETTINGS = settings(max_examples=12, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def trial_of(seed: int, base: Base = BASE) -> Trial:
    return generate(random.Random(seed), base, Strategies())


@SETTINGS
@given(seed=st.integers(min_value=0, max_value=10**6))
def test_a_trial_runs_the_same_every_time(seed: int) -> None:
    t = trial_of(seed)
    a, b = run_trial(BASE, t), run_trial(BASE, Trial.from_json(t.to_json()))
    assert (a.status, a.signature, a.coverage) == (b.status, b.signature, b.coverage)


@SETTINGS
@given(seed=st.integers(min_value=0, max_value=10**6))
def test_a_simulated_trial_replays_to_its_verdict(seed: int, tmp_path_factory) -> None:  # type: ignore[no-untyped-def]
    t = trial_of(seed).with_(schedule="")
    path = Path(tmp_path_factory.mktemp("t")) / "t.jsonl.gz"
    res = run_trial(BASE, t, trace_out=str(path))
    if res.status in ("invalid", "error", "livelock"):
        return
    assert replay_sim(str(path)).status == res.status


@settings(SETTINGS, max_examples=6)
@given(seed=st.integers(min_value=0, max_value=10**6), extra=st.integers(0, 2))
def test_shrinking_keeps_the_signature_and_never_grows(seed: int, extra: int) -> None:
    """The stale-watermark wedge with noise around it (more requests, another seed)."""
    sc = SCENARIOS["stale-empty-ring"]
    base = Base(sc.config, BASE.params, ("stale-empty-ring-watermark",))
    rng = random.Random(seed)
    core = (Req(0.0, 1536), Req(0.5, 1792), Req(1.0, 512))
    noise = tuple(gen_request(rng, sc.config, 1.0 + 0.1 * (i + 1)) for i in range(extra))
    t = Trial(requests=core + noise, seed=seed % 1000)
    sig = run_trial(base, t).signature
    assume(sig is not None)
    assert sig is not None
    res = shrink(base, t, sig, max_runs=25)
    assert res.result.signature == sig
    assert rank(res.trial) <= rank(t)
    assert len(res.trial.requests) <= len(t.requests)
