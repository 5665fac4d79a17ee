"""Decode-side staging ring allocator and the prefill-side readiness rule.

``StagingAllocator`` matches sglang 0.5.23 (overcommitting ring: ``assign`` always succeeds when
the request fits the buffer; overlap safety is the prefill's job, via the watermark).
"""

from __future__ import annotations

from collections import deque
from typing import ClassVar

from twin.core.defects import NONE, STALE_EMPTY_RING_WATERMARK, Defects

ALLOC_OVERSIZED = -2
Watermark = tuple[int, int]


class StagingAllocator:
    """Overcommitting ring of ``total_size_bytes``.

    ``assign(n)`` returns ``(alloc_id, offset, round)`` or ``None`` when ``n`` exceeds the ring.
    The watermark ``(round, tail)`` is the position of the oldest live allocation; everything
    before it is safe to overwrite.
    """

    ALLOC_OVERSIZED: ClassVar[int] = ALLOC_OVERSIZED

    def __init__(self, total_size_bytes: int, defects: Defects = NONE) -> None:
        if total_size_bytes <= 0:
            raise ValueError(f"total_size_bytes must be positive, got {total_size_bytes}")
        self.total_size = total_size_bytes
        self.defects = defects
        self.head = 0
        self.round = 0
        self.allocations: dict[int, tuple[int, int, int]] = {}  # id -> (offset, size, round)
        self.alloc_order: deque[int] = deque()
        self.next_alloc_id = 0
        self.watermark_round = 0
        self.watermark_tail = 0

    def assign(self, required_bytes: int) -> tuple[int, int, int] | None:
        if required_bytes > self.total_size:
            return None
        if required_bytes <= self.total_size - self.head:
            offset = self.head
            self.head += required_bytes
        else:
            self.round += 1
            offset = 0
            self.head = required_bytes
        alloc_id = self.next_alloc_id
        self.next_alloc_id += 1
        self.allocations[alloc_id] = (offset, required_bytes, self.round)
        self.alloc_order.append(alloc_id)
        return alloc_id, offset, self.round

    def free(self, alloc_id: int) -> None:
        """Free ``alloc_id`` (unknown ids are a no-op) and advance the watermark."""
        if alloc_id not in self.allocations:
            return
        del self.allocations[alloc_id]
        order = self.alloc_order
        while order and order[0] not in self.allocations:
            order.popleft()
        if not self.allocations:
            if self.defects.on(STALE_EMPTY_RING_WATERMARK):
                # Pre-fix: the watermark stops at the last allocation's end; round and head stay.
                self.watermark_round = self.round
                self.watermark_tail = self.head
            else:
                self.round += 1
                self.head = 0
                self.watermark_round = self.round
                self.watermark_tail = 0
        else:
            off, _, rnd = self.allocations[order[0]]
            self.watermark_round = rnd
            self.watermark_tail = off

    def get_watermark(self) -> Watermark:
        return (self.watermark_round, self.watermark_tail)

    def live(self) -> list[tuple[int, int, int, int]]:
        """Live allocations as ``(alloc_id, offset, size, round)`` in allocation order."""
        return [(a, *self.allocations[a]) for a in self.alloc_order if a in self.allocations]


def is_watermark_ready(watermark: Watermark, alloc_round: int, alloc_end: int) -> bool:
    """May a write to ``[.., alloc_end)`` of ``alloc_round`` proceed under ``watermark``?"""
    if alloc_round <= 0:
        return True
    prev_round = alloc_round - 1
    wm_round, wm_tail = watermark
    return prev_round < wm_round or (prev_round == wm_round and alloc_end <= wm_tail)
