"""``twin sim``, ``twin scenarios`` and ``twin config``."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from twin.cli.common import (
    apply_launch,
    defect_option,
    emit_json,
    fault_option,
    gpu_option,
    model_option,
    resolve_run,
)
from twin.core.config import TwinConfig
from twin.sim.runner import SimResult, run_sim
from twin.sim.scenarios import SCENARIOS


def describe(cfg: TwinConfig) -> str:
    """One line: who writes to whom, ring and grid."""
    def side(x) -> str:  # type: ignore[no-untyped-def]
        dp = f" DP{x.dp_size} (DP attention)" if x.enable_dp_attention else ""
        inst = f" x{x.instances}" if x.instances > 1 else ""
        return f"TP{x.tp_size}{dp}{inst}"

    ring = cfg.ring_bytes / (1 << 20)
    return (f"prefill {side(cfg.prefill)} -> decode {side(cfg.decode)}, ring {ring:g} MiB per "
            f"decode rank, chunked_prefill_size {cfg.chunked_prefill_size}, page {cfg.page_size}")


def _print_human(result: SimResult) -> None:
    s = result.summary()
    click.echo(f"deployment  {describe(result.sim.cfg)}")
    click.echo(f"serving     {result.sim.deployment.describe()}")
    click.echo(f"status      {s['status']}  ({s['stop_reason']})")
    click.echo(f"requests    {s['requests']}: {s['completed']} completed, {s['failed']} failed, "
               f"{s['unfinished']} unfinished")
    click.echo(f"simulated   {s['sim_seconds']:.3f} s in {s['wall_seconds']:.3f} s wall, "
               f"{s['events']} core events")
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E")):
        lat = s["latency"].get(key, {})
        if lat:
            click.echo(f"{label:<11} p50 {lat['p50'] * 1e3:.1f} ms  p90 {lat['p90'] * 1e3:.1f} "
                       f"ms  p99 {lat['p99'] * 1e3:.1f} ms")
    if s["deferrals"]:
        click.echo(f"deferrals   {sum(s['deferrals'].values())} (backpressure waits)")
    if s["defects"]:
        click.echo(f"defects on  {', '.join(s['defects'])}")
    for reason, n in s["failures"].items():
        click.echo(f"failed      {n} x {reason}")
    for line in s["diagnosis"]:
        click.echo(f"wedge       {line}")
    for line in s["corruption"][:20]:
        click.echo(f"corruption  {line}")


@click.command("sim")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="TOML config (SGLang's names; a [sim] table sets cost parameters).")
@click.option("--scenario", default=None, metavar="NAME",
              help="Built-in scenario (see `twin scenarios`); default: 'default' (its small demo "
                   "model), or SGLang's defaults when --workload is given.")
@click.option("--scenario-defects", is_flag=True,
              help="Switch on the defects the scenario reproduces.")
@click.option("--workload", "workload_spec", default=None, metavar="FILE|SPEC",
              help="Mooncake JSONL or Azure CSV trace (detected by content), or a generator "
                   "spec such as poisson:n=200,rate=5,input=4096,output=64,seed=1.")
@click.option("--first-n", type=int, default=None, help="Keep the first N requests.")
@click.option("--slowdown", type=float, default=None, help="Stretch inter-arrival times.")
@click.option("--prefill-args", default=None, metavar="ARGS",
              help="Prefill server launch arguments, e.g. '--tp-size 4 --chunked-prefill-size 256'.")
@click.option("--decode-args", default=None, metavar="ARGS",
              help="Decode server launch arguments, e.g. '--tp-size 2'.")
@click.option("--env", "env_items", multiple=True, metavar="KEY=VALUE",
              help="Staging environment variable, e.g. SGLANG_DISAGG_STAGING_POOL_SIZE_MB=64.")
@model_option
@gpu_option
@defect_option
@fault_option
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--until", type=float, default=None, metavar="SECONDS",
              help="Stop after this much simulated time.")
@click.option("--max-concurrency", type=int, default=None,
              help="Closed-loop clients: at most N requests in flight.")
@click.option("--trace-out", type=click.Path(dir_okay=False), default=None,
              help="Write the trace (JSON Lines; .gz compresses).")
@click.option("--metrics-out", type=click.Path(file_okay=False), default=None,
              help="Write requests.csv, occupancy.csv, watermark_lag.csv, metrics.json here.")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), default=None,
              help="Write latency.png, ring.png and deferrals.png here.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary object.")
def sim_command(config_path, scenario, scenario_defects, workload_spec, first_n, slowdown,
                prefill_args, decode_args, env_items, model, gpu, defects, faults, seed, until,
                max_concurrency, trace_out, metrics_out, plot_dir, as_json) -> None:
    """Simulate a staged PD deployment and report wedges, corruption and latency.

    Exit status: 0 every request ended with no wedge and no corruption, 2 bad input,
    3 wedge, 4 corruption.
    """
    run = resolve_run(scenario=scenario, scenario_defects=scenario_defects,
                      config_path=config_path, workload_spec=workload_spec, first_n=first_n,
                      slowdown=slowdown, defects=defects, faults=faults,
                      prefill_args=prefill_args, decode_args=decode_args, env_items=env_items,
                      max_concurrency=max_concurrency, model=model, gpu=gpu)
    result = run_sim(
        run.cfg, run.workload, defects=run.defects, faults=run.faults, seed=seed,
        params=run.params, until=until, progress=not as_json, request_overrides=run.overrides,
        max_concurrency=run.max_concurrency, trace_out=trace_out)
    if metrics_out:
        result.sim.metrics.write(Path(metrics_out))
    if plot_dir:
        from twin.sim.plots import write_plots

        write_plots(result.sim.metrics, Path(plot_dir))
    if as_json:
        emit_json(result.summary())
    else:
        _print_human(result)
        if trace_out:
            click.echo(f"trace       {trace_out}")
    sys.exit(result.exit_code)


@click.command("scenarios")
@click.option("--check", is_flag=True,
              help="Run every scenario with its defects on and off and check the symptom.")
@click.option("--json", "as_json", is_flag=True)
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


@click.command("config")
@click.option("--prefill-args", required=True, metavar="ARGS")
@click.option("--decode-args", required=True, metavar="ARGS")
@click.option("--env", "env_items", multiple=True, metavar="KEY=VALUE")
def config_command(prefill_args: str, decode_args: str, env_items: tuple[str, ...]) -> None:
    """Translate SGLang launch arguments into the twin's TOML config."""
    import tomli_w

    cfg = apply_launch(TwinConfig(), prefill_args, decode_args, env_items, None)
    click.echo(tomli_w.dumps(cfg.to_dict()), nl=False)


COMMANDS = [sim_command, scenarios_command, config_command]
