"""Decode rank: staging ring, STAGING_REQ allocation, CHUNK_READY fan-in, scatter, completion.

Mirrors sglang 0.5.23 ``DecodeStagingHandler`` and ``handle_staging_req``. Feed inputs with
``handle(event, now)``; it returns effects for the driver. Each timeout comes out as a
``SetTimer`` effect; the driver answers it with a ``Tick`` input at that time.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
from twin.core.layout import num_tp_writers
from twin.core.snapshot import AllocationView, ChunkAllocView, DecodeRoomView, DecodeSnapshot
from twin.core.states import DecodeRoomState, DecodeTrigger, decode_next

_S, _T = DecodeRoomState, DecodeTrigger


@dataclass(slots=True)
class ChunkAlloc:
    """``chunk_staging_infos[chunk_idx]``: a live, unscattered allocation (or oversized)."""

    alloc_id: int
    offset: int
    round: int
    end: int
    chunk_pages: int


@dataclass(slots=True)
class DecodeRoom:
    room: int
    prefill_ranks: tuple[str, ...]
    prefill_attn_tp: int
    decode_prefix_len: int
    total_pages: int
    registered: bool
    registered_at: float
    state: DecodeRoomState = DecodeRoomState.WAITING
    fail_reason: str = ""
    success_at: float = 0.0
    success_ranks: set[str] = field(default_factory=set)
    chunks: dict[int, ChunkAlloc] = field(default_factory=dict)
    oversized: set[int] = field(default_factory=set)
    arrivals: dict[int, list[tuple[int, int, str]]] = field(default_factory=dict)
    scattering: dict[int, int] = field(default_factory=dict)  # alloc_id -> chunk_idx

    @property
    def expected_responses(self) -> int:
        return len(self.prefill_ranks)


class DecodeRank:
    """One decode attention-TP rank with its staging ring (``session`` is its agent name)."""

    def __init__(self, cfg: TwinConfig, session: str, attn_tp_rank: int,
                 defects: Defects | None = None) -> None:
        self.cfg = cfg
        self.session = session
        self.rank = attn_tp_rank
        self.defects = defects or Defects()
        self._allocator = StagingAllocator(cfg.ring_bytes, self.defects)
        self._rooms: dict[int, DecodeRoom] = {}
        self._subscribers: dict[tuple[str, ...], str] = {}
        self._crashed: str | None = None
        self.now = 0.0
        self._dirty: set[int] = set()
        self._deadlines: list[tuple[float, int]] = []

    @property
    def watermark(self) -> tuple[int, int]:
        """The ring's current watermark ``(round, tail)``."""
        return self._allocator.get_watermark()

    def snapshot(self) -> DecodeSnapshot:
        """A read-only copy of this rank's ring, rooms and subscribers."""
        a = self._allocator
        rooms = {r.room: DecodeRoomView(
            room=r.room, state=r.state, registered=r.registered, prefill_ranks=r.prefill_ranks,
            success_ranks=frozenset(r.success_ranks), fail_reason=r.fail_reason,
            chunks={i: ChunkAllocView(alloc_id=c.alloc_id, offset=c.offset, round=c.round,
                                      end=c.end, chunk_pages=c.chunk_pages)
                    for i, c in r.chunks.items()},
            arrivals={i: len(v) for i, v in r.arrivals.items()},
            scattering=dict(r.scattering)) for r in self._rooms.values()}
        return DecodeSnapshot(
            node=self.session, now=self.now, crashed=self._crashed, ring_bytes=a.total_size,
            head=a.head, round=a.round, watermark=a.get_watermark(),
            live=tuple(AllocationView(alloc_id=i, offset=o, size=n, round=r)
                       for i, o, n, r in a.live()),
            rooms=rooms, subscribers=dict(self._subscribers))

    # -- dispatch ----------------------------------------------------------------------------
    def handle(self, event: ev.Input, now: float) -> list[ev.Effect]:
        """Consume one input at time ``now``; return the effects, in order."""
        assert now >= self.now - 1e-12, (now, self.now)
        self.now = now
        if self._crashed is not None:
            return [ev.Dropped(what=type(event).__name__, room=-1, reason="rank crashed")]
        out: list[ev.Effect] = []
        handler = self._DISPATCH.get(type(event))
        if handler is None:
            raise TypeError(f"decode rank cannot handle {type(event).__name__}")
        handler(self, event, out)
        if type(event) is ev.Tick:
            while self._deadlines and self._deadlines[0][0] <= now:
                self._dirty.add(heapq.heappop(self._deadlines)[1])
        if self._dirty:
            self._advance(out)
        return out

    def _arm(self, room: DecodeRoom, start: float, out: list[ev.Effect]) -> None:
        at = start + self.cfg.waiting_timeout_s + 1e-6
        heapq.heappush(self._deadlines, (at, room.room))
        out.append(ev.SetTimer(at=at))

    def _on_message(self, e: ev.MessageArrived, out: list[ev.Effect]) -> None:
        msg = e.msg
        if isinstance(msg, wire.StagingReq):
            self._on_staging_req(msg, out)
        elif isinstance(msg, wire.ChunkReady):
            self._on_chunk_ready(msg, out)
        elif isinstance(msg, wire.TransferStatus):
            self._on_status(e.src, msg, out)
        else:
            out.append(ev.Dropped(what=type(msg).__name__, room=getattr(msg, "room", -1),
                                  reason="unexpected message kind at decode"))

    # -- registration ------------------------------------------------------------------------
    def _on_room_init(self, e: ev.DecodeRoomInit, out: list[ev.Effect]) -> None:
        if e.room in self._rooms:
            out.append(ev.Dropped(what="DecodeRoomInit", room=e.room, reason="room exists"))
            return
        late = self.defects.on(LATE_DECODE_REGISTRATION)
        room = DecodeRoom(
            room=e.room, prefill_ranks=e.prefill_ranks, prefill_attn_tp=e.prefill_attn_tp,
            decode_prefix_len=e.decode_prefix_len, total_pages=e.total_pages,
            registered=not late, registered_at=self.now,
        )
        self._rooms[e.room] = room
        self._arm(room, self.now, out)
        if not late:
            self._register(room, out)
            if self._crashed is not None:
                return
        out.append(ev.SendMetadata(
            room=e.room, prefill_ranks=e.prefill_ranks, session=self.session,
            decode_rank=self.rank, decode_prefix_len=e.decode_prefix_len,
            total_pages=e.total_pages,
            register_at=self.now + self.cfg.late_register_delay_s if late else None,
        ))

    def _on_room_register(self, e: ev.DecodeRoomRegister, out: list[ev.Effect]) -> None:
        room = self._rooms.get(e.room)
        if room is None or room.registered:
            return
        room.registered = True
        self._register(room, out)

    def _register(self, room: DecodeRoom, out: list[ev.Effect]) -> None:
        if room.decode_prefix_len % self.cfg.page_size:
            reason = (f"decode prefix length {room.decode_prefix_len} is not page-aligned "
                      f"(page_size={self.cfg.page_size})")
            if self.defects.on(RAISE_ON_UNALIGNED_PREFIX):
                self._crashed = f"room {room.room}: {reason}"
                out.append(ev.RankCrashed(reason=self._crashed))
                return
            self._fail(room, reason, out)

    # -- STAGING_REQ -------------------------------------------------------------------------
    def _on_staging_req(self, msg: wire.StagingReq, out: list[ev.Effect]) -> None:
        room = self._rooms.get(msg.room)
        if room is None or not room.registered:
            out.append(ev.Dropped(what="STAGING_REQ", room=msg.room, reason="room not registered"))
            return
        info = room.chunks.get(msg.chunk_idx)
        if info is not None:
            offset, rnd, end = info.offset, info.round, info.end
        elif msg.chunk_idx in room.oversized:
            offset, rnd, end = ALLOC_OVERSIZED, 0, -1
        else:
            offset, rnd, end = self._allocate(room, msg.chunk_idx, msg.chunk_pages, out)
        rsp = wire.StagingRsp(room=msg.room, chunk_idx=msg.chunk_idx, offset=offset, round=rnd,
                              end=end, session_id=msg.session_id)
        for dst in room.prefill_ranks:
            out.append(ev.Send(dst=dst, msg=rsp))
        self._subscribe(room.prefill_ranks, msg.session_id, out)

    def region_bytes(self, room: DecodeRoom, chunk_pages: int) -> int:
        """Bytes of one staging region holding ``chunk_pages`` pages from every writer."""
        return self.cfg.region_layout(self.rank, chunk_pages, room.prefill_attn_tp)[2]

    def _allocate(self, room: DecodeRoom, chunk_idx: int, chunk_pages: int,
                  out: list[ev.Effect]) -> tuple[int, int, int]:
        required = self.region_bytes(room, chunk_pages)
        got = self._allocator.assign(required)
        if got is None:
            room.oversized.add(chunk_idx)
            out.append(ev.Dropped(what="STAGING_REQ", room=room.room,
                                  reason=f"oversized: {required} > ring {self._allocator.total_size}"))
            return ALLOC_OVERSIZED, 0, -1
        alloc_id, offset, rnd = got
        room.chunks[chunk_idx] = ChunkAlloc(alloc_id, offset, rnd, offset + required, chunk_pages)
        out.append(ev.Allocated(room=room.room, chunk_idx=chunk_idx, alloc_id=alloc_id,
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
        msg = wire.Watermark(round=wm_round, tail=wm_tail, session_id=session_id)
        for dst in key:
            out.append(ev.Send(dst=dst, msg=msg))

    # -- CHUNK_READY and scatter -------------------------------------------------------------
    def _on_chunk_ready(self, msg: wire.ChunkReady, out: list[ev.Effect]) -> None:
        room = self._rooms.get(msg.room)
        if room is None or not room.registered:
            out.append(ev.Dropped(what="CHUNK_READY", room=msg.room, reason="room not registered"))
            return
        self._dirty.add(room.room)
        arrivals = room.arrivals.setdefault(msg.chunk_idx, [])
        arrivals.append((msg.page_start, msg.num_pages, msg.writer_id))
        if len(arrivals) >= self._num_writers(room):
            self._submit_scatter(room, msg.chunk_idx, msg.page_start, msg.num_pages, out)
            del room.arrivals[msg.chunk_idx]

    def _num_writers(self, room: DecodeRoom) -> int:
        return num_tp_writers(room.prefill_attn_tp, self.cfg.decode.attn_tp_size)

    def _submit_scatter(self, room: DecodeRoom, chunk_idx: int, page_start: int, num_pages: int,
                        out: list[ev.Effect], blind: bool = False) -> bool:
        info = room.chunks.pop(chunk_idx, None)
        if info is None:
            out.append(ev.Dropped(what="CHUNK_READY", room=room.room,
                                  reason=f"chunk {chunk_idx} has no unscattered allocation"))
            return False
        room.scattering[info.alloc_id] = chunk_idx
        _, writer_bytes, total = self.cfg.region_layout(self.rank, num_pages, room.prefill_attn_tp)
        out.append(ev.StartScatter(
            room=room.room, chunk_idx=chunk_idx, alloc_id=info.alloc_id, offset=info.offset,
            nbytes=total, page_start=page_start, num_pages=num_pages, blind=blind,
            prefill_attn_tp=room.prefill_attn_tp, writer_bytes=writer_bytes,
        ))
        return True

    def _on_scatter_done(self, e: ev.ScatterDone, out: list[ev.Effect]) -> None:
        room = self._rooms.get(e.room)
        if room is not None:
            room.scattering.pop(e.alloc_id, None)
            self._dirty.add(room.room)
        self._free(e.alloc_id, e.room, e.chunk_idx, "scattered", out)

    def _free(self, alloc_id: int, room: int, chunk_idx: int, reason: str,
              out: list[ev.Effect]) -> None:
        a = self._allocator
        before = a.get_watermark()
        a.free(alloc_id)
        out.append(ev.Freed(alloc_id=alloc_id, room=room, chunk_idx=chunk_idx, reason=reason))
        after = a.get_watermark()
        if after != before:
            lag = (a.round - after[0]) * a.total_size + a.head - after[1]
            out.append(ev.WatermarkMoved(round=after[0], tail=after[1], lag_bytes=max(0, lag)))
        for key, session_id in self._subscribers.items():
            self._send_watermark(key, session_id, out)

    # -- status, completion, timeouts --------------------------------------------------------
    def _on_status(self, src: str, msg: wire.TransferStatus, out: list[ev.Effect]) -> None:
        room = self._rooms.get(msg.room)
        if room is None:
            out.append(ev.Dropped(what="KV_STATUS", room=msg.room, reason="room cleared"))
            return
        if msg.status == wire.KVPoll.Failed:
            self._fail(room, f"prefill {src} failed: {msg.failure_reason}", out, notify=True)
            return
        if msg.status != wire.KVPoll.Success:
            return
        self._dirty.add(room.room)
        room.success_ranks.add(src)
        if len(room.success_ranks) >= room.expected_responses and room.state is _S.WAITING:
            room.state = decode_next(room.state, _T.ALL_RANKS_SUCCESS)
            room.success_at = self.now
            self._arm(room, self.now, out)
            if self.defects.on(COMPLETION_BEFORE_LAST_SCATTER) and room.chunks:
                last = max(room.chunks)
                info = room.chunks[last]
                self._submit_scatter(room, last, last * self.cfg.full_chunk_pages,
                                     info.chunk_pages, out, blind=True)

    def _advance(self, out: list[ev.Effect]) -> None:
        """``advance_scatter`` for every room: complete, time out, or wait."""
        done: list[DecodeRoom] = []
        dirty = sorted(self._dirty)
        self._dirty.clear()
        for room_id in dirty:
            room = self._rooms.get(room_id)
            if room is None:
                continue
            if room.state is _S.FAILED:
                done.append(room)
            elif room.state is _S.ALL_SUCCESS:
                pending = room.chunks and not self.defects.on(COMPLETION_BEFORE_LAST_SCATTER)
                if not room.scattering and not pending:
                    room.state = decode_next(room.state, _T.COMPLETE)
                    done.append(room)
                elif self.now - room.success_at > self.cfg.waiting_timeout_s:
                    room.state = decode_next(room.state, _T.FAIL)
                    room.fail_reason = (f"not complete {self.cfg.waiting_timeout_s:.0f}s after "
                                        f"all-ranks Success (a scatter never arrived)")
                    done.append(room)
            elif self.now - room.registered_at > self.cfg.waiting_timeout_s:
                room.state = decode_next(room.state, _T.FAIL)
                room.fail_reason = f"no transfer result within {self.cfg.waiting_timeout_s:.0f}s"
                out.append(ev.AbortNotice(room=room.room, dsts=room.prefill_ranks,
                                          reason=room.fail_reason))
                done.append(room)
        for room in done:
            out.append(ev.RoomConcluded(room=room.room, status=room.state.value,
                                        reason=room.fail_reason))
            self._unregister(room, out)

    def _fail(self, room: DecodeRoom, reason: str, out: list[ev.Effect],
              notify: bool = True) -> None:
        if room.state is _S.FAILED:
            return
        room.state = decode_next(room.state, _T.FAIL)
        room.fail_reason = reason
        self._dirty.add(room.room)
        if notify:
            out.append(ev.AbortNotice(room=room.room, dsts=room.prefill_ranks, reason=reason))

    def _on_abort(self, e: ev.RoomAborted, out: list[ev.Effect]) -> None:
        room = self._rooms.get(e.room)
        if room is not None:
            self._fail(room, e.reason, out)

    def _unregister(self, room: DecodeRoom, out: list[ev.Effect]) -> None:
        """``unregister_decode_req`` + ``release_room``: free what was never scattered."""
        del self._rooms[room.room]
        if self.defects.on(NO_RELEASE_ROOM):
            return
        # In-flight scatters are drained first; their allocations are freed as they finish.
        for chunk_idx, info in sorted(room.chunks.items()):
            self._free(info.alloc_id, room.room, chunk_idx, "released", out)
        room.chunks.clear()

    def _on_tick(self, e: ev.Tick, out: list[ev.Effect]) -> None:
        del e, out

    _DISPATCH: dict[type, Callable[[DecodeRank, Any, list[ev.Effect]], None]] = {
        ev.MessageArrived: _on_message,
        ev.DecodeRoomInit: _on_room_init,
        ev.DecodeRoomRegister: _on_room_register,
        ev.ScatterDone: _on_scatter_done,
        ev.RoomAborted: _on_abort,
        ev.Tick: _on_tick,
    }
