"""An in-memory cluster of core ranks whose every pending action can be taken in any order.

``Cluster`` holds prefill and decode ranks of one deployment and a list of pending actions
(message deliveries, transfer and scatter completions, worker polls, bootstrap metadata, the
scheduler's sends). ``choices()`` lists the actions that may go next: frames keep FIFO order per
(source, destination, socket) as ZMQ does (``wire.socket_of``: prefill's STAGING_REQ has a
socket of its own, so it may overtake or trail the same rank's CHUNK_READY and KV_STATUS;
decode's bootstrap metadata shares its control socket), everything else is free. ``step(i)``
takes one. Property tests and the wedge explorer drive it; it checks the core's invariants
after every step. The decode group's poll reduction happens within a step (the runtime hands a
``GroupPoll`` to the peers it holds at once), as SGLang's lockstep all-reduce does.

Logical time: every step takes ``step_s``. An input the core scheduled for a later time (a
worker's re-poll at ``Deferred.retry_at`` or ``WakeWorkers.at``, a registration at
``register_at``, a timeout's ``Tick`` at ``SetTimer.at``) waits in ``timers`` and becomes a
pending action only once the clock reaches it, either by steps or, when nothing is pending, by
``advance()`` jumping to the earliest one. So a worker re-polling a chunk that cannot move
costs logical time, and the timeouts that settle such a state do come.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from twin.core import events as ev
from twin.core import wire
from twin.core.config import TwinConfig
from twin.core.decode import DecodeRank
from twin.core.defects import Defects
from twin.core.grid import pages_for_tokens
from twin.core.integrity import IntegrityModel
from twin.core.prefill import PrefillRank
from twin.core.sendplan import PlannedSend, plan_sends
from twin.core.topology import Topology, build_ranks
from twin.runtime.runtime import Runtime


@dataclass(frozen=True, slots=True)
class Action:
    kind: str  # msg | meta | xfer | scatter | poll | send | register | control | tick
    node: str
    event: ev.Input
    src: str = ""
    seq: int = 0
    token: int = 0  # a poll's token: taken after a newer poll of its worker, it is a no-op
    at: float = 0.0  # a scheduled input's time (poll, register, tick); 0 for the others


@dataclass(slots=True)
class RoomPlan:
    room: int
    input_len: int
    decode_prefix_len: int
    prefill_group: int
    decode_group: int
    sends: list[PlannedSend]
    total_pages: int
    next_send: int = 0
    bootstrapped: set[str] = field(default_factory=set)
    decode_status: dict[str, str] = field(default_factory=dict)


class InvariantViolation(AssertionError):
    """A safety property of the protocol failed; the message names it."""


class Livelock(AssertionError):
    """The cluster stayed busy past a run's step budget; the message names what kept it busy.

    A protocol that keeps re-polling or re-requesting without progress fails a run this way
    instead of running without bound."""


class Cluster:
    """Prefill and decode ranks of ``cfg`` wired through a pending-action list.

    It is the runtime's driver in logical time: every send, transfer and scatter becomes a
    pending action at once; a poll, registration or timeout (``Tick``) scheduled for a later
    time waits in ``timers`` (a heap of ``(at, seq, action)``) until the clock reaches it.
    """

    def __init__(self, cfg: TwinConfig, defects: Defects | None = None,
                 step_s: float = 1e-3) -> None:
        self.cfg = cfg
        self.defects = defects or Defects()
        self.topo = Topology(cfg)
        self.runtime = Runtime(build_ranks(self.topo, self.defects), self, recorder=self,
                               hooks={ev.RoomConcluded: self._on_concluded,
                                      ev.TargetsKnown: self._on_targets_known})
        self.pending: list[Action] = []
        self.rooms: dict[int, RoomPlan] = {}
        self.integrity = IntegrityModel(cfg.ring_bytes, cfg.prefill.pp_size)
        self.in_flight: dict[tuple[str, int], ev.StartTransfer] = {}
        self.timers: list[tuple[float, int, Action]] = []
        self.crashed: list[str] = []
        self.now = 0.0
        self.step_s = step_s
        self._seq = 0
        self._wm_seen: dict[str, tuple[int, int]] = {}
        self.log: list[tuple[float, str, ev.Input]] = []

    @property
    def ranks(self) -> dict[str, PrefillRank | DecodeRank]:
        return self.runtime.ranks

    def time(self) -> float:
        return self.now

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, room: int, input_len: int, *, decode_prefix_len: int = 0,
                    prefill_prefix_len: int = 0, prefill_group: int = 0,
                    decode_group: int = 0) -> None:
        cfg = self.cfg
        pg = self.topo.prefill_groups[prefill_group]
        dg = self.topo.decode_groups[decode_group]
        suffix = input_len - decode_prefix_len
        total_pages = pages_for_tokens(suffix, cfg.page_size)
        sends = plan_sends(input_len, prefill_prefix_len, decode_prefix_len,
                           cfg.chunked_prefill_size, cfg.page_size)
        self.rooms[room] = RoomPlan(room, input_len, decode_prefix_len, prefill_group,
                                    decode_group, sends, total_pages)
        for d in dg.nodes:
            self._feed(d.id, ev.DecodeRoomInit(
                room=room, prefill_ranks=self.topo.writers_of(d, pg),
                prefill_attn_tp=cfg.prefill.attn_tp_size, decode_prefix_len=decode_prefix_len,
                total_pages=total_pages, group=self.topo.decode_group_of(d)))

    # -- choosing and taking actions ---------------------------------------------------------
    def choices(self) -> list[int]:
        """Indices of ``pending`` that may be taken next (FIFO per source, destination and
        socket for frames and metadata)."""
        seen_links: set[tuple[str, str, str]] = set()
        out = []
        for i, a in enumerate(self.pending):
            link = self.link_of(a)
            if link is not None:
                if link in seen_links:
                    continue
                seen_links.add(link)
            out.append(i)
        return out

    @staticmethod
    def link_of(a: Action) -> tuple[str, str, str] | None:
        """The ordered channel an action travels on, or None when it is free to go any time."""
        if a.kind == "msg":
            return (a.src, a.node, wire.socket_of(a.event.msg))  # type: ignore[union-attr]
        if a.kind == "meta":
            return (a.src, a.node, wire.CONTROL_SOCKET)
        return None

    def step(self, index: int) -> Action:
        """Take ``pending[index]``: the clock moves on by ``step_s`` (scheduled inputs due by
        then become pending), then the action's input is fed."""
        action = self.pending.pop(index)
        self.now += self.step_s
        self._release_due()
        self._take(action)
        return action

    def _take(self, action: Action) -> None:
        if action.kind == "send":
            plan = self.rooms[action.event.room]  # type: ignore[union-attr]
            plan.next_send += 1
            for n in self.topo.prefill_groups[plan.prefill_group].nodes:
                self._feed(n.id, action.event)
            self._queue_next_send(plan)
        elif action.kind == "xfer":
            self._land(action.node, action.event.worker)  # type: ignore[union-attr]
            self._feed(action.node, action.event)
        elif self.runtime.is_current(action.node, action.event, action.token):
            self._feed(action.node, action.event, src=action.src)

    def run(self, max_steps: int = 200_000,
            pick: Callable[[list[int]], int] | None = None) -> int:
        """Take actions (first choice, or ``pick(choices)``) until none is pending or scheduled;
        when none is pending the clock jumps to the next scheduled input (``advance``).
        Returns the steps taken; raises ``Livelock`` after ``max_steps``."""
        steps = 0
        while True:
            cs = self.choices()
            if not cs:
                if self.advance() is None:
                    return steps
                continue
            if steps >= max_steps:
                raise Livelock(f"still busy after {max_steps} steps: {self.busy_report()}")
            self.step(cs[0] if pick is None else pick(cs))
            steps += 1

    def advance(self, timeouts: bool = True) -> Action | None:
        """Move the clock to the earliest scheduled input (not counting timeouts when
        ``timeouts`` is False) and make every input due by then pending; return that input's
        action, or None when none is scheduled. Polls replaced by newer ones are dropped."""
        self._drop_stale()
        due = [t for t in self.timers if timeouts or t[2].kind != "tick"]
        if not due:
            return None
        at, _, action = min(due)
        self.now = max(self.now, at)
        self._release_due()
        return action

    def fire_timers(self) -> bool:
        """Fire the earliest timeout: the clock moves to it (scheduled inputs due by then become
        pending) and its rank ticks at once. A timeout already due fires first. False if no
        timeout is armed."""
        for i, a in enumerate(self.pending):
            if a.kind == "tick":
                self.pending.pop(i)
                self._take(a)
                return True
        ticks = [t for t in self.timers if t[2].kind == "tick"]
        if not ticks:
            return False
        entry = min(ticks)
        self.timers.remove(entry)
        heapq.heapify(self.timers)
        self.now = max(self.now, entry[0])
        self._release_due()
        self._take(entry[2])
        return True

    def _release_due(self) -> None:
        """Scheduled inputs whose time has come become pending (earliest first)."""
        timers = self.timers
        while timers and timers[0][0] <= self.now:
            action = heapq.heappop(timers)[2]
            if self.runtime.is_current(action.node, action.event, action.token):
                self.pending.append(action)

    def _drop_stale(self) -> None:
        """Forget scheduled polls that a newer poll of the same worker replaced."""
        keep = [t for t in self.timers
                if self.runtime.is_current(t[2].node, t[2].event, t[2].token)]
        if len(keep) < len(self.timers):
            heapq.heapify(keep)
            self.timers = keep

    def busy_report(self, recent: int = 2000) -> str:
        """What keeps the cluster busy: pending and scheduled actions by kind, rank and input
        (a frame by its message), and the inputs fed most often lately."""
        def top(c: Counter[str]) -> str:
            return ", ".join(f"{k} x{n}" for k, n in c.most_common(6)) or "none"

        def count(actions: Iterable[Action]) -> str:
            return top(Counter(f"{a.kind} {a.node} {_name(a.event)}" for a in actions))
        fed = Counter(f"{node} {_name(e)}" for _, node, e in self.log[-recent:])
        return (f"t={self.now:.3f}s, unfinished rooms {self.unfinished()}; pending: "
                f"{count(self.pending)}; scheduled: {count(t[2] for t in self.timers)}; "
                f"last {min(recent, len(self.log))} inputs: {top(fed)}")

    # -- the runtime's driver ----------------------------------------------------------------
    def _feed(self, node: str, event: ev.Input, src: str = "") -> None:
        self.runtime.feed(node, event)
        self._check(node)

    def write_input(self, t: float, node: str, event: ev.Input) -> None:
        self.log.append((t, node, event))

    def write_effects(self, t: float, node: str, effects: list[ev.Effect]) -> None:
        for e in effects:
            if type(e) is ev.RankCrashed:
                self.crashed.append(f"{node}: {e.reason}")

    def _push(self, kind: str, node: str, event: ev.Input, src: str = "", token: int = 0) -> None:
        self._seq += 1
        self.pending.append(Action(kind, node, event, src, self._seq, token))

    def feed_at(self, at: float, node: str, event: ev.Input, token: int) -> None:
        """Schedule ``event`` for ``at``: pending at once when due, else a timer."""
        kind = ("tick" if type(event) is ev.Tick else
                "poll" if type(event) is ev.WorkerPoll else "register")
        self._seq += 1
        action = Action(kind, node, event, seq=self._seq, token=token, at=at)
        if at <= self.now:
            self.pending.append(action)
        else:
            heapq.heappush(self.timers, (at, self._seq, action))

    def transmit(self, src: str, dst: str, msg: wire.Message) -> None:
        self._push("msg", dst, ev.MessageArrived(src=src, msg=msg), src=src)

    def control(self, src: str, dst: str, event: ev.Input) -> None:
        self._push("meta" if type(event) is ev.RoomBootstrapped else "control", dst, event,
                   src=src)

    def start_transfer(self, node: str, e: ev.StartTransfer) -> None:
        self.in_flight[(node, e.worker)] = e
        self._push("xfer", node, ev.TransferDone(worker=e.worker))

    def start_scatter(self, node: str, e: ev.StartScatter) -> None:
        self.integrity.on_scatter(node, e, list(e.writer_bytes))
        self._push("scatter", node, ev.ScatterDone(room=e.room, chunk_idx=e.chunk_idx,
                                                   alloc_id=e.alloc_id))

    def _on_concluded(self, node: str, e: ev.RoomConcluded) -> None:
        plan = self.rooms.get(e.room)
        if plan is None:
            return
        if self.topo.nodes[node].role == "decode":
            plan.decode_status[node] = e.status
            self.integrity.on_concluded(node, e.room, e.status, plan.total_pages)

    def _on_targets_known(self, node: str, e: ev.TargetsKnown) -> None:
        plan = self.rooms.get(e.room)
        if plan is None:
            return
        want = len(self.topo.targets_of(self.topo.nodes[node],
                                        self.topo.decode_groups[plan.decode_group]))
        if len(e.sessions) == want:
            plan.bootstrapped.add(node)
        pg = self.topo.prefill_groups[plan.prefill_group]
        if len(plan.bootstrapped) == len(pg.nodes) and plan.next_send == 0 and not any(
                a.kind == "send" and a.event.room == e.room  # type: ignore[union-attr]
                for a in self.pending):
            self._queue_next_send(plan)

    def _queue_next_send(self, plan: RoomPlan) -> None:
        if plan.next_send < len(plan.sends):
            s = plan.sends[plan.next_send]
            self._push("send", "", ev.SendKV(room=plan.room, end_idx=s.end_idx, last=s.last))

    # -- TransferDone needs the write to land first ------------------------------------------
    def _land(self, node: str, worker: int) -> None:
        t = self.in_flight.pop((node, worker))
        self.integrity.on_transfer(t.session, t)

    def _check(self, node: str) -> None:
        rank = self.ranks[node]
        if isinstance(rank, DecodeRank):
            wm = rank.watermark
            prev = self._wm_seen.get(node, (0, 0))
            if wm < prev:
                raise InvariantViolation(f"{node}: watermark moved backwards {prev} -> {wm}")
            self._wm_seen[node] = wm
            ring = self.cfg.ring_bytes
            live = sorted((a.round * ring + a.offset, a.round * ring + a.offset + a.size,
                           a.alloc_id) for a in rank.live_allocations())
            for (_, end_a, a), (start_b, _, b) in zip(live, live[1:], strict=False):
                if start_b < end_a:
                    raise InvariantViolation(f"{node}: live allocations {a} and {b} overlap")
        else:
            for session, wm in rank.session_watermarks().items():
                key = f"{node}>{session}"
                prev = self._wm_seen.get(key, (0, 0))
                if wm < prev:
                    raise InvariantViolation(f"{key}: watermark moved backwards {prev} -> {wm}")
                self._wm_seen[key] = wm

    # -- status ------------------------------------------------------------------------------
    def unfinished(self) -> list[int]:
        """Rooms not concluded on every decode rank of their group."""
        out = []
        for plan in self.rooms.values():
            n = len(self.topo.decode_groups[plan.decode_group].nodes)
            if len(plan.decode_status) < n:
                out.append(plan.room)
        return out

    def outcome(self, room: int) -> str:
        st = set(self.rooms[room].decode_status.values())
        if not st or len(self.rooms[room].decode_status) < len(
                self.topo.decode_groups[self.rooms[room].decode_group].nodes):
            return "pending"
        return "Success" if st == {"Success"} else "Failed"


def _name(event: ev.Input) -> str:
    """An input's name for reports: a frame's message type, else the input's type."""
    if type(event) is ev.MessageArrived:
        return type(event.msg).__name__
    return type(event).__name__
