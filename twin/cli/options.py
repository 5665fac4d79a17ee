"""CLI plumbing that needs nothing of the twin itself: bad-input errors, checked option
types, output paths, one value per option and the options of a run across nodes.

Light on purpose: ``twin`` loads a subcommand's module only when it runs, and a command that
reads a trace (``twin trace summary``) should not pay for importing the simulator.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from twin.runtime.outcome import EXIT_BAD_INPUT


class BadInput(click.ClickException):
    """Invalid user input: printed as ``error: ...`` with exit code 2."""

    exit_code = EXIT_BAD_INPUT

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


# -- checked option types ---------------------------------------------------------------------
class FiniteFloat(click.ParamType):
    """A finite float, positive (``min_open``) or non-negative; NaN and infinities rejected."""

    name = "float"

    def __init__(self, *, positive: bool = True) -> None:
        self.positive = positive

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        if isinstance(value, float) and math.isfinite(value):
            x = value
        else:
            try:
                x = float(value)
            except (TypeError, ValueError):
                self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(x):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        if self.positive and x <= 0:
            self.fail(f"{value!r} must be positive", param, ctx)
        if not self.positive and x < 0:
            self.fail(f"{value!r} must not be negative", param, ctx)
        return x


POSITIVE_FLOAT = FiniteFloat(positive=True)
POSITIVE_INT = click.IntRange(min=1)


# -- output paths -----------------------------------------------------------------------------
def check_output_file(path: str | os.PathLike[str] | None, flag: str) -> Path | None:
    """Fail early (``BadInput``) unless ``path`` can be created or overwritten as a file: its
    folder exists and is writable, and it is not a folder. For ``--trace-out``, ``perfetto -o``
    and any other file a command writes."""
    if path is None:
        return None
    p = Path(path)
    if str(path) == "" or p.name in ("", ".", ".."):
        raise BadInput(f"{flag} {str(path)!r}: expected a file name")
    if p.is_dir():
        raise BadInput(f"{flag} {str(p)!r}: is a folder; expected a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise BadInput(f"{flag} {str(p)!r}: folder {str(parent)!r} does not exist")
    if p.exists() and not os.access(p, os.W_OK):
        raise BadInput(f"{flag} {str(p)!r}: not writable")
    if not p.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise BadInput(f"{flag} {str(p)!r}: folder {str(parent)!r} is not writable")
    return p


def check_output_dir(path: str | os.PathLike[str] | None, flag: str) -> Path | None:
    """Fail early unless ``path`` is a writable folder or one that can be created in an
    existing, writable folder (``--plot``, ``--metrics-out``)."""
    if path is None:
        return None
    p = Path(path)
    if str(path) == "":
        raise BadInput(f"{flag}: expected a folder name")
    if p.exists():
        if not p.is_dir():
            raise BadInput(f"{flag} {str(p)!r}: exists and is not a folder")
        if not os.access(p, os.W_OK | os.X_OK):
            raise BadInput(f"{flag} {str(p)!r}: folder is not writable")
        return p
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise BadInput(f"{flag} {str(p)!r}: folder {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BadInput(f"{flag} {str(p)!r}: folder {str(parent)!r} is not writable")
    return p


#: errno values of a write that failed because of where it went, not because of a bug.
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS,
                errno.EFBIG, errno.EIO, errno.ENOENT, errno.ENOTDIR, errno.EISDIR)


def write_error(exc: OSError, flag: str, path: Any) -> BadInput:
    """A ``BadInput`` for an output that could not be written (a full disk, a lost folder)."""
    return BadInput(f"{flag} {str(path)!r}: cannot write: {exc.strerror or exc}")


@contextlib.contextmanager
def writing(flag: str, path: Any) -> Iterator[None]:
    """Check ``path`` as an output file for ``flag``, then turn a failed write inside the block
    (a full disk, a folder removed meanwhile) into ``BadInput``::

        with writing("--out", out_path):
            write_perfetto(trace, out_path)
    """
    check_output_file(path, flag)
    try:
        yield
    except OSError as exc:
        if exc.errno not in WRITE_ERRNOS:
            raise
        raise write_error(exc, flag, path) from None


# -- one value per option ---------------------------------------------------------------------
def _check_repeats(command: click.Command, args: list[str]) -> None:
    """Reject an option that takes one value given more than once (click would keep the last
    one silently); flags and repeatable options may repeat."""
    by_name: dict[str, click.Option] = {}
    for param in command.params:
        if isinstance(param, click.Option):
            for name in (*param.opts, *param.secondary_opts):
                by_name[name] = param
    seen: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if token == "--":
            break
        name, eq, value = token.partition("=") if token.startswith("--") else (token, "", "")
        param = by_name.get(name)
        if param is None:
            continue
        takes_value = not param.is_flag and not param.count
        if takes_value and not eq:
            value = args[i] if i < len(args) else ""
            i += 1
        if takes_value and not param.multiple and param.nargs == 1:
            seen.setdefault(param.opts[0], []).append(value)
    for opt, values in seen.items():
        if len(values) > 1:
            raise BadInput(f"{opt} given {len(values)} times ({', '.join(map(repr, values))}); "
                           f"it takes one value")


def one_value_per_option(command: click.Command) -> None:
    """Make ``command`` (and a group's subcommands) reject repeated single-value options."""
    parse = command.parse_args

    def parse_args(ctx: click.Context, args: list[str]) -> list[str]:
        _check_repeats(command, args)
        return parse(ctx, args)

    command.parse_args = parse_args  # type: ignore[method-assign]
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            one_value_per_option(sub)


# -- a run across nodes ----------------------------------------------------------------------
def agent_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--listen, --agents and the rest of a run across nodes (``twin hw``, ``twin replay``)."""
    for opt in reversed([
        click.option("--listen", default=None, metavar="HOST:PORT",
                     help="Run across nodes: listen here for `twin agent --join HOST:PORT` "
                          "(one per node) instead of starting the ranks on this host. Give a "
                          "private address; 0.0.0.0 listens on every interface."),
        click.option("--agents", "n_agents", type=POSITIVE_INT, default=None, metavar="N",
                     help="How many agents to wait for (default: one per [placement] "
                          "entry of the config)."),
        click.option("--agent-timeout", type=POSITIVE_FLOAT, default=120.0,
                     show_default=True, metavar="S",
                     help="Give up (exit 1, naming who is missing) if the agents have not all "
                          "joined within S seconds."),
        click.option("--heartbeat-timeout", type=POSITIVE_FLOAT, default=10.0,
                     show_default=True, metavar="S",
                     help="An agent silent for S seconds (dead, or its network lost) ends the "
                          "run, named in the verdict; agents stop their ranks after as long "
                          "without the coordinator."),
        click.option("--control-ports", default=None, metavar="FIRST-LAST",
                     help="Ports the ranks' control sockets listen on, on every node (an "
                          "agent's own --control-ports wins, and also holds the agent's own "
                          "socket); default: any free port."),
        click.option("--data-ports", default=None, metavar="FIRST-LAST",
                     help="Ports UCX's TCP transport listens on (UCX_TCP_PORT_RANGE), on every "
                          "node (an agent's own --data-ports wins); default: any free port."),
    ]):
        f = opt(f)
    return f


def reject_agent_options(across: dict[str, Any]) -> None:
    """Agent options given to a replay in simulation."""
    if across.get("listen") is not None or across.get("n_agents") is not None:
        raise BadInput("--listen/--agents run a replay on hardware across nodes: add "
                       "--mode hw")


DIAGNOSIS_DETAILS = 30
"""How many detail lines of a wedge's diagnosis the human-readable output shows."""


def print_diagnosis(lines: list[str], limit: int = DIAGNOSIS_DETAILS) -> None:
    """A wedge's diagnosis for people: its head and every root, then at most ``limit`` detail
    lines (a wedge of thousands of rooms has a line per room and rank; ``--json`` has all)."""
    heads = [line for line in lines if line.startswith(("wedge:", "root:"))]
    details = [line for line in lines if not line.startswith(("wedge:", "root:"))]
    for line in [*heads, *details[:limit]]:
        click.echo(f"wedge       {line}")
    if len(details) > limit:
        click.echo(f"wedge       ... {len(details) - limit} more detail line(s) (--json prints "
                   f"them all)")
