"""Decode rank: staging ring, STAGING_REQ allocation, CHUNK_READY fan-in, scatter, completion.

Mirrors sglang 0.5.23 ``DecodeStagingHandler``, ``handle_staging_req`` and the decode transfer
queue's ``pop_transferred``. Feed inputs with ``handle(event, now)``; it returns effects for the
driver. Each timeout comes out as a ``SetTimer`` effect; the driver answers it with a ``Tick``
input at that time.

Concluding a room. A rank's *local* poll of a room is Success once every byte landed and was
scattered here, Failed once it failed here. SGLang MIN-reduces the polls of the attention-TP
group every decode loop, so a room concludes Success only when every rank of the group is done,
and one rank's failure fails it on every rank in the same poll. The twin shares a local poll
with the room's ``group`` (``GroupPoll`` effect, ``PeerPolled`` input) and concludes on the
reduction. A failed room then goes down SGLang's failure path: it sends ``ABORT`` to its prefill
ranks and, with deferred decode KV release on (the default), keeps its staging until every
prefill rank acknowledged (``ABORT_ACK`` of the armed generation) or the release deadline passed;
held rooms are released together across the group.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from twin.core import events as ev
from twin.core import wire
from twin.core.allocator import ALLOC_OVERSIZED, StagingAllocator
from twin.core.config import TwinConfig
from twin.core.defects import (
    COMPLETION_BEFORE_LAST_SCATTER,
    LATE_DECODE_REGISTRATION,
    NO_RELEASE_ROOM,
    NO_SUBSCRIBER_SNAPSHOT,
    RAISE_ON_UNALIGNED_PREFIX,
    Defects,
)
from twin.core.fixes import (
    ANSWER_REQUESTER_ONLY,
    BOUND_STAGING_REQ_CHUNK,
    DROP_LATE_STAGING_REQ,
    LOST_CONTROL_RECOVERY,
)
from twin.core.layout import num_tp_writers, pp_stage_of
from twin.core.snapshot import AllocationView, ChunkAllocView, DecodeRoomView, DecodeSnapshot
from twin.core.states import DecodeRoomState, DecodeTrigger, decode_next

# The members the handlers compare against, as module constants: compiled, a Final
# name is a C static, where reading an enum class's attribute goes through its
# metaclass's __getattr__ hook.
_S_ALL_SUCCESS: Final = DecodeRoomState.ALL_SUCCESS
_S_DONE: Final = DecodeRoomState.DONE
_S_FAILED: Final = DecodeRoomState.FAILED
_S_SUCCESS: Final = DecodeRoomState.SUCCESS
_S_WAITING: Final = DecodeRoomState.WAITING
_T_ALL_RANKS_SUCCESS: Final = DecodeTrigger.ALL_RANKS_SUCCESS
_T_COMPLETE: Final = DecodeTrigger.COMPLETE
_T_FAIL: Final = DecodeTrigger.FAIL
_T_GROUP_SUCCESS: Final = DecodeTrigger.GROUP_SUCCESS

# The event and frame classes the handlers build or test, as module constants: compiled, a
# Final name is a C static, where ``ev.Send`` is a lookup in this module's globals and
# then in the events module's, on every use.
_Abort: Final = wire.Abort
_AbortAck: Final = wire.AbortAck
_Allocated: Final = ev.Allocated
_ChunkReady: Final = wire.ChunkReady
_Dropped: Final = ev.Dropped
_Freed: Final = ev.Freed
_GroupPoll: Final = ev.GroupPoll
_KVPoll: Final = wire.KVPoll
_MessageArrived: Final = ev.MessageArrived
_RankCrashed: Final = ev.RankCrashed
_RoomConcluded: Final = ev.RoomConcluded
_RoomHeld: Final = ev.RoomHeld
_RoomReleased: Final = ev.RoomReleased
_Send: Final = ev.Send
_SendMetadata: Final = ev.SendMetadata
_SetTimer: Final = ev.SetTimer
_StagingReq: Final = wire.StagingReq
_StagingRsp: Final = wire.StagingRsp
_StartScatter: Final = ev.StartScatter
_Tick: Final = ev.Tick
_TransferStatus: Final = wire.TransferStatus
_Watermark: Final = wire.Watermark
_WatermarkMoved: Final = ev.WatermarkMoved

POLL_SUCCESS: Final = "Success"
POLL_FAILED: Final = "Failed"
POLL_RELEASE_READY: Final = "ReleaseReady"
_FAILED_POLLS: Final = (POLL_FAILED, POLL_RELEASE_READY)


@dataclass(slots=True)
class ChunkAlloc:
    """``chunk_staging_infos[chunk_idx]``: a live, unscattered allocation (or oversized).

    The per-chunk and per-room records here define ``__init__`` themselves (the dataclass keeps
    it): compiled, that is a native constructor, where the ``dataclasses`` module's own would
    run as Python."""

    alloc_id: int
    offset: int
    round: int
    end: int
    chunk_pages: int
    late: bool  # allocated by a STAGING_REQ that arrived after the chunk was scattered

    def __init__(self, alloc_id: int, offset: int, round: int, end: int, chunk_pages: int,
                 late: bool = False) -> None:
        self.alloc_id = alloc_id
        self.offset = offset
        self.round = round
        self.end = end
        self.chunk_pages = chunk_pages
        self.late = late


@dataclass(slots=True)
class DecodeRoom:
    room: int
    prefill_ranks: tuple[str, ...]
    prefill_attn_tp: int
    decode_prefix_len: int
    total_pages: int
    registered: bool
    # The waiting clock's start, SGLang's ``init_time``: set at the end of ``send_metadata``
    # (cc ~2886), which in the twin is the same input as the registration (DecodeRoomInit
    # is pop_preallocated: register, then send the metadata). It is checked only while the
    # room waits for transfer status (KVPoll.WaitingForInput, cc ~2603-2611).
    wait_start: float
    state: DecodeRoomState
    fail_reason: str
    success_at: float
    success_ranks: set[str]
    chunks: dict[int, ChunkAlloc]
    oversized: set[int]
    arrivals: dict[int, list[tuple[int, int, str]]]
    scattering: dict[int, int]  # alloc_id -> chunk_idx
    scattered: set[int]  # chunk indices whose scatter started
    group: tuple[str, ...]  # the other decode ranks whose polls are reduced with ours
    peer_polls: dict[str, str]
    shared: str  # the local poll last shared with the group
    concluded: bool
    abort_notified: bool
    generation: int | None
    acks: set[int]
    held: bool
    release_at: float
    # The length SGLang's ``receiver.chunk_staging_infos`` list has grown to: every
    # STAGING_REQ that allocates pads it to ``chunk_idx + 1`` entries (sh ~847-848, ~859-860),
    # so one malformed chunk_idx grows it by that much (issue #39764).
    info_len: int
    # ``_chunk_events``: every submitted scatter whose allocation the poll has not freed yet,
    # in submission order (alloc_id -> chunk_idx); a held room's stay here until released.
    events: dict[int, int]

    def __init__(self, *, room: int, prefill_ranks: tuple[str, ...], prefill_attn_tp: int,
                 decode_prefix_len: int, total_pages: int, registered: bool,
                 wait_start: float, group: tuple[str, ...] = (),
                 peer_polls: dict[str, str] | None = None) -> None:
        self.room = room
        self.prefill_ranks = prefill_ranks
        self.prefill_attn_tp = prefill_attn_tp
        self.decode_prefix_len = decode_prefix_len
        self.total_pages = total_pages
        self.registered = registered
        self.wait_start = wait_start
        self.state = _S_WAITING
        self.fail_reason = ""
        self.success_at = 0.0
        self.success_ranks = set()
        self.chunks = {}
        self.info_len = 0
        self.oversized = set()
        self.arrivals = {}
        self.scattering = {}
        self.scattered = set()
        self.group = group
        self.peer_polls = {} if peer_polls is None else peer_polls
        self.shared = ""
        self.concluded = False
        self.abort_notified = False
        self.generation = None
        self.acks = set()
        self.held = False
        self.release_at = 0.0
        self.events = {}

    @property
    def expected_responses(self) -> int:
        return len(self.prefill_ranks)


class DecodeRank:
    """One decode attention-TP rank with its staging ring (``session`` is its agent name)."""

    def __init__(self, cfg: TwinConfig, session: str, attn_tp_rank: int,
                 defects: Defects | None = None, port: int = -1) -> None:
        self.cfg = cfg
        self._waiting_timeout_s = cfg.waiting_timeout_s  # read on every poll of a room
        self.session = session
        self.rank = attn_tp_rank
        self.port = port
        self.defects = defects or Defects()
        self.fixes = cfg.fix_set
        self._allocator = StagingAllocator(cfg.ring_bytes, self.defects)
        self._layouts: dict[tuple[int, int], tuple[int, tuple[int, ...], int]] = {}
        self._rooms: dict[int, DecodeRoom] = {}
        self._subscribers: dict[tuple[str, ...], str] = {}
        self._crashed: str | None = None
        # ``decode_listener_thread`` ended (an exception it does not catch): frames are no
        # longer handled, while the scheduler (timers, registration, polls) goes on.
        self._listener_dead: str | None = None
        self.now = 0.0
        self._dirty: set[int] = set()
        self._deadlines: list[tuple[float, int]] = []
        self._generation = 0
        self._early_polls: dict[int, dict[str, str]] = {}
        # Read on every chunk or poll (the config, defect and fix sets are frozen).
        self._blind_last = self.defects.on(COMPLETION_BEFORE_LAST_SCATTER)
        self._decode_tp = cfg.decode.attn_tp_size
        self._bound_chunk = self.fixes.on(BOUND_STAGING_REQ_CHUNK)
        # ``answer-requester-only`` refines lost-control recovery's answers (alone: no change)
        self._requester_only = (self.fixes.on(ANSWER_REQUESTER_ONLY)
                                and self.fixes.on(LOST_CONTROL_RECOVERY))
        # Memory accounting of structures keyed by wire fields: the entries of every live
        # room's ``chunk_staging_infos`` (``DecodeRoom.info_len``), now and at their peak.
        self.chunk_info_entries = 0
        self.chunk_info_peak = 0
        # Every prefill PP stage writes its own layers of each chunk (Mooncake, PP > 1):
        # ``num_writers_for`` = TP writers x (prefill PP // decode PP).
        self._pp_writers = max(1, cfg.prefill.pp_size // max(1, cfg.decode.pp_size))

    @property
    def watermark(self) -> tuple[int, int]:
        """The ring's current watermark ``(round, tail)``."""
        return self._allocator.get_watermark()

    def live_allocations(self) -> tuple[AllocationView, ...]:
        """The ring's live allocations, oldest first (cheaper than a whole snapshot)."""
        return tuple(AllocationView(alloc_id=i, offset=o, size=n, round=r)
                     for i, o, n, r in self._allocator.live())

    def snapshot(self) -> DecodeSnapshot:
        """A read-only copy of this rank's ring, rooms and subscribers."""
        a = self._allocator
        rooms = {r.room: DecodeRoomView(
            room=r.room, state=r.state, registered=r.registered, prefill_ranks=r.prefill_ranks,
            success_ranks=frozenset(r.success_ranks), fail_reason=r.fail_reason,
            chunks={i: ChunkAllocView(alloc_id=c.alloc_id, offset=c.offset, round=c.round,
                                      end=c.end, chunk_pages=c.chunk_pages, late=c.late)
                    for i, c in r.chunks.items()},
            arrivals={i: len(v) for i, v in r.arrivals.items()},
            scattering=dict(r.scattering), group=r.group, peer_polls=dict(r.peer_polls),
            held=r.held, acks=frozenset(r.acks), release_at=r.release_at,
            held_scattered=tuple(a for a in r.events if a not in r.scattering))
            for r in self._rooms.values()}
        return DecodeSnapshot(
            node=self.session, now=self.now, crashed=self._crashed, ring_bytes=a.total_size,
            head=a.head, round=a.round, watermark=a.get_watermark(),
            live=tuple(AllocationView(alloc_id=i, offset=o, size=n, round=r)
                       for i, o, n, r in a.live()),
            rooms=rooms, subscribers=dict(self._subscribers), listener_dead=self._listener_dead)

    # -- dispatch ----------------------------------------------------------------------------
    def handle(self, event: ev.Input, now: float) -> list[ev.Effect]:
        """Consume one input at time ``now``; return the effects, in order."""
        assert now >= self.now - 1e-12, (now, self.now)
        self.now = now
        if self._crashed is not None:
            return [_Dropped(what=type(event).__name__, room=-1, reason="rank crashed")]
        if self._listener_dead is not None and type(event) is _MessageArrived:
            msg = event.msg
            return [_Dropped(what=type(msg).__name__, room=getattr(msg, "room", -1),
                             reason="decode listener thread ended")]
        out: list[ev.Effect] = []
        handler = _DECODE_HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"decode rank cannot handle {type(event).__name__}")
        handler(self, event, out)
        if type(event) is _Tick:
            while self._deadlines and self._deadlines[0][0] <= now:
                self._dirty.add(heapq.heappop(self._deadlines)[1])
        if self._dirty:
            self._advance(out)
        return out

    def _arm(self, room: DecodeRoom, start: float, out: list[ev.Effect],
             after_s: float | None = None) -> None:
        at = start + (self.cfg.waiting_timeout_s if after_s is None else after_s) + 1e-6
        heapq.heappush(self._deadlines, (at, room.room))
        out.append(_SetTimer(at=at))

    def _on_message(self, e: ev.MessageArrived, out: list[ev.Effect]) -> None:
        msg = e.msg
        if isinstance(msg, _StagingReq):
            self._on_staging_req(msg, out, e.src)
        elif isinstance(msg, _ChunkReady):
            self._on_chunk_ready(msg, out)
        elif isinstance(msg, _TransferStatus):
            self._on_status(e.src, msg, out)
        elif isinstance(msg, _AbortAck):
            self._on_abort_ack(msg, out)
        else:
            out.append(_Dropped(what=type(msg).__name__, room=getattr(msg, "room", -1),
                                reason="unexpected message kind at decode"))

    # -- registration ------------------------------------------------------------------------
    def _on_room_init(self, e: ev.DecodeRoomInit, out: list[ev.Effect]) -> None:
        if e.room in self._rooms:
            out.append(_Dropped(what="DecodeRoomInit", room=e.room, reason="room exists"))
            return
        late = self.defects.on(LATE_DECODE_REGISTRATION)
        room = DecodeRoom(
            room=e.room, prefill_ranks=e.prefill_ranks, prefill_attn_tp=e.prefill_attn_tp,
            decode_prefix_len=e.decode_prefix_len, total_pages=e.total_pages,
            registered=not late, wait_start=self.now,
            group=tuple(g for g in e.group if g != self.session),
            peer_polls=self._early_polls.pop(e.room, {}),
        )
        self._rooms[e.room] = room
        if room.peer_polls:
            self._dirty.add(room.room)
        self._arm(room, self.now, out)
        if not late:
            self._register(room, out)
            if self._crashed is not None:
                return
        out.append(_SendMetadata(
            room=e.room, prefill_ranks=e.prefill_ranks, session=self.session,
            decode_rank=self.rank, decode_prefix_len=e.decode_prefix_len,
            total_pages=e.total_pages,
            register_at=self.now + self.cfg.late_register_delay_s if late else None,
            dst_port=self.port,
        ))

    def _on_room_register(self, e: ev.DecodeRoomRegister, out: list[ev.Effect]) -> None:
        room = self._rooms.get(e.room)
        if room is None or room.registered:
            return
        room.registered = True
        self._register(room, out)

    def _register(self, room: DecodeRoom, out: list[ev.Effect]) -> None:
        # ``register_decode_req`` runs only for a receiver that ``require_staging`` (prefill's
        # attention TP differs, cc ~2557-2561); its unaligned-prefix check with it
        stages = self.cfg.stage_equal_tp or room.prefill_attn_tp != self._decode_tp
        if stages and room.decode_prefix_len % self.cfg.page_size:
            reason = (f"decode prefix length {room.decode_prefix_len} is not page-aligned "
                      f"(page_size={self.cfg.page_size})")
            if self.defects.on(RAISE_ON_UNALIGNED_PREFIX):
                self._crashed = f"room {room.room}: {reason}"
                out.append(_RankCrashed(reason=self._crashed))
                return
            self._fail(room, reason, out)

    # -- STAGING_REQ -------------------------------------------------------------------------
    def _on_staging_req(self, msg: wire.StagingReq, out: list[ev.Effect], src: str) -> None:
        room_id, chunk_idx = msg.room, msg.chunk_idx  # read once each
        room = self._rooms.get(room_id)
        if room is None or not room.registered:
            out.append(_Dropped(what="STAGING_REQ", room=room_id, reason="room not registered"))
            return
        if self._bound_chunk and not (0 <= chunk_idx < room.total_pages
                                      and msg.chunk_pages > 0):
            # PR #39792: a negative chunk_idx, a non-positive page count or an index at or
            # past the room's recorded page count is rejected before anything is allocated.
            out.append(_Dropped(what="STAGING_REQ", room=room_id,
                                reason=f"chunk_idx {chunk_idx} / chunk_pages "
                                f"{msg.chunk_pages} out of range (room of "
                                f"{room.total_pages} pages)"))
            return
        key = chunk_idx
        if key < 0:
            # 0.5.23 indexes its chunk_staging_infos list with the wire's chunk_idx: a negative
            # one is a Python index from the end (sh ~833-863).
            key = room.info_len + chunk_idx
            if key < 0:
                self._index_error(room, msg, out)
                return
        info = room.chunks.get(key)
        repeated = info is not None
        if info is not None:
            offset, rnd, end = info.offset, info.round, info.end
        elif key in room.oversized:
            offset, rnd, end = ALLOC_OVERSIZED, 0, -1
        elif key in room.scattered and self.fixes.on(DROP_LATE_STAGING_REQ):
            out.append(_Dropped(what="STAGING_REQ", room=room_id,
                                reason=f"chunk {key} was already scattered"))
            return
        else:
            # A STAGING_REQ that arrives after its chunk was scattered (it travels on its own
            # socket, so another writer's CHUNK_READY can overtake it) gets a fresh allocation,
            # as in SGLang: nothing will ever scatter it, so it pins the watermark until the
            # waiting timeout fails the room.
            offset, rnd, end = self._allocate(room, key, msg.chunk_pages, out,
                                              late=key in room.scattered)
        rsp = _StagingRsp(room=room_id, chunk_idx=chunk_idx, offset=offset, round=rnd,
                          end=end, session_id=msg.session_id)
        pp_rank = msg.pp_rank
        # ``answer-requester-only``: a repeated request is answered to its sender alone (of
        # the ranks SGLang would answer); a first one to every rank, as SGLang does.
        src_only = repeated and self._requester_only
        for dst in room.prefill_ranks:
            # A request naming its PP rank (Mooncake) is answered only to that stage's ranks
            # (staging_handler.py ~895-897); one naming none, to every prefill rank.
            if pp_rank is not None and pp_stage_of(dst) != pp_rank:
                continue
            if src_only and dst != src:
                continue
            out.append(_Send(dst=dst, msg=rsp))
        self._subscribe(room.prefill_ranks, msg.session_id, out)
        if repeated and self.fixes.on(LOST_CONTROL_RECOVERY):
            # A repeated request may mean a lost WATERMARK too: re-broadcast the current one
            # (with ``answer-requester-only``, re-send it to the requester only).
            if not src_only:
                self._send_watermark(tuple(sorted(room.prefill_ranks)), msg.session_id, out)
            elif src in room.prefill_ranks:
                self._send_watermark((src,), msg.session_id, out)

    def _index_error(self, room: DecodeRoom, msg: wire.StagingReq,
                     out: list[ev.Effect]) -> None:
        """A negative chunk_idx past the start of the room's chunk_staging_infos list: SGLang
        allocates ring space, then ``infos[chunk_idx] = ...`` raises IndexError. The allocation
        is recorded nowhere, so nothing ever frees it (it pins the watermark), and the exception
        ends ``decode_listener_thread`` (nx ~1017-1040 catches nothing): from then on this rank
        handles no frame, while its scheduler goes on."""
        required = self.region_bytes(room, msg.chunk_pages)
        got = self._allocator.assign(required)
        if got is not None:
            alloc_id, offset, rnd = got
            out.append(_Allocated(room=room.room, chunk_idx=msg.chunk_idx,
                                             alloc_id=alloc_id, offset=offset, round=rnd,
                                             size=required))
        self._listener_dead = (f"STAGING_REQ room {msg.room} chunk_idx {msg.chunk_idx}: "
                               f"IndexError on a chunk list of {room.info_len} entries ended "
                               f"decode_listener_thread")
        out.append(_Dropped(what="STAGING_REQ", room=msg.room, reason=self._listener_dead))

    def region_bytes(self, room: DecodeRoom, chunk_pages: int) -> int:
        """Bytes of one staging region holding ``chunk_pages`` pages from every writer."""
        return self._layout(chunk_pages, room.prefill_attn_tp)[2]

    def _layout(self, num_pages: int, prefill_attn_tp: int) -> tuple[int, tuple[int, ...], int]:
        """``cfg.region_layout`` of this rank, memoised (the config is frozen)."""
        key = (num_pages, prefill_attn_tp)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = self.cfg.region_layout(self.rank, num_pages,
                                                                 prefill_attn_tp)
        return layout

    def _allocate(self, room: DecodeRoom, chunk_idx: int, chunk_pages: int,
                  out: list[ev.Effect], late: bool = False) -> tuple[int, int, int]:
        if chunk_idx >= room.info_len:  # ``while len(infos) <= chunk_idx: infos.append(...)``
            self.chunk_info_entries += chunk_idx + 1 - room.info_len
            room.info_len = chunk_idx + 1
            if self.chunk_info_entries > self.chunk_info_peak:
                self.chunk_info_peak = self.chunk_info_entries
        required = self.region_bytes(room, chunk_pages)
        got = self._allocator.assign(required)
        if got is None:
            room.oversized.add(chunk_idx)
            out.append(_Dropped(what="STAGING_REQ", room=room.room,
                                reason=f"oversized: {required} > ring {self._allocator.total_size}"))
            return ALLOC_OVERSIZED, 0, -1
        alloc_id, offset, rnd = got
        room.chunks[chunk_idx] = ChunkAlloc(alloc_id, offset, rnd, offset + required, chunk_pages,
                                            late)
        out.append(_Allocated(room=room.room, chunk_idx=chunk_idx, alloc_id=alloc_id,
                              offset=offset, round=rnd, size=required))
        return offset, rnd, offset + required

    def _subscribe(self, prefill_ranks: tuple[str, ...], session_id: str,
                   out: list[ev.Effect]) -> None:
        key = tuple(sorted(prefill_ranks))
        if key in self._subscribers:
            return
        self._subscribers[key] = session_id
        if not self.defects.on(NO_SUBSCRIBER_SNAPSHOT):
            self._send_watermark(key, session_id, out)

    def _send_watermark(self, key: tuple[str, ...], session_id: str, out: list[ev.Effect]) -> None:
        wm_round, wm_tail = self._allocator.get_watermark()
        msg = _Watermark(round=wm_round, tail=wm_tail, session_id=session_id)
        for dst in key:
            out.append(_Send(dst=dst, msg=msg))

    # -- CHUNK_READY and scatter -------------------------------------------------------------
    def _on_chunk_ready(self, msg: wire.ChunkReady, out: list[ev.Effect]) -> None:
        room = self._rooms.get(msg.room)
        if room is None or not room.registered:
            out.append(_Dropped(what="CHUNK_READY", room=msg.room, reason="room not registered"))
            return
        self._dirty.add(room.room)
        arrivals = room.arrivals.setdefault(msg.chunk_idx, [])
        arrivals.append((msg.page_start, msg.num_pages, msg.writer_id))
        if len(arrivals) >= num_tp_writers(room.prefill_attn_tp, self._decode_tp) * \
                self._pp_writers:
            self._submit_scatter(room, msg.chunk_idx, msg.page_start, msg.num_pages, out)
            del room.arrivals[msg.chunk_idx]

    def _submit_scatter(self, room: DecodeRoom, chunk_idx: int, page_start: int, num_pages: int,
                        out: list[ev.Effect], blind: bool = False) -> bool:
        info = room.chunks.pop(chunk_idx, None)
        if info is None:
            out.append(_Dropped(what="CHUNK_READY", room=room.room,
                                reason=f"chunk {chunk_idx} has no unscattered allocation"))
            return False
        room.scattering[info.alloc_id] = chunk_idx
        room.scattered.add(chunk_idx)
        room.events[info.alloc_id] = chunk_idx
        _, writer_bytes, total = self._layout(num_pages, room.prefill_attn_tp)
        out.append(_StartScatter(
            room=room.room, chunk_idx=chunk_idx, alloc_id=info.alloc_id, offset=info.offset,
            nbytes=total, page_start=page_start, num_pages=num_pages, blind=blind,
            prefill_attn_tp=room.prefill_attn_tp, writer_bytes=writer_bytes,
        ))
        return True

    def _on_scatter_done(self, e: ev.ScatterDone, out: list[ev.Effect]) -> None:
        room = self._rooms.get(e.room)
        if room is None:
            if e.alloc_id in self._allocator.allocations:  # no_release_room: freed here
                self._free(e.alloc_id, e.room, e.chunk_idx, "scattered", out)
            return  # release_room drained the stream and freed it with the room
        room.scattering.pop(e.alloc_id, None)
        self._dirty.add(room.room)
        if room.held:
            # A held room left the transfer queue: its scatter events are not polled any
            # more, and release_room frees their allocations when the room is released.
            return
        room.events.pop(e.alloc_id, None)
        self._free(e.alloc_id, e.room, e.chunk_idx, "scattered", out)

    def _free(self, alloc_id: int, room: int, chunk_idx: int, reason: str,
              out: list[ev.Effect]) -> None:
        a = self._allocator
        before = a.get_watermark()
        a.free(alloc_id)
        out.append(_Freed(alloc_id=alloc_id, room=room, chunk_idx=chunk_idx, reason=reason))
        after = a.get_watermark()
        if after != before:
            lag = (a.round - after[0]) * a.total_size + a.head - after[1]
            out.append(_WatermarkMoved(round=after[0], tail=after[1], lag_bytes=max(0, lag)))
        for key, session_id in self._subscribers.items():
            self._send_watermark(key, session_id, out)

    # -- status, completion, timeouts --------------------------------------------------------
    def _on_status(self, src: str, msg: wire.TransferStatus, out: list[ev.Effect]) -> None:
        room = self._rooms.get(msg.room)
        if room is None:
            out.append(_Dropped(what="KV_STATUS", room=msg.room, reason="room cleared"))
            return
        if msg.status == _KVPoll.Failed:
            if room.state in (_S_ALL_SUCCESS, _S_DONE):
                # The receiver concluded Success when every rank reported it
                # (CommonKVReceiver._poll caches it): a later Failed is not seen, and the room
                # waits for its chunks until the completion timeout.
                out.append(_Dropped(what="KV_STATUS", room=msg.room,
                                    reason="Failed after all-ranks Success"))
                return
            self._fail(room, f"prefill {src} failed: {msg.failure_reason}", out)
            return
        if msg.status != _KVPoll.Success or room.state is _S_FAILED:
            return
        self._dirty.add(room.room)
        room.success_ranks.add(src)
        if len(room.success_ranks) >= room.expected_responses and room.state is _S_WAITING:
            room.state = decode_next(room.state, _T_ALL_RANKS_SUCCESS)
            room.success_at = self.now
            self._arm(room, self.now, out)
            if self._blind_last and room.chunks:
                last = max(room.chunks)
                info = room.chunks[last]
                self._submit_scatter(room, last, last * self.cfg.full_chunk_pages,
                                     info.chunk_pages, out, blind=True)

    def _advance(self, out: list[ev.Effect]) -> None:
        """One decode poll of every room that changed: ``advance_scatter`` and the timeouts
        (the local poll), then the group's reduction, which concludes, holds or releases."""
        dirty = sorted(self._dirty)
        self._dirty.clear()
        rooms = self._rooms
        for room_id in dirty:
            room = rooms.get(room_id)
            if room is None:
                continue
            self._local_poll(room, out)
            self._share(room, out)
            self._reduce(room, out)
            self._share(room, out)

    def _local_poll(self, room: DecodeRoom, out: list[ev.Effect]) -> None:
        timeout = self._waiting_timeout_s
        if room.state is _S_ALL_SUCCESS:
            pending = room.chunks and not self._blind_last
            if not room.scattering and not pending:
                room.state = decode_next(room.state, _T_COMPLETE)
            elif self.now - room.success_at > timeout:
                # The staging completion timeout; SGLang reports it as a Failed poll, and the
                # failure path below sends ABORT (with deferred release on).
                self._fail(room, f"not complete {timeout:.0f}s after all-ranks Success (a "
                           f"scatter never arrived)", out)
        elif room.state is _S_WAITING and self.now - room.wait_start >= timeout:
            # ``_check_waiting_timeout`` (cc ~2888-2893): fails once elapsed >= the timeout
            self._fail(room, f"no transfer result within {timeout:.0f}s", out, initiated=True)

    def _poll_value(self, room: DecodeRoom) -> str:
        if room.state is _S_FAILED:
            return POLL_RELEASE_READY if room.held and self._release_ready(room) else POLL_FAILED
        return POLL_SUCCESS if room.state in (_S_DONE, _S_SUCCESS) else ""

    def _share(self, room: DecodeRoom, out: list[ev.Effect]) -> None:
        if not room.group:  # a rank that concludes alone shares nothing
            return
        poll = self._poll_value(room)
        if poll and poll != room.shared and room.room in self._rooms:
            room.shared = poll
            out.append(_GroupPoll(room=room.room, poll=poll, peers=room.group))

    def _reduce(self, room: DecodeRoom, out: list[ev.Effect]) -> None:
        """The MIN of the group's polls: Failed anywhere fails the room here; Success
        everywhere concludes it; a held room is released once every rank may release it."""
        peer_polls = room.peer_polls
        peers = [peer_polls.get(p, "") for p in room.group]
        if room.state is not _S_FAILED:
            for p in room.group:  # the first peer whose poll failed
                if peer_polls.get(p) in _FAILED_POLLS:
                    self._fail(room, f"decode rank {p} of the group failed the room", out)
                    break
        if room.state is _S_DONE and all(p == POLL_SUCCESS for p in peers):
            room.state = decode_next(room.state, _T_GROUP_SUCCESS)
            room.concluded = True
            out.append(_RoomConcluded(room=room.room, status=room.state.value))
            self._unregister(room, out)
            return
        if room.state is not _S_FAILED:
            return
        if not room.concluded:
            room.concluded = True
            out.append(_RoomConcluded(room=room.room, status=room.state.value,
                                      reason=room.fail_reason))
            if not self.cfg.deferred_decode_kv_release:
                self._unregister(room, out)
                return
            self._hold(room, out)
        if self._release_ready(room) and all(p == POLL_RELEASE_READY for p in peers):
            out.append(_RoomReleased(room=room.room,
                                     drained=len(room.acks) >= room.expected_responses))
            self._unregister(room, out)

    def _hold(self, room: DecodeRoom, out: list[ev.Effect]) -> None:
        """``ensure_abort_notified(force_arm=True)`` then ``_defer_release``."""
        self._notify_abort(room, out)
        room.held = True
        room.release_at = self.now + self.cfg.deferred_decode_kv_release_timeout_s
        out.append(_RoomHeld(room=room.room, generation=room.generation or 0,
                             required_acks=room.expected_responses, release_at=room.release_at))
        self._arm(room, self.now, out, self.cfg.deferred_decode_kv_release_timeout_s)

    def _release_ready(self, room: DecodeRoom) -> bool:
        """``is_abort_release_safe`` (every prefill rank acknowledged) or the deadline passed."""
        return len(room.acks) >= room.expected_responses or self.now >= room.release_at

    def _notify_abort(self, room: DecodeRoom, out: list[ev.Effect]) -> None:
        """Send ``ABORT`` to the room's prefill ranks once, arming a new generation for the
        acknowledgements when deferred release is on."""
        if room.abort_notified:
            return
        room.abort_notified = True
        if self.cfg.deferred_decode_kv_release:
            self._generation += 1
            room.generation = self._generation
        msg = _Abort(room=room.room, decode_ip=self.session, decode_port=self.port,
                     generation=room.generation)
        for dst in room.prefill_ranks:
            out.append(_Send(dst=dst, msg=msg))

    def _on_abort_ack(self, msg: wire.AbortAck, out: list[ev.Effect]) -> None:
        room = self._rooms.get(msg.room)
        if room is None or room.generation is None or msg.generation != room.generation:
            out.append(_Dropped(what="ABORT_ACK", room=msg.room,
                                reason="no armed generation for it"))
            return
        room.acks.add(msg.prefill_rank)
        self._dirty.add(room.room)

    def _on_peer_polled(self, e: ev.PeerPolled, out: list[ev.Effect]) -> None:
        room = self._rooms.get(e.room)
        if room is None:
            self._early_polls.setdefault(e.room, {})[e.peer] = e.poll
            return
        room.peer_polls[e.peer] = e.poll
        self._dirty.add(room.room)

    def _fail(self, room: DecodeRoom, reason: str, out: list[ev.Effect],
              initiated: bool = False) -> None:
        """Fail ``room`` here. ``initiated``: decode itself gave up on it (an abort, the
        waiting timeout), which sends ``ABORT`` at once whatever the release setting."""
        if room.state is _S_FAILED:
            return
        room.state = decode_next(room.state, _T_FAIL)
        room.fail_reason = reason
        self._dirty.add(room.room)
        if initiated:
            self._notify_abort(room, out)

    def _on_abort(self, e: ev.RoomAborted, out: list[ev.Effect]) -> None:
        """``CommonKVReceiver.abort``: fail the room, and notify its prefill ranks even when it
        had already failed for another reason (``ensure_abort_notified``)."""
        room = self._rooms.get(e.room)
        if room is not None:
            self._fail(room, e.reason, out, initiated=True)
            self._notify_abort(room, out)

    def _unregister(self, room: DecodeRoom, out: list[ev.Effect]) -> None:
        """``unregister_decode_req`` + ``release_room``: free what was never scattered."""
        del self._rooms[room.room]
        self.chunk_info_entries -= room.info_len
        if not self.defects.on(NO_RELEASE_ROOM):
            for chunk_idx, info in sorted(room.chunks.items()):
                self._free(info.alloc_id, room.room, chunk_idx, "released", out)
            room.chunks.clear()
        # The scatter stream is drained first (SGLang synchronizes it), so every submitted
        # scatter has finished: free their allocations too, in submission order.
        for alloc_id, chunk_idx in room.events.items():
            self._free(alloc_id, room.room, chunk_idx, "released", out)
        room.events.clear()

    def _on_tick(self, e: ev.Tick, out: list[ev.Effect]) -> None:
        del e, out


# Input type -> handler (a module table rather than a class attribute, so the module also
# compiles: a compiled class body cannot refer to its own methods).
_DECODE_HANDLERS: dict[type, Callable[[DecodeRank, Any, list[ev.Effect]], None]] = {
    ev.MessageArrived: DecodeRank._on_message,
    ev.DecodeRoomInit: DecodeRank._on_room_init,
    ev.DecodeRoomRegister: DecodeRank._on_room_register,
    ev.ScatterDone: DecodeRank._on_scatter_done,
    ev.RoomAborted: DecodeRank._on_abort,
    ev.PeerPolled: DecodeRank._on_peer_polled,
    ev.Tick: DecodeRank._on_tick,
}
