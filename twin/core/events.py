"""Inputs the core consumes and effects it returns.

Drivers call ``rank.handle(event, now)`` with an *input* and carry out the returned *effects*.
Every class here is a frozen, keyword-only ``msgspec.Struct`` tagged with its name: cheap to
build, hashable, and its own schema. The trace codec (``twin.trace.codec``) writes one as
``{"type": ClassName, **fields}`` and reads it back strictly, with nothing else listing its
fields: adding a field here is all a new field needs (plus a ``twin.trace.compat`` entry
when older traces lack it and it has no default). ``EVENT_TYPES`` maps names to classes.
"""

from __future__ import annotations

import msgspec

from twin.core.wire import Message


class Event(msgspec.Struct, frozen=True, kw_only=True, gc=False, forbid_unknown_fields=True,
            tag_field="type", tag=True):
    """Base of every input, effect and nested event object: a frozen, keyword-only msgspec
    Struct whose tag (``"type"``) is its class name; its typed fields are the trace schema."""


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------
class MessageArrived(Event, frozen=True):
    """A control frame from ``src`` was delivered (already decoded)."""

    src: str
    msg: Message


class DecodeRoomInit(Event, frozen=True):
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


class DecodeRoomRegister(Event, frozen=True):
    """The late registration point (``extend``); only used with ``late-decode-registration``."""

    room: int


class ScatterDone(Event, frozen=True):
    """The scatter of ``alloc_id`` (room, chunk) finished on the decode device."""

    room: int
    chunk_idx: int
    alloc_id: int


class Tick(Event, frozen=True):
    """Time advanced; check timeouts."""


class RoomAborted(Event, frozen=True):
    """The request was aborted (client, router, or the other side failed it)."""

    room: int
    reason: str = "aborted"


class RoomBootstrapped(Event, frozen=True):
    """Prefill received the decode metadata of a room: one target per decode session."""

    room: int
    targets: tuple[Target, ...]


class Target(Event, frozen=True):
    """One decode session a prefill rank writes a room's KV to.

    ``dst_port``: the session's control port from its metadata (SGLang's ``dst_port``), which
    picks the transfer worker; -1 when unknown (traces before format 3).
    """

    session: str
    decode_rank: int
    total_pages: int
    decode_prefix_len: int
    dst_port: int = -1


class Prefetch(Event, frozen=True):
    """The prefill scheduler formed a batch with this room: prefetch STAGING_REQs."""

    room: int


class SendKV(Event, frozen=True):
    """The prefill scheduler sends KV ``[start_send_idx, end_idx)`` of a room (``send_kv_chunk``).

    Token indices are absolute in the request; non-last ends are floored to the page and to the
    staging grid anchored at the decode prefix.
    """

    room: int
    end_idx: int
    last: bool


class WorkerPoll(Event, frozen=True):
    """Transfer worker ``worker`` may pop its queue (woken, or its deferral wait ended)."""

    worker: int


class PollsDue(Event, frozen=True):
    """The driver's clock reached ``now`` with nothing to feed: a prefill rank with coalesced
    polls (``TwinConfig.worker_polls``) accounts the deferral polls due before it. A
    simulation feeds it once per prefill rank where it stops (``--until``, a wedge)."""


class TransferDone(Event, frozen=True):
    """The staged WRITE posted by ``worker`` ended.

    ``settled``: False when the backend cannot prove the write stopped (a handle still running
    after a failure, a rejected post); SGLang then poisons the room's abort acknowledgement.
    """

    worker: int
    ok: bool = True
    error: str = ""
    settled: bool = True


class PeerPolled(Event, frozen=True):
    """Decode rank ``peer`` of the room's group shared its poll state ``poll`` of ``room``."""

    room: int
    peer: str
    poll: str


class SendFailed(Event, frozen=True):
    """The driver could not send ``msg`` (socket error)."""

    dst: str
    msg: Message


# ---------------------------------------------------------------------------------------------
# Effects
# ---------------------------------------------------------------------------------------------
class Send(Event, frozen=True):
    """Send ``msg`` to node ``dst``."""

    dst: str
    msg: Message


class SendMetadata(Event, frozen=True):
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


class AbortNotice(Event, frozen=True):
    """Tell the other side that a room failed here (traces before format 3; the decode rank
    now sends SGLang's ``ABORT`` frame instead)."""

    room: int
    dsts: tuple[str, ...]
    reason: str


class Allocated(Event, frozen=True):
    room: int
    chunk_idx: int
    alloc_id: int
    offset: int
    round: int
    size: int


class Freed(Event, frozen=True):
    alloc_id: int
    room: int
    chunk_idx: int
    reason: str


class WatermarkMoved(Event, frozen=True):
    """The ring's watermark moved; ``lag_bytes`` is how far it trails the allocation head."""

    round: int
    tail: int
    lag_bytes: int = 0


class StartScatter(Event, frozen=True):
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


class StartTransfer(Event, frozen=True):
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


class Deferred(Event, frozen=True):
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


class DeferralsCounted(Event, frozen=True):
    """Coalesced polls of ``worker`` that each deferred a chunk, counted instead of reported
    one ``Deferred`` each (a run that records no effects): ``counts[i]`` deferrals of room
    ``rooms[i]``."""

    worker: int
    rooms: tuple[int, ...]
    counts: tuple[int, ...]


class WorkerIdle(Event, frozen=True):
    worker: int


class WakeWorkers(Event, frozen=True):
    """Allocation or watermark news: feed each of ``workers`` a ``WorkerPoll`` at ``at``.

    A poll scheduled for a worker replaces any earlier one not yet fed (one wait per worker).
    """

    workers: tuple[int, ...]
    at: float = 0.0


class TargetsKnown(Event, frozen=True):
    """Prefill learned a room's decode sessions: ``sessions`` so far (one per metadata)."""

    room: int
    sessions: tuple[str, ...]


class ChunkQueued(Event, frozen=True):
    worker: int
    room: int
    chunk_idx: int
    page_start: int
    num_pages: int
    is_last: bool


class ChunkSkipped(Event, frozen=True):
    room: int
    page_start: int
    reason: str


class RoomConcluded(Event, frozen=True):
    """A room ended on this rank: ``status`` is ``"Success"`` or ``"Failed"``."""

    room: int
    status: str
    reason: str = ""


class RoomTornDown(Event, frozen=True):
    room: int


class Dropped(Event, frozen=True):
    """An input was ignored, with why (a warning in SGLang's logs)."""

    what: str
    room: int
    reason: str


class SetTimer(Event, frozen=True):
    """Feed this rank a ``Tick`` at time ``at``: a timeout may fire then."""

    at: float


class GroupPoll(Event, frozen=True):
    """Share this decode rank's poll state of ``room`` with ``peers`` (the MIN all-reduce).

    ``poll``: ``"Success"`` (every byte landed here), ``"Failed"``, or ``"ReleaseReady"`` (a
    held failed room may be released here: every prefill rank acknowledged, or the deadline).
    """

    room: int
    poll: str
    peers: tuple[str, ...]


class RoomHeld(Event, frozen=True):
    """A failed room keeps its staging until ``required_acks`` prefill ranks acknowledged the
    abort of ``generation`` or ``release_at`` comes (deferred decode KV release)."""

    room: int
    generation: int
    required_acks: int
    release_at: float


class RoomReleased(Event, frozen=True):
    """A held failed room was released: ``drained`` when every prefill rank acknowledged."""

    room: int
    drained: bool


class RankCrashed(Event, frozen=True):
    """The rank raised out of its scheduler loop; it handles nothing from now on."""

    reason: str


INPUT_TYPES = (
    MessageArrived, DecodeRoomInit, DecodeRoomRegister, ScatterDone, Tick, RoomAborted,
    RoomBootstrapped, Prefetch, SendKV, WorkerPoll, TransferDone, SendFailed, PeerPolled, PollsDue,
)
EFFECT_TYPES = (
    Send, SendMetadata, AbortNotice, Allocated, Freed, WatermarkMoved, StartScatter,
    StartTransfer, Deferred, DeferralsCounted, WorkerIdle, WakeWorkers, TargetsKnown, ChunkQueued,
    ChunkSkipped,
    RoomConcluded, RoomTornDown, Dropped, SetTimer, RankCrashed, GroupPoll, RoomHeld,
    RoomReleased,
)
EVENT_TYPES: dict[str, type] = {c.__name__: c for c in (*INPUT_TYPES, *EFFECT_TYPES, Target)}
Input = (
    MessageArrived | DecodeRoomInit | DecodeRoomRegister | ScatterDone | Tick | RoomAborted
    | RoomBootstrapped | Prefetch | SendKV | WorkerPoll | TransferDone | SendFailed | PeerPolled
    | PollsDue
)
Effect = (
    Send | SendMetadata | AbortNotice | Allocated | Freed | WatermarkMoved | StartScatter
    | StartTransfer | Deferred | DeferralsCounted | WorkerIdle | WakeWorkers | TargetsKnown
    | ChunkQueued
    | ChunkSkipped | RoomConcluded | RoomTornDown | Dropped | SetTimer | RankCrashed | GroupPoll
    | RoomHeld | RoomReleased
)

