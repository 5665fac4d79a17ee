"""Where a request goes and what is already cached: shared by the simulator and hardware mode.

Prefill and decode groups are chosen round-robin by request id; the decode-side and prefill-side
radix caches (``PrefixCache``) give the page-floored cached prefix of each side. By default a
prefill group's cache lives in its KV pool, as SGLang's radix cache does (``RADIX_IN_POOL``): it
holds what the pool's free pages hold and gives them up, least recently used first, as requests
take pages. Per-request overrides (scenarios) replace any of these.
"""

from __future__ import annotations

from twin.core.config import TwinConfig
from twin.core.grid import pages_for_tokens
from twin.core.topology import Topology
from twin.runtime.params import RADIX_IN_POOL, SimParams
from twin.runtime.requests import RequestState
from twin.workloads import PrefixCache, Request


class Placement:
    """Decides groups and cached prefixes; ``done`` feeds the radix caches."""

    def __init__(self, cfg: TwinConfig, topo: Topology, params: SimParams,
                 overrides: dict[int, dict[str, int]] | None = None,
                 pools: tuple[int, int] | None = None) -> None:
        """``pools``: the KV pool of one prefill and one decode group in tokens, needed when a
        side's radix cache lives in it (``RADIX_IN_POOL``)."""
        self.cfg = cfg
        self.topo = topo
        self.overrides = overrides or {}
        self.prefill_pool = pools[0] if pools else 0
        self.decode_pool = pools[1] if pools else 0
        self.prefill_in_pool = params.prefill_radix_tokens == RADIX_IN_POOL
        self.decode_in_pool = params.decode_radix_tokens == RADIX_IN_POOL
        self.prefill_caches = _caches(params.prefill_radix_tokens, len(topo.prefill_groups),
                                      self.prefill_pool, "prefill")
        self.decode_caches = _caches(params.decode_radix_tokens, len(topo.decode_groups),
                                     self.decode_pool, "decode")

    def place(self, r: Request, now: float) -> RequestState:
        page = self.cfg.page_size
        n_pg, n_dg = len(self.topo.prefill_groups), len(self.topo.decode_groups)
        o = self.overrides.get(r.rid, {})
        pg = o.get("prefill_group", r.rid % n_pg)
        dg = o.get("decode_group", r.rid % n_dg)
        dc, pc = self.decode_caches[dg], self.prefill_caches[pg]
        decode_prefix = dc.match(r) if dc is not None else 0
        prefill_prefix = pc.match(r) if pc is not None else 0
        req = RequestState(
            room=r.rid, rid=r.rid, arrival_s=now, input_len=r.input_len,
            output_len=r.output_len, prefill_group=pg, decode_group=dg,
            decode_prefix_len=o.get("decode_prefix_len", decode_prefix - decode_prefix % page),
            prefill_prefix_len=o.get("prefill_prefix_len", prefill_prefix - prefill_prefix % page),
        )
        req.extend_end = min(req.prefill_prefix_len, r.input_len - 1)
        return req

    def prefill_done(self, r: Request, group: int = 0, held_tokens: int = 0) -> None:
        """``r``'s prefill finished in prefill group ``group``, whose requests hold
        ``held_tokens`` of its KV pool now: its prompt joins that group's cache."""
        cache = self.prefill_caches[group]
        if cache is not None:
            cache.insert(r)
            if self.prefill_in_pool:
                cache.evict_to(max(0, self.prefill_pool - held_tokens) // r.block_tokens)

    def decode_done(self, r: Request, group: int = 0, held_tokens: int = 0) -> None:
        """``r`` finished decoding in decode group ``group`` (as ``prefill_done``)."""
        cache = self.decode_caches[group]
        if cache is not None:
            cache.insert(r)
            if self.decode_in_pool:
                cache.evict_to(max(0, self.decode_pool - held_tokens) // r.block_tokens)

    def cached_blocks(self, side: str) -> int:
        """Blocks the caches of ``side`` hold now (each shared cache once)."""
        caches = self.prefill_caches if side == "prefill" else self.decode_caches
        return sum(c.used_blocks for c in {id(c): c for c in caches if c is not None}.values())

    def total_pages(self, req: RequestState) -> int:
        """Pages decode receives: the suffix after its cached prefix."""
        return pages_for_tokens(req.input_len - req.decode_prefix_len, self.cfg.page_size)

    def arrival_record(self, req: RequestState) -> dict[str, object]:
        """The trace's ``RequestArrived`` record of ``req``."""
        pg = self.topo.prefill_groups[req.prefill_group]
        dg = self.topo.decode_groups[req.decode_group]
        return {
            "type": "RequestArrived", "room": req.room, "rid": str(req.rid),
            "input_len": req.input_len, "output_len": req.output_len,
            "decode_prefix_len": req.decode_prefix_len,
            "prefill_prefix_len": req.prefill_prefix_len,
            "prefill_node": [n.id for n in pg.nodes], "decode_node": [n.id for n in dg.nodes],
        }


def _caches(tokens: int, groups: int, pool: int, side: str) -> list[PrefixCache | None]:
    """One cache per group in its KV pool, one separate cache shared by all, or none."""
    if tokens == 0:
        return [None] * groups
    if tokens == RADIX_IN_POOL:
        if pool <= 0:
            raise ValueError(f"the {side} radix cache lives in the KV pool: give the pool size")
        return [PrefixCache.from_tokens(pool) for _ in range(groups)]
    shared = PrefixCache.from_tokens(tokens)
    return [shared] * groups
