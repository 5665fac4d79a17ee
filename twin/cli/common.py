"""Shared CLI plumbing: bad-input errors, config and workload resolution, output."""

from __future__ import annotations

import json
from typing import Any

import click

from twin.core.config import ConfigError, TwinConfig
from twin.core.defects import ALL_DEFECTS, Defects
from twin.sim.faults import FaultSpec, FaultSpecError, parse_fault
from twin.sim.workloads import Workload, WorkloadError, parse_workload_spec

EXIT_BAD_INPUT = 2


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


defect_option = click.option(
    "--defect", "defects", multiple=True, metavar="NAME",
    help=f"Switch an upstream defect back on (repeatable): {', '.join(ALL_DEFECTS)}.")
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
