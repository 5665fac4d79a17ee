"""The two findings of ``twin explore --budget 120 --seed 7`` with every other fix on, gone with
``answer-requester-only`` (docs/defects.md, "`lost-control-recovery` answers every re-request
to every writer"): a storm of re-requests each answered to every writer and subscriber."""

from __future__ import annotations

import json
from pathlib import Path

from twin.core.fixes import ANSWER_REQUESTER_ONLY, LOST_CONTROL_RECOVERY
from twin.explore.oracles import run_trial
from twin.explore.trial import Base, Trial

DATA = Path(__file__).parent / "data"


def _load(name: str) -> tuple[Base, Trial]:
    data = json.loads((DATA / name).read_text())
    base = Base.from_json(data["base"])
    assert LOST_CONTROL_RECOVERY in base.cfg.fixes and ANSWER_REQUESTER_ONLY not in base.cfg.fixes
    return base, Trial.from_json(data["trial"])


def _with_fix(base: Base) -> Base:
    return Base(base.cfg.replace(fixes=(*base.cfg.fixes, ANSWER_REQUESTER_ONLY)), base.params,
                base.defects)


def test_the_loopback_re_request_livelock_is_gone() -> None:
    """Prefill TP8 -> decode TP1, page size 1, 32-token chunks, three requests, no fault: the
    re-requests and their answers to all eight writers pile up past the loopback's limit of
    pending actions; answered to the requester only and backed off, the schedule completes."""
    base, trial = _load("loopback-livelock-all-fixes-trial.json")
    assert not trial.faults and trial.schedule
    before = run_trial(base, trial)
    assert before.signature == ("livelock", "livelock: N actions pending"), before.signature
    after = run_trial(_with_fix(base), trial)
    assert (after.status, after.signature, after.safety) == ("completed", None, [])


def test_a_restarted_prefill_server_no_longer_storms_until_the_waiting_timeout() -> None:
    """``restart:p0g0r3:at=0.003:down=0.01:scope=server``, prefill TP8 -> decode TP1: the
    restarted writers' chunks stay deferred until decode's waiting timeout. With every re-request
    answered to everyone, the settling run gave up at 1.5 M inputs (``wedged: ... no prefill
    worker holds its write``); backed off, it reaches the timeout, which fails the rooms (a
    fault on their path): settled, as in SGLang without the recovery."""
    base, trial = _load("prefill-server-restart-storm-trial.json")
    assert trial.faults == ("restart:p0g0r3:at=0.003:down=0.01:scope=server",)
    after = run_trial(_with_fix(base), trial)
    assert (after.status, after.signature, after.safety, after.corruption) == \
        ("wedged", None, [], [])
