"""Named models and GPUs: the KV geometry and sizes a deployment's costs and memory follow.

A model is a catalogue name (``Llama-3.1-8B``, ``Qwen2.5-72B``, ...; case-insensitive, an
organisation prefix such as ``meta-llama/`` is ignored) or the path of a Hugging Face style
``config.json`` (``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim``, ``intermediate_size``, ``vocab_size``,
``max_position_embeddings``, ``torch_dtype``). Catalogue entries copy the fields of each model's
published ``config.json``. GPUs carry the numbers their vendor publishes (memory, HBM bandwidth,
dense BF16 tensor throughput), the same values aiconfigurator's system files use.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from twin.core.config import ConfigError, ModelShape

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the twin needs to know about a served model."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    context_len: int = 131072
    dtype_bytes: int = 2
    tie_word_embeddings: bool = False
    num_experts: int = 0  # MoE: experts per layer (0: dense)
    is_mla: bool = False

    @property
    def shape(self) -> ModelShape:
        """The KV geometry the protocol core works with."""
        return ModelShape(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                          head_dim=self.head_dim, dtype_bytes=self.dtype_bytes,
                          is_mla=self.is_mla)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over every layer and KV head (all ranks together)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def params(self) -> int:
        """Parameter count (embeddings included; an untied LM head counted once more)."""
        h, q, kv = self.hidden_size, self.num_attention_heads, self.num_kv_heads
        attn = h * (q + 2 * kv) * self.head_dim + q * self.head_dim * h
        mlp = 3 * h * self.intermediate_size * max(1, self.num_experts)
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class GPUSpec:
    """One accelerator: memory, HBM bandwidth and dense BF16 tensor throughput."""

    name: str
    memory_bytes: int
    hbm_Bps: float
    bf16_flops: float
    aiconfigurator_system: str = ""  # aiconfigurator's system name, where it has one


def _m(name: str, layers: int, hidden: int, heads: int, kv: int, inter: int, vocab: int,
       ctx: int, head_dim: int | None = None, tie: bool = False) -> ModelSpec:
    return ModelSpec(name=name, num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                     num_kv_heads=kv, head_dim=head_dim or hidden // heads,
                     intermediate_size=inter, vocab_size=vocab, context_len=ctx,
                     tie_word_embeddings=tie)


MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    _m("Llama-3.1-8B", 32, 4096, 32, 8, 14336, 128256, 131072),
    _m("Llama-3.1-70B", 80, 8192, 64, 8, 28672, 128256, 131072),
    _m("Llama-3.1-405B", 126, 16384, 128, 8, 53248, 128256, 131072),
    _m("Llama-3.2-1B", 16, 2048, 32, 8, 8192, 128256, 131072, head_dim=64, tie=True),
    _m("Llama-3.2-3B", 28, 3072, 24, 8, 8192, 128256, 131072, head_dim=128, tie=True),
    _m("Mistral-7B", 32, 4096, 32, 8, 14336, 32768, 32768),
    _m("Mistral-Small-24B", 40, 5120, 32, 8, 32768, 131072, 32768, head_dim=128),
    _m("Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064, 32768),
    _m("Qwen2.5-14B", 48, 5120, 40, 8, 13824, 152064, 32768),
    _m("Qwen2.5-32B", 64, 5120, 40, 8, 27648, 152064, 32768),
    _m("Qwen2.5-72B", 80, 8192, 64, 8, 29568, 152064, 32768),
    _m("Qwen3-8B", 36, 4096, 32, 8, 12288, 151936, 40960, head_dim=128),
    _m("Qwen3-32B", 64, 5120, 64, 8, 25600, 151936, 40960, head_dim=128),
)}

GPUS: dict[str, GPUSpec] = {g.name: g for g in (
    GPUSpec("H200", 151397597184, 4.8e12, 989e12, "h200_sxm"),
    GPUSpec("H100", 85899345920, 3.35e12, 989e12, "h100_sxm"),
    GPUSpec("B200", 193273528320, 7.7e12, 2250e12, "b200_sxm"),
    GPUSpec("A100", 85899345920, 2.039e12, 312e12, "a100_sxm"),
    GPUSpec("L40S", 48305799168, 0.864e12, 362.05e12, "l40s"),
)}
GPU_ALIASES = {"h200-sxm": "H200", "h200_sxm": "H200", "h100-sxm": "H100", "h100_sxm": "H100",
               "b200-sxm": "B200", "b200_sxm": "B200", "a100-sxm": "A100", "a100_sxm": "A100",
               "a100-80gb": "A100"}

DEFAULT_MODEL = "Llama-3.1-8B"
DEFAULT_GPU = "H200"

# The built-in scenarios' small GQA model (4 layers, 8 KV heads, head_dim 64, bf16): their runs
# stay fast. Known by its shape alone, it is named for what it is rather than "custom".
DEMO_SHAPE = ModelShape(num_layers=4, num_kv_heads=8, head_dim=64, dtype_bytes=2)
DEMO_MODEL = "twin-demo"


def _key(name: str) -> str:
    return name.rsplit("/", 1)[-1].lower().replace("meta-llama-", "llama-").replace("_", "-")


_BY_KEY = {_key(n): n for n in MODELS}
_BY_KEY.update({"llama-3.1-8b-instruct": "Llama-3.1-8B", "llama-3.1-70b-instruct": "Llama-3.1-70B",
                "mistral-7b-instruct-v0.3": "Mistral-7B", "mistral-7b-v0.3": "Mistral-7B",
                "qwen2.5-7b-instruct": "Qwen2.5-7B", "qwen2.5-32b-instruct": "Qwen2.5-32B",
                "qwen2.5-72b-instruct": "Qwen2.5-72B", "qwen2.5-14b-instruct": "Qwen2.5-14B"})

_DTYPES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4,
           "float8_e4m3fn": 1, "fp8": 1}


def resolve_model(spec: str) -> ModelSpec:
    """A catalogue name or a ``config.json`` path; ``ConfigError`` names what is wrong."""
    name = _BY_KEY.get(_key(spec))
    if name is not None:
        return MODELS[name]
    path = Path(spec)
    if path.suffix == ".json" or path.is_file() or path.is_dir():
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"--model {spec}: no such file") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"--model {spec}: not a JSON config: {exc}") from None
        return model_from_hf_config(data, source=str(path))
    raise ConfigError(f"--model {spec!r}: not a known model or a config.json; known: "
                      f"{', '.join(MODELS)}")


def model_from_hf_config(data: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """A model from a Hugging Face ``config.json`` (the text config of a multimodal one)."""
    if isinstance(data.get("text_config"), dict):
        data = {**data, **data["text_config"]}

    def need(key: str, *alts: str) -> int:
        for k in (key, *alts):
            v = data.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        raise ConfigError(f"{source}: field {key!r}: expected a positive integer, "
                          f"got {data.get(key)!r}")

    layers = need("num_hidden_layers", "n_layer", "num_layers")
    hidden = need("hidden_size", "n_embd", "d_model")
    heads = need("num_attention_heads", "n_head")
    kv = data.get("num_key_value_heads") or heads
    head_dim = data.get("head_dim") or hidden // heads
    dtype_name = str(data.get("torch_dtype") or data.get("dtype") or "bfloat16")
    if dtype_name not in _DTYPES:
        raise ConfigError(f"{source}: field 'torch_dtype': unknown dtype {dtype_name!r}")
    experts = int(data.get("num_local_experts") or data.get("num_experts") or 0)
    inter = int(data.get("moe_intermediate_size") if experts and data.get(
        "moe_intermediate_size") else data.get("intermediate_size") or 4 * hidden)
    name = str(data.get("_name_or_path") or Path(source).parent.name or "custom")
    return ModelSpec(
        name=name, num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_kv_heads=int(kv), head_dim=int(head_dim), intermediate_size=inter,
        vocab_size=int(data.get("vocab_size") or 32000),
        context_len=int(data.get("max_position_embeddings") or 131072),
        dtype_bytes=_DTYPES[dtype_name],
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        num_experts=experts, is_mla="kv_lora_rank" in data)


def model_from_shape(shape: ModelShape) -> ModelSpec:
    """A stand-in for a model known only by its KV geometry (a config's ``[model]`` table).

    The default shape is Llama-3.1-8B's; the scenarios' small shape is ``DEMO_MODEL``. Otherwise the attention width is taken as four query
    heads per KV head and the MLP as 3.5x the hidden size (Llama's proportions), so that
    weights and compute scale sensibly with the shape; name the model for real numbers.
    """
    for m in MODELS.values():
        if m.shape == shape:
            return m
    heads = 4 * shape.num_kv_heads
    hidden = heads * shape.head_dim
    name = DEMO_MODEL if shape == DEMO_SHAPE else "custom"
    return ModelSpec(name=name, num_layers=shape.num_layers, hidden_size=hidden,
                     num_attention_heads=heads, num_kv_heads=shape.num_kv_heads,
                     head_dim=shape.head_dim, intermediate_size=int(3.5 * hidden),
                     vocab_size=32000, dtype_bytes=shape.dtype_bytes, is_mla=shape.is_mla)


def resolve_gpu(name: str) -> GPUSpec:
    key = name.strip()
    for g in GPUS.values():
        if g.name.lower() == key.lower():
            return g
    alias = GPU_ALIASES.get(key.lower())
    if alias is not None:
        return GPUS[alias]
    raise ConfigError(f"--gpu {name!r}: unknown GPU; known: {', '.join(GPUS)}")


def check_tp(model: ModelSpec, tp: int, role: str) -> None:
    """SGLang's start-up rule for splitting attention heads over ``tp`` ranks: query heads
    divide evenly, KV heads divide evenly or are replicated (``tp`` a multiple of them)."""
    if model.num_attention_heads % tp:
        raise ConfigError(f"{role}: {model.name} has {model.num_attention_heads} attention heads, "
                          f"not divisible by attention TP size {tp}")
    kv = model.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise ConfigError(f"{role}: {model.name} has {kv} KV heads: attention TP size {tp} must "
                          f"divide them or be a multiple of them")
