"""Shared CLI plumbing: bad-input errors, checked option types, output paths, and the one
resolver of run inputs (scenario, config file, launch lines, workload, defects, faults) that
``twin sim``, ``twin hw`` and ``twin config show`` share.

Layers, later ones win field by field:

1. the scenario's config and cost parameters (``--scenario``; without it: the small-model
   ``default`` scenario, or SGLang's defaults when ``--workload`` or ``--config`` is given);
2. each ``--config`` file in the order given (the option repeats: a deployment, then the
   costs ``twin calibrate`` wrote, say): its tables (``[model]``, ``[prefill]``,
   ``[decode]``, top-level fields, ``[sim]``), then its ``[launch]`` table (``prefill``,
   ``decode``, ``env``);
4. ``--prefill-args``, ``--decode-args`` and ``--env`` on the command line;
5. ``--model`` and ``--gpu`` (over the config's ``[serving]`` table and a launch line's
   ``--model-path``), then a check that the deployment fits (``Deployment.build``).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

import click

from twin.cli.options import POSITIVE_FLOAT, POSITIVE_INT, BadInput, check_output_file
from twin.core.config import ConfigError, TwinConfig
from twin.core.defects import ALL_DEFECTS, Defects
from twin.core.fixes import ALL_FIXES, Fixes
from twin.core.grid import pages_for_tokens
from twin.runtime.faults import FaultSpec, FaultSpecError, check_faults, parse_fault
from twin.runtime.params import SimParams
from twin.sim.scenarios import Scenario
from twin.workloads import Workload, WorkloadError, parse_workload_spec


# -- small loaders ----------------------------------------------------------------------------
def load_config(path: str | None, base: TwinConfig | None = None) -> TwinConfig:
    """The config file ``path`` layered over ``base`` (SGLang's defaults when None)."""
    try:
        if path is None:
            return base or TwinConfig()
        return TwinConfig.from_toml(path, base=base)
    except ConfigError as exc:
        raise BadInput(str(exc)) from None


def load_workload(spec: str) -> Workload:
    try:
        return parse_workload_spec(spec)
    except (WorkloadError, ValueError, OSError) as exc:
        raise BadInput(str(exc)) from None
    except UnicodeDecodeError as exc:  # pragma: no cover - ValueError covers it today
        raise BadInput(f"{spec}: not a text trace: {exc}") from None


def parse_faults(specs: tuple[str, ...] | list[str]) -> list[FaultSpec]:
    try:
        return [parse_fault(s) for s in specs]
    except FaultSpecError as exc:
        raise BadInput(str(exc)) from None


def make_defects(names: tuple[str, ...] | list[str]) -> Defects:
    try:
        return Defects.of(names)
    except ValueError as exc:
        raise BadInput(str(exc)) from None


_defect = click.option(
    "--defect", "defects", multiple=True, metavar="NAME",
    help=f"Switch an upstream defect back on (repeatable): {', '.join(ALL_DEFECTS)}.")


def _keep_fixes(ctx: click.Context, _param: click.Parameter, value: tuple[str, ...]) -> None:
    try:
        Fixes.of(value)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    ctx.meta["twin_fixes"] = tuple(value)


_fix = click.option(
    "--fix", "fixes", multiple=True, metavar="NAME", expose_value=False, callback=_keep_fixes,
    help=f"Switch on a proposed change SGLang has not merged (repeatable): "
         f"{', '.join(ALL_FIXES)}.")


def defect_option(f: Any) -> Any:
    """``--defect NAME`` and ``--fix NAME``; the fixes reach ``resolve_run`` through the click
    context, so every command that takes defects takes fixes too."""
    return _defect(_fix(f))


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True))


# -- options ----------------------------------------------------------------------------------
def fault_option(examples: str) -> Callable[[Any], Any]:
    return click.option(
        "--fault", "faults", multiple=True, metavar="SPEC",
        help=f"Inject a fault (repeatable), e.g. {examples}. A fault that names a node, room "
             "or chunk that does not exist is rejected; the summary says how often each fired.")


SIM_FAULT_EXAMPLES = ("drop:WATERMARK:nth=3, delay:CHUNK_READY:ms=20:p=0.5, fail-transfer:p=0.01,"
                      " crash:d0g0r0:at=2, abort:room=3:at=1.5")
HW_FAULT_EXAMPLES = ("drop:WATERMARK:nth=3, delay:CHUNK_READY:ms=20:p=0.5, dup:STAGING_RSP:p=0.1,"
                     " fail-transfer:nth=1, abort:room=3:at=1.5, crash:p0g1r0:at=2 (the rank "
                     "process ends; restart is simulator-only)")


def deployment_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--config, --scenario, --workload and the launch-line flags (everything that shapes the
    deployment; shared by ``twin sim``, ``twin hw`` and ``twin config show``)."""
    for opt in reversed([
        click.option("--config", "config_path", type=click.Path(dir_okay=False),
                     multiple=True, metavar="FILE",
                     help="TOML config (SGLang's names; [sim] sets cost parameters, [launch] "
                          "launch lines). Layered over the scenario, or over SGLang's "
                          "defaults without --scenario; repeatable, later files win field "
                          "by field (e.g. a deployment, then `twin calibrate`'s costs)."),
        click.option("--scenario", default=None, metavar="NAME",
                     help="Built-in scenario (see `twin scenarios`); default: 'default' (its "
                          "small demo model), or SGLang's defaults when --workload or "
                          "--config is given."),
        click.option("--workload", "workload_spec", default=None, metavar="FILE|SPEC",
                     help="Mooncake JSONL or Azure CSV trace (detected by content), or a "
                          "generator spec such as poisson:n=200,rate=5,input=4096,output=64,"
                          "seed=1."),
        click.option("--prefill-args", default=None, metavar="ARGS",
                     help="Prefill server launch arguments, e.g. '--tp-size 4 "
                          "--chunked-prefill-size 256'; only the fields named change."),
        click.option("--decode-args", default=None, metavar="ARGS",
                     help="Decode server launch arguments, e.g. '--tp-size 2'; only the fields "
                          "named change."),
        click.option("--env", "env_items", multiple=True, metavar="KEY=VALUE",
                     help="Staging environment variable (repeatable), e.g. "
                          "SGLANG_DISAGG_STAGING_POOL_SIZE_MB=64; unknown keys are rejected."),
        click.option("--model", "model", default=None, metavar="NAME|config.json",
                     help="Served model: a catalogue name (`twin models`) or a Hugging Face "
                          "config.json; sets the KV geometry, weights and (with --gpu) "
                          "measured compute costs."),
        click.option("--gpu", "gpu", default=None, metavar="NAME",
                     help="GPU of both servers (H200, H100, B200, A100, L40S): memory and "
                          "measured costs."),
    ]):
        f = opt(f)
    return f


def run_options(fault_examples: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Everything a run takes besides the deployment (shared by ``twin sim`` and ``twin hw``)."""
    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        for opt in reversed([
            click.option("--scenario-defects", is_flag=True,
                         help="Switch on the defects the scenario reproduces."),
            click.option("--first-n", type=POSITIVE_INT, default=None, metavar="N",
                         help="Keep the first N requests (N >= 1)."),
            click.option("--slowdown", type=POSITIVE_FLOAT, default=None, metavar="FACTOR",
                         help="Stretch inter-arrival times by FACTOR (> 0; 2 halves the "
                              "rate)."),
            defect_option,
            fault_option(fault_examples),
            click.option("--seed", type=int, default=0, show_default=True,
                         help="Root seed of every random stream (network jitter, "
                              "probabilistic faults); the same seed gives the same run."),
            click.option("--until", type=POSITIVE_FLOAT, default=None, metavar="SECONDS",
                         help="Stop after this much run time (simulated in `twin sim`, wall "
                              "clock in `twin hw`); status 'until', exit 0 unless requests "
                              "failed."),
            click.option("--max-concurrency", type=POSITIVE_INT, default=None, metavar="N",
                         help="Closed-loop clients: at most N requests in flight (N >= 1)."),
        ]):
            f = opt(f)
        return f
    return wrap


# -- --trace-out ------------------------------------------------------------------------------
#: Compression suffixes a trace is not written in (it is plain, ``.gz`` or ``.zst``): a name
#: ending in one would hold plain text under a compressed name.
OTHER_COMPRESSIONS = (".bz2", ".xz", ".lzma", ".lz", ".lz4", ".zip", ".7z", ".br", ".z",
                      ".zstd", ".gzip", ".tgz", ".tbz2", ".txz", ".tar", ".sz", ".snappy")


def workload_file(spec: str | None) -> str | None:
    """The file a ``--workload`` spec reads (a path, or ``trace:path=P,...``), else None."""
    if spec is None:
        return None
    text = spec.strip()
    if os.path.isfile(text):
        return text
    kind, sep, rest = text.partition(":")
    if sep and kind.strip().lower() == "trace":
        m = re.search(r"(?:^|,)\s*path\s*=\s*(.*?)\s*(?=,\s*(?:first_n|slowdown)\s*=|$)", rest)
        if m is not None and os.path.isfile(m.group(1)):
            return m.group(1)
    return None


def check_trace_out(trace_out: str | None, workload_spec: str | None,
                    config_path: str | tuple[str, ...] | list[str] | None) -> None:
    """``--trace-out`` as ``check_output_file`` checks it, and neither a compression the writer
    does not speak (it would write plain text under that name) nor a file the run reads."""
    check_output_file(trace_out, "--trace-out")
    if trace_out is None:
        return
    name = os.path.basename(trace_out).lower()
    for suffix in OTHER_COMPRESSIONS:
        if name.endswith(suffix):
            raise BadInput(f"--trace-out {trace_out!r}: traces are written plain, gzip (.gz) or "
                           f"zstd (.zst), not {suffix!r}; name it with one of those")
    if not os.path.exists(trace_out):
        return
    inputs = [("--workload", workload_file(workload_spec))]
    inputs += [("--config", p) for p in config_paths(config_path)]
    for flag, path in inputs:
        if path is not None and os.path.exists(path) and os.path.samefile(path, trace_out):
            raise BadInput(f"--trace-out {trace_out!r}: is the {flag} file this run reads; "
                           f"writing the trace would overwrite it")


# -- the deployment line ----------------------------------------------------------------------
def describe(cfg: TwinConfig) -> str:
    """One line: who writes to whom, model, ring and grid."""
    def side(x) -> str:  # type: ignore[no-untyped-def]
        dp = f" DP{x.dp_size} (DP attention)" if x.enable_dp_attention else ""
        inst = f" x{x.instances}" if x.instances > 1 else ""
        pp = f" PP{x.pp_size}" if x.pp_size > 1 else ""
        return f"TP{x.tp_size}{pp}{dp}{inst}"

    m = cfg.model
    ring = cfg.ring_bytes / (1 << 20)
    staging = (f"ring {ring:g} MiB per decode rank" if cfg.stages else
               "no staging (equal attention TP: KV pages written directly)")
    return (f"prefill {side(cfg.prefill)} -> decode {side(cfg.decode)}, {staging}, "
            f"chunked_prefill_size {cfg.chunked_prefill_size}, page "
            f"{cfg.page_size}, model {m.num_layers} layers x {m.num_kv_heads} KV heads x "
            f"{m.head_dim}, backend {cfg.disaggregation_transfer_backend}")


# -- the resolver -----------------------------------------------------------------------------
def _launch_table(cfg: TwinConfig, source: str | None) -> tuple[str | None, str | None,
                                                               dict[str, str]]:
    table = cfg.extra.get("launch", {})
    where = f"{source}: [launch]"
    unknown = sorted(set(table) - {"prefill", "decode", "env"})
    if unknown:
        from twin.launch_args import did_you_mean

        raise BadInput(f"{where}: field {unknown[0]!r}: unknown"
                       f"{did_you_mean(unknown[0], ['prefill', 'decode', 'env'])} "
                       f"(known: prefill, decode, env)")
    for key in ("prefill", "decode"):
        if key in table and not isinstance(table[key], str):
            raise BadInput(f"{where}: field {key!r}: expected a string of launch arguments")
    env = table.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, (str, int, float, bool))
                                            for v in env.values()):
        raise BadInput(f"{where}: field 'env': expected a table of KEY = \"VALUE\"")
    return table.get("prefill"), table.get("decode"), {str(k): str(v) for k, v in env.items()}


def apply_launch(cfg: TwinConfig, prefill_args: str | None, decode_args: str | None,
                 env_items: tuple[str, ...] | list[str], source: str | None,
                 params: SimParams | None = None) -> tuple[TwinConfig, SimParams]:
    """Layer the config's ``[launch]`` table, then the command line's launch lines and
    ``--env`` items, over ``cfg`` (and ``params``)."""
    from twin.launch_args import layer_launch

    params = params or SimParams()
    env: dict[str, str] = {}
    for item in env_items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise BadInput(f"--env {item!r}: expected KEY=VALUE")
        if key in env:
            given = [i for i in env_items if i.partition("=")[0] == key]
            raise BadInput(f"--env {key} given {len(given)} times "
                           f"({', '.join(map(repr, given))}); give each variable once")
        env[key] = value
    t_prefill, t_decode, t_env = _launch_table(cfg, source)
    layers = []
    if t_prefill is not None or t_decode is not None or t_env:
        layers.append((f"{source}: [launch]: ", t_prefill, t_decode, t_env))
    if prefill_args is not None or decode_args is not None or env:
        layers.append(("", prefill_args, decode_args, env))
    for where, prefill, decode, env_layer in layers:
        try:
            cfg, changes = layer_launch(cfg, prefill, decode, env_layer)
        except ConfigError as exc:
            raise BadInput(f"{where}{exc}") from None
        if changes:
            params = replace(params, **changes)
    return cfg, params


@dataclass
class RunInputs:
    """Everything a run needs, resolved from a scenario, a config file and the flags."""

    scenario: Scenario
    cfg: TwinConfig
    params: SimParams
    workload: Workload
    defects: Defects
    faults: list[FaultSpec]
    overrides: dict[int, dict[str, int]]
    max_concurrency: int | None
    notes: list[str] = field(default_factory=list)
    cut: str = ""
    basis: str = ""
    """Why the deployment is not the scenario's, when it is not (``deployment_basis``)."""

    def deployment_line(self) -> str:
        """The deployment, and where it came from when that is not the scenario."""
        return describe(self.cfg) + (f" ({self.basis})" if self.basis else "")

    def workload_line(self) -> str:
        """What runs: the workload, how it was cut, and the client model."""
        n = len(self.workload.requests)
        clients = (f"at most {self.max_concurrency} in flight" if self.max_concurrency
                   else "open loop")
        return f"{self.workload.name}: {n} request{'s' * (n != 1)}{self.cut}, {clients}"


def core_path() -> str:
    """The path this process runs the core on: ``compiled`` or ``pure`` (``twin.compiled``);
    every command that simulates names it in its text and JSON output."""
    from twin import compiled

    return compiled.state().mode


def core_line() -> str:
    """The ``core`` line of a command's text output: the path and why."""
    from twin import compiled

    return f"core        {compiled.state().line()}"


def config_paths(config_path: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """``--config`` as given: none, one path, or several (layered in order)."""
    if config_path is None:
        return ()
    return (config_path,) if isinstance(config_path, str) else tuple(config_path)


def deployment_basis(scenario: str | None,
                     config_path: str | tuple[str, ...] | list[str] | None,
                     workload_spec: str | None) -> str:
    """Why a run with its own workload does not use the demo deployment that ``twin sim``
    alone runs (the ``default`` scenario's): without ``--scenario`` or ``--config`` it starts
    from SGLang's defaults. "" otherwise (a config file names its own deployment)."""
    if scenario is not None or config_paths(config_path) or workload_spec is None:
        return ""
    return ("SGLang's defaults, as --workload was given without --scenario; "
            "--scenario default runs it on the demo deployment")


def resolve_deployment(*, scenario: str | None,
                       config_path: str | tuple[str, ...] | list[str] | None,
                       workload_spec: str | None, prefill_args: str | None = None,
                       decode_args: str | None = None, env_items: tuple[str, ...] = (),
                       model: str | None = None, gpu: str | None = None
                       ) -> tuple[Scenario, TwinConfig, SimParams]:
    """The scenario and the effective config and cost parameters (the layers in the module
    docstring)."""
    from twin.sim.scenarios import SCENARIOS

    name = scenario or "default"
    if name not in SCENARIOS:
        from twin.launch_args import did_you_mean

        raise BadInput(f"unknown scenario {name!r}{did_you_mean(name, list(SCENARIOS))} "
                       f"(known: {', '.join(SCENARIOS)})")
    sc = SCENARIOS[name]
    paths = config_paths(config_path)
    own = scenario is None and (workload_spec is not None or bool(paths))
    cfg = TwinConfig() if own else sc.config
    params = SimParams() if own else sc.params
    extra: dict[str, Any] = {}
    for path in paths:
        cfg = load_config(path, cfg)
        try:
            params = SimParams.from_dict(cfg.extra.get("sim", {}), path, base=params)
        except ConfigError as exc:
            raise BadInput(str(exc)) from None
        cfg, params = apply_launch(cfg, None, None, (), path, params)
        for key, table in cfg.extra.items():  # later files win entry by entry
            before = extra.get(key)
            extra[key] = ({**before, **table} if isinstance(before, dict)
                          and isinstance(table, dict) else table)
    if paths:
        cfg = cfg.replace(extra={k: v for k, v in extra.items() if k != "launch"})
    cfg, params = apply_launch(cfg, prefill_args, decode_args, env_items, None, params)
    try:
        from twin.models.costs import Deployment, configure

        cfg = configure(cfg, model, gpu)
        Deployment.build(cfg, params)  # the model fits the GPU, the profile exists, ...
    except ConfigError as exc:
        raise BadInput(str(exc)) from None
    return sc, cfg, params


def resolve_run(*, scenario: str | None, scenario_defects: bool,
                config_path: str | tuple[str, ...] | list[str] | None,
                workload_spec: str | None, first_n: int | None, slowdown: float | None,
                defects: tuple[str, ...], faults: tuple[str, ...],
                prefill_args: str | None = None, decode_args: str | None = None,
                env_items: tuple[str, ...] = (), max_concurrency: int | None = None,
                fault_check: Callable[[list[FaultSpec]], None] | None = None,
                model: str | None = None, gpu: str | None = None) -> RunInputs:
    """Shared by ``twin sim`` and ``twin hw``: the deployment (``resolve_deployment``), then
    the workload and its cut, defects and faults, each checked against the deployment."""
    if first_n is not None and first_n < 1:
        raise BadInput(f"--first-n {first_n}: must be at least 1")
    if slowdown is not None and not (math.isfinite(slowdown) and slowdown > 0):
        raise BadInput(f"--slowdown {slowdown}: must be a positive number")
    if max_concurrency is not None and max_concurrency < 1:
        raise BadInput(f"--max-concurrency {max_concurrency}: must be at least 1")
    sc, cfg, params = resolve_deployment(
        scenario=scenario, config_path=config_path, workload_spec=workload_spec,
        prefill_args=prefill_args, decode_args=decode_args, env_items=env_items,
        model=model, gpu=gpu)
    if scenario_defects and not sc.defects:
        raise BadInput(f"--scenario-defects: scenario {sc.name!r} reproduces no defect; name "
                       f"one with --scenario (see `twin scenarios`)")
    workload = load_workload(workload_spec) if workload_spec else sc.workload()
    total = len(workload.requests)
    cut = ""
    if first_n is not None or slowdown is not None:
        workload = cut_workload(workload, first_n, slowdown)
        if first_n is not None and first_n < total:
            cut += f" (first {first_n} of {total})"
        elif first_n is not None and first_n > total:
            cut += f" (all of them; --first-n {first_n} asked for more)"
        if slowdown is not None:
            cut += f" (arrivals stretched x{slowdown:g})"
    names = list(sc.base_defects) + (list(sc.defects) if scenario_defects else []) + list(defects)
    overrides = sc.overrides if not workload_spec else {}
    ctx = click.get_current_context(silent=True)
    fixes = tuple(ctx.meta.get("twin_fixes", ())) if ctx is not None else ()
    if fixes:
        cfg = cfg.replace(fixes=tuple(sorted({*cfg.fixes, *fixes})))
    specs = parse_faults([*sc.faults, *faults])
    run = RunInputs(sc, cfg, params, workload, make_defects(names), specs, overrides,
                    max_concurrency or sc.max_concurrency, cut=cut,
                    basis=deployment_basis(scenario, config_path, workload_spec))
    try:
        check_faults(specs, cfg, [r.input_len for r in workload.requests])
    except FaultSpecError as exc:
        raise BadInput(str(exc)) from None
    if fault_check is not None:
        fault_check(specs)
    check_request_lengths(cfg, workload, params)
    run.notes += check_ring(cfg, workload, params, overrides)
    return run


# -- can each request be served? --------------------------------------------------------------
def max_req_input_len(max_total_tokens: int) -> int:
    """The longest prompt a server with a KV pool of ``max_total_tokens`` admits, as SGLang's
    scheduler computes it: ``max_req_len = max_total_tokens - 1`` (or the context length, if
    smaller), ``max_req_input_len = max_req_len - 5``; ``validate_input_length`` aborts a
    request of ``len(input_ids) >= max_req_input_len``."""
    return max_total_tokens - 1 - 5


def check_request_lengths(cfg: TwinConfig, workload: Workload, params: SimParams) -> None:
    """Reject (``BadInput``) a workload with a prompt that a server's KV pool cannot hold:
    SGLang aborts such a request when it arrives (and refuses to start with a pool under 7
    tokens), so the twin names it before the run instead of wedging on it."""
    from twin.models.costs import Deployment

    deployment = Deployment.build(cfg, params)
    for role in ("prefill", "decode"):
        total = getattr(deployment, role).max_total_tokens
        limit = max_req_input_len(total)
        if limit <= 0:
            raise BadInput(f"{role}: max_total_tokens {total}: SGLang refuses to start with it "
                           f"(\"Memory pool size is too small\": a request needs at least 7 "
                           f"tokens of KV pool)")
        long = [r for r in workload.requests if r.input_len >= limit]
        if long:
            first = long[0]
            raise BadInput(
                f"request {first.rid} of {workload.name!r} has {first.input_len} input tokens "
                f"and the {role} server's KV pool is {total} tokens (max_total_tokens): SGLang "
                f"aborts a prompt of {limit} tokens or more (max_req_input_len = "
                f"max_total_tokens - 1 - 5); {len(long)} of {len(workload.requests)} "
                f"request(s) are that long. Raise --max-total-tokens (or give the server more "
                f"memory) or shorten them")
    total = deployment.decode.max_total_tokens
    cut = [r for r in workload.requests if r.output_len > total - 2 - r.input_len]
    if cut:
        first = cut[0]
        raise BadInput(
            f"request {first.rid} of {workload.name!r} has {first.input_len} input + "
            f"{first.output_len} output tokens and the decode server's KV pool is {total} "
            f"tokens (max_total_tokens): SGLang would cut its output to "
            f"{total - 2 - first.input_len} tokens (max_new_tokens <= max_total_tokens - 1 - "
            f"input - 1); {len(cut)} of {len(workload.requests)} request(s) would be cut. "
            f"Raise the decode server's --max-total-tokens or shorten them")


def cut_workload(workload: Workload, first_n: int | None, slowdown: float | None) -> Workload:
    """The first ``first_n`` requests, inter-arrival times stretched by ``slowdown``."""
    reqs = workload.requests[:first_n] if first_n is not None else workload.requests
    if slowdown is not None:
        if not (math.isfinite(slowdown) and slowdown > 0):
            raise BadInput("--slowdown must be a positive number")
        reqs = tuple(replace(r, arrival_s=r.arrival_s * slowdown) for r in reqs)
    return Workload(name=workload.name, requests=tuple(reqs), source=workload.source)


# -- can any request succeed? -----------------------------------------------------------------
def region_bytes(cfg: TwinConfig, pages: int) -> int:
    """The largest staging region ``pages`` pages take on any decode rank."""
    return _region_bytes(cfg, pages)


@lru_cache(maxsize=4096)
def _region_bytes(cfg: TwinConfig, pages: int) -> int:
    return max(cfg.region_layout(rank, pages)[2] for rank in range(cfg.decode.attn_tp_size))


def _mib_up(nbytes: int) -> int:
    return -(-nbytes // (1 << 20))


def check_ring(cfg: TwinConfig, workload: Workload, params: SimParams,
               overrides: dict[int, dict[str, int]]) -> list[str]:
    """Reject (``BadInput``) a ring in which no request of ``workload`` can ever be staged;
    return a note when some requests send chunks larger than the ring (they will fail).

    Sends are grid slots anchored at the decode-side cached prefix, so a request sends one
    region of ``min(full_chunk_pages, pages it transfers)`` pages; with a decode radix cache the
    pages it transfers can shrink to its uncached suffix.
    """
    if not workload.requests or not cfg.stages:  # nothing is staged: any ring will do
        return []
    full = cfg.full_chunk_pages
    page = cfg.page_size
    radix = params.decode_radix_tokens
    need_min = None
    need_max = 0
    too_big = 0
    ring = cfg.ring_bytes
    for r in workload.requests:
        o = overrides.get(r.rid, {})
        prefix = o.get("decode_prefix_len", 0)
        largest = min(full, pages_for_tokens(max(r.input_len - prefix, 1), page))
        smallest = largest
        if radix and "decode_prefix_len" not in o:
            cached = min(radix, max(r.input_len - 1, 0)) // page * page
            smallest = min(full, pages_for_tokens(max(r.input_len - cached, 1), page))
        lo = region_bytes(cfg, smallest)
        hi = region_bytes(cfg, largest)
        need_min = lo if need_min is None else min(need_min, lo)
        need_max = max(need_max, hi)
        too_big += hi > ring
    full_region = region_bytes(cfg, full)
    if need_min is not None and need_min > ring:
        works = min(need_max, full_region)
        raise BadInput(
            f"no request can succeed: the staging ring ({ring} bytes per decode rank) is "
            f"smaller than the smallest staged chunk this workload sends ({need_min} bytes; a "
            f"full chunk at chunked_prefill_size {cfg.chunked_prefill_size} is {full_region} "
            f"bytes). The smallest ring that fits every chunk is {works} bytes: "
            f"SGLANG_DISAGG_STAGING_POOL_SIZE_MB={_mib_up(works)}, or lower "
            f"chunked_prefill_size")
    if too_big:
        return [f"{too_big} request(s) send a chunk larger than the ring ({need_max} > {ring} "
                f"bytes) and will fail; SGLANG_DISAGG_STAGING_POOL_SIZE_MB="
                f"{_mib_up(need_max)} fits them all"]
    return []
