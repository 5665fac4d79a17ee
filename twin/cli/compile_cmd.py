"""``twin compile``: build (or remove) the optional compiled core (``twin.compiled``)."""

from __future__ import annotations

import time

import click

from twin import compiled


class BuildFailed(click.ClickException):
    """The compiler is missing or failed: exit 1 with its output."""

    exit_code = 1

    def show(self, file: object = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


@click.command("compile")
@click.option("--clean", is_flag=True, help="Remove the compiled core; run pure Python again.")
@click.option("--status", "show_status", is_flag=True,
              help="Only say which path this installation runs, and why.")
@click.option("--quick", is_flag=True,
              help="Build without C optimisation: about half the build time, slower code.")
@click.option("--verbose", is_flag=True, help="Show the compiler's output as it builds.")
def compile_command(clean: bool, show_status: bool, quick: bool, verbose: bool) -> None:
    """Rebuild the compiled core: mypyc compiles the protocol core, the runtime and the
    simulator (a third of the CPU time per simulation, benchmarks/bench_sim.py).

    scripts/setup.sh builds it where a C compiler is. Builds C extensions beside the Python
    sources; needs a C compiler, mypy and setuptools (pip install 'staging-twin[fast]'). Traces are byte-identical either way. Editing a
    compiled module's source switches back to pure Python until the next `twin compile`;
    TWIN_PURE_PYTHON=1 forces pure Python for one run.
    """
    if clean and show_status:
        from twin.cli.options import BadInput

        raise BadInput("--clean and --status: choose one")
    if show_status:
        click.echo(f"core: {compiled.state().line()}")
        return
    if clean:
        gone = compiled.remove()
        click.echo(f"removed {len(gone)} compiled file(s); the core runs pure Python")
        return
    click.echo(f"compiling {len(compiled.MODULES)} modules with mypyc (a few minutes) ...")
    t0 = time.monotonic()
    try:
        built = compiled.build(verbose=verbose, quick=quick)
    except RuntimeError as e:
        raise BuildFailed(str(e)) from None
    click.echo(f"built {len(built)} extension(s) in {time.monotonic() - t0:.0f} s; "
               "new twin processes run the compiled core (twin compile --status)")


COMMANDS = [compile_command]
