"""Every built-in scenario shows its symptom with its defects on and runs clean with them off.

Also the details the upstream write-ups report: the warmup stall needs both watermark fixes
(seed 002), and the radix-cache grid skew corrupts data rather than only wedging (seeds 000/003).
"""

from __future__ import annotations

import re

import pytest

from twin.core.defects import (
    ALL_DEFECTS,
    NO_GRID_ALIGNMENT,
    NO_SUBSCRIBER_SNAPSHOT,
    STALE_EMPTY_RING_WATERMARK,
    Defects,
)
from twin.runtime.outcome import EXIT_CORRUPTION, EXIT_OK, EXIT_WEDGE
from twin.sim.runner import SimResult, run_sim
from twin.sim.scenarios import SCENARIOS, Scenario, check_scenario


def _run(sc: Scenario, defects: tuple[str, ...]) -> SimResult:
    return run_sim(sc.config, sc.workload(), defects=Defects.of(sc.base_defects + defects),
                   faults=sc.fault_specs(), params=sc.params, request_overrides=sc.overrides,
                   max_concurrency=sc.max_concurrency)


@pytest.mark.parametrize("name", sorted(n for n, s in SCENARIOS.items() if not s.finding))
def test_scenario_symptom_on_and_clean_off(name: str) -> None:
    sc = SCENARIOS[name]
    got = check_scenario(sc)
    want_on = {"clean": "completed", "wedge": "wedged", "corruption": "corrupted"}[sc.symptom]
    assert got["ok"] is True and got["on"] == want_on, (name, got)
    assert str(got["off"]).startswith(sc.clean_status), (name, got)


def test_scenarios_that_fail_a_room_by_design_say_so() -> None:
    """With the defects off, an injected abort or send error, an inflated send or an unaligned
    prefix fails exactly one room: the run ends ``failed`` (exit 5), not ``completed``."""
    from twin.runtime.outcome import EXIT_FAILED

    by_design = {n: s.fails_by_design for n, s in SCENARIOS.items() if s.fails_by_design}
    assert by_design == {"release-room": (0,), "chunk-ready-error": (0,),
                         "slice-fallback": (1,), "unaligned-prefix": (1,)}
    r = _run(SCENARIOS["release-room"], ())
    assert r.status == "failed" and r.exit_code == EXIT_FAILED


def test_multi_target_retry_finding_corrupts_todays_protocol() -> None:
    """The upstream race the twin found: with every defect off, a chunk re-enqueued after a
    deferral on its second decode session rewrites the first session's region, which was
    already scattered and reallocated to another room."""
    sc = SCENARIOS["multi-target-retry"]
    assert sc.finding and sc.defects == () and sc.base_defects == ()
    assert check_scenario(sc) == {
        "on": "corrupted", "off": "completed (fix multi-target-retry-resume)", "ok": True}
    r = _run(sc, ())
    kinds = {v.kind for v in r.sim.integrity.violations}
    assert "overwrite" in kinds
    first = next(v for v in r.sim.integrity.violations if v.kind == "overwrite")
    assert first.node == "d0g0r0" and "unscattered data of room" in first.detail
    # Without the slow decode rank, the decode loop's cadence decides: staging is freed once
    # per decode step, and a slower step holds watermarks back the way the injected delay
    # does. At the default step (3.2 ms) the traffic runs clean; at 10 ms (a larger batch or
    # model) it corrupts on its own.
    for step, want in ((sc.params.decode_step_s, "completed"), (0.010, "corrupted")):
        params = sc.params.replace(decode_step_s=step)
        got = {run_sim(sc.config, sc.workload(), params=params, seed=s).status.value
               for s in range(3)}
        assert got == {want}, (step, got)


@pytest.mark.parametrize("name", sorted(n for n, s in SCENARIOS.items()
                                         if s.finding and s.fixes and n != "multi-target-retry"))
def test_finding_shows_its_symptom_and_its_fix_removes_it(name: str) -> None:
    sc = SCENARIOS[name]
    got = check_scenario(sc)
    want_on = {"clean": "completed", "wedge": "wedged", "corruption": "corrupted"}[sc.symptom]
    assert got["on"] == want_on and got["ok"], (name, got)


def test_default_is_clean_and_has_no_defects() -> None:
    sc = SCENARIOS["default"]
    assert sc.symptom == "clean" and sc.defects == () and sc.base_defects == ()
    r = _run(sc, ())
    s = r.summary()
    assert r.exit_code == EXIT_OK
    assert s["completed"] == s["requests"] == 128 and s["failed"] == 0
    assert s["diagnosis"] == [] and s["corruption"] == []


def test_every_defect_has_a_scenario() -> None:
    covered = {d for sc in SCENARIOS.values() for d in sc.defects}
    assert covered == set(ALL_DEFECTS)


# -- warmup stall (seed 002) ------------------------------------------------------------------
WARMUP = SCENARIOS["warmup-stall"]


def test_warmup_stall_both_defects_wedges_partway() -> None:
    r = _run(WARMUP, (STALE_EMPTY_RING_WATERMARK, NO_SUBSCRIBER_SNAPSHOT))
    s = r.summary()
    assert s["requests"] == 11
    assert r.wedged and r.exit_code == EXIT_WEDGE
    assert 0 < s["completed"] < 11, "wedges partway: some, not all, warmup requests finish"
    assert s["failed"] == 0


def test_warmup_stall_only_allocator_fixed_still_wedges() -> None:
    """The seed's control arm: fixing the empty-ring reset alone is not enough."""
    r = _run(WARMUP, (NO_SUBSCRIBER_SNAPSHOT,))
    s = r.summary()
    assert r.wedged and r.exit_code == EXIT_WEDGE
    assert s["completed"] < 11
    assert any("never sent to this session" in line for line in s["diagnosis"])


def test_warmup_stall_only_snapshot_fixed_runs() -> None:
    r = _run(WARMUP, (STALE_EMPTY_RING_WATERMARK,))
    assert r.summary()["completed"] == 11 and not r.wedged


def test_warmup_stall_both_fixed_all_eleven_finish() -> None:
    r = _run(WARMUP, ())
    s = r.summary()
    assert s["completed"] == 11 and s["unfinished"] == 0 and s["failed"] == 0
    assert r.exit_code == EXIT_OK and s["diagnosis"] == []


def test_warmup_wedge_diagnosis_is_actionable() -> None:
    """The diagnosis names the waiting room, its chunk, and the watermark it needs versus the
    one it knows (and what decode's allocator would allow)."""
    r = _run(WARMUP, (STALE_EMPTY_RING_WATERMARK, NO_SUBSCRIBER_SNAPSHOT))
    lines = r.diagnosis
    assert lines[0].startswith("wedge: ") and "rooms" in lines[0]
    wait = [x for x in lines if "waits for watermark" in x]
    assert wait, lines
    m = re.search(r"room (\d+) chunk (\d+) -> (d\d+g\d+r\d+): waits for watermark: needs round "
                  r"(\d+) end (\d+), prefill knows \((\d+), (\d+)\)", wait[0])
    assert m is not None, wait[0]
    room = int(m[1])
    unfinished = {rq.room for rq in r.sim.requests.values() if not rq.finished}
    assert room in unfinished
    assert "decode's watermark" in wait[0]


def test_stale_ring_diagnosis_names_the_allocation() -> None:
    sc = SCENARIOS["stale-empty-ring"]
    r = _run(sc, sc.defects)
    text = "\n".join(r.diagnosis)
    assert r.wedged
    assert re.search(r"room \d+ chunk \d+ -> d\d+g\d+r\d+: waits for watermark", text), text
    assert "stale" in text or "ring is empty" in text or "would admit" in text, text


def test_release_room_diagnosis_names_the_pinning_allocation() -> None:
    sc = SCENARIOS["release-room"]
    r = _run(sc, sc.defects)
    text = "\n".join(r.diagnosis)
    assert r.wedged
    assert re.search(r"watermark \(\d+, \d+\) is pinned by alloc \d+ \[\d+, \d+\) round \d+",
                     text), text


# -- radix grid (seeds 000/003) ----------------------------------------------------------------
RADIX = SCENARIOS["radix-grid"]


def test_radix_grid_without_alignment_corrupts_named_rooms_and_chunks() -> None:
    r = _run(RADIX, (NO_GRID_ALIGNMENT,))
    assert r.exit_code == EXIT_CORRUPTION and r.summary()["corrupted"]
    assert r.corruption
    rooms = set(r.sim.requests)
    named = 0
    for v in r.corruption:
        m = re.search(r"room (\d+)", v)
        assert m is not None, v
        assert int(m[1]) in rooms
        named += "chunk" in v or "pages" in v
    assert named, r.corruption[:5]


def test_radix_grid_with_alignment_is_clean() -> None:
    r = _run(RADIX, ())
    s = r.summary()
    assert r.corruption == [] and r.exit_code == EXIT_OK
    assert s["completed"] == s["requests"] > 0
    assert any(rq.decode_prefix_len > 0 for rq in r.sim.requests.values()), \
        "the scenario must exercise the decode radix cache"
