"""Differential test: the twin's ``DecodeRank`` against SGLang 0.5.23's own decode-side code.

Hypothesis generates one decode rank's inputs (rooms registered, STAGING_REQs from any writer
for any chunk, CHUNK_READYs, transfer statuses, scatter completions, aborts, time passing) in
any order; the same sequence drives the twin's core and SGLang's ``DecodeStagingHandler``,
``handle_staging_req``, chunk-ready and status handling and staging-aware poll, loaded from the
wheel (``twin/reference/decode_machine.py``). After every input the two must agree on:

* the frames sent (STAGING_RSP and WATERMARK, byte for byte, to the same prefill ranks);
* the scatters submitted (room, chunk, ring offset, pages);
* the allocations freed, in order, and the ring (head, round, watermark, live allocations);
* the rooms concluded, and how (Success or Failed).

Named simplifications, where the comparison is adjusted (``docs/fidelity.md``):

* ABORT frames are not compared: SGLang's receiver sends them, outside the code loaded here.
* Deferred decode KV release is off here (the scheduler's hold is not in the loaded code);
  its path is covered by ``test_failpaths.py`` and ``test_decode.py``.

The inputs are not derandomized: every run sees new sequences. A failing sequence is printed
by Hypothesis as a reproducible program (and its seed); record it in ``docs/fidelity.md``.
``TWIN_DIFF_EXAMPLES`` sets how many sequences a run tries (default 200).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from twin.core import events as ev
from twin.core import wire
from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.core.decode import DecodeRank
from twin.core.grid import prefetch_chunks
from twin.core.layout import target_decode_ranks
from twin.reference.decode_machine import SglangDecodeRank

TIMEOUT_S = 10.0
STEPS_S = (3.7, 8.3, 12.1)  # no sum of these equals the timeout: no boundary ties
MODEL = ModelShape(num_layers=2, num_kv_heads=8, head_dim=4, dtype_bytes=2)
EXAMPLES = int(os.environ.get("TWIN_DIFF_EXAMPLES", "200"))


@pytest.fixture(autouse=True)
def _reference(sglang_reference) -> None:
    """SGLang's wheel: a failure when missing, a skip only with TWIN_OFFLINE=1."""


def _frames(effects: list[ev.Effect]) -> list[tuple[str, list[bytes]]]:
    return sorted((e.dst, wire.encode(e.msg)) for e in effects
                  if isinstance(e, ev.Send) and not isinstance(e.msg, wire.Abort))


class DecodeDifferential(RuleBasedStateMachine):
    """One decode rank of a deployment, twin and SGLang side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.sgl = None
        self.rooms: dict[int, dict] = {}
        self.scattering: dict[int, tuple[int, int]] = {}  # alloc_id -> (room, chunk)
        self.next_room = 0
        self.now = 0.0

    @initialize(prefill_tp=st.sampled_from([1, 2, 4]), decode_tp=st.sampled_from([1, 2]),
                page=st.sampled_from([1, 16]), cps=st.sampled_from([32, 64]),
                ring_regions=st.sampled_from([0.5, 1, 2, 3]), pp=st.sampled_from([1, 1, 2]),
                backend=st.sampled_from(["mooncake", "nixl"]), data=st.data())
    def setup(self, prefill_tp, decode_tp, page, cps, ring_regions, pp, backend, data) -> None:
        rank = data.draw(st.integers(0, decode_tp - 1), label="decode_rank")
        if pp > 1:
            backend = "mooncake"  # staging with PP > 1 runs only on Mooncake
        base = TwinConfig(prefill=ServerSide(tp_size=prefill_tp, pp_size=pp),
                          decode=ServerSide(tp_size=decode_tp), model=MODEL,
                          chunked_prefill_size=cps, page_size=page,
                          waiting_timeout_s=TIMEOUT_S, deferred_decode_kv_release=False,
                          disaggregation_transfer_backend=backend,
                          # the harness registers every room with the staging handler, as
                          # SGLang does for a receiver that require_staging
                          stage_equal_tp=True)
        region = base.region_layout(rank, base.full_chunk_pages)[2]
        self.cfg = base.replace(staging_pool_size_bytes=max(1, int(ring_regions * region)))
        # Every PP stage's rank of a writing TP rank is a writer (Mooncake's PP staging); node
        # ids name the stage when there are several, as the topology does.
        self.ids: dict[str, int] = {}
        self.stage: dict[str, int] = {}
        for s in range(pp):
            for p in range(prefill_tp):
                if rank in target_decode_ranks(prefill_tp, decode_tp, p):
                    name = f"p{p}" if pp == 1 else f"p0g0s{s}r{p}"
                    self.ids[name], self.stage[name] = s * prefill_tp + p, s
        self.writers = list(self.ids)
        self.session = f"d0g0r{rank}"
        self.twin = DecodeRank(self.cfg, self.session, rank, port=4242)
        self.sgl = SglangDecodeRank(
            ring_bytes=self.cfg.ring_bytes, page_size=page, decode_tp=decode_tp, tp_rank=rank,
            total_kv_heads=MODEL.num_kv_heads, head_bytes=self.cfg.bytes_per_head_token,
            num_layers=MODEL.num_layers, timeout_s=TIMEOUT_S)

    # -- driving both -------------------------------------------------------------------------
    def _twin(self, event: ev.Input) -> list[ev.Effect]:
        out = self.twin.handle(event, self.now)
        for e in out:
            if isinstance(e, ev.StartScatter):
                self.scattering[e.alloc_id] = (e.room, e.chunk_idx)
        for e in out:
            if isinstance(e, ev.RoomConcluded):  # release_room drained its scatters
                self.scattering = {a: rc for a, rc in self.scattering.items()
                                   if rc[0] != e.room}
        return out

    def _twin_scatter_done(self, alloc_id: int) -> list[ev.Effect]:
        room, chunk = self.scattering.pop(alloc_id)
        return self.twin.handle(ev.ScatterDone(room=room, chunk_idx=chunk, alloc_id=alloc_id),
                                self.now)

    def _compare(self, out: list[ev.Effect], what: str) -> None:
        frames, scatters, freed, concluded = self.sgl.drain()
        got = {
            "frames": _frames(out),
            "scatters": [(e.room, e.chunk_idx, e.offset, e.page_start, e.num_pages)
                         for e in out if isinstance(e, ev.StartScatter)],
            "freed": [e.alloc_id for e in out if isinstance(e, ev.Freed)],
            "concluded": [(e.room, e.status) for e in out if isinstance(e, ev.RoomConcluded)],
        }
        want = {
            "frames": sorted((d, f) for d, f in frames if f[0] != b"ABORT"),
            "scatters": scatters, "freed": freed, "concluded": concluded,
        }
        for key in got:
            assert got[key] == want[key], (what, key, "twin", got[key], "sglang", want[key])
        for room, _ in got["concluded"]:
            self.rooms.pop(room, None)

    @invariant()
    def rings_agree(self) -> None:
        if self.sgl is None:
            return
        snap = self.twin.snapshot()
        twin_ring = (snap.head, snap.round, snap.watermark,
                     [(a.alloc_id, a.offset, a.size, a.round) for a in snap.live])
        assert twin_ring == self.sgl.ring(), ("ring", twin_ring, self.sgl.ring())

    # -- rules --------------------------------------------------------------------------------
    @precondition(lambda self: self.sgl is not None and self.next_room < 5)
    @rule(pages=st.integers(1, 10), prefix_pages=st.integers(0, 2),
          unaligned=st.booleans())
    def new_room(self, pages: int, prefix_pages: int, unaligned: bool) -> None:
        room, self.next_room = self.next_room, self.next_room + 1
        page = self.cfg.page_size
        prefix = prefix_pages * page + (1 if unaligned and page > 1 and pages > 3 else 0)
        self.rooms[room] = {"pages": pages}
        out = self._twin(ev.DecodeRoomInit(
            room=room, prefill_ranks=tuple(self.writers),
            prefill_attn_tp=self.cfg.prefill.attn_tp_size, decode_prefix_len=prefix,
            total_pages=pages))
        self.sgl.on_room(room, self.writers, [self.ids[w] for w in self.writers],
                         self.cfg.prefill.attn_tp_size, prefix,
                         pp_ranks=[self.stage[w] for w in self.writers],
                         pp_size=self.cfg.prefill.pp_size)
        self._compare(out, f"room {room}")

    def _chunks(self, room: int) -> list[tuple[int, int]]:
        return prefetch_chunks(self.rooms[room]["pages"], self.cfg.full_chunk_pages)

    @precondition(lambda self: self.sgl is not None and self.next_room > 0)
    @rule(data=st.data())
    def staging_req(self, data: st.DataObject) -> None:
        room = data.draw(st.integers(0, self.next_room - 1), label="room")
        pages = self.rooms.get(room, {}).get("pages", 4)
        chunks = prefetch_chunks(pages, self.cfg.full_chunk_pages)
        chunk, chunk_pages = data.draw(st.sampled_from(chunks), label="chunk")
        src = data.draw(st.sampled_from(self.writers), label="writer")
        # Mooncake names the requesting PP rank on every request (stage 0 too); NIXL none.
        msg = wire.StagingReq(room=room, chunk_idx=chunk, chunk_pages=chunk_pages,
                              session_id=self.session,
                              pp_rank=self.stage[src] if self.cfg.is_mooncake else None)
        out = self._twin(ev.MessageArrived(src=src, msg=msg))
        self.sgl.on_staging_req(wire.encode(msg))
        self._compare(out, f"STAGING_REQ {msg}")

    @precondition(lambda self: self.sgl is not None and self.next_room > 0)
    @rule(data=st.data())
    def chunk_ready(self, data: st.DataObject) -> None:
        room = data.draw(st.integers(0, self.next_room - 1), label="room")
        pages = self.rooms.get(room, {}).get("pages", 4)
        chunk, chunk_pages = data.draw(st.sampled_from(
            prefetch_chunks(pages, self.cfg.full_chunk_pages)), label="chunk")
        src = data.draw(st.sampled_from(self.writers), label="writer")
        msg = wire.ChunkReady(room=room, chunk_idx=chunk,
                              page_start=chunk * self.cfg.full_chunk_pages,
                              num_pages=chunk_pages, writer_id=self.session,
                              prefill_rank=self.ids[src])
        out = self._twin(ev.MessageArrived(src=src, msg=msg))
        self.sgl.on_chunk_ready(wire.encode(msg))
        self._compare(out, f"CHUNK_READY {msg}")

    @precondition(lambda self: self.sgl is not None and self.next_room > 0)
    @rule(data=st.data(), ok=st.booleans(), often_ok=st.booleans())
    def status(self, data: st.DataObject, ok: bool, often_ok: bool) -> None:
        room = data.draw(st.integers(0, self.next_room - 1), label="room")
        src = data.draw(st.sampled_from(self.writers), label="writer")
        poll = wire.KVPoll.Success if ok or often_ok else wire.KVPoll.Failed
        msg = wire.TransferStatus(room=room, status=poll, prefill_rank=self.ids[src])
        out = self._twin(ev.MessageArrived(src=src, msg=msg))
        self.sgl.on_status(room, int(poll), self.ids[src])
        self._compare(out, f"KV_STATUS {msg}")

    @precondition(lambda self: self.sgl is not None and self.scattering)
    @rule(data=st.data())
    def scatter_done(self, data: st.DataObject) -> None:
        alloc_id = data.draw(st.sampled_from(sorted(self.scattering)), label="alloc")
        out = self._twin_scatter_done(alloc_id)
        self.sgl.on_scatter_done(alloc_id)
        self._compare(out, f"scatter of alloc {alloc_id} done")

    @precondition(lambda self: self.sgl is not None and self.rooms)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        room = data.draw(st.sampled_from(sorted(self.rooms)), label="room")
        out = self._twin(ev.RoomAborted(room=room, reason="abort"))
        self.sgl.on_abort(room)
        self._compare(out, f"abort room {room}")

    @precondition(lambda self: self.sgl is not None)
    @rule(step=st.sampled_from(STEPS_S))
    def time_passes(self, step: float) -> None:
        self.now += step
        out = self._twin(ev.Tick())
        self.sgl.on_time(self.now)
        self._compare(out, f"time {self.now:.1f}")


DecodeDifferential.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=40, deadline=None, derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestDecodeAgainstSglang = DecodeDifferential.TestCase
