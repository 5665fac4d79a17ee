"""The explorer's oracles: run one trial in the simulator and say what, if anything, went wrong.

Three families, checked separately (as deterministic simulation testing keeps them apart):

* **safety** — the integrity model (a write over unscattered data, a ring overrun, a misplaced
  scatter, a room done before its data landed), no overlapping live allocations and no
  watermark moving backwards (``CoverageRecorder``);
* **liveness** — every room ends Success or Failed within the timeouts' reach: a run the
  simulator's monitor calls wedged (no progress for ``wedge_window_s``) is a finding, named by
  the root its roots-first diagnosis puts first. When the trial injected a fault and no defect
  is on, it is first run again past every timeout SGLang has (``settle_window``: decode's
  waiting timeout, prefill's bootstrap timeout, the deferred KV release deadline, Mooncake's
  transfer timeout, the heartbeat): if every request of that run ends and each failed one was
  touched by an injected fault (or names one as its end: an abort, a dead rank), SGLang's own
  timeouts settled the fault's damage and there is no finding. (Without that rerun, a root
  that says decode's waiting timeout will fail the rooms is settled the same way; a wedge with
  a defect on, or with no fault, stands as found);
* **nothing failed without a cause** — a request that failed in a trial with no fault injected
  and no defect on, for a reason other than the ones SGLang fails a request for by design (a
  chunk larger than the ring, a decode prefix that is not page-aligned), is a finding.

A finding's **signature** is ``(kind, root)``: the kind (``corrupted:KIND[+KIND]``, ``unsafe``,
``wedged``, ``failed-without-cause``) and its root with node ids and numbers taken out, so the
same defect found on other ranks, rooms or offsets is one finding.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from twin.explore.coverage import CoverageRecorder, observe_transitions
from twin.explore.trial import Base, InvalidTrial, Trial
from twin.runtime.params import longest_timeout

if TYPE_CHECKING:
    from twin.explore.schedule import Driver

_NODE = re.compile(r"\b[pd]\d+g\d+r\d+\b")
_NUM = re.compile(r"\d+(\.\d+)?")
_BRACKET = re.compile(r"\s*\[[^\]]*blocked item[^\]]*\]")
SETTLED = "at its waiting timeout"
EXPECTED = "crashed by fault"
BY_DESIGN = ("aborted", "staging allocation oversized", "decode prefix", "unaligned",
             "not page-aligned", "not aligned", "staged transfer cannot fit")
"""Failure reasons SGLang gives a request by design: an abort, a chunk larger than the decode
ring, a decode prefix that is not page-aligned, a chunk larger than a fixed-size prefill
staging buffer (PR #31217: ``_do_staging_transfer`` returns -1 and the room fails)."""


def normalise(line: str) -> str:
    """A diagnosis or failure line without node ids, numbers and its trailing ``[...]``."""
    text = line.removeprefix("root: ").split("; injected fault on this path:", 1)[0]
    text = _BRACKET.sub("", text)
    text = _NODE.sub("RANK", text)
    text = re.sub(r"RANK(, RANK)+", "RANKS", text)
    text = _NUM.sub("N", text)
    text = re.sub(r"N(, N){2,}", "N", text)
    text = re.sub(r"\(fault[^)]*\)", "", text)
    return " ".join(text.split())[:160]


@dataclass
class TrialResult:
    """How a trial ended and what it reached. ``signature`` is None for a trial that found
    nothing (or could not run: ``invalid``)."""

    status: str
    signature: tuple[str, str] | None
    coverage: frozenset[str] = frozenset()
    diagnosis: list[str] = field(default_factory=list)
    corruption: list[str] = field(default_factory=list)
    safety: list[str] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    invalid: str = ""
    wall_s: float = 0.0
    log: list[tuple[float, str, str]] = field(default_factory=list)
    needs: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"needs": self.needs, "status": self.status,
                "signature": list(self.signature) if self.signature else None,
                "coverage": sorted(self.coverage), "diagnosis": self.diagnosis,
                "corruption": self.corruption, "safety": self.safety,
                "failures": self.failures, "invalid": self.invalid, "wall_s": self.wall_s}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrialResult:
        sig = d.get("signature")
        return cls(d["status"], (sig[0], sig[1]) if sig else None,
                   frozenset(d.get("coverage", ())), list(d.get("diagnosis", [])),
                   list(d.get("corruption", [])), list(d.get("safety", [])),
                   dict(d.get("failures", {})), d.get("invalid", ""), d.get("wall_s", 0.0),
                   needs=list(d.get("needs", [])))


class Tap(Protocol):
    """A second recorder for one trial's run (``run_trial(tap=...)``): it hears what the
    run's recorder hears, input by input. ``clear`` is called when the run is redone (a
    loopback run on a finer clock), so it holds one run's records."""

    def write_input(self, t: float, node: str, event: Any) -> None: ...

    def write_effects(self, t: float, node: str, effects: list[Any]) -> None: ...

    def write_sys(self, t: float, node: str, record: dict[str, Any]) -> None: ...

    def clear(self) -> None: ...


def judge(status: str, *, corruption_kinds: list[str], safety: list[str],
          diagnosis: list[str], failures: dict[str, int], caused: bool,
          corruption: list[str] | None = None, leaks: list[str] | None = None,
          aborted: set[int] | frozenset[int] = frozenset()) -> tuple[str, str] | None:
    """The signature of what a run found, or None (the oracles' one rule; first match wins:
    corruption, unsafe, wedge, a leak once every timeout fired, failure without a cause)."""
    if corruption_kinds:
        kinds = sorted(set(corruption_kinds))
        root = kinds[0]
        parts = corruption[0].split(": ", 2) if corruption else []
        if len(parts) == 3:  # "kind: node room R: detail"
            root = f"{parts[0]}: {normalise(parts[2])}"
        return (f"corrupted:{'+'.join(kinds)}", root)
    if safety:
        return ("unsafe", normalise(safety[0]))
    if status == "wedged":
        roots = [line for line in diagnosis if line.startswith("root: ")]
        root = normalise(roots[0]) if roots else "no root named"
        if caused and EXPECTED in roots[0] if roots else False:
            return None  # a rank the schedule crashed stops its rooms: that is the fault's
        if roots and all(SETTLED in r or _names_only(r, aborted) for r in roots):
            # Every root ends at decode's waiting timeout: the timeouts settle these rooms
            # (Failed). With a fault or a defect that is the cause; without one it is not.
            # Once they fired nothing may be left behind.
            if not caused:
                return ("failed-without-cause", root)
            return ("leak", normalise(leaks[0])) if leaks else None
        return ("wedged", root)
    if leaks:
        return ("leak", normalise(leaks[0]))
    if status == "failed" and not caused:
        unexplained = sorted(r for r in failures
                             if not any(b in r.lower() for b in BY_DESIGN))
        if unexplained:
            return ("failed-without-cause", normalise(unexplained[0]))
    return None


_ROOMS = re.compile(r"\brooms? (\d+(?:, \d+)*)")


def _names_only(root: str, rooms: set[int] | frozenset[int]) -> bool:
    """Whether ``root`` names rooms, all of them in ``rooms`` (an aborted room's wedge: its
    other side learns of the abort at a timeout, SGLang's way for a one-sided abort)."""
    named = {int(n) for m in _ROOMS.finditer(root.split(" [", 1)[0])
             for n in m.group(1).split(", ")}
    return bool(rooms) and bool(named) and named <= rooms


def run_trial(base: Base, trial: Trial, *, trace_out: str | None = None,
              log_limit: int = 0, defects: tuple[str, ...] | None = None,
              driver: Driver | None = None, max_steps: int | None = None,
              tap: Tap | None = None) -> TrialResult:
    """Run ``trial`` (in the simulator, or on the loopback cluster when it has a schedule or a
    ``driver``, which then admits the requests, aborts rooms and picks every step; at most
    ``max_steps`` steps) and judge it. ``defects`` replaces the base's. ``tap`` hears every
    input, effect and driver record of the run the trial's status comes from (``Tap``).

    With defects on (and ``defects`` not given), a trial that found something is rerun with
    each defect off alone: the defects whose absence makes its signature go are the ones it
    *needs*, and they become part of the signature (``root [needs NAME]``), so the same symptom
    with and without a defect's help are two findings, not one."""
    res = _run_trial(base, trial, trace_out=trace_out, log_limit=log_limit, defects=defects,
                     driver=driver, max_steps=max_steps, tap=tap)
    if defects is not None or not base.defects or res.signature is None or driver is not None:
        return res
    needs = []
    for d in base.defects:
        rest = tuple(x for x in base.defects if x != d)
        if _run_trial(base, trial, defects=rest).signature != res.signature:
            needs.append(d)
    res.needs = needs
    if needs:
        res.signature = (res.signature[0], f"{res.signature[1]} [needs {', '.join(needs)}]")
    return res


def _run_trial(base: Base, trial: Trial, *, trace_out: str | None = None,
               log_limit: int = 0, defects: tuple[str, ...] | None = None,
               driver: Driver | None = None, max_steps: int | None = None,
               tap: Tap | None = None) -> TrialResult:
    from twin.runtime.faults import parse_fault
    from twin.sim.runner import run_sim

    t0 = time.perf_counter()
    try:
        cfg = base.check(trial)
    except InvalidTrial as exc:
        return TrialResult("invalid", None, invalid=str(exc))
    recorder = CoverageRecorder(cfg.ring_bytes, log_limit, tap)
    on = base.defects_on(defects)
    faults = [parse_fault(f) for f in trial.faults]
    keys: set[str] = set()
    ctx = observe_transitions(keys) if base.coverage else _null()
    if trial.schedule or driver is not None:
        return _run_loopback(base, trial, cfg, on, recorder, keys, t0, driver, max_steps)

    def simulate(params: Any, rec: CoverageRecorder) -> Any:
        if trace_out is not None:
            return _traced(cfg, params, trial, on, faults, trace_out, rec)
        return run_sim(cfg, trial.workload(), defects=on, faults=faults, seed=trial.seed,
                       params=params, request_overrides=trial.overrides(), recorder=rec,
                       stop_check=_EventBudget())

    try:
        with ctx:
            result = simulate(base.params, recorder)
            judged = result  # the run the oracles judge; the trial's status is the first's
            stuck = result.status.value == "wedged" or result.stop_reason == "event budget"
            if stuck and trial.faults and not on.sorted() and not recorder.safety and \
                    not result.sim.integrity.violations:
                # A fault's wedge with no defect on: do SGLang's own timeouts settle it?
                judged = _settles(cfg, base, trial, on, faults) or result
    except Exception as exc:  # the twin itself raised: a finding of its own
        text = f"{type(exc).__name__}: {exc}"
        return TrialResult("error", ("error", normalise(text)), frozenset(recorder.keys | keys),
                           diagnosis=[text[:400]], wall_s=time.perf_counter() - t0)
    summary_failures = _failures(result)
    status = result.status.value
    kinds = [v.kind for v in result.sim.integrity.violations]
    caused = bool(trial.faults) or bool(on.sorted())
    sig = judge(judged.status.value, corruption_kinds=kinds, safety=recorder.safety,
                diagnosis=judged.diagnosis, failures=_failures(judged), caused=caused,
                corruption=result.corruption)
    if sig is None and judged.stop_reason == "event budget":
        status = "livelock"
        sig = ("livelock", f"the simulator was still busy after {MAX_INPUTS} core inputs "
                           f"with requests unfinished")
    cov = frozenset(recorder.keys | keys | {f"st:{status}"})
    return TrialResult(status, sig, cov, list(result.diagnosis), result.corruption[:20],
                       recorder.safety[:20], summary_failures,
                       wall_s=time.perf_counter() - t0, log=recorder.log)


def _run_loopback(base: Base, trial: Trial, cfg: Any, on: Any, recorder: CoverageRecorder,
                  keys: set[str], t0: float, driver: Driver | None = None,
                  max_steps: int | None = None) -> TrialResult:
    """``trial`` on the loopback cluster under its schedule or ``driver``
    (``twin/explore/schedule.py``)."""
    from twin.explore.schedule import MAX_STEPS, run_loopback

    reqs = [(r.input_len, r.decode_prefix, r.prefill_prefix)
            for r in sorted(trial.requests, key=lambda q: q.at)]
    ctx = observe_transitions(keys) if base.coverage else _null()
    try:
        with ctx:
            run = run_loopback(cfg, reqs, trial.faults, on, trial.schedule, recorder,
                               driver=driver, max_steps=max_steps or MAX_STEPS)
            if run.status == "livelock" and driver is None and \
                    cfg.fix_set.on("lost-control-recovery") and \
                    "actions pending" in run.diagnosis[0]:
                # The loopback's clock, not the protocol: one action a millisecond cannot keep
                # up with every writer re-requesting each 50 ms (SGLang's listener answers far
                # faster). The same schedule on a ten times finer clock decides it.
                if recorder.tap is not None:
                    recorder.tap.clear()
                recorder = CoverageRecorder(cfg.ring_bytes, recorder.log_limit, recorder.tap)
                run = run_loopback(cfg, reqs, trial.faults, on, trial.schedule, recorder,
                                   max_steps=10 * (max_steps or MAX_STEPS),
                                   step_s=FINE_STEP_S)
    except Exception as exc:  # the twin itself raised: a finding of its own
        text = f"{type(exc).__name__}: {exc}"
        return TrialResult("error", ("error", normalise(text)), frozenset(recorder.keys | keys),
                           diagnosis=[text[:400]], wall_s=time.perf_counter() - t0)
    caused = bool(run.aborted) or bool(on.sorted())
    if run.status == "livelock":
        sig: tuple[str, str] | None = ("livelock", normalise(run.diagnosis[0]))
    else:
        sig = judge(run.status, corruption_kinds=run.corruption_kinds, safety=run.safety,
                    diagnosis=run.diagnosis, failures=run.failures, caused=caused,
                    corruption=run.corruption, leaks=run.leaks, aborted=run.aborted)
    cov = frozenset(recorder.keys | keys | {f"st:{run.status}"})
    return TrialResult(run.status, sig, cov, run.diagnosis + [f"leak: {x}" for x in run.leaks],
                       run.corruption[:20], run.safety[:20], run.failures,
                       wall_s=time.perf_counter() - t0, log=recorder.log)


MAX_INPUTS = 200_000
"""Core inputs a simulated trial may take: past it the run stops as a ``livelock`` (still busy,
as with lost-control recovery re-requesting every 50 ms until a 300 s timeout). Counted in
inputs, not seconds, so the bound is deterministic; some 2-4 s of pure-Python simulation."""


FINE_STEP_S = 1e-4
"""The loopback's step when the millisecond step piles up lost-control re-requests."""

SETTLE_INPUTS = 1_500_000
"""Core inputs a settling run (``_settles``) may take: lost-control recovery re-requests a
deferred chunk every 50 ms until the room's timeout, about a million inputs for a failed
transfer that pins a ring for the 30 s release deadline (a few seconds compiled)."""


SETTLE_WINDOWS = 4
"""Settle windows after the last arrival a settling run may simulate: a thread that blocks
in one send to a dead peer after another is slow, not stuck, to the wedge monitor, and such a
chain can go on for simulated days of watcher ticks while it feeds the cores next to nothing
(a settling run is otherwise bounded in core inputs only)."""


class _EventBudget:
    every = 0.05

    def __init__(self, limit: int = MAX_INPUTS) -> None:
        self.limit = limit

    def __call__(self, sim: Any) -> str:
        return "event budget" if sim.polls > self.limit else ""


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _failures(result: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in result.sim.metrics.done:
        if r.status == "Failed":
            key = r.reason[:120] or "failed"
            out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


class _Tee:
    """Hands every record to the trace writer and to the coverage recorder."""

    def __init__(self, writer: Any, recorder: CoverageRecorder) -> None:
        self.writer = writer
        self.recorder = recorder

    def write_input(self, t: float, node: str, event: Any) -> None:
        self.writer.write_input(t, node, event)
        self.recorder.write_input(t, node, event)

    def write_effects(self, t: float, node: str, effects: list[Any]) -> None:
        self.writer.write_effects(t, node, effects)
        self.recorder.write_effects(t, node, effects)

    def write_sys(self, t: float, node: str, record: dict[str, Any]) -> None:
        self.writer.write_sys(t, node, record)
        self.recorder.write_sys(t, node, record)


def _settles(cfg: Any, base: Base, trial: Trial, on: Any, faults: list[Any]) -> Any:
    """The run of ``trial`` past every timeout (at most ``SETTLE_INPUTS`` core inputs: a
    proposed fix's retries may keep it busy until then) when SGLang's timeouts settle it (see
    the module docstring); the run itself when it is still wedged past them (its roots see the
    whole picture, a dead rank's included); None when a request is still unfinished at the
    input bound or failed with no fault on its path (no message or transfer fault on its
    room, no abort of it, no dead rank on its path, no reason SGLang fails a request for by
    design: a defect's, or the protocol's own)."""
    from twin.sim.runner import run_sim

    window = settle_window(cfg, base.params)
    params = base.params.replace(wedge_window_s=window)
    workload = trial.workload()
    last = max((r.arrival_s for r in workload.requests), default=0.0)
    result = run_sim(cfg, workload, defects=on, faults=faults, seed=trial.seed,
                     params=params, request_overrides=trial.overrides(),
                     recorder=CoverageRecorder(cfg.ring_bytes),
                     stop_check=_EventBudget(SETTLE_INPUTS),
                     until=last + SETTLE_WINDOWS * window)
    sim = result.sim
    if result.status.value == "wedged":
        return result
    if len(sim.metrics.done) < len(trial.requests):
        return None  # busy until the input or time bound
    touched = set(sim.fault_notes)  # rooms a message or transfer fault hit
    touched.update(f.room for f in faults if f.action == "abort" and f.room is not None)
    dead = set(sim.runtime.crashed) | set(sim.restarted) | set(sim.crash_times)
    for r in sim.metrics.done:
        nodes = {n.id for n in (*sim.topo.prefill_groups[r.prefill_group].nodes,
                                *sim.topo.decode_groups[r.decode_group].nodes)}
        if r.status == "Failed" and r.room not in touched and not nodes & dead and \
                not any(k in r.reason for k in FAULT_ENDS) and \
                not any(b in r.reason.lower() for b in BY_DESIGN):
            return None
    return result


FAULT_ENDS = ("aborted by fault", "crashed by fault", "lost with decode rank", "is down (",
              "prefill server p")
"""Failure reasons that name a fault as the end of a request: a client abort, a dead or
restarting rank, a dead prefill server (its heartbeat or its refused bootstrap query)."""


def settle_window(cfg: Any, params: Any) -> float:
    """Seconds without progress after which none of SGLang's timeouts can still move a run:
    the longest of them (``longest_timeout``) plus the base wedge window."""
    return longest_timeout(cfg, params) + float(params.wedge_window_s)


def _traced(cfg: Any, params: Any, trial: Trial, on: Any, faults: list[Any], path: str,
            recorder: CoverageRecorder) -> Any:
    """``run_sim`` writing the trace to ``path`` while the coverage recorder watches."""
    from twin.sim.runner import outcome_record, recorded_run, run_sim
    from twin.trace.format import TraceWriter

    params, header = recorded_run(cfg, trial.workload(), params, defects=on,
                                  faults=faults, seed=trial.seed,
                                  request_overrides=trial.overrides(), max_concurrency=None)
    with TraceWriter(path, header) as writer:
        result = run_sim(cfg, trial.workload(), defects=on, faults=faults, seed=trial.seed,
                         params=params, request_overrides=trial.overrides(),
                         recorder=_Tee(writer, recorder), stop_check=_EventBudget())
        writer.close(outcome_record(result))
    return result
