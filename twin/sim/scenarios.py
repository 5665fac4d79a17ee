"""Built-in scenarios: a clean default and one reproduction per upstream defect.

Each defect scenario names the defects that make it fail (``defects``) and what that failure
looks like (``symptom``: ``wedge`` or ``corruption``); with those switched off every request
ends with no wedge and no corruption. Where today's protocol fails a request by design (an
injected abort or send error, an unaligned prefix), ``fails_by_design`` names those rooms: with
the defects off the run ends ``failed`` with exactly those rooms failed, else ``completed``.
``twin scenarios --check`` runs them both ways.
A *finding* scenario shows a failure of today's protocol (every defect off) that the twin found;
it has no defect switch. When a proposed fix removes it (``fixes``, see ``twin/core/fixes.py``),
it is checked both ways: the symptom with the fix off, a clean run with it on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from twin.core.config import ServerSide, TwinConfig
from twin.core.defects import (
    COMPLETION_BEFORE_LAST_SCATTER,
    LATE_DECODE_REGISTRATION,
    NO_GRID_ALIGNMENT,
    NO_RELEASE_ROOM,
    NO_SUBSCRIBER_SNAPSHOT,
    RAISE_ON_UNALIGNED_PREFIX,
    SILENT_SLICE_FALLBACK,
    STALE_EMPTY_RING_WATERMARK,
    SWALLOWED_CHUNK_READY_ERROR,
    TEARDOWN_DROPS_DEFERRED,
)
from twin.core.fixes import (
    BOUND_STAGING_REQ_CHUNK,
    LOST_CONTROL_RECOVERY,
    MULTI_TARGET_RETRY_RESUME,
    SUCCESS_AFTER_OUTSTANDING,
)
from twin.models.catalog import DEMO_SHAPE
from twin.runtime.faults import FaultSpec, parse_fault
from twin.runtime.params import SimParams
from twin.workloads import Workload, fixed, poisson, shared_prefix

# A small GQA model keeps scenario runs fast: 8 KV heads, 4 layers, head_dim 64, bf16.
SMALL = DEMO_SHAPE
MiB = 1024 * 1024


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    config: TwinConfig
    workload: Callable[[], Workload]
    defects: tuple[str, ...] = ()
    base_defects: tuple[str, ...] = ()
    symptom: str = "clean"
    faults: tuple[str, ...] = ()
    params: SimParams = field(default_factory=SimParams)
    overrides: dict[int, dict[str, int]] = field(default_factory=dict)
    max_concurrency: int | None = None
    finding: bool = False
    fails_by_design: tuple[int, ...] = ()

    @property
    def clean_status(self) -> str:
        """The status of a run with the scenario's defects off."""
        return "failed" if self.fails_by_design else "completed"
    fixes: tuple[str, ...] = ()

    def fault_specs(self) -> list[FaultSpec]:
        return [parse_fault(f) for f in self.faults]


def _serial(n: int, input_len: int, gap_s: float, prefix: int = 0) -> Callable[[], Workload]:
    return lambda: fixed([(i * gap_s, input_len, 8, prefix) for i in range(n)], name="serial")


def _cfg(**kw: object) -> TwinConfig:
    base: dict[str, object] = dict(model=SMALL, chunked_prefill_size=256, page_size=16)
    base.update(kw)
    return TwinConfig(**base)  # type: ignore[arg-type]


TP4_TP2 = dict(prefill=ServerSide(tp_size=4), decode=ServerSide(tp_size=2))
QUIET = SimParams(prefill_radix_tokens=0, wedge_window_s=5.0)

SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario(
        "default", "prefill TP4 -> decode TP2, shared-prefix traffic (4 groups x 32 prompts, "
        "4K system prompt), 64 MiB ring: the protocol as it is today",
        _cfg(**TP4_TP2, chunked_prefill_size=2048, staging_pool_size_mb=64),
        lambda: shared_prefix(4, 32, 4096, 512, 64, rate_per_s=40.0, seed=7),
    ),
    Scenario(
        "warmup-stall", "seed 002: prefill TP4 DP4 with DP attention -> decode TP8, eleven "
        "serial warmup requests on a small ring; wedges partway with the stale allocator and "
        "no subscriber snapshot, still wedges with only the allocator fixed",
        _cfg(prefill=ServerSide(tp_size=4, dp_size=4, enable_dp_attention=True),
             decode=ServerSide(tp_size=8), staging_pool_size_mb=1),
        _serial(11, 640, 0.0),
        defects=(STALE_EMPTY_RING_WATERMARK, NO_SUBSCRIBER_SNAPSHOT), symptom="wedge",
        params=QUIET, max_concurrency=1,
    ),
    Scenario(
        "radix-grid", "seeds 000/003: prefill TP4 -> decode TP2, chunked_prefill_size 256, "
        "decode radix cache, a shared prefix spanning several grid slots; the pre-fix "
        "fixed-size prefill staging buffer lets inflated sends through",
        _cfg(**TP4_TP2, staging_pool_size_mb=16, prefill_staging_buffer_pages=4096),
        lambda: fixed([(i * 0.05, 2300, 8, 640) for i in range(8)], name="radix"),
        defects=(NO_GRID_ALIGNMENT,), symptom="corruption",
        params=SimParams(decode_radix_tokens=512, wedge_window_s=5.0),
    ),
    Scenario(
        "stale-empty-ring", "the 100-byte-ring wedge at scale: serial requests of 60% then 70% "
        "of the ring; the wrapping allocation waits on a stale watermark",
        _cfg(**TP4_TP2, chunked_prefill_size=2048, staging_pool_size_mb=10),
        lambda: fixed([(0.0, 1536, 8, 0), (0.5, 1792, 8, 0), (1.0, 512, 8, 0)], name="60-70"),
        defects=(STALE_EMPTY_RING_WATERMARK,), symptom="wedge", params=QUIET,
    ),
    Scenario(
        "subscriber-snapshot", "prefill DP attention (2 groups) -> decode TP2: after the ring "
        "empties, a new prefill session waits from (0, 0) for a broadcast that never comes",
        _cfg(prefill=ServerSide(tp_size=2, dp_size=2, enable_dp_attention=True),
             decode=ServerSide(tp_size=2), staging_pool_size_mb=8),
        _serial(4, 1024, 0.0),
        defects=(NO_SUBSCRIBER_SNAPSHOT,), symptom="wedge", params=QUIET, max_concurrency=1,
    ),
    Scenario(
        "late-registration", "decode registers the room 5 ms after its metadata went out; the "
        "prefetched STAGING_REQ lands in that window and is dropped",
        _cfg(**TP4_TP2, staging_pool_size_mb=8), _serial(3, 1024, 0.5),
        defects=(LATE_DECODE_REGISTRATION,), symptom="wedge", params=QUIET,
    ),
    Scenario(
        "release-room", "a long request is aborted while its prefetched allocations are "
        "unscattered; without release_room they pin the watermark and later requests wedge",
        _cfg(**TP4_TP2, staging_pool_size_bytes=24 * 256 * 1024),
        lambda: fixed([(0.0, 16 * 1024, 8, 0)] + [(0.2 + 0.2 * i, 2048, 8, 0)
                                                   for i in range(8)], name="abort-long"),
        defects=(NO_RELEASE_ROOM,), symptom="wedge", faults=("abort:room=0:at=0.03",),
        params=QUIET, fails_by_design=(0,),
    ),
    Scenario(
        "chunk-ready-error", "the first CHUNK_READY send fails; swallowed, decode never "
        "scatters that chunk and its allocation pins the ring until the room times out",
        _cfg(**TP4_TP2, staging_pool_size_bytes=12 * 256 * 1024),
        _serial(8, 1024, 0.2), defects=(SWALLOWED_CHUNK_READY_ERROR,), symptom="wedge",
        faults=("fail-send:CHUNK_READY:nth=1",), params=QUIET, fails_by_design=(0,),
    ),
    Scenario(
        "slice-fallback", "a prefill radix hit inflates the first send past the chunk-sized "
        "prefill staging buffer (grid alignment off); the silent slice fallback leaks the "
        "decode allocation, which pins the ring",
        _cfg(**TP4_TP2, staging_pool_size_bytes=12 * 256 * 1024),
        lambda: fixed([(0.0, 1024, 8, 0), (0.3, 1536, 8, 0)] + [(0.6 + 0.2 * i, 1024, 8, 0)
                                                              for i in range(8)], name="fallback"),
        defects=(SILENT_SLICE_FALLBACK,), base_defects=(NO_GRID_ALIGNMENT,), symptom="wedge",
        params=QUIET, overrides={1: {"prefill_prefix_len": 1024}}, fails_by_design=(1,),
    ),
    Scenario(
        "teardown-deferred", "the STAGING_RSP of a room's first chunk is overtaken by the later "
        "ones, so that chunk is deferred behind the last one; tearing the room down on the last "
        "chunk drops it",
        _cfg(**TP4_TP2, staging_pool_size_mb=8), _serial(3, 512, 0.5),
        defects=(TEARDOWN_DROPS_DEFERRED,), symptom="wedge",
        faults=("reorder:STAGING_RSP:room=1:chunk=0:ms=50",), params=QUIET,
    ),
    Scenario(
        "unaligned-prefix", "one request arrives with a decode prefix that is not page-aligned; "
        "raising kills the scheduler and every later room on that rank stalls",
        _cfg(**TP4_TP2, staging_pool_size_mb=8), _serial(4, 1024, 0.3),
        defects=(RAISE_ON_UNALIGNED_PREFIX,), symptom="wedge", params=QUIET,
        overrides={1: {"decode_prefix_len": 100}}, fails_by_design=(1,),
    ),
    Scenario(
        "completion-race", "an overtaken STAGING_RSP defers a room's first chunk behind its last; "
        "all-ranks Success arrives first and the blind last scatter completes the room before "
        "the first chunk landed",
        _cfg(**TP4_TP2, staging_pool_size_mb=8), _serial(3, 512, 0.5),
        defects=(COMPLETION_BEFORE_LAST_SCATTER,), symptom="corruption",
        faults=("reorder:STAGING_RSP:room=1:chunk=0:ms=50",), params=QUIET,
    ),
    Scenario(
        "multi-target-retry", "finding in today's protocol: prefill DP attention (2 sessions of "
        "attention TP1) -> decode TP2, so each chunk goes to two decode ranks; d0g0r1's "
        "watermarks run 20 ms late. A chunk written to d0g0r0 but deferred on d0g0r1 is "
        "re-enqueued whole, and its retry rewrites d0g0r0's region after that region was "
        "scattered, freed and given to the next room",
        _cfg(prefill=ServerSide(tp_size=2, dp_size=2, enable_dp_attention=True),
             decode=ServerSide(tp_size=2), staging_pool_size_bytes=2 * MiB),
        lambda: poisson(60, 40, (800, 400), 8, seed=1),
        symptom="corruption", faults=("delay:WATERMARK:src=d0g0r1:ms=20",), params=QUIET,
        finding=True, fixes=(MULTI_TARGET_RETRY_RESUME,),
    ),
    Scenario(
        "lost-staging-rsp", "today's protocol has no recovery for a lost control frame: prefill "
        "TP4 -> decode TP2, serial requests; both STAGING_RSPs that would tell p0g0r0 where "
        "room 1's chunk goes are lost, so the chunk waits for its allocation forever and the "
        "room stalls until decode's waiting timeout. Fixed by lost-control-recovery (sglang "
        "PR #29978: prefill re-requests the STAGING_RSP)",
        _cfg(**TP4_TP2, staging_pool_size_mb=8), _serial(4, 1024, 0.2), symptom="wedge",
        faults=("drop:STAGING_RSP:dst=p0g0r0:room=1:chunk=0:nth=1",
                "drop:STAGING_RSP:dst=p0g0r0:room=1:chunk=0:nth=2"),
        params=QUIET, finding=True, fixes=(LOST_CONTROL_RECOVERY,),
    ),
    Scenario(
        "lost-watermark", "a lost WATERMARK: prefill TP4 -> decode TP2 on a one-chunk ring, "
        "serial one-chunk requests; the watermark that d0g0r0 broadcasts when room 0 frees the "
        "ring never reaches p0g0r0, whose write of room 1 then waits forever. Fixed by "
        "lost-control-recovery (decode re-broadcasts its watermark to a repeated request)",
        _cfg(**TP4_TP2, staging_pool_size_bytes=MiB), _serial(3, 256, 0.2), symptom="wedge",
        faults=("drop:WATERMARK:src=d0g0r0:dst=p0g0r0:nth=2",),
        params=QUIET, finding=True, fixes=(LOST_CONTROL_RECOVERY,),
    ),
    Scenario(
        "malformed-chunk-idx", "a malformed STAGING_REQ (issue #39764): prefill TP4 -> decode "
        "TP2, serial one-chunk requests; p0g0r0's first STAGING_REQ leaves with chunk_idx "
        "100000. Decode allocates ring space for that chunk, which nothing will scatter, and "
        "pads the room's chunk list to 100001 entries (peak_chunk_infos); the room waits for "
        "the phantom chunk until the completion timeout. Fixed by bound-staging-req-chunk "
        "(PR #39792: decode drops an out-of-range chunk_idx)",
        _cfg(**TP4_TP2), _serial(3, 256, 0.2), symptom="wedge",
        faults=("corrupt:STAGING_REQ:src=p0g0r0:nth=1:field=chunk_idx:value=100000",),
        params=QUIET, finding=True, fixes=(BOUND_STAGING_REQ_CHUNK,),
    ),
    Scenario(
        "lost-staging-req", "a lost STAGING_REQ completes a room with pages never written: "
        "prefill TP1 -> decode TP2, serial requests of two chunks (16 + 1 pages); the request "
        "for room 0's first chunk to d0g0r1 is lost. That chunk is re-enqueued behind the last, "
        "the last concludes Success, and d0g0r1, whose completion gate counts only the "
        "allocations it made, completes the room with 16 of 17 pages never written. Fixed by "
        "success-after-outstanding (the room concludes once no chunk is outstanding) with "
        "lost-control-recovery (the lost request is sent again)",
        _cfg(prefill=ServerSide(tp_size=1), decode=ServerSide(tp_size=2),
             staging_pool_size_mb=8), _serial(3, 272, 0.5), symptom="corruption",
        faults=("drop:STAGING_REQ:nth=3",), params=QUIET, finding=True,
        fixes=(SUCCESS_AFTER_OUTSTANDING, LOST_CONTROL_RECOVERY),
    ),
)}


def check_scenario(sc: Scenario) -> dict[str, object]:
    """Run ``sc`` with its defects on and off; ``ok`` when on shows the symptom and off ends
    as ``clean_status`` with exactly the ``fails_by_design`` rooms failed (for the clean
    default: both runs completed)."""
    from twin.core.defects import Defects
    from twin.sim.runner import run_sim

    results: dict[str, str] = {}
    failed: dict[str, tuple[int, ...]] = {}
    runs = (("on", sc.defects),) if sc.finding else (("on", sc.defects), ("off", ()))
    for label, extra in runs:
        r = run_sim(sc.config, sc.workload(), defects=Defects.of(sc.base_defects + extra),
                    faults=sc.fault_specs(), params=sc.params, request_overrides=sc.overrides,
                    max_concurrency=sc.max_concurrency)
        results[label] = r.status.value
        failed[label] = tuple(sorted(q.room for q in r.sim.metrics.done if q.status == "Failed"))
    want_on = {"clean": sc.clean_status, "wedge": "wedged",
               "corruption": "corrupted"}[sc.symptom]
    if sc.finding and sc.fixes:
        fixed = run_sim(sc.config.replace(fixes=sc.fixes), sc.workload(),
                        defects=Defects.of(sc.base_defects), faults=sc.fault_specs(),
                        params=sc.params, request_overrides=sc.overrides,
                        max_concurrency=sc.max_concurrency).status.value
        return {"on": results["on"], "off": f"{fixed} (fix {', '.join(sc.fixes)})",
                "ok": results["on"] == want_on and fixed == "completed"}
    if sc.finding:
        return {"on": results["on"], "off": "n/a (no switch)", "ok": results["on"] == want_on}
    ok = (results["on"] == want_on and results["off"] == sc.clean_status
          and failed["off"] == sc.fails_by_design)
    off = results["off"]
    if failed["off"]:
        rooms = "room" + "s" * (len(failed["off"]) > 1)
        off += f" ({rooms} {', '.join(map(str, failed['off']))} failed by design)"
    return {"on": results["on"], "off": off, "ok": ok}
