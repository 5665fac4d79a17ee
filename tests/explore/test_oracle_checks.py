"""The oracles the explorer relies on, tested as a mutation run would test them.

Each test fails under a specific plausible mutant of the code it covers: the integrity model's
scatter check weakened to "any overlapping span has the right tag", a partly blocked deferral
losing its bounded re-poll, and the verdict rule ranking a wedge above corruption.
"""

from __future__ import annotations

from twin.core import events as ev
from twin.core import wire
from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.core.integrity import IntegrityModel
from twin.core.prefill import PrefillRank
from twin.runtime.outcome import EXIT_CORRUPTION, RunStatus, decide, exit_code

RING = 1000


def _write(room: int, page_start: int, offset: int, nbytes: int, writer: int = 0,
           region: tuple[int, int] | None = None) -> ev.StartTransfer:
    start, end = region if region is not None else (offset, offset + nbytes)
    return ev.StartTransfer(worker=0, room=room, chunk_idx=0, session="d0",
                            page_start=page_start, num_pages=1, region_offset=start,
                            region_end=end, dst_offset=offset, nbytes=nbytes, writer=writer,
                            round=0)


def _scatter(room: int, offset: int, nbytes: int) -> ev.StartScatter:
    return ev.StartScatter(room=room, chunk_idx=0, alloc_id=0, offset=offset, nbytes=nbytes,
                           page_start=0, num_pages=1)


def test_scatter_of_a_block_half_never_written_is_misplaced() -> None:
    """Writer 0's block is [0, 100) but only [0, 50) was written with its tag: the other half
    holds never-written bytes. The scatter must be flagged and the room must not conclude as
    a clean Success (kills the mutant "any overlapping span has the right tag")."""
    m = IntegrityModel(RING)
    m.on_transfer("d0", _write(1, 0, 0, 50, region=(0, 100)))
    m.on_scatter("d0", _scatter(1, 0, 100), [100])
    m.on_concluded("d0", 1, "Success", 1)
    assert [(v.kind, v.room) for v in m.violations] == [("misplaced", 1), ("incomplete", 1)]


def test_scatter_of_a_block_half_covered_by_another_writer_is_misplaced() -> None:
    """Writer 0's block [0, 100) holds writer 0's tag on [0, 50) and writer 1's on [50, 100):
    two spans, one with the right tag; the block is wrong."""
    m = IntegrityModel(RING)
    m.on_transfer("d0", _write(1, 0, 0, 50, writer=0, region=(0, 200)))
    m.on_transfer("d0", _write(1, 0, 50, 150, writer=1, region=(0, 200)))
    m.on_scatter("d0", _scatter(1, 0, 200), [100, 100])
    assert [(v.kind, v.room) for v in m.violations] == [("misplaced", 1)]


def test_scatter_of_fully_written_blocks_is_clean() -> None:
    """The control: each writer's block fully covered by its own tag passes."""
    m = IntegrityModel(RING)
    m.on_transfer("d0", _write(1, 0, 0, 100, writer=0, region=(0, 200)))
    m.on_transfer("d0", _write(1, 0, 100, 100, writer=1, region=(0, 200)))
    m.on_scatter("d0", _scatter(1, 0, 200), [100, 100])
    m.on_concluded("d0", 1, "Success", 1)
    assert m.violations == []


MODEL = ModelShape(num_layers=2, num_kv_heads=8, head_dim=4, dtype_bytes=2)
CFG = TwinConfig(prefill=ServerSide(tp_size=4), decode=ServerSide(tp_size=2), model=MODEL,
                 chunked_prefill_size=64, page_size=16, staging_pool_size_bytes=1 << 20,
                 deferral_wait_s=0.004)


def test_partly_blocked_deferral_repolls_after_the_bounded_wait() -> None:
    """Two chunks queued, the first has no allocation yet: it is re-enqueued behind the other,
    so the worker is not all blocked and re-polls ``deferral_wait_s`` after ``now``."""
    p = PrefillRank(CFG, "p0", 0, 0)
    targets = (ev.Target(session="d0", decode_rank=0, total_pages=8, decode_prefix_len=0),)
    p.handle(ev.RoomBootstrapped(room=1, targets=targets), 0.0)
    out = p.handle(ev.SendKV(room=1, end_idx=128, last=False), 0.5)
    (d,) = [e for e in out if isinstance(e, ev.Deferred)]
    assert (d.chunk_idx, d.reason, d.all_blocked) == (0, "allocation pending", False)
    assert d.retry_at == 0.5 + CFG.deferral_wait_s
    # Once every queued chunk deferred, only a wake-up can help: no timed re-poll.
    out = p.handle(ev.WorkerPoll(worker=0), d.retry_at)
    (d2,) = [e for e in out if isinstance(e, ev.Deferred)]
    assert (d2.chunk_idx, d2.all_blocked, d2.retry_at) == (1, True, None)
    # An allocation arriving wakes the worker.
    rsp = wire.StagingRsp(room=1, chunk_idx=0, offset=0, round=0, end=4096, session_id="d0")
    out = p.handle(ev.MessageArrived(src="d0", msg=rsp), 0.6)
    assert [e for e in out if isinstance(e, ev.WakeWorkers)]


def test_corruption_outranks_a_wedge() -> None:
    status = decide(corrupted=True, wedged=True, unfinished=3, failed=1)
    assert status is RunStatus.CORRUPTED
    assert exit_code(status) == EXIT_CORRUPTION == 4
    assert decide(corrupted=False, wedged=True, unfinished=3, failed=1) is RunStatus.WEDGED
