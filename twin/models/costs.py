"""What a deployment's compute costs and KV pools are: resolved once per run from the config.

``Deployment.build(cfg, params)`` reads the named model and GPU (``[serving]``), each
server's knobs (SGLang's names) and the cost parameters, and gives per server:

* ``forward_s(batch)``: one prefill forward of ``(new tokens, cached prefix)`` per request;
* ``decode_step_s(batch, ctx_tokens)``: one decode step of the running batch;
* ``max_total_tokens`` and ``max_running_requests``: the KV pool and request slots of one
  scheduler (one attention group), derived as SGLang derives them unless set.

Costs come from a measured profile (``twin.models.profile``) when ``sim.compute_costs`` allows
and the model was named, else from the analytic formulas of ``SimParams``. ``source`` says
which, for the deployment line and the trace header.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from twin.core.config import ConfigError, ServerSide, TwinConfig
from twin.models.catalog import (
    DEFAULT_GPU,
    MODELS,
    GPUSpec,
    ModelSpec,
    check_tp,
    model_from_shape,
    resolve_gpu,
    resolve_model,
)
from twin.models.profile import Profile, find_profile
from twin.runtime.params import KV_CACHE_DTYPES, ServerArgs, ServingArgs, SimParams

MiB = 1 << 20


def reserved_mem_mb(role: str, side: ServerSide, args: ServerArgs, cfg: TwinConfig,
                    gpu: GPUSpec) -> float:
    """SGLang's estimate of non-static memory (activations, CUDA graphs) for
    ``--mem-fraction-static``'s default (``arg_groups/memory_hook.py``, simplified)."""
    if role == "decode":
        activation = max(args.max_running_requests or 256, 2048)
        graphs = 256 * 2.0  # decode CUDA graphs up to batch 256
    else:
        activation = max(cfg.chunked_prefill_size, 2048)
        graphs = 0.0
    reserved = 512 + activation * 1.5 + side.tp_size / 8 * 1024 + graphs
    if gpu.memory_bytes > 60 * 1024 * MiB:
        reserved = max(reserved, 10 * 1024)
    return reserved


@dataclass(frozen=True)
class ServerCosts:
    """One server's scheduler: compute costs, KV pool and request slots."""

    role: str
    tp: int
    model: ModelSpec
    gpu: GPUSpec
    params: SimParams
    profile: Profile | None
    max_total_tokens: int
    max_running_requests: int
    args: ServerArgs
    kv_bytes_per_token: int = 0  # on one rank of the server (its share of the KV heads)

    @property
    def source(self) -> str:
        return f"profile {self.profile.source}" if self.profile is not None else "analytic"

    def pool(self) -> str:
        """The KV pool for people: ``4.07 M tokens (62.1 GiB a GPU)``."""
        gib = self.max_total_tokens * self.kv_bytes_per_token / (1 << 30)
        size = f" ({gib:.1f} GiB a GPU)" if self.kv_bytes_per_token else ""
        return f"{count(self.max_total_tokens)} tokens{size}"

    def forward_s(self, batch: list[tuple[int, int]]) -> float:
        """One prefill forward: ``(new tokens, cached prefix)`` per request in the batch."""
        if self.profile is not None:
            return self.profile.prefill_s(batch)
        p = self.params
        tokens = 0
        ctx = 0.0
        for t, c in batch:  # a loop, not two generators: called on every forward
            tokens += t
            ctx += t * (c + t / 2)
        return (p.forward_overhead_s + tokens * p.prefill_s_per_token
                + ctx * p.prefill_s_per_token_ctx)

    def decode_step_s(self, batch: int, ctx_tokens: int) -> float:
        """One decode step of ``batch`` requests holding ``ctx_tokens`` KV tokens in all."""
        if self.profile is not None:
            return self.profile.decode_s(batch, ctx_tokens)
        base, per_ctx = self.analytic_decode_terms(batch)
        return base + ctx_tokens * per_ctx

    def analytic_decode_terms(self, batch: int) -> tuple[float, float]:
        """The analytic decode step of ``batch`` requests as ``(base, per KV token)``: a step
        holding ``ctx`` tokens costs ``base + ctx * per_token`` (without a profile)."""
        p = self.params
        return p.decode_step_s + batch * p.decode_s_per_seq, p.decode_s_per_ctx_token


@dataclass(frozen=True)
class Deployment:
    """Model, GPU and both servers' costs and pools of one run."""

    model: ModelSpec
    gpu: GPUSpec
    named: bool  # the model or GPU was named (profiles are used only then, under "auto")
    prefill: ServerCosts
    decode: ServerCosts

    @property
    def source(self) -> str:
        """Which compute costs are in use, in one line."""
        p, d = self.prefill, self.decode
        if p.source == d.source:
            return f"{p.source}"
        return f"prefill {p.source}; decode {d.source}"

    def describe(self) -> str:
        p, d = self.prefill, self.decode
        return (f"{self.model.name} on {self.gpu.name}; KV pool {p.pool()} x "
                f"{p.max_running_requests} requests (prefill), {d.pool()} x "
                f"{d.max_running_requests} (decode); costs: {self.source}")

    @classmethod
    def build(cls, cfg: TwinConfig, params: SimParams,
              serving: ServingArgs | None = None) -> Deployment:
        serving = serving or ServingArgs.from_config(cfg.extra)
        model = model_of(cfg, serving)
        gpu = resolve_gpu(serving.gpu or DEFAULT_GPU)
        named = bool(serving.model or serving.gpu)
        return cls(model=model, gpu=gpu, named=named,
                   prefill=_server("prefill", cfg.prefill, cfg, params, serving, model, gpu,
                                   named),
                   decode=_server("decode", cfg.decode, cfg, params, serving, model, gpu,
                                  named))


def model_of(cfg: TwinConfig, serving: ServingArgs) -> ModelSpec:
    """The served model: named (catalogue or recorded config.json fields) or from the shape."""
    if serving.model_config is not None:
        try:
            return ModelSpec(**serving.model_config)
        except TypeError as exc:
            raise ConfigError(f"field 'serving.model_config': {exc}") from None
    if serving.model:
        return resolve_model(serving.model)
    return model_from_shape(cfg.model)


def configure(cfg: TwinConfig, model: str | None = None, gpu: str | None = None) -> TwinConfig:
    """Apply ``--model`` / ``--gpu`` (and a ``--model-path`` from a launch line) to ``cfg``.

    A named model sets the KV geometry (``[model]``) from its layers, KV heads, head dim and
    dtype (or ``--kv-cache-dtype``); a config.json's fields are recorded in
    ``serving.model_config`` so that the run replays without the file. Head splits SGLang
    rejects are rejected here, naming the server and its TP size. ``ConfigError`` on bad input.
    """
    serving = ServingArgs.from_config(cfg.extra)
    if model:
        serving = serving.replace(model=model, model_config=None)
    if gpu:
        serving = serving.replace(gpu=resolve_gpu(gpu).name)
    if serving.model and serving.model_config is None:
        spec = resolve_model(serving.model)
        if spec.name in MODELS and MODELS[spec.name] == spec:
            serving = serving.replace(model=spec.name)
        else:
            serving = serving.replace(model=spec.name, model_config=spec.to_dict())
    shape = cfg.model
    if serving.model or serving.model_config is not None:
        spec = model_of(cfg, serving)
        if spec.is_mla:
            raise ConfigError(f"--model {spec.name}: an MLA model; the staging buffer is for "
                              f"GQA and MHA models only")
        check_model_fits_tp(spec, cfg)
        shape = spec.shape
    kv = {KV_CACHE_DTYPES.get(serving.side(r).kv_cache_dtype) or shape.dtype_bytes
          for r in ("prefill", "decode")}
    if len(kv) > 1:
        raise ConfigError("field '--kv-cache-dtype': prefill and decode store KV in different "
                          "dtypes; the staging transfer needs the same layout on both sides")
    shape = replace(shape, dtype_bytes=kv.pop())
    if not (serving.model or serving.gpu or serving.model_config is not None) and \
            "serving" not in cfg.extra and shape == cfg.model:
        return cfg
    return cfg.replace(model=shape, extra={**cfg.extra, "serving": serving.to_dict()})


def _server(role: str, side: ServerSide, cfg: TwinConfig, params: SimParams,
            serving: ServingArgs, model: ModelSpec, gpu: GPUSpec, named: bool) -> ServerCosts:
    args = serving.side(role)
    tp = side.attn_tp_size
    profile = None
    if params.compute_costs == "profile" or (params.compute_costs == "auto" and named):
        profile = find_profile(model.name, gpu.name, side.tp_size if not
                               side.enable_dp_attention else tp)
        if profile is None and params.compute_costs == "profile":
            raise ConfigError(f"sim.compute_costs = 'profile': no profile for {model.name} on "
                              f"{gpu.name} at TP {side.tp_size} (see `twin models`)")
    kv_elem = KV_CACHE_DTYPES.get(args.kv_cache_dtype) or cfg.model.dtype_bytes
    heads = max(1, cfg.model.num_kv_heads // tp)
    kv_per_token = 2 * cfg.model.num_layers * heads * cfg.model.head_dim * kv_elem
    total = args.max_total_tokens
    if total is None:
        frac = args.mem_fraction_static
        if frac is None:
            gpu_mb = gpu.memory_bytes / MiB
            frac = round((gpu_mb - reserved_mem_mb(role, side, args, cfg, gpu)) / gpu_mb, 3)
        rest = gpu.memory_bytes * frac - model.weight_bytes() / side.tp_size
        total = int(rest // kv_per_token)
        if total <= 0:
            raise ConfigError(
                f"{role}: {model.name} does not fit on {gpu.name} at TP {side.tp_size}: weights "
                f"{model.weight_bytes() / side.tp_size / (1 << 30):.1f} GiB per rank, "
                f"{gpu.memory_bytes * frac / (1 << 30):.1f} GiB usable "
                f"(mem_fraction_static {frac})")
    slots = args.max_running_requests
    if slots is None:
        estimated = int(total / model.context_len * 512)
        slots = max(1, min(max(min(estimated, 4096), 2048), total // 2))
    return ServerCosts(role=role, tp=tp, model=model, gpu=gpu, params=params, profile=profile,
                       max_total_tokens=total, max_running_requests=slots, args=args,
                       kv_bytes_per_token=kv_per_token)


def count(n: int) -> str:
    """``n`` in three significant digits: 512, 40.7 k, 4.07 M."""
    if n >= 1_000_000:
        return f"{n / 1e6:.3g} M"
    if n >= 10_000:
        return f"{n / 1e3:.3g} k"
    return str(n)


def check_model_fits_tp(model: ModelSpec, cfg: TwinConfig) -> None:
    """Reject head splits SGLang would reject, on both servers."""
    for role in ("prefill", "decode"):
        side: ServerSide = getattr(cfg, role)
        check_tp(model, side.attn_tp_size, f"{role} --tp-size {side.tp_size}")
