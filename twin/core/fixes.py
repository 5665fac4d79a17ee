"""Named switches that turn on proposed changes SGLang has not merged: the opposite of defects.

Every fix is off by default (the protocol as sglang 0.5.23 runs it). ``Fixes`` is an immutable
set of names; the core asks ``fixes.on(NAME)`` at the exact place where the change differs, so
its effect can be measured in every driver before anyone merges it. A run's fixes live in its
config (``TwinConfig.fixes``), so traces, hardware ranks and replays carry them.
``docs/defects.md`` describes each fix and how to add one.
"""

from __future__ import annotations

from dataclasses import dataclass

from twin.core.switches import SwitchSet

MULTI_TARGET_RETRY_RESUME = "multi-target-retry-resume"
LOST_CONTROL_RECOVERY = "lost-control-recovery"
DROP_LATE_STAGING_REQ = "drop-late-staging-req"
STALE_WATERMARK_SUBSCRIBERS = "stale-watermark-subscribers"
COUNT_ERRORED_TRANSFERS = "count-errored-transfers"
KEEP_ERRORED_OUTSTANDING = "keep-errored-outstanding"
BOUND_STAGING_REQ_CHUNK = "bound-staging-req-chunk"
SUCCESS_AFTER_OUTSTANDING = "success-after-outstanding"
ANSWER_REQUESTER_ONLY = "answer-requester-only"


@dataclass(frozen=True, slots=True)
class FixInfo:
    """What a fix changes and where it comes from."""

    name: str
    side: str
    summary: str
    source: str


CATALOG: dict[str, FixInfo] = {
    f.name: f
    for f in (
        FixInfo(
            MULTI_TARGET_RETRY_RESUME, "prefill worker",
            "a chunk for several decode sessions writes every session that is ready and retries "
            "only the sessions not yet written: no retry rewrites a region decode already "
            "scattered and reused, and a session that is not ready no longer blocks the others "
            "(which can deadlock when two prefill senders' allocations are ordered differently "
            "on two decode rings)",
            "sglang PR #38100 (issue #38099), also the twin's finding (docs/defects.md, "
            "'Multi-target retry rewrites a reallocated region'); not merged in 0.5.23",
        ),
        FixInfo(
            LOST_CONTROL_RECOVERY, "both",
            "prefill re-sends the STAGING_REQ of a chunk still deferred control_retry_s after "
            "its last request (a lost STAGING_RSP or WATERMARK); decode answers a repeated "
            "request with the allocation and re-broadcasts its current watermark",
            "sglang PR #29978 (not merged in 0.5.23)",
        ),
        FixInfo(
            DROP_LATE_STAGING_REQ, "decode",
            "decode remembers which chunks of a room it has scattered and drops a STAGING_REQ "
            "for one of them instead of allocating it again. STAGING_REQ travels on the "
            "prefill's prefetch socket, so with several writers per decode rank one writer's "
            "request can arrive after the other writers' CHUNK_READY completed the chunk; the "
            "fresh allocation is never scattered, pins the watermark (stalling every room "
            "behind it on the ring) and fails the room at the waiting timeout",
            "the twin's finding (docs/defects.md, 'A STAGING_REQ after its chunk was scattered "
            "leaks until the completion timeout'), first seen on real transfers between two "
            "network namespaces",
        ),
        FixInfo(
            STALE_WATERMARK_SUBSCRIBERS, "decode scheduler (simulator)",
            "WATERMARK broadcasts leave off the decode scheduler thread (the twin: one sender "
            "per subscriber), and a dead prefill server's subscribers are dropped once decode's "
            "heartbeat gives up on it (5 s x 2 failures; one dead rank of a server that still "
            "answers is never detected). Without it every free sends WATERMARK to every "
            "subscriber ever registered from the scheduler thread: once a dead prefill's "
            "socket holds its high-water mark (1000 frames) each such send blocks the "
            "scheduler for SGLANG_DISAGGREGATION_ZMQ_SEND_TIMEOUT (1 s), stalling decode for "
            "every healthy prefill group too",
            "sglang PR #36049 (not merged in 0.5.23; issue #34737)",
        ),
        FixInfo(
            COUNT_ERRORED_TRANSFERS, "prefill worker",
            "an errored WRITE whose handles did not settle stays counted in the room's "
            "outstanding chunks instead of poisoning the room: the ABORT_ACK waits for the "
            "count, not forever. Upstream's design after 0.5.23 as PR #36707 describes it "
            "(commit 30a50a2); on its own it opens the incident #36707 fixes: a later chunk of "
            "the Failed room is skipped with the whole count dropped, and ABORT_ACK goes out "
            "while the errored write may still land in decode's released pages",
            "upstream after 0.5.23 (commit 30a50a2, per sglang PR #36707's description); "
            "NIXL's path (Mooncake poisons the room on any failed write)",
        ),
        FixInfo(
            KEEP_ERRORED_OUTSTANDING, "prefill worker",
            "skipping a chunk of a Failed room uncounts only that chunk (it was counted at "
            "dequeue) instead of dropping the room's whole outstanding count, so a count kept "
            "for an unresolved errored transfer survives and ABORT_ACK waits for it",
            "sglang PR #36707 (not merged in 0.5.23)",
        ),
        FixInfo(
            BOUND_STAGING_REQ_CHUNK, "decode",
            "decode drops a STAGING_REQ whose chunk_idx is negative or at or past the room's "
            "recorded page count, or whose chunk_pages is not positive, instead of allocating "
            "ring space for it and padding its per-room chunk_staging_infos list up to that "
            "index (issue #39764: one malformed chunk_idx grows decode's memory without bound)",
            "sglang PR #39792 for issue #39764 (not merged in 0.5.23)",
        ),
        FixInfo(
            SUCCESS_AFTER_OUTSTANDING, "prefill worker",
            "the room's last chunk concludes Success only once no chunk of the room is still "
            "outstanding (one re-enqueued because its allocation has not come); the chunk that "
            "finishes last concludes it. Without it a chunk whose STAGING_REQ was lost is "
            "re-enqueued behind the last one, the last concludes Success, and decode, whose "
            "completion gate counts only the allocations it made, completes the room with that "
            "chunk's pages never written",
            "the twin's finding (docs/defects.md, 'A lost STAGING_REQ completes a room with "
            "pages never written'); not in SGLang",
        ),
        FixInfo(
            ANSWER_REQUESTER_ONLY, "both",
            "refines lost-control-recovery (without it this fix changes nothing): decode "
            "answers a repeated STAGING_REQ (its chunk already has an allocation) with the "
            "STAGING_RSP to the writer that sent it only and re-sends its current watermark "
            "to that subscriber only, instead of to every prefill rank of the room; a writer "
            "whose chunk stays deferred backs off its re-requests, doubling the interval from "
            "control_retry_s up to a tenth of the waiting timeout, and starts over at "
            "control_retry_s once the chunk gets its allocation or its write is posted. "
            "Without it a long-deferred chunk costs writers x (writers + subscribers) frames "
            "every control_retry_s",
            "the twin's finding (docs/defects.md, 'lost-control-recovery answers every "
            "re-request to every writer'); not in SGLang",
        ),
    )
}

ALL_FIXES: tuple[str, ...] = tuple(CATALOG)


class Fixes(SwitchSet):
    """An immutable set of switched-on fixs; unknown names are rejected."""

    __slots__ = ()
    KIND = "fix"
    KNOWN = CATALOG


NONE = Fixes()
