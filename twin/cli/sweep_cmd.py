"""``twin sweep``, ``twin advise`` and ``twin plot``: the sizing advisor (``twin/advise``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from twin.cli.common import (
    core_line,
    core_path,
    defect_option,
    emit_json,
    fault_option,
    resolve_run,
)
from twin.cli.options import BadInput

EXIT_NO_ADVICE = 1


def run_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The flags that describe the deployment and workload, as in ``twin sim``."""
    opts = [
        click.option("--config", "config_path", type=click.Path(dir_okay=False),
                     multiple=True, metavar="FILE",
                     help="TOML config (SGLang's names; a [sim] table sets cost parameters); "
                          "repeatable, later files win field by field."),
        click.option("--scenario", default=None, metavar="NAME",
                     help="Built-in scenario to start from (see `twin scenarios`)."),
        click.option("--scenario-defects", is_flag=True,
                     help="Switch on the defects the scenario reproduces."),
        click.option("--workload", "workload_spec", default=None, metavar="FILE|SPEC",
                     help="Mooncake JSONL or Azure CSV trace, or a generator spec."),
        click.option("--first-n", type=int, default=None, help="Keep the first N requests."),
        click.option("--slowdown", type=float, default=None,
                     help="Stretch inter-arrival times."),
        click.option("--prefill-args", default=None, metavar="ARGS",
                     help="Prefill server launch arguments."),
        click.option("--decode-args", default=None, metavar="ARGS",
                     help="Decode server launch arguments."),
        click.option("--env", "env_items", multiple=True, metavar="KEY=VALUE",
                     help="Staging environment variable."),
        defect_option, fault_option("drop:STAGING_RSP:p=0.01"),
        click.option("--max-concurrency", type=int, default=None,
                     help="Closed-loop clients: at most N requests in flight."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def executor_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    opts = [
        click.option("--executor", type=click.Choice(["local", "ray"]), default="local",
                     show_default=True,
                     help="local: a process pool on this machine; ray: Ray tasks."),
        click.option("--workers", type=int, default=None,
                     help="Local processes (default: the CPUs available; 1 runs in this "
                          "process), or the CPUs of a private local Ray instance."),
        click.option("--address", default=None, metavar="ADDR",
                     help="Join this Ray cluster ('auto': the one `ray start` runs here)."),
        click.option("--ray-installed-code", is_flag=True,
                     help="Ray workers import their installed twin instead of receiving this "
                          "checkout's package."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _job(kw: dict[str, Any], horizon: float | None,  # type: ignore[no-untyped-def]
         early_stop=None):
    from twin.advise import Base, Job

    run = resolve_run(scenario=kw["scenario"], scenario_defects=kw["scenario_defects"],
                      config_path=kw["config_path"], workload_spec=kw["workload_spec"],
                      first_n=kw["first_n"], slowdown=kw["slowdown"], defects=kw["defects"],
                      faults=kw["faults"], prefill_args=kw["prefill_args"],
                      decode_args=kw["decode_args"], env_items=kw["env_items"],
                      max_concurrency=kw["max_concurrency"])
    if not run.workload.requests:
        raise BadInput("the workload has no requests")
    if horizon is not None and horizon <= 0:
        raise BadInput("--horizon must be positive")
    base = Base(cfg=run.cfg, params=run.params, defects=run.defects, faults=tuple(run.faults),
                request_overrides=run.overrides, max_concurrency=run.max_concurrency,
                horizon_s=horizon, early_stop=early_stop)
    return Job(base, run.workload)


def _executor_factory(job, kw: dict[str, Any]):  # type: ignore[no-untyped-def]
    from twin.advise.executors import RayUnavailable, make_executor

    if kw["workers"] is not None and kw["workers"] < 1:
        raise BadInput("--workers must be at least 1")
    if kw["address"] and kw["executor"] != "ray":
        raise BadInput("--address needs --executor ray")

    def make():  # type: ignore[no-untyped-def]
        try:
            return make_executor(job, kw["executor"], kw["workers"], kw["address"],
                                 ship_code=not kw["ray_installed_code"])
        except RayUnavailable as exc:
            raise BadInput(str(exc)) from None

    return make


def _progress(as_json: bool) -> bool:
    return not as_json and sys.stderr.isatty()


@click.command("sweep")
@run_options
@click.option("--vary", "axes", multiple=True, metavar="NAME=VALUES", required=True,
              help="An axis (repeatable): ring_mb=16,32,64 | cps=1024:8192:x2 | "
                   "'decode_args=--tp-size 2|--tp-size 4' | rate_scale=0.5,1,2 | "
                   "sim.ranks_per_nic=1,2 | prefill.tp_size=2,4 | any config field.")
@click.option("--seeds", default="0", show_default=True, metavar="LIST",
              help="Seeds per point: 0,1,2 or START:STOP.")
@click.option("--horizon", type=float, default=None, metavar="SECONDS",
              help="Stop each run this long after the last arrival (unfinished requests then "
                   "count as 'unfinished'); default: run to the end.")
@click.option("-o", "--out", "out", type=click.Path(dir_okay=False), required=True,
              help="Result file (CSV); an existing one of the same sweep is resumed.")
@executor_options
@click.option("--dry-run", is_flag=True, help="List the points and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report at the end.")
def sweep_command(axes: tuple[str, ...], seeds: str, horizon: float | None, out: str,
                  dry_run: bool, as_json: bool, **kw: Any) -> None:
    """Run the simulator over every combination of the axes and seeds.

    Each point becomes one row of the result file: verdict (clean, failed, wedged with its
    root cause, corrupted, unfinished, invalid), ring occupancy, deferrals and deferral wait,
    latency percentiles, resource use, simulated and wall time and the full resolved config.
    Rows are written as they arrive; rerunning the same command skips finished points.
    """
    from twin.advise import AxisError, ResultsError, ResultsFile, grid, parse_axis, parse_seeds
    from twin.advise.sweep import run_sweep

    try:
        parsed = [parse_axis(a) for a in axes]
        points = grid(parsed, parse_seeds(seeds))
    except AxisError as exc:
        raise BadInput(str(exc)) from None
    job = _job(kw, horizon)
    if dry_run:
        for p in points:
            click.echo(p.label())
        click.echo(f"{len(points)} point(s)")
        return
    make = _executor_factory(job, kw)
    try:
        results = ResultsFile(out, [a.name for a in parsed])
    except ResultsError as exc:
        raise BadInput(str(exc)) from None
    with results:
        report = run_sweep(job, points, results, make, progress=_progress(as_json))
        rows = results.rows
    if not as_json and len(points) <= TABLE_MAX_POINTS:
        _print_points(job, points, rows, [a.name for a in parsed])
    if as_json:
        emit_json({**report.to_dict(), "core": core_path(), "results": out})
    else:
        outcomes = ", ".join(f"{n} {k}" for k, n in sorted(report.outcomes.items())) or "-"
        click.echo(f"sweep       {report.total} point(s): {report.ran} run now ({outcomes}), "
                   f"{report.skipped} already in {out}")
        if report.ran:
            click.echo(f"throughput  {report.points_per_min:.1f} points/min "
                       f"({report.wall_s:.1f} s wall)")
        click.echo(core_line())
    if report.interrupted:
        click.echo(f"interrupted: rerun the same command to resume from {out}", err=True)
        sys.exit(1)


TABLE_MAX_POINTS = 40


def _print_points(job, points, rows, names) -> None:  # type: ignore[no-untyped-def]
    """One line per point of a small sweep: its axes, verdict, p99 TTFT, deferrals."""
    from twin.advise.search import failure_text, fmt_s
    from twin.advise.space import point_id, short_name

    by_id = {str(r.get("point_id")): r for r in rows}
    head = [short_name(n) for n in names] + ["seed", "outcome", "TTFT p99", "deferrals/req"]
    lines = [head]
    for p in points:
        r = by_id.get(point_id(job.fingerprint, p))
        if r is None:
            continue
        note = "" if r.get("outcome") == "clean" else failure_text(r)[:70]
        lines.append([str(p.get(n)) for n in names] + [
            str(p.seed), str(r.get("outcome")), fmt_s(r.get("ttft_p99")),
            f"{r.get('deferrals_per_request') or 0:.2f}", note])
    widths = [max(len(line[i]) for line in lines if i < len(line)) for i in range(len(head))]
    for line in lines:
        text = "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=False)).rstrip()
        click.echo(text + (f"  {line[-1]}" if len(line) > len(head) and line[-1] else ""))


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise BadInput(f"{what} {text!r}: expected integers separated by commas") from None
    if not values or any(v <= 0 for v in values):
        raise BadInput(f"{what} {text!r}: expected positive integers")
    return values


@click.command("advise")
@run_options
@click.option("--cps", "cps_list", default=None, metavar="LIST",
              help="Candidate chunked_prefill_size values (default: the config's value x1/4, "
                   "x1/2, x1, x2).")
@click.option("--ttft", type=float, default=None, metavar="SECONDS",
              help="TTFT budget at --percentile.")
@click.option("--tpot", type=float, default=None, metavar="SECONDS",
              help="TPOT budget at --percentile (applied when the simulator reports TPOT).")
@click.option("--percentile", type=click.Choice(["50", "90", "99"]), default="99",
              show_default=True, help="Which TTFT/TPOT percentile the budgets bound.")
@click.option("--seeds", default="0,1", show_default=True, metavar="LIST",
              help="Every answer must pass on all these seeds.")
@click.option("--ring-min", type=int, default=1, show_default=True, metavar="MIB",
              help="Smallest ring tried.")
@click.option("--ring-max", type=int, default=None, metavar="MIB",
              help="Largest ring tried (default: 4x the config's ring, at least 64 MiB).")
@click.option("--ring", type=int, default=None, metavar="MIB",
              help="Skip the ring search: compare the candidates' capacity at this ring.")
@click.option("--tolerance", type=float, default=0.1, show_default=True,
              help="Stop a bisection when its bracket is within this relative width.")
@click.option("--headroom", type=float, default=0.25, show_default=True,
              help="Recommended ring = smallest passing ring x (1 + headroom), rounded up.")
@click.option("--capacity", type=click.Choice(["pick", "all", "none"]), default="pick",
              show_default=True, help="Which candidates get a capacity (rate-scale) search.")
@click.option("--rate-scale", type=float, default=1.0, show_default=True,
              help="Size for the workload arriving this many times faster (traffic growth).")
@click.option("--max-scale", type=float, default=8.0, show_default=True,
              help="Largest request-rate scale the capacity search tries.")
@click.option("--prefer", type=click.Choice(["ring", "capacity"]), default="ring",
              show_default=True,
              help="ring: the smallest recommended ring wins; capacity: the largest sustained "
                   "rate scale wins.")
@click.option("--horizon", type=float, default=None, metavar="SECONDS",
              help="Stop each run this long after the last arrival (default: 10x the TTFT "
                   "budget, at least 30 s; 120 s without one).")
@click.option("--no-early-stop", is_flag=True,
              help="Run every probe to the end, even once it is certain to miss the TTFT "
                   "budget (enough requests already late) or has failed a request.")
@click.option("-o", "--out", "out", type=click.Path(dir_okay=False), default=None,
              help="Write every probe to this result file (and reuse the probes it holds).")
@executor_options
@click.option("--json", "as_json", is_flag=True, help="Print the advice as JSON.")
def advise_command(cps_list: str | None, ttft: float | None, tpot: float | None,
                   percentile: str, seeds: str, ring_min: int, ring_max: int | None,
                   ring: int | None, tolerance: float, headroom: float, capacity: str,
                   rate_scale: float, max_scale: float, prefer: str, horizon: float | None,
                   no_early_stop: bool, out: str | None, as_json: bool, **kw: Any) -> None:
    """Recommend a chunked_prefill_size and a decode staging ring for a workload.

    For each candidate chunk size: the smallest ring (bisection) that runs the workload with no
    wedge, no failed request and latency within the budgets on every seed; then the largest
    request-rate scale the recommended ring sustains. Prints a Markdown table and the reasoning.
    Exit status: 0 with a recommendation, 1 when no candidate passes, 2 bad input.
    """
    from twin.advise import AxisError, ResultsError, ResultsFile, parse_seeds
    from twin.advise.search import AXES, Budgets, advise, early_stop_for

    for name, v in (("--ttft", ttft), ("--tpot", tpot)):
        if v is not None and not v > 0:
            raise BadInput(f"{name} must be positive")
    if not 0 < tolerance < 1:
        raise BadInput("--tolerance must be within (0, 1)")
    if headroom < 0:
        raise BadInput("--headroom must be >= 0")
    if max_scale < 1:
        raise BadInput("--max-scale must be at least 1")
    if not 0 < rate_scale <= 100:
        raise BadInput("--rate-scale must be within (0, 100]")
    if ring_min < 1 or (ring_max is not None and ring_max < ring_min):
        raise BadInput("--ring-min must be >= 1 and <= --ring-max")
    if ring is not None and ring < 1:
        raise BadInput("--ring must be at least 1 MiB")
    try:
        seed_list = parse_seeds(seeds)
    except AxisError as exc:
        raise BadInput(str(exc)) from None
    if horizon is None:
        horizon = max(30.0, 10 * ttft) if ttft is not None else 120.0
    budgets = Budgets(ttft, tpot, int(percentile))
    job = _job(kw, horizon, None if no_early_stop else early_stop_for(budgets))
    cfg = job.base.cfg
    if not cfg.stages:
        # SGLang stages a room only when decode's attention TP differs from prefill's
        # (nixl/conn.py ~1058 needs_staging): there is no ring to size
        reason = (f"prefill and decode attention TP are equal ({cfg.prefill.attn_tp_size}): "
                  f"SGLang writes the KV pages directly, without staging; no staging ring is "
                  f"needed (SGLANG_DISAGG_STAGING_POOL_SIZE_MB is unused)")
        if as_json:
            emit_json({"staging": False, "ring_mb": 0, "reason": reason})
        else:
            from twin.cli.common import describe

            click.echo(f"deployment  {describe(cfg)}")
            click.echo(f"advice      {reason}")
        return
    if cps_list is None:
        base_cps = cfg.chunked_prefill_size
        cands = [c for c in (base_cps // 4, base_cps // 2, base_cps, base_cps * 2)
                 if c > 0 and c % cfg.page_size == 0]
    else:
        cands = _int_list(cps_list, "--cps")
    bad = [c for c in cands if c % cfg.page_size]
    if bad:
        raise BadInput(f"--cps: {', '.join(map(str, bad))} not a multiple of page_size "
                       f"({cfg.page_size})")
    results = None
    if out is not None:
        try:
            results = ResultsFile(out, AXES)
        except ResultsError as exc:
            raise BadInput(str(exc)) from None
    executor = _executor_factory(job, kw)()
    try:
        advice = advise(job, executor, cands, budgets=budgets, seeds=seed_list,
                        ring_min=ring_min, ring_max=ring_max, ring=ring, tolerance=tolerance,
                        headroom=headroom, capacity=capacity, rate_scale=rate_scale,
                        max_scale=max_scale,
                        prefer=prefer, results=results, progress=_progress(as_json))
    except KeyboardInterrupt:
        click.echo("interrupted" + (f": rerun with -o {out} to reuse the probes" if out else ""),
                   err=True)
        sys.exit(1)
    finally:
        executor.close()
        if results is not None:
            results.close()
    if as_json:
        emit_json({**advice.to_dict(), "core": core_path()})
    else:
        from twin.cli.common import deployment_basis
        from twin.cli.sim_cmd import describe

        basis = deployment_basis(kw["scenario"], kw["config_path"], kw["workload_spec"])
        click.echo(f"deployment  {describe(cfg)}{f' ({basis})' if basis else ''}")
        click.echo(f"workload    {job.workload.name}: {len(job.workload.requests)} requests over "
                   f"{job.workload.duration_s:.1f} s")
        click.echo(f"criteria    no wedge, failure or corruption; {budgets.describe()}; seeds "
                   f"{', '.join(map(str, seed_list))}")
        click.echo(core_line())
        click.echo("")
        click.echo(advice.table())
        click.echo("")
        label = "Recommendation:" if advice.pick else "No recommendation:"
        click.echo(f"{label} " + " ".join(advice.reasons))
        for note in advice.notes:
            click.echo(f"note: {note}")
        click.echo(f"\n{advice.ran} run(s) ({advice.reused} reused from {out}) in "
                   f"{advice.wall_s:.1f} s" if out else
                   f"\n{advice.ran} run(s) in {advice.wall_s:.1f} s")
    sys.exit(0 if advice.pick else EXIT_NO_ADVICE)


@click.command("plot")
@click.argument("results_path", metavar="RESULTS", type=click.Path(dir_okay=False))
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), required=True,
              help="Directory for the PNG files.")
@click.option("--x", "x_axis", default=None, metavar="NAME", help="Heatmap x axis.")
@click.option("--y", "y_axis", default=None, metavar="NAME", help="Heatmap y axis.")
def plot_command(results_path: str, out_dir: str, x_axis: str | None,
                 y_axis: str | None) -> None:
    """Plot a sweep's or an advise run's result file.

    Heatmaps over two swept fields (verdict, p99 TTFT, deferral wait), the Pareto frontier of
    ring size against p99 TTFT, and latency CDFs across points.
    """
    from twin.advise import ResultsError
    from twin.advise.plots import write_plots

    try:
        paths = write_plots(results_path, Path(out_dir), x_axis, y_axis)
    except (ResultsError, ValueError) as exc:
        raise BadInput(str(exc)) from None
    for p in paths:
        click.echo(str(p))


COMMANDS = [sweep_command, advise_command, plot_command]
