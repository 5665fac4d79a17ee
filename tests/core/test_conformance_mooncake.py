"""Mooncake's PP-aware staging routing, the twin's ``DecodeRank`` against SGLang's own code.

SGLang's ``handle_staging_req`` and ``DecodeStagingHandler`` (loaded from the 0.5.23 wheel by
``twin.reference.decode_machine``) and one twin decode rank get the same inputs for a prefill with
``pp_size > 1``: STAGING_REQ naming each PP stage (Mooncake) or none (NIXL), CHUNK_READY from
every stage's writer, KV_STATUS from every writer. After each input the frames sent (who gets
each STAGING_RSP), the scatters submitted and the rooms concluded must agree. Also the facts
of SGLang's GPU-free wire tests for these paths, checked on the wheel's code directly.
"""

from __future__ import annotations

import itertools

import pytest

from twin.core import events as ev
from twin.core import wire
from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.core.decode import DecodeRank
from twin.core.topology import Topology
from twin.reference.decode_machine import SglangDecodeRank, load_machines

MODEL = ModelShape(num_layers=4, num_kv_heads=8, head_dim=8, dtype_bytes=2)
TIMEOUT_S = 5.0


def _frames(effects: list[ev.Effect]) -> list[tuple[str, list[bytes]]]:
    return sorted((e.dst, wire.encode(e.msg)) for e in effects
                  if isinstance(e, ev.Send) and not isinstance(e.msg, wire.Abort))


class Pair:
    """One decode rank, twin and SGLang, fed the same frames."""

    def __init__(self, prefill_tp: int, pp: int, decode_tp: int, rank: int) -> None:
        self.cfg = TwinConfig(prefill=ServerSide(tp_size=prefill_tp, pp_size=pp),
                              decode=ServerSide(tp_size=decode_tp), model=MODEL,
                              chunked_prefill_size=64, page_size=16,
                              staging_pool_size_bytes=1 << 20, waiting_timeout_s=TIMEOUT_S,
                              deferred_decode_kv_release=False)
        topo = Topology(self.cfg)
        d = topo.decode_groups[0].nodes[rank]
        pg = topo.prefill_groups[0]
        self.writers = list(topo.writers_of(d, pg))
        self.ids = {n.id: n.unique_rank for n in pg.nodes}
        self.stage = {n.id: n.pp_rank for n in pg.nodes}
        self.session = d.id
        self.twin = DecodeRank(self.cfg, d.id, rank, port=4242)
        self.sgl = SglangDecodeRank(
            ring_bytes=self.cfg.ring_bytes, page_size=16, decode_tp=decode_tp, tp_rank=rank,
            total_kv_heads=MODEL.num_kv_heads, head_bytes=self.cfg.bytes_per_head_token,
            num_layers=MODEL.num_layers, timeout_s=TIMEOUT_S)

    def compare(self, out: list[ev.Effect], what: str) -> None:
        frames, scatters, _freed, concluded = self.sgl.drain()
        got = (_frames(out), [(e.room, e.chunk_idx, e.offset, e.page_start, e.num_pages)
                              for e in out if isinstance(e, ev.StartScatter)],
               [(e.room, e.status) for e in out if isinstance(e, ev.RoomConcluded)])
        want = (sorted((d, f) for d, f in frames if f[0] != b"ABORT"), scatters, concluded)
        assert got == want, (what, "twin", got, "sglang", want)

    def room(self, room: int, pages: int) -> None:
        out = self.twin.handle(ev.DecodeRoomInit(
            room=room, prefill_ranks=tuple(self.writers),
            prefill_attn_tp=self.cfg.prefill.attn_tp_size, decode_prefix_len=0,
            total_pages=pages), 0.0)
        self.sgl.on_room(room, self.writers, [self.ids[w] for w in self.writers],
                         self.cfg.prefill.attn_tp_size, 0,
                         pp_ranks=[self.stage[w] for w in self.writers],
                         pp_size=self.cfg.prefill.pp_size)
        self.compare(out, f"room {room}")

    def feed(self, src: str, msg: wire.Message) -> None:
        out = self.twin.handle(ev.MessageArrived(src=src, msg=msg), 0.0)
        if isinstance(msg, wire.StagingReq):
            self.sgl.on_staging_req(wire.encode(msg))
        elif isinstance(msg, wire.ChunkReady):
            self.sgl.on_chunk_ready(wire.encode(msg))
        else:
            assert isinstance(msg, wire.TransferStatus)
            self.sgl.on_status(msg.room, int(msg.status), msg.prefill_rank)
        self.compare(out, f"{src}: {msg}")


@pytest.mark.parametrize(("prefill_tp", "pp", "decode_tp", "rank"), [
    (2, 2, 2, 0), (2, 2, 2, 1), (4, 2, 2, 1), (2, 2, 1, 0), (1, 3, 2, 1), (4, 4, 4, 2)])
@pytest.mark.parametrize("name_pp_rank", [True, False], ids=["mooncake-req", "nixl-req"])
def test_pp_writers_route_and_fan_in_as_sglang(prefill_tp: int, pp: int, decode_tp: int,
                                               rank: int, name_pp_rank: bool) -> None:
    p = Pair(prefill_tp, pp, decode_tp, rank)
    assert len(p.writers) == p.cfg.num_writers  # TP writers x PP stages, as num_writers_for
    pages = 9  # chunks of 4, 4 and 1 pages
    p.room(0, pages)
    chunks = [(0, 4), (1, 4), (2, 1)]
    # every writer asks for every chunk (each stage prefetches alone), in an interleaved order
    for (chunk, n), w in itertools.product(chunks, reversed(p.writers)):
        p.feed(w, wire.StagingReq(room=0, chunk_idx=chunk, chunk_pages=n,
                                  session_id=p.session,
                                  pp_rank=p.stage[w] if name_pp_rank else None))
    # CHUNK_READY from every stage's writer: the scatter starts only with the last one
    for (chunk, n), w in itertools.product(chunks, p.writers):
        p.feed(w, wire.ChunkReady(room=0, chunk_idx=chunk, page_start=chunk * 4, num_pages=n,
                                  writer_id=p.session, prefill_rank=p.ids[w]))
    for w in p.writers:
        p.feed(w, wire.TransferStatus(room=0, status=wire.KVPoll.Success,
                                      prefill_rank=p.ids[w]))


# --- facts of SGLang's GPU-free wire tests, on the wheel's code --------------------------------

def test_staging_register_info_fields_as_the_wheel_parses_them() -> None:
    """The registration message's staging fields (``StagingRegisterInfo.from_zmq_fields``):
    base pointer at field 14 (8 bytes, native ``Q``), total size at 15 (ASCII), slot layer
    ids at 18 (packed ``Q``); none when both are empty or zero."""
    import ast
    import dataclasses
    import struct
    from typing import Optional  # noqa: UP035 - names the wheel's annotations use

    from twin.reference.sglang_wheel import STAGING_HANDLER, read_sources, top_level, wheel_path

    source = read_sources(wheel_path(), [STAGING_HANDLER])[STAGING_HANDLER]
    cls = top_level(ast.parse(source), "StagingRegisterInfo", STAGING_HANDLER)
    import sys
    import types

    mod = types.ModuleType("sglang_staging_register_info")
    mod.__dict__.update(dataclasses=dataclasses, struct=struct, List=list, Optional=Optional)
    sys.modules[mod.__name__] = mod
    try:
        exec(compile(ast.Module(body=[cls], type_ignores=[]), STAGING_HANDLER, "exec"),
             mod.__dict__)
    finally:
        del sys.modules[mod.__name__]
    info_cls = mod.StagingRegisterInfo
    msg = [b""] * 14 + [struct.pack("Q", 0x7F00_0000_1000), b"4194304", b"1", b"0",
                        struct.pack("4Q", 0, 1, 32, 33)]
    info = info_cls.from_zmq_fields(msg, 14, slot_ids_index=18)
    assert (info.base_ptr, info.total_size, info.slot_layer_ids) == (
        0x7F00_0000_1000, 4 << 20, [0, 1, 32, 33])
    assert info_cls.from_zmq_fields([b""] * 16, 14, slot_ids_index=18) is None
    assert info_cls.from_zmq_fields(msg[:16], 14, slot_ids_index=18).slot_layer_ids == []


def test_num_writers_for_counts_tp_writers_times_pp_stages() -> None:
    """``DecodeStagingHandler.num_writers_for`` (TestMooncakePPStaging's fan-in fact) equals
    the twin's ``TwinConfig.num_writers`` for every layout."""
    import types

    m = load_machines()
    h = m.DecodeStagingHandler.__new__(m.DecodeStagingHandler)
    for p_tp, d_tp, pp in itertools.product((1, 2, 4, 8), (1, 2, 4), (1, 2, 3, 4)):
        h.decode_tp = d_tp
        h.kv_manager = types.SimpleNamespace(pp_size=1)
        receiver = types.SimpleNamespace(prefill_info=types.SimpleNamespace(
            attn_tp_size=p_tp, pp_size=pp))
        cfg = TwinConfig(prefill=ServerSide(tp_size=p_tp, pp_size=pp),
                         decode=ServerSide(tp_size=d_tp))
        assert h.num_writers_for(receiver) == cfg.num_writers, (p_tp, d_tp, pp)


def test_staging_response_targets_the_requesting_pp_rank() -> None:
    """SGLang's wire test ``TestMooncakePPStaging.test_staging_response_targets_requesting_pp_rank``
    as a fact about the twin: a room whose writers sit in PP stages 2 and 3, a STAGING_REQ
    naming PP rank 3 (prefill attention TP 1 -> decode TP 16 in the original; 1 -> 2 here):
    exactly one STAGING_RSP, to stage 3's writer."""
    cfg = TwinConfig(prefill=ServerSide(tp_size=1, pp_size=4), decode=ServerSide(tp_size=2),
                     model=MODEL, chunked_prefill_size=64, page_size=16,
                     staging_pool_size_bytes=1 << 20)
    d = DecodeRank(cfg, "d0g0r0", 0)
    d.handle(ev.DecodeRoomInit(room=7, prefill_ranks=("p0g0s2r0", "p0g0s3r0"),
                               prefill_attn_tp=1, decode_prefix_len=0, total_pages=1), 0.0)
    out = d.handle(ev.MessageArrived(src="p0g0s3r0", msg=wire.decode(
        [b"STAGING_REQ", b"7", b"0", b"1", b"d0g0r0", b"3"])), 0.0)
    rsps = [e for e in out if isinstance(e, ev.Send) and isinstance(e.msg, wire.StagingRsp)]
    assert [e.dst for e in rsps] == ["p0g0s3r0"]
