"""A PP prefill's bytes, moved as the hardware mode moves them, on the core's own effects.

The loopback cluster runs the protocol (prefill TP2 x PP2 -> decode TP1 or TP4, an uneven layer
split) and this driver carries out its ``StartTransfer`` and ``StartScatter`` effects on torch
tensors with the hardware mode's kernels: each PP stage's prefill rank holds its own layers'
KV pool, gathers them and writes its layer slots of the staged chunk (``pp_stage_write``, one
block per slot as SGLang's Mooncake staging pairs them); each decode rank scatters every layer
from its ring and checks every page against the pattern. No processes: what this checks is the
layout, which the rank processes (tests/hw/test_pp_hardware.py) use unchanged.
"""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch

from twin.core import events as ev
from twin.core.config import ModelShape, ServerSide, TwinConfig, pp_layer_range
from twin.core.grid import pages_for_tokens
from twin.core.layout import compute_head_slice_params, pp_slot_blocks, pp_stage_write
from twin.explore.loopback import Cluster
from twin.hw.kernels import TORCH_BACKEND
from twin.hw.kvpattern import fill_prefill_pool, rank_head_range, verify_decode_pool
from twin.hw.pools import DTYPES, KVPool, byte_buffer
from twin.reference.sglang_wheel import ReferenceUnavailable, load, offline

# Five layers over two stages: stage 0 holds layers 0-1, stage 1 layers 2-4 (SGLang's split).
MODEL = ModelShape(num_layers=5, num_kv_heads=4, head_dim=8, dtype_bytes=2)


class ByteCluster(Cluster):
    """The loopback cluster with real bytes: pools, rings, gathers, writes and scatters."""

    def __init__(self, cfg: TwinConfig, *, slots: bool = True) -> None:
        super().__init__(cfg)
        self.slots = slots  # False: write the core's span as is (the wrong layout, on purpose)
        m = cfg.model
        self.pools: dict[str, KVPool] = {}
        self.layers: dict[str, tuple[int, int]] = {}
        self.heads: dict[str, range] = {}
        for n in self.topo.nodes.values():
            side = getattr(cfg, n.role)
            self.layers[n.id] = pp_layer_range(m.num_layers, n.pp_rank, side.pp_size)
            self.heads[n.id] = rank_head_range(side.attn_tp_size, n.rank, m.num_kv_heads)
            first, stop = self.layers[n.id]
            self.pools[n.id] = KVPool(stop - first, 64, cfg.page_size, len(self.heads[n.id]),
                                      m.head_dim, DTYPES[m.dtype_bytes], torch.device("cpu"))
            # Pages handed out in a shuffled order, so a chunk's pages are not contiguous.
            self.pools[n.id].free_pages = deque(random.Random(n.id).sample(range(64), 64))
        self.rings = {n.id: byte_buffer(cfg.ring_bytes, torch.device("cpu"))
                      for n in self.topo.nodes.values() if n.role == "decode"}
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}
        self.wrong: list[str] = []
        self.checked: dict[tuple[str, int], set[int]] = {}
        self.inputs: dict[int, int] = {}

    def request(self, room: int, input_len: int) -> None:
        self.inputs[room] = input_len
        pages = pages_for_tokens(input_len, self.cfg.page_size)
        for n in self.topo.nodes.values():
            got = self.pools[n.id].alloc(room, pages)
            if n.role == "prefill":
                fill_prefill_pool(self.pools[n.id].k, self.pools[n.id].v, got,
                                  self.cfg.page_size, request=room,
                                  head_offset=self.heads[n.id].start,
                                  layer_offset=self.layers[n.id][0])
        self.add_request(room, input_len)

    def start_transfer(self, node: str, e: ev.StartTransfer) -> None:
        cfg = self.cfg
        pool = self.pools[node]
        pages = pool.pages_of(e.room)[e.page_start:e.page_start + e.num_pages]
        src_head, nh, _, _ = compute_head_slice_params(
            cfg.prefill.attn_tp_size, cfg.decode.attn_tp_size, self.topo.nodes[node].rank,
            e.decode_rank, cfg.model.num_kv_heads)
        if (node, e.worker) not in self.buffers:  # a transfer worker's staging buffer
            self.buffers[(node, e.worker)] = byte_buffer(1 << 16, pool.k[0].device)
        buf = self.buffers[(node, e.worker)]
        n = TORCH_BACKEND.gather_to_staging(pool.k, pool.v, pages, cfg.page_size, src_head, nh,
                                            buf)
        assert n == e.nbytes
        ring = self.rings[e.session]
        first, stop = self.layers[node]
        base, blocks = (pp_stage_write(e.dst_offset, e.nbytes, cfg.model.num_layers, first, stop)
                        if self.slots else (e.dst_offset, ((0, 0, e.nbytes),)))
        for lo, ro, length in blocks:
            ring[base + ro:base + ro + length] = buf[lo:lo + length]
        super().start_transfer(node, e)

    def start_scatter(self, node: str, e: ev.StartScatter) -> None:
        cfg = self.cfg
        pool = self.pools[node]
        pages = pool.pages_of(e.room)[e.page_start:e.page_start + e.num_pages]
        rank = self.topo.nodes[node].rank
        TORCH_BACKEND.scatter_from_staging(
            self.rings[node][e.offset:e.offset + e.nbytes], pool.k, pool.v, pages,
            cfg.page_size, e.prefill_attn_tp, cfg.decode.attn_tp_size, rank,
            cfg.model.num_kv_heads)
        page = cfg.page_size
        count = min(e.num_pages * page, self.inputs[e.room] - e.page_start * page)
        tokens = pool.token_indices(pool.pages_of(e.room), e.page_start * page, count)
        wrong = verify_decode_pool(pool.k, pool.v, e.room,
                                   range(e.page_start * page, e.page_start * page + count),
                                   tokens, self.heads[node])
        if wrong is not None:
            self.wrong.append(f"{node}: {wrong}")
        self.checked.setdefault((node, e.room), set()).update(
            range(e.page_start, e.page_start + e.num_pages))
        super().start_scatter(node, e)


def _cfg(decode_tp: int) -> TwinConfig:
    return TwinConfig(prefill=ServerSide(tp_size=2, pp_size=2),
                      decode=ServerSide(tp_size=decode_tp), model=MODEL,
                      chunked_prefill_size=64, page_size=16, staging_pool_size_bytes=1 << 18)


@pytest.mark.parametrize("decode_tp", [1, 4])
def test_every_stage_writes_its_layer_slots_and_decode_scatters_every_layer(
        decode_tp: int) -> None:
    c = ByteCluster(_cfg(decode_tp))
    lengths = {0: 200, 1: 64, 2: 130}  # several chunks, one whole chunk, a partial page
    for room, n in lengths.items():
        c.request(room, n)
    c.run()
    assert not c.unfinished()
    assert all(c.outcome(r) == "Success" for r in lengths)
    assert c.wrong == []
    decode = [n.id for n in c.topo.nodes.values() if n.role == "decode"]
    for room, n in lengths.items():  # every page of every room on every decode rank checked
        for d in decode:
            assert c.checked[(d, room)] == set(range(pages_for_tokens(n, 16)))


def test_the_cores_span_written_as_is_puts_layers_in_the_wrong_slots() -> None:
    """Control: the same run with each stage's bytes written as the core's one span (its K
    and V layers back to back at the stage's share of the block) scatters wrong layers, and
    the check names them; the slot layout above is what makes the bytes right."""
    c = ByteCluster(_cfg(1), slots=False)
    c.request(0, 200)
    c.run()
    assert c.wrong and "layer" in c.wrong[0]


def test_slot_blocks_are_sglangs_pairing_of_layer_ids() -> None:
    """``pp_slot_blocks`` places each stage's slots where SGLang's
    ``build_transfer_entry_pairs`` (from the wheel) pairs the stage's slot layer ids (its K
    layers then its V layers) with decode's (every K layer then every V layer)."""
    import ast
    import collections
    import zipfile

    try:
        wheel = load().wheel
    except ReferenceUnavailable as exc:
        if offline():
            pytest.skip(str(exc))
        raise
    path = "sglang/srt/disaggregation/utils.py"
    with zipfile.ZipFile(wheel) as zf:
        tree = ast.parse(zf.read(path).decode(), filename=path)
    fn = next(n for n in tree.body
              if isinstance(n, ast.FunctionDef) and n.name == "build_transfer_entry_pairs")
    namespace: dict[str, object] = {"deque": collections.deque, "List": list, "Tuple": tuple}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), path, "exec"), namespace)
    pairs_of = namespace["build_transfer_entry_pairs"]
    slot = 96
    for layers, pp in ((4, 2), (5, 2), (7, 3), (32, 4)):
        dst_ids = [*range(layers), *range(layers)]
        for stage in range(pp):
            first, stop = pp_layer_range(layers, stage, pp)
            src_ids = [*range(first, stop), *range(first, stop)]
            pairs = pairs_of(src_ids, dst_ids, len(src_ids), len(dst_ids))  # type: ignore[operator]
            want = tuple((i * slot, j * slot, slot) for i, j in pairs)
            assert pp_slot_blocks(slot, layers, first, stop) == want, (layers, pp, stage)
