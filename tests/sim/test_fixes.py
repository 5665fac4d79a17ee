"""``--fix NAME``: proposed changes SGLang has not merged, switched on from the command line.

A run's fixes travel in its config, so the trace header carries them and a replay rebuilds the
same cores.
"""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner, Result

from twin.cli import cli
from twin.core.config import ConfigError, TwinConfig
from twin.core.fixes import ALL_FIXES, DROP_LATE_STAGING_REQ, LOST_CONTROL_RECOVERY
from twin.core.wire import StagingReq
from twin.replay import replay_sim
from twin.runtime.outcome import EXIT_BAD_INPUT, EXIT_OK, EXIT_WEDGE
from twin.trace.format import read_trace


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_fix_names_are_validated_in_config_and_cli() -> None:
    assert TwinConfig(fixes=ALL_FIXES).fixes == ALL_FIXES
    try:
        TwinConfig(fixes=("no-such-fix",))
    except ConfigError as exc:
        assert "no-such-fix" in str(exc)
    else:
        raise AssertionError("an unknown fix was accepted")
    r = invoke("sim", "--fix", "no-such-fix")
    assert r.exit_code == EXIT_BAD_INPUT and "unknown fix" in r.output


def test_fix_removes_the_lost_watermark_wedge_and_replays(tmp_path: Path) -> None:
    r = invoke("sim", "--scenario", "lost-watermark", "--json")
    assert r.exit_code == EXIT_WEDGE, r.output
    out = tmp_path / "fixed.jsonl"
    r = invoke("sim", "--scenario", "lost-watermark", "--fix", LOST_CONTROL_RECOVERY,
               "--json", "--trace-out", str(out))
    assert r.exit_code == EXIT_OK, r.output
    trace = read_trace(out)
    assert trace.config.fixes == (LOST_CONTROL_RECOVERY,)
    result = replay_sim(trace)
    assert result.divergence is None and result.status == "completed"


LATE_REQ = "delay:STAGING_REQ:src=p0g0r1:room=0:chunk=0:ms=10"


def _arrival_order(trace_path: Path, src: str, dst: str) -> list[int]:
    """Chunk indices of room 0's STAGING_REQs from ``src`` in the order ``dst`` got them."""
    return [r.event.msg.chunk_idx for r in read_trace(trace_path).events
            if r.dir == "in" and r.node == dst and r.type == "MessageArrived"
            and r.event.src == src and isinstance(r.event.msg, StagingReq)
            and r.event.msg.room == 0]


def test_delay_holds_the_socket_and_reorder_lets_frames_overtake(tmp_path: Path) -> None:
    """``delay`` stalls the sending socket as one TCP stream would (later frames wait behind);
    ``reorder`` holds back one frame only."""
    held, overtaken = tmp_path / "delay.jsonl", tmp_path / "reorder.jsonl"
    invoke("sim", "--scenario", "radix-grid", "--fault", LATE_REQ, "--trace-out", str(held))
    invoke("sim", "--scenario", "radix-grid", "--trace-out", str(overtaken), "--fault",
           LATE_REQ.replace("delay", "reorder"))
    in_order = _arrival_order(held, "p0g0r1", "d0g0r0")
    assert len(in_order) > 2 and in_order == sorted(in_order)
    assert _arrival_order(overtaken, "p0g0r1", "d0g0r0")[-1] == 0


def test_late_staging_req_wedges_the_ring_and_the_fix_drops_it(tmp_path: Path) -> None:
    """One prefill writer's STAGING_REQs held 10 ms: the other writer's request got the
    allocation, both wrote and decode scattered, then the late request allocates the chunk again
    (as SGLang does); nothing scatters it, so it pins the watermark and the ring stalls."""
    r = invoke("sim", "--scenario", "radix-grid", "--fault", LATE_REQ)
    assert r.exit_code == EXIT_WEDGE, r.output
    assert "root: d0g0r0: room 0: a STAGING_REQ for chunks 0" in r.output
    assert "arrived after they were scattered" in r.output
    out = tmp_path / "fixed.jsonl"
    r = invoke("sim", "--scenario", "radix-grid", "--fault", LATE_REQ, "--fix",
               DROP_LATE_STAGING_REQ, "--trace-out", str(out))
    assert r.exit_code == EXIT_OK, r.output
    dropped = [rec for rec in read_trace(out).events if rec.type == "Dropped"
               and "already scattered" in rec.event.reason]
    assert dropped
    assert replay_sim(read_trace(out)).status == "completed"


def _malformed(value: int, *fixes: str) -> dict:
    """The ``malformed-chunk-idx`` scenario with its fault's value replaced (a later spec's
    rewrite of the same field on the same frame wins)."""
    import json

    args = ["sim", "--scenario", "malformed-chunk-idx", "--json", "--fault",
            f"corrupt:STAGING_REQ:src=p0g0r0:nth=1:field=chunk_idx:value={value}"]
    for f in fixes:
        args += ["--fix", f]
    r = invoke(*args)
    return json.loads(r.output)


def test_malformed_chunk_idx_grows_decode_memory_with_the_value_until_pr39792() -> None:
    """Issue #39764: decode pads a room's chunk_staging_infos up to a STAGING_REQ's chunk_idx,
    so its memory grows with the malformed value (peak_chunk_infos, per decode rank), and the
    phantom chunk's allocation holds the room. ``bound-staging-req-chunk`` (PR #39792) drops
    the frame: no growth, the run completes."""
    peaks = {}
    for value in (1_000, 100_000):
        d = _malformed(value)
        assert d["status"] == "wedged"
        peaks[value] = d["peak_chunk_infos"]["d0g0r0"]
        assert peaks[value] > value
        fixed = _malformed(value, "bound-staging-req-chunk")
        assert fixed["status"] == "completed"
        assert max(fixed["peak_chunk_infos"].values()) <= 2
    assert peaks[100_000] - peaks[1_000] == 99_000


def test_a_negative_chunk_idx_is_dropped_with_the_fix() -> None:
    assert _malformed(-5)["status"] == "wedged"
    assert _malformed(-5, "bound-staging-req-chunk")["status"] == "completed"


def test_a_negative_chunk_pages_corrupts_until_pr39792() -> None:
    """A STAGING_REQ with chunk_pages -1 makes decode assign a negative region (SGLang's
    ``StagingAllocator.assign`` moves its head back), so the real write overruns the next
    allocations; PR #39792 rejects a non-positive page count."""
    base = ["sim", "--prefill-args", "--tp-size 4", "--decode-args", "--tp-size 2",
            "--workload", "poisson:n=20,rate=20", "--fault",
            "corrupt:STAGING_REQ:src=p0g0r0:nth=1:field=chunk_pages:value=-1"]
    r = invoke(*base)
    assert r.exit_code == 4 and "overrun: d0g0r0 room 0" in r.output, r.output
    assert invoke(*base, "--fix", "bound-staging-req-chunk").exit_code == EXIT_OK
