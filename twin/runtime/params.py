"""Cost model of the simulated deployment, and the serving knobs of each server.

``SimParams``: every latency, bandwidth and cadence, with defaults. Defaults describe one H200
node pair on a 400 Gb/s RDMA fabric serving Llama-3.1-8B (the config's default KV shape). Override any field in the config's ``[sim]`` table; ``docs/simulator.md`` lists them.

``ServingArgs``: what each server's scheduler is told at launch, under SGLang's names
(``--max-total-tokens``, ``--mem-fraction-static``, ``--max-running-requests``, ...), plus the
named model and GPU. They live in the config's ``[serving]`` table (``[serving.prefill]``,
``[serving.decode]``, ``model``, ``gpu``), which ``--prefill-args``/``--decode-args``,
``--model`` and ``--gpu`` fill.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any

from twin.core.config import ConfigError

COMPUTE_COSTS = ("auto", "analytic", "profile")


@dataclass(frozen=True, slots=True)
class SimParams:
    """Latencies in seconds, bandwidths in bytes per second."""

    # Control plane (ZMQ over TCP): one-way latency = zmq_latency_s + Exp(zmq_jitter_s).
    zmq_latency_s: float = 50e-6
    zmq_jitter_s: float = 20e-6
    # A send to a peer that is gone (twin/sim/sockets.py): frames queue up to the socket's
    # high-water mark (ZMQ_SNDHWM, messages), then each send blocks its thread for the send
    # timeout of decode's sockets (SGLANG_DISAGGREGATION_ZMQ_SEND_TIMEOUT, 1 s).
    zmq_send_timeout_s: float = 1.0
    zmq_sndhwm: int = 1000
    # Decode's heartbeat (common/conn.py ~2004-2083): it probes each prefill server's
    # bootstrap endpoint every SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL seconds and, after
    # SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE failed probes in a row, fails the rooms of
    # that server (_handle_node_failure) and closes its cached sockets.
    heartbeat_interval_s: float = 5.0
    heartbeat_max_failure: int = 2
    # Data plane (RDMA WRITE): latency plus bytes / NIC bandwidth; ranks share NICs.
    rdma_latency_s: float = 8e-6
    # Mean of an exponential extra latency per WRITE (0: none); calibrated on hosts where
    # WRITEs wait on process scheduling (the hardware mode on a shared CPU host).
    transfer_jitter_s: float = 0.0
    # Mooncake: batch_transfer_sync returns -1 when a batch outlives the engine's wall-clock
    # timeout (MC_TRANSFER_TIMEOUT, 30 s by default), with the batch possibly still writing;
    # SGLang then poisons the room (mooncake/conn.py ~2478). 0: no timeout. NIXL: none.
    mooncake_transfer_timeout_s: float = 30.0
    nic_bandwidth_Bps: float = 50e9
    # A room that needs no staging (equal attention TP) is written page by page: one RDMA
    # WRITE per page, layer and K/V, each costing this on top of its bytes (no gather kernel).
    # The default is about a NIC's message rate for small writes; ``twin calibrate`` fits it
    # from hardware traces that have direct writes.
    direct_write_s: float = 5e-8
    ranks_per_nic: int = 2
    # Device copies: gather on prefill, scatter on decode (HBM-bound kernels).
    gather_bandwidth_Bps: float = 600e9
    scatter_bandwidth_Bps: float = 600e9
    kernel_launch_s: float = 15e-6
    # Analytic compute costs (compute_costs "analytic", or nothing named). Defaults: a
    # least-squares fit (relative error) to the measured profile of Llama-3.1-8B on H200,
    # prefill at TP4 and decode at TP2, within 8% of it from 256 to 8192 tokens.
    # Prefill: forward = overhead + tokens * s_per_token + tokens * context * s_per_ctx.
    forward_overhead_s: float = 1.9e-3
    prefill_s_per_token: float = 8.1e-6
    prefill_s_per_token_ctx: float = 2.1e-10
    # Requests one prefill forward may take (0: as many as the token budget holds, as SGLang
    # does; 1: one request per forward, as the hardware mode's scheduler does).
    prefill_requests_per_forward: int = 0
    # Mean of an exponential delay before each prefill rank sees the scheduler's calls
    # (Prefetch, send_kv_chunk), FIFO per rank. 0: the ranks move in lockstep, as SGLang's TP
    # ranks do; the hardware mode's coordinator reaches its rank processes one by one.
    prefill_command_jitter_s: float = 0.0
    # Per-process stalls (twin/sim/stalls.py): each rank process alternates running
    # (exponential, mean process_run_s) and descheduled (mean process_stall_s), handling what
    # reached it meanwhile when it runs again. 0: never stalls (a dedicated core per rank).
    process_stall_s: float = 0.0
    process_run_s: float = 0.1
    # Gathers and scatters run on the rank process's own thread (the hardware mode on CPU:
    # torch copies in the process's loop) rather than on a device stream: while one runs, the
    # process handles nothing else, and the frames its input produced leave after it.
    blocking_kernels: bool = False
    # Coalesced polls (TwinConfig.worker_polls): the cores account the deferral re-polls that
    # can only defer again and the engine runs one poll where a chunk can move; the same run,
    # several times faster in a deferral storm. False feeds every re-poll (and so do runs
    # with process stalls, blocking kernels or a fix that coalescing excludes, and runs that
    # write a trace file, which must replay on real ranks too).
    coalesce_polls: bool = True
    # Decode loop: one decode step for the running batch lasts decode_step_s + batch *
    # decode_s_per_seq + context tokens * decode_s_per_ctx_token; scatter events are polled,
    # staging freed and requests admitted once per iteration. With no batch to run the loop
    # iterates every decode_poll_interval_s.
    decode_poll_interval_s: float = 2e-3
    decode_step_s: float = 3.2e-3
    decode_s_per_seq: float = 7.1e-6
    decode_s_per_ctx_token: float = 1.46e-8
    decode_prealloc_s: float = 1e-3
    # Where prefill forward and decode step times come from: "profile" (measured per-operator
    # tables of the named model and GPU, see twin/models), "analytic" (the formulas above), or
    # "auto" (a profile where one exists for the model, GPU and TP size, else analytic).
    compute_costs: str = "auto"
    # Radix caches (tokens). -1 (prefill's default): each group's cache lives in that group's KV
    # pool, as SGLang's radix cache does (prefixes stay in free pool pages, evicted LRU when
    # running requests need the pages); N > 0: one separate N-token cache shared by every group
    # (the twin's earlier model, kept as an override); 0: off.
    prefill_radix_tokens: int = -1
    decode_radix_tokens: int = 0
    # Early send of the prefill-cached prefix (SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX).
    early_send_cached_prefix: bool = True
    # Liveness: pending work with no progress for this long is a wedge.
    wedge_window_s: float = 20.0

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<config>",
                  base: SimParams | None = None) -> SimParams:
        """Parameters from a ``[sim]`` table; with ``base``, only the named fields change.

        Every value is finite and non-negative (a radix cache size may also be -1, "in the KV
        pool"); bandwidths, the poll cadence and the wedge
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
            if want == "str":
                if value not in COMPUTE_COSTS:
                    raise ConfigError(f"{source}: field 'sim.{key}': expected one of "
                                      f"{', '.join(COMPUTE_COSTS)}, got {value!r}")
                kwargs[key] = value
                continue
            if want == "bool":
                ok = isinstance(value, bool)
            elif want == "int":
                ok = isinstance(value, int) and not isinstance(value, bool)
            else:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if ok and key in RADIX_FIELDS and value == RADIX_IN_POOL:
                kwargs[key] = value
                continue
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

    def replace(self, **changes: Any) -> SimParams:
        return dataclasses.replace(self, **changes)


#: ``prefill_radix_tokens`` / ``decode_radix_tokens``: the cache lives in the group's KV pool.
RADIX_IN_POOL = -1
RADIX_FIELDS = frozenset({"prefill_radix_tokens", "decode_radix_tokens"})

#: ``SimParams`` fields that must be positive (divisors, cadences, the wedge window).
POSITIVE = frozenset({"nic_bandwidth_Bps", "gather_bandwidth_Bps", "scatter_bandwidth_Bps",
                      "ranks_per_nic", "decode_poll_interval_s", "wedge_window_s",
                      "process_run_s", "heartbeat_interval_s", "heartbeat_max_failure"})


def longest_timeout(cfg: Any, params: SimParams) -> float:
    """The longest of SGLang's timeouts that can still end or move a stuck run: decode's
    waiting timeout, prefill's bootstrap timeout, the deferred decode KV release deadline,
    Mooncake's transfer timeout and the heartbeat's window. Past it with no progress, nothing
    but a send that blocks again and again can happen."""
    return float(max(cfg.waiting_timeout_s, cfg.bootstrap_timeout_s,
                     cfg.deferred_decode_kv_release_timeout_s,
                     params.mooncake_transfer_timeout_s,
                     params.heartbeat_interval_s * params.heartbeat_max_failure))


@dataclass(frozen=True, slots=True)
class ServerArgs:
    """One server's memory and scheduling knobs, under SGLang's names. ``None``: derived as
    SGLang derives it (from the GPU's memory, the model's weights and KV size)."""

    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    max_prefill_tokens: int = 16384
    num_reserved_decode_tokens: int = 512
    disaggregation_decode_polling_interval: int = 1
    kv_cache_dtype: str = "auto"

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


KV_CACHE_DTYPES = {"auto": None, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
                   "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8": 1}
"""``--kv-cache-dtype`` values and the bytes per element they store (None: the model's)."""


@dataclass(frozen=True, slots=True)
class ServingArgs:
    """Both servers' knobs plus the named model and GPU (the config's ``[serving]`` table).

    ``model``: a catalogue name (``twin models``) or a config.json path; ``model_config``: the
    fields read from that file, kept so that a trace replays without it. ``gpu``: a GPU name.
    Empty strings mean "not named": the config's ``[model]`` shape and the default GPU.
    """

    prefill: ServerArgs = field(default_factory=ServerArgs)
    decode: ServerArgs = field(default_factory=ServerArgs)
    model: str = ""
    gpu: str = ""
    model_config: dict[str, Any] | None = None
    cost_source: str = ""  # informational: written by the run that resolved it

    @classmethod
    def from_config(cls, extra: dict[str, Any], source: str = "<config>") -> ServingArgs:
        """From a config's ``extra`` (its unknown tables); ``ConfigError`` names the field."""
        table = extra.get("serving", {})
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: field 'serving': expected a table")
        kw: dict[str, Any] = {}
        for key, value in table.items():
            if key in ("prefill", "decode"):
                kw[key] = _server_args(value, f"serving.{key}", source)
            elif key in ("model", "gpu", "cost_source"):
                if not isinstance(value, str):
                    raise ConfigError(f"{source}: field 'serving.{key}': expected a string")
                kw[key] = value
            elif key == "model_config":
                if not isinstance(value, dict):
                    raise ConfigError(f"{source}: field 'serving.model_config': expected a table")
                kw[key] = value
            else:
                raise ConfigError(f"{source}: field 'serving.{key}': unknown; known: cost_source, "
                                  f"decode, gpu, model, model_config, prefill")
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prefill": self.prefill.to_dict(), "decode": self.decode.to_dict()}
        for key in ("model", "gpu", "cost_source"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        if self.model_config is not None:
            out["model_config"] = dict(self.model_config)
        return out

    def side(self, role: str) -> ServerArgs:
        return self.prefill if role == "prefill" else self.decode

    def replace(self, **changes: Any) -> ServingArgs:
        return dataclasses.replace(self, **changes)


def _server_args(data: Any, where: str, source: str) -> ServerArgs:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: field {where!r}: expected a table")
    fields = {f.name: f for f in dataclasses.fields(ServerArgs)}
    kw: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in fields:
            raise ConfigError(f"{source}: field '{where}.{key}': unknown; known: "
                              f"{', '.join(sorted(fields))}")
        want = fields[name].type
        if name == "kv_cache_dtype":
            if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
                raise ConfigError(f"{source}: field '{where}.{key}': expected one of "
                                  f"{', '.join(KV_CACHE_DTYPES)}, got {value!r}")
        elif "float" in want:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not 0 < value <= 1:
                raise ConfigError(f"{source}: field '{where}.{key}': expected a fraction in "
                                  f"(0, 1], got {value!r}")
            value = float(value)
        elif isinstance(value, bool) or not isinstance(value, int) or value < (
                0 if name == "num_reserved_decode_tokens" else 1):
            raise ConfigError(f"{source}: field '{where}.{key}': expected a positive integer, "
                              f"got {value!r}")
        kw[name] = value
    return ServerArgs(**kw)
