"""What the explorer's strategies reach: fault kinds it has not fired yet, a fixed-size prefill
staging buffer below a grid slot (the path of the silent slice fallback), a failed CHUNK_READY
send of a room's last chunk, and the leak and one-sided-abort rules of the loopback oracle."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from twin.core.config import ServerSide
from twin.explore.coverage import FAULT_KEYS, CoverageRecorder, fault_key
from twin.explore.faultmodel import MODELS, classes_of, fault_class
from twin.explore.oracles import judge, run_trial
from twin.explore.schedule import Driver, run_loopback
from twin.explore.strategies import Strategies, fixed_buffers, gen_fault, generate
from twin.explore.trial import Base, Deploy, Req, Trial
from twin.runtime.faults import check_faults, parse_fault
from twin.runtime.params import SimParams
from twin.sim.scenarios import SCENARIOS

SC = SCENARIOS["default"]
QUIET = SimParams(prefill_radix_tokens=0, decode_radix_tokens=0, wedge_window_s=5.0)
SWALLOWED = "swallowed-chunk-ready-error"
SLICE = "silent-slice-fallback"


@pytest.mark.parametrize("model", ["sglang", "all"])
def test_every_fault_drawn_is_valid_and_keyed(model: str) -> None:
    """Faults drawn over many seeds parse, pass the simulator's checks (no fail-send of a frame
    decode sends), and each maps to one of the fault keys the coverage counts: every kind of
    the fault model, and under ``sglang`` only faults SGLang's deployment can meet."""
    cfg = SC.config
    reqs = (Req(0.0, 300), Req(0.01, 20))
    seen: Counter[str] = Counter()
    for i in range(600):
        text = gen_fault(random.Random(i), cfg, reqs, model=model)
        check_faults([parse_fault(text)], cfg, [r.input_len for r in reqs])
        seen[fault_key(text)] += 1
    assert set(seen) == set(MODELS[model])
    assert not any(k.startswith("ft:fail-send:") and k.split(":")[2] in ("STAGING_RSP",
                                                                          "WATERMARK")
                   for k in seen)
    if model == "sglang":
        assert all(fault_class(k).realistic for k in seen)
        assert not any(k.startswith(("ft:dup:", "ft:reorder:", "ft:drop:")) for k in seen)
    else:
        assert set(seen) == set(FAULT_KEYS)


def test_every_fault_kind_has_a_class_saying_where_sglang_meets_it() -> None:
    for key in FAULT_KEYS:
        c = fault_class(key)
        assert c.where and (c.realistic == (key in MODELS["sglang"]))
    assert fault_class("fail-send:STAGING_REQ:nth=1").name == "unraised-send"
    assert fault_class("fail-send:KV_STATUS:nth=1").name == "send-timeout"
    assert fault_class("corrupt:STAGING_REQ:field=chunk_idx:value=1").name == "malformed-field"
    assert classes_of(["crash:p0g0r0:at=1", "delay:WATERMARK:ms=5", "restart:d0g0r0:at=1:"
                       "down=1"]) == ["dead-peer", "late-frame"]


def test_fault_kinds_no_trial_fired_are_preferred() -> None:
    """With one kind not yet fired, about half the draws take it (one in 35 without)."""
    cfg = SC.config
    reqs = (Req(0.0, 300),)
    want = "ft:fail-send:CHUNK_READY"
    plain = sum(fault_key(gen_fault(random.Random(i), cfg, reqs, model="all")) == want
                for i in range(400))
    preferred = sum(fault_key(gen_fault(random.Random(i), cfg, reqs, (want,), "all")) == want
                    for i in range(400))
    assert plain < 40 and preferred > 160


def test_the_coverage_counts_the_faults_that_fired() -> None:
    rec = CoverageRecorder(1 << 20)
    rec.write_sys(0.0, "driver", {"type": "FaultInjected", "fault": "drop:STAGING_RSP:nth=2",
                                  "detail": ""})
    rec.write_sys(0.0, "driver", {"type": "FaultInjected", "fault": "crash:p0g0r0:at=0.1",
                                  "detail": ""})
    assert {"ft:drop:STAGING_RSP", "ft:crash"} <= rec.keys


def test_fixed_buffers_include_one_below_a_grid_slot() -> None:
    cfg = SC.config.replace(chunked_prefill_size=256)
    full = cfg.full_chunk_pages
    assert fixed_buffers(cfg) == [full // 2, full, 4 * full]
    drawn = {generate(random.Random(i), Base(SC.config, QUIET), Strategies()).deploy
             .prefill_staging_pages for i in range(300)}
    assert None in drawn and len(drawn) > 3


def _small_buffer_trial() -> Trial:
    """A full 16-page chunk through an 8-page fixed prefill staging buffer."""
    return Trial(Deploy(chunked_prefill_size=256, prefill_staging_pages=8),
                 (Req(0.0, 256),))


def test_a_buffer_below_a_chunk_fails_the_room_by_design_today() -> None:
    res = run_trial(Base(SC.config, QUIET), _small_buffer_trial())
    assert res.status == "failed" and res.signature is None
    assert any("cannot fit" in r for r in res.failures)


def test_the_silent_slice_fallback_wedges_alone_through_a_small_buffer() -> None:
    res = run_trial(Base(SC.config, QUIET, (SLICE,)), _small_buffer_trial())
    assert res.signature is not None and res.signature[0] == "wedged"
    assert res.needs == [SLICE]


def _last_chunk_ready_fails() -> Trial:
    """Prefill TP8 -> decode TP1, one one-page request: the second writer's CHUNK_READY, its
    last chunk's, fails to send after that writer concluded Success."""
    return Trial(Deploy(prefill_tp=8, decode_tp=1, chunked_prefill_size=64),
                 (Req(0.0, 1),), ("fail-send:CHUNK_READY:nth=2:room=0",))


def test_a_failed_last_chunk_ready_send_fails_the_room() -> None:
    """SGLang's send raises before the room concludes Success; the twin feeds the failure back
    after the step, so the rank tells decode Failed, ahead of its Success on the same socket."""
    res = run_trial(Base(SC.config, QUIET), _last_chunk_ready_fails())
    assert res.status == "failed" and res.signature is None
    assert any("CHUNK_READY send" in r for r in res.failures)


def test_swallowing_that_error_wedges_the_room() -> None:
    res = run_trial(Base(SC.config, QUIET, (SWALLOWED,)), _last_chunk_ready_fails())
    assert res.signature is not None and res.signature[0] == "wedged"
    assert res.needs == [SWALLOWED] and "CHUNK_READY" in res.signature[1]


class _PrefillAbort(Driver):
    """Oldest first; room 0 is aborted on its prefill side after ``after`` steps."""

    def __init__(self, after: int) -> None:
        super().__init__("random:0")
        self.after = after
        self.steps = 0

    def pick(self, cluster, choices):  # type: ignore[no-untyped-def]
        self.steps += 1
        return choices[0]

    def aborts(self, cluster):  # type: ignore[no-untyped-def]
        return [(0, "prefill")] if self.steps == self.after else []


def test_a_prefill_side_abort_is_settled_by_decode_timeout_not_a_wedge() -> None:
    """SGLang tells decode nothing of a prefill-side abort: decode fails the room at its
    waiting timeout. The loopback oracle takes that as the abort's doing, and once every
    timeout fired nothing is left behind."""
    cfg = SC.config.replace(prefill=ServerSide(tp_size=4), chunked_prefill_size=256)
    rec = CoverageRecorder(cfg.ring_bytes)
    run = run_loopback(cfg, [(512, 0, 0)], (), Base(cfg, QUIET).defects_on(), "",
                       rec, driver=_PrefillAbort(3))
    assert run.status == "wedged" and run.aborted == {0} and not run.leaks
    assert judge(run.status, corruption_kinds=[], safety=[], diagnosis=run.diagnosis,
                 failures=run.failures, caused=True, leaks=run.leaks,
                 aborted=run.aborted) is None
    # Not caused by an abort, the same wedge is a finding.
    assert judge(run.status, corruption_kinds=[], safety=[], diagnosis=run.diagnosis,
                 failures=run.failures, caused=True, leaks=run.leaks) is not None


def test_a_leak_after_every_timeout_is_a_finding() -> None:
    sig = judge("failed", corruption_kinds=[], safety=[], diagnosis=[], failures={},
                caused=True, leaks=["d0g0r0 still holds 1 live staging allocation(s)"])
    assert sig == ("leak", "RANK still holds N live staging allocation(s)")


def test_a_finding_with_no_trace_is_not_replayed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from twin.explore.confirm import confirm_on_hardware

    assert confirm_on_hardware(tmp_path).startswith("no trace")


def test_a_finding_that_needs_an_injected_failure_is_not_replayed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A recorded failed transfer cannot happen on real ranks by itself: the finding is marked
    unsupported without starting any (a dropped frame is only an order, and is replayed)."""
    from twin.explore.confirm import confirm_on_hardware

    base = Base(SCENARIOS["stale-empty-ring"].config, QUIET)
    res = run_trial(base, Trial(requests=(Req(0.0, 512),), faults=("fail-transfer:nth=1",)),
                    trace_out=str(tmp_path / "repro.jsonl.gz"))
    assert "ft:fail-transfer" in res.coverage
    assert confirm_on_hardware(tmp_path).startswith("unsupported on hardware: its run needs "
                                                    "fail-transfer")
