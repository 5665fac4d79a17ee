"""Read-only views of a rank's state, for diagnosis, invariant checks and inspection.

``PrefillRank.snapshot()`` and ``DecodeRank.snapshot()`` copy what a reader may need into frozen
values; nothing outside ``twin/core`` reads a rank's own attributes. Snapshots are plain typed
data, so a hardware rank can ship one to its coordinator (``twin.hw.messages.RankState``,
MessagePack decoded against these classes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from twin.core.allocator import ALLOC_OVERSIZED
from twin.core.states import DecodeRoomState, PrefillRoomState


class StagingInfo(NamedTuple):
    """A chunk's region in a decode ring, as STAGING_RSP reported it."""

    offset: int
    round: int
    end: int

    @property
    def oversized(self) -> bool:
        """Decode could never fit the chunk (``ALLOC_OVERSIZED``)."""
        return self.offset == ALLOC_OVERSIZED

    @property
    def pending(self) -> bool:
        """No region yet (a negative offset other than oversized)."""
        return self.offset < 0 and not self.oversized


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkView:
    room: int
    chunk_idx: int
    page_start: int
    num_pages: int
    is_last: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerView:
    busy: ChunkView | None
    queue: tuple[ChunkView, ...]
    waiting: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetView:
    session: str
    decode_rank: int
    total_pages: int
    staging: dict[int, StagingInfo]


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillRoomView:
    room: int
    state: PrefillRoomState
    targets: tuple[TargetView, ...]
    outstanding: int
    start_send_idx: int
    sent_pages: int
    fail_reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillSnapshot:
    node: str
    now: float
    watermarks: dict[str, tuple[int, int]]
    workers: tuple[WorkerView, ...]
    rooms: dict[int, PrefillRoomView]


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocationView:
    alloc_id: int
    offset: int
    size: int
    round: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkAllocView:
    alloc_id: int
    offset: int
    round: int
    end: int
    chunk_pages: int
    late: bool = False  # allocated after the chunk had already been scattered


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeRoomView:
    room: int
    state: DecodeRoomState
    registered: bool
    prefill_ranks: tuple[str, ...]
    success_ranks: frozenset[str]
    chunks: dict[int, ChunkAllocView]
    arrivals: dict[int, int]
    scattering: dict[int, int]
    fail_reason: str
    group: tuple[str, ...] = ()
    peer_polls: dict[str, str] | None = None
    held: bool = False
    acks: frozenset[int] = frozenset()
    release_at: float = 0.0
    held_scattered: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeSnapshot:
    node: str
    now: float
    crashed: str | None
    ring_bytes: int
    head: int
    round: int
    watermark: tuple[int, int]
    live: tuple[AllocationView, ...]
    rooms: dict[int, DecodeRoomView]
    subscribers: dict[tuple[str, ...], str]
    # Why the rank's listener thread ended (it then handles no frame), or None.
    listener_dead: str | None = None


RankSnapshot = PrefillSnapshot | DecodeSnapshot
