"""What a sweep varies: axes over config fields, cost parameters, launch arguments, the
workload's request rate and seeds; points; and how a point turns into one run's inputs.

An axis is written ``NAME=VALUES``:

* ``NAME`` is a config field (``chunked_prefill_size``, ``page_size``, ``staging_pool_size_mb``,
  ``prefill.tp_size``, ``decode.dp_size``, ``model.num_layers``, ...), a cost parameter
  (``sim.ranks_per_nic``, ``sim.prefill_radix_tokens``; the ``sim.`` prefix may be left out),
  a launch line (``prefill_args``, ``decode_args``), a staging environment variable
  (``env.SGLANG_DISAGG_STAGING_POOL_SIZE_MB``), ``rate_scale`` (requests arrive this many times
  faster: arrival times divided by it), or a short alias: ``ring_mb``, ``cps``, ``page``,
  ``ranks_per_nic``, ``prefill_radix``.
* ``VALUES`` is a comma list (``512,1024,2048``), a ``|`` list when values hold commas or
  spaces (``--tp-size 4|--tp-size 4 --dp-size 4 --enable-dp-attention``), an arithmetic range
  ``START:STOP:STEP`` or a geometric one ``START:STOP:xFACTOR`` (both include STOP when hit).

A :class:`Point` is one assignment of every axis plus a seed; :func:`build_run` applies it to a
:class:`Base` (the resolved config, cost parameters, defects, faults, horizon and an optional
:class:`EarlyStop`) in a fixed order: launch
lines and environment first, then fields, so ``prefill.tp_size`` overrides a launch line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import product
from typing import Any

from twin.core.config import ConfigError, ModelShape, ServerSide, TwinConfig
from twin.core.defects import Defects
from twin.runtime.faults import FaultSpec
from twin.runtime.params import SimParams

FORMAT_VERSION = 1
"""Bumped when a point's meaning changes, so old result rows are not reused by a resume."""

ALIASES = {
    "ring_mb": "staging_pool_size_mb",
    "cps": "chunked_prefill_size",
    "page": "page_size",
    "ranks_per_nic": "sim.ranks_per_nic",
    "prefill_radix": "sim.prefill_radix_tokens",
    "decode_radix": "sim.decode_radix_tokens",
}
LAUNCH_NAMES = ("prefill_args", "decode_args")
RATE_SCALE = "rate_scale"

_CFG_FIELDS = {f.name: f.type for f in dataclasses.fields(TwinConfig)
               if f.name not in ("model", "prefill", "decode", "extra")}
_SECTIONS: dict[str, type] = {"model": ModelShape, "prefill": ServerSide, "decode": ServerSide}
_SIM_FIELDS = {f.name: f.type for f in dataclasses.fields(SimParams)}


class AxisError(ValueError):
    """A malformed axis, unknown field or value of the wrong type."""


def canonical_name(name: str) -> str:
    """The full name of an axis (aliases expanded, ``sim.`` added where needed); raises
    :class:`AxisError` for a name that is neither a field nor a known axis."""
    name = name.strip()
    name = ALIASES.get(name, name)
    if name in (RATE_SCALE, *LAUNCH_NAMES) or name in _CFG_FIELDS:
        return name
    if name.startswith("env."):
        from twin.launch_args import ENV_FIELDS

        if name[4:] not in ENV_FIELDS:
            raise AxisError(f"axis {name!r}: unknown staging variable; known: "
                            f"{', '.join(sorted(ENV_FIELDS))}")
        return name
    head, dot, tail = name.partition(".")
    if dot and head in _SECTIONS:
        known = {f.name for f in dataclasses.fields(_SECTIONS[head])}
        if tail not in known:
            raise AxisError(f"axis {name!r}: unknown field; {head} has {', '.join(sorted(known))}")
        return name
    if dot and head == "sim":
        if tail not in _SIM_FIELDS:
            raise AxisError(f"axis {name!r}: unknown cost parameter; known: "
                            f"{', '.join(sorted(_SIM_FIELDS))}")
        return name
    if not dot and name in _SIM_FIELDS:
        return f"sim.{name}"
    raise AxisError(
        f"axis {name!r}: unknown; use a config field ({', '.join(sorted(_CFG_FIELDS))}, "
        f"model.*, prefill.*, decode.*), sim.FIELD, prefill_args, decode_args, env.VAR, "
        f"{RATE_SCALE} or an alias ({', '.join(sorted(ALIASES))})")


def _field_type(name: str) -> str:
    if name == RATE_SCALE:
        return "float"
    if name in LAUNCH_NAMES:
        return "str"
    if name.startswith("env."):
        from twin.launch_args import ENV_FIELDS

        return "int" if ENV_FIELDS[name[4:]][1] is int else "float"
    head, dot, tail = name.partition(".")
    if dot and head in _SECTIONS:
        return str({f.name: f.type for f in dataclasses.fields(_SECTIONS[head])}[tail])
    if dot and head == "sim":
        return str(_SIM_FIELDS[tail])
    return str(_CFG_FIELDS[name])


def coerce(name: str, value: Any) -> Any:
    """``value`` (a string from the command line, or a number) as the type of field ``name``."""
    kind = _field_type(name)
    text = value.strip() if isinstance(value, str) else value
    try:
        if "bool" in kind:
            if isinstance(text, bool):
                return text
            if str(text).lower() in ("true", "1", "yes", "on"):
                return True
            if str(text).lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if kind in ("int", "int | None"):
            if isinstance(text, bool):
                raise ValueError
            if isinstance(text, int):
                return text
            number = float(text)
            if not number.is_integer():
                raise ValueError
            return int(number)
        if "float" in kind:
            out_f = float(text)
            if not math.isfinite(out_f):
                raise ValueError
            return out_f
    except (TypeError, ValueError):
        raise AxisError(f"axis {name!r}: value {value!r} is not a valid {kind}") from None
    return str(text)


def _range(name: str, text: str) -> list[float]:
    parts = text.split(":")
    if len(parts) != 3:
        raise AxisError(f"axis {name!r}: range {text!r}: expected START:STOP:STEP or "
                        f"START:STOP:xFACTOR")
    try:
        start, stop = float(parts[0]), float(parts[1])
        geometric = parts[2].lower().startswith("x")
        step = float(parts[2][1:] if geometric else parts[2])
    except ValueError:
        raise AxisError(f"axis {name!r}: range {text!r}: not numbers") from None
    if (geometric and (step <= 1 or start <= 0)) or (not geometric and step <= 0) or stop < start:
        raise AxisError(f"axis {name!r}: range {text!r}: needs START <= STOP and a STEP > 0 "
                        f"(a FACTOR > 1 with START > 0)")
    out: list[float] = []
    value = start
    while value <= stop * (1 + 1e-9) and len(out) <= 10_000:
        out.append(value)
        value = value * step if geometric else start + step * len(out)
    if len(out) > 10_000:
        raise AxisError(f"axis {name!r}: range {text!r}: more than 10000 values")
    return out


@dataclass(frozen=True)
class Axis:
    """One swept field and its values (already of the field's type)."""

    name: str
    values: tuple[Any, ...]


def parse_axis(text: str) -> Axis:
    """``NAME=VALUES`` as an :class:`Axis` (see the module docstring for the forms)."""
    name, sep, rest = text.partition("=")
    if not sep or not rest.strip():
        raise AxisError(f"axis {text!r}: expected NAME=VALUES, e.g. ring_mb=16,32,64")
    full = canonical_name(name)
    rest = rest.strip()
    if "|" in rest or full in LAUNCH_NAMES:
        raw: list[Any] = [v for v in rest.split("|")]
    elif ":" in rest and _field_type(full) not in ("str",):
        raw = _range(full, rest)
    else:
        raw = rest.split(",")
    values: list[Any] = []
    for v in raw:
        c = coerce(full, v)
        if c not in values:
            values.append(c)
    return Axis(full, tuple(values))


def parse_seeds(text: str) -> tuple[int, ...]:
    """``0,1,2`` or ``0:3`` (start inclusive, stop exclusive) as a tuple of seeds."""
    try:
        if ":" in text:
            a, b = text.split(":")
            seeds = tuple(range(int(a), int(b)))
        else:
            seeds = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise AxisError(f"seeds {text!r}: expected 0,1,2 or START:STOP") from None
    if not seeds:
        raise AxisError(f"seeds {text!r}: no seed")
    return tuple(dict.fromkeys(seeds))


@dataclass(frozen=True)
class Point:
    """One run of a sweep: a value for each axis (sorted by name) and a seed."""

    assign: tuple[tuple[str, Any], ...]
    seed: int = 0

    @classmethod
    def of(cls, values: dict[str, Any] | Iterable[tuple[str, Any]], seed: int = 0) -> Point:
        items = dict(values)
        return cls(tuple(sorted((canonical_name(k), coerce(canonical_name(k), v))
                                for k, v in items.items())), seed)

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.assign).get(name, default)

    def key(self) -> str:
        return json.dumps([list(self.assign), self.seed], sort_keys=True, default=str)

    def label(self) -> str:
        parts = [f"{short_name(k)}={v}" for k, v in self.assign]
        return " ".join([*parts, f"seed={self.seed}"])


def short_name(name: str) -> str:
    """The alias of a field if it has one (``staging_pool_size_mb`` -> ``ring_mb``)."""
    back = {v: k for k, v in ALIASES.items()}
    return back.get(name, name)


def grid(axes: Sequence[Axis], seeds: Sequence[int]) -> list[Point]:
    """Every combination of the axes' values, for every seed (seeds innermost)."""
    names = [a.name for a in axes]
    if len(set(names)) != len(names):
        raise AxisError(f"axis named twice: {', '.join(n for n in names if names.count(n) > 1)}")
    out = []
    for combo in product(*(a.values for a in axes)):
        for seed in seeds:
            out.append(Point(tuple(sorted(zip(names, combo, strict=True))), seed))
    return out


@dataclass(frozen=True)
class EarlyStop:
    """Stop a run with a TTFT budget as soon as its verdict is certain: corruption, a failed
    request, or so many requests past the budget (finished over it, or waiting longer than it)
    that the ``percentile`` cannot meet it whatever happens later (checked as the run goes,
    every half budget of simulated time: ``twin.advise.evaluate.LateWatch``). The
    stopped run is the full run's exact prefix, so a stopped point is one the full run would
    fail too; a healthy run pays only the checks. A wedge stops a run anyway."""

    ttft_s: float
    percentile: int = 99


@dataclass(frozen=True)
class Base:
    """What every point of a sweep shares: the resolved run inputs before the axes apply.

    ``horizon_s``: stop a run this many simulated seconds after the last arrival (None: run to
    the end); a run stopped with requests in flight counts as ``unfinished``.
    """

    cfg: TwinConfig
    params: SimParams = field(default_factory=SimParams)
    defects: Defects = field(default_factory=Defects)
    faults: tuple[FaultSpec, ...] = ()
    request_overrides: dict[int, dict[str, int]] = field(default_factory=dict)
    max_concurrency: int | None = None
    horizon_s: float | None = None
    early_stop: EarlyStop | None = None

    def fingerprint(self, workload_digest: str) -> str:
        """A digest of everything that decides a point's result besides the point itself."""
        blob = json.dumps({
            "v": FORMAT_VERSION,
            "cfg": self.cfg.to_dict(),
            "sim": self.params.to_dict(),
            "defects": self.defects.sorted(),
            "faults": [f.text for f in self.faults],
            "overrides": {str(k): v for k, v in sorted(self.request_overrides.items())},
            "max_concurrency": self.max_concurrency,
            "horizon_s": self.horizon_s,
            "early_stop": dataclasses.asdict(self.early_stop) if self.early_stop else None,
            "workload": workload_digest,
        }, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def point_id(fingerprint: str, point: Point) -> str:
    return hashlib.sha256(f"{fingerprint}\n{point.key()}".encode()).hexdigest()[:16]


def build_run(base: Base, point: Point) -> tuple[TwinConfig, SimParams, float]:
    """The config, cost parameters and rate scale of ``point``; raises ``ConfigError`` when the
    combination is one SGLang (or the twin) rejects."""
    from twin.launch_args import ENV_FIELDS, layer_launch

    values = dict(point.assign)
    cfg = base.cfg
    if values.get("prefill_args") is not None or values.get("decode_args") is not None:
        cfg, _ = layer_launch(cfg, values.get("prefill_args"), values.get("decode_args"))
    changes: dict[str, Any] = {}
    for name, value in values.items():
        if name.startswith("env."):
            changes[ENV_FIELDS[name[4:]][0]] = value
    sections: dict[str, dict[str, Any]] = {}
    sim: dict[str, Any] = {}
    scale = 1.0
    for name, value in values.items():
        head, dot, tail = name.partition(".")
        if name == RATE_SCALE:
            scale = float(value)
        elif name in LAUNCH_NAMES or head == "env":
            continue
        elif dot and head in _SECTIONS:
            sections.setdefault(head, {})[tail] = value
        elif dot and head == "sim":
            sim[tail] = value
        else:
            changes[name] = value
    for head, fields in sections.items():
        current = changes.get(head, getattr(cfg, head))
        changes[head] = dataclasses.replace(current, **fields)
    if "staging_pool_size_mb" in changes and "staging_pool_size_bytes" not in changes:
        changes["staging_pool_size_bytes"] = None  # the swept size must take effect
    if not scale > 0:
        raise ConfigError(f"field {RATE_SCALE!r}: must be positive, got {scale}")
    cfg = cfg.replace(**changes) if changes else cfg
    params = base.params
    if sim:
        params = SimParams.from_dict({**params.to_dict(), **sim}, "sweep point")
    return cfg, params, scale
