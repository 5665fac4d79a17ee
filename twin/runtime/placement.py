"""Where a request goes and what is already cached: shared by the simulator and hardware mode.

Prefill and decode groups are chosen round-robin by request id; the decode-side and prefill-side
radix caches (``PrefixCache``) give the page-floored cached prefix of each side. Per-request
overrides (scenarios) replace any of these.
"""

from __future__ import annotations

from twin.core.config import TwinConfig
from twin.core.grid import pages_for_tokens
from twin.core.topology import Topology
from twin.runtime.params import SimParams
from twin.runtime.requests import RequestState
from twin.workloads import PrefixCache, Request


class Placement:
    """Decides groups and cached prefixes; ``done`` feeds the radix caches."""

    def __init__(self, cfg: TwinConfig, topo: Topology, params: SimParams,
                 overrides: dict[int, dict[str, int]] | None = None) -> None:
        self.cfg = cfg
        self.topo = topo
        self.overrides = overrides or {}
        self.prefill_cache = (PrefixCache.from_tokens(params.prefill_radix_tokens)
                              if params.prefill_radix_tokens else None)
        self.decode_cache = (PrefixCache.from_tokens(params.decode_radix_tokens)
                             if params.decode_radix_tokens else None)

    def place(self, r: Request, now: float) -> RequestState:
        page = self.cfg.page_size
        n_pg, n_dg = len(self.topo.prefill_groups), len(self.topo.decode_groups)
        decode_prefix = self.decode_cache.match(r) if self.decode_cache else 0
        prefill_prefix = self.prefill_cache.match(r) if self.prefill_cache else 0
        o = self.overrides.get(r.rid, {})
        req = RequestState(
            room=r.rid, rid=r.rid, arrival_s=now, input_len=r.input_len,
            output_len=r.output_len, prefill_group=o.get("prefill_group", r.rid % n_pg),
            decode_group=o.get("decode_group", r.rid % n_dg),
            decode_prefix_len=o.get("decode_prefix_len", decode_prefix - decode_prefix % page),
            prefill_prefix_len=o.get("prefill_prefix_len", prefill_prefix - prefill_prefix % page),
        )
        req.extend_end = min(req.prefill_prefix_len, r.input_len - 1)
        return req

    def prefill_done(self, r: Request) -> None:
        if self.prefill_cache is not None:
            self.prefill_cache.insert(r)

    def decode_done(self, r: Request) -> None:
        if self.decode_cache is not None:
            self.decode_cache.insert(r)

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
