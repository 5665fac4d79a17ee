"""Cost model of the simulated deployment: every latency, bandwidth and cadence, with defaults.

Defaults describe one H100/H200-class node pair on a 400 Gb/s RDMA fabric serving an 8B-class
GQA model. Override any field in the config's ``[sim]`` table; ``docs/simulator.md`` lists them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any

from twin.core.config import ConfigError


@dataclass(frozen=True, slots=True)
class SimParams:
    """Latencies in seconds, bandwidths in bytes per second."""

    # Control plane (ZMQ over TCP): one-way latency = zmq_latency_s + Exp(zmq_jitter_s).
    zmq_latency_s: float = 50e-6
    zmq_jitter_s: float = 20e-6
    # Data plane (RDMA WRITE): latency plus bytes / NIC bandwidth; ranks share NICs.
    rdma_latency_s: float = 8e-6
    nic_bandwidth_Bps: float = 50e9
    ranks_per_nic: int = 2
    # Device copies: gather on prefill, scatter on decode (HBM-bound kernels).
    gather_bandwidth_Bps: float = 600e9
    scatter_bandwidth_Bps: float = 600e9
    kernel_launch_s: float = 15e-6
    # Prefill compute: forward = overhead + tokens * s_per_token + tokens * context * s_per_ctx.
    forward_overhead_s: float = 4e-3
    prefill_s_per_token: float = 6.0e-6
    prefill_s_per_token_ctx: float = 1.5e-10
    # Decode: scheduler loop cadence (scatter events are polled once per iteration), one
    # decode step for the first token, pre-allocation delay before metadata is sent.
    decode_poll_interval_s: float = 2e-3
    decode_step_s: float = 12e-3
    decode_prealloc_s: float = 1e-3
    # Radix caches (tokens); 0 disables a side's cache.
    prefill_radix_tokens: int = 2_000_000
    decode_radix_tokens: int = 0
    # Early send of the prefill-cached prefix (SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX).
    early_send_cached_prefix: bool = True
    # Liveness: pending work with no progress for this long is a wedge.
    wedge_window_s: float = 20.0

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<config>",
                  base: SimParams | None = None) -> SimParams:
        """Parameters from a ``[sim]`` table; with ``base``, only the named fields change.

        Every value is finite and non-negative; bandwidths, the poll cadence and the wedge
        window are positive (a zero there divides by zero or never advances time).
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key not in fields:
                close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
                hint = f"; did you mean 'sim.{close[0]}'?" if close else ""
                raise ConfigError(f"{source}: field 'sim.{key}': unknown{hint} (known: "
                                  f"{', '.join(sorted(fields))})")
            want = fields[key].type
            if want == "bool":
                ok = isinstance(value, bool)
            elif want == "int":
                ok = isinstance(value, int) and not isinstance(value, bool)
            else:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or (not isinstance(value, bool) and not (math.isfinite(value)
                                                               and value >= 0)):
                raise ConfigError(f"{source}: field 'sim.{key}': expected a finite, "
                                  f"non-negative {want}, got {value!r}")
            if key in POSITIVE and value <= 0:
                raise ConfigError(f"{source}: field 'sim.{key}': must be positive, got "
                                  f"{value!r}")
            kwargs[key] = value
        return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: ``SimParams`` fields that must be positive (divisors, cadences, the wedge window).
POSITIVE = frozenset({"nic_bandwidth_Bps", "gather_bandwidth_Bps", "scatter_bandwidth_Bps",
                      "ranks_per_nic", "decode_poll_interval_s", "wedge_window_s"})
