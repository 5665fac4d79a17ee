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
