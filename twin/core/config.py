"""Typed, validated configuration of a staged PD deployment, with SGLang's names.

``TwinConfig.from_toml(path)`` / ``from_dict`` reject bad input with a ``ConfigError`` naming the
file and field (a misspelt key or table gets a suggestion). Validation mirrors SGLang's start-up
checks for the staging buffer: positive ``chunked_prefill_size`` that is a multiple of
``page_size``, a Mooncake or NIXL transfer backend (``disaggregation_transfer_backend``,
SGLang's default ``mooncake``), prefill ``pp_size > 1`` only on Mooncake, no MLA model, no prefill context parallelism, KV heads that
split over each side's attention TP (or are replicated across it). The driver tables
(``[sim]``, ``[launch]``, ``[placement]``; ``[run]`` in a trace header) are kept in ``extra``;
any other table is rejected. Given a ``base``, the file is a layer: the fields it names
replace the base's.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twin.core.fixes import LOST_CONTROL_RECOVERY, MULTI_TARGET_RETRY_RESUME, Fixes
from twin.core.grid import staging_grid_tokens
from twin.core.layout import num_tp_writers, staging_layout

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

MiB = 1024 * 1024

#: The staging transfer backends (SGLang's ``--disaggregation-transfer-backend`` values that
#: support ``SGLANG_DISAGG_STAGING_BUFFER``); the first is SGLang's default.
TRANSFER_BACKENDS = ("mooncake", "nixl")
#: Every value SGLang 0.5.23's ``--disaggregation-transfer-backend`` accepts
#: (``arg_groups/choices.py`` ``DISAGG_TRANSFER_BACKEND_CHOICES``).
SGLANG_TRANSFER_BACKEND_CHOICES = ("mooncake", "nixl", "ascend", "fake", "mori", "mooncake_tcp")


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """``[start, end)`` of the layers PP stage ``pp_rank`` holds (SGLang's ``get_pp_indices``
    without ``SGLANG_PP_LAYER_PARTITION``: an even split, the last ``remainder`` stages one
    layer more)."""
    base, remainder = divmod(num_layers, pp_size)
    start = pp_rank * base + max(0, pp_rank - (pp_size - remainder))
    return start, start + base + (1 if pp_rank >= pp_size - remainder else 0)


class ConfigError(ValueError):
    """A configuration value is missing, malformed or rejected by SGLang's start-up rules."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """KV geometry of the served model."""

    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    is_mla: bool = False


@dataclass(frozen=True, slots=True)
class ServerSide:
    """One side's parallelism (SGLang launch arguments of that server)."""

    tp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    pp_size: int = 1
    instances: int = 1

    @property
    def attn_tp_size(self) -> int:
        """Attention TP: ``tp_size // dp_size`` under DP attention, else ``tp_size``."""
        return self.tp_size // self.dp_size if self.enable_dp_attention else self.tp_size

    @property
    def attn_dp_size(self) -> int:
        """Independent attention groups (sessions) per instance."""
        return self.dp_size if self.enable_dp_attention else 1


@dataclass(frozen=True, slots=True)
class TwinConfig:
    """Everything the protocol core needs to know about a deployment.

    ``prefill_staging_buffer_pages``: pages each prefill transfer worker's staging buffer holds;
    None sizes it to one grid slot as SGLang does today. A larger value models the pre-fix,
    fixed-size buffer that let oversized (unaligned) sends through.

    Protocol timing the core decides (every driver waits exactly this long):
    ``deferral_wait_s`` is the transfer worker's bounded wait before re-polling a deferred chunk
    (SGLang's 1 ms condition-variable wait); ``late_register_delay_s`` is how long after the
    metadata the pre-fix registration point comes (only with ``late-decode-registration``).

    Failure paths: ``deferred_decode_kv_release`` (SGLang's
    ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE``, on by default) makes decode hold a
    failed room's staging until every prefill rank acknowledged the abort (``ABORT_ACK``) or
    ``deferred_decode_kv_release_timeout_s`` passed (``..._TIMEOUT``, 30 s).

    ``fixes``: proposed changes SGLang has not merged, switched on (``twin/core/fixes.py``);
    ``control_retry_s`` is how long the lost-control-message recovery fix waits before it
    re-requests a chunk's STAGING_RSP and watermark.

    ``stage_equal_tp``: SGLang stages a room only when a decode peer's attention TP differs
    from prefill's (``nixl/conn.py`` ~1058 ``needs_staging``, ``mooncake/conn.py`` ~664,
    ``common/conn.py`` ~2557-2561 ``require_staging``); with equal TP prefill writes the KV
    pages straight into decode's pool: no STAGING_REQ, ring or WATERMARK. True stages every
    room anyway: the twin's model before it knew this (traces recorded without the field); the
    hardware mode sets it only for a prefill with ``pp_size > 1`` (``twin.hw.run``).
    ``disaggregation_transfer_backend``: SGLang's transfer backend on both servers,
    ``"mooncake"`` (SGLang's default: a prefill with ``pp_size > 1`` may stage, each PP stage
    writing its own layers, and STAGING_REQ names the requesting PP rank) or ``"nixl"``.

    ``worker_wake``: ``"sglang"`` wakes a deferred transfer worker on every WATERMARK and on
    nothing else (a STAGING_RSP or a queued chunk is found when the bounded wait ends);
    ``"eager"`` is the twin's model before trace format 3 (a STAGING_RSP, a queued chunk or
    an abort woke it at once, a WATERMARK only when it advanced), kept so older traces replay.
    ``worker_polls``: ``"fed"`` feeds every deferral's 1 ms re-poll to the core as a
    ``WorkerPoll``; ``"coalesced"`` (the simulator's default, where ``polls_coalescible``
    allows) accounts the re-polls that can only defer again inside the core, at the rank's
    next input, and has the driver feed one poll where a chunk becomes ready: the same
    dequeues, re-puts, deferral counts and transfers at the same times (docs/simulator.md).
    """

    model: ModelShape = field(default_factory=ModelShape)
    prefill: ServerSide = field(default_factory=lambda: ServerSide(tp_size=4))
    decode: ServerSide = field(default_factory=lambda: ServerSide(tp_size=2))
    chunked_prefill_size: int = 8192
    page_size: int = 16
    staging_pool_size_mb: int = 4096
    staging_pool_size_bytes: int | None = None
    transfer_queue_size: int = 4
    prefill_staging_buffer_pages: int | None = None
    waiting_timeout_s: float = 300.0
    bootstrap_timeout_s: float = 300.0
    deferral_wait_s: float = 1e-3
    late_register_delay_s: float = 5e-3
    enable_prefill_context_parallel: bool = False
    deferred_decode_kv_release: bool = True
    deferred_decode_kv_release_timeout_s: float = 30.0
    fixes: tuple[str, ...] = ()
    control_retry_s: float = 0.05
    worker_wake: str = "sglang"
    worker_polls: str = "fed"
    stage_equal_tp: bool = False
    disaggregation_transfer_backend: str = "mooncake"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.fixes, tuple):
            object.__setattr__(self, "fixes", tuple(self.fixes))
        validate(self)

    @property
    def stages(self) -> bool:
        """Whether rooms go through the staging ring: prefill's and decode's attention TP
        differ (one decode TP per deployment, so every room or none), or ``stage_equal_tp``."""
        return self.stage_equal_tp or self.prefill.attn_tp_size != self.decode.attn_tp_size

    @property
    def fix_set(self) -> Fixes:
        """The switched-on fixes as a ``Fixes`` set (``fixes.on(NAME)``)."""
        return Fixes.of(self.fixes)

    # Derived quantities --------------------------------------------------------------
    @property
    def ring_bytes(self) -> int:
        """Decode staging ring size in bytes (``staging_pool_size_bytes`` wins if set)."""
        if self.staging_pool_size_bytes is not None:
            return self.staging_pool_size_bytes
        return self.staging_pool_size_mb * MiB

    @property
    def grid_tokens(self) -> int:
        return staging_grid_tokens(self.chunked_prefill_size, self.page_size)

    @property
    def full_chunk_pages(self) -> int:
        return self.grid_tokens // self.page_size

    @property
    def bytes_per_head_token(self) -> int:
        return self.model.head_dim * self.model.dtype_bytes

    @property
    def num_writers(self) -> int:
        """Writers per staged chunk: TP writers times prefill PP stages (SGLang's
        ``DecodeStagingHandler.num_writers_for``)."""
        tp_writers = num_tp_writers(self.prefill.attn_tp_size, self.decode.attn_tp_size)
        return tp_writers * self.prefill.pp_size // max(1, self.decode.pp_size)

    @property
    def is_mooncake(self) -> bool:
        return self.disaggregation_transfer_backend == "mooncake"

    def region_layout(self, dst_rank: int, num_pages: int,
                      prefill_attn_tp: int | None = None) -> tuple[int, tuple[int, ...], int]:
        """``(num_writers, writer_bytes, total)`` of a staging region of ``num_pages`` pages on
        decode rank ``dst_rank`` (``compute_staging_layout`` with this deployment's shape)."""
        p_tp = self.prefill.attn_tp_size if prefill_attn_tp is None else prefill_attn_tp
        return staging_layout(p_tp, self.decode.attn_tp_size, dst_rank, self.model.num_kv_heads,
                              num_pages * self.page_size, self.bytes_per_head_token,
                              self.model.num_layers)

    def replace(self, **changes: Any) -> TwinConfig:
        return dataclasses.replace(self, **changes)

    # Loading --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "<config>",
                  base: TwinConfig | None = None,
                  tables: tuple[str, ...] = ("sim", "launch", "run", "serving", "placement")
                  ) -> TwinConfig:
        """A config from plain data; with ``base``, only the fields ``data`` names change.
        ``tables``: the driver tables accepted into ``extra``."""
        return _from_dict(data, source, base, tables)

    @classmethod
    def from_toml(cls, path: str | Path, base: TwinConfig | None = None) -> TwinConfig:
        """A config file (tables ``[model]``, ``[prefill]``, ``[decode]``, ``[sim]``,
        ``[launch]``, ``[serving]``, ``[placement]``), layered over ``base`` when given."""
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{p}: no such file") from None
        except IsADirectoryError:
            raise ConfigError(f"{p}: is a directory, not a TOML file") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{p}: not a text file (not UTF-8); expected TOML") from None
        except OSError as exc:
            raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML: {exc}") from None
        return _from_dict(data, str(p), base, ("sim", "launch", "serving", "placement"))

    def to_dict(self) -> dict[str, Any]:
        """Plain data that ``from_dict`` reads back to an equal config."""
        out: dict[str, Any] = {
            "model": dataclasses.asdict(self.model),
            "prefill": dataclasses.asdict(self.prefill),
            "decode": dataclasses.asdict(self.decode),
        }
        for f in dataclasses.fields(self):
            if f.name not in ("model", "prefill", "decode", "extra"):
                value = getattr(self, f.name)
                if f.name == "fixes":
                    if value:
                        out[f.name] = list(value)
                elif value is not None:
                    out[f.name] = value
        out.update(self.extra)
        return out


_SECTIONS = {"model": ModelShape, "prefill": ServerSide, "decode": ServerSide}


def _unknown(source: str, name: str, key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"{source}: field {name!r}: unknown{hint} (known: "
                       f"{', '.join(sorted(known))})")


def _typed(source: str, name: str, value: Any, want: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{source}: field {name!r}: expected a finite number, got {value}")
    if want in (bool, "bool"):
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: field {name!r}: expected true/false, got {value!r}")
        return value
    if want in (int, "int", "int | None"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: field {name!r}: expected an integer, got {value!r}")
        return value
    if want in (float, "float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{source}: field {name!r}: expected a number, got {value!r}")
        return float(value)
    if want == "tuple[str, ...]":
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{source}: field {name!r}: expected a list of names, got {value!r}")
        return tuple(value)
    return value


def _build(cls: type, data: Any, source: str, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: field {prefix.rstrip('.')!r}: expected a table")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown(source, prefix + key, key, list(fields))
        kwargs[key] = _typed(source, prefix + key, value, fields[key].type)
    return kwargs


# Protocol timing that lived in the ``[sim]`` table before it moved into the core's config;
# configs and traces written then still carry it there.
_MOVED_FROM_SIM = ("deferral_wait_s", "late_register_delay_s")


def _from_dict(data: dict[str, Any], source: str, base: TwinConfig | None = None,
               tables: tuple[str, ...] = ("sim", "launch", "run", "serving", "placement")
               ) -> TwinConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a table of fields")
    sim = data.get("sim")
    if isinstance(sim, dict) and any(k in sim for k in _MOVED_FROM_SIM):
        data = {**data, "sim": {k: v for k, v in sim.items() if k not in _MOVED_FROM_SIM}}
        for k in _MOVED_FROM_SIM:
            if k in sim and k not in data:
                data[k] = sim[k]
    top: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    scalar_fields = {
        f.name: f for f in dataclasses.fields(TwinConfig) if f.name not in (*_SECTIONS, "extra")
    }
    for key, value in data.items():
        if key in _SECTIONS:
            fields = _build(_SECTIONS[key], value, source, f"{key}.")
            if base is not None:
                fields = {**dataclasses.asdict(getattr(base, key)), **fields}
            try:
                top[key] = _SECTIONS[key](**fields)
            except TypeError as exc:  # pragma: no cover - _build checked the names
                raise ConfigError(f"{source}: field {key!r}: {exc}") from None
        elif key in scalar_fields:
            top[key] = _typed(source, key, value, scalar_fields[key].type)
        elif key in tables:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: field {key!r}: expected a table")
            extra[key] = value
        else:
            raise _unknown(source, key, key, [*_SECTIONS, *scalar_fields, *tables])
    if base is not None and "staging_pool_size_mb" in top and \
            "staging_pool_size_bytes" not in top:
        top["staging_pool_size_bytes"] = None  # the ring size this layer asked for wins
    try:
        if base is not None:
            return base.replace(**top, extra=extra)
        return TwinConfig(**top, extra=extra)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _positive(name: str, value: float) -> None:
    if not value > 0:  # also rejects NaN
        raise ConfigError(f"field {name!r}: must be positive, got {value}")


def validate(cfg: TwinConfig) -> None:
    """SGLang's staging start-up rules plus self-consistency; raises ``ConfigError``."""
    m = cfg.model
    for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
        _positive(f"model.{name}", getattr(m, name))
    if m.is_mla:
        raise ConfigError(
            "field 'model.is_mla': the staging buffer is for non-MLA models (GQA, MHA) only"
        )
    _positive("page_size", cfg.page_size)
    if cfg.chunked_prefill_size <= 0 or cfg.chunked_prefill_size % cfg.page_size:
        raise ConfigError(
            f"field 'chunked_prefill_size': staging needs a positive multiple of page_size "
            f"({cfg.page_size}); got {cfg.chunked_prefill_size}"
        )
    if cfg.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
        # SGLang 0.5.23 arg_groups/pd_disaggregation_hook.py ~154-162
        raise ConfigError(
            f"field 'disaggregation_transfer_backend': SGLANG_DISAGG_STAGING_BUFFER requires "
            f"disaggregation_transfer_backend='mooncake' or 'nixl', got "
            f"'{cfg.disaggregation_transfer_backend}'.")
    for side_name in ("prefill", "decode"):
        side: ServerSide = getattr(cfg, side_name)
        for name in ("tp_size", "dp_size", "pp_size", "instances"):
            _positive(f"{side_name}.{name}", getattr(side, name))
        if side.pp_size > 1 and side_name == "decode":
            raise ConfigError("field 'decode.pp_size': the twin does not model a decode server "
                              "with pp_size > 1")
        if side.pp_size > 1 and cfg.disaggregation_transfer_backend != "mooncake":
            # SGLang 0.5.23 disaggregation/prefill.py ~237
            raise ConfigError("field 'prefill.pp_size': SGLANG_DISAGG_STAGING_BUFFER with "
                              "pp_size > 1 is only supported by Mooncake.")
        if side.pp_size > m.num_layers:
            raise ConfigError(f"field '{side_name}.pp_size': {side.pp_size} pipeline stages "
                              f"for {m.num_layers} layers")
        if side.dp_size > 1 and not side.enable_dp_attention:
            # SGLang accepts this pair: its data-parallel controller then runs dp_size
            # independent TP groups of tp_size GPUs each. The twin's dp_size is DP attention's.
            raise ConfigError(
                f"field '{side_name}.dp_size': dp_size {side.dp_size} without "
                f"enable_dp_attention makes SGLang's data-parallel controller run "
                f"{side.dp_size} independent TP{side.tp_size} servers "
                f"({side.dp_size * side.tp_size} GPUs), which the twin does not model; give "
                f"--enable-dp-attention (DP attention inside TP{side.tp_size}), or run "
                f"{side.dp_size} servers with instances = {side.dp_size} under [{side_name}] in "
                f"a --config file"
            )
        if side.enable_dp_attention and side.tp_size % side.dp_size:
            raise ConfigError(
                f"field '{side_name}.dp_size': tp_size ({side.tp_size}) must be divisible by "
                f"dp_size ({side.dp_size}) under DP attention"
            )
    if cfg.enable_prefill_context_parallel:
        raise ConfigError(
            "field 'enable_prefill_context_parallel': staging does not support prefill "
            "context parallelism"
        )
    pa, da = cfg.prefill.attn_tp_size, cfg.decode.attn_tp_size
    heads = m.num_kv_heads
    for side_name, tp in (("prefill", pa), ("decode", da)):
        if heads % tp and tp % heads:
            raise ConfigError(
                f"field '{side_name}.tp_size': {heads} KV heads do not split over attention TP "
                f"{tp} (SGLang needs num_kv_heads % tp == 0 or tp % num_kv_heads == 0)"
            )
    if max(pa, da) % min(pa, da):
        raise ConfigError(
            f"field 'decode.tp_size': attention TP sizes must divide each other "
            f"(prefill {pa}, decode {da})"
        )
    _positive("staging_pool_size_mb", cfg.staging_pool_size_mb)
    if cfg.staging_pool_size_bytes is not None:
        _positive("staging_pool_size_bytes", cfg.staging_pool_size_bytes)
    _positive("transfer_queue_size", cfg.transfer_queue_size)
    if cfg.prefill_staging_buffer_pages is not None:
        _positive("prefill_staging_buffer_pages", cfg.prefill_staging_buffer_pages)
    _positive("waiting_timeout_s", cfg.waiting_timeout_s)
    _positive("bootstrap_timeout_s", cfg.bootstrap_timeout_s)
    _positive("deferral_wait_s", cfg.deferral_wait_s)
    _positive("deferred_decode_kv_release_timeout_s", cfg.deferred_decode_kv_release_timeout_s)
    _positive("control_retry_s", cfg.control_retry_s)
    if cfg.worker_wake not in ("sglang", "eager"):
        raise ConfigError(f"field 'worker_wake': expected 'sglang' or 'eager', got "
                          f"{cfg.worker_wake!r}")
    if cfg.worker_polls not in ("fed", "coalesced"):
        raise ConfigError(f"field 'worker_polls': expected 'fed' or 'coalesced', got "
                          f"{cfg.worker_polls!r}")
    if cfg.worker_polls == "coalesced" and not polls_coalescible(cfg):
        raise ConfigError("field 'worker_polls': 'coalesced' needs worker_wake 'sglang' and "
                          f"neither fix {MULTI_TARGET_RETRY_RESUME!r} nor "
                          f"{LOST_CONTROL_RECOVERY!r} (their re-polls act without an input)")
    try:
        Fixes.of(cfg.fixes)
    except ValueError as exc:
        raise ConfigError(f"field 'fixes': {exc}") from None
    if not cfg.late_register_delay_s >= 0:
        raise ConfigError(f"field 'late_register_delay_s': must be >= 0, got "
                          f"{cfg.late_register_delay_s}")


def polls_coalescible(cfg: TwinConfig) -> bool:
    """Whether ``cfg``'s deferral re-polls can be coalesced (``worker_polls = "coalesced"``):
    with SGLang's wake rule, and without the fixes whose re-poll may act with no new input
    (a resumed multi-target chunk, a lost-control re-request)."""
    return (cfg.worker_wake == "sglang" and MULTI_TARGET_RETRY_RESUME not in cfg.fixes
            and LOST_CONTROL_RECOVERY not in cfg.fixes)
