"""One explorer trial: a small deployment, a handful of requests, a fault schedule and a seed.

A ``Trial`` is plain data (JSON in and out) so it can be generated, mutated, shrunk, shipped to
a worker process and written beside a finding. ``Base`` is what every trial of a campaign
shares: the user's resolved config and cost parameters and the defects switched on.
``run_trial`` runs one trial in the simulator and judges it with the oracles
(``twin/explore/oracles.py``), returning a ``TrialResult`` with its coverage.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from twin.core.config import ConfigError, ServerSide, TwinConfig
from twin.core.defects import Defects
from twin.runtime.faults import FaultSpecError, check_faults, parse_fault
from twin.runtime.params import SimParams
from twin.workloads import Workload, fixed


@dataclass(frozen=True)
class Deploy:
    """The deployment fields the explorer varies (None: the base config's value)."""

    prefill_tp: int | None = None
    prefill_dp: int | None = None
    prefill_dp_attn: bool | None = None
    decode_tp: int | None = None
    page_size: int | None = None
    chunked_prefill_size: int | None = None
    ring_bytes: int | None = None
    prefill_staging_pages: int | None = None  # a fixed-size prefill staging buffer (pre-fix)

    def apply(self, cfg: TwinConfig) -> TwinConfig:
        """``cfg`` with these fields changed; ``ConfigError`` when SGLang would refuse it."""
        p, d = cfg.prefill, cfg.decode
        prefill = ServerSide(tp_size=self.prefill_tp or p.tp_size,
                             dp_size=self.prefill_dp or p.dp_size,
                             enable_dp_attention=(p.enable_dp_attention
                                                  if self.prefill_dp_attn is None
                                                  else self.prefill_dp_attn),
                             pp_size=p.pp_size, instances=p.instances)
        decode = ServerSide(tp_size=self.decode_tp or d.tp_size, dp_size=d.dp_size,
                            enable_dp_attention=d.enable_dp_attention, pp_size=d.pp_size,
                            instances=d.instances)
        changes: dict[str, Any] = {"prefill": prefill, "decode": decode}
        if self.page_size is not None:
            changes["page_size"] = self.page_size
        if self.chunked_prefill_size is not None:
            changes["chunked_prefill_size"] = self.chunked_prefill_size
        if self.ring_bytes is not None:
            changes["staging_pool_size_bytes"] = self.ring_bytes
        if self.prefill_staging_pages is not None:
            changes["prefill_staging_buffer_pages"] = self.prefill_staging_pages
        return cfg.replace(**changes)

    def fields(self) -> int:
        """How many fields differ from the base (a shrink measure)."""
        return sum(v is not None for v in asdict(self).values())


@dataclass(frozen=True)
class Req:
    """One request: arrival, prompt length, decode-side cached prefix (a multiple of the page
    size unless the trial means to send an unaligned one), prefill-side radix hit."""

    at: float
    input_len: int
    decode_prefix: int = 0
    prefill_prefix: int = 0


@dataclass(frozen=True)
class Trial:
    deploy: Deploy = field(default_factory=Deploy)
    requests: tuple[Req, ...] = ()
    faults: tuple[str, ...] = ()
    seed: int = 0
    schedule: str = ""  # "" the simulator; random:SEED or pct:SEED:DEPTH the loopback cluster

    def to_json(self) -> dict[str, Any]:
        out = {"deploy": {k: v for k, v in asdict(self.deploy).items() if v is not None},
               "requests": [[r.at, r.input_len, r.decode_prefix, r.prefill_prefix]
                            for r in self.requests],
               "faults": list(self.faults), "seed": self.seed}
        if self.schedule:
            out["schedule"] = self.schedule
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Trial:
        return cls(Deploy(**obj.get("deploy", {})),
                   tuple(Req(float(r[0]), int(r[1]), int(r[2]), int(r[3]))
                         for r in obj.get("requests", [])),
                   tuple(obj.get("faults", [])), int(obj.get("seed", 0)),
                   str(obj.get("schedule", "")))

    def key(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)

    def size(self) -> int:
        """The repro size a shrink minimises: requests, faults, tokens (in pages of 16) and
        deployment changes, in that order of weight."""
        tokens = sum(r.input_len for r in self.requests)
        return (1000 * len(self.requests) + 1000 * len(self.faults) + tokens // 16
                + 10 * self.deploy.fields())

    def workload(self) -> Workload:
        rows = [(r.at, r.input_len, 8, 0) for r in self.requests]
        return fixed(rows, name="explore")

    def overrides(self) -> dict[int, dict[str, int]]:
        out: dict[int, dict[str, int]] = {}
        for i, r in enumerate(sorted(self.requests, key=lambda q: q.at)):
            o = {}
            if r.decode_prefix:
                o["decode_prefix_len"] = r.decode_prefix
            if r.prefill_prefix:
                o["prefill_prefix_len"] = r.prefill_prefix
            if o:
                out[i] = o
        return out

    def with_(self, **changes: Any) -> Trial:
        return replace(self, **changes)


class InvalidTrial(ValueError):
    """A trial that SGLang would refuse to start or whose faults name nothing that exists."""


@dataclass(frozen=True)
class Base:
    """What every trial of a campaign shares."""

    cfg: TwinConfig
    params: SimParams
    defects: tuple[str, ...] = ()
    coverage: bool = True

    def config(self, trial: Trial) -> TwinConfig:
        try:
            return trial.deploy.apply(self.cfg)
        except (ConfigError, ValueError) as exc:
            raise InvalidTrial(str(exc)) from None

    def check(self, trial: Trial) -> TwinConfig:
        """The trial's config, after checking that it can run (``InvalidTrial`` if not)."""
        if not trial.requests:
            raise InvalidTrial("no requests")
        cfg = self.config(trial)
        for r in trial.requests:
            if r.input_len < 1 or not 0 <= r.decode_prefix < r.input_len or \
                    not 0 <= r.prefill_prefix <= r.input_len:
                raise InvalidTrial(f"bad request {r}")
        if trial.schedule:
            from twin.explore.schedule import LOOPBACK_CHUNKS, parse_schedule

            try:
                parse_schedule(trial.schedule)
            except ValueError as exc:
                raise InvalidTrial(str(exc)) from None
            grid = cfg.grid_tokens
            ranks = cfg.prefill.tp_size * cfg.prefill.instances
            work = ranks * sum(-(-(r.input_len - r.decode_prefix) // grid) for r in trial.requests)
            if work > LOOPBACK_CHUNKS:
                raise InvalidTrial(f"{work} chunk writes: too many for the loopback cluster "
                                   f"(at most {LOOPBACK_CHUNKS})")
        try:
            check_faults([parse_fault(f) for f in trial.faults], cfg,
                         [r.input_len for r in sorted(trial.requests, key=lambda q: q.at)])
        except FaultSpecError as exc:
            raise InvalidTrial(str(exc)) from None
        return cfg

    def to_json(self) -> dict[str, Any]:
        return {"config": self.cfg.to_dict(), "params": self.params.to_dict(),
                "defects": list(self.defects)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Base:
        cfg = TwinConfig.from_dict(obj["config"])
        return cls(cfg, SimParams.from_dict(obj["params"], "explore base"),
                   tuple(obj.get("defects", ())))

    def defects_on(self, names: tuple[str, ...] | None = None) -> Defects:
        return Defects.of(self.defects if names is None else names)
