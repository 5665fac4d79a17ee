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
            "the twin's finding (docs/defects.md, 'Multi-target retry rewrites a reallocated "
            "region')",
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
    )
}

ALL_FIXES: tuple[str, ...] = tuple(CATALOG)


class Fixes(SwitchSet):
    """An immutable set of switched-on fixs; unknown names are rejected."""

    __slots__ = ()
    KIND = "fix"
    KNOWN = CATALOG


NONE = Fixes()
