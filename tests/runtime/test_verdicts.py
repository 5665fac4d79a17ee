"""A verdict counts every request of the workload: one never admitted is unfinished too."""

from __future__ import annotations

from twin.hw.run import HwResult
from twin.runtime.outcome import RunStatus, exit_code
from twin.runtime.requests import RequestState


def _done(room: int) -> RequestState:
    r = RequestState(room=room, rid=room, arrival_s=0.0, input_len=64, output_len=1,
                     prefill_group=0, decode_group=0, decode_prefix_len=0,
                     prefill_prefix_len=0)
    r.status = "Success"
    return r


def _result(stopped: RunStatus, done: int, requests: int) -> HwResult:
    return HwResult(requests=requests, done=[_done(i) for i in range(done)], unfinished=[],
                    wedged=False, diagnosis=[], corruption=[], wall_seconds=1.0,
                    run_seconds=1.0, events=10, stopped=stopped)


def test_an_interrupt_between_admissions_is_not_a_completed_run() -> None:
    """SIGTERM while nothing was in flight and 363 of 400 requests were still to come: the run
    is interrupted (exit 1), not completed (exit 0)."""
    result = _result(RunStatus.INTERRUPTED, done=37, requests=400)
    assert result.status is RunStatus.INTERRUPTED and result.exit_code == exit_code(
        RunStatus.INTERRUPTED) != 0
    assert result.verdict.unfinished == 363


def test_a_run_where_every_request_ended_is_completed() -> None:
    result = _result(RunStatus.INTERRUPTED, done=40, requests=40)
    assert result.status is RunStatus.COMPLETED and result.exit_code == 0


def test_until_with_requests_still_to_come_is_until() -> None:
    assert _result(RunStatus.UNTIL, done=5, requests=40).status is RunStatus.UNTIL


def test_until_is_recorded_as_until() -> None:
    """The trace's Outcome says what the console says for a run --until stopped (it said
    'interrupted', the word for Ctrl-C and signals); both modes write it through record()."""
    from twin.runtime.outcome import RunStatus, Verdict

    v = Verdict(RunStatus.UNTIL, requests=5, completed=2, failed=0, unfinished=3)
    rec = v.record("stopped at --until 2 s with 3 request(s) in flight")
    assert rec["status"] == "until" and v.exit_code == 0
    assert rec["diagnosis"] == ["stopped at --until 2 s with 3 request(s) in flight"]
