"""Inputs the core consumes and effects it returns.

Drivers call ``rank.handle(event, now)`` with an *input* and carry out the returned *effects*.
Every class here is a frozen, slotted, keyword-only dataclass, so events are cheap, hashable and
serialise to the trace as ``{"type": ClassName, **fields}``. ``EVENT_TYPES`` maps names back to
classes for the trace reader.
"""

from __future__ import annotations

from dataclasses import dataclass

from twin.core.fastinit import speed_up_module
from twin.core.wire import Message


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class MessageArrived:
    """A control frame from ``src`` was delivered (already decoded)."""

    src: str
    msg: Message


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeRoomInit:
    """Decode pre-allocated KV for a room (``pop_preallocated``) and is about to send metadata.

    ``total_pages`` counts pages after the decode-side cached prefix (``decode_prefix_len``
    tokens); ``prefill_ranks`` are the prefill nodes that write this rank's KV. ``group`` are the
    decode ranks whose poll states of this room are reduced together (SGLang's MIN all-reduce
    over the attention-TP group), this rank included; empty: the rank concludes alone.
    """

    room: int
    prefill_ranks: tuple[str, ...]
    prefill_attn_tp: int
    decode_prefix_len: int
    total_pages: int
    group: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeRoomRegister:
    """The late registration point (``extend``); only used with ``late-decode-registration``."""

    room: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ScatterDone:
    """The scatter of ``alloc_id`` (room, chunk) finished on the decode device."""

    room: int
    chunk_idx: int
    alloc_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Tick:
    """Time advanced; check timeouts."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RoomAborted:
    """The request was aborted (client, router, or the other side failed it)."""

    room: int
    reason: str = "aborted"


@dataclass(frozen=True, slots=True, kw_only=True)
class RoomBootstrapped:
    """Prefill received the decode metadata of a room: one target per decode session."""

    room: int
    targets: tuple[Target, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """One decode session a prefill rank writes a room's KV to.

    ``dst_port``: the session's control port from its metadata (SGLang's ``dst_port``), which
    picks the transfer worker; -1 when unknown (traces before format 3).
    """

    session: str
    decode_rank: int
    total_pages: int
    decode_prefix_len: int
    dst_port: int = -1


@dataclass(frozen=True, slots=True, kw_only=True)
class Prefetch:
    """The prefill scheduler formed a batch with this room: prefetch STAGING_REQs."""

    room: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SendKV:
    """The prefill scheduler sends KV ``[start_send_idx, end_idx)`` of a room (``send_kv_chunk``).

    Token indices are absolute in the request; non-last ends are floored to the page and to the
    staging grid anchored at the decode prefix.
    """

    room: int
    end_idx: int
    last: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerPoll:
    """Transfer worker ``worker`` may pop its queue (woken, or its deferral wait ended)."""

    worker: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferDone:
    """The staged WRITE posted by ``worker`` ended.

    ``settled``: False when the backend cannot prove the write stopped (a handle still running
    after a failure, a rejected post); SGLang then poisons the room's abort acknowledgement.
    """

    worker: int
    ok: bool = True
    error: str = ""
    settled: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerPolled:
    """Decode rank ``peer`` of the room's group shared its poll state ``poll`` of ``room``."""

    room: int
    peer: str
    poll: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SendFailed:
    """The driver could not send ``msg`` (socket error)."""

    dst: str
    msg: Message


# ---------------------------------------------------------------------------------------------
# Effects
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Send:
    """Send ``msg`` to node ``dst``."""

    dst: str
    msg: Message


@dataclass(frozen=True, slots=True, kw_only=True)
class SendMetadata:
    """Decode tells the room's prefill ranks where to write (bootstrap metadata).

    ``register_at``: with ``late-decode-registration`` the time at which the driver feeds a
    ``DecodeRoomRegister`` (the pre-fix registration point); None when already registered.
    """

    room: int
    prefill_ranks: tuple[str, ...]
    session: str
    decode_rank: int
    decode_prefix_len: int
    total_pages: int
    register_at: float | None = None
    dst_port: int = -1


@dataclass(frozen=True, slots=True, kw_only=True)
class AbortNotice:
    """Tell the other side that a room failed here (traces before format 3; the decode rank
    now sends SGLang's ``ABORT`` frame instead)."""

    room: int
    dsts: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Allocated:
    room: int
    chunk_idx: int
    alloc_id: int
    offset: int
    round: int
    size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Freed:
    alloc_id: int
    room: int
    chunk_idx: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class WatermarkMoved:
    """The ring's watermark moved; ``lag_bytes`` is how far it trails the allocation head."""

    round: int
    tail: int
    lag_bytes: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class StartScatter:
    """Scatter a staging region (all writers) into KV pages ``[page_start, +num_pages)``.

    ``writer_bytes`` is each writer's block of the region, in order; ``prefill_attn_tp`` the
    prefill attention TP the room was bootstrapped with (it decides the head slices).
    """

    room: int
    chunk_idx: int
    alloc_id: int
    offset: int
    nbytes: int
    page_start: int
    num_pages: int
    blind: bool = False
    prefill_attn_tp: int = 0
    writer_bytes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class StartTransfer:
    """Gather this rank's head slice of pages ``[page_start, +num_pages)`` and WRITE it.

    The bytes land at ``dst_offset`` of ``session``'s ring (``region_offset`` plus this writer's
    block); ``region_end`` is the allocation's end from STAGING_RSP; ``decode_rank`` is the
    session's attention-TP rank (it decides the head slice to gather). ``staged`` is False for
    the per-slice fallback, which writes KV pages directly.
    """

    worker: int
    room: int
    chunk_idx: int
    session: str
    page_start: int
    num_pages: int
    region_offset: int
    region_end: int
    dst_offset: int
    nbytes: int
    writer: int
    round: int
    staged: bool = True
    is_last: bool = False
    decode_rank: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Deferred:
    """The chunk at the head of ``worker``'s queue is not ready and was re-enqueued.

    ``all_blocked``: every chunk in the queue deferred since the last allocation or watermark
    update, so polling again before one arrives cannot make progress. ``retry_at``: when the
    driver feeds this worker a ``WorkerPoll`` (the bounded condition-variable wait), None when
    all are blocked and only a ``WakeWorkers`` can help.
    """

    worker: int
    room: int
    chunk_idx: int
    session: str
    reason: str
    all_blocked: bool
    retry_at: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerIdle:
    worker: int


@dataclass(frozen=True, slots=True, kw_only=True)
class WakeWorkers:
    """Allocation or watermark news: feed each of ``workers`` a ``WorkerPoll`` at ``at``.

    A poll scheduled for a worker replaces any earlier one not yet fed (one wait per worker).
    """

    workers: tuple[int, ...]
    at: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetsKnown:
    """Prefill learned a room's decode sessions: ``sessions`` so far (one per metadata)."""

    room: int
    sessions: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkQueued:
    worker: int
    room: int
    chunk_idx: int
    page_start: int
    num_pages: int
    is_last: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkSkipped:
    room: int
    page_start: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RoomConcluded:
    """A room ended on this rank: ``status`` is ``"Success"`` or ``"Failed"``."""

    room: int
    status: str
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class RoomTornDown:
    room: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Dropped:
    """An input was ignored, with why (a warning in SGLang's logs)."""

    what: str
    room: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SetTimer:
    """Feed this rank a ``Tick`` at time ``at``: a timeout may fire then."""

    at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupPoll:
    """Share this decode rank's poll state of ``room`` with ``peers`` (the MIN all-reduce).

    ``poll``: ``"Success"`` (every byte landed here), ``"Failed"``, or ``"ReleaseReady"`` (a
    held failed room may be released here: every prefill rank acknowledged, or the deadline).
    """

    room: int
    poll: str
    peers: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class RoomHeld:
    """A failed room keeps its staging until ``required_acks`` prefill ranks acknowledged the
    abort of ``generation`` or ``release_at`` comes (deferred decode KV release)."""

    room: int
    generation: int
    required_acks: int
    release_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RoomReleased:
    """A held failed room was released: ``drained`` when every prefill rank acknowledged."""

    room: int
    drained: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class RankCrashed:
    """The rank raised out of its scheduler loop; it handles nothing from now on."""

    reason: str


INPUT_TYPES = (
    MessageArrived, DecodeRoomInit, DecodeRoomRegister, ScatterDone, Tick, RoomAborted,
    RoomBootstrapped, Prefetch, SendKV, WorkerPoll, TransferDone, SendFailed, PeerPolled,
)
EFFECT_TYPES = (
    Send, SendMetadata, AbortNotice, Allocated, Freed, WatermarkMoved, StartScatter,
    StartTransfer, Deferred, WorkerIdle, WakeWorkers, TargetsKnown, ChunkQueued, ChunkSkipped,
    RoomConcluded, RoomTornDown, Dropped, SetTimer, RankCrashed, GroupPoll, RoomHeld,
    RoomReleased,
)
EVENT_TYPES: dict[str, type] = {c.__name__: c for c in (*INPUT_TYPES, *EFFECT_TYPES, Target)}
Input = (
    MessageArrived | DecodeRoomInit | DecodeRoomRegister | ScatterDone | Tick | RoomAborted
    | RoomBootstrapped | Prefetch | SendKV | WorkerPoll | TransferDone | SendFailed | PeerPolled
)
Effect = (
    Send | SendMetadata | AbortNotice | Allocated | Freed | WatermarkMoved | StartScatter
    | StartTransfer | Deferred | WorkerIdle | WakeWorkers | TargetsKnown | ChunkQueued
    | ChunkSkipped | RoomConcluded | RoomTornDown | Dropped | SetTimer | RankCrashed | GroupPoll
    | RoomHeld | RoomReleased
)

speed_up_module(globals())  # cheaper construction; the classes stay frozen dataclasses
