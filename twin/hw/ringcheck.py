"""Byte check of a decode rank's staging ring where it holds written, not yet scattered data.

The decode ranks check every chunk's bytes as the scatter lands them in the KV pool
(``RankProcess._verify_pages``). Bytes that are written into the ring and never scattered (a
room that wedges, fails or is released before its chunk's last writer reported) are not seen
by that check, so a later WRITE that lands on them is not either, though the simulator's
integrity model calls it an ``overwrite``. This module checks those ring regions themselves.

A writer's block of a chunk's region is *written* once the writer's ``CHUNK_READY`` reached
the rank: SGLang's prefill sends it only after the WRITE completed, so a region still being
written is never checked. A written block is *pending* until its chunk's scatter starts
(the scatter check covers it from then on). A pending block is checked against the pattern
its writer put there (``twin.hw.kvpattern``: the writer's head slice of every layer's K then
V, a PP stage: its own layers' slots, at the request's token positions) when it stops being
pending without a scatter, as the simulator's model retires it:

* its allocation is freed unscattered (``release_room``),
* its room concludes on this rank (Success or Failed: its unscattered bytes are dead from
  then on, so a later write over them is no corruption, as in the simulator), or
* the coordinator asks for the rank's state at the end of a run that did not finish every
  room (a wedge, ``--until``) or of a hardware replay.

A wrong block is reported with its room, chunk, pages, writer and the ring bytes that are
wrong, and with whose bytes are there now: the most recent written block this rank knows
(any room, scattered or not) that the bytes match, zeros (never written), or bytes of no
chunk this rank saw written.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from twin.core import events as ev
from twin.core import wire
from twin.core.config import TwinConfig, pp_layer_range
from twin.core.integrity import RoomSet
from twin.core.layout import compute_head_slice_params, writer_index
from twin.core.topology import Topology
from twin.hw.kernels.common import INT_DTYPES
from twin.hw.kvpattern import expected_tokens, pattern_value, rank_head_range
from twin.hw.pools import DTYPES

__all__ = ["RingBlock", "RingCheck", "RingMismatch"]

#: Written blocks kept to name whose bytes overwrote a region (most recent first).
HISTORY = 4096
#: Elements compared to decide whose bytes lie at the first wrong one.
WINDOW = 64


@dataclass(frozen=True, slots=True)
class RingBlock:
    """One writer's bytes of one chunk in the ring, as that writer put them there."""

    room: int
    chunk_idx: int
    alloc_id: int
    offset: int  # ring byte offset of the writer's block
    nbytes: int  # the whole block (every layer's K and V slot)
    page_start: int
    num_pages: int
    writer: str  # the prefill node
    rid: int
    first_token: int  # request position of the chunk's first token
    valid_tokens: int  # chunk tokens inside the request (the rest of a last page is not checked)
    heads: range  # global KV heads of the block
    layers: range  # the layers this writer wrote (a PP stage: its own)

    def label(self) -> str:
        return (f"room {self.room} chunk {self.chunk_idx} (pages [{self.page_start}, "
                f"{self.page_start + self.num_pages}), writer {self.writer})")


@dataclass(frozen=True, slots=True)
class RingMismatch:
    """The first wrong element of a pending block, where the wrong bytes lie, and what they
    hold."""

    block: RingBlock
    layer: int
    kv: str
    token: int  # request position
    head: int  # global KV head
    dim: int
    expected: int
    got: int
    count: int  # wrong elements of the block
    first_byte: int  # ring offset of the first wrong element
    end_byte: int  # ring offset just past the last wrong element
    holds: str

    def __str__(self) -> str:
        b = self.block
        return (f"ring bytes [{self.first_byte}, {self.end_byte}) of {b.label()}, written and "
                f"not scattered, were overwritten: request {b.rid} layer {self.layer} "
                f"{self.kv.upper()} token {self.token} head {self.head} dim {self.dim} at ring "
                f"offset {self.first_byte}: expected {self.expected:#x}, got {self.got:#x} "
                f"({self.count} wrong elements); they hold {self.holds}")


@dataclass(slots=True)
class _Alloc:
    room: int
    chunk_idx: int
    offset: int
    size: int
    round: int
    scattered: bool = False
    pending: dict[str, RingBlock] = field(default_factory=dict)  # writer -> block


class RingCheck:
    """The ring ledger and byte check of one staged decode rank (see the module docstring).

    ``rooms`` is the rank's own map of set-up requests (room -> ``rid``, ``input_len``,
    ``decode_prefix_len``), read when a block is written."""

    def __init__(self, ring: torch.Tensor, cfg: TwinConfig, rank: int, topo: Topology,
                 rooms: Mapping[int, Mapping[str, Any]]) -> None:
        self.ring = ring
        self.cfg = cfg
        self.rank = rank
        self.topo = topo
        self.rooms = rooms
        m = cfg.model
        self.dtype = DTYPES[m.dtype_bytes]
        self.elem = torch.empty((), dtype=self.dtype).element_size()
        self.int_dtype = INT_DTYPES[self.elem]
        self.num_layers = m.num_layers
        self.head_dim = m.head_dim
        self._allocs: dict[int, _Alloc] = {}
        self._live: dict[tuple[int, int], int] = {}  # (room, chunk) -> its newest allocation
        # room -> (chunk, writer) -> (offset, round) of the last STAGING_RSP sent to it
        self._told: dict[int, dict[tuple[int, str], tuple[int, int]]] = {}
        # (room, chunk) -> (alloc id, offset, size) of its newest allocation, freed or not
        self._last: OrderedDict[tuple[int, int], tuple[int, int, int]] = OrderedDict()
        self._history: deque[RingBlock] = deque(maxlen=HISTORY)
        self._ended = RoomSet()
        self._found: dict[int, str] = {}  # room -> its first wrong pending block
        self.checked = 0  # blocks byte-checked (a test hook)

    # -- what the rank sees --------------------------------------------------------------------
    def arrived(self, msg: wire.ChunkReady, writer: str) -> None:
        """``writer``'s CHUNK_READY reached the rank: its block of the chunk is written where
        the last STAGING_RSP this rank sent it for the chunk said. That is the chunk's live
        allocation (the block is then pending), or an older one: a late rewrite, whose bytes
        may have hit what now lies there."""
        key = (msg.room, msg.chunk_idx)
        told = self._told.get(msg.room, {}).get((msg.chunk_idx, writer))
        alloc_id = self._live.get(key)
        a = self._allocs.get(alloc_id) if alloc_id is not None else None
        live = alloc_id is not None and a is not None and told == (a.offset, a.round)
        if alloc_id is not None and a is not None and live:
            where: tuple[int, int, int | None] | None = (alloc_id, a.offset, a.size)
        elif told is not None:
            where = (-1, told[0], None)
        else:
            where = self._last.get(key)
        if where is None:
            return
        block = self._block(msg, writer, *where)
        if block is None:
            return
        self._history.append(block)
        if live and a is not None and not a.scattered and msg.room not in self._ended:
            a.pending[writer] = block
        # Written bytes of other chunks under this block were just overwritten: check them
        # now, before a rewrite can hide it (the simulator flags the write as it lands).
        end = block.offset + block.nbytes
        for other in self._allocs.values():
            if other is not a and other.pending and other.offset < end and \
                    block.offset < other.offset + other.size:
                self._check(p for p in other.pending.values()
                            if p.offset < end and block.offset < p.offset + p.nbytes)

    def effects(self, effects: Iterable[ev.Effect]) -> None:
        """The core's effects of one input, in order."""
        for e in effects:
            if isinstance(e, ev.Send):
                m = e.msg
                if isinstance(m, wire.StagingRsp):  # where that writer will write the chunk
                    self._told.setdefault(m.room, {})[(m.chunk_idx, e.dst)] = (m.offset, m.round)
            elif isinstance(e, ev.Allocated):
                self._allocs[e.alloc_id] = _Alloc(e.room, e.chunk_idx, e.offset, e.size,
                                                  e.round)
                self._live[(e.room, e.chunk_idx)] = e.alloc_id
                last = self._last
                last[(e.room, e.chunk_idx)] = (e.alloc_id, e.offset, e.size)
                last.move_to_end((e.room, e.chunk_idx))
                if len(last) > HISTORY:
                    last.popitem(last=False)
            elif isinstance(e, ev.StartScatter):
                a = self._allocs.get(e.alloc_id)
                if a is not None:
                    a.scattered = True
                    a.pending.clear()
            elif isinstance(e, ev.Freed):
                a = self._allocs.pop(e.alloc_id, None)
                if a is None:
                    continue
                if self._live.get((a.room, a.chunk_idx)) == e.alloc_id:
                    del self._live[(a.room, a.chunk_idx)]
                self._check(a.pending.values())
            elif isinstance(e, ev.RoomConcluded):
                for a in self._allocs.values():
                    if a.room == e.room and a.pending:
                        self._check(a.pending.values())
                        a.pending.clear()
                self._ended.add(e.room)
                self._told.pop(e.room, None)

    def take(self, room: int) -> str | None:
        """The room's first wrong ring block, once (when it concludes)."""
        return self._found.pop(room, None)

    def open_rooms(self) -> dict[int, str]:
        """Check every pending block now; the first wrong one of each room not concluded."""
        for a in self._allocs.values():
            self._check(a.pending.values())
        return {room: text for room, text in self._found.items() if room not in self._ended}

    # -- the blocks ----------------------------------------------------------------------------
    def _block(self, msg: wire.ChunkReady, writer: str, alloc_id: int, offset: int,
               size: int | None) -> RingBlock | None:
        """Where ``writer`` put its bytes of the chunk and what they are, or None when that is
        not known (an unknown writer or request, a chunk the allocation cannot hold)."""
        node = self.topo.nodes.get(writer)
        req = self.rooms.get(msg.room)
        if node is None or node.role != "prefill" or req is None or msg.num_pages <= 0:
            return None
        cfg = self.cfg
        p_tp, d_tp, total = (cfg.prefill.attn_tp_size, cfg.decode.attn_tp_size,
                             cfg.model.num_kv_heads)
        _, writer_bytes, region = cfg.region_layout(self.rank, msg.num_pages)
        if offset < 0 or (size is not None and region > size) or \
                offset + region > self.ring.numel():
            return None
        wi = writer_index(p_tp, d_tp, node.rank)
        src_head, nh, _, _ = compute_head_slice_params(p_tp, d_tp, node.rank, self.rank, total)
        page = cfg.page_size
        tokens = msg.num_pages * page
        if wi >= len(writer_bytes) or writer_bytes[wi] != 2 * self.num_layers * tokens * nh \
                * self.head_dim * self.elem:
            return None
        first = (int(req["decode_prefix_len"]) // page + msg.page_start) * page
        first_layer, stop = pp_layer_range(self.num_layers, node.pp_rank, cfg.prefill.pp_size)
        head0 = rank_head_range(p_tp, node.rank, total).start + src_head
        return RingBlock(
            room=msg.room, chunk_idx=msg.chunk_idx, alloc_id=alloc_id,
            offset=offset + sum(writer_bytes[:wi]), nbytes=writer_bytes[wi],
            page_start=msg.page_start, num_pages=msg.num_pages, writer=writer,
            rid=int(req["rid"]), first_token=first,
            valid_tokens=max(0, min(tokens, int(req["input_len"]) - first)),
            heads=range(head0, head0 + nh), layers=range(first_layer, stop))

    def _view(self, b: RingBlock) -> torch.Tensor:
        """The block's ring bytes as ``[2, layers, tokens, heads, head_dim]`` integers."""
        tokens = b.num_pages * self.cfg.page_size
        raw = self.ring[b.offset:b.offset + b.nbytes].view(self.int_dtype)
        return raw.view(2, self.num_layers, tokens, len(b.heads), self.head_dim)

    def _check(self, blocks: Iterable[RingBlock]) -> None:
        for b in list(blocks):
            if b.room in self._found or b.room in self._ended:
                continue
            wrong = self.verify(b)
            if wrong is not None:
                self._found[b.room] = str(wrong)

    def verify(self, b: RingBlock) -> RingMismatch | None:
        """Compare the block's ring bytes with what its writer put there."""
        self.checked += 1
        if not b.valid_tokens or not len(b.layers) or b.offset % self.elem:
            return None
        lay = slice(b.layers.start, b.layers.stop)
        got = self._view(b)[:, lay, :b.valid_tokens]
        want = expected_tokens(b.rid, b.layers,
                               range(b.first_token, b.first_token + b.valid_tokens), b.heads,
                               self.head_dim, self.dtype, self.ring.device).view(self.int_dtype)
        if torch.equal(got, want):
            return None
        wrong = got != want
        where = wrong.nonzero()
        kv, li, t, h, d = (int(i) for i in where[0])
        last = [int(i) for i in where[-1]]
        first_byte = self._byte(b, kv, b.layers.start + li, t, h, d)
        end_byte = self._byte(b, last[0], b.layers.start + last[1], *last[2:]) + self.elem
        return RingMismatch(
            block=b, layer=b.layers.start + li, kv="kv"[kv], token=b.first_token + t,
            head=b.heads[h], dim=d, expected=int(want[kv, li, t, h, d]),
            got=int(got[kv, li, t, h, d]), count=int(wrong.sum()), first_byte=first_byte,
            end_byte=end_byte, holds=self._holds(b, first_byte))

    def _byte(self, b: RingBlock, kv: int, layer: int, t: int, h: int, d: int) -> int:
        tokens = b.num_pages * self.cfg.page_size
        index = (((kv * self.num_layers + layer) * tokens + t) * len(b.heads) + h) \
            * self.head_dim + d
        return b.offset + index * self.elem

    # -- whose bytes are there -----------------------------------------------------------------
    def _holds(self, victim: RingBlock, at: int) -> str:
        """What the ring holds from byte ``at`` on: a written block's bytes, zeros, or
        neither."""
        n = min(WINDOW, (self.ring.numel() - at) // self.elem)
        got = self.ring[at:at + n * self.elem].view(self.int_dtype)
        for cand in reversed(self._history):
            if cand == victim or not cand.offset <= at < cand.offset + cand.nbytes:
                continue
            want = self._pattern_at(cand, at, n)
            if want is not None and torch.equal(got[:len(want)], want):
                return f"the bytes of {cand.label()} written at ring offset {cand.offset}"
        if not bool(got.any()):
            return "zeros (never written)"
        return "bytes of no chunk this rank saw written"

    def _pattern_at(self, b: RingBlock, at: int, n: int) -> torch.Tensor | None:
        """Block ``b``'s pattern for ``n`` elements from ring byte ``at`` (fewer at the block's
        end), or None where those elements are not the writer's (other layers, padding)."""
        if (at - b.offset) % self.elem:
            return None
        tokens = b.num_pages * self.cfg.page_size
        nh = len(b.heads)
        first = (at - b.offset) // self.elem
        count = min(n, b.nbytes // self.elem - first)
        idx = torch.arange(first, first + count, dtype=torch.int64)
        d = idx % self.head_dim
        h = idx // self.head_dim % nh
        t = idx // (self.head_dim * nh) % tokens
        layer = idx // (self.head_dim * nh * tokens) % self.num_layers
        kv = idx // (self.head_dim * nh * tokens * self.num_layers)
        ok = (t < b.valid_tokens) & (layer >= b.layers.start) & (layer < b.layers.stop)
        if not bool(ok.all()):
            return None
        values = pattern_value(b.rid, layer, kv, t + b.first_token, h + b.heads.start, d,
                               self.dtype)
        return values.view(self.int_dtype).to(self.ring.device)
