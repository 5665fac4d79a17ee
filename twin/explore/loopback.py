"""An in-memory cluster of core ranks whose every pending action can be taken in any order.

``Cluster`` holds prefill and decode ranks of one deployment and a list of pending actions
(message deliveries, transfer and scatter completions, worker polls, bootstrap metadata, the
scheduler's sends). ``choices()`` lists the actions that may go next: control messages keep
per-link FIFO order as ZMQ does, everything else is free. ``step(i)`` takes one. Property tests
and the wedge explorer drive it; it checks the core's invariants after every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from twin.core import events as ev
from twin.core.config import TwinConfig
from twin.core.decode import DecodeRank
from twin.core.defects import Defects
from twin.core.grid import pages_for_tokens
from twin.core.integrity import IntegrityModel
from twin.core.prefill import PrefillRank
from twin.core.sendplan import PlannedSend, plan_sends
from twin.core.topology import Topology, build_ranks


@dataclass(frozen=True, slots=True)
class Action:
    kind: str  # msg | meta | xfer | scatter | poll | send | register | abort
    node: str
    event: ev.Input
    src: str = ""
    seq: int = 0


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
    """Prefill and decode ranks of ``cfg`` wired through a pending-action list."""

    def __init__(self, cfg: TwinConfig, defects: Defects | None = None,
                 step_s: float = 1e-3) -> None:
        self.cfg = cfg
        self.defects = defects or Defects()
        self.topo = Topology(cfg)
        self.ranks: dict[str, PrefillRank | DecodeRank] = build_ranks(self.topo, self.defects)
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
                total_pages=total_pages))

    # -- choosing and taking actions ---------------------------------------------------------
    def choices(self) -> list[int]:
        """Indices of ``pending`` that may be taken next (per-link FIFO for messages)."""
        seen_links: set[tuple[str, str]] = set()
        out = []
        for i, a in enumerate(self.pending):
            if a.kind == "msg":
                link = (a.src, a.node)
                if link in seen_links:
                    continue
                seen_links.add(link)
            out.append(i)
        return out

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
        else:
            self._feed(action.node, action.event, src=action.src)
            if action.kind == "meta":
                self.bootstrap_progress(action.node, action.event.room)  # type: ignore[union-attr]
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

    # -- feeding the core and carrying out effects -------------------------------------------
    def _feed(self, node: str, event: ev.Input, src: str = "") -> None:
        rank = self.ranks[node]
        self.log.append((self.now, node, event))
        effects = rank.handle(event, self.now)
        for e in effects:
            self._effect(node, e)
        self._check(node)

    def _push(self, kind: str, node: str, event: ev.Input, src: str = "") -> None:
        self._seq += 1
        self.pending.append(Action(kind, node, event, src, self._seq))

    def _effect(self, node: str, e: ev.Effect) -> None:
        t = type(e)
        if t is ev.Send:
            self._push("msg", e.dst, ev.MessageArrived(src=node, msg=e.msg), src=node)
        elif t is ev.SendMetadata:
            target = ev.Target(session=e.session, decode_rank=e.decode_rank,
                               total_pages=e.total_pages, decode_prefix_len=e.decode_prefix_len)
            for p in e.prefill_ranks:
                self._push("meta", p, ev.RoomBootstrapped(room=e.room, targets=(target,)), src=node)
            rank = self.ranks[node]
            assert isinstance(rank, DecodeRank)
            room = rank.rooms.get(e.room)
            if room is not None and not room.registered:
                self._push("register", node, ev.DecodeRoomRegister(room=e.room))
        elif t is ev.StartTransfer:
            self.in_flight[(node, e.worker)] = e
            self._push("xfer", node, ev.TransferDone(worker=e.worker))
        elif t is ev.StartScatter:
            self._on_scatter(node, e)
            self._push("scatter", node, ev.ScatterDone(room=e.room, chunk_idx=e.chunk_idx,
                                                       alloc_id=e.alloc_id))
        elif t is ev.Deferred:
            if not e.all_blocked:
                self._push("poll", node, ev.WorkerPoll(worker=e.worker))
        elif t is ev.WakeWorkers:
            for w in e.workers:
                self._push("poll", node, ev.WorkerPoll(worker=w))
        elif t is ev.AbortNotice:
            for d in e.dsts:
                self._push("abort", d, ev.RoomAborted(room=e.room, reason=e.reason), src=node)
        elif t is ev.SetTimer:
            self.timers.append((e.at, node))
        elif t is ev.RoomConcluded:
            self._on_concluded(node, e)
        elif t is ev.Freed:
            pass
        elif t is ev.RankCrashed:
            self.crashed.append(f"{node}: {e.reason}")

    def _on_scatter(self, node: str, e: ev.StartScatter) -> None:
        rank = self.ranks[node]
        assert isinstance(rank, DecodeRank)
        _, writer_bytes, _ = self.cfg.region_layout(rank.rank, e.num_pages)
        self.integrity.on_scatter(node, e, list(writer_bytes))

    def _on_concluded(self, node: str, e: ev.RoomConcluded) -> None:
        plan = self.rooms.get(e.room)
        if plan is None:
            return
        if self.topo.nodes[node].role == "decode":
            plan.decode_status[node] = e.status
            self.integrity.on_concluded(node, e.room, e.status, plan.total_pages)

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
            wm = rank.allocator.get_watermark()
            prev = self._wm_seen.get(node, (0, 0))
            if wm < prev:
                raise InvariantViolation(f"{node}: watermark moved backwards {prev} -> {wm}")
            self._wm_seen[node] = wm
            live = sorted((r * self.cfg.ring_bytes + off, r * self.cfg.ring_bytes + off + size, a)
                          for a, off, size, r in rank.allocator.live())
            for (_, end_a, a), (start_b, _, b) in zip(live, live[1:], strict=False):
                if start_b < end_a:
                    raise InvariantViolation(f"{node}: live allocations {a} and {b} overlap")
        else:
            for session, wm in rank.watermarks.items():
                key = f"{node}>{session}"
                prev = self._wm_seen.get(key, (0, 0))
                if wm < prev:
                    raise InvariantViolation(f"{key}: watermark moved backwards {prev} -> {wm}")
                self._wm_seen[key] = wm

    # -- status ------------------------------------------------------------------------------
    def bootstrap_progress(self, node: str, room: int) -> None:
        plan = self.rooms[room]
        rank = self.ranks[node]
        assert isinstance(rank, PrefillRank)
        pg = self.topo.prefill_groups[plan.prefill_group]
        dg = self.topo.decode_groups[plan.decode_group]
        r = rank.rooms.get(room)
        want = len(self.topo.targets_of(self.topo.nodes[node], dg))
        if r is not None and len(r.targets) == want:
            plan.bootstrapped.add(node)
        if len(plan.bootstrapped) == len(pg.nodes) and plan.next_send == 0 and not any(
                a.kind == "send" and a.event.room == room for a in self.pending):  # type: ignore[union-attr]
            self._queue_next_send(plan)

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
