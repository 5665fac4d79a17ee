"""The ``twin`` command: simulate, inspect traces, replay, and validate on hardware.

Exit codes (``twin.runtime.outcome``): 0 every request that ended succeeded (or ``--until``
stopped the run first); 1 a rank died or raised, or the run was interrupted (Ctrl-C, SIGTERM,
SIGHUP); 2 bad input; 3 wedge; 4 corruption; 5 requests failed with no wedge and no corruption.
"""

from __future__ import annotations

import importlib

import click

from twin import __version__, compiled
from twin.cli.options import BadInput, one_value_per_option

COMMAND_MODULES: dict[str, str] = {
    "sim": "sim_cmd", "scenarios": "sim_cmd", "config": "sim_cmd",
    "defects": "info_cmd", "walkthrough": "info_cmd",
    "trace": "trace_cmd", "perfetto": "trace_cmd", "replay": "trace_cmd",
    "hw": "hw_cmd", "agent": "agent_cmd", "models": "models_cmd", "calibrate": "calibrate_cmd",
    "sweep": "sweep_cmd", "advise": "sweep_cmd", "plot": "sweep_cmd", "compile": "compile_cmd",
    "explore": "explore_cmd", "shrink": "explore_cmd",
}
"""Each subcommand's module in ``twin.cli`` (its ``COMMANDS``), imported when the subcommand
runs (or ``--help`` lists them): ``twin trace summary`` does not import the simulator."""


class _LazyGroup(click.Group):
    """A group whose subcommands are loaded from ``COMMAND_MODULES`` on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMAND_MODULES)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMAND_MODULES:
            module = importlib.import_module(f"twin.cli.{COMMAND_MODULES[cmd_name]}")
            for command in module.COMMANDS:
                if command.name not in self.commands:
                    one_value_per_option(command)
                    self.add_command(command)
        return self.commands.get(cmd_name)


@click.group(cls=_LazyGroup,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="twin",
                      message=f"%(prog)s %(version)s (core: {compiled.state().line()})")
def cli() -> None:
    """staging-twin: a digital twin of SGLang's staging-buffer KV transfer.

    Start with `twin sim` (a built-in default run), `twin scenarios` (the upstream defects,
    reproduced) and `twin defects`.

    Exit codes: 0 every request that ended succeeded (or --until stopped the run first),
    1 a rank died or raised, or the run was interrupted, 2 bad input, 3 wedge,
    4 corruption, 5 requests failed (no wedge, no corruption).
    """


def main() -> None:
    try:
        cli(standalone_mode=True)
    except BadInput as exc:  # pragma: no cover - click handles ClickException itself
        raise SystemExit(exc.exit_code) from None
