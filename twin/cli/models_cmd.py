"""``twin models``: the model catalogue, the GPUs and the shipped compute profiles."""

from __future__ import annotations

import click

from twin.cli.common import emit_json


@click.command("models")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def models_command(as_json: bool) -> None:
    """List the models and GPUs --model and --gpu accept, and which have measured profiles."""
    from twin.models.catalog import GPUS, MODELS
    from twin.models.profile import _load, available

    profiles = available()
    if as_json:
        emit_json({
            "models": {n: {**m.to_dict(), "kv_bytes_per_token": m.kv_bytes_per_token,
                           "params": m.params} for n, m in MODELS.items()},
            "gpus": {n: {"memory_bytes": g.memory_bytes, "hbm_Bps": g.hbm_Bps,
                         "bf16_flops": g.bf16_flops} for n, g in GPUS.items()},
            "profiles": profiles,
            "provenance": {g: (_load(g) or {}).get("provenance", {}) for g in profiles},
        })
        return
    click.echo(f"{'model':<18} {'layers':>6} {'heads':>5} {'kv':>3} {'dim':>4} "
               f"{'KV/token':>9} {'params':>7}  profiles (GPU: TP sizes)")
    for name, m in MODELS.items():
        prof = "; ".join(f"{g}: {','.join(map(str, tps[name]))}" for g, tps in profiles.items()
                         if name in tps)
        click.echo(f"{name:<18} {m.num_layers:>6} {m.num_attention_heads:>5} {m.num_kv_heads:>3} "
                   f"{m.head_dim:>4} {m.kv_bytes_per_token // 1024:>7}Ki {m.params / 1e9:>6.1f}B"
                   f"  {prof or '-'}")
    click.echo("")
    for name, g in GPUS.items():
        click.echo(f"{name:<6} {g.memory_bytes / 2**30:6.0f} GiB  {g.hbm_Bps / 1e12:4.2f} TB/s  "
                   f"{g.bf16_flops / 1e12:6.0f} TFLOPS bf16")
    for gpu in profiles:
        p = (_load(gpu) or {}).get("provenance", {})
        click.echo(f"\nprofiles {gpu}: {p.get('source')} ({p.get('framework')} "
                   f"{p.get('framework_version')}, {p.get('system')}), {p.get('license')}; "
                   f"{p.get('method')}")
    click.echo("\nAny other model: --model path/to/config.json (Hugging Face format).")


COMMANDS = [models_command]
