"""``twin sim``, ``twin scenarios`` and ``twin config``."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from twin.cli.common import (
    SIM_FAULT_EXAMPLES,
    RunInputs,
    check_trace_out,
    core_line,
    core_path,
    deployment_basis,
    deployment_options,
    describe,
    emit_json,
    resolve_deployment,
    resolve_run,
    run_options,
)
from twin.cli.options import (
    WRITE_ERRNOS,
    check_output_dir,
    print_diagnosis,
    write_error,
)
from twin.runtime.outcome import EXIT_CODES_HELP
from twin.sim.runner import SimResult, run_sim
from twin.sim.scenarios import SCENARIOS


def print_faults(faults: list[dict]) -> None:
    """One line per injected fault: how often it fired, flagging one that never did."""
    for f in faults:
        n = f["fired"]
        flag = "  <- never fired" if n == 0 else ""
        click.echo(f"fault       {f['fault']}: fired {n} time{'s' * (n != 1)}{flag}")


def print_blocked(s: dict) -> None:
    """The ``blocked`` line of a summary (``twin sim``'s or ``twin hw``'s): seconds its ranks'
    sends sat blocked on dead peers, by rank, frame and thread."""
    if s.get("send_blocked_s"):
        blocked = ", ".join(f"{n} {v:.1f} s" for n, v in s["send_blocked_s"].items())
        kinds = ", ".join(f"{k} {v:.1f} s" for k, v in s.get("send_blocked_by_frame", {}).items())
        threads = ", ".join(f"{k} {v:.1f} s"
                            for k, v in s.get("send_blocked_by_thread", {}).items())
        click.echo(f"blocked     sends to dead peers held threads: {blocked} (by frame: {kinds}; "
                   f"by thread: {threads})")


def print_roots(s: dict) -> None:
    """The summary's ``root`` lines (failed requests linked to the ranks that died)."""
    for line in s.get("roots", []):
        click.echo(f"root        {line}")


def _print_human(result: SimResult, run: RunInputs) -> None:
    s = result.summary()
    click.echo(f"deployment  {run.deployment_line()}")
    click.echo(f"serving     {result.sim.deployment.describe()}")
    click.echo(f"workload    {run.workload_line()}")
    for note in run.notes:
        click.echo(f"note        {note}")
    click.echo(f"status      {s['status']}  ({s['stop_reason']})")
    click.echo(f"requests    {s['requests']}: {s['completed']} completed, {s['failed']} failed, "
               f"{s['unfinished']} unfinished")
    click.echo(f"simulated   {s['sim_seconds']:.3f} s in {s['wall_seconds']:.3f} s wall, "
               f"{s['events']} core events" + (
                   f" (+ {s['polls_accounted']} coalesced deferral polls)"
                   if s.get("polls_accounted") else ""))
    click.echo(core_line())
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E")):
        lat = s["latency"].get(key, {})
        if lat:
            click.echo(f"{label:<11} p50 {lat['p50'] * 1e3:.1f} ms  p90 {lat['p90'] * 1e3:.1f} "
                       f"ms  p99 {lat['p99'] * 1e3:.1f} ms")
    print_blocked(s)
    if s["deferrals"]:
        click.echo(f"deferrals   {sum(s['deferrals'].values())} (backpressure waits)")
    if s["defects"]:
        click.echo(f"defects on  {', '.join(s['defects'])}")
    for reason, n in s["failures"].items():
        click.echo(f"failed      {n} x {reason}")
    print_roots(s)
    print_faults(s["fault_report"])
    print_diagnosis(s["diagnosis"])
    for line in s["corruption"][:20]:
        click.echo(f"corruption  {line}")


@click.command("sim", epilog=f"Exit status: {EXIT_CODES_HELP}")
@deployment_options
@run_options(SIM_FAULT_EXAMPLES)
@click.option("--trace-out", type=click.Path(dir_okay=False), default=None,
              help="Write the trace (JSON Lines; a name ending in .gz or .zst is "
                   "gzip- or zstd-compressed; other compression suffixes are rejected).")
@click.option("--metrics-out", type=click.Path(file_okay=False), default=None,
              help="Write requests.csv, occupancy.csv, watermark_lag.csv, decode_batch.csv, "
                   "prefill_pool.csv and metrics.json here.")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), default=None,
              help="Write latency.png, ring.png, deferrals.png and decode.png here.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary object.")
def sim_command(config_path, scenario, workload_spec, prefill_args, decode_args, env_items,
                model, gpu,
                scenario_defects, first_n, slowdown, defects, faults, seed, until,
                max_concurrency, trace_out, metrics_out, plot_dir, as_json) -> None:
    """Simulate a staged PD deployment and report wedges, corruption, failures and latency."""
    check_trace_out(trace_out, workload_spec, config_path)
    check_output_dir(metrics_out, "--metrics-out")
    check_output_dir(plot_dir, "--plot")
    run = resolve_run(scenario=scenario, scenario_defects=scenario_defects,
                      config_path=config_path, workload_spec=workload_spec, first_n=first_n,
                      slowdown=slowdown, defects=defects, faults=faults,
                      prefill_args=prefill_args, decode_args=decode_args, env_items=env_items,
                      max_concurrency=max_concurrency, model=model, gpu=gpu)
    from twin.runtime.signals import signals_interrupt

    try:
        with signals_interrupt():
            result = run_sim(
                run.cfg, run.workload, defects=run.defects, faults=run.faults, seed=seed,
                params=run.params, until=until, progress=not as_json,
                request_overrides=run.overrides, max_concurrency=run.max_concurrency,
                trace_out=trace_out)
    except OSError as exc:
        if trace_out is None or exc.errno not in WRITE_ERRNOS:
            raise
        raise write_error(exc, "--trace-out", trace_out) from None
    written: list[tuple[str, Path]] = []
    try:
        if metrics_out:
            result.sim.metrics.write(Path(metrics_out))
            written.append(("metrics", Path(metrics_out)))
        if plot_dir:
            from twin.sim.plots import write_plots

            write_plots(result.sim.metrics, Path(plot_dir), stopped_at=result.sim.env.now,
                        wedged=result.wedged, last_progress=result.sim.runtime.last_progress)
            written.append(("plots", Path(plot_dir)))
    except OSError as exc:
        if exc.errno not in WRITE_ERRNOS:
            raise
        flag, path = ("--plot", plot_dir) if written or not metrics_out else \
            ("--metrics-out", metrics_out)
        raise write_error(exc, flag, path) from None
    if as_json:
        emit_json({**result.summary(), "core": core_path(), "deployment": run.deployment_line(),
                   "workload_line": run.workload_line(), "notes": run.notes})
    else:
        _print_human(result, run)
        if trace_out:
            click.echo(f"trace       {trace_out}")
        for label, path in written:
            names = ", ".join(sorted(p.name for p in path.iterdir() if p.is_file()))
            click.echo(f"{label:<11} {path}/ ({names})")
    sys.exit(result.exit_code)


@click.command("scenarios")
@click.option("--check", is_flag=True,
              help="Run every scenario with its defects on and off and check the symptom.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def scenarios_command(check: bool, as_json: bool) -> None:
    """List the built-in scenarios (one per upstream defect) or check them all."""
    from twin.sim.scenarios import check_scenario

    rows = []
    for sc in SCENARIOS.values():
        row = {"name": sc.name, "defects": list(sc.defects), "symptom": sc.symptom,
               "summary": sc.summary}
        if check:
            row.update(check_scenario(sc))
        rows.append(row)
    if as_json:
        emit_json(rows)
    else:
        for row in rows:
            defects = ", ".join(row["defects"]) or "-"
            click.echo(f"{row['name']:20s} {row['symptom']:10s} {defects}")
            click.echo(f"{'':20s} {row['summary']}")
            if check:
                click.echo(f"{'':20s} defects on: {row['on']}; off: {row['off']} -> "
                           f"{'OK' if row['ok'] else 'MISMATCH'}")
        if not check:
            click.echo("\nRun one: twin sim --scenario NAME [--scenario-defects]")
    if check and not all(r["ok"] for r in rows):
        sys.exit(1)


@click.group("config")
def config_group() -> None:
    """The effective deployment config: what a run with the same flags would use."""


@config_group.command("show")
@deployment_options
def config_show_command(config_path, scenario, workload_spec, prefill_args, decode_args,
                        env_items, model, gpu) -> None:
    """Print the effective config as TOML (the scenario or SGLang's defaults, then --config,
    its [launch] table, then --prefill-args, --decode-args and --env, then --model and --gpu,
    later layers winning field by field). The output is a config file: `--config` reads it back to the same
    deployment and cost parameters."""
    import tomli_w

    _, cfg, params = resolve_deployment(
        scenario=scenario, config_path=config_path, workload_spec=workload_spec,
        prefill_args=prefill_args, decode_args=decode_args, env_items=env_items, model=model,
        gpu=gpu)
    data = cfg.to_dict()
    for table in ("launch", "run"):
        data.pop(table, None)  # applied above; reading it back would apply it twice
    data["sim"] = params.to_dict()
    basis = deployment_basis(scenario, config_path, workload_spec)
    click.echo(f"# {describe(cfg)}{f' ({basis})' if basis else ''}")
    click.echo(tomli_w.dumps(data), nl=False)


COMMANDS = [sim_command, scenarios_command, config_group]
