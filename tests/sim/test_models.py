"""Named models and GPUs: KV geometry, SGLang's head-split rule, serving knobs from launch
lines, KV pools, and the measured profiles against their source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from twin.core.config import ConfigError, ServerSide, TwinConfig
from twin.launch_args import config_from_launch
from twin.models.catalog import MODELS, check_tp, resolve_gpu, resolve_model
from twin.models.costs import Deployment, configure
from twin.models.profile import find_profile
from twin.runtime.params import ServingArgs, SimParams


def test_catalogue_kv_bytes_and_names() -> None:
    m = resolve_model("meta-llama/Llama-3.1-8B-Instruct")
    assert m.name == "Llama-3.1-8B" and m.kv_bytes_per_token == 131072
    assert 7.9e9 < m.params < 8.1e9
    assert 70e9 < MODELS["Llama-3.1-70B"].params < 71e9
    assert resolve_model("qwen2.5-7b").num_kv_heads == 4
    assert resolve_gpu("h200").memory_bytes > 140e9
    with pytest.raises(ConfigError, match="not a known model"):
        resolve_model("no-such-model")
    with pytest.raises(ConfigError, match="unknown GPU"):
        resolve_gpu("Z80")


def test_hf_config_json(tmp_path: Path) -> None:
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 24, "hidden_size": 2048,
           "num_attention_heads": 16, "num_key_value_heads": 4, "intermediate_size": 5632,
           "vocab_size": 32000, "max_position_embeddings": 4096, "torch_dtype": "float16"}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    out = configure(TwinConfig(), str(p))
    assert (out.model.num_layers, out.model.num_kv_heads, out.model.head_dim,
            out.model.dtype_bytes) == (24, 4, 128, 2)
    recorded = out.extra["serving"]["model_config"]
    assert recorded["num_layers"] == 24  # the run replays without the file
    assert Deployment.build(out, SimParams()).model.num_layers == 24
    mla = {**cfg, "kv_lora_rank": 512}
    p.write_text(json.dumps(mla))
    with pytest.raises(ConfigError, match="MLA"):
        configure(TwinConfig(), str(p))
    p.write_text("{")
    with pytest.raises(ConfigError, match="not a JSON config"):
        configure(TwinConfig(), str(p))


def test_head_splits_sglang_rejects() -> None:
    qwen = MODELS["Qwen2.5-7B"]  # 28 query heads, 4 KV heads
    check_tp(qwen, 4, "decode")
    with pytest.raises(ConfigError, match="28 attention heads"):
        check_tp(qwen, 8, "decode")
    llama = MODELS["Llama-3.1-8B"]  # 32 heads, 8 KV heads: TP16 replicates KV heads
    check_tp(llama, 16, "prefill")
    with pytest.raises(ConfigError, match="KV heads"):
        check_tp(MODELS["Qwen2.5-14B"], 5, "prefill")  # 40 heads, 8 KV heads
    cfg = TwinConfig(prefill=ServerSide(tp_size=8), decode=ServerSide(tp_size=2))
    with pytest.raises(ConfigError, match="prefill --tp-size 8"):
        configure(cfg, "Qwen2.5-7B")


def test_launch_lines_carry_serving_knobs_and_the_model() -> None:
    cfg = config_from_launch(
        "--tp-size 4 --max-total-tokens 200000 --max-running-requests 64 "
        "--model-path Qwen/Qwen2.5-32B-Instruct --kv-cache-dtype fp8_e4m3",
        "--tp-size 2 --mem-fraction-static 0.8 --num-reserved-decode-tokens 128 "
        "--disaggregation-decode-polling-interval 2 --kv-cache-dtype fp8_e4m3")
    serving = ServingArgs.from_config(cfg.extra)
    assert serving.prefill.max_total_tokens == 200000
    assert serving.prefill.max_running_requests == 64
    assert serving.decode.mem_fraction_static == 0.8
    assert serving.decode.num_reserved_decode_tokens == 128
    assert serving.decode.disaggregation_decode_polling_interval == 2
    out = configure(cfg)
    assert out.model.num_layers == 64 and out.model.dtype_bytes == 1  # fp8 KV: half the bytes
    d = Deployment.build(out, SimParams())
    assert d.prefill.max_total_tokens == 200000 and d.prefill.max_running_requests == 64
    assert d.decode.max_total_tokens > 0
    with pytest.raises(ConfigError, match="different models"):
        config_from_launch("--model-path Llama-3.1-8B", "--model-path Qwen2.5-7B")
    with pytest.raises(ConfigError, match="different dtypes"):
        configure(config_from_launch("--kv-cache-dtype fp8_e4m3", ""))


def test_serving_table_is_validated() -> None:
    with pytest.raises(ConfigError, match="serving.decode.max_total_tokens"):
        ServingArgs.from_config({"serving": {"decode": {"max_total_tokens": -1}}})
    with pytest.raises(ConfigError, match="serving.prefill.mem_fraction_static"):
        ServingArgs.from_config({"serving": {"prefill": {"mem_fraction_static": 1.5}}})
    with pytest.raises(ConfigError, match="serving.colour"):
        ServingArgs.from_config({"serving": {"colour": "red"}})
    with pytest.raises(ConfigError, match="sim.compute_costs"):
        SimParams.from_dict({"compute_costs": "guess"})


def test_kv_pool_follows_sglang_memory_rule() -> None:
    """70B at TP4 on H200: KV pool = (memory x mem_fraction_static - weights / TP) / KV bytes
    per token per rank; request slots as SGLang derives them."""
    cfg = configure(TwinConfig(prefill=ServerSide(tp_size=8), decode=ServerSide(tp_size=4)),
                    "Llama-3.1-70B", "H200")
    d = Deployment.build(cfg, SimParams())
    m, gpu = d.model, d.gpu
    frac = round((gpu.memory_bytes / 2**20 - 10240) / (gpu.memory_bytes / 2**20), 3)
    per_rank = 2 * 80 * 2 * 128 * 2  # 8 KV heads over TP4
    want = int((gpu.memory_bytes * frac - m.weight_bytes() / 4) // per_rank)
    assert d.decode.max_total_tokens == want
    assert d.decode.max_running_requests == min(max(min(int(want / 131072 * 512), 4096), 2048),
                                                want // 2)
    with pytest.raises(ConfigError, match="does not fit"):
        Deployment.build(configure(TwinConfig(prefill=ServerSide(tp_size=1),
                                              decode=ServerSide(tp_size=1)),
                                   "Llama-3.1-70B", "L40S"), SimParams())


def test_cost_source_is_named() -> None:
    plain = Deployment.build(TwinConfig(), SimParams())
    assert plain.source == "analytic"  # nothing named: the [sim] formulas
    named = Deployment.build(configure(TwinConfig(), "Llama-3.1-8B", "H200"), SimParams())
    assert named.source.startswith("profile aiconfigurator-core")
    forced = Deployment.build(configure(TwinConfig(), "Llama-3.1-8B", "H200"),
                              SimParams(compute_costs="analytic"))
    assert forced.source == "analytic"
    with pytest.raises(ConfigError, match="no profile"):
        Deployment.build(configure(TwinConfig(), gpu="A100"), SimParams(compute_costs="profile"))


# -- measured costs against their source ------------------------------------------------------
@pytest.mark.parametrize("gpu", ["H200", "H100", "B200"])
def test_profiles_match_their_source_off_grid(gpu: str) -> None:
    """Every shipped profile reproduces its source at points off its grid within 5%."""
    worst = 0.0
    for name in MODELS:
        for tp in (1, 2, 4, 8):
            prof = find_profile(name, gpu, tp)
            if prof is None:
                continue
            for tokens, ms in prof.check["prefill"]:
                worst = max(worst, abs(prof.prefill_s([(int(tokens), 0)]) / (ms * 1e-3) - 1))
            for batch, ctx, ms in prof.check["decode"]:
                worst = max(worst, abs(prof.decode_s(int(batch), int(batch * ctx))
                                       / (ms * 1e-3) - 1))
    assert worst < 0.05, worst


def test_llama_8b_tp4_h200_through_the_simulator() -> None:
    """The goal: Llama-3.1-8B TP4 on H200, prefill forward and decode step as the simulator
    computes them, within 5% of the source table from 256 to 8,192 tokens."""
    cfg = configure(TwinConfig(prefill=ServerSide(tp_size=4), decode=ServerSide(tp_size=4)),
                    "Llama-3.1-8B", "H200")
    d = Deployment.build(cfg, SimParams())
    prof = find_profile("Llama-3.1-8B", "H200", 4)
    assert prof is not None
    points = {int(t): ms for t, ms in prof.check["prefill"]}
    # The source's own numbers (aiconfigurator 0.12.0, sglang 0.5.14, h200_sxm, batch 1).
    points.update({256: 4.180492567915598, 512: 6.297904771998215, 1024: 11.008317009117507,
                   2048: 18.621772349194885, 4096: 37.90307987061077, 8192: 73.77426945220324})
    for tokens, ms in points.items():
        assert d.prefill.forward_s([(tokens, 0)]) == pytest.approx(ms * 1e-3, rel=0.05), tokens
    decode = {(1, 1024): 2.3959473131857223, (8, 8192): 2.889560970480237,
              (64, 1024): 3.1720956015270314, (64, 8192): 6.521516965158295}
    for (batch, ctx), ms in decode.items():
        got = d.decode.decode_step_s(batch, batch * ctx)
        assert got == pytest.approx(ms * 1e-3, rel=0.05), (batch, ctx)
