"""Replay a recorded trace (from the simulator or the hardware mode) through fresh cores.

The replayer rebuilds every rank from the trace header (config, defects) and feeds each rank
its recorded inputs in the recorded order, each with its recorded time (the cores take time only
as an argument, so no event loop is needed). After every input it compares the effects the core
returns with the effects recorded after that input (as text first: the line encoder writes an
effect exactly as it was recorded, so recorded lines equal byte for byte to the fresh effects'
lines need no parsing, ``RecordStream.skip_effects``). The first difference stops the replay (``Divergence``); the
rest of the trace is still read for its driver records and its ``Outcome``. The trace streams:
memory holds the cores and what is in flight, whatever the trace's length. At the end it recomputes the outcome (completed rooms, wedge diagnosis from the
cores' state, integrity violations) and compares it with the recorded ``Outcome``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twin.core import events as ev
from twin.core.decode import DecodeRank
from twin.core.defects import Defects
from twin.core.grid import pages_for_tokens
from twin.core.integrity import IntegrityModel
from twin.core.prefill import PrefillRank
from twin.core.topology import Topology, build_rank
from twin.runtime.causes import Death, RoomEnd, root_lines
from twin.runtime.diagnosis import crash_reason, diagnose, note_fault_record, restart_reason
from twin.runtime.faults import parse_fault, scope_nodes
from twin.runtime.outcome import EXIT_ERROR, EXIT_OK, RunStatus, decide, exit_code
from twin.runtime.params import SimParams
from twin.runtime.runtime import note_dropped
from twin.runtime.signals import held_for_safe_points
from twin.trace.codec import body, event_to_json
from twin.trace.compat import comparable
from twin.trace.format import (
    FORMAT_VERSION,
    Record,
    RecordStream,
    Trace,
    TraceReader,
    TraceSource,
    open_trace,
)

_STOPPED = (RunStatus.INTERRUPTED, RunStatus.UNTIL)
"""Recorded statuses of a run stopped with rooms in flight: the replay stops there too, and
nothing is diagnosed as a wedge."""


@dataclass
class Divergence:
    """Where a replay departed from its trace."""

    line: int
    node: str
    t: float
    expected: str
    got: str

    def __str__(self) -> str:
        return (f"replay diverged at trace line {self.line} ({self.node}, t={self.t:.6f} s)\n"
                f"  recorded: {self.expected}\n  replayed: {self.got}")


@dataclass
class ReplayResult:
    """The replay's verdict and how it compares with the recorded outcome."""

    inputs: int
    divergence: Divergence | None
    status: str
    completed: int
    failed: int
    diagnosis: list[str] = field(default_factory=list)
    corruption: list[str] = field(default_factory=list)
    recorded: dict[str, Any] | None = None
    timing: dict[str, Any] | None = None
    version: int = FORMAT_VERSION  # of the recording: older diagnoses are worded differently
    interrupted: str | None = None
    """Why the replay stopped before the trace's end (Ctrl-C, SIGTERM, SIGHUP), and how far it
    got; None when it read the whole trace."""
    roots: list[str] = field(default_factory=list)
    """Root lines of requests lost to a dead rank (``twin.runtime.causes``)."""
    ended_early: str | None = None
    """The trace ends before its ``Outcome`` (truncated, or a recording that never finished),
    or its run was stopped (interrupted, or ``--until``): what was still in flight there. Its
    rooms are not diagnosed as a wedge."""

    @property
    def same_outcome(self) -> bool:
        """Status, counts and wedge diagnosis (beyond its headline) match the recording."""
        rec = self.recorded
        if rec is None or self.divergence is not None or self.interrupted is not None:
            return False
        same = (rec["status"] == self.status and rec["completed"] == self.completed
                and rec["failed"] == self.failed)
        if self.status == "wedged" and self.version >= DIAGNOSIS_SINCE:
            same = same and _body(rec.get("diagnosis", [])) == _body(self.diagnosis)
        return same

    def differences(self, limit: int = 6) -> list[str]:
        """What differs from the recorded outcome, a line each (empty when the outcome is the
        same): the status, the counts, then the diagnosis lines only one side has."""
        rec = self.recorded
        if rec is None or self.same_outcome:
            return []
        out = [f"{key}: recorded {rec[key]}, replayed {getattr(self, key)}"
               for key in ("status", "completed", "failed") if rec[key] != getattr(self, key)]
        if self.status == "wedged" and self.version >= DIAGNOSIS_SINCE:
            want, got = _body(rec.get("diagnosis", [])), _body(self.diagnosis)
            only_rec = [x for x in want if x not in got]
            only_rep = [x for x in got if x not in want]
            out += [f"diagnosis only recorded: {x}" for x in only_rec[:limit]]
            out += [f"diagnosis only replayed: {x}" for x in only_rep[:limit]]
            hidden = max(0, len(only_rec) - limit) + max(0, len(only_rep) - limit)
            if hidden:
                out.append(f"... {hidden} more differing diagnosis line(s)")
            if not only_rec and not only_rep and want != got:
                out.append("diagnosis: the same lines in another order")
        return out

    @property
    def exit_code(self) -> int:
        if self.divergence is not None or self.interrupted is not None:
            return EXIT_ERROR
        status = RunStatus(self.status)
        if status in _STOPPED:
            return EXIT_OK  # the recording stopped there too; the replay reproduced it
        return exit_code(status)


DIAGNOSIS_SINCE = 3
"""The first format version whose wedge diagnosis is worded as today's (version 4 changed the
codec, not the lines): from it on a replay compares the diagnosis lines too."""
_FOLLOWED = frozenset({"RequestArrived", "FaultInjected", "RequestLost"})
"""The driver records the replay follows (``Replayer.note_sys``)."""


def _body(lines: list[str]) -> list[str]:
    return [x for x in lines if not x.startswith("wedge:")]


def _line(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items())


class Replayer:
    """Feeds a trace's inputs to fresh cores and checks their effects.

    The trace is read once, in order: each input is handed to its rank as soon as it is read,
    and its effects are checked against the lines after it before the next input, so memory
    holds the cores, the rooms and what is in flight, never the trace.
    """

    def __init__(self, trace: TraceSource) -> None:
        self.trace = trace = open_trace(trace)
        cfg = trace.config
        self.cfg = cfg
        self.defects = Defects.of(trace.header.get("defects", []))
        self.topo = Topology(cfg)
        self.ranks: dict[str, PrefillRank | DecodeRank] = {
            n.id: build_rank(cfg, n, self.defects) for n in self.topo.nodes.values()
            if n.id in trace.nodes}
        self.integrity = IntegrityModel(cfg.ring_bytes, cfg.prefill.pp_size)
        self.in_flight: dict[tuple[str, int], ev.StartTransfer] = {}
        # open rooms only: (decode nodes, total pages); a room leaves when every decode node
        # of it concluded, and is counted then
        self.rooms: dict[int, tuple[int, int]] = {}
        self.concluded: dict[int, dict[str, str]] = {}
        self.completed = 0
        self.failed = 0
        self.crashed: dict[str, str] = {}
        self.fault_notes: dict[int, list[str]] = {}  # room -> injected faults that touched it
        self.divergence: Divergence | None = None
        self.inputs = 0
        self._decode_nodes = {nid for nid, n in self.topo.nodes.items() if n.role == "decode"}
        self.version: int = trace.header["version"]
        self._observers = frozenset({ev.StartTransfer, ev.StartScatter, ev.RoomConcluded,
                                     ev.RankCrashed, ev.Dropped})
        self.dropped: dict[int, list[str]] = {}  # room -> inputs its ranks dropped
        self.nodes_of: dict[int, tuple[str, ...]] = {}  # room -> the ranks it was placed on
        self.restarted: dict[str, str] = {}  # node -> how it crashed and came back empty
        self.deaths: list[Death] = []  # ranks a crash or restart fault took down
        self._restarts: list[tuple[float, str]] = []  # heap of (back at, node)
        self.ends: dict[int, tuple[str, str]] = {}  # room -> (status, first failure reason)

    def note_sys(self, rtype: str, d: dict[str, Any]) -> None:
        """Note what the replay follows of a driver record (rooms, crashes and faults)."""
        if rtype == "RequestArrived":
            total = pages_for_tokens(d["input_len"] - d["decode_prefix_len"], self.cfg.page_size)
            self.rooms[d["room"]] = (len(d["decode_node"]), total)
            self.nodes_of[d["room"]] = (*d["prefill_node"], *d["decode_node"])
        elif rtype == "RequestLost":
            self._lost(d["room"], d["reason"])
        elif rtype == "FaultInjected":
            text = d["fault"]
            if text.startswith(("crash:", "restart:")):
                spec = parse_fault(text)
                for node in scope_nodes(self.topo, spec) if spec.target in self.topo.nodes \
                        else []:
                    self.deaths.append(Death(node, spec.at or 0.0, crash_reason(text)))
                    if spec.action == "crash":
                        self.crashed[node] = crash_reason(text)
                        continue
                    # As the simulator: back, empty. A dead rank records no input, so the
                    # next input of ``node`` after this record is the fresh core's.
                    self.restarted[node] = restart_reason(text)
                    if node in self.ranks:
                        self.ranks[node] = build_rank(self.cfg, self.topo.nodes[node],
                                                      self.defects)
                    # its memory is new from when it is back (``feed`` forgets the old ring)
                    heapq.heappush(self._restarts, ((spec.at or 0.0) + (spec.down or 0.0),
                                                    node))
            note_fault_record(self.fault_notes, d)  # named on its room's wedge root

    def _lost(self, room: int, reason: str) -> None:
        """The driver failed ``room`` outside the protocol (a ``RequestLost`` record): no
        decode rank will conclude it."""
        if self.rooms.pop(room, None) is None:
            return
        self.concluded.pop(room, None)
        self.failed += 1
        self.ends.setdefault(room, ("Failed", reason))

    def run(self) -> ReplayResult:
        """Replay the whole trace: with the trace read in a forked process when that can run
        (``twin.replay.forked``), else (or when that path hands back) sequentially here.
        Ctrl-C (or SIGTERM and SIGHUP inside ``signals_interrupt``) ends it with what was
        replayed so far."""
        from twin.replay import forked

        if forked.can_run(self):
            try:
                return forked.run(self)
            except forked.Fallback:
                return Replayer(self.trace).run_here()
            except KeyboardInterrupt as exc:  # the forked reader is stopped already
                return self._result(interrupted=exc)
        return self.run_here()

    def run_here(self) -> ReplayResult:
        """Replay the whole trace in this process, reading it as it goes."""
        try:
            return self._run_here()
        except KeyboardInterrupt as exc:
            return self._result(interrupted=exc)

    def _run_here(self) -> ReplayResult:
        records = RecordStream(self.trace)
        skip_effects = records.skip_effects
        pending: tuple[Record, list[ev.Effect]] | None = None  # fed; its effect lines follow
        recorded: list[Record] = []
        feeding = True
        with held_for_safe_points() as noted:  # a signal is acted on between two inputs
            for rec in records:
                d = rec.dir
                if d == "out":
                    if pending is not None and rec.node == pending[0].node:
                        recorded.append(rec)
                    continue
                if pending is not None:
                    feeding = self._check(*pending, recorded)
                pending = None
                if d == "in":
                    if noted.signum:
                        noted.deliver()
                    if feeding:
                        effects = self._feed(rec)
                        if effects is None:
                            pass
                        elif effects and skip_effects(effects):  # recorded exactly so
                            self.observe(rec.node, effects)
                        else:
                            pending, recorded = (rec, effects), []
                elif rec.type in _FOLLOWED:
                    self.note_sys(rec.type, rec.data)
        if pending is not None:
            self._check(*pending, recorded)
        return self._result()

    def _feed(self, rec: Record) -> list[ev.Effect] | None:
        """Hand input ``rec`` to its rank; its effects (None: the rank is not replayed)."""
        rank = self.ranks.get(rec.node)
        if rank is None:
            return None
        return self.feed(rank, rec.node, rec.event, rec.t)

    def feed(self, rank: PrefillRank | DecodeRank, node: str, event: Any, t: float
             ) -> list[ev.Effect]:
        """Hand ``event`` to ``rank`` (of ``node``) at time ``t``; its effects."""
        self.inputs += 1
        restarts = self._restarts
        while restarts and t >= restarts[0][0]:  # as the simulator: back with a new ring
            self.integrity.restarted(heapq.heappop(restarts)[1])
        if type(event) is ev.TransferDone and event.ok:  # its bytes land first
            st = self.in_flight.pop((node, event.worker), None)
            if st is not None:
                self.integrity.on_transfer(st.session, st)
        effects: list[ev.Effect] = rank.handle(event, t)
        return effects

    def _check(self, rec: Record, effects: list[ev.Effect], recorded: list[Record]) -> bool:
        """Compare the effects of input ``rec`` with its recorded effect lines; on a difference
        note the ``Divergence`` and return False, else observe the effects."""
        same = len(effects) == len(recorded)
        if same:
            for e, r in zip(effects, recorded):  # noqa: B905 - equal lengths
                if body(e) != r.body:
                    same = False
                    break
        if not same:
            # not the same text: compare the decoded events (a hand-edited line may order its
            # fields differently), and name the first difference
            got = [_line(d) for d in comparable(effects, self.version, event_to_json)]
            want = [_line(d) for d in comparable([r.event for r in recorded], self.version,
                                                 event_to_json)]
            if got != want:
                i = next((k for k in range(max(len(got), len(want)))
                          if k >= len(got) or k >= len(want) or got[k] != want[k]), 0)
                line = recorded[i].line if i < len(recorded) else rec.line
                self.divergence = Divergence(
                    line, rec.node, rec.t, want[i] if i < len(want) else "(no further effect)",
                    got[i] if i < len(got) else "(no further effect)")
                return False
        self.observe(rec.node, effects)
        return True

    def observe(self, node: str, effects: list[ev.Effect]) -> None:
        """Note what the replay tracks (transfers, scatters, conclusions, crashes) of the
        checked ``effects`` of ``node``."""
        observers = self._observers
        for e in effects:
            if type(e) in observers:
                self._observe(node, e)

    def _observe(self, node: str, e: ev.Effect) -> None:
        t = type(e)
        if t is ev.StartTransfer:
            self.in_flight[(node, e.worker)] = e
        elif t is ev.StartScatter:
            self.integrity.on_scatter(node, e, list(e.writer_bytes))
        elif t is ev.RoomConcluded and node in self._decode_nodes:
            room = self.rooms.get(e.room)
            if room is None:
                return  # never introduced, or already counted
            st = self.concluded.setdefault(e.room, {})
            st[node] = e.status
            if e.status == "Failed" and e.room not in self.ends:
                self.ends[e.room] = ("Failed", e.reason)
            self.integrity.on_concluded(node, e.room, e.status, room[1])
            if len(st) >= room[0]:
                if all(s == "Success" for s in st.values()):
                    self.completed += 1
                    self.ends[e.room] = ("Success", "")
                else:
                    self.failed += 1
                del self.rooms[e.room], self.concluded[e.room]
        elif t is ev.RankCrashed:
            self.crashed[node] = e.reason
        elif t is ev.Dropped:
            note_dropped(self.dropped, node, e)

    def _result(self, interrupted: KeyboardInterrupt | None = None) -> ReplayResult:
        corruption = [str(v) for v in self.integrity.violations]
        unfinished = set(self.rooms)
        if interrupted is not None:  # stopped here: nothing to compare, no wedge to diagnose
            from twin.runtime.signals import Interrupted

            why = (interrupted.args[0] if isinstance(interrupted, Interrupted) and
                   interrupted.args else "Ctrl-C")
            status = decide(corrupted=bool(corruption), wedged=False,
                            unfinished=max(len(unfinished), 1), failed=self.failed).value
            return ReplayResult(
                self.inputs, self.divergence, status, self.completed, self.failed, [],
                corruption, None, version=self.version,
                interrupted=(f"interrupted by {why} after {self.inputs} inputs: "
                             f"{self.completed} room(s) completed, {self.failed} failed, "
                             f"{len(unfinished)} in flight; the rest of the trace was not "
                             "replayed"))
        status = _status(len(unfinished), corruption, self.trace.outcome, self.failed)
        ended_early = None
        recorded = self.trace.outcome
        stopped = recorded is not None and RunStatus(recorded["status"]) in _STOPPED
        if recorded is None or stopped:  # the recording stops here; its ranks are not stuck
            diagnosis: list[str] = []
            ended_early = _ended_early(self.trace, unfinished,
                                       recorded["status"] if stopped else None)
        else:
            snapshots = {n: r.snapshot() for n, r in self.ranks.items()}
            diagnosis = (diagnose(snapshots, self.crashed, unfinished, self.dropped,
                                  self.fault_notes, self.nodes_of, self.restarted).lines()
                         if unfinished else [])
        return ReplayResult(self.inputs, self.divergence, status, self.completed, self.failed,
                            diagnosis, corruption, self.trace.outcome, version=self.version,
                            ended_early=ended_early, roots=self.roots(unfinished))

    def roots(self, unfinished: set[int]) -> list[str]:
        """``twin.runtime.causes.root_lines`` from what the trace says: the ranks its faults
        took down and how each room ended (a replay knows of no blocked sends)."""
        if not self.deaths:
            return []
        rooms = [RoomEnd(room, nodes, "pending" if room in unfinished else
                         self.ends.get(room, ("Failed", ""))[0],
                         self.ends.get(room, ("", ""))[1])
                 for room, nodes in self.nodes_of.items()]
        return root_lines(self.deaths, rooms)


def _ended_early(trace: Trace | TraceReader, unfinished: set[int],
                 stopped: str | None = None) -> str:
    """What a replay of a trace without its ``Outcome``, or of a run that was stopped
    (``stopped``: its recorded status), says instead of a wedge diagnosis."""
    lines = (len(trace.events) if isinstance(trace, Trace) else sum(trace.counts.values())) + 1
    why = (f"records a run that was stopped ({stopped})" if stopped else
           "is cut short (truncated)" if trace.truncated else
           "has no Outcome record (the recording did not finish)")
    rooms = sorted(unfinished)
    shown = ", ".join(map(str, rooms[:12])) + (f", ... ({len(rooms) - 12} more)"
                                                if len(rooms) > 12 else "")
    return (f"the trace {why}: it ends at line {lines}"
            + (f" with {len(rooms)} room(s) in flight ({shown}); the replay stops where the "
               "input stops, so they are not diagnosed as a wedge" if rooms else ""))


def _status(unfinished: int, corruption: list[str], recorded: dict[str, Any] | None,
            failed: int) -> str:
    """The replay's status: rooms left unfinished are a wedge when the recording ended in one,
    otherwise the replay stopped where the recording stopped."""
    rec = RunStatus(recorded["status"]) if recorded is not None else RunStatus.INTERRUPTED
    wedged = bool(unfinished) and rec in (RunStatus.WEDGED, RunStatus.CORRUPTED)
    if rec in _STOPPED:
        # The recording stopped with requests in flight; some may have been decoding after
        # their transfer ended, which is all a replay sees of them.
        unfinished = max(unfinished, 1)
    return decide(corrupted=bool(corruption), wedged=wedged, unfinished=unfinished,
                  failed=failed, stopped=rec).value


def verdict(rooms: dict[int, dict[str, Any]], concluded: dict[int, dict[str, str]],
            corruption: list[str], recorded: dict[str, Any] | None
            ) -> tuple[str, int, int, set[int]]:
    """``(status, completed, failed, unfinished rooms)`` of a replay from every room's
    ``RequestArrived`` record and its decode nodes' conclusions.

    A room is finished when every decode node of its ``RequestArrived`` record concluded it.
    Rooms left unfinished are a wedge when the recording ended in one, otherwise the replay
    stopped where the recording stopped.
    """
    completed = failed = 0
    unfinished: set[int] = set()
    for room, data in rooms.items():
        st = concluded.get(room, {})
        if len(st) < len(data.get("decode_node", [])):
            unfinished.add(room)
        elif all(s == "Success" for s in st.values()):
            completed += 1
        else:
            failed += 1
    return _status(len(unfinished), corruption, recorded, failed), completed, failed, unfinished


def replay_sim(trace: TraceSource, params: SimParams | None = None,
               costs_host: dict[str, Any] | None = None) -> ReplayResult:
    """Replay ``trace`` (a ``Trace``, a reader or a path, streamed) in simulation (see the
    module docstring). For a hardware trace the result also says how far a fresh simulation's
    timings are from the measured ones (which reads the trace a second time), with ``params``
    as the cost model, else the trace's own ``[sim]`` table; ``costs_host`` is the host
    ``params`` were fitted on (``compare_with_simulation``)."""
    replayer = Replayer(trace)
    result = replayer.run()
    source = replayer.trace
    if source.header.get("mode") == "hw" and result.interrupted is None:
        from twin.replay.timing import compare_with_simulation

        again = source if isinstance(source, Trace) else Path(source.path)
        try:
            result.timing = compare_with_simulation(again, params, costs_host=costs_host)
        except KeyboardInterrupt as exc:
            from twin.runtime.signals import Interrupted

            why = exc.args[0] if isinstance(exc, Interrupted) and exc.args else "Ctrl-C"
            result.interrupted = (f"interrupted by {why} during the timing comparison (the "
                                  "replay itself read the whole trace)")
    return result
