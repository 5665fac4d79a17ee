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
"""

from __future__ import annotations

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
    kind: str  # msg | meta | xfer | scatter | poll | send | register | control
    node: str
    event: ev.Input
    src: str = ""
    seq: int = 0
    token: int = 0  # a poll's token: taken after a newer poll of its worker, it is a no-op


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


class Cluster:
    """Prefill and decode ranks of ``cfg`` wired through a pending-action list.

    It is the runtime's driver in logical time: every send, transfer, scatter, poll and
    registration becomes a pending action; timeouts (``Tick``) fire only when nothing else can
    happen (``fire_timers``).
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
        self.integrity = IntegrityModel(cfg.ring_bytes)
        self.in_flight: dict[tuple[str, int], ev.StartTransfer] = {}
        self.timers: list[tuple[float, str]] = []
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
        action = self.pending.pop(index)
        self.now += self.step_s
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
        return action

    def run(self, max_steps: int = 1_000_000, pick=None) -> int:
        """Take actions (first choice, or ``pick(choices)``) until none is left."""
        steps = 0
        while steps < max_steps:
            cs = self.choices()
            if not cs:
                if not self.fire_timers():
                    break
                continue
            self.step(cs[0] if pick is None else pick(cs))
            steps += 1
        return steps

    def fire_timers(self) -> bool:
        """Advance time to the earliest armed timeout and tick that rank; False if none."""
        if not self.timers:
            return False
        self.timers.sort()
        at, node = self.timers.pop(0)
        self.now = max(self.now, at)
        self._feed(node, ev.Tick())
        return True

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
        if type(event) is ev.Tick:
            self.timers.append((at, node))
        elif type(event) is ev.WorkerPoll:
            self._push("poll", node, event, token=token)
        else:
            self._push("register", node, event)

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
