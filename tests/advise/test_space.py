"""Axes, points and how a point becomes one run's config."""

from __future__ import annotations

import pytest

from twin.advise.space import (
    AxisError,
    Base,
    Point,
    build_run,
    canonical_name,
    grid,
    parse_axis,
    parse_seeds,
    point_id,
)
from twin.core.config import ConfigError, TwinConfig


def test_value_lists_ranges_and_aliases() -> None:
    assert parse_axis("ring_mb=16,32,64").name == "staging_pool_size_mb"
    assert parse_axis("ring_mb=16,32,64").values == (16, 32, 64)
    assert parse_axis("cps=1024:8192:x2").values == (1024, 2048, 4096, 8192)
    assert parse_axis("page=16:64:16").values == (16, 32, 48, 64)
    assert parse_axis("rate_scale=0.5,1,2").values == (0.5, 1.0, 2.0)
    assert parse_axis("ranks_per_nic=1,2").name == "sim.ranks_per_nic"
    assert parse_axis("sim.zmq_jitter_s=0,2e-5").values == (0.0, 2e-5)
    assert parse_axis("prefill_radix_tokens=0,1e6").values == (0, 1_000_000)
    assert parse_axis("prefill.enable_dp_attention=true,false").values == (True, False)
    assert parse_axis("decode_args=--tp-size 2|--tp-size 4").values == ("--tp-size 2",
                                                                         "--tp-size 4")
    assert parse_axis("env.SGLANG_DISAGG_STAGING_POOL_SIZE_MB=8,16").values == (8, 16)
    assert parse_axis("ring_mb=16,16,32").values == (16, 32)  # duplicates dropped


@pytest.mark.parametrize("text, fragment", [
    ("ring_mb", "expected NAME=VALUES"),
    ("nonsense=1", "unknown"),
    ("prefill.nonsense=1", "unknown field"),
    ("sim.nonsense=1", "unknown cost parameter"),
    ("env.HOME=1", "unknown staging variable"),
    ("ring_mb=1.5", "not a valid int"),
    ("ring_mb=abc", "not a valid int"),
    ("cps=8:1:x2", "needs START <= STOP"),
    ("cps=1:8:x1", "FACTOR > 1"),
    ("rate_scale=inf", "not a valid float"),
])
def test_bad_axes_name_the_problem(text: str, fragment: str) -> None:
    with pytest.raises(AxisError, match=fragment):
        parse_axis(text)


def test_seeds() -> None:
    assert parse_seeds("0,1,2") == (0, 1, 2)
    assert parse_seeds("3:6") == (3, 4, 5)
    with pytest.raises(AxisError):
        parse_seeds("a")
    with pytest.raises(AxisError):
        parse_seeds("5:5")


def test_grid_is_every_combination_times_seeds() -> None:
    pts = grid([parse_axis("ring_mb=8,16"), parse_axis("cps=512,1024,2048")], (0, 1))
    assert len(pts) == 12 and len(set(pts)) == 12
    assert pts[0] == Point((("chunked_prefill_size", 512), ("staging_pool_size_mb", 8)), 0)
    with pytest.raises(AxisError, match="twice"):
        grid([parse_axis("ring_mb=8"), parse_axis("staging_pool_size_mb=16")], (0,))


def test_build_run_applies_launch_lines_then_fields() -> None:
    base = Base(cfg=TwinConfig(staging_pool_size_bytes=3 << 20))
    p = Point.of({"prefill_args": "--tp-size 4 --dp-size 2 --enable-dp-attention "
                                  "--chunked-prefill-size 1024",
                  "decode.tp_size": 4, "ring_mb": 32, "ranks_per_nic": 1, "rate_scale": 2})
    cfg, params, scale = build_run(base, p)
    assert (cfg.prefill.tp_size, cfg.prefill.dp_size, cfg.prefill.enable_dp_attention) == (4, 2,
                                                                                          True)
    assert cfg.chunked_prefill_size == 1024 and cfg.decode.tp_size == 4
    assert cfg.ring_bytes == 32 << 20  # the swept size wins over the base's byte size
    assert params.ranks_per_nic == 1 and scale == 2.0
    assert build_run(base, Point.of({"env.SGLANG_DISAGG_STAGING_POOL_SIZE_MB": 9}))[0] \
        .staging_pool_size_mb == 9


def test_invalid_combinations_raise_config_errors() -> None:
    base = Base(cfg=TwinConfig())
    with pytest.raises(ConfigError, match="multiple of page_size"):
        build_run(base, Point.of({"cps": 1000}))
    with pytest.raises(ConfigError):
        build_run(base, Point.of({"prefill.tp_size": 3}))


def test_point_ids_depend_on_base_point_and_seed() -> None:
    a, b = Base(cfg=TwinConfig()), Base(cfg=TwinConfig(staging_pool_size_mb=64))
    p = Point.of({"cps": 1024})
    fa, fb = a.fingerprint("w"), b.fingerprint("w")
    assert fa == Base(cfg=TwinConfig()).fingerprint("w")
    assert len({fa, fb, a.fingerprint("other workload")}) == 3
    assert point_id(fa, p) != point_id(fa, Point(p.assign, 1)) != point_id(fb, p)
    assert canonical_name("cps") == "chunked_prefill_size"
