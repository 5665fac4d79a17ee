"""The ``twin`` command: simulate, inspect traces, replay, and validate on hardware.

Exit codes (``twin.runtime.outcome``): 0 every request that ended succeeded (or ``--until``
stopped the run first); 1 a rank died or raised, or the run was interrupted (Ctrl-C, SIGTERM,
SIGHUP); 2 bad input; 3 wedge; 4 corruption; 5 requests failed with no wedge and no corruption.
"""

from __future__ import annotations

import click

from twin import __version__, compiled
from twin.cli.common import BadInput, one_value_per_option


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
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


def _register() -> None:
    from twin.cli import (
        agent_cmd,
        calibrate_cmd,
        compile_cmd,
        hw_cmd,
        info_cmd,
        models_cmd,
        sim_cmd,
        sweep_cmd,
        trace_cmd,
    )

    for module in (sim_cmd, info_cmd, trace_cmd, hw_cmd, agent_cmd, models_cmd, calibrate_cmd,
                   sweep_cmd, compile_cmd):
        for command in module.COMMANDS:
            one_value_per_option(command)
            cli.add_command(command)


_register()


def main() -> None:
    try:
        cli(standalone_mode=True)
    except BadInput as exc:  # pragma: no cover - click handles ClickException itself
        raise SystemExit(exc.exit_code) from None
