"""Translate SGLang launch arguments and staging environment variables into a ``TwinConfig``.

Users describe deployments the way they launch them::

    prefill: python -m sglang.launch_server --tp-size 4 --dp-size 4 --enable-dp-attention \
             --chunked-prefill-size 256 --page-size 16 --disaggregation-mode prefill
    decode:  python -m sglang.launch_server --tp-size 8 --disaggregation-mode decode
    env:     SGLANG_DISAGG_STAGING_BUFFER=1 SGLANG_DISAGG_STAGING_POOL_SIZE_MB=4096

A launch line is a *layer* over a base config: only the fields its arguments name change, so
``--env SGLANG_DISAGG_STAGING_POOL_SIZE_MB=64`` on top of a config file changes the ring and
nothing else. Read: the arguments that shape the staging protocol (parallelism, chunking,
pages), each server's memory and scheduling knobs (``--max-total-tokens``,
``--mem-fraction-static``, ``--max-running-requests``, ``--max-prefill-tokens``,
``--num-reserved-decode-tokens``, ``--disaggregation-decode-polling-interval``,
``--kv-cache-dtype``; kept in the config's ``[serving.prefill]`` / ``[serving.decode]``
tables), ``--disaggregation-transfer-backend`` (``mooncake``, SGLang's default, or ``nixl``;
the same on both lines; ``mooncake_tcp`` is Mooncake) and ``--model-path`` (a catalogue name, or a directory or file holding a Hugging Face
``config.json``). Each value is checked here, naming the option. Other SGLang arguments
(``--host``, ...) are ignored, but one that looks like a misspelt argument the twin reads
(``--tp-szie``) is rejected with a suggestion. Environment keys the twin does not model are
rejected. Without ``--model-path`` (or ``--model``) the model shape (layers, KV heads, head
dim, dtype) comes from the config.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import shlex
from collections.abc import Mapping
from typing import Any

from twin.core.config import SGLANG_TRANSFER_BACKEND_CHOICES, ConfigError, TwinConfig

#: Environment variable -> (``TwinConfig`` field, type).
ENV_FIELDS = {
    "SGLANG_DISAGG_STAGING_POOL_SIZE_MB": ("staging_pool_size_mb", int),
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": ("deferred_decode_kv_release", bool),
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": (
        "deferred_decode_kv_release_timeout_s", float),
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": ("waiting_timeout_s", float),
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": ("bootstrap_timeout_s", float),
    "SGLANG_DISAGGREGATION_QUEUE_SIZE": ("transfer_queue_size", int),
}
#: Environment variable -> (``SimParams`` field, type): a driver behaviour, not the core's
#: config.
ENV_PARAMS: dict[str, tuple[str, type]] = {
    "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": ("early_send_cached_prefix", bool),
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": ("heartbeat_interval_s", float),
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": ("heartbeat_max_failure", int),
}
STAGING_SWITCH = "SGLANG_DISAGG_STAGING_BUFFER"
KNOWN_ENV = (STAGING_SWITCH, *ENV_FIELDS, *ENV_PARAMS)

#: Launch options the twin reads.
KNOWN_ARGS = ("--tp-size", "--tp", "--dp-size", "--dp", "--pp-size", "--pp",
              "--enable-dp-attention", "--chunked-prefill-size", "--page-size",
              "--enable-prefill-context-parallel", "--disaggregation-mode", "--model-path",
              "--model", "--max-total-tokens", "--mem-fraction-static",
              "--max-running-requests", "--max-prefill-tokens", "--num-reserved-decode-tokens",
              "--disaggregation-decode-polling-interval", "--kv-cache-dtype",
              "--disaggregation-transfer-backend")
#: SGLang server options close in spelling to ones the twin reads, which are not typos.
_OTHER_SGLANG_ARGS = frozenset({
    "--ep-size", "--ep", "--moe-dense-tp-size", "--enable-dp-lm-head", "--attn-cp-size",
    "--moe-a2a-backend", "--disaggregation-ib-device",
    "--disaggregation-bootstrap-port", "--disaggregation-decode-tp",
    "--disaggregation-decode-dp", "--disaggregation-prefill-pp", "--enable-two-batch-overlap",
    "--enable-mixed-chunk", "--chunked-prefill-size-per-dp", "--max-queued-requests",
    "--model-impl", "--model-loader-extra-config", "--served-model-name",
})


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False,
                                argument_default=argparse.SUPPRESS)
    p.add_argument("--tp-size", "--tp", dest="tp_size", type=int)
    p.add_argument("--dp-size", "--dp", dest="dp_size", type=int)
    p.add_argument("--pp-size", "--pp", dest="pp_size", type=int)
    p.add_argument("--enable-dp-attention", action="store_true")
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument("--page-size", type=int)
    p.add_argument("--enable-prefill-context-parallel", action="store_true")
    p.add_argument("--disaggregation-mode")
    p.add_argument("--model-path", "--model", dest="model_path")
    for name in SERVING_INT_ARGS:
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--kv-cache-dtype")
    p.add_argument("--disaggregation-transfer-backend", choices=SGLANG_TRANSFER_BACKEND_CHOICES)
    return p


SERVING_INT_ARGS = ("max_total_tokens", "max_running_requests", "max_prefill_tokens",
                    "num_reserved_decode_tokens", "disaggregation_decode_polling_interval")
"""Integer serving knobs read from a launch line (SGLang's names, underscores for dashes)."""


def serving_args(given: dict[str, Any], where: str) -> dict[str, Any]:
    """The serving knobs a parsed launch line sets (only those given), each checked."""
    from twin.runtime.params import KV_CACHE_DTYPES

    out: dict[str, Any] = {}
    for name in SERVING_INT_ARGS:
        if name not in given:
            continue
        value = given[name]
        low = 0 if name == "num_reserved_decode_tokens" else 1
        if value < low:
            raise ConfigError(f"{where}: field '--{name.replace('_', '-')}': expected "
                              f"{'a non-negative' if low == 0 else 'a positive'} integer, got "
                              f"{value}")
        out[name] = value
    if "mem_fraction_static" in given:
        frac = given["mem_fraction_static"]
        if not (math.isfinite(frac) and 0 < frac <= 1):
            raise ConfigError(f"{where}: field '--mem-fraction-static': expected a fraction in "
                              f"(0, 1], got {frac}")
        out["mem_fraction_static"] = frac
    if "kv_cache_dtype" in given:
        dtype = given["kv_cache_dtype"]
        if dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"{where}: field '--kv-cache-dtype': expected one of "
                              f"{', '.join(KV_CACHE_DTYPES)}, got {dtype!r}"
                              f"{did_you_mean(dtype, list(KV_CACHE_DTYPES))}")
        out["kv_cache_dtype"] = dtype
    return out


def did_you_mean(word: str, known: list[str] | tuple[str, ...], cutoff: float = 0.75) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``known``, or an empty string."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=cutoff)
    return f"; did you mean {close[0]!r}?" if close else ""


def parse_server_args(line: str, role: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """One server's launch line as ``(side fields, shared fields)``: only what it names."""
    where = f"--{role}-args"
    try:
        words = shlex.split(line)
    except ValueError as exc:
        raise ConfigError(f"{where}: cannot parse {line!r}: {exc}") from None
    parser = _parser()

    def fail(message: str) -> None:
        raise ConfigError(f"{where}: {message}")

    parser.error = fail  # type: ignore[method-assign]
    try:
        args, unknown = parser.parse_known_args(words)
    except SystemExit:  # pragma: no cover - ``error`` raises first
        raise ConfigError(f"{where}: cannot parse {line!r}") from None
    for word in unknown:
        if not word.startswith("--"):
            continue
        opt = word.split("=", 1)[0]
        if opt in _OTHER_SGLANG_ARGS:
            continue
        hint = did_you_mean(opt, KNOWN_ARGS, cutoff=0.8)
        if hint:
            raise ConfigError(f"{where}: unknown option {opt!r}{hint}")
    given = vars(args)
    mode = given.pop("disaggregation_mode", None)
    if mode not in (None, role):
        raise ConfigError(f"{where}: field '--disaggregation-mode' is {mode!r}, expected "
                          f"{role!r}")
    side: dict[str, Any] = {}
    for name in ("tp_size", "dp_size", "pp_size"):
        if name in given:
            side[name] = given[name]
    if given.get("enable_dp_attention"):
        side["enable_dp_attention"] = True
    shared: dict[str, Any] = {}
    if "chunked_prefill_size" in given and role == "prefill":
        shared["chunked_prefill_size"] = given["chunked_prefill_size"]
    if "page_size" in given:
        shared["page_size"] = given["page_size"]
    if given.get("enable_prefill_context_parallel"):
        shared["enable_prefill_context_parallel"] = True
    knobs = serving_args(given, where)
    if knobs:
        shared["serving"] = knobs
    if "disaggregation_transfer_backend" in given:
        backend = given["disaggregation_transfer_backend"]
        if backend == "mooncake_tcp":  # SGLang: Mooncake with MC_FORCE_TCP=1
            backend = "mooncake"
        if backend == "fake" and role == "prefill":
            # SGLang 0.5.23 arg_groups/pd_disaggregation_hook.py ~146
            fail("field '--disaggregation-transfer-backend': Prefill server does not support "
                 "'fake' as the transfer backend")
        shared["disaggregation_transfer_backend"] = backend
    if "model_path" in given:
        if not given["model_path"]:
            raise ConfigError(f"{where}: field '--model-path': expected a model name or path")
        shared["model_path"] = given["model_path"]
    return side, shared


def _bool_env(key: str, value: str) -> bool:
    low = value.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"field {key!r}: expected 1/0 or true/false, got {value!r}")


def env_changes(env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config changes, SimParams changes)`` of staging environment variables."""
    changes: dict[str, Any] = {}
    params: dict[str, Any] = {}
    for key, value in env.items():
        if key == STAGING_SWITCH:
            if not _bool_env(key, value):
                raise ConfigError(f"field {key!r}: the twin models the staging path; set it "
                                  f"to 1")
            continue
        if key not in ENV_FIELDS and key not in ENV_PARAMS:
            raise ConfigError(f"field {key!r}: not an environment variable the twin "
                              f"models{did_you_mean(key, KNOWN_ENV)} (known: "
                              f"{', '.join(KNOWN_ENV)})")
        into = params if key in ENV_PARAMS else changes
        name, kind = ENV_PARAMS[key] if key in ENV_PARAMS else ENV_FIELDS[key]
        if kind is bool:
            into[name] = _bool_env(key, value)
            continue
        try:
            number = kind(value)
        except ValueError:
            raise ConfigError(f"field {key!r}: expected "
                              f"{'an integer' if kind is int else 'a number'}, got "
                              f"{value!r}") from None
        if number != number or number in (float("inf"), float("-inf")):
            raise ConfigError(f"field {key!r}: expected a finite number, got {value!r}")
        if into is params and number <= 0:
            raise ConfigError(f"field {key!r}: must be positive, got {value!r}")
        into[name] = number
    if "staging_pool_size_mb" in changes:
        changes["staging_pool_size_bytes"] = None  # the pool size in MB is what was asked
    return changes, params


def layer_launch(base: TwinConfig, prefill: str | None, decode: str | None,
                 env: Mapping[str, str] | None = None) -> tuple[TwinConfig, dict[str, Any]]:
    """``base`` with the fields named by the launch lines and environment replaced; also the
    ``SimParams`` changes the environment asks for. Raises ``ConfigError``."""
    changes: dict[str, Any] = {}
    shared: dict[str, dict[str, Any]] = {}
    for role, line in (("prefill", prefill), ("decode", decode)):
        if line is None:
            continue
        side, shared[role] = parse_server_args(line, role)
        if side:
            changes[role] = dataclasses.replace(getattr(base, role), **side)
    p_page = shared.get("prefill", {}).get("page_size")
    d_page = shared.get("decode", {}).get("page_size")
    if p_page is not None and d_page is not None and p_page != d_page:
        raise ConfigError(f"field '--page-size': prefill {p_page} and decode {d_page} differ")
    p_backend = shared.get("prefill", {}).get("disaggregation_transfer_backend")
    d_backend = shared.get("decode", {}).get("disaggregation_transfer_backend")
    if p_backend is not None and d_backend is not None and p_backend != d_backend:
        raise ConfigError(f"field '--disaggregation-transfer-backend': prefill {p_backend!r} and "
                          f"decode {d_backend!r} differ (both servers must use the same "
                          f"transfer backend)")
    serving = {**base.extra.get("serving", {})}
    models: dict[str, str] = {}
    for role in ("prefill", "decode"):
        side_shared = shared.get(role, {})
        knobs = side_shared.pop("serving", None)
        if knobs:
            serving[role] = {**serving.get(role, {}), **knobs}
        if "model_path" in side_shared:
            models[role] = side_shared.pop("model_path")
    if len(set(models.values())) > 1:
        raise ConfigError(f"field '--model-path': prefill and decode serve different models "
                          f"({', '.join(sorted(set(models.values())))})")
    if models:
        serving["model"] = next(iter(models.values()))
        serving.pop("model_config", None)
    if serving != base.extra.get("serving", {}):
        changes["extra"] = {**base.extra, "serving": serving}
    changes.update(shared.get("decode", {}))
    changes.update(shared.get("prefill", {}))
    env_cfg, env_params = env_changes(env or {})
    changes.update(env_cfg)
    return (base.replace(**changes) if changes else base), env_params


def config_from_launch(prefill: str, decode: str, env: Mapping[str, str] | None = None,
                       base: TwinConfig | None = None) -> TwinConfig:
    """A config from both servers' launch lines and the staging environment, layered over
    ``base`` (default: SGLang's defaults)."""
    cfg, _ = layer_launch(base or TwinConfig(), prefill, decode, env)
    return cfg
