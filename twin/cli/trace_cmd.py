"""``twin trace summary|room|diff``, ``twin perfetto`` and ``twin replay``."""

from __future__ import annotations

import sys

import click

from twin.cli.common import BadInput


def _read(path: str):  # type: ignore[no-untyped-def]
    from twin.trace.codec import TraceError
    from twin.trace.format import read_trace

    try:
        trace = read_trace(path)
    except (TraceError, OSError) as exc:
        raise BadInput(str(exc)) from None
    for w in trace.warnings:
        click.echo(f"warning: {w}", err=True)
    return trace


@click.group("trace")
def trace_group() -> None:
    """Inspect traces written by `twin sim` or `twin hw`."""


@trace_group.command("summary")
@click.argument("trace_path", type=click.Path(exists=True, dir_okay=False))
def trace_summary(trace_path: str) -> None:
    """Counts, outcome and per-room timing of a trace."""
    from twin.trace.inspect import summary

    click.echo(summary(_read(trace_path)))


@trace_group.command("room")
@click.argument("trace_path", type=click.Path(exists=True, dir_okay=False))
@click.argument("room", type=int)
def trace_room(trace_path: str, room: int) -> None:
    """A readable timeline of one room across every rank."""
    from twin.trace.inspect import room_timeline

    click.echo(room_timeline(_read(trace_path), room))


@trace_group.command("diff")
@click.argument("a", type=click.Path(exists=True, dir_okay=False))
@click.argument("b", type=click.Path(exists=True, dir_okay=False))
def trace_diff(a: str, b: str) -> None:
    """First divergence between two traces, then a summary of differences."""
    from twin.trace.inspect import diff, first_divergence

    ta, tb = _read(a), _read(b)
    click.echo(diff(ta, tb))
    sys.exit(1 if first_divergence(ta, tb) is not None else 0)


@click.command("perfetto")
@click.argument("trace_path", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--out", "out_path", required=True, type=click.Path(dir_okay=False),
              help="Chrome trace-event JSON for ui.perfetto.dev or chrome://tracing.")
def perfetto_command(trace_path: str, out_path: str) -> None:
    """Write a Perfetto-viewable timeline of a trace."""
    from twin.trace.perfetto import write_perfetto

    write_perfetto(_read(trace_path), out_path)
    click.echo(f"wrote {out_path} (open it in ui.perfetto.dev)")


COMMANDS = [trace_group, perfetto_command]
