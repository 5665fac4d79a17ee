"""Translate SGLang launch arguments and staging environment variables into a ``TwinConfig``.

Users describe deployments the way they launch them::

    prefill: python -m sglang.launch_server --tp-size 4 --dp-size 4 --enable-dp-attention \
             --chunked-prefill-size 256 --page-size 16 --disaggregation-mode prefill
    decode:  python -m sglang.launch_server --tp-size 8 --disaggregation-mode decode
    env:     SGLANG_DISAGG_STAGING_BUFFER=1 SGLANG_DISAGG_STAGING_POOL_SIZE_MB=4096

Only the arguments that shape the staging protocol are read; others are ignored. The model shape
(layers, KV heads, head dim, dtype) is not in the launch line and comes from the config.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Mapping
from typing import Any

from twin.core.config import ConfigError, ServerSide, TwinConfig


def _env_bool(value: str) -> bool:
    """SGLang's ``EnvBool``: true/1/yes or false/0/no, any case."""
    v = value.strip().lower()
    if v in ("1", "true", "yes", "y", "on"):
        return True
    if v in ("0", "false", "no", "n", "off", ""):
        return False
    raise ValueError(value)


ENV_FIELDS = {
    "SGLANG_DISAGG_STAGING_POOL_SIZE_MB": ("staging_pool_size_mb", int),
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": ("deferred_decode_kv_release", _env_bool),
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": (
        "deferred_decode_kv_release_timeout_s", float),
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
    return p


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
    changes: dict[str, Any] = {**d_shared, **p_shared, "prefill": p_side, "decode": d_side}
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
            what = "true or false" if kind is _env_bool else "a number"
            raise ConfigError(f"field {key!r}: expected {what}, got {value!r}") from None
    return base.replace(**changes)
