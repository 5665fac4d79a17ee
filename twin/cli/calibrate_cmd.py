"""``twin calibrate``: fit the simulator's cost model to hardware-mode traces."""

from __future__ import annotations

import sys

import click

from twin.cli.common import emit_json
from twin.cli.options import BadInput


@click.command("calibrate")
@click.argument("trace_paths", nargs=-1, required=True,
                type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--out", "out_path", required=True, type=click.Path(dir_okay=False),
              help="Write the fitted [sim] table here (TOML; use with --config).")
@click.option("--seeds", type=int, default=3, show_default=True,
              help="Simulations per candidate (control-plane jitter is random).")
@click.option("--stalls", is_flag=True,
              help="Model the host's delays as per-process stalls (a descheduled rank handles "
                   "nothing until it runs again) instead of independent per-frame jitter.")
@click.option("--json", "as_json", is_flag=True, help="Print the fit as one JSON object.")
def calibrate_command(trace_paths: tuple[str, ...], out_path: str, seeds: int, stalls: bool,
                      as_json: bool) -> None:
    """Fit transfer, kernel, control-plane, prefill-cadence and polling costs to hardware-mode
    traces (`twin hw --trace-out`), and write them as a [sim] table. The cost of a direct page
    write (equal attention TP: direct_write_s) is fitted only from traces that have such
    writes; the output says whether it was.

    Check the fit on another hardware trace with `twin replay TRACE --config OUT`.
    """
    from twin.calibrate import calibrate, write_costs
    from twin.trace.format import TraceError, read_trace

    traces = []
    for p in trace_paths:
        try:
            t = read_trace(p)
        except (TraceError, OSError) as exc:
            raise BadInput(str(exc)) from None
        if t.header.get("mode") != "hw":
            raise BadInput(f"{p}: a {t.header.get('mode')} trace; calibration needs "
                           f"hardware-mode traces (`twin hw --trace-out`)")
        traces.append(t)
    if seeds < 1:
        raise BadInput("--seeds must be at least 1")
    cal = calibrate(traces, seeds=tuple(range(seeds)), stalls=stalls)
    write_costs(cal, out_path)
    if as_json:
        emit_json({**cal.report(), "out": out_path})
    else:
        for f in cal.fit:
            parts = []
            for phase in ("kv_done_s", "transfer_s"):
                if phase in f["ratio_p50"]:
                    parts.append(f"{phase} measured p50 {f['measured_p50'][phase] * 1e3:.2f} ms, "
                                 f"simulated {f['simulated_p50'][phase] * 1e3:.2f} ms "
                                 f"(ratio {f['ratio_p50'][phase]:.3f})")
            click.echo(f"{f['trace']}: " + "; ".join(parts))
        for note in cal.notes:
            click.echo(note)
        from twin.calibrate.host import describe

        click.echo(f"fitted on {describe(cal.host)}" if cal.host is not None else
                   f"fitted on an unknown host: {cal.host_unknown}")
        click.echo(f"wrote {out_path}; check another trace with "
                   f"`twin replay TRACE --config {out_path}`")
    sys.exit(0)


COMMANDS = [calibrate_command]
