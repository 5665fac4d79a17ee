"""``twin hw``: a workload on real rank processes, byte-verified, with the simulator's verdicts.

The coordinator plays router and prefill scheduler: it places each request (same placement and
radix caches as the simulator), has the ranks allocate and fill KV pages, starts the decode
rooms, and once every prefill rank of the group has its metadata it issues the prefetch and the
``send_kv_chunk`` calls of each chunked forward. Every decode rank verifies every byte of each
finished room against the prefill pattern. The verdicts and exit codes are the simulator's
(``twin.runtime.outcome``): 0 completed (or ``--until`` reached), 1 a rank died or raised, or
the run was interrupted, 3 wedge (with the same kind of diagnosis), 4 corruption, 5 failed
requests.

A request is admitted only when every rank of its groups has KV pool pages for it, as SGLang's
scheduler admits only what fits; ``plan_pool`` has already checked that each request fits an
empty pool. ``abort:room=N:at=T`` faults abort the room on every rank of its groups at ``T``.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from twin.core import events as ev
from twin.core.config import TwinConfig
from twin.core.defects import SILENT_SLICE_FALLBACK, Defects
from twin.core.grid import pages_for_tokens
from twin.core.sendplan import early_send_end
from twin.hw import messages
from twin.hw.launcher import HwOptions, Launcher, open_hub
from twin.models.costs import Deployment
from twin.runtime.causes import Death, RoomEnd, root_lines
from twin.runtime.diagnosis import crash_reason, diagnose, fault_record
from twin.runtime.faults import FaultSpec, fault_report, parse_fault
from twin.runtime.outcome import RunStatus, Verdict, decide, exit_code
from twin.runtime.params import SimParams
from twin.runtime.placement import Placement
from twin.runtime.requests import RequestState
from twin.runtime.runtime import PROGRESS_EFFECTS, note_dropped
from twin.runtime.signals import Interrupted, signals_interrupt
from twin.workloads import Workload

UNSUPPORTED_FAULTS = ("restart",)
#: The wedge window on hardware is wall-clock time: at least this long, since a loaded host can
#: stall a rank for seconds without anything being stuck.
HW_MIN_WEDGE_WINDOW_S = 15.0
#: How often the coordinator's loop looks for rank processes that ended (and agents gone
#: silent): each look polls every process, too much to do between every two frames.
CHECK_ALIVE_S = 0.01
#: The records are written to the trace when no timer is due within this long (writing a block
#: of them takes several milliseconds, which would hold a forward), or after this long at most.
TRACE_FLUSH_GAP_S = 0.01
TRACE_FLUSH_MAX_S = 1.0


class HwInputError(ValueError):
    """A run the hardware mode cannot carry out as asked."""


@dataclass
class HwResult:
    """The outcome of a hardware run; ``summary()`` has the simulator's keys."""

    requests: int
    done: list[RequestState]
    unfinished: list[int]
    wedged: bool
    diagnosis: list[str]
    corruption: list[str]
    wall_seconds: float
    run_seconds: float
    events: int
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    verified: int = 0  # completed requests whose every decode rank checked every byte
    stopped: RunStatus = RunStatus.INTERRUPTED
    corrupted_rooms: list[int] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    log_dir: str | None = None
    agents: list[dict[str, Any]] | None = None  # across nodes: each agent, its ranks and clock
    coordinator_cpu_s: float = 0.0  # CPU the coordinator process used while driving the run
    # Connections refused because the peer did not prove the run's key, by socket owner
    # ("coordinator" or a rank), and control frames dropped because they did not decode.
    refused: dict[str, int] = field(default_factory=dict)
    dropped_frames: int = 0
    # Sends that sat blocked on a peer (SGLang's socket options): seconds by (rank, peer,
    # thread), by frame kind and by thread, and when each rank's sends to a peer first blocked.
    blocked_on: dict[tuple[str, str, str], float] = field(default_factory=dict)
    blocked_by_frame: dict[str, float] = field(default_factory=dict)
    blocked_by_thread: dict[str, float] = field(default_factory=dict)
    first_full: dict[tuple[str, str], float] = field(default_factory=dict)
    lost_frames: int = 0  # frames whose send timed out (SGLang swallows zmq.Again)
    roots: list[str] = field(default_factory=list)

    @property
    def status(self) -> RunStatus:
        # Every request that did not end counts, admitted or not: a run interrupted between
        # admissions (nothing in flight, most of the workload still to come) is interrupted.
        return decide(corrupted=bool(self.corruption), wedged=self.wedged,
                      unfinished=self.requests - len(self.done), crashed=bool(self.errors),
                      failed=sum(r.status == "Failed" for r in self.done), stopped=self.stopped)

    @property
    def exit_code(self) -> int:
        return exit_code(self.status)

    @property
    def verdict(self) -> Verdict:
        return Verdict(status=self.status, requests=self.requests,
                       completed=sum(r.status == "Success" for r in self.done),
                       failed=sum(r.status == "Failed" for r in self.done),
                       unfinished=self.requests - len(self.done),
                       diagnosis=self.diagnosis + self.errors,
                       corruption=self.corruption[:50])

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.done if r.status == "Success"]
        ttft = [r.kv_done_s - r.arrival_s for r in ok]
        lat: dict[str, Any] = {}
        if ttft:
            a = np.asarray(ttft)
            lat["ttft_s"] = {f"p{q}": round(float(np.percentile(a, q)), 6) for q in (50, 90, 99)}
        return {
            "status": self.status.value, "mode": "hw", "requests": self.requests,
            "completed": len(ok), "failed": sum(r.status == "Failed" for r in self.done),
            "unfinished": self.requests - len(self.done), "wedged": self.wedged,
            "corrupted": bool(self.corruption), "diagnosis": self.diagnosis,
            "corruption": self.corruption[:50], "sim_seconds": round(self.run_seconds, 6),
            "wall_seconds": round(self.wall_seconds, 3), "events": self.events,
            "latency": lat, "errors": self.errors, "notes": self.notes,
            "verified": self.verified,
            "corrupted_requests": len(self.corrupted_rooms), "failures": self._failures(),
            "fault_report": self.faults, "log_dir": self.log_dir,
            "refused_connections": dict(sorted(self.refused.items())),
            "dropped_frames": self.dropped_frames, "roots": self.roots,
            "send_blocked_s": self._blocked_by_rank(),
            "send_blocked_by_frame": _rounded(self.blocked_by_frame),
            "send_blocked_by_thread": _rounded(self.blocked_by_thread),
            "send_lost_frames": self.lost_frames,
            **({"agents": self.agents} if self.agents is not None else {}),
        }

    def _blocked_by_rank(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (node, _peer, _thread), sec in self.blocked_on.items():
            out[node] = out.get(node, 0.0) + sec
        return _rounded(out)

    def _failures(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.done:
            if r.status == "Failed":
                key = r.reason.split(":")[0][:80] or "failed"
                out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items()))


class HwRun:
    """Drives one workload through a started ``Launcher``."""

    def __init__(self, launcher: Launcher, workload: Workload, params: SimParams,
                 overrides: dict[int, dict[str, int]], max_concurrency: int,
                 faults: list[FaultSpec] | None = None,
                 echo: Callable[[str], None] | None = None) -> None:
        self.launcher = launcher
        self.cfg: TwinConfig = launcher.cfg
        self.topo = launcher.topo
        self.workload = workload
        self.params = params
        deployment = Deployment.build(self.cfg, params)  # the KV pools a radix cache lives in
        self.placement = Placement(self.cfg, self.topo, params, overrides,
                                   pools=(deployment.prefill.max_total_tokens,
                                          deployment.decode.max_total_tokens))
        self.max_concurrency = max_concurrency
        self.reqs: dict[int, RequestState] = {}
        self.queue: dict[int, deque[RequestState]] = {}
        self.busy: set[int] = set()
        self.timers: list[tuple[float, int, Any]] = []
        self._cpu0 = 0.0
        self._n = 0
        self.last_progress = 0.0
        self.corruption: list[str] = []
        self.verified: dict[int, set[str]] = {}  # room -> decode nodes whose byte check passed
        self.corrupted_rooms: set[int] = set()
        self.crashed: dict[str, str] = {}
        self.deaths: list[Death] = []  # ranks a crash fault took down
        self.blocked_on: dict[tuple[str, str, str], float] = {}
        self.blocked_by_frame: dict[str, float] = {}
        self.blocked_by_thread: dict[str, float] = {}
        self.first_full: dict[tuple[str, str], float] = {}
        self.lost_frames = 0
        self.heartbeat_notes: set[int] = set()  # prefill servers a heartbeat gave up on
        self.dropped: dict[int, list[str]] = {}  # room -> inputs its ranks dropped
        self.fault_notes: dict[int, list[str]] = {}  # room -> injected faults that touched it
        self.notes: list[str] = []
        self.refused: dict[str, int] = {}  # node -> connections refused for want of the run key
        self.echo = echo
        self.faults = list(faults or [])
        self.fired = [0] * len(self.faults)
        self.pool_free = {n: launcher.options.kv_pool_pages for n in self.topo.nodes}
        self.pool_held: dict[tuple[str, int], int] = {}
        # (node, room) whose KV pages a rank is still allocating and filling: a rank busy with
        # that is working, not wedged, however long the pattern fill takes on a loaded host.
        self.setting_up: set[tuple[str, int]] = set()
        opts = launcher.options
        self.wedge_window_s = (opts.wedge_window_s if opts.wedge_window_s is not None
                               else max(params.wedge_window_s, HW_MIN_WEDGE_WINDOW_S))
        self.stopped = RunStatus.INTERRUPTED
        self._next_check = 0.0  # when to look for dead ranks and agents next
        self._flushed_at = 0.0  # when the records were last written to the trace
        launcher.on_records = self._records
        launcher.on_report = self._report

    def _at(self, t: float, fn: Any) -> None:
        self._n += 1
        heapq.heappush(self.timers, (t, self._n, fn))

    # -- records and reports from ranks --------------------------------------------------------
    def _records(self, node: str, records: list[Any]) -> None:
        for t, _event, effects in records:
            for e in effects:
                if isinstance(e, PROGRESS_EFFECTS):
                    self.last_progress = t
                if type(e) is ev.TargetsKnown:
                    self._bootstrapped(node, e.room, len(e.sessions))
                if type(e) is ev.Dropped:
                    note_dropped(self.dropped, node, e)
                if type(e) is ev.RoomTornDown or type(e) is ev.RoomReleased:
                    self._release(node, e.room)

    def _report(self, r: dict[str, Any]) -> None:
        kind = r.get("kind")
        if kind == "concluded" and r["node"].startswith("d"):
            req = self.reqs.get(r["room"])
            if req is None:
                return
            if r["status"] == "Success" or not self.cfg.deferred_decode_kv_release:
                self._release(r["node"], r["room"])  # a held failed room: at its RoomReleased
            if r.get("mismatch"):
                self.corrupted_rooms.add(r["room"])
                self.corruption.append(f"{r['node']} room {r['room']}: {r['mismatch']}")
            elif "mismatch" in r:
                self.verified.setdefault(r["room"], set()).add(r["node"])
            group = len(self.topo.decode_groups[req.decode_group].nodes)
            status = req.note_concluded(r["node"], r["status"], r.get("reason", ""), group)
            if status is not None:
                req.status = status
                req.kv_done_s = self.launcher.now()
                if status == "Success":
                    self.placement.decode_done(self.workload.requests[req.rid],
                                               req.decode_group)
        elif kind == "setup-done":
            self.last_progress = self.launcher.now()
            self.setting_up.discard((r["node"], r["room"]))
        elif kind == "crashed":
            self.crashed[r["node"]] = r["reason"]
        elif kind == "died":
            self._died(r["node"], r["fault"], float(r["t"]))
        elif kind == "send-blocked":
            self._blocked(r)
        elif kind == "heartbeat":
            if r["server"] not in self.heartbeat_notes:  # one note per server, as simulated
                self.heartbeat_notes.add(r["server"])
                p = self.params
                self.launcher.sys({"type": "Note", "text": (
                    f"{r['detail']}: SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL "
                    f"{p.heartbeat_interval_s:g} s, SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE "
                    f"{p.heartbeat_max_failure}; decode fails the server's rooms")})
        elif kind == "fault":
            self.launcher.sys(fault_record(self.fault_notes, r["fault"], r["detail"],
                                           r.get("room", -1)))
            for text in r["fault"].split(";"):
                for i, spec in enumerate(self.faults):
                    if spec.text == text:
                        self.fired[i] += 1
                        break
        elif kind in ("bad-frame", "bad-scatter", "send-failed"):
            self.notes.append(f"{r['node']}: {r['detail']}")
        elif kind == "refused":
            self.refused[str(r["node"])] = int(r["count"])

    def _died(self, node: str, fault: str, t: float) -> None:
        """A crash fault ended ``node``'s process at ``t``: one ``FaultInjected`` record per
        fault (as the simulator writes it), the rank named crashed."""
        reason = crash_reason(fault)
        self.crashed[node] = reason
        at = parse_fault(fault).at  # the fault's time, as the simulator names the death
        self.deaths.append(Death(node, at if at is not None else t, reason))
        for i, spec in enumerate(self.faults):
            if spec.text == fault and not self.fired[i]:
                self.fired[i] += 1
                self.launcher.sys(fault_record(self.fault_notes, fault, "", -1), t=t)
                if self.echo is not None:
                    self.echo(f"{fault}: {node} crashed at t={t:.2f} s; the run goes on")

    def _blocked(self, r: dict[str, Any]) -> None:
        """A rank's send sat ``seconds`` blocked on ``peer`` (``lost``: then timed out)."""
        key = (str(r["node"]), str(r["peer"]), str(r["thread"]))
        sec = float(r["seconds"])
        self.blocked_on[key] = self.blocked_on.get(key, 0.0) + sec
        self.blocked_by_frame[r["frame"]] = self.blocked_by_frame.get(r["frame"], 0.0) + sec
        self.blocked_by_thread[key[2]] = self.blocked_by_thread.get(key[2], 0.0) + sec
        self.first_full.setdefault(key[:2], float(r["t"]))
        self.lost_frames += bool(r.get("lost"))

    # -- the KV pools --------------------------------------------------------------------------
    def _nodes_of(self, index: int) -> list[str]:
        r = self.workload.requests[index]
        o = self.placement.overrides.get(r.rid, {})
        pg = self.topo.prefill_groups[o.get("prefill_group", r.rid % len(self.topo.prefill_groups))]
        dg = self.topo.decode_groups[o.get("decode_group", r.rid % len(self.topo.decode_groups))]
        return [n.id for n in (*pg.nodes, *dg.nodes)]

    def _live_nodes_of(self, index: int) -> list[str]:
        """The request's ranks whose process runs (a crashed rank has no pool to wait for:
        the request goes to it all the same, as the router does not know)."""
        gone = self.launcher.departed
        return [n for n in self._nodes_of(index) if n not in gone]

    def _fits(self, index: int) -> bool:
        """Every live rank of the request's groups has pages for its whole prompt."""
        need = pages_for_tokens(self.workload.requests[index].input_len, self.cfg.page_size)
        return all(self.pool_free[n] >= need for n in self._live_nodes_of(index))

    def _held_failed(self) -> bool:
        """A decode rank still holds the pages of a failed room (released later)."""
        return any(self.reqs[room].finished for (_, room) in self.pool_held
                   if room in self.reqs)

    def _reserve(self, index: int, room: int) -> None:
        need = pages_for_tokens(self.workload.requests[index].input_len, self.cfg.page_size)
        for n in self._live_nodes_of(index):
            self.pool_free[n] -= need
            self.pool_held[(n, room)] = need

    def _release(self, node: str, room: int) -> None:
        self.pool_free[node] += self.pool_held.pop((node, room), 0)

    # -- timed faults --------------------------------------------------------------------------
    def _abort(self, i: int) -> None:
        spec = self.faults[i]
        req = self.reqs.get(spec.room if spec.room is not None else -1)
        if req is None or req.finished:
            return
        self.fired[i] += 1
        reason = f"aborted by fault {spec.text}"
        self.launcher.sys(fault_record(self.fault_notes, spec.text, "", req.room))
        pg = self.topo.prefill_groups[req.prefill_group]
        dg = self.topo.decode_groups[req.decode_group]
        for n in (*pg.nodes, *dg.nodes):
            self.launcher.feed(n.id, ev.RoomAborted(room=req.room, reason=reason))

    # -- requests ------------------------------------------------------------------------------
    def _admit(self, index: int) -> None:
        r = self.workload.requests[index]
        req = self.placement.place(r, self.launcher.now())
        self.reqs[req.room] = req
        self._reserve(index, req.room)
        self.launcher.sys(self.placement.arrival_record(req), t=req.arrival_s)
        self.last_progress = self.launcher.now()
        pg = self.topo.prefill_groups[req.prefill_group]
        dg = self.topo.decode_groups[req.decode_group]
        setup = {"op": "request", "room": req.room, "rid": req.rid,
                 "input_len": req.input_len, "decode_prefix_len": req.decode_prefix_len,
                 "computed": req.extend_end}  # the cached prefix; forwards write the rest
        for n in (*pg.nodes, *dg.nodes):
            self.setting_up.add((n.id, req.room))
            self.launcher.command(n.id, messages.setup_request(setup))
        total = self.placement.total_pages(req)
        for d in dg.nodes:
            self.launcher.feed(d.id, ev.DecodeRoomInit(
                room=req.room, prefill_ranks=self.topo.writers_of(d, pg),
                prefill_attn_tp=self.cfg.prefill.attn_tp_size,
                decode_prefix_len=req.decode_prefix_len, total_pages=total,
                group=self.topo.decode_group_of(d)))

    def _bootstrapped(self, node: str, room: int, known: int) -> None:
        req = self.reqs.get(room)
        if req is None:
            return
        want = len(self.topo.targets_of(self.topo.nodes[node],
                                        self.topo.decode_groups[req.decode_group]))
        group = len(self.topo.prefill_groups[req.prefill_group].nodes)
        if req.note_targets(node, known, want, group):
            req.bootstrap_done_s = self.launcher.now()
            self.queue.setdefault(req.prefill_group, deque()).append(req)
            self._schedule(req.prefill_group)

    def _group_feed(self, group: int, event: Any) -> None:
        for n in self.topo.prefill_groups[group].nodes:
            self.launcher.feed(n.id, event)

    def _schedule(self, group: int) -> None:
        """Start the next request's forwards on an idle prefill group."""
        q = self.queue.get(group)
        if group in self.busy or not q:
            return
        req = q.popleft()
        self.busy.add(group)
        self._group_feed(group, ev.Prefetch(room=req.room))
        end = early_send_end(req.extend_end, req.decode_prefix_len, self.cfg.page_size)
        if self.params.early_send_cached_prefix and end is not None:
            self._group_feed(group, ev.SendKV(room=req.room, end_idx=end, last=False))
        self._at(self.launcher.now() + self.launcher.options.forward_s, lambda: self._forward(group, req))

    def _forward(self, group: int, req: RequestState) -> None:
        req.extend_end = min(req.input_len, req.extend_end + self.cfg.chunked_prefill_size)
        last = req.extend_end >= req.input_len
        self._group_feed(group, ev.SendKV(room=req.room, end_idx=req.extend_end, last=last))
        if last:
            req.prefill_done_s = self.launcher.now()
            self.placement.prefill_done(self.workload.requests[req.rid], req.prefill_group)
            self.busy.discard(group)
            self._schedule(group)
        else:
            self._at(self.launcher.now() + self.launcher.options.forward_s, lambda: self._forward(group, req))

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> HwResult:
        lau = self.launcher
        t_start = time.perf_counter()
        self._cpu0 = time.process_time()
        pending = deque(range(len(self.workload.requests)))
        wedged = False
        for i, spec in enumerate(self.faults):
            if spec.action == "abort":
                self._at(spec.at or 0.0, lambda i=i: self._abort(i))
        try:
            wedged = self._loop(pending)
        except KeyboardInterrupt as exc:
            why = (f"interrupted by {exc.args[0]}" if isinstance(exc, Interrupted)
                   else "interrupted by Ctrl-C")
            self.notes.append(f"{why} at {lau.now():.2f} s; ranks stopped")
            self.stopped = RunStatus.INTERRUPTED
        return self._result(wedged, t_start)

    def _loop(self, pending: deque[int]) -> bool:
        """Drive the run; True when it wedged."""
        lau, opts = self.launcher, self.launcher.options
        while True:
            now = lau.now()
            in_flight = sum(not r.finished for r in self.reqs.values())
            while pending and in_flight < self.max_concurrency and \
                    self.workload.requests[pending[0]].arrival_s <= now and \
                    self._fits(pending[0]):
                self._admit(pending.popleft())
                in_flight += 1
            self._fire_timers()
            wait = 0.02
            if self.timers:
                wait = min(wait, self.timers[0][0] - lau.now())
            if pending and in_flight < self.max_concurrency and self._fits(pending[0]):
                # An arrived request waiting for a slot or for KV pages is admitted on a
                # rank's message, which ends the pump anyway: waiting for its arrival time
                # (long past) would spin this loop and take a core from the ranks.
                wait = min(wait, self.workload.requests[pending[0]].arrival_s - lau.now())
            self._wait(wait)
            # A forward due now goes before the trace's bookkeeping and the liveness checks,
            # and the trace is written while no forward is due soon (a block of it takes
            # milliseconds to encode), or at least every TRACE_FLUSH_MAX_S.
            self._fire_timers()
            t = lau.now()
            if not self.timers or self.timers[0][0] - t > TRACE_FLUSH_GAP_S or \
                    t - self._flushed_at > TRACE_FLUSH_MAX_S:
                self._flushed_at = t
                lau.flush_records()
            if lau.now() >= self._next_check:
                self._next_check = lau.now() + CHECK_ALIVE_S
                lau.check_alive()
            if lau.errors:
                lau.settle_unreachable()
                if self.echo is not None:
                    self.echo(f"{lau.errors[0].split(':')[0]} failed; stopping the other "
                              f"ranks ...")
                return False
            if not pending and all(r.finished for r in self.reqs.values()):
                return False
            gone = lau.departed
            busy = any(node not in gone for node, _ in self.setting_up)  # a dead rank sets up nothing
            if in_flight and not busy and \
                    now - self.last_progress > self.wedge_window_s:
                return True
            if pending and not in_flight and not self._fits(pending[0]) and \
                    (not self._held_failed() or now - self.last_progress > self.wedge_window_s
                     + self.cfg.deferred_decode_kv_release_timeout_s):
                self.notes.append(f"request {pending[0]} does not fit the KV pools with "
                                  f"nothing in flight (pages not released)")
                return True
            if opts.until_s is not None and now >= opts.until_s:
                self.stopped = RunStatus.UNTIL
                self.notes.append(f"stopped at --until {opts.until_s:g} s")
                return False
            if now > opts.timeout_s:
                self.notes.append(f"stopped after --timeout {opts.timeout_s:g} s")
                return False

    def _fire_timers(self) -> None:
        now = self.launcher.now()
        while self.timers and self.timers[0][0] <= now:
            heapq.heappop(self.timers)[2]()

    def _wait(self, wait: float) -> None:
        """Read the ranks' messages for ``wait`` seconds, or until a timer is due: zmq waits
        whole milliseconds, so a rest under one is slept (not spun on, which took a core from
        the ranks as a forward came due), and reading stops when the next timer is due."""
        lau = self.launcher
        until = self.timers[0][0] if self.timers else None
        ms = int(wait * 1000)
        if ms > 0:
            lau.pump(ms, flush=False, until=until)
        elif not lau.pump(0, flush=False, until=until) and wait > 0:
            time.sleep(wait)

    def _result(self, wedged: bool, t_start: float) -> HwResult:
        lau = self.launcher
        unfinished = sorted(r.room for r in self.reqs.values() if not r.finished)
        diagnosis: list[str] = []
        if wedged:
            states = lau.request_states()
            snapshots = {n: st.snapshot for n, st in states.items()}
            diagnosis = diagnose(snapshots, self.crashed, set(unfinished), self.dropped,
                                 self.fault_notes).lines()
            self._unfinished_wrong(states, unfinished)
            silent = sorted(set(lau.endpoints) - set(snapshots) - lau.departed)
            diagnosis += [f"{n} did not report its state (busy or stuck)" for n in silent]
            diagnosis.insert(0, f"wedge: {len(unfinished)} request(s) unfinished with no "
                                f"progress for {self.wedge_window_s:g} s (rooms "
                                f"{', '.join(map(str, unfinished[:12]))})")
        elif unfinished and self.stopped is RunStatus.UNTIL and not lau.errors:
            self._unfinished_wrong(lau.request_states(), unfinished)
        verified = sum(
            r.status == "Success" and self.verified.get(r.room, set()) >= set(r.decode_status)
            for r in self.reqs.values())
        rooms = sorted(self.corrupted_rooms)
        refused = {**self.refused, "coordinator": lau.sock.refused}
        refused = {k: v for k, v in refused.items() if v}
        if refused:
            self.notes.append(
                f"refused {sum(refused.values())} connection(s) from processes without this "
                f"run's key (" + ", ".join(f"{k}: {v}" for k, v in sorted(refused.items())) + ")")
        self.notes.extend(lau.dropped)
        return HwResult(
            verified=verified,
            requests=len(self.workload.requests), done=[r for r in self.reqs.values()
                                                        if r.finished],
            unfinished=unfinished, wedged=wedged, diagnosis=diagnosis,
            corruption=self.corruption, wall_seconds=time.perf_counter() - t_start,
            run_seconds=lau.now(), events=lau.inputs, errors=list(lau.errors), notes=self.notes,
            stopped=self.stopped, corrupted_rooms=rooms,
            faults=fault_report(self.faults, self.fired),
            log_dir=lau.log_dir if lau.failed_nodes else None,
            agents=lau.hub.records() if lau.hub is not None else None,
            coordinator_cpu_s=time.process_time() - self._cpu0,
            refused=refused, dropped_frames=len(lau.dropped))

    def _unfinished_wrong(self, states: dict[str, messages.RankState],
                          unfinished: list[int]) -> None:
        """Wrong bytes the decode ranks found in rooms that never finished (their scatters'
        checks, and written ring regions no scatter read, checked now: twin.hw.ringcheck):
        the run corrupted them before it wedged or stopped."""
        for node, st in sorted(states.items()):
            for room, text in sorted(st.mismatch.items()):
                if room in unfinished:
                    self.corrupted_rooms.add(room)
                    self.corruption.append(f"{node} room {room} (unfinished): {text}")

    def settle(self, result: HwResult) -> None:
        """After the ranks stopped (their last reports read): the blocked sends and the root
        lines that link failed requests to the ranks that died (``twin.runtime.causes``)."""
        result.blocked_on = dict(self.blocked_on)
        result.blocked_by_frame = dict(self.blocked_by_frame)
        result.blocked_by_thread = dict(self.blocked_by_thread)
        result.first_full = dict(self.first_full)
        result.lost_frames = self.lost_frames
        topo = self.topo
        rooms = [RoomEnd(r.room, tuple(n.id for n in (*topo.prefill_groups[r.prefill_group].nodes,
                                                       *topo.decode_groups[r.decode_group].nodes)),
                         r.status if r.finished else "", r.reason)
                 for r in self.reqs.values()]
        result.roots = root_lines(self.deaths, rooms, self.blocked_on, self.first_full)


def pp_direct_refusal(cfg: TwinConfig) -> str | None:
    """Why the hardware mode cannot write this deployment's rooms page by page as SGLang
    does, or None. Equal attention TP is written directly (no staging), except with a
    prefill of ``pp_size > 1``: each PP stage would write its own layers, but the core sizes
    a direct write for every layer."""
    if cfg.stages or cfg.prefill.pp_size == 1:
        return None
    return ("equal prefill and decode attention TP with a prefill of pp_size > 1: SGLang "
            "writes each PP stage's layers of the KV pages directly, but the core sizes a "
            "direct write for every layer")


def check_transport(cfg: TwinConfig, options: HwOptions) -> None:
    """Raise ``HwInputError`` where the ranks' data mover cannot run as asked (Mooncake
    forced on CUDA where the engine cannot register VRAM, a bad ``TWIN_HW_TRANSPORT``), with
    the reason, before any rank starts. Across nodes each agent's ranks decide on its host."""
    if options.across_nodes:
        return
    from twin.hw.mooncake_transport import choose_transport

    try:
        choose_transport(cfg.disaggregation_transfer_backend, options.device)
    except ValueError as exc:
        raise HwInputError(str(exc)) from None


def check_supported(defects: Defects, faults: list[str]) -> None:
    """Reject what the hardware mode does not carry out (with the reason)."""
    if defects.on(SILENT_SLICE_FALLBACK):
        raise HwInputError("defect 'silent-slice-fallback': the per-slice fallback transfer "
                           "is not implemented on hardware; use the simulator")
    for f in faults:
        action = f.split(":", 1)[0]
        if action == "restart":
            raise HwInputError(f"fault {f!r}: a restart (a new rank process mid-run) is "
                               f"simulator-only; on hardware use crash:NODE:at=T (the process "
                               f"ends and the run goes on without it)")
        if action in UNSUPPORTED_FAULTS:
            raise HwInputError(f"fault {f!r}: {action} is simulator-only")


def run_hw(cfg: TwinConfig, workload: Workload, *, defects: Defects | None = None,
           faults: list[str] | None = None, seed: int = 0, params: SimParams | None = None,
           options: HwOptions | None = None, trace_out: str | None = None,
           request_overrides: dict[int, dict[str, int]] | None = None,
           max_concurrency: int | None = None,
           echo: Callable[[str], None] | None = None) -> HwResult:
    """Run ``workload`` on real rank processes; the trace streams to ``trace_out``. Ctrl-C,
    SIGTERM and SIGHUP end the run as ``interrupted``; ``echo`` gets rank errors as they
    happen. With ``options.listen`` the ranks run on the nodes of the agents that join (their
    clocks and the placement are printed through ``echo`` first)."""
    defects = defects or Defects()
    faults = list(faults or [])
    params = params or SimParams()
    options = options or HwOptions()
    staged = pp_direct_refusal(cfg)
    if staged is not None:
        cfg = cfg.replace(stage_equal_tp=True)
        if echo is not None:
            echo(f"note: {staged}; the hardware mode stages these rooms through the ring "
                 f"(stage_equal_tp)")
    check_supported(defects, faults)
    check_transport(cfg, options)
    specs = [parse_fault(f) for f in faults]
    header: dict[str, Any] | None = None
    if trace_out is not None:
        from twin.runtime.header import trace_header

        plain = cfg.replace(extra={k: v for k, v in cfg.extra.items() if k != "placement"})
        header = trace_header(plain, workload, defects=defects,
                              faults=specs, seed=seed, params=params,
                              request_overrides=request_overrides or {},
                              max_concurrency=max_concurrency, mode="hw")
        if not options.across_nodes:  # every rank runs here: the host and its probe
            from twin.hw.probe import host_record

            header["config"]["run"]["host"] = host_record()
    writer: Any = None

    def open_writer(started: dict[str, Any] | None = None) -> Any:
        """The trace, opened once the ranks are ready (the header's [run] table records their
        warm-up and the coordinator's pacing: ``started``) or when the run ends before that."""
        nonlocal writer
        if header is not None and writer is None:
            from twin.trace.format import TraceWriter

            header["config"]["run"].update(started or {})
            # inline: this process runs zmq threads, which a fork would not carry; blocks are
            # compressed on a thread of their own, not between the forwards this loop paces
            writer = TraceWriter(trace_out, header,  # type: ignore[arg-type]
                                 encoder="inline", threaded=True)
        return writer

    result: HwResult | None = None
    try:
        with signals_interrupt():
            hub = None
            try:
                hub = open_hub(cfg, options, echo)
            finally:
                if header is not None and hub is not None:
                    header["agents"] = hub.records()  # who ran what, and their clocks
            # The trace opens once the ranks are warm (its header records the warm-up), before
            # the run's clock starts: nothing of the warm-up is recorded.
            with Launcher(cfg, defects=defects, faults=faults, seed=seed, options=options,
                          hub=hub, params=params, open_writer=open_writer) as launcher:
                run = HwRun(launcher, workload, params, request_overrides or {},
                            max_concurrency or options.max_concurrency, faults=specs,
                            echo=echo)
                result = run.run()
            run.settle(result)
            result.notes.extend(launcher.clock_notes)
            if launcher.hub is not None:  # with the clocks re-checked at the end
                result.agents = launcher.hub.records()
    except BaseException as exc:
        if open_writer() is not None:  # a run that never started leaves its trace too
            writer.close(writer.abort_outcome(exc))
        raise
    if writer is not None:
        writer.close(_outcome(result))
    return result


def _rounded(d: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 6) for k, v in sorted(d.items()) if v > 0}


def _outcome(result: HwResult) -> dict[str, Any]:
    return result.verdict.record()
