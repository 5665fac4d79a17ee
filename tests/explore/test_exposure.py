"""The exposure label: would SGLang 0.5.23 meet a finding (``twin/explore/exposure.py``).

A finding that needs a defect is ``not exposed``, naming the defect; the lost-STAGING_REQ
corruption, reproducible with SGLang's defaults, is ``exposed`` with SGLang's own decode code
from the wheel deciding what the twin decided; the wheel check finds a decode rank that
behaves otherwise; a missing wheel leaves the label ``unchecked`` with the reason. Tests that
run SGLang's code need the wheel (a failure without it, a skip only with TWIN_OFFLINE=1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from twin.cli import cli
from twin.core import events as ev
from twin.explore.exposure import (
    EXPOSED,
    NOT_EXPOSED,
    UNCHECKED,
    DecodeLog,
    check_decode,
    exposure,
    sglang_base,
)
from twin.explore.oracles import run_trial
from twin.explore.trial import Base, Req, Trial
from twin.sim.scenarios import SCENARIOS

DATA = Path(__file__).parent / "data"
LOST_REQ = Trial(requests=(Req(0.0, 272),), faults=("drop:STAGING_REQ:nth=3",))
"""docs/defects.md: prefill TP1 -> decode TP2, 16 + 1 pages, chunk 0's STAGING_REQ to the
second decode rank lost; decode completes the room with 16 of 17 pages never written."""


def _data(name: str) -> tuple[Base, Trial]:
    d = json.loads((DATA / name).read_text())
    return Base.from_json(d["base"]), Trial.from_json(d["trial"])


def _lost_req_base(**changes: object) -> Base:
    sc = SCENARIOS["lost-staging-req"]
    return Base(sc.config.replace(**changes), sc.params)


def test_a_finding_that_needs_a_defect_is_not_exposed() -> None:
    base, trial = _data("no-release-room-leak-trial.json")
    assert base.defects == ("no-release-room",)
    found = run_trial(base, trial)
    assert found.signature is not None and found.signature[0] == "leak"
    assert found.needs == ["no-release-room"]
    told = exposure(base, trial, found.signature[0], needs_defects=tuple(found.needs))
    assert told.label == NOT_EXPOSED
    assert "ends failed with no finding" in told.detail
    assert "needs defect no-release-room" in told.detail
    # Not told what it needs, the label finds the switch itself: on alone over SGLang's
    # defaults, it brings the verdict back.
    searched = exposure(base, trial, found.signature[0])
    assert searched.label == NOT_EXPOSED
    assert "defect no-release-room (fixed upstream) alone brings it back" in searched.detail


def test_the_lost_staging_req_corruption_is_exposed_and_the_wheel_agrees(
        sglang_reference: object) -> None:
    base = _lost_req_base()
    assert not base.defects and not base.cfg.fixes
    found = run_trial(base, LOST_REQ)
    assert found.signature is not None and found.signature[0] == "corrupted:incomplete"
    told = exposure(base, LOST_REQ, found.signature[0])
    assert told.label == EXPOSED, told.detail
    assert "still ends corrupted:incomplete" in told.detail
    assert "decode code from the wheel made the same decisions" in told.detail
    assert exposure(base, LOST_REQ, found.signature[0]) == told  # deterministic
    # Every input of both decode ranks was fed to SGLang's code, none left out.
    log = DecodeLog()
    run_trial(sglang_base(base), LOST_REQ, tap=log)
    check = check_decode(base.config(LOST_REQ), log)
    assert sorted(check.agreed) == ["d0g0r0", "d0g0r1"]
    assert check.agreed == {n: len(steps) for n, steps in log.steps.items()}
    assert not check.differs and not check.unchecked and not check.unavailable
    # The corrupting decision is among them: d0g0r1 concludes Success with one chunk scattered.
    concluded = [e for _, _, effects in log.steps["d0g0r1"] for e in effects
                 if isinstance(e, ev.RoomConcluded)]
    scattered = [e for _, _, effects in log.steps["d0g0r1"] for e in effects
                 if isinstance(e, ev.StartScatter)]
    assert [(c.room, c.status) for c in concluded] == [(0, "Success")]
    assert [s.chunk_idx for s in scattered] == [1]


def test_the_wheel_check_finds_a_decode_rank_that_decides_otherwise(
        sglang_reference: object) -> None:
    """The comparison has teeth: a run with ``no-release-room`` on (a failed room's unscattered
    allocations never freed), checked as if it were SGLang's, differs where SGLang's
    release_room frees them and broadcasts the watermark; the same run without the defect
    agrees, and a twin decision struck from the record is missed."""
    base = Base(_lost_req_base(deferred_decode_kv_release=False).cfg, SCENARIOS[
        "lost-staging-req"].params, ("no-release-room",))
    trial = Trial(requests=(Req(0.0, 272),), faults=("fail-transfer:nth=1",))
    cfg = base.config(trial)
    log = DecodeLog()
    run_trial(base, trial, tap=log, defects=base.defects)
    assert "defects on (no-release-room)" in check_decode(
        cfg, log, defects=base.defects).unchecked_text()
    check = check_decode(cfg, log)
    assert check.differs.startswith("d0g0r0 input 4 of 4"), check.differs
    assert "frames: the twin [], SGLang [('p0g0r0', [b'WATERMARK'" in check.differs
    clean = DecodeLog()
    run_trial(base, trial, tap=clean, defects=())
    agreed = check_decode(cfg, clean)
    assert not agreed.differs and not agreed.unchecked and sum(agreed.agreed.values()) > 0
    # Strike the twin's conclusion of the room on one rank: SGLang's still concludes it.
    steps = clean.steps["d0g0r1"]
    at = next(i for i, (_, _, fx) in enumerate(steps)
              if any(isinstance(e, ev.RoomConcluded) for e in fx))
    t, event, effects = steps[at]
    steps[at] = (t, event, [e for e in effects if not isinstance(e, ev.RoomConcluded)])
    assert "concluded: the twin [], SGLang [(0, 'Failed')]" in check_decode(cfg, clean).differs


def test_a_restarted_decode_rank_is_checked_as_a_fresh_one(sglang_reference: object) -> None:
    base, trial = _data("decode-server-restart-trial.json")
    plain = sglang_base(base)
    log = DecodeLog()
    run_trial(plain, trial, tap=log)
    check = check_decode(plain.config(trial), log)
    assert not check.differs and not check.unchecked
    assert "d0g0r1 came back empty at 103.000 ms, checked as a fresh rank" in check.notes
    assert check.agreed == {n: len(steps) for n, steps in log.steps.items()}


def test_a_missing_wheel_leaves_the_label_unchecked(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    missing = tmp_path / "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"
    monkeypatch.setenv("TWIN_SGLANG_WHEEL", str(missing))
    heard: list[str] = []
    told = exposure(_lost_req_base(), LOST_REQ, "corrupted:incomplete", note=heard.append)
    assert told.label == UNCHECKED
    assert told.detail.startswith(
        f"SGLang 0.5.23 wheel unavailable: TWIN_SGLANG_WHEEL={missing}: no such file; with "
        f"SGLang's behaviour (no defect, no fix) it still ends corrupted:incomplete"), told.detail
    assert heard == []  # nothing was downloaded


def test_findings_carry_the_label(tmp_path: Path) -> None:
    """``findings.json`` (``sglang_exposure``), ``findings.md`` and the ``finding`` line."""
    out = tmp_path / "camp"
    res = CliRunner().invoke(cli, [
        "explore", "--scenario", "stale-empty-ring", "--defect", "stale-empty-ring-watermark",
        "--no-faults", "--seed", "1", "--runs", "24", "--shrink-runs", "30", "--out",
        str(out)], catch_exceptions=False)
    assert res.exit_code == 3, res.output
    data = json.loads((out / "findings.json").read_text())
    labels = {f["root"]: f["sglang_exposure"] for f in data["findings"]}
    stale = [e for root, e in labels.items() if "needs stale-empty-ring-watermark" in root]
    assert stale and all(e["label"] == NOT_EXPOSED for e in stale)
    assert all("needs defect stale-empty-ring-watermark" in e["detail"] for e in stale)
    assert "SGLang 0.5.23: not exposed" in res.stderr
    md = (out / "findings.md").read_text()
    assert "| SGLang 0.5.23 |" in md and "**not exposed**: with SGLang's behaviour" in md
    state = json.loads((out / "state.json").read_text())  # a resumed campaign keeps it
    assert [f["sglang_exposure"] for f in state["findings"]] == \
        [f["sglang_exposure"] for f in data["findings"]]
