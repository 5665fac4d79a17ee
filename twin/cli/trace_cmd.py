"""``twin trace summary|room|diff``, ``twin perfetto`` and ``twin replay``."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import click

from twin.cli.options import (
    BadInput,
    agent_options,
    print_diagnosis,
    reject_agent_options,
    writing,
)
from twin.runtime.outcome import EXIT_ERROR


def _read(path: str):  # type: ignore[no-untyped-def]
    """The whole trace in memory (hardware replay, which scripts every rank up front)."""
    from twin.trace.codec import TraceError
    from twin.trace.format import read_trace

    try:
        trace = read_trace(path)
    except (TraceError, OSError) as exc:
        raise BadInput(str(exc)) from None
    for w in trace.warnings:
        click.echo(f"warning: {w}", err=True)
    return trace


@contextlib.contextmanager
def _streaming(*paths: str):  # type: ignore[no-untyped-def]
    """Turn trace errors met while streaming into bad input; print the readers' warnings
    (final once a view has read its traces) afterwards."""
    from twin.trace.codec import TraceError

    readers: list = []  # type: ignore[type-arg]

    def open_reader(path: str, **kwargs):  # type: ignore[no-untyped-def]
        from twin.trace.format import TraceReader

        reader = TraceReader(path, lazy=True, **kwargs)
        readers.append(reader)
        return reader

    try:
        yield open_reader
    except (TraceError, OSError) as exc:
        raise BadInput(str(exc)) from None
    for reader in readers:
        for w in reader.warnings:
            click.echo(f"warning: {w}", err=True)


@click.group("trace")
def trace_group() -> None:
    """Inspect traces written by `twin sim` or `twin hw`."""


@trace_group.command("summary")
@click.argument("trace_path", type=click.Path(exists=True, dir_okay=False))
def trace_summary(trace_path: str) -> None:
    """Counts, outcome and per-room timing of a trace."""
    from twin.trace.codec import TraceError
    from twin.trace.inspect import summary_of_file

    try:
        text, warnings = summary_of_file(trace_path)
    except (TraceError, OSError) as exc:
        raise BadInput(str(exc)) from None
    click.echo(text, nl=False)
    for w in warnings:
        click.echo(f"warning: {w}", err=True)


@trace_group.command("room")
@click.argument("trace_path", type=click.Path(exists=True, dir_okay=False))
@click.argument("room", type=int)
def trace_room(trace_path: str, room: int) -> None:
    """A readable timeline of one room across every rank."""
    from twin.trace.inspect import room_timeline_of_file

    with _streaming():
        text, warnings = room_timeline_of_file(trace_path, room)
    click.echo(text, nl=False)
    for w in warnings:
        click.echo(f"warning: {w}", err=True)


@trace_group.command("diff")
@click.argument("a", type=click.Path(exists=True, dir_okay=False))
@click.argument("b", type=click.Path(exists=True, dir_okay=False))
def trace_diff(a: str, b: str) -> None:
    """First divergence between two traces, then a summary of differences."""
    from twin.trace.inspect import compare

    with _streaming() as open_reader:
        result = compare(open_reader(a), open_reader(b))
    click.echo(result.text, nl=False)
    sys.exit(1 if result.diverged else 0)


@click.command("perfetto")
@click.argument("trace_path", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--out", "out_path", required=True, type=click.Path(dir_okay=False),
              help="Output file: Perfetto protobuf (e.g. run.pftrace), or Chrome trace-event "
                   "JSON when it ends in .json or .json.gz; .gz compresses.")
@click.option("--format", "fmt", type=click.Choice(["proto", "json"]), default=None,
              help="Output format  [default: json for .json/.json.gz names, else proto]")
@click.option("--from", "t_from", type=float, default=None, metavar="SECONDS",
              help="Only the part of the run from this trace time on.")
@click.option("--to", "t_to", type=float, default=None, metavar="SECONDS",
              help="Only the part of the run up to this trace time.")
@click.option("--room", type=int, default=None,
              help="Only this room's slices, instants and flows (and counters while it lives).")
def perfetto_command(trace_path: str, out_path: str, fmt: str | None, t_from: float | None,
                     t_to: float | None, room: int | None) -> None:
    """Write a Perfetto timeline of a trace (open it in ui.perfetto.dev).

    The trace is streamed; with its index (TRACE.idx, written beside it) a window or a room
    is cut without reading the whole trace.
    """
    from twin.trace.perfetto import write_perfetto

    if t_from is not None and t_to is not None and t_to < t_from:
        raise BadInput(f"--to {t_to:g} is before --from {t_from:g}")
    from twin.runtime.signals import Interrupted, signals_interrupt

    try:
        # SIGTERM and SIGHUP stop it as Ctrl-C does; write_perfetto removes its partial file
        with signals_interrupt(), writing("--out", out_path), _streaming() as open_reader:
            write_perfetto(open_reader(trace_path), out_path, fmt=fmt, t_from=t_from,
                           t_to=t_to, room=room)
    except KeyboardInterrupt as exc:
        why = exc.args[0] if isinstance(exc, Interrupted) and exc.args else "Ctrl-C"
        click.echo(f"interrupted by {why}: {out_path} not written", err=True)
        sys.exit(EXIT_ERROR)
    click.echo(f"wrote {out_path} (open it in ui.perfetto.dev)")


COMMANDS = [trace_group, perfetto_command]


@click.command("replay")
@click.argument("trace_path", type=click.Path(exists=True, dir_okay=False))
@click.option("--mode", type=click.Choice(["sim", "hw"]), default="sim", show_default=True,
              help="sim: fresh cores fed the recorded inputs at the recorded times; "
                   "hw: real rank processes, NIXL and kernels.")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              default=None, help="A hardware trace's timing comparison simulates with this "
                                 "config's [sim] costs (e.g. from `twin calibrate`).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@agent_options
def replay_command(trace_path: str, mode: str, config_path: str | None, as_json: bool,
                   **across: Any) -> None:
    """Replay a trace and check that it reaches the same outcome.

    With --mode hw and --listen HOST:PORT the ranks run on the nodes of the agents that join
    (`twin agent --join HOST:PORT`), as in `twin hw`.

    Ctrl-C, SIGTERM and SIGHUP stop the replay with what it replayed so far (exit 1).

    Exit status: 0 same outcome and clean, 1 the replay diverged from the trace, the trace ends
    before its Outcome, or the replay was interrupted, 2 a bad or damaged trace, 3 wedge,
    4 corruption, 5 failed requests (reproduced).
    """
    if mode == "hw" and config_path is not None:
        raise BadInput("--config: a cost model for the simulated timing comparison; "
                       "--mode hw replays on real ranks and takes none")
    if mode == "hw":
        from twin.cli.hw_cmd import replay_on_hardware

        result = replay_on_hardware(_read(trace_path), echo=None if as_json else click.echo,
                                    **across)
    else:
        reject_agent_options(across)
        from twin.calibrate import costs_from
        from twin.calibrate.host import costs_host
        from twin.replay import replay_sim

        try:
            params = costs_from(config_path)
            fitted_on = costs_host(config_path)
        except ValueError as exc:  # ConfigError
            raise BadInput(str(exc)) from None
        from twin.runtime.signals import Interrupted, signals_interrupt

        try:
            # SIGTERM and SIGHUP stop the replay as Ctrl-C does: it reports what it replayed
            with signals_interrupt(), _streaming() as open_reader:
                result = replay_sim(open_reader(trace_path), params, costs_host=fitted_on)
        except KeyboardInterrupt as exc:  # before the replay began (reading the header)
            why = exc.args[0] if isinstance(exc, Interrupted) and exc.args else "Ctrl-C"
            if as_json:
                from twin.cli.common import emit_json

                emit_json({"inputs": 0, "status": "interrupted",
                           "interrupted": f"interrupted by {why} before the replay began"})
            else:
                click.echo(f"status      interrupted by {why} before the replay began")
            sys.exit(EXIT_ERROR)
    if as_json:
        from twin.cli.common import core_path, emit_json

        emit_json({"inputs": result.inputs, "core": core_path(), "status": result.status,
                   "completed": result.completed, "failed": result.failed,
                   "same_outcome": result.same_outcome, "differences": result.differences(),
                   "roots": result.roots,
                   "divergence": str(result.divergence) if result.divergence else None,
                   "diagnosis": result.diagnosis, "corruption": result.corruption,
                   "timing": result.timing, "interrupted": result.interrupted,
                   "ended_early": result.ended_early})
    else:
        from twin.cli.common import core_line

        click.echo(f"replayed {result.inputs} inputs ({mode}): {result.status}, "
                   f"{result.completed} completed, {result.failed} failed")
        click.echo(core_line())
        if result.interrupted is not None:
            click.echo(f"stopped     {result.interrupted}")
        if result.ended_early is not None:
            click.echo(f"input       {result.ended_early}")
        if result.divergence is not None:
            click.echo(str(result.divergence))
        rec = result.recorded
        if rec is not None:
            verdict = "same outcome as recorded" if result.same_outcome else "DIFFERENT outcome"
            click.echo(f"recorded: {rec['status']}, {rec['completed']} completed, "
                       f"{rec['failed']} failed -> {verdict}")
            if result.divergence is None:
                for line in result.differences():
                    click.echo(f"differs     {line}")
        for line in result.roots:
            click.echo(f"root        {line}")
        print_diagnosis(result.diagnosis)
        for line in result.corruption[:20]:
            click.echo(f"corruption  {line}")
        _print_timing(result.timing)
    sys.exit(result.exit_code if result.same_outcome or result.divergence else 1)


def _print_timing(timing: dict[str, Any] | None) -> None:
    if not timing:
        return
    if "error" in timing:
        click.echo(f"timing      {timing['error']}")
        return
    runs = timing.get("runs", 1)
    click.echo(f"timing      {runs} fresh simulation(s) of this hardware run: "
               f"{timing['simulated_status']}, {timing['rooms_compared']} rooms compared "
               f"(ratio = simulated / measured, pooled over the runs)")
    if timing.get("note"):
        click.echo(f"  note: {timing['note']}")
    host = timing.get("host") or {}
    if host.get("note"):
        click.echo(f"  note: {host['note']}")
    speed = timing.get("host_speed") or {}
    if speed.get("note"):
        click.echo(f"  note: {speed['note']}")
    for phase in ("kv_done_s", "transfer_s"):
        t = timing.get(phase)
        if t:
            click.echo(f"  {phase:11s} measured p50 {t['measured_p50'] * 1e3:8.2f} ms, simulated "
                       f"p50 {t['simulated_p50'] * 1e3:8.2f} ms, ratio p10/p50/p90 "
                       f"{t['ratio_p10']:.3g}/{t['ratio_p50']:.3g}/{t['ratio_p90']:.3g}")


COMMANDS.append(replay_command)
