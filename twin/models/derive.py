"""Derive the shipped compute profiles from aiconfigurator's measured per-operator tables.

aiconfigurator (NVIDIA, Apache-2.0) ships per-operator latency tables collected from SGLang
on each GPU (GEMMs, attention, all-reduce, ...) and composes a model's forward pass from them.
This script asks it, for every catalogue model, GPU and attention-TP size, for:

* prefill: one forward of ``t`` new tokens after a cached prefix of ``p`` tokens (batch 1),
  split into attention and everything else, on a dense token grid;
* decode: one decode step of a batch of ``b`` requests with ``s`` context tokens each, split
  the same way;

and writes ``profiles/<gpu>.json.gz`` with the tables, a list of off-grid check points (the
source's own values where the grid has none, for the accuracy test) and the provenance.

Run (needs the optional ``profiles`` extra: ``pip install 'staging-twin[profiles]'``)::

    python -m twin.models.derive [--gpu H200 ...] [--model Llama-3.1-8B ...] [-o DIR]
    python -m twin.models.derive --check --gpu H200 --model Llama-3.1-8B --tp 4

``--check`` compares the shipped profiles with the source at every token count from 256 to
8,192 (prefill, batch 1) and on a dense grid of decode batches and contexts, and prints the
largest relative error.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gzip
import json
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from twin.models.catalog import GPUS, MODELS, ModelSpec, check_tp
from twin.models.profile import (
    DECODE_BATCH,
    DECODE_CTX,
    PREFILL_PREFIX,
    PREFILL_TOKENS,
    PROFILE_DIR,
)

TPS = (1, 2, 4, 8)
# Mistral is computed as the Llama architecture it shares (aiconfigurator has no Mistral class).
ARCH = {"Llama": "LlamaForCausalLM", "Mistral": "LlamaForCausalLM",
        "Qwen2.5": "Qwen2ForCausalLM", "Qwen3": "Qwen3ForCausalLM"}
SHIPPED = {"Llama-3.1-8B": "meta-llama/Meta-Llama-3.1-8B",
           "Llama-3.1-70B": "meta-llama/Meta-Llama-3.1-70B",
           "Llama-3.1-405B": "meta-llama/Meta-Llama-3.1-405B",
           "Qwen3-8B": "Qwen/Qwen3-8B", "Qwen3-32B": "Qwen/Qwen3-32B"}
CHECK_PREFILL = (300, 700, 1000, 1500, 2500, 3000, 5000, 6000, 7000)
CHECK_DECODE = ((3, 3000), (10, 700), (40, 1500), (100, 6000), (200, 300), (50, 8192),
                (1, 256), (64, 2048), (128, 4096), (256, 8192))


def _hf_config(m: ModelSpec) -> dict[str, Any]:
    arch = next(v for k, v in ARCH.items() if m.name.startswith(k))
    return {"architectures": [arch], "model_type": arch.replace("ForCausalLM", "").lower(),
            "num_hidden_layers": m.num_layers, "hidden_size": m.hidden_size,
            "num_attention_heads": m.num_attention_heads,
            "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
            "intermediate_size": m.intermediate_size, "vocab_size": m.vocab_size,
            "max_position_embeddings": m.context_len, "torch_dtype": "bfloat16",
            "tie_word_embeddings": m.tie_word_embeddings, "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0}


def _r(x: float) -> float:
    return float(f"{x:.5g}")


class Source:
    """aiconfigurator's model of one GPU's SGLang (imported lazily: an optional extra)."""

    def __init__(self, system: str) -> None:
        from aiconfigurator_core.sdk.backends.factory import get_backend
        from aiconfigurator_core.sdk.perf_database import get_database

        self.system = system
        self.db = get_database(system, "sglang", "current")
        self.version = str(self.db.version)
        self.backend = get_backend("sglang")
        self.tmp = Path(tempfile.mkdtemp(prefix="twin-derive-"))

    def model(self, m: ModelSpec, tp: int) -> Any:
        from aiconfigurator_core.sdk import config
        from aiconfigurator_core.sdk.models import get_model

        path = SHIPPED.get(m.name)
        if path is None:
            d = self.tmp / m.name
            d.mkdir(exist_ok=True)
            (d / "config.json").write_text(json.dumps(_hf_config(m)))
            path = str(d)
        return get_model(path, config.ModelConfig(tp_size=tp), "sglang")

    def prefill(self, model: Any, tokens: int, prefix: int) -> tuple[float, float]:
        """(total, attention) ms of one forward of ``tokens`` after ``prefix`` cached."""
        from aiconfigurator_core.sdk import config

        rc = config.RuntimeConfig(batch_size=1, isl=tokens + prefix, osl=1, prefix=prefix)
        d = self.backend._run_static_breakdown(model, self.db, rc, "static_ctx",
                                               include_energy=False)[0]
        return sum(d.values()), d.get("context_attention", 0.0)

    def decode(self, model: Any, batch: int, ctx: int) -> tuple[float, float]:
        """(total, attention) ms of one decode step of ``batch`` requests at ``ctx`` tokens."""
        from aiconfigurator_core.sdk import config

        rc = config.RuntimeConfig(batch_size=batch, isl=ctx, osl=2, prefix=0)
        total, _, ops, _, _ = self.backend._get_genonly_step_latency(
            model, self.db, rc, gen_tokens=batch, isl=ctx, osl=2)
        return total, ops.get("generation_attention", 0.0)


def derive_one(src: Source, m: ModelSpec, tp: int) -> dict[str, Any]:
    model = src.model(m, tp)
    linear, attn = [], []
    for t in PREFILL_TOKENS:
        total, a = src.prefill(model, t, 0)
        linear.append(_r(total - a))
    for p in PREFILL_PREFIX:
        attn.append([_r(src.prefill(model, t, p)[1]) for t in PREFILL_TOKENS])
    d_linear, d_attn = [], []
    for b in DECODE_BATCH:
        total, a = src.decode(model, b, DECODE_CTX[0])
        d_linear.append(_r(total - a))
    for s in DECODE_CTX:
        d_attn.append([_r(src.decode(model, b, s)[1]) for b in DECODE_BATCH])
    check_p = [[t, _r(src.prefill(model, t, 0)[0])] for t in CHECK_PREFILL]
    check_d = [[b, s, _r(src.decode(model, b, s)[0])] for b, s in CHECK_DECODE]
    return {"prefill": {"linear_ms": linear, "attn_ms": attn},
            "decode": {"linear_ms": d_linear, "attn_ms": d_attn},
            "check": {"prefill": check_p, "decode": check_d}}


def derive_gpu(gpu: str, models: list[str]) -> dict[str, Any]:
    g = GPUS[gpu]
    src = Source(g.aiconfigurator_system)
    out: dict[str, Any] = {
        "gpu": gpu,
        "provenance": {
            "source": f"aiconfigurator-core {metadata.version('aiconfigurator-core')}",
            "system": src.system, "framework": "sglang", "framework_version": src.version,
            "license": "Apache-2.0 (aiconfigurator, NVIDIA)",
            "method": "aiconfigurator's composition of measured per-operator tables: "
                      "prefill static_ctx at batch 1 (attention split out), decode "
                      "generation-only step (attention split out)",
            "derived_by": "python -m twin.models.derive",
            "date": _dt.date.today().isoformat(),
        },
        "grid": {"prefill_tokens": list(PREFILL_TOKENS), "prefill_prefix": list(PREFILL_PREFIX),
                 "decode_batch": list(DECODE_BATCH), "decode_ctx": list(DECODE_CTX)},
        "models": {},
    }
    for name in models:
        m = MODELS[name]
        per_tp: dict[str, Any] = {}
        for tp in TPS:
            try:
                check_tp(m, tp, "derive")
            except ValueError:
                continue
            per_tp[str(tp)] = derive_one(src, m, tp)
            print(f"{gpu} {name} TP{tp}", file=sys.stderr)
        out["models"][name] = per_tp
    return out


def check(gpu: str, models: list[str], tps: list[int]) -> None:
    """Print the largest relative error of the shipped profiles against the source."""
    from twin.models.profile import find_profile

    src = Source(GPUS[gpu].aiconfigurator_system)
    for name in models:
        for tp in tps:
            prof = find_profile(name, gpu, tp)
            if prof is None:
                continue
            model = src.model(MODELS[name], tp)
            pre = max(abs(prof.prefill_s([(t, 0)]) / (src.prefill(model, t, 0)[0] * 1e-3) - 1)
                      for t in range(256, 8193))
            dec = max(abs(prof.decode_s(b, b * c) / (src.decode(model, b, c)[0] * 1e-3) - 1)
                      for b in (1, 2, 3, 5, 7, 10, 20, 33, 50, 64, 77, 100, 128, 150, 200, 256,
                                300, 400, 512) for c in range(256, 8193, 301))
            print(f"{gpu} {name} TP{tp}: prefill 256-8192 tokens max error {pre:.4%}; "
                  f"decode max error {dec:.4%}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="append", choices=sorted(GPUS))
    ap.add_argument("--model", action="append", choices=sorted(MODELS))
    ap.add_argument("--tp", action="append", type=int, choices=TPS)
    ap.add_argument("--check", action="store_true", help="compare shipped profiles with the source")
    ap.add_argument("-o", "--out", type=Path, default=PROFILE_DIR)
    args = ap.parse_args(argv)
    if args.check:
        for gpu in args.gpu or ["H200"]:
            check(gpu, args.model or ["Llama-3.1-8B"], args.tp or list(TPS))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    for gpu in args.gpu or ["H200", "H100", "B200"]:
        data = derive_gpu(gpu, args.model or list(MODELS))
        path = args.out / f"{gpu.lower()}.json.gz"
        # mtime=0: the same tables give the same bytes.
        with path.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
            f.write(json.dumps(data, separators=(",", ":"), sort_keys=True).encode())
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
