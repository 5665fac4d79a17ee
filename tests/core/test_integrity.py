"""The symbolic integrity model: tagged staging bytes and landed KV pages."""

from __future__ import annotations

from twin.core import events as ev
from twin.core.integrity import IntegrityModel, Ring, RoomSet

RING = 1000


def write(room, page_start, offset, nbytes, writer=0, num_pages=1, region=None, staged=True):
    start, end = region if region is not None else (offset, offset + nbytes)
    return ev.StartTransfer(worker=0, room=room, chunk_idx=page_start, session="d0",
                            page_start=page_start, num_pages=num_pages, region_offset=start,
                            region_end=end, dst_offset=offset, nbytes=nbytes, writer=writer,
                            round=0, staged=staged)


def scatter(room, page_start, offset, nbytes, num_pages=1, blind=False):
    return ev.StartScatter(room=room, chunk_idx=page_start, alloc_id=0, offset=offset,
                           nbytes=nbytes, page_start=page_start, num_pages=num_pages, blind=blind)


def kinds(m):
    return [(v.kind, v.room) for v in m.violations]


# -- Ring ---------------------------------------------------------------------------------------
def test_ring_put_splits_overlapped_intervals():
    r = Ring()
    r.put(0, 100, (1, 0, 1, 0))
    r.put(40, 60, (2, 0, 1, 0))
    assert [(s.start, s.end, s.tag[0], s.live) for s in r.spans] == [
        (0, 40, 1, True), (40, 60, 2, True), (60, 100, 1, True)]


def test_ring_put_over_several_intervals_keeps_their_liveness():
    r = Ring()
    r.put(0, 50, (1, 0, 1, 0))
    r.put(50, 100, (2, 0, 1, 0))
    r.consume(0, 50)
    r.put(25, 75, (3, 0, 1, 0))
    assert [(s.start, s.end, s.tag[0], s.live) for s in r.spans] == [
        (0, 25, 1, False), (25, 75, 3, True), (75, 100, 2, True)]


def test_ring_put_dead_and_overlapping_query():
    r = Ring()
    r.put(10, 20, (1, 0, 1, 0), live=False)
    assert r.spans[0].live is False
    assert r.overlapping(0, 10) == [] and r.overlapping(19, 30) == [r.spans[0]]
    assert r.meeting(0, 10) == (0, 0) and r.meeting(20, 30) == (1, 1)


def test_ring_consume_and_retire():
    r = Ring()
    r.put(0, 10, (1, 0, 1, 0))
    r.put(10, 20, (2, 0, 1, 0))
    r.consume(0, 5)
    assert [s.live for s in r.spans] == [False, True]
    r.retire(2)
    assert [s.live for s in r.spans] == [False, False]


# -- IntegrityModel -----------------------------------------------------------------------------
def test_clean_write_scatter_complete():
    m = IntegrityModel(RING)
    m.on_transfer("d0", write(1, 0, 0, 100, writer=0, region=(0, 200)))
    m.on_transfer("d0", write(1, 0, 100, 100, writer=1, region=(0, 200)))
    m.on_scatter("d0", scatter(1, 0, 0, 200), [100, 100])
    m.on_concluded("d0", 1, "Success", total_pages=1)
    assert m.violations == []


def test_overwrite_of_unscattered_data():
    m = IntegrityModel(RING)
    m.on_transfer("d0", write(1, 0, 0, 100))
    m.on_transfer("d0", write(2, 0, 50, 100))
    assert kinds(m) == [("overwrite", 1)]


def test_write_after_scatter_is_no_overwrite():
    m = IntegrityModel(RING)
    m.on_transfer("d0", write(1, 0, 0, 100))
    m.on_scatter("d0", scatter(1, 0, 0, 100), [100])
    m.on_transfer("d0", write(2, 0, 0, 100))
    assert m.violations == []


def test_rewrite_of_same_chunk_is_no_overwrite():
    m = IntegrityModel(RING)
    m.on_transfer("d0", write(1, 0, 0, 100))
    m.on_transfer("d0", write(1, 0, 0, 100))
    assert m.violations == []


def test_repeat_write_of_scattered_chunk_is_garbage_but_may_clobber():
    m = IntegrityModel(RING)
    m.on_transfer("d0", write(1, 0, 0, 100))
    m.on_scatter("d0", scatter(1, 0, 0, 100), [100])
    m.on_transfer("d0", write(1, 0, 0, 100))  # a retry rewrites the region: nobody reads it
    m.on_transfer("d0", write(2, 0, 0, 100))
    assert m.violations == []
    m.on_transfer("d0", write(1, 0, 0, 100))  # ... but landing on room 2's data is corruption
    assert kinds(m) == [("overwrite", 2)]


def test_data_of_an_ended_room_is_dead():
    m = IntegrityModel(RING)
    m.on_transfer("d0", write(1, 0, 0, 100))
    m.on_concluded("d0", 1, "Failed", total_pages=1)
    m.on_transfer("d0", write(2, 0, 0, 100))
    m.on_transfer("d0", write(1, 0, 0, 100, num_pages=1))  # late write of the ended room
    assert kinds(m) == [("overwrite", 2)]


def test_overrun_and_past_ring_end():
    m = IntegrityModel(RING)
    m.on_transfer("d0", write(1, 0, 950, 100, region=(950, 1000)))
    assert sorted(kinds(m)) == [("overrun", 1), ("overwrite", 1)]


def test_misplaced_scatter_reads_other_room():
    m = IntegrityModel(RING)
    m.on_transfer("d0", write(2, 0, 0, 100))
    m.on_scatter("d0", scatter(1, 0, 0, 100), [100])
    (v,) = m.violations
    assert (v.kind, v.room) == ("misplaced", 1) and "room 2" in v.detail


def test_misplaced_scatter_wrong_pages_or_never_written():
    m = IntegrityModel(RING)
    m.on_transfer("d0", write(1, 0, 0, 100))
    m.on_scatter("d0", scatter(1, 4, 0, 100), [100])  # right room, wrong page_start
    m.on_scatter("d0", scatter(3, 0, 500, 100, blind=True), [100])
    assert kinds(m) == [("misplaced", 1), ("misplaced", 3)]
    assert "never-written" in m.violations[1].detail and "blind" in m.violations[1].detail


def test_misplaced_when_writer_block_partly_missing():
    m = IntegrityModel(RING)
    m.on_transfer("d0", write(1, 0, 0, 100, writer=0))
    m.on_scatter("d0", scatter(1, 0, 0, 200), [100, 100])  # writer 1 never wrote
    assert kinds(m) == [("misplaced", 1)]


def test_incomplete_when_success_before_pages_landed():
    m = IntegrityModel(RING)
    m.on_transfer("d0", write(1, 0, 0, 100))
    m.on_scatter("d0", scatter(1, 0, 0, 100), [100])
    m.on_concluded("d0", 1, "Success", total_pages=2)
    (v,) = m.violations
    assert (v.kind, v.room) == ("incomplete", 1) and "page 1" in v.detail


def test_failed_room_is_not_incomplete():
    m = IntegrityModel(RING)
    m.on_concluded("d0", 1, "Failed", total_pages=4)
    assert m.violations == []


def test_misplaced_scatter_marks_pages_bad():
    m = IntegrityModel(RING)
    m.on_transfer("d0", write(2, 0, 0, 100))
    m.on_scatter("d0", scatter(1, 0, 0, 100), [100])
    m.on_concluded("d0", 1, "Success", total_pages=1)
    assert kinds(m) == [("misplaced", 1), ("incomplete", 1)]


def test_unstaged_slice_write_lands_pages_directly():
    m = IntegrityModel(RING)
    m.on_transfer("d0", write(1, 0, 0, 100, num_pages=2, staged=False))
    m.on_concluded("d0", 1, "Success", total_pages=2)
    assert m.violations == [] and not m.rings["d0"].spans


def test_violations_deduplicated_per_kind_room_node():
    m = IntegrityModel(RING)
    m.on_transfer("d0", write(1, 0, 0, 100))
    m.on_transfer("d0", write(2, 0, 0, 50))
    m.on_transfer("d0", write(3, 0, 50, 50))
    assert kinds(m) == [("overwrite", 1)]


def test_room_set_keeps_only_rooms_above_its_floor() -> None:
    rooms = RoomSet()
    for r in (1, 2, 0, 5, -3):
        rooms.add(r)
    assert rooms.floor == 3 and rooms.above == {5, -3}
    assert all(r in rooms for r in (0, 1, 2, 5, -3)) and 3 not in rooms and 4 not in rooms


def test_memory_stays_bounded_by_the_rooms_in_flight() -> None:
    """10,000 rooms written, scattered and ended in order leave no per-room state behind,
    and a late write of any of them is still dead data."""
    m = IntegrityModel(RING)
    for room in range(10_000):
        m.on_transfer("d0", write(room, 0, 0, 100))
        m.on_scatter("d0", scatter(room, 0, 0, 100), [100])
        m.on_concluded("d0", room, "Success", total_pages=1)
    d0 = m.nodes["d0"]
    assert not d0.pages and not d0.scattered
    assert d0.ended.floor == 10_000 and not d0.ended.above
    m.on_transfer("d0", write(10_000, 0, 0, 100))
    m.on_transfer("d0", write(17, 0, 0, 100))  # a late write of an ended room ...
    assert kinds(m) == [("overwrite", 10_000)]  # ... clobbers live data but is itself dead


def test_ring_put_inside_one_span_splits_it_in_three_and_stays_sorted_and_disjoint():
    r = Ring()
    r.put(0, 100, (1, 0, 1, 0))
    r.consume(0, 100)
    r.put(30, 50, (2, 0, 1, 0))
    r.put(10, 20, (3, 0, 1, 0))
    r.put(45, 200, (4, 0, 1, 0))
    assert [(s.start, s.end, s.tag[0], s.live) for s in r.spans] == [
        (0, 10, 1, False), (10, 20, 3, True), (20, 30, 1, False), (30, 45, 2, True),
        (45, 200, 4, True)]
    assert [s.tag[0] for s in r.overlapping(15, 31)] == [3, 1, 2]
    assert r.meeting(200, 300) == (5, 5) and r.meeting(-5, 0) == (0, 0)
