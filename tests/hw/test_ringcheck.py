"""The byte check of written, unscattered ring regions (``twin.hw.ringcheck``), on its own:
regions gathered by the real kernels from pattern-filled prefill pools pass, an overwrite is
named with the bytes that lie there, and only written, unscattered, unconcluded regions are
checked."""

from __future__ import annotations

import itertools

import pytest
import torch

from twin.core import events as ev
from twin.core import wire
from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.core.topology import Topology
from twin.hw.kernels import gather_to_staging, scatter_from_staging
from twin.hw.kvpattern import TransferCase, run_transfer, writer_ranks
from twin.hw.ringcheck import RingCheck

PAGE = 16
HEADS = 8
HEAD_DIM = 8
LAYERS = 2


def _cfg(src_tp: int, dst_tp: int, heads: int = HEADS) -> TwinConfig:
    return TwinConfig(model=ModelShape(num_layers=LAYERS, num_kv_heads=heads, head_dim=HEAD_DIM),
                      prefill=ServerSide(tp_size=src_tp), decode=ServerSide(tp_size=dst_tp),
                      page_size=PAGE, staging_pool_size_bytes=1 << 20)


class _Rank:
    """A decode rank's ring and check, fed as the rank process feeds it."""

    def __init__(self, src_tp: int, dst_tp: int, dst_rank: int = 0, heads: int = HEADS) -> None:
        self.cfg = _cfg(src_tp, dst_tp, heads)
        self.heads = heads
        self.src_tp, self.dst_tp, self.dst_rank = src_tp, dst_tp, dst_rank
        self.ring = torch.zeros(1 << 20, dtype=torch.uint8)
        self.rooms: dict[int, dict[str, int]] = {}
        self.check = RingCheck(self.ring, self.cfg, dst_rank, Topology(self.cfg), self.rooms)
        self.next_alloc = 0

    def room(self, room: int, rid: int, tokens: int, prefix: int = 0) -> None:
        self.rooms[room] = {"rid": rid, "input_len": prefix + tokens, "decode_prefix_len": prefix}

    def write(self, room: int, chunk: int, pages: int, offset: int, page_start: int = 0,
              announce: bool = True) -> int:
        """Allocate ``pages`` at ``offset``, land every writer's bytes there (the kernels'
        gather of pattern-filled pools) and, with ``announce``, each writer's CHUNK_READY."""
        alloc = self.next_alloc
        self.next_alloc += 1
        region = self.region(room, pages, page_start)
        self.check.effects([ev.Allocated(room=room, chunk_idx=chunk, alloc_id=alloc,
                                         offset=offset, round=0, size=region.numel())])
        for r in writer_ranks(self.src_tp, self.dst_tp, self.dst_rank):
            self.tell(room, chunk, offset, f"p0g0r{r}")
        self.ring[offset:offset + region.numel()] = region
        if announce:
            for r in writer_ranks(self.src_tp, self.dst_tp, self.dst_rank):
                self.arrive(room, chunk, pages, page_start, r)
        return alloc

    def tell(self, room: int, chunk: int, offset: int, writer: str, rnd: int = 0) -> None:
        """The rank's STAGING_RSP to ``writer``: where it is to write the chunk."""
        self.check.effects([ev.Send(dst=writer, msg=wire.StagingRsp(
            room=room, chunk_idx=chunk, offset=offset, round=rnd, end=offset + 1,
            session_id=f"d0g0r{self.dst_rank}"))])

    def region(self, room: int, pages: int, page_start: int = 0) -> torch.Tensor:
        req = self.rooms[room]
        case = TransferCase(self.src_tp, self.dst_tp, self.heads, num_layers=LAYERS,
                            head_dim=HEAD_DIM, page_size=PAGE, chunk_pages=pages,
                            pool_pages=pages + 2, request=req["rid"],
                            token_offset=req["decode_prefix_len"] + page_start * PAGE)
        return run_transfer(case, gather_to_staging, scatter_from_staging).regions[self.dst_rank]

    def arrive(self, room: int, chunk: int, pages: int, page_start: int, writer: int) -> None:
        msg = wire.ChunkReady(room=room, chunk_idx=chunk, page_start=page_start,
                              num_pages=pages, writer_id=f"d0g0r{self.dst_rank}",
                              prefill_rank=writer)
        self.check.arrived(msg, f"p0g0r{writer}")


@pytest.mark.parametrize(("src_tp", "dst_tp", "heads"), [
    (a, b, h) for a, b, h in itertools.product([1, 2, 4, 8], [1, 2, 4], [8, 2]) if a != b])
def test_written_regions_gathered_by_the_kernels_pass(src_tp: int, dst_tp: int,
                                                      heads: int) -> None:
    """Every writer's block, as the real gather lays it out for heterogeneous TP (head
    slices, GQA replication), is what the check expects: no false alarm."""
    rank = _Rank(src_tp, dst_tp, dst_rank=dst_tp - 1, heads=heads)
    rank.room(3, rid=11, tokens=2 * PAGE + 5, prefix=PAGE)
    rank.write(3, 0, pages=3, offset=4096)
    assert rank.check.open_rooms() == {}
    assert rank.check.checked == len(writer_ranks(src_tp, dst_tp, dst_tp - 1))


def test_an_overwrite_of_an_unscattered_region_is_named_with_whose_bytes_lie_there() -> None:
    rank = _Rank(4, 2)
    rank.room(1, rid=1, tokens=2 * PAGE)
    rank.room(2, rid=2, tokens=PAGE)
    rank.write(1, 0, pages=2, offset=0)  # written, never scattered
    victim = rank.region(1, 2)
    # A write of room 2 lands at the same offset (an allocation the ring should not give).
    rank.write(2, 0, pages=1, offset=0)
    wrong = rank.check.open_rooms()
    assert list(wrong) == [1], wrong
    text = wrong[1]
    assert text.startswith("ring bytes [0, ") and "of room 1 chunk 0 (pages [0, 2), writer " \
        "p0g0r0), written and not scattered, were overwritten" in text, text
    assert "they hold the bytes of room 2 chunk 0 (pages [0, 1), writer p0g0r0) written at " \
        "ring offset 0" in text, text
    # The first wrong byte is where room 2's block (one page of one writer) differs.
    assert rank.ring[:victim.numel()].ne(victim).any()


def test_only_written_unscattered_regions_of_open_rooms_are_checked() -> None:
    rank = _Rank(2, 1)
    rank.room(0, rid=5, tokens=PAGE)
    # Allocated, bytes wrong, but no writer said it wrote (a WRITE still in flight): unchecked.
    rank.check.effects([ev.Allocated(room=0, chunk_idx=0, alloc_id=0, offset=0, round=0,
                                     size=16384)])
    rank.tell(0, 0, 0, "p0g0r1")
    rank.ring[:16384] = 7
    assert rank.check.open_rooms() == {}
    # One writer of two reported: its block only.
    rank.arrive(0, 0, 1, 0, writer=1)
    assert rank.check.checked == 0  # nothing under its block was pending
    assert "writer p0g0r1" in rank.check.open_rooms()[0]
    # Scattered: the scatter's own check decides from then on.
    rank2 = _Rank(2, 1)
    rank2.room(0, rid=5, tokens=PAGE)
    alloc = rank2.write(0, 0, pages=1, offset=0)
    rank2.check.effects([ev.StartScatter(room=0, chunk_idx=0, alloc_id=alloc, offset=0,
                                         nbytes=4096, page_start=0, num_pages=1)])
    rank2.ring[:100] = 1
    assert rank2.check.open_rooms() == {}
    # Concluded: its unscattered bytes are dead; what they held at conclusion was checked.
    rank3 = _Rank(2, 1)
    rank3.room(0, rid=5, tokens=PAGE)
    rank3.write(0, 0, pages=1, offset=0)
    rank3.check.effects([ev.RoomConcluded(room=0, status="Failed", reason="aborted")])
    assert rank3.check.take(0) is None
    rank3.ring[:100] = 1
    assert rank3.check.open_rooms() == {}


def test_a_region_overwritten_then_released_is_reported_when_its_room_concludes() -> None:
    """Freed without a scatter (release_room): checked then, reported with the room."""
    rank = _Rank(2, 1)
    rank.room(0, rid=5, tokens=PAGE)
    alloc = rank.write(0, 0, pages=1, offset=512)
    rank.ring[600:800] = 0
    rank.check.effects([ev.Freed(alloc_id=alloc, room=0, chunk_idx=0, reason="released")])
    rank.ring[600:800] = rank.region(0, 1)[88:288]  # put back: the check already saw it
    rank.check.effects([ev.RoomConcluded(room=0, status="Failed", reason="aborted")])
    text = rank.check.take(0)
    assert text is not None and "ring bytes [600, 800)" in text, text
    assert "they hold zeros (never written)" in text, text
    assert rank.check.take(0) is None and rank.check.open_rooms() == {}


def test_a_pp_stage_is_checked_on_its_own_layer_slots() -> None:
    """A PP stage writes its layers' K and V slots of its TP writer's block: with only stage
    0 reported, the other slots (not written yet) are not checked; stage 1's are once it
    reports."""
    cfg = TwinConfig(model=ModelShape(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM),
                     prefill=ServerSide(tp_size=2, pp_size=2), decode=ServerSide(tp_size=1),
                     page_size=PAGE, staging_pool_size_bytes=1 << 20)
    rank = _Rank(2, 1)
    rank.cfg = cfg
    rank.check = RingCheck(rank.ring, cfg, 0, Topology(cfg), rank.rooms)
    rank.room(0, rid=4, tokens=PAGE)
    rank.write(0, 0, pages=1, offset=0, announce=False)
    for writer in ("p0g0s0r0", "p0g0s0r1", "p0g0s1r0", "p0g0s1r1"):
        rank.tell(0, 0, 0, writer)
    slot = PAGE * (HEADS // 2) * HEAD_DIM * 2  # one layer's K (or V) of one TP writer's block
    block = 2 * LAYERS * slot
    for w in range(2):  # layer 1 (stage 1) of every writer block: not written yet
        for kv in range(2):
            at = w * block + (kv * LAYERS + 1) * slot
            rank.ring[at:at + slot] = 0
    for r in range(2):
        rank.check.arrived(wire.ChunkReady(room=0, chunk_idx=0, page_start=0, num_pages=1,
                                           writer_id="d0g0r0", prefill_rank=r),
                           f"p0g0s0r{r}")
    assert rank.check.open_rooms() == {}
    rank.check.arrived(wire.ChunkReady(room=0, chunk_idx=0, page_start=0, num_pages=1,
                                       writer_id="d0g0r0", prefill_rank=2), "p0g0s1r0")
    text = rank.check.open_rooms()[0]
    assert f"ring bytes [{slot}, " in text and "writer p0g0s1r0" in text, text
    assert "layer 1 K token 0" in text, text


def test_a_block_goes_where_the_writer_was_told() -> None:
    """A CHUNK_READY names no offset: the block lies where this rank's last STAGING_RSP to
    that writer put the chunk. An allocation the writer was never told of (the chunk allocated
    again after its scatter, for a late STAGING_REQ) is not taken as written; a rewrite to the
    old offset is checked against what it lands on."""
    rank = _Rank(2, 1)
    rank.room(0, rid=3, tokens=PAGE)
    rank.room(1, rid=4, tokens=PAGE)
    first = rank.write(0, 0, pages=1, offset=0)
    rank.check.effects([
        ev.StartScatter(room=0, chunk_idx=0, alloc_id=first, offset=0, nbytes=16384,
                        page_start=0, num_pages=1),
        ev.Freed(alloc_id=first, room=0, chunk_idx=0, reason="scattered"),
        # A late STAGING_REQ: the chunk allocated again, at 65536, and answered to p0g0r1 only.
        ev.Allocated(room=0, chunk_idx=0, alloc_id=7, offset=65536, round=0, size=16384)])
    rank.tell(0, 0, 65536, "p0g0r1")
    rank.arrive(0, 0, 1, 0, writer=0)  # p0g0r0 wrote where it was told: offset 0, scattered
    assert rank.check.open_rooms() == {}  # 65536 holds zeros, but nobody wrote there
    # Room 1's chunk now at offset 0, written by both; p0g0r0 then rewrites room 0's chunk at
    # its old offset: room 1's block is overwritten before any scatter.
    rank.write(1, 0, pages=1, offset=0)
    old = rank.region(0, 1)
    rank.ring[:old.numel()] = old
    rank.arrive(0, 0, 1, 0, writer=0)
    text = rank.check.open_rooms()[1]
    assert text.startswith("ring bytes [0, ") and "room 1 chunk 0" in text, text
    assert "they hold the bytes of room 0 chunk 0 (pages [0, 1), writer p0g0r0) written at " \
        "ring offset 0" in text, text
