"""Prefill rank: grid-aligned sends, STAGING_REQ prefetch, transfer-worker queues, watermarks.

Mirrors sglang 0.5.23 ``prefill.py`` (``send_kv_chunk``), ``prefetch_staging_reqs`` and the NIXL
``transfer_worker``. Each worker is a queue of chunks and at most one chunk in flight. A chunk
that is not ready (allocation pending or watermark behind) is re-enqueued at the tail
(backpressure deferral); a worker whose whole queue is blocked waits for a ``WakeWorkers``.

Aborts. A decode ``ABORT`` fails a room that has not succeeded yet (one at Success is left
alone); a prefill-side abort (``RoomAborted``) fails it whatever its state. With deferred decode
KV release an ``ABORT`` carrying a generation registers an acknowledgement target: this rank
answers ``ABORT_ACK`` once none of the room's chunks is dequeued or in flight, unless a write
could not be proven to have stopped (a *poisoned* room never acknowledges).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Final

from twin.core import events as ev
from twin.core import wire
from twin.core.allocator import ALLOC_OVERSIZED, is_watermark_ready
from twin.core.config import TwinConfig, polls_coalescible, pp_layer_range
from twin.core.defects import (
    COMPLETION_BEFORE_LAST_SCATTER,
    NO_GRID_ALIGNMENT,
    SILENT_SLICE_FALLBACK,
    SWALLOWED_CHUNK_READY_ERROR,
    TEARDOWN_DROPS_DEFERRED,
    Defects,
)
from twin.core.fixes import (
    ANSWER_REQUESTER_ONLY,
    COUNT_ERRORED_TRANSFERS,
    KEEP_ERRORED_OUTSTANDING,
    LOST_CONTROL_RECOVERY,
    MULTI_TARGET_RETRY_RESUME,
    SUCCESS_AFTER_OUTSTANDING,
)
from twin.core.grid import (
    chunk_index,
    compute_grid_segments,
    floor_to_grid,
    pages_for_tokens,
    prefetch_chunks,
)
from twin.core.layout import writer_index
from twin.core.snapshot import (
    ChunkView,
    PrefillRoomView,
    PrefillSnapshot,
    StagingInfo,
    TargetView,
    WorkerView,
)
from twin.core.states import PrefillRoomState, PrefillTrigger, observing, prefill_next

# The members the handlers compare against, as module constants: compiled, a Final
# name is a C static, where reading an enum class's attribute goes through its
# metaclass's __getattr__ hook.
_S_BOOTSTRAPPING: Final = PrefillRoomState.BOOTSTRAPPING
_S_FAILED: Final = PrefillRoomState.FAILED
_S_SUCCESS: Final = PrefillRoomState.SUCCESS
_T_DEQUEUE: Final = PrefillTrigger.DEQUEUE
_TRANSFERRING: Final = PrefillRoomState.TRANSFERRING
_T_FAIL: Final = PrefillTrigger.FAIL
_T_LAST_CHUNK_DONE: Final = PrefillTrigger.LAST_CHUNK_DONE

# The event and frame classes the handlers build or test, as module constants: compiled, a
# Final name is a C static, where ``ev.Send`` is a lookup in this module's globals and
# then in the events module's, on every use.
_Abort: Final = wire.Abort
_AbortAck: Final = wire.AbortAck
_ChunkQueued: Final = ev.ChunkQueued
_ChunkReady: Final = wire.ChunkReady
_ChunkSkipped: Final = ev.ChunkSkipped
_DeferralsCounted: Final = ev.DeferralsCounted
_Deferred: Final = ev.Deferred
_Dropped: Final = ev.Dropped
_KVPoll: Final = wire.KVPoll
_PollsDue: Final = ev.PollsDue
_RoomConcluded: Final = ev.RoomConcluded
_RoomTornDown: Final = ev.RoomTornDown
_Send: Final = ev.Send
_StagingReq: Final = wire.StagingReq
_StagingRsp: Final = wire.StagingRsp
_StartTransfer: Final = ev.StartTransfer
_TargetsKnown: Final = ev.TargetsKnown
_TransferStatus: Final = wire.TransferStatus
_WakeWorkers: Final = ev.WakeWorkers
_Watermark: Final = wire.Watermark
_WorkerIdle: Final = ev.WorkerIdle
_WorkerPoll: Final = ev.WorkerPoll

# What a queued chunk's next poll does (coalesced polls): act (post, skip, fail or finish it),
# or defer again until its first target's allocation arrives or its watermark moves past it.
_ACTS: Final = 0
_WAITS_ALLOC: Final = 1
_WAITS_WATERMARK: Final = 2


@dataclass(slots=True)
class TransferChunk:
    """``TransferKVChunk``: pages ``[page_start, +num_pages)`` after the decode prefix.

    The per-chunk and per-room records here define ``__init__`` themselves (the dataclass keeps
    it): compiled, that is a native constructor, where the ``dataclasses`` module's own would
    run as Python."""

    room: int
    page_start: int
    num_pages: int
    is_last: bool
    counted: bool
    written: set[int]  # indices of targets written and announced
    current: int  # the target whose write is in flight
    staged: bool
    # Coalesced polls: the chunk's place in its worker's queue (``seq``, consecutive from
    # the head), whether it is queued, what its next poll does and which classification
    # the index entries naming it belong to (``token``; older entries are stale).
    worker: int
    seq: int
    queued: bool
    wait: int
    token: int
    epoch: int

    def __init__(self, *, room: int, page_start: int, num_pages: int, is_last: bool) -> None:
        self.room = room
        self.page_start = page_start
        self.num_pages = num_pages
        self.is_last = is_last
        self.counted = False
        self.written = set()
        self.current = 0
        self.staged = True
        self.worker = 0
        self.seq = 0
        self.queued = False
        self.wait = _ACTS
        self.token = 0
        self.epoch = -1  # the rank's indexing epoch ``wait`` was worked out in


@dataclass(slots=True)
class PrefillTarget:
    session: str
    decode_rank: int
    total_pages: int
    # chunk -> (offset, round, end) as STAGING_RSP reported it (a ``StagingInfo`` in snapshots)
    staging: dict[int, tuple[int, int, int]]
    dst_port: int

    def __init__(self, session: str, decode_rank: int, total_pages: int, *,
                 dst_port: int = -1) -> None:
        self.session = session
        self.decode_rank = decode_rank
        self.total_pages = total_pages
        self.staging = {}
        self.dst_port = dst_port


@dataclass(slots=True)
class PrefillRoom:
    room: int
    targets: list[PrefillTarget]
    base: int
    state: PrefillRoomState
    outstanding: int
    start_send_idx: int
    sent_pages: int
    prefetched: bool
    fail_reason: str
    success_due: bool  # the last chunk finished while another was outstanding (a fix)
    polled: int  # coalesced polls: this room's accounted polls in the batch being counted

    def __init__(self, *, room: int, targets: list[PrefillTarget], base: int,
                 start_send_idx: int = 0) -> None:
        self.room = room
        self.targets = targets
        self.base = base
        self.state = _S_BOOTSTRAPPING
        self.outstanding = 0
        self.start_send_idx = start_send_idx
        self.sent_pages = 0
        self.prefetched = False
        self.fail_reason = ""
        self.success_due = False
        self.polled = 0


@dataclass(slots=True)
class Worker:
    queue: deque[TransferChunk] = field(default_factory=deque)
    busy: TransferChunk | None = None
    waiting: bool = False
    sleeping: bool = False  # waiting with no poll scheduled: every chunk in its queue blocked
    blocked_streak: int = 0
    # Coalesced polls: the time of the worker's next poll (-1: none), the time of the poll
    # the driver feeds (the polls before it are accounted here), the next queue ``seq``, and
    # the queued chunks whose next poll acts, by ``seq`` (entries checked when read).
    poll_at: float = -1.0
    fed_at: float = -1.0
    next_seq: int = 0
    acting: list[tuple[int, int, TransferChunk]] = field(default_factory=list)
    planned: tuple[float, int] = (-1.0, -1)  # (poll_at, steps) that ``fed_at`` was worked out for


class PrefillRank:
    """One prefill attention-TP rank (``node`` is its name; ``unique_rank`` goes on the wire)."""

    def __init__(self, cfg: TwinConfig, node: str, attn_tp_rank: int, unique_rank: int,
                 defects: Defects | None = None, pp_rank: int = 0) -> None:
        self.cfg = cfg
        self.node = node
        self.rank = attn_tp_rank
        self.unique_rank = unique_rank
        self.pp_rank = pp_rank
        # Mooncake names the requesting PP rank on every STAGING_REQ (mooncake/conn.py ~685,
        # ``requester_pp_rank=self.pp_rank``); NIXL's requests carry none.
        self._req_pp_rank: int | None = pp_rank if cfg.is_mooncake else None
        self._mooncake = cfg.is_mooncake
        # This PP stage's layers [start, end): it writes only their slots of each region.
        m0 = cfg.model
        self._layers = pp_layer_range(m0.num_layers, pp_rank, cfg.prefill.pp_size)
        self.defects = defects or Defects()
        self.fixes = cfg.fix_set
        self._eager = cfg.worker_wake == "eager"
        self._rooms: dict[int, PrefillRoom] = {}
        self._watermarks: dict[str, tuple[int, int]] = {}
        # Per room (so a teardown drops its entries at once): each (chunk_idx, session) asked
        # for, and when it was last asked (lost-control recovery re-asks after a while).
        self._requested_at: dict[int, dict[tuple[int, str], float]] = {}
        # ``answer-requester-only``: per room, each (chunk_idx, session)'s interval before its
        # next re-request (absent: control_retry_s), doubled by each re-request.
        self._retry_gap: dict[int, dict[tuple[int, str], float]] = {}
        self._ack_targets: dict[int, dict[tuple[str, int], int]] = {}
        self._poisoned: set[int] = set()
        self._aborted: set[int] = set()  # failed rooms already torn down here
        self._workers = [Worker() for _ in range(cfg.transfer_queue_size)]
        self.now = 0.0
        # Derived from the frozen config once (they are read on every chunk).
        self._grid_tokens = cfg.grid_tokens
        self._full_pages = cfg.full_chunk_pages
        self._ring_bytes = cfg.ring_bytes
        self._deferral_wait_s = cfg.deferral_wait_s
        # (decode rank, pages) -> (this writer's bytes, its offset in the region, region bytes)
        self._writes: dict[tuple[int, int], tuple[int, int, int]] = {}
        self._writer = writer_index(cfg.prefill.attn_tp_size, cfg.decode.attn_tp_size,
                                    attn_tp_rank)
        # Switches read on every chunk (the defect and fix sets are frozen).
        self._aligned = not self.defects.on(NO_GRID_ALIGNMENT)
        self._resume = self.fixes.on(MULTI_TARGET_RETRY_RESUME)
        self._recovery = self.fixes.on(LOST_CONTROL_RECOVERY)
        # ``answer-requester-only`` backs the recovery's re-requests off (alone: no change)
        self._backoff = self._recovery and self.fixes.on(ANSWER_REQUESTER_ONLY)
        self._retry_cap = max(cfg.control_retry_s, cfg.waiting_timeout_s / 10)
        self._count_errored = self.fixes.on(COUNT_ERRORED_TRANSFERS)
        self._keep_outstanding = self.fixes.on(KEEP_ERRORED_OUTSTANDING)
        self._success_after_outstanding = self.fixes.on(SUCCESS_AFTER_OUTSTANDING)
        self._blind_last = self.defects.on(COMPLETION_BEFORE_LAST_SCATTER)
        # ``needs_staging`` false (equal attention TP): pages go straight to decode's pool
        self._direct = not cfg.stages
        m = cfg.model
        heads = max(1, m.num_kv_heads // cfg.prefill.attn_tp_size)
        pages = cfg.prefill_staging_buffer_pages
        buf_pages = pages if pages is not None else cfg.full_chunk_pages
        self.buffer_bytes = (buf_pages * cfg.page_size * heads * cfg.bytes_per_head_token
                             * (self._layers[1] - self._layers[0]) * 2)
        # Coalesced polls (``worker_polls``): the queued chunks that wait, by what they wait
        # for: (room, chunk_idx) -> (token, chunk) waiting for an allocation; session ->
        # heap of (round - 1, end, uid, token, chunk) waiting for that session's watermark.
        self.coalesced = cfg.worker_polls == "coalesced" and polls_coalescible(cfg)
        self._alloc_wait: dict[tuple[int, int], list[tuple[int, TransferChunk]]] = {}
        self._wm_wait: dict[str, list[tuple[int, int, int, int, TransferChunk]]] = {}
        self._uid = 0
        # The index above is kept from a worker's first deferral until every queue drained
        # (``_indexing``): a run with no deferral pays nothing for it. Each time it starts
        # again (a new ``_epoch``) every queued chunk is classified afresh.
        self._indexing = False
        self._epoch = 0
        self._accounting = False
        # Set by a driver that records no effects: accounted polls are reported as one
        # ``DeferralsCounted`` per worker and input instead of a ``Deferred`` each.
        self.count_deferrals = False
        self.accounted = 0  # polls the last input accounted
        # The workers whose chain of polls began with the last input (a deferral outside the
        # accounted polls, a wake): a driver orders a chain's polls by when it began, as the
        # engine orders fed polls that fall on the same instant.
        self.chain_starts: list[int] = []

    @property
    def num_workers(self) -> int:
        """Transfer workers (each owns one staging buffer of ``buffer_bytes``)."""
        return len(self._workers)

    def session_watermarks(self) -> dict[str, tuple[int, int]]:
        """A copy of the watermark this rank knows per decode session."""
        return dict(self._watermarks)

    def snapshot(self) -> PrefillSnapshot:
        """A read-only copy of this rank's rooms, workers and per-session watermarks."""
        full = self.cfg.full_chunk_pages

        def chunk(c: TransferChunk) -> ChunkView:
            return ChunkView(room=c.room, chunk_idx=chunk_index(c.page_start, full),
                             page_start=c.page_start, num_pages=c.num_pages, is_last=c.is_last)

        workers = tuple(WorkerView(busy=None if w.busy is None else chunk(w.busy),
                                   queue=tuple(chunk(c) for c in w.queue), waiting=w.waiting)
                        for w in self._workers)
        rooms = {r.room: PrefillRoomView(
            room=r.room, state=r.state, outstanding=r.outstanding, fail_reason=r.fail_reason,
            start_send_idx=r.start_send_idx, sent_pages=r.sent_pages,
            targets=tuple(TargetView(session=t.session, decode_rank=t.decode_rank,
                                     total_pages=t.total_pages,
                                     staging={c: StagingInfo(*i) for c, i in t.staging.items()})
                          for t in r.targets)) for r in self._rooms.values()}
        return PrefillSnapshot(node=self.node, now=self.now, watermarks=dict(self._watermarks),
                               workers=workers, rooms=rooms)

    # -- dispatch ----------------------------------------------------------------------------
    def handle(self, event: ev.Input, now: float) -> list[ev.Effect]:
        """Consume one input at time ``now``; return the effects, in order."""
        assert now >= self.now - 1e-12, (now, self.now)
        self.now = now
        out: list[ev.Effect] = []
        handler = _PREFILL_HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"prefill rank cannot handle {type(event).__name__}")
        if self.coalesced:
            if self.chain_starts:
                self.chain_starts.clear()
            self.accounted = 0
            for w in self._workers:  # most inputs find no poll due: skip the accounting
                if 0 <= w.poll_at <= now and w.poll_at < w.fed_at:
                    self._accounting = True
                    self._account(event, now, out)
                    self._accounting = False
                    break
        handler(self, event, out)
        if self.coalesced:
            for w in self._workers:  # nothing to schedule unless a worker waits
                if w.waiting:
                    self._schedule_polls(out)
                    break
            if self._indexing:
                for w in self._workers:
                    if w.queue:
                        break
                else:  # every queue drained: nothing left to index until a worker waits
                    self._stop_indexing()
        return out

    # -- coalesced polls -----------------------------------------------------------------------
    def _account(self, event: ev.Input, now: float, out: list[ev.Effect]) -> None:
        """Run, in time order, each worker's polls due before this input that the driver was
        not asked to feed: each one only defers its head chunk again (checked). A poll at
        exactly ``now`` goes first, except behind a fed poll of a later worker and for
        ``PollsDue``. The polls run the fed polls' code at their own times."""
        workers = self._workers
        if isinstance(event, _WorkerPoll):
            limit = event.worker
        elif isinstance(event, _PollsDue):
            limit = -1
        else:
            limit = len(workers)
        if self.count_deferrals:
            for i, w in enumerate(workers):
                at = w.poll_at  # most inputs find no poll due: no call for those
                if at >= 0 and at < w.fed_at and at <= now:
                    self._count_polls(i, now, i < limit, out)
            return
        while True:
            best = -1
            best_at = 0.0
            for i, w in enumerate(workers):
                at = w.poll_at
                if at < 0 or at >= w.fed_at or at > now or (at == now and i >= limit):
                    continue
                if best < 0 or at < best_at:
                    best, best_at = i, at
            if best < 0:
                break
            w = workers[best]
            head = w.queue[0] if w.queue else None
            if head is None or head.wait == _ACTS or w.busy is not None:
                raise AssertionError(f"{self.node}: coalesced poll of worker {best} at "
                                     f"{best_at!r} would act; it should have been fed")
            self.now = best_at
            fed_at = w.fed_at
            self.accounted += 1
            self._poll_worker(best, out)
            w.fed_at = fed_at  # the fed poll stays asked for
            if not w.waiting:
                raise AssertionError(f"{self.node}: coalesced poll of worker {best} at "
                                     f"{best_at!r} acted; it should have been fed")
        self.now = now

    def _count_polls(self, index: int, now: float, tie: bool, out: list[ev.Effect]) -> None:
        """The accounted polls of worker ``index`` due before ``now`` (at ``now`` too when
        ``tie``), each doing what ``_run_worker`` does with a chunk that waits: dequeue it
        (counting it and moving its room to Transferring), re-put it, lengthen the blocked
        streak and sleep once every queued chunk deferred; counted per room."""
        w = self._workers[index]
        at = w.poll_at
        fed_at = w.fed_at  # neither changes while polls are accounted: read once
        if at < 0 or at >= fed_at or at > now or (at == now and not tie):
            return
        queue = w.queue
        size = len(queue)  # a dequeue and its re-put leave the length as it was
        wait_s = self._deferral_wait_s
        room_of = self._rooms
        seq = w.next_seq
        streak = w.blocked_streak
        # How many polls are due: the times step as the fed polls' would (one addition each,
        # so the last one is the same float). The worker sleeps once every queued chunk
        # deferred in a row, so at most ``size - streak`` polls, each on a different chunk.
        polls = 0
        while at >= 0 and at < fed_at and (at < now or (at == now and tie)):
            polls += 1
            if streak + polls >= size:
                w.sleeping = True
                at = -1.0
            else:
                at += wait_s
        if polls and (not queue or w.busy is not None):
            raise AssertionError(f"{self.node}: coalesced poll of worker {index} would act; "
                                 f"it should have been fed")
        # Each poll dequeues the head and re-puts it at the tail: a rotation by ``polls``. A
        # room already Transferring stays so on a dequeue: the table's self-loop is skipped
        # unless somebody watches. Counts go on the room records, not in a dict keyed by room
        # id (each such key is a fresh int object above 256); a record is looked up again only
        # when the next chunk is another room's.
        full = observing()
        touched: list[PrefillRoom] = []
        key = -1
        room: PrefillRoom | None = None
        for chunk in islice(queue, polls):
            if chunk.room != key or room is None:
                key = chunk.room
                room = room_of.get(key)
                if room is None:
                    raise AssertionError(f"{self.node}: coalesced poll of worker {index} on "
                                         f"room {key}, which it does not hold")
            if chunk.wait == _ACTS:
                raise AssertionError(f"{self.node}: coalesced poll of worker {index} on room "
                                     f"{key} would act; it should have been fed")
            if not chunk.counted:
                room.outstanding += 1
                chunk.counted = True
            if full or room.state is not _TRANSFERRING:
                room.state = prefill_next(room.state, _T_DEQUEUE)
            if chunk.written:
                chunk.written.clear()
            chunk.seq = seq
            seq += 1
            if room.polled == 0:
                touched.append(room)
            room.polled += 1
        queue.rotate(-polls)
        streak += polls
        self.accounted += seq - w.next_seq
        w.next_seq = seq
        w.blocked_streak = streak
        w.poll_at = at
        out.append(_DeferralsCounted(worker=index, rooms=tuple([r.room for r in touched]),
                                     counts=tuple([r.polled for r in touched])))
        for r in touched:
            r.polled = 0

    def _schedule_polls(self, out: list[ev.Effect]) -> None:
        """Ask the driver to feed each waiting worker's first poll that acts or sleeps (a
        ``WakeWorkers`` at its time; a newer one replaces an older). The polls before it
        each defer a chunk that waits, one ``deferral_wait_s`` apart."""
        wait_s = self._deferral_wait_s
        for i, w in enumerate(self._workers):
            if w.poll_at < 0 or not w.waiting or w.sleeping or w.busy is not None:
                continue
            queue = w.queue
            steps = max(0, len(queue) - w.blocked_streak - 1)  # the poll that sleeps
            if queue:
                acting = w.acting
                head_seq = queue[0].seq
                while acting:
                    seq, token, chunk = acting[0]
                    if chunk.queued and chunk.seq == seq and chunk.token == token:
                        steps = min(steps, seq - head_seq)
                        break
                    heapq.heappop(acting)
            at = w.poll_at
            if w.fed_at >= 0 and w.planned == (at, steps):
                continue  # nothing it depends on moved
            w.planned = (at, steps)
            for _ in range(steps):
                at += wait_s  # as a fed poll adds its wait to the time it ran at
            if at != w.fed_at:
                w.fed_at = at
                out.append(_WakeWorkers(workers=(i,), at=at))

    def _enqueue(self, index: int, chunk: TransferChunk, fresh: bool) -> None:
        """Append ``chunk`` to worker ``index``'s queue; a ``fresh`` chunk (not a re-put) or
        one whose poll was expected to act is classified for coalesced polls."""
        w = self._workers[index]
        chunk.worker = index
        chunk.seq = w.next_seq
        w.next_seq += 1
        chunk.queued = True
        w.queue.append(chunk)
        if self._indexing and (fresh or chunk.wait == _ACTS or chunk.epoch != self._epoch):
            self._classify(chunk)

    def _start_indexing(self) -> None:
        """A worker starts to wait: index what every queued chunk's next poll does."""
        self._indexing = True
        self._epoch += 1
        self._reclassify_rooms(None)

    def _stop_indexing(self) -> None:
        """Every queue drained: drop the index until a worker waits again."""
        self._indexing = False
        self._alloc_wait.clear()
        self._wm_wait.clear()
        for w in self._workers:
            w.acting.clear()

    def _classify(self, chunk: TransferChunk) -> None:
        """Index what a queued chunk's next poll does, as ``_step_chunk`` would decide it
        (without resume, a retry starts at the first target). Anything unusual acts: a poll
        fed where it only defers is harmless, one accounted where it acts is not."""
        chunk.token += 1
        token = chunk.token
        chunk.epoch = self._epoch
        room = self._rooms.get(chunk.room)
        chunk.wait = _ACTS
        if (room is not None and room.state is not _S_FAILED and chunk.num_pages > 0
                and not self._direct and room.targets and not chunk.written):
            target = room.targets[0]
            chunk_idx = chunk_index(chunk.page_start, self._full_pages)
            info = target.staging.get(chunk_idx)
            if info is None or (info[0] < 0 and info[0] != ALLOC_OVERSIZED):
                chunk.wait = _WAITS_ALLOC
                self._alloc_wait.setdefault((chunk.room, chunk_idx), []).append((token, chunk))
                return
            _offset, rnd, end = info
            if info[0] >= 0 and not is_watermark_ready(
                    self._watermarks.get(target.session, (0, 0)), rnd, end):
                chunk.wait = _WAITS_WATERMARK
                self._uid += 1
                heapq.heappush(self._wm_wait.setdefault(target.session, []),
                               (rnd - 1, end, self._uid, token, chunk))
                return
        heapq.heappush(self._workers[chunk.worker].acting, (chunk.seq, token, chunk))

    def _reclassify_rooms(self, rooms: set[int] | None) -> None:
        """Classify again the queued chunks of ``rooms`` (all when None): their room failed,
        went or gained targets."""
        for w in self._workers:
            for chunk in w.queue:
                if rooms is None or chunk.room in rooms:
                    self._classify(chunk)

    def _watermark_advanced(self, session: str, wm: tuple[int, int]) -> None:
        """The chunks waiting for ``session``'s watermark that ``wm`` admits now act."""
        heap = self._wm_wait.get(session)
        while heap and (heap[0][0], heap[0][1]) <= wm:
            _r, _e, _uid, token, chunk = heapq.heappop(heap)
            if chunk.queued and chunk.token == token:
                chunk.token += 1
                chunk.wait = _ACTS
                heapq.heappush(self._workers[chunk.worker].acting,
                               (chunk.seq, chunk.token, chunk))

    def _allocation_known(self, room: int, chunk_idx: int, first: bool) -> None:
        """A STAGING_RSP arrived for ``(room, chunk_idx)``: classify its waiting chunks again
        (every chunk of the room when it replaced an allocation already known)."""
        if not first:
            self._reclassify_rooms({room})
            return
        for token, chunk in self._alloc_wait.pop((room, chunk_idx), ()):
            if chunk.queued and chunk.token == token:
                self._classify(chunk)

    def _on_message(self, e: ev.MessageArrived, out: list[ev.Effect]) -> None:
        msg = e.msg
        if isinstance(msg, _Watermark):
            session = msg.session_id
            mark = (msg.round, msg.tail)
            advanced = mark > self._watermarks.get(session, (0, 0))
            if advanced:
                self._watermarks[session] = mark
                if self._indexing:
                    self._watermark_advanced(session, mark)
            if advanced or not self._eager:
                self._wake(out)  # handle_watermark_msg notifies the condition, advancing or not
        elif isinstance(msg, _StagingRsp):
            room_id, chunk_idx = msg.room, msg.chunk_idx
            room = self._rooms.get(room_id)
            target = None if room is None else _find(room.targets, msg.session_id)
            if target is None:
                out.append(_Dropped(what="STAGING_RSP", room=room_id, reason="no transfer info"))
                return
            first = chunk_idx not in target.staging
            target.staging[chunk_idx] = (msg.offset, msg.round, msg.end)
            if first and self._backoff:
                self._reset_backoff(room_id, chunk_idx, msg.session_id)
            if self._indexing:
                self._allocation_known(room_id, chunk_idx, first)
            self._news(out)  # handle_staging_rsp does not notify: the bounded wait runs out
        elif isinstance(msg, _Abort):
            self._on_decode_abort(msg, out)
        else:
            out.append(_Dropped(what=type(msg).__name__, room=getattr(msg, "room", -1),
                                reason="unexpected message kind at prefill"))

    def _wake(self, out: list[ev.Effect]) -> None:
        """``watermark_cv.notify_all()``: every waiting worker polls now."""
        waiting = tuple(i for i, w in enumerate(self._workers) if w.waiting)
        for i in waiting:
            w = self._workers[i]
            w.waiting = w.sleeping = False
            w.blocked_streak = 0
            w.poll_at = w.fed_at = self.now  # a fed poll replaces the pending one
            w.planned = (-1.0, -1)
            if self.coalesced:
                self.chain_starts.append(i)
        if waiting:
            out.append(_WakeWorkers(workers=waiting, at=self.now))

    def _news(self, out: list[ev.Effect], worker: int | None = None) -> None:
        """News that does not notify the condition. With ``worker_wake = "eager"`` (the model
        of traces before format 3) it woke the waiting workers (or ``worker``) at once."""
        if not self._eager:
            self._nudge(out)
        elif worker is None:
            self._wake(out)
        else:
            w = self._workers[worker]
            w.waiting = w.sleeping = False
            w.blocked_streak = 0
            out.append(_WakeWorkers(workers=(worker,), at=self.now))

    def _nudge(self, out: list[ev.Effect]) -> None:
        """News that does not notify the condition (an allocation, a queued chunk, an abort):
        a waiting worker sees it when its bounded wait ends. A worker the twin lets sleep
        (its whole queue blocked) stands for one cycling through 1 ms waits, so it polls
        ``deferral_wait_s`` from now; one with a poll scheduled keeps it (with
        ``answer-requester-only``, unless that poll is a re-request backed off past then)."""
        sleeping = []
        at = self.now + self.cfg.deferral_wait_s
        backoff = self._backoff
        for i, w in enumerate(self._workers):
            w.blocked_streak = 0
            if w.waiting and w.sleeping:
                w.sleeping = False
                sleeping.append(i)
            elif backoff and w.waiting and w.poll_at > at:
                # ``answer-requester-only``: a re-poll backed off past the bounded wait stands
                # for a worker cycling through 1 ms waits too; it sees the news then.
                sleeping.append(i)
        if sleeping:
            for i in sleeping:
                self._workers[i].poll_at = self._workers[i].fed_at = at
                self._workers[i].planned = (-1.0, -1)
                if self.coalesced:
                    self.chain_starts.append(i)
            out.append(_WakeWorkers(workers=tuple(sleeping), at=at))

    # -- rooms and sends ---------------------------------------------------------------------
    def _on_bootstrapped(self, e: ev.RoomBootstrapped, out: list[ev.Effect]) -> None:
        if e.room in self._aborted:
            out.append(_Dropped(what="metadata", room=e.room, reason="room already failed"))
            return
        room = self._rooms.get(e.room)
        targets = [PrefillTarget(t.session, t.decode_rank, t.total_pages, dst_port=t.dst_port)
                   for t in e.targets]
        if room is None:
            base = e.targets[0].decode_prefix_len if e.targets else 0
            room = self._rooms[e.room] = PrefillRoom(room=e.room, targets=targets, base=base,
                                                     start_send_idx=base)
        else:
            known = {t.session for t in room.targets}
            had_targets = bool(room.targets)
            room.targets.extend(t for t in targets if t.session not in known)
            if self._indexing and not had_targets:
                self._reclassify_rooms({e.room})
        out.append(_TargetsKnown(room=e.room,
                                 sessions=tuple(t.session for t in room.targets)))

    def _on_prefetch(self, e: ev.Prefetch, out: list[ev.Effect]) -> None:
        room = self._rooms.get(e.room)
        if room is None or room.prefetched:
            return
        self._prefetch(room, out)

    def _prefetch(self, room: PrefillRoom, out: list[ev.Effect]) -> None:
        """``prefetch_staging_reqs``: one STAGING_REQ per grid chunk and target, once; none
        for a room that needs no staging (``_prefetch_staging_reqs``, nx ~1058-1068)."""
        room.prefetched = True
        if self._direct:
            return
        room_id = room.room
        grid_pages = self._full_pages
        requested_at = self._requested_at.setdefault(room_id, {})
        for target in room.targets:
            for chunk_idx, chunk_pages in prefetch_chunks(target.total_pages, grid_pages):
                key = (chunk_idx, target.session)
                if key in requested_at:
                    continue
                requested_at[key] = self.now
                out.append(_Send(dst=target.session, msg=_StagingReq(
                    room=room_id, chunk_idx=chunk_idx, chunk_pages=chunk_pages,
                    session_id=target.session, pp_rank=self._req_pp_rank)))

    def _on_send_kv(self, e: ev.SendKV, out: list[ev.Effect]) -> None:
        room = self._rooms.get(e.room)
        if room is None or room.state is _S_FAILED:
            out.append(_Dropped(what="SendKV", room=e.room, reason="room not bootstrapped"))
            return
        page = self.cfg.page_size
        aligned = self._aligned
        start, end = room.start_send_idx, e.end_idx
        if not e.last:
            end -= end % page
            if aligned:
                end = floor_to_grid(end, room.base, self._grid_tokens)
        if end < start:
            return
        if not room.prefetched:
            self._prefetch(room, out)
        segments = (compute_grid_segments(start, end, room.base, self._grid_tokens)
                    if aligned else [(start, end)])
        total_pages = 0
        for t in room.targets:  # a loop, not max() over a list: no boxed ints when compiled
            if t.total_pages > total_pages:
                total_pages = t.total_pages
        worker = self._worker_of(room)
        for seg_start, seg_end in segments:
            num_pages = pages_for_tokens(seg_end - seg_start, page)
            chunk = TransferChunk(room=e.room, page_start=room.sent_pages, num_pages=num_pages,
                                  is_last=False)
            room.sent_pages += num_pages
            chunk.is_last = e.last and seg_end == end and room.sent_pages >= total_pages
            self._enqueue(worker, chunk, True)
            out.append(_ChunkQueued(worker=worker, room=e.room,
                                    chunk_idx=chunk_index(chunk.page_start, self._full_pages),
                                    page_start=chunk.page_start, num_pages=num_pages,
                                    is_last=chunk.is_last))
        room.start_send_idx = end
        w = self._workers[worker]
        if w.busy is None and not w.waiting:
            self._run_worker(worker, out)
        elif w.waiting:
            self._news(out, worker)  # queue.put: found after the bounded wait

    def _worker_of(self, room: PrefillRoom) -> int:
        """``add_transfer_request``: shard by the sum of the sessions' ports, so the same
        destinations always use the same worker (and its staging buffer). Targets from traces
        before format 3 carry no port; those shard by the decode ranks' indices."""
        ports = ranks = 0  # summed in loops, not by sum() over lists: no boxed ints compiled
        for t in room.targets:
            if ports >= 0:
                ports = ports + t.dst_port if t.dst_port >= 0 else -1
            ranks += t.decode_rank
        if room.targets and ports >= 0:
            return ports % len(self._workers)
        return ranks % len(self._workers)

    # -- transfer worker ---------------------------------------------------------------------
    def _on_poll(self, e: ev.WorkerPoll, out: list[ev.Effect]) -> None:
        self._poll_worker(e.worker, out)

    def _on_polls_due(self, e: ev.PollsDue, out: list[ev.Effect]) -> None:
        del e, out  # the polls due were accounted before the handler

    def _poll_worker(self, index: int, out: list[ev.Effect]) -> None:
        w = self._workers[index]
        w.waiting = w.sleeping = False
        w.poll_at = w.fed_at = -1.0
        w.planned = (-1.0, -1)
        if w.busy is None:
            self._run_worker(index, out)

    def _run_worker(self, index: int, out: list[ev.Effect]) -> None:
        """Pop chunks until one is posted, one defers, or the queue is empty."""
        w = self._workers[index]
        while w.queue:
            chunk = w.queue.popleft()
            chunk.queued = False
            room = self._rooms.get(chunk.room)
            if room is None:
                out.append(_ChunkSkipped(room=chunk.room, page_start=chunk.page_start,
                                         reason="room state torn down"))
                self._maybe_ack(chunk.room, out)
                continue
            if not chunk.counted:
                room.outstanding += 1
                chunk.counted = True
            if room.state is _S_FAILED:
                if self._keep_outstanding:
                    # PR #36707: uncount only this chunk; a count kept for an errored
                    # transfer that did not settle survives (and holds the room's state).
                    chunk.counted = False
                    room.outstanding -= 1
                else:
                    room.outstanding = 0  # _staging_outstanding.pop(room) (nx ~1635)
                out.append(_ChunkSkipped(room=chunk.room, page_start=chunk.page_start,
                                         reason="room failed"))
                if not self._queued(room.room) and room.outstanding <= 0:
                    self._tear_down(room, out)
                self._maybe_ack(room.room, out)
                continue
            room.state = prefill_next(room.state, _T_DEQUEUE)
            if self._step_chunk(index, room, chunk, out):
                return
        out.append(_WorkerIdle(worker=index))

    def _step_chunk(self, index: int, room: PrefillRoom, chunk: TransferChunk,
                    out: list[ev.Effect]) -> bool:
        """Post the next target's write; True when the worker is now busy or waiting.

        SGLang walks the chunk's targets in order and defers the whole chunk at the first one
        that is not ready; the retry starts over at the first target. With
        ``multi-target-retry-resume`` the chunk writes whichever unwritten target is ready and
        a retry visits only the targets not written yet."""
        w = self._workers[index]
        cfg = self.cfg
        resume = self._resume
        chunk_idx = chunk_index(chunk.page_start, self._full_pages)
        while True:
            written = chunk.written
            pending = [i for i in range(len(room.targets)) if i not in written]
            if not pending:
                break
            if chunk.num_pages == 0:
                chunk.written.update(pending)
                continue
            if self._direct:  # ``send_kvcache`` (nx ~1722-1760): no region, no watermark
                i = pending[0]
                out.append(self._post_direct(index, room, chunk, room.targets[i], chunk_idx))
                w.busy = chunk
                chunk.current = i
                chunk.staged = False
                w.blocked_streak = 0
                return True
            blocked: tuple[PrefillTarget, str] | None = None
            ask_at = -1.0  # with a backoff: the earliest next re-request of a blocked target
            for i in pending if resume else pending[:1]:
                target = room.targets[i]
                info = target.staging.get(chunk_idx)
                # ``StagingInfo.oversized`` and ``.pending``; no region yet reads as pending (-1)
                offset, rnd, end = info if info is not None else (-1, 0, 0)
                if offset == ALLOC_OVERSIZED:
                    self._fail_chunk(room, chunk, "staging allocation oversized: chunk exceeds "
                                     "the ring; increase SGLANG_DISAGG_STAGING_POOL_SIZE_MB", out)
                    return False
                wm = self._watermarks.get(target.session, (0, 0))
                if offset < 0 or not is_watermark_ready(wm, rnd, end):
                    # (the watermark's two numbers formatted one by one: a tuple's str()
                    # was 6% of a deferral storm's time)
                    reason = "allocation pending" if offset < 0 else (
                        f"watermark ({wm[0]}, {wm[1]}) behind round {rnd} end {end}")
                    if self._recovery:
                        due = self._re_request(room, target, chunk_idx, out)
                        if due >= 0 and (ask_at < 0 or due < ask_at):
                            ask_at = due
                    blocked = blocked or (target, reason)
                    continue
                post = self._post(index, room, chunk, target, chunk_idx, (offset, rnd, end),
                                  out)
                if post is None:
                    return False
                out.append(post)
                if self._backoff:
                    self._reset_backoff(room.room, chunk_idx, target.session)
                w.busy = chunk
                chunk.current = i
                chunk.staged = post.staged
                w.blocked_streak = 0
                return True
            assert blocked is not None
            target, reason = blocked
            if not resume:
                chunk.written.clear()  # the retry re-processes every target of the chunk
            self._enqueue(index, chunk, False)
            w.blocked_streak += 1
            all_blocked = w.blocked_streak >= len(w.queue)
            w.waiting = True
            if self.coalesced and not self._indexing:
                self._start_indexing()
            retry = None if all_blocked else self.now + self._deferral_wait_s
            if retry is None and self._recovery:
                retry = self.now + cfg.control_retry_s
                if self._backoff and ask_at > retry:
                    retry = ask_at  # nothing to ask again before then
            w.sleeping = retry is None
            w.poll_at = -1.0 if retry is None else retry
            if retry is not None and self.coalesced and not self._accounting:
                self.chain_starts.append(index)
            out.append(_Deferred(worker=index, room=room.room, chunk_idx=chunk_idx,
                                 session=target.session, reason=reason,
                                 all_blocked=all_blocked, retry_at=retry))
            return True
        self._finish_chunk(index, room, chunk, out)
        return False

    def _re_request(self, room: PrefillRoom, target: PrefillTarget, chunk_idx: int,
                    out: list[ev.Effect]) -> float:
        """Lost-control recovery: ask again for a chunk deferred ``control_retry_s`` after its
        last request; decode answers with the allocation and its current watermark.

        With ``answer-requester-only`` the interval doubles with each re-request of the same
        chunk and session, up to a tenth of the waiting timeout. Returns when the next
        re-request is due (-1: never requested, or no backoff)."""
        key = (chunk_idx, target.session)
        requested_at = self._requested_at.get(room.room)
        if requested_at is None or key not in requested_at:
            return -1.0  # never requested: nothing to ask again
        last = requested_at[key]
        due = -1.0
        if not self._backoff:
            if self.now - last < self.cfg.control_retry_s:
                return due
        else:
            gaps = self._retry_gap.setdefault(room.room, {})
            gap = gaps.get(key, self.cfg.control_retry_s)
            if self.now < last + gap:  # (the poll comes at exactly last + gap)
                return last + gap
            gap = min(gap * 2, self._retry_cap)
            gaps[key] = gap
            due = self.now + gap
        requested_at[key] = self.now
        full = self.cfg.full_chunk_pages
        pages = min(full, target.total_pages - chunk_idx * full)
        out.append(_Send(dst=target.session, msg=_StagingReq(
            room=room.room, chunk_idx=chunk_idx, chunk_pages=pages, session_id=target.session,
            pp_rank=self._req_pp_rank)))
        return due

    def _reset_backoff(self, room_id: int, chunk_idx: int, session: str) -> None:
        """``answer-requester-only``: a chunk that got its allocation or posted its write
        re-requests ``control_retry_s`` after its last request again."""
        gaps = self._retry_gap.get(room_id)
        if gaps is not None:
            gaps.pop((chunk_idx, session), None)

    def _post(self, index: int, room: PrefillRoom, chunk: TransferChunk, target: PrefillTarget,
              chunk_idx: int, info: tuple[int, int, int],
              out: list[ev.Effect]) -> ev.StartTransfer | None:
        """The write for one target, or None after failing the room (chunk cannot fit)."""
        offset, rnd, end = info
        key = (target.decode_rank, chunk.num_pages)
        write = self._writes.get(key)
        if write is None:
            writer_bytes = self.cfg.region_layout(target.decode_rank, chunk.num_pages)[1]
            wi = self._writer
            # A PP stage writes its own layers' K and V slots of its TP writer's block; the
            # twin places them as one span at the stage's share of the block.
            first, stop = self._layers
            layers = self.cfg.model.num_layers
            block = writer_bytes[wi]
            write = self._writes[key] = (block * (stop - first) // layers,
                                         sum(writer_bytes[:wi]) + block * first // layers,
                                         sum(writer_bytes))
        nbytes, before, region = write
        wi = self._writer
        dst_offset = offset + before
        fits = nbytes <= self.buffer_bytes and self._ring_bytes - offset >= region
        staged = True
        if not fits:
            if not self.defects.on(SILENT_SLICE_FALLBACK):
                self._fail_chunk(room, chunk, f"staged transfer cannot fit chunk {chunk_idx} "
                                 f"({chunk.num_pages} pages, {nbytes} bytes)", out)
                return None
            staged = False
        return _StartTransfer(
            worker=index, room=room.room, chunk_idx=chunk_idx, session=target.session,
            page_start=chunk.page_start, num_pages=chunk.num_pages, region_offset=offset,
            region_end=end, dst_offset=dst_offset, nbytes=nbytes, writer=wi, round=rnd,
            staged=staged, is_last=chunk.is_last, decode_rank=target.decode_rank)

    def _post_direct(self, index: int, room: PrefillRoom, chunk: TransferChunk,
                     target: PrefillTarget, chunk_idx: int) -> ev.StartTransfer:
        """The page-by-page write of a room that needs no staging: this rank's KV of the
        chunk's pages into the target's KV pool (``staged`` False, no ring region)."""
        key = (target.decode_rank, chunk.num_pages)
        write = self._writes.get(key)
        if write is None:
            writer_bytes = self.cfg.region_layout(target.decode_rank, chunk.num_pages)[1]
            wi = self._writer
            write = self._writes[key] = (writer_bytes[wi], sum(writer_bytes[:wi]),
                                         sum(writer_bytes))
        return _StartTransfer(
            worker=index, room=room.room, chunk_idx=chunk_idx, session=target.session,
            page_start=chunk.page_start, num_pages=chunk.num_pages, region_offset=-1,
            region_end=-1, dst_offset=-1, nbytes=write[0], writer=self._writer, round=0,
            staged=False, is_last=chunk.is_last, decode_rank=target.decode_rank)

    def _on_transfer_done(self, e: ev.TransferDone, out: list[ev.Effect]) -> None:
        w = self._workers[e.worker]
        chunk = w.busy
        assert chunk is not None, f"worker {e.worker} has no transfer in flight"
        w.busy = None
        room = self._rooms.get(chunk.room)
        if room is None:
            self._run_worker(e.worker, out)
            return
        if not e.ok:
            if self._mooncake:
                # batch_transfer_sync returned non-zero (its timeout leaves the batch possibly
                # in flight): Mooncake poisons the room's drain ACK and concludes Failed,
                # telling decode (mooncake/conn.py ~2739-2752, _poison_unsettled_send ~2478).
                self._poisoned.add(room.room)
                self._ack_targets.pop(room.room, None)
                self._fail_chunk(room, chunk, f"Mooncake transfer failed: {e.error}", out)
            elif not e.settled and self._count_errored:
                # Upstream after 0.5.23 (NIXL): the unsettled chunk stays counted (never uncounted
                # here), so no ABORT_ACK while it is; no poison.
                chunk.counted = False
                self._fail_chunk(room, chunk, f"NIXL transfer not settled: {e.error}", out,
                                 notify=False)
            elif not e.settled:
                # A handle may still be writing: fail the room here without telling decode
                # (its waiting timeout will), and never acknowledge its abort.
                self._poisoned.add(room.room)
                self._ack_targets.pop(room.room, None)
                self._fail_chunk(room, chunk, f"NIXL transfer not settled: {e.error}", out,
                                 notify=False)
            else:
                self._fail_chunk(room, chunk, f"NIXL transfer failed: {e.error}", out)
            self._run_worker(e.worker, out)
            return
        target = room.targets[chunk.current]
        chunk_idx = chunk_index(chunk.page_start, self._full_pages)
        skip_last = chunk.is_last and self._blind_last
        if chunk.staged and not skip_last:
            out.append(_Send(dst=target.session, msg=_ChunkReady(
                room=chunk.room, chunk_idx=chunk_idx, page_start=chunk.page_start,
                num_pages=chunk.num_pages, writer_id=target.session,
                prefill_rank=self.unique_rank)))
        chunk.written.add(chunk.current)
        if self._step_chunk(e.worker, room, chunk, out):
            return
        self._run_worker(e.worker, out)

    def _finish_chunk(self, index: int, room: PrefillRoom, chunk: TransferChunk,
                      out: list[ev.Effect]) -> None:
        chunk.counted = False
        room.outstanding -= 1
        if chunk.is_last:
            if self._success_after_outstanding and room.outstanding > 0:
                room.success_due = True  # an earlier chunk was re-enqueued: it concludes
            else:
                self._conclude(room, "Success", "", out)
        elif room.success_due and room.outstanding <= 0 and room.state is not _S_FAILED:
            room.success_due = False
            self._conclude(room, "Success", "", out)
        self._maybe_teardown(room, chunk, out)
        self._maybe_ack(room.room, out)

    def _maybe_teardown(self, room: PrefillRoom, chunk: TransferChunk,
                        out: list[ev.Effect]) -> None:
        gate = room.outstanding <= 0 or self.defects.on(TEARDOWN_DROPS_DEFERRED)
        # A failed room also goes once nothing of it is queued: the prefill scheduler polls
        # Failed and clears the sender (CommonKVSender.clear), whichever chunk finished last.
        failed_done = room.state is _S_FAILED and (chunk.is_last or not self._queued(room.room))
        if gate and (room.state is _S_SUCCESS or failed_done):
            self._tear_down(room, out)

    def _tear_down(self, room: PrefillRoom, out: list[ev.Effect]) -> None:
        del self._rooms[room.room]
        self._requested_at.pop(room.room, None)
        self._retry_gap.pop(room.room, None)
        if room.state is _S_FAILED:
            self._aborted.add(room.room)
        if self._indexing:
            self._reclassify_rooms({room.room})  # its queued chunks are skipped
        out.append(_RoomTornDown(room=room.room))

    def _fail_chunk(self, room: PrefillRoom, chunk: TransferChunk, reason: str,
                    out: list[ev.Effect], notify: bool = True) -> None:
        if chunk.counted:
            chunk.counted = False
            room.outstanding -= 1
        self._conclude(room, "Failed", reason, out, notify=notify)
        self._maybe_teardown(room, chunk, out)
        self._maybe_ack(room.room, out)

    def _conclude(self, room: PrefillRoom, status: str, reason: str,
                  out: list[ev.Effect], notify: bool = True) -> None:
        """``conclude_transfer``: a room already Failed concludes Failed again, with its first
        reason, and tells decode again (``KV_STATUS`` Failed)."""
        if room.state is _S_FAILED:
            if notify:
                self._send_status(room, _KVPoll.Failed, room.fail_reason, out)
            return
        room.state = prefill_next(room.state,
                                  _T_LAST_CHUNK_DONE if status == "Success" else _T_FAIL)
        room.fail_reason = reason
        if self._indexing and status != "Success":
            self._reclassify_rooms({room.room})  # its queued chunks are skipped
        poll = _KVPoll.Success if status == "Success" else _KVPoll.Failed
        out.append(_RoomConcluded(room=room.room, status=status, reason=reason))
        if notify:
            self._send_status(room, poll, reason, out)

    def _send_status(self, room: PrefillRoom, poll: wire.KVPoll, reason: str,
                     out: list[ev.Effect]) -> None:
        for target in room.targets:
            out.append(_Send(dst=target.session, msg=_TransferStatus(
                room=room.room, status=poll, prefill_rank=self.unique_rank,
                failure_reason=reason)))

    def _on_send_failed(self, e: ev.SendFailed, out: list[ev.Effect]) -> None:
        msg = e.msg
        if not isinstance(msg, _ChunkReady) or self.defects.on(SWALLOWED_CHUNK_READY_ERROR):
            out.append(_Dropped(what=type(msg).__name__, room=getattr(msg, "room", -1),
                                reason="send failed (ignored)"))
            return
        room = self._rooms.get(msg.room)
        reason = f"CHUNK_READY send to {e.dst} failed"
        if room is not None:
            self._conclude(room, "Failed", reason, out)
            return
        # The last chunk's step concluded Success and tore the room down before the driver
        # fed this failure back. SGLang's send raises inside the worker, before
        # ``conclude_transfer(Success)`` (nx ~1838-1902), and ``conclude_failure`` tells decode;
        # so tell the decode rank the frame was for (a driver feeds the failure before it sends
        # the step's later frames, so this Failed goes out ahead of that Success).
        out.append(_Send(dst=e.dst, msg=_TransferStatus(
            room=msg.room, status=_KVPoll.Failed, prefill_rank=self.unique_rank,
            failure_reason=reason)))

    def _on_abort(self, e: ev.RoomAborted, out: list[ev.Effect]) -> None:
        """A prefill-side abort (``sender.abort``): fails the room even at Success."""
        room = self._rooms.get(e.room)
        if room is None:
            # The sender exists before its metadata: a late metadata must not revive it.
            self._aborted.add(e.room)
            return
        if room.state is _S_FAILED:
            return
        self._abort_room(room, e.reason, out)

    def _on_decode_abort(self, msg: wire.Abort, out: list[ev.Effect]) -> None:
        """``_handle_abort_notification``: a decode ABORT fails a room only while it has not
        succeeded; with a generation it also registers where the acknowledgement goes."""
        room = self._rooms.get(msg.room)
        if room is not None and room.state not in (_S_SUCCESS, _S_FAILED):
            self._abort_room(room, "Aborted by decode-side abort notification.", out)
        if msg.generation is None or not self.cfg.deferred_decode_kv_release:
            return
        if msg.room not in self._poisoned:
            targets = self._ack_targets.setdefault(msg.room, {})
            targets[(msg.decode_ip, msg.decode_port)] = msg.generation
        self._maybe_ack(msg.room, out)

    def _abort_room(self, room: PrefillRoom, reason: str, out: list[ev.Effect]) -> None:
        room.state = prefill_next(room.state, _T_FAIL)
        room.fail_reason = reason
        if self._indexing:
            self._reclassify_rooms({room.room})  # its queued chunks are skipped
        out.append(_RoomConcluded(room=room.room, status="Failed", reason=reason))
        if room.outstanding <= 0 and not self._queued(room.room):
            self._tear_down(room, out)
        self._news(out)  # its queued chunks are skipped at the next pass

    def _maybe_ack(self, room_id: int, out: list[ev.Effect]) -> None:
        """``_maybe_ack_drained_abort``: acknowledge once nothing of the room is dequeued or in
        flight; a poisoned room never acknowledges."""
        room = self._rooms.get(room_id)
        if room is not None and room.outstanding > 0:
            return
        targets = self._ack_targets.pop(room_id, None)
        if not targets or room_id in self._poisoned:
            return
        for (ip, _port), generation in sorted(targets.items()):
            out.append(_Send(dst=ip, msg=_AbortAck(
                room=room_id, prefill_rank=self.unique_rank, generation=generation)))

    def _queued(self, room: int) -> bool:
        return any(c.room == room for w in self._workers for c in w.queue) or any(
            w.busy is not None and w.busy.room == room for w in self._workers)

    def _on_tick(self, e: ev.Tick, out: list[ev.Effect]) -> None:
        del e, out


# Input type -> handler (a module table rather than a class attribute, so the module also
# compiles: a compiled class body cannot refer to its own methods).
_PREFILL_HANDLERS: dict[type, Callable[[PrefillRank, Any, list[ev.Effect]], None]] = {
    ev.MessageArrived: PrefillRank._on_message,
    ev.RoomBootstrapped: PrefillRank._on_bootstrapped,
    ev.Prefetch: PrefillRank._on_prefetch,
    ev.SendKV: PrefillRank._on_send_kv,
    ev.WorkerPoll: PrefillRank._on_poll,
    ev.TransferDone: PrefillRank._on_transfer_done,
    ev.SendFailed: PrefillRank._on_send_failed,
    ev.RoomAborted: PrefillRank._on_abort,
    ev.Tick: PrefillRank._on_tick,
    ev.PollsDue: PrefillRank._on_polls_due,
}


def _find(targets: list[PrefillTarget], session: str) -> PrefillTarget | None:
    for t in targets:
        if t.session == session:
            return t
    return None

