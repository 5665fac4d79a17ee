"""Translate SGLang launch arguments and staging environment variables into a ``TwinConfig``.

Users describe deployments the way they launch them::

    prefill: python -m sglang.launch_server --tp-size 4 --dp-size 4 --enable-dp-attention \
             --chunked-prefill-size 256 --page-size 16 --disaggregation-mode prefill
    decode:  python -m sglang.launch_server --tp-size 8 --disaggregation-mode decode
    env:     SGLANG_DISAGG_STAGING_BUFFER=1 SGLANG_DISAGG_STAGING_POOL_SIZE_MB=4096

Read: the arguments that shape the staging protocol (parallelism, chunking, pages), each
server's memory and scheduling knobs (``--max-total-tokens``, ``--mem-fraction-static``,
``--max-running-requests``, ``--max-prefill-tokens``, ``--num-reserved-decode-tokens``,
``--disaggregation-decode-polling-interval``, ``--kv-cache-dtype``; kept in the config's
``[serving.prefill]`` / ``[serving.decode]`` tables) and ``--model-path`` (a catalogue name, or
a directory or file holding a Hugging Face ``config.json``). Other arguments are ignored.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Mapping
from typing import Any

from twin.core.config import ConfigError, ServerSide, TwinConfig

ENV_FIELDS = {
    "SGLANG_DISAGG_STAGING_POOL_SIZE_MB": ("staging_pool_size_mb", int),
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": ("waiting_timeout_s", float),
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": ("bootstrap_timeout_s", float),
    "SGLANG_DISAGGREGATION_QUEUE_SIZE": ("transfer_queue_size", int),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--tp-size", "--tp", type=int, default=1)
    p.add_argument("--dp-size", "--dp", type=int, default=1)
    p.add_argument("--pp-size", "--pp", type=int, default=1)
    p.add_argument("--enable-dp-attention", action="store_true")
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--enable-prefill-context-parallel", action="store_true")
    p.add_argument("--disaggregation-mode", default=None)
    p.add_argument("--model-path", "--model", default=None)
    for name in SERVING_INT_ARGS:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--kv-cache-dtype", default=None)
    return p


SERVING_INT_ARGS = ("max_total_tokens", "max_running_requests", "max_prefill_tokens",
                    "num_reserved_decode_tokens", "disaggregation_decode_polling_interval")
"""Integer serving knobs read from a launch line (SGLang's names, underscores for dashes)."""


def serving_args(args: argparse.Namespace) -> dict[str, Any]:
    """The serving knobs a parsed launch line sets (only those given)."""
    out: dict[str, Any] = {n: getattr(args, n) for n in SERVING_INT_ARGS
                           if getattr(args, n) is not None}
    if args.mem_fraction_static is not None:
        out["mem_fraction_static"] = args.mem_fraction_static
    if args.kv_cache_dtype is not None:
        out["kv_cache_dtype"] = args.kv_cache_dtype
    return out


def parse_server_args(line: str, role: str) -> tuple[ServerSide, dict[str, Any]]:
    """One server's launch line as ``ServerSide`` plus the shared fields it sets."""
    try:
        args, _ = _parser().parse_known_args(shlex.split(line))
    except (SystemExit, ValueError) as exc:
        raise ConfigError(f"{role} launch arguments: cannot parse {line!r}: {exc}") from None
    if args.disaggregation_mode not in (None, role):
        raise ConfigError(f"{role} launch arguments: field '--disaggregation-mode' is "
                          f"{args.disaggregation_mode!r}, expected {role!r}")
    side = ServerSide(tp_size=args.tp_size, dp_size=args.dp_size,
                      enable_dp_attention=args.enable_dp_attention, pp_size=args.pp_size)
    shared: dict[str, Any] = {}
    if args.chunked_prefill_size is not None and role == "prefill":
        shared["chunked_prefill_size"] = args.chunked_prefill_size
    if args.page_size is not None:
        shared["page_size"] = args.page_size
    if args.enable_prefill_context_parallel:
        shared["enable_prefill_context_parallel"] = True
    shared["serving"] = serving_args(args)
    if args.model_path is not None:
        shared["model_path"] = args.model_path
    return side, shared


def config_from_launch(prefill: str, decode: str, env: Mapping[str, str] | None = None,
                       base: TwinConfig | None = None) -> TwinConfig:
    """Build a config from both servers' launch lines and the staging environment."""
    base = base or TwinConfig()
    p_side, p_shared = parse_server_args(prefill, "prefill")
    d_side, d_shared = parse_server_args(decode, "decode")
    if "page_size" in p_shared and "page_size" in d_shared and \
            p_shared["page_size"] != d_shared["page_size"]:
        raise ConfigError(f"field '--page-size': prefill {p_shared['page_size']} and decode "
                          f"{d_shared['page_size']} differ")
    serving = {**base.extra.get("serving", {})}
    for role, shared in (("prefill", p_shared), ("decode", d_shared)):
        knobs = shared.pop("serving")
        if knobs:
            serving[role] = {**serving.get(role, {}), **knobs}
    models = {shared.pop("model_path") for shared in (p_shared, d_shared)
              if "model_path" in shared}
    if len(models) > 1:
        raise ConfigError(f"field '--model-path': prefill and decode serve different models "
                          f"({', '.join(sorted(models))})")
    if models:
        serving["model"] = models.pop()
        serving.pop("model_config", None)
    changes: dict[str, Any] = {**d_shared, **p_shared, "prefill": p_side, "decode": d_side}
    if serving:
        changes["extra"] = {**base.extra, "serving": serving}
    for key, value in (env or {}).items():
        if key == "SGLANG_DISAGG_STAGING_BUFFER":
            if value not in ("1", "true", "True"):
                raise ConfigError("field 'SGLANG_DISAGG_STAGING_BUFFER': the twin models the "
                                  "staging path; set it to 1")
            continue
        if key not in ENV_FIELDS:
            continue
        name, kind = ENV_FIELDS[key]
        try:
            changes[name] = kind(value)
        except ValueError:
            raise ConfigError(f"field {key!r}: expected a number, got {value!r}") from None
    return base.replace(**changes)
