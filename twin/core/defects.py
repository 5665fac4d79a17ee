"""Named switches that restore upstream defects, one per bug fixed in SGLang.

Every switch is off by default (today's protocol). ``Defects`` is an immutable set of names;
the core asks ``defects.on(NAME)`` at the exact place where the pre-fix code behaved
differently. ``docs/defects.md`` describes each switch and how to add one.
"""

from __future__ import annotations

from dataclasses import dataclass

from twin.core.switches import SwitchSet

STALE_EMPTY_RING_WATERMARK = "stale-empty-ring-watermark"
NO_SUBSCRIBER_SNAPSHOT = "no-subscriber-snapshot"
LATE_DECODE_REGISTRATION = "late-decode-registration"
NO_RELEASE_ROOM = "no-release-room"
SWALLOWED_CHUNK_READY_ERROR = "swallowed-chunk-ready-error"
SILENT_SLICE_FALLBACK = "silent-slice-fallback"
NO_GRID_ALIGNMENT = "no-grid-alignment"
TEARDOWN_DROPS_DEFERRED = "teardown-drops-deferred"
RAISE_ON_UNALIGNED_PREFIX = "raise-on-unaligned-prefix"
COMPLETION_BEFORE_LAST_SCATTER = "completion-before-last-scatter"


@dataclass(frozen=True, slots=True)
class DefectInfo:
    """What a switch restores and where upstream fixed it."""

    name: str
    side: str
    summary: str
    fixed_in: str


CATALOG: dict[str, DefectInfo] = {
    d.name: d
    for d in (
        DefectInfo(
            STALE_EMPTY_RING_WATERMARK, "decode allocator",
            "emptying the ring leaves the watermark at (round, head) and keeps head; a "
            "wrapping allocation then waits forever on `end <= stale head`",
            "PR #37166, seed 002 (StagingAllocator.free resets an empty ring to (round+1, 0))",
        ),
        DefectInfo(
            NO_SUBSCRIBER_SNAPSHOT, "decode handler",
            "a new watermark subscriber is not sent the current watermark; its prefill "
            "session waits from (0, 0) for a broadcast only a future free sends",
            "PR #37166, seed 002 (register_wm_subscriber sends the current watermark)",
        ),
        DefectInfo(
            LATE_DECODE_REGISTRATION, "decode handler",
            "the room is registered after its metadata went to prefill; a STAGING_REQ that "
            "arrives in between is dropped and the chunk never gets an allocation",
            "seed 001 (register_decode_req moved to pop_preallocated)",
        ),
        DefectInfo(
            NO_RELEASE_ROOM, "decode handler",
            "unregistering a failed or aborted room does not free its unscattered "
            "allocations; they pin the watermark for every later request",
            "seed 001 (release_room in unregister_decode_req)",
        ),
        DefectInfo(
            SWALLOWED_CHUNK_READY_ERROR, "prefill worker",
            "a failed CHUNK_READY send is ignored; decode never scatters the chunk and the "
            "room sits until the completion timeout while its allocation pins the ring",
            "seed 001 (send errors propagate and fail the room)",
        ),
        DefectInfo(
            SILENT_SLICE_FALLBACK, "prefill worker",
            "a staged chunk that does not fit falls back to the per-slice path silently, "
            "leaking its decode allocation, which is never scattered nor freed",
            "seed 001 (_do_staging_transfer fails the room instead)",
        ),
        DefectInfo(
            NO_GRID_ALIGNMENT, "prefill sender",
            "sends are not floored to the grid nor split per slot; a prefill radix hit "
            "inflates the first send and skews every positional chunk index",
            "seeds 000/003 (send_kv_chunk floors to base + k*grid, compute_grid_segments)",
        ),
        DefectInfo(
            TEARDOWN_DROPS_DEFERRED, "prefill worker",
            "room state is torn down when the last chunk finishes even though an earlier "
            "deferred chunk is still queued; that chunk is then skipped",
            "seeds 000/003 (per-room outstanding count gates teardown)",
        ),
        DefectInfo(
            RAISE_ON_UNALIGNED_PREFIX, "decode handler",
            "an unaligned decode prefix raises instead of failing the room, killing the "
            "scheduler: every room on that rank stops",
            "seed 000 (register_decode_req fails only that room)",
        ),
        DefectInfo(
            COMPLETION_BEFORE_LAST_SCATTER, "decode handler",
            "the last chunk is scattered blind from the newest allocation on all-ranks "
            "Success instead of on its own CHUNK_READY; the room can complete before its "
            "data landed",
            "seeds 000/003 (arrival-driven scatter; done needs every allocation scattered)",
        ),
    )
}

ALL_DEFECTS: tuple[str, ...] = tuple(CATALOG)


class Defects(SwitchSet):
    """An immutable set of switched-on defects; unknown names are rejected."""

    __slots__ = ()
    KIND = "defect"
    KNOWN = CATALOG


NONE = Defects()
