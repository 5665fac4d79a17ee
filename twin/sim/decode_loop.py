"""The decode scheduler of one attention group: continuous batching around the transfer.

SGLang's decode event loop (``disaggregation/decode.py``, ``event_loop_*_disagg_decode`` and
``process_decode_queue``), one iteration at a time:

1. resume retracted requests that fit again; **while any request is retracted, nothing else
   happens in this step** (no pre-allocation, no scatter polling, no frees, no admission);
2. every ``disaggregation_decode_polling_interval`` iterations: pre-allocate KV pages for
   waiting requests (FIFO, as many as the pool admits; each admitted request's room is
   initialised on every decode rank, which sends its metadata), poll the scatter events that
   finished (``ScatterDone``: staging freed, watermark broadcast), and move requests whose KV
   fully landed to the waiting queue (failed ones release their pages);
3. merge waiting requests into the running batch (up to ``max_running_requests``): each
   streams its first token now (computed by prefill, carried with the KV);
4. make room for one more token per running request, retracting the most recently admitted
   requests when the KV pool is short (their KV is backed up and restored on resume);
5. run one decode step for the whole batch (``ServerCosts.decode_step_s(batch, context)``);
   requests that produced their last token free their pages when it ends.

With nothing to run, the loop iterates every ``decode_poll_interval_s`` while work is pending,
and sleeps when nothing can change until an outside event (an arrival, a scatter, a room
concluding). Decode is simulated per batch step, not per request token: a step costs O(1)
plus the requests it admits or finishes.

KV accounting is in tokens (page rounding ignored): a request holds its private prompt tokens
(those after the decode radix hit) from pre-allocation and one more per decoded token.
Admission follows ``pop_preallocated``: the pool less ``num_reserved_decode_tokens`` per active
request (or the largest remaining need of a running request, if larger) and the retracted
requests' needs must cover the prompt.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from twin.core import events as ev
from twin.core.topology import Topology
from twin.models.costs import ServerCosts
from twin.runtime.params import SimParams
from twin.runtime.requests import RequestState

MAX_RUN = 256
"""Most decode steps one scheduled callback covers."""

RECORD_EVERY_S = 0.01
"""Time resolution of the loop's recorded series while only the KV tokens change."""

RETRACT_DECODE_STEPS = 20
"""After a retraction the batch keeps room for this many more steps (SGLang's constant)."""


class LoopHost(Protocol):
    """What a decode loop needs from its simulation (``Simulation`` provides it)."""

    params: SimParams
    topo: Topology

    def time(self) -> float: ...
    def at(self, delay: float, fn: Callable[..., object], *args: Any) -> None: ...
    def feed(self, node: str, event: ev.Input) -> list[ev.Effect]: ...
    def mark_progress(self) -> None: ...
    def decode_admitted(self, req: RequestState) -> None: ...
    def first_token(self, req: RequestState) -> None: ...
    def request_ended(self, req: RequestState) -> None: ...
    def scheduler_blocked_until(self, nodes: list[str]) -> float: ...


@dataclass(slots=True)
class _Slot:
    """A request in the running batch (or retracted from it)."""

    req: RequestState
    held: int  # KV tokens held at ``since``
    since: int  # step number when it joined the batch
    generated: int  # tokens produced before ``since``
    seq: int  # admission order (retraction takes the newest)

    def held_at(self, step: int) -> int:
        return self.held + (step - self.since)


@dataclass
class LoopSeries:
    """One group's decode loop over time (one point per decode step or state change)."""

    t: list[float] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    kv_tokens: list[int] = field(default_factory=list)
    queued: list[int] = field(default_factory=list)  # waiting for pre-allocation
    retracted: list[int] = field(default_factory=list)
    steps: int = 0  # decode steps run


class DecodeLoop:
    """One decode attention group's scheduler loop (see the module docstring)."""

    def __init__(self, sim: LoopHost, group: int, costs: ServerCosts) -> None:
        self.sim = sim
        self.group = group
        self.nodes = [n.id for n in sim.topo.decode_groups[group].nodes]
        self.costs = costs
        self.capacity = costs.max_total_tokens
        self.max_running = costs.max_running_requests
        self.reserve = costs.args.num_reserved_decode_tokens
        self.poll_every = max(1, costs.args.disaggregation_decode_polling_interval)
        self.idle_s = sim.params.decode_poll_interval_s
        self.prealloc: deque[RequestState] = deque()
        self.transfer: dict[int, RequestState] = {}
        self.concluded: list[RequestState] = []
        self.waiting: deque[_Slot] = deque()
        self.running: dict[int, _Slot] = {}
        self.retracted: deque[_Slot] = deque()
        self.scatters: dict[str, deque[tuple[float, ev.ScatterDone]]] = {
            n: deque() for n in self.nodes}
        self.used = 0  # KV tokens held by pre-allocated, waiting and running requests
        self.ctx = 0  # KV tokens of the running batch
        self.step = 0
        self.polls = 0
        self.seq = 0
        self.steps_run = 0
        self.retractions = 0
        self._ends: list[tuple[int, int, int]] = []  # (last step, seq, room) of running slots
        self._busy = False  # an iteration or a run of steps is scheduled
        self._token = 0
        self._next_at = 0.0
        self._blocked = 0.0  # the scheduler thread sits in a blocked send until then
        self._run_times: list[float] = []  # step ends of the run in flight
        self.series = LoopSeries()
        self.iterations: list[float] | None = None  # set to a list to record every iteration

    # -- what the simulation tells the loop ----------------------------------------------------
    def arrived(self, req: RequestState) -> None:
        """The request reached this decode server (handshake done): wait for KV pages."""
        self.prealloc.append(req)
        self._kick()

    def scatter_started(self, node: str, finish: float, done: ev.ScatterDone) -> None:
        """A scatter was launched on ``node``'s stream; its event fires at ``finish``."""
        self.scatters[node].append((finish, done))
        self._kick(finish)

    def room_concluded(self, req: RequestState) -> None:
        """Every decode rank of the group concluded the room (Success or Failed)."""
        self.concluded.append(req)
        self._kick()

    def abandon(self, req: RequestState) -> bool:
        """Drop a request still waiting for pre-allocation (aborted); True if it was there."""
        try:
            self.prealloc.remove(req)
        except ValueError:
            return False
        return True

    def lose_all(self) -> list[RequestState]:
        """The decode server's process died: every request it held (waiting for pages, in
        transfer, queued, running or retracted) is gone with it, and its KV pool with them.
        Returns those requests (not yet ended); the loop starts empty."""
        lost = list(self.prealloc) + list(self.transfer.values())
        lost += [r for r in self.concluded if r.room not in self.transfer]
        lost += [s.req for s in (*self.waiting, *self.running.values(), *self.retracted)]
        self.prealloc.clear()
        self.transfer.clear()
        self.concluded = []
        self.waiting.clear()
        self.running.clear()
        self.retracted.clear()
        self._ends = []
        self.used = 0
        self.ctx = 0
        self._token += 1  # a scheduled iteration of the old process does nothing
        self._busy = False
        self._run_times = []
        self._blocked = 0.0
        return list({r.room: r for r in lost}.values())

    # -- the loop ------------------------------------------------------------------------------
    # Scheduling: one pending callback at a time (``_token`` cancels a superseded one). A run
    # of decode steps during which nothing the loop polls can change is one callback, not one
    # per step: it ends at the first request's last token, when the KV pool would run short,
    # at the first step boundary after a scatter finishes, or after MAX_RUN steps; an outside
    # event (arrival, scatter, conclusion) cuts it at the first boundary the per-step loop
    # would have seen it. The result is the same as iterating step by step.

    def _grid(self, t: float) -> float:
        p = self.idle_s
        return math.ceil(t / p - 1e-9) * p if p > 0 else t

    def _schedule(self, at: float, fn: Callable[..., None], *args: Any) -> None:
        self._token += 1
        self._next_at = at
        self._busy = True
        self.sim.at(at - self.sim.time(), self._fire, self._token, fn, args)

    def _fire(self, token: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        if token == self._token:
            fn(*args)

    def _kick(self, due: float | None = None) -> None:
        """Something the next poll must see happens at ``due`` (default now)."""
        now = self.sim.time()
        if self._blocked > now:
            return  # stuck in a send: the loop looks again when it returns
        due = now if due is None else max(due, now)
        if not self._busy:
            self._schedule(max(self._grid(due), now), self._iterate)
        elif self._run_times:  # cut a run of steps at the first boundary at or after ``due``
            times = self._run_times
            j = bisect_left(times, due)
            if j < len(times) - 1:
                del times[j + 1:]
                self._schedule(times[j], self._steps_done, j + 1)
        elif self._grid(due) < self._next_at:  # an idle poll, due earlier
            self._schedule(max(self._grid(due), now), self._iterate)

    def _iterate(self) -> None:
        now = self.sim.time()
        if self.iterations is not None:
            self.iterations.append(now)
        if self.retracted:
            self._resume_retracted()
        if not self.retracted:
            self.polls = (self.polls + 1) % self.poll_every
            if self.polls == 0:
                if self.prealloc:
                    self._pop_preallocated()
                self._poll_scatters(now)
                if self.concluded:
                    self._pop_transferred()
        if self.waiting:
            self._merge_waiting()
        if self.running and self.capacity - self.used < len(self.running):
            self._make_room()
        self._record(now)
        blocked = self.sim.scheduler_blocked_until(self.nodes)
        if blocked > now:
            # A send of this iteration (a WATERMARK or metadata to a dead peer) blocks the
            # scheduler thread (twin/sim/sockets.py): no step runs until it returns.
            self._blocked = blocked
            if math.isinf(blocked):
                self._token += 1  # never again
                self._busy = True
                return
            self._schedule(blocked, self._unblocked)
            return
        if self.running:
            self._run_steps(now)
            return
        self._idle(now)

    def _unblocked(self) -> None:
        """The blocked send returned: the iteration goes on to its decode step."""
        now = self.sim.time()
        if self.running:
            self._run_steps(now)
        else:
            self._iterate()

    def _run_steps(self, now: float) -> None:
        n = len(self.running)
        steps = 1
        if self.poll_every == 1 and not self.prealloc and not self.retracted:
            ends = self._ends
            while ends and (ends[0][2] not in self.running
                            or self.running[ends[0][2]].seq != ends[0][1]):
                heapq.heappop(ends)  # stale: retracted since
            steps = min(MAX_RUN, max(1, (self.capacity - self.used) // n),
                        ends[0][0] - self.step if ends else MAX_RUN)
        due = min((q[0][0] for q in self.scatters.values() if q), default=math.inf)
        times: list[float] = []
        self._run_times = times
        t, ctx = now, self.ctx
        costs = self.costs
        if costs.profile is None:
            # ``ServerCosts.decode_step_s`` without a call per step (the same float operations)
            base, per_ctx = costs.analytic_decode_terms(n)
            for _ in range(max(1, steps)):
                t += base + ctx * per_ctx
                ctx += n
                times.append(t)
                if t >= due:
                    break
        else:
            step_s = costs.decode_step_s
            for _ in range(max(1, steps)):
                t += step_s(n, ctx)
                ctx += n
                times.append(t)
                if t >= due:
                    break
        self._schedule(t, self._steps_done, len(times))

    def _idle(self, now: float) -> None:
        """Nothing to run: iterate again while something can change, else sleep."""
        p = self.idle_s
        if self.concluded or self.waiting or self.retracted:
            self._schedule(now + p, self._iterate)
            return
        finish = min((q[0][0] for q in self.scatters.values() if q), default=None)
        if finish is not None:
            at = self._grid(finish)
            self._schedule(at if at > now else now + p, self._iterate)
            return
        self._busy = False  # sleep; an arrival, scatter or conclusion wakes the loop

    def _steps_done(self, count: int) -> None:
        self._run_times = []
        n = len(self.running)
        self.step += count
        self.steps_run += count
        self.series.steps += count
        self.ctx += n * count
        self.used += n * count
        ends = self._ends
        while ends and ends[0][0] <= self.step:
            _, seq, room = heapq.heappop(ends)
            slot = self.running.get(room)
            if slot is None or slot.seq != seq:
                continue  # retracted since; its entry is stale
            del self.running[room]
            held = slot.held_at(self.step)
            self.ctx -= held
            self.used -= held
            self.sim.request_ended(slot.req)
        self.sim.mark_progress()
        self._iterate()

    # -- SGLang's steps ------------------------------------------------------------------------
    def _active(self) -> int:
        return len(self.running) + len(self.transfer) + len(self.waiting) + len(self.concluded)

    def _allocatable(self, count_retracted: bool) -> int:
        need_single = 0
        if self.running:
            retractable = self.ctx
            need_single = max(s.req.input_len + s.req.output_len for s in
                              self.running.values()) - retractable
        free = self.capacity - self.used
        out = free - max(self.reserve * self._active(), need_single)
        if count_retracted:
            out -= sum(self._need(s) for s in self.retracted)
        return out

    def _need(self, slot: _Slot) -> int:
        return slot.held + self.reserve

    def _pop_preallocated(self) -> None:
        if not self.prealloc:
            return
        budget = self._allocatable(count_retracted=True)
        while self.prealloc:
            req = self.prealloc[0]
            if req.finished:  # aborted while it waited
                self.prealloc.popleft()
                continue
            if self._active() >= self.max_running:
                break
            need = self._private_tokens(req)
            if need > budget:
                break
            self.prealloc.popleft()
            budget -= need + self.reserve
            self.used += need
            self.transfer[req.room] = req
            self.sim.decode_admitted(req)

    def _private_tokens(self, req: RequestState) -> int:
        return max(1, req.input_len - req.decode_prefix_len)

    def _poll_scatters(self, now: float) -> None:
        for node in self.nodes:
            q = self.scatters[node]
            while q and q[0][0] <= now:
                self.sim.feed(node, q.popleft()[1])

    def _pop_transferred(self) -> None:
        if not self.concluded:
            return
        done, self.concluded = self.concluded, []
        for req in done:
            if self.transfer.pop(req.room, None) is None:
                continue
            need = self._private_tokens(req)
            if req.status != "Success":
                self.used -= need
                self.sim.request_ended(req)
                continue
            self.seq += 1
            self.waiting.append(_Slot(req, need, 0, 0, self.seq))

    def _merge_waiting(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            slot = self.waiting.popleft()
            req = slot.req
            if slot.generated == 0:
                slot.generated = 1
                self.sim.first_token(req)
            left = req.output_len - slot.generated
            if left <= 0:
                self.used -= slot.held
                self.sim.request_ended(req)
                continue
            slot.since = self.step
            self.running[req.room] = slot
            self.ctx += slot.held
            heapq.heappush(self._ends, (self.step + left, slot.seq, req.room))

    def _make_room(self) -> None:
        """``check_decode_mem``/``retract_decode``: one token per running request must fit;
        when it does not, retract the newest until RETRACT_DECODE_STEPS more steps fit."""
        if self.capacity - self.used >= len(self.running):
            return
        while self.running and \
                self.capacity - self.used < len(self.running) * RETRACT_DECODE_STEPS:
            room = next(reversed(self.running))
            slot = self.running.pop(room)
            held = slot.held_at(self.step)
            self.ctx -= held
            self.used -= held
            slot.generated += self.step - slot.since
            slot.held = held
            slot.req.retractions += 1
            self.retractions += 1
            self.retracted.append(slot)
            if len(self.running) <= 1:
                break

    def _resume_retracted(self) -> None:
        if not self.retracted:
            return
        budget = self._allocatable(count_retracted=False)
        while self.retracted and self._active() < self.max_running:
            slot = self.retracted[0]
            if self._need(slot) > budget:
                break
            self.retracted.popleft()
            budget -= self._need(slot)
            self.used += slot.held
            self.seq += 1
            slot.seq = self.seq
            self.waiting.append(slot)

    def _record(self, now: float) -> None:
        """One point per change of batch, queue or retractions, and at least every
        ``RECORD_EVERY_S`` while the KV pool moves (not one per step: a long run has
        hundreds of thousands of steps)."""
        s = self.series
        if s.t and s.batch[-1] == len(self.running) and s.queued[-1] == len(self.prealloc) \
                and s.retracted[-1] == len(self.retracted) and (
                    s.kv_tokens[-1] == self.used or now - s.t[-1] < RECORD_EVERY_S):
            return
        s.t.append(now)
        s.batch.append(len(self.running))
        s.kv_tokens.append(self.used)
        s.queued.append(len(self.prealloc))
        s.retracted.append(len(self.retracted))
