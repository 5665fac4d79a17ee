"""Shared CLI plumbing: bad-input errors, config and workload resolution, output."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import click

from twin.core.config import ConfigError, TwinConfig
from twin.core.defects import ALL_DEFECTS, Defects
from twin.core.fixes import ALL_FIXES, Fixes
from twin.runtime.faults import FaultSpec, FaultSpecError, parse_fault
from twin.runtime.outcome import EXIT_BAD_INPUT
from twin.runtime.params import SimParams
from twin.sim.scenarios import Scenario
from twin.workloads import Workload, WorkloadError, parse_workload_spec


class BadInput(click.ClickException):
    """Invalid user input: printed as ``error: ...`` with exit code 2."""

    exit_code = EXIT_BAD_INPUT

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def load_config(path: str | None, base: TwinConfig | None = None) -> TwinConfig:
    try:
        if path is None:
            return base or TwinConfig()
        return TwinConfig.from_toml(path)
    except ConfigError as exc:
        raise BadInput(str(exc)) from None


def load_workload(spec: str) -> Workload:
    try:
        return parse_workload_spec(spec)
    except (WorkloadError, ValueError, OSError) as exc:
        raise BadInput(str(exc)) from None


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
fault_option = click.option(
    "--fault", "faults", multiple=True, metavar="SPEC",
    help="Inject a fault (repeatable), e.g. drop:WATERMARK:nth=3, delay:CHUNK_READY:ms=20:p=0.5,"
         " fail-transfer:p=0.01, crash:d0g0r0:at=2, abort:room=3:at=1.5.")


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True))


def apply_launch(cfg: TwinConfig, prefill_args: str | None, decode_args: str | None,
                 env_items: tuple[str, ...] | list[str], source: str | None) -> TwinConfig:
    """Apply SGLang launch arguments from the command line, or from the config's ``[launch]``
    table (``prefill = "..."``, ``decode = "..."``, ``env = {KEY = "VALUE"}``)."""
    from twin.launch_args import config_from_launch

    table = cfg.extra.get("launch", {})
    env: dict[str, str] = {str(k): str(v) for k, v in table.get("env", {}).items()}
    for item in env_items:
        key, sep, value = item.partition("=")
        if not sep:
            raise BadInput(f"--env {item!r}: expected KEY=VALUE")
        env[key] = value
    prefill = prefill_args if prefill_args is not None else table.get("prefill")
    decode = decode_args if decode_args is not None else table.get("decode")
    if prefill is None and decode is None and not env:
        return cfg
    try:
        return config_from_launch(prefill or "", decode or "", env, base=cfg)
    except ConfigError as exc:
        where = f"{source}: [launch]: " if source and table else ""
        raise BadInput(f"{where}{exc}") from None


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


def resolve_run(*, scenario: str | None, scenario_defects: bool, config_path: str | None,
                workload_spec: str | None, first_n: int | None, slowdown: float | None,
                defects: tuple[str, ...], faults: tuple[str, ...],
                prefill_args: str | None = None, decode_args: str | None = None,
                env_items: tuple[str, ...] = (), max_concurrency: int | None = None,
                sglang_defaults_for_own_workload: bool = True) -> RunInputs:
    """Shared by ``twin sim`` and ``twin hw``: scenario (default ``default``), then the config
    file (with its ``[sim]`` costs and ``[launch]`` lines), flags, workload cut and defects.

    With ``sglang_defaults_for_own_workload``, a ``--workload`` given without a scenario or
    config runs on SGLang's defaults (8B-class model, 4096 MiB ring) rather than the scenario's
    small demo model.
    """
    from twin.sim.scenarios import SCENARIOS

    name = scenario or "default"
    if name not in SCENARIOS:
        raise BadInput(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    sc = SCENARIOS[name]
    own = sglang_defaults_for_own_workload and workload_spec is not None and scenario is None
    cfg = load_config(config_path, TwinConfig() if own else sc.config)
    params = SimParams() if own else sc.params
    if config_path is not None:
        try:
            params = SimParams.from_dict(cfg.extra.get("sim", {}), config_path)
        except ConfigError as exc:
            raise BadInput(str(exc)) from None
    cfg = apply_launch(cfg, prefill_args, decode_args, env_items, config_path)
    workload = load_workload(workload_spec) if workload_spec else sc.workload()
    if first_n is not None or slowdown is not None:
        workload = cut_workload(workload, first_n, slowdown)
    names = list(sc.base_defects) + (list(sc.defects) if scenario_defects else []) + list(defects)
    ctx = click.get_current_context(silent=True)
    fixes = tuple(ctx.meta.get("twin_fixes", ())) if ctx is not None else ()
    if fixes:
        cfg = cfg.replace(fixes=tuple(sorted({*cfg.fixes, *fixes})))
    return RunInputs(sc, cfg, params, workload, make_defects(names),
                     parse_faults([*sc.faults, *faults]),
                     sc.overrides if not workload_spec else {},
                     max_concurrency or sc.max_concurrency)


def cut_workload(workload: Workload, first_n: int | None, slowdown: float | None) -> Workload:
    """The first ``first_n`` requests, inter-arrival times stretched by ``slowdown``."""
    reqs = workload.requests[:first_n] if first_n else workload.requests
    if slowdown is not None:
        if slowdown <= 0:
            raise BadInput("--slowdown must be positive")
        reqs = tuple(replace(r, arrival_s=r.arrival_s * slowdown) for r in reqs)
    return Workload(name=workload.name, requests=tuple(reqs), source=workload.source)
