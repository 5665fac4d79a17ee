"""TwinConfig: defaults, TOML loading, SGLang's staging start-up rules and derived values."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twin.core.config import ConfigError, MiB, ModelShape, ServerSide, TwinConfig


def write(tmp_path, text: str, name: str = "deploy.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


# --- defaults and loading ---------------------------------------------------------------------


def test_defaults_are_valid():
    cfg = TwinConfig()
    assert cfg.chunked_prefill_size == 8192 and cfg.page_size == 16
    assert cfg.prefill.tp_size == 4 and cfg.decode.tp_size == 2
    assert cfg.model == ModelShape()
    assert cfg.ring_bytes == 4096 * MiB
    assert TwinConfig.from_dict({}) == cfg


def test_error_type_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_from_toml(tmp_path):
    path = write(tmp_path, """
        chunked_prefill_size = 4096
        page_size = 64
        staging_pool_size_mb = 512
        waiting_timeout_s = 30

        [model]
        num_layers = 61
        num_kv_heads = 4
        head_dim = 128

        [prefill]
        tp_size = 8
        dp_size = 4
        enable_dp_attention = true

        [decode]
        tp_size = 1
        instances = 2

        [sim]
        seed = 3
        workload = "burst"
    """)
    cfg = TwinConfig.from_toml(path)
    assert cfg.chunked_prefill_size == 4096 and cfg.page_size == 64
    assert cfg.ring_bytes == 512 * MiB
    assert cfg.waiting_timeout_s == 30.0 and isinstance(cfg.waiting_timeout_s, float)
    assert cfg.model == ModelShape(num_layers=61, num_kv_heads=4, head_dim=128)
    assert cfg.prefill == ServerSide(tp_size=8, dp_size=4, enable_dp_attention=True)
    assert cfg.decode == ServerSide(tp_size=1, instances=2)
    assert cfg.extra == {"sim": {"seed": 3, "workload": "burst"}}  # unknown tables kept


def test_pool_size_bytes_wins(tmp_path):
    cfg = TwinConfig.from_toml(write(tmp_path, "staging_pool_size_bytes = 1000\n"))
    assert cfg.ring_bytes == 1000


def test_missing_file(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="no such file") as info:
        TwinConfig.from_toml(path)
    assert str(path) in str(info.value)


def test_bad_toml_names_the_file(tmp_path):
    path = write(tmp_path, "page_size = = 16\n", "broken.toml")
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        TwinConfig.from_toml(path)
    assert "broken.toml" in str(info.value)


# --- SGLang's start-up rules and type checks: each names file and field ----------------------

REJECTED = [
    pytest.param("chunked_prefill_size = 100\npage_size = 16\n", "chunked_prefill_size",
                 "multiple of page_size", id="cps-not-page-multiple"),
    pytest.param("chunked_prefill_size = 0\n", "chunked_prefill_size", "positive",
                 id="cps-zero"),
    pytest.param("chunked_prefill_size = -16\n", "chunked_prefill_size", "positive",
                 id="cps-negative"),
    pytest.param("page_size = 0\n", "page_size", "positive", id="page-size-zero"),
    pytest.param('disaggregation_transfer_backend = "nixl"\n[prefill]\npp_size = 2\n',
                 "prefill.pp_size", "SGLANG_DISAGG_STAGING_BUFFER with pp_size > 1 is only "
                 "supported by Mooncake.", id="prefill-pp-nixl"),
    pytest.param("[decode]\npp_size = 4\n", "decode.pp_size", "pp_size > 1", id="decode-pp"),
    pytest.param('disaggregation_transfer_backend = "mori"\n', "disaggregation_transfer_backend",
                 "SGLANG_DISAGG_STAGING_BUFFER requires disaggregation_transfer_backend="
                 "'mooncake' or 'nixl', got 'mori'.", id="backend-mori"),
    pytest.param("[model]\nis_mla = true\n", "model.is_mla", "MLA", id="mla"),
    pytest.param("enable_prefill_context_parallel = true\n", "enable_prefill_context_parallel",
                 "context parallelism", id="prefill-cp"),
    pytest.param("[model]\nnum_kv_heads = 12\n[prefill]\ntp_size = 3\n", "decode.tp_size",
                 "divide", id="tp-not-dividing"),
    pytest.param("[model]\nnum_kv_heads = 4\n[prefill]\ntp_size = 3\n", "prefill.tp_size",
                 "4 KV heads do not split over attention TP 3", id="head-split"),
    pytest.param("[decode]\ntp_size = 6\n", "decode.tp_size", "do not split",
                 id="head-split-decode"),
    pytest.param("[decode]\ntp_size = 4\ndp_size = 3\nenable_dp_attention = true\n",
                 "decode.dp_size", "divisible", id="dp-not-dividing"),
    pytest.param("[model]\nnum_kv_heads = 0\n", "model.num_kv_heads", "positive",
                 id="zero-heads"),
    pytest.param("transfer_queue_size = 0\n", "transfer_queue_size", "positive",
                 id="zero-queue"),
    pytest.param("waiting_timeout_s = -1.0\n", "waiting_timeout_s", "positive",
                 id="negative-timeout"),
    pytest.param("staging_pool_size_bytes = 0\n", "staging_pool_size_bytes", "positive",
                 id="zero-pool-bytes"),
    # unknown fields
    pytest.param("chunk_size = 8192\n", "chunk_size", "unknown", id="unknown-top"),
    pytest.param("[model]\nnum_heads = 8\n", "model.num_heads", "unknown", id="unknown-model"),
    pytest.param("[decode]\ntp = 2\n", "decode.tp", "unknown", id="unknown-side"),
    pytest.param("[modle]\nnum_layers = 2\n", "modle", "did you mean 'model'",
                 id="unknown-table"),
    pytest.param("[run]\nmax_concurrency = 2\n", "run", "unknown", id="trace-only-table"),
    pytest.param("[model]\nnum_layer = 2\n", "model.num_layer", "did you mean 'num_layers'",
                 id="misspelt-key"),
    pytest.param("chunked_prefil_size = 256\n", "chunked_prefil_size",
                 "did you mean 'chunked_prefill_size'", id="misspelt-top"),
    # wrong types
    pytest.param('page_size = "16"\n', "page_size", "integer", id="str-for-int"),
    pytest.param("page_size = 16.0\n", "page_size", "integer", id="float-for-int"),
    pytest.param("page_size = true\n", "page_size", "integer", id="bool-for-int"),
    pytest.param("[model]\nis_mla = 0\n", "model.is_mla", "true/false", id="int-for-bool"),
    pytest.param("[prefill]\ntp_size = [4]\n", "prefill.tp_size", "integer", id="list-for-int"),
    pytest.param('waiting_timeout_s = "30"\n', "waiting_timeout_s", "number",
                 id="str-for-float"),
    pytest.param("model = 3\n", "model", "table", id="scalar-for-section"),
]


@pytest.mark.parametrize(("text", "field", "why"), REJECTED)
def test_rejected_with_file_and_field(tmp_path, text, field, why):
    path = write(tmp_path, text, "rejected.toml")
    with pytest.raises(ConfigError) as info:
        TwinConfig.from_toml(path)
    msg = str(info.value)
    assert str(path) in msg, msg
    assert f"'{field}'" in msg, msg
    assert why in msg, msg


def test_binary_file_and_folder_are_rejected(tmp_path):
    binary = tmp_path / "blob.toml"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match="not a text file"):
        TwinConfig.from_toml(binary)
    with pytest.raises(ConfigError, match="is a directory"):
        TwinConfig.from_toml(tmp_path)


def test_a_file_layers_over_a_base(tmp_path):
    base = TwinConfig(prefill=ServerSide(tp_size=2), decode=ServerSide(tp_size=1),
                      staging_pool_size_bytes=1 << 20, chunked_prefill_size=256)
    path = write(tmp_path, "staging_pool_size_mb = 8\n[decode]\ntp_size = 2\n")
    cfg = TwinConfig.from_toml(path, base=base)
    assert (cfg.prefill.tp_size, cfg.decode.tp_size) == (2, 2)
    assert cfg.chunked_prefill_size == 256 and cfg.ring_bytes == 8 << 20


def test_head_split_matches_hardware_mode():
    """The simulator refuses the head splits the hardware mode's KV pattern refuses."""
    from twin.hw.kvpattern import rank_head_range

    for heads in (1, 2, 4, 8):
        for tp in (1, 2, 3, 4, 6, 8, 16):
            try:
                TwinConfig(model=ModelShape(num_kv_heads=heads), prefill=ServerSide(tp_size=tp),
                           decode=ServerSide(tp_size=tp))
                ok = True
            except ConfigError:
                ok = False
            try:
                rank_head_range(tp, 0, heads)
                hw_ok = True
            except ValueError:
                hw_ok = False
            assert ok == hw_ok, (heads, tp)


def test_direct_construction_validates():
    with pytest.raises(ConfigError, match="only supported by Mooncake"):
        TwinConfig(prefill=ServerSide(tp_size=2, pp_size=2), disaggregation_transfer_backend="nixl")
    with pytest.raises(ConfigError, match="chunked_prefill_size"):
        TwinConfig().replace(chunked_prefill_size=8200)


def test_from_dict_names_its_source():
    with pytest.raises(ConfigError, match=r"^cli: field 'page_size'"):
        TwinConfig.from_dict({"page_size": -1}, source="cli")


# --- to_dict / from_dict ----------------------------------------------------------------------


def test_to_dict_round_trip_defaults():
    cfg = TwinConfig()
    data = cfg.to_dict()
    assert "staging_pool_size_bytes" not in data  # None is left out, TOML has no null
    back = TwinConfig.from_dict(data)
    assert back == cfg and back.extra == {}


sides = st.builds(
    lambda tp_exp, dp_exp, dpa, inst: ServerSide(
        tp_size=2**tp_exp, dp_size=2 ** min(dp_exp, tp_exp), enable_dp_attention=dpa,
        instances=inst,
    ),
    st.integers(0, 4), st.integers(0, 3), st.booleans(), st.integers(1, 4),
)


@settings(derandomize=True, database=None, deadline=None, max_examples=200)
@given(
    prefill=sides, decode=sides,
    page_size=st.sampled_from([1, 16, 32, 64]), cps_pages=st.integers(1, 1024),
    pool_bytes=st.one_of(st.none(), st.integers(1, 2**40)),
    model=st.builds(ModelShape, num_layers=st.integers(1, 128), num_kv_heads=st.integers(1, 64),
                    head_dim=st.sampled_from([64, 128, 256]), dtype_bytes=st.sampled_from([1, 2])),
    timeout=st.floats(0.001, 1e4), sim=st.dictionaries(st.sampled_from("abc"), st.integers()),
)
def test_to_dict_from_dict_round_trip(prefill, decode, page_size, cps_pages, pool_bytes, model,
                                      timeout, sim):
    try:
        cfg = TwinConfig(
            model=model, prefill=prefill, decode=decode, page_size=page_size,
            chunked_prefill_size=cps_pages * page_size, staging_pool_size_bytes=pool_bytes,
            waiting_timeout_s=timeout, extra={"sim": sim} if sim else {},
        )
    except ConfigError:
        return  # attention TP sizes that do not divide each other
    back = TwinConfig.from_dict(cfg.to_dict())
    assert back == cfg
    assert back.extra == cfg.extra
    assert back.to_dict() == cfg.to_dict()


def test_round_trip_through_toml_text(tmp_path):
    cfg = TwinConfig(prefill=ServerSide(tp_size=8, dp_size=2, enable_dp_attention=True),
                     decode=ServerSide(tp_size=4), page_size=32, chunked_prefill_size=2048,
                     extra={"sim": {"seed": 1}})
    lines = []
    for key, value in cfg.to_dict().items():
        if not isinstance(value, dict):
            lines.append(f"{key} = {_toml(value)}")
    for key, value in cfg.to_dict().items():
        if isinstance(value, dict):
            lines.append(f"[{key}]")
            lines += [f"{k} = {_toml(v)}" for k, v in value.items()]
    back = TwinConfig.from_toml(write(tmp_path, "\n".join(lines) + "\n"))
    assert back == cfg and back.extra == cfg.extra


def _toml(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


# --- derived values ---------------------------------------------------------------------------


def test_grid_values():
    cfg = TwinConfig()
    assert cfg.grid_tokens == 8192 and cfg.full_chunk_pages == 512
    cfg = TwinConfig(chunked_prefill_size=4096, page_size=64)
    assert cfg.grid_tokens == 4096 and cfg.full_chunk_pages == 64
    cfg = TwinConfig(chunked_prefill_size=48, page_size=16)
    assert cfg.grid_tokens == 48 and cfg.full_chunk_pages == 3
    assert TwinConfig(page_size=1, chunked_prefill_size=1).full_chunk_pages == 1


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "writers"),
    [(4, 2, 2), (1, 2, 1), (2, 2, 1), (8, 1, 8), (2, 8, 1), (16, 4, 4)],
)
def test_num_writers(prefill_tp, decode_tp, writers):
    cfg = TwinConfig(prefill=ServerSide(tp_size=prefill_tp), decode=ServerSide(tp_size=decode_tp))
    assert cfg.num_writers == writers


def test_attention_tp_under_dp_attention():
    side = ServerSide(tp_size=8, dp_size=4, enable_dp_attention=True)
    assert side.attn_tp_size == 2 and side.attn_dp_size == 4
    plain = ServerSide(tp_size=8, dp_size=4)  # dp_size ignored without DP attention
    assert plain.attn_tp_size == 8 and plain.attn_dp_size == 1
    cfg = TwinConfig(prefill=side, decode=ServerSide(tp_size=1))
    assert cfg.num_writers == 2  # attention TP 2 -> 1, not 8 -> 1
    cfg = TwinConfig(prefill=ServerSide(tp_size=4),
                     decode=ServerSide(tp_size=8, dp_size=8, enable_dp_attention=True))
    assert cfg.decode.attn_tp_size == 1 and cfg.num_writers == 4


def test_bytes_per_head_token():
    cfg = TwinConfig(model=ModelShape(head_dim=128, dtype_bytes=2))
    assert cfg.bytes_per_head_token == 256


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TwinConfig().page_size = 32  # type: ignore[misc]


# --- the transfer backend ---------------------------------------------------------------------

def test_transfer_backend_defaults_to_mooncake_as_in_sglang():
    assert TwinConfig().disaggregation_transfer_backend == "mooncake"
    cfg = TwinConfig(prefill=ServerSide(tp_size=2, pp_size=2))  # Mooncake stages with PP > 1
    assert cfg.num_writers == 2  # 1 TP writer (TP2 -> TP2) x 2 PP stages
    assert TwinConfig.from_dict(cfg.to_dict()) == cfg


def test_pp_layer_ranges_match_sglang_get_pp_indices():
    from twin.core.config import pp_layer_range

    # SGLang: an even split, the last ``remainder`` stages one layer more.
    assert [pp_layer_range(32, s, 2) for s in range(2)] == [(0, 16), (16, 32)]
    assert [pp_layer_range(32, s, 3) for s in range(3)] == [(0, 10), (10, 21), (21, 32)]
    assert [pp_layer_range(33, s, 2) for s in range(2)] == [(0, 16), (16, 33)]
