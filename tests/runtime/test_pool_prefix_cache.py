"""The radix caches of ``Placement``: by default each prefill group's cache lives in its KV pool."""

from __future__ import annotations

import pytest

from twin.core.config import ConfigError, ServerSide, TwinConfig
from twin.core.topology import Topology
from twin.runtime.params import RADIX_IN_POOL, SimParams
from twin.runtime.placement import Placement
from twin.workloads import Request

CFG = TwinConfig(prefill=ServerSide(tp_size=2, dp_size=2, enable_dp_attention=True),
                 decode=ServerSide(tp_size=2))
TOPO = Topology(CFG)


def _req(rid: int, blocks: tuple[int, ...]) -> Request:
    return Request(rid, float(rid), len(blocks) * 512 + 10, 1, blocks, 512)


def test_the_default_prefill_cache_is_one_per_group_sized_to_its_pool() -> None:
    assert SimParams().prefill_radix_tokens == RADIX_IN_POOL
    p = Placement(CFG, TOPO, SimParams(), pools=(10 * 512, 8 * 512))
    a, b = p.prefill_caches
    assert a is not None and b is not None and a is not b
    assert a.capacity_blocks == 10 and p.decode_caches == [None]
    first = _req(0, (1, 2, 3))  # rid 0: prefill group 0
    p.prefill_done(first, 0, held_tokens=0)
    assert p.place(_req(2, (1, 2, 3, 4)), 0.0).prefill_prefix_len == 3 * 512  # group 0 hits
    assert p.place(_req(3, (1, 2, 3, 4)), 0.0).prefill_prefix_len == 0  # group 1 never saw it


def test_running_requests_take_pool_pages_from_the_cache() -> None:
    p = Placement(CFG, TOPO, SimParams(), pools=(10 * 512, 8 * 512))
    p.prefill_done(_req(0, (1, 2, 3, 4)), 0, held_tokens=0)
    assert p.cached_blocks("prefill") == 4
    # 8 blocks' worth of the pool held by requests: the cache keeps the 2 blocks left,
    # the prompt's leading blocks last (leaf-first eviction)
    p.prefill_done(_req(2, (1, 2, 3, 4)), 0, held_tokens=8 * 512)
    assert p.cached_blocks("prefill") == 2
    assert p.place(_req(4, (1, 2, 3, 4, 5)), 0.0).prefill_prefix_len == 2 * 512


def test_an_explicit_size_is_one_separate_cache_shared_by_every_group() -> None:
    p = Placement(CFG, TOPO, SimParams(prefill_radix_tokens=2_000_000), pools=(512, 512))
    a, b = p.prefill_caches
    assert a is b and a is not None and a.capacity_blocks == 2_000_000 // 512
    p.prefill_done(_req(0, (1, 2, 3)), 0, held_tokens=10**9)  # the pool does not bound it
    assert p.place(_req(3, (1, 2, 3, 4)), 0.0).prefill_prefix_len == 3 * 512
    off = Placement(CFG, TOPO, SimParams(prefill_radix_tokens=0), pools=(512, 512))
    assert off.prefill_caches == [None, None]


def test_decode_cache_in_its_pool_and_the_pool_is_required() -> None:
    p = Placement(CFG, TOPO, SimParams(decode_radix_tokens=RADIX_IN_POOL), pools=(512, 6 * 512))
    (d,) = p.decode_caches
    assert d is not None and d.capacity_blocks == 6
    with pytest.raises(ValueError, match="KV pool"):
        Placement(CFG, TOPO, SimParams())


def test_sim_table_accepts_minus_one_only_for_the_radix_sizes() -> None:
    assert SimParams.from_dict({"decode_radix_tokens": -1}).decode_radix_tokens == -1
    assert SimParams.from_dict({"prefill_radix_tokens": 0}).prefill_radix_tokens == 0
    for key, value in (("prefill_radix_tokens", -2), ("zmq_sndhwm", -1)):
        with pytest.raises(ConfigError, match=key):
            SimParams.from_dict({key: value})
