"""``twin explore`` (find the next wedge before production does) and ``twin shrink``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from twin.cli.common import defect_option, deployment_options, emit_json, make_defects
from twin.cli.options import POSITIVE_FLOAT, POSITIVE_INT, BadInput, check_output_dir

EXPLORE_EXIT_HELP = ("0 no findings, 1 interrupted (findings so far are written) or the twin "
                     "itself raised on a trial, 2 bad input, 3 a wedge (or a livelock, a leak) "
                     "was found, 4 corruption (or overlapping allocations, a watermark going "
                     "back), 5 a request failed with no fault injected and no defect on.")


def _base(kw: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    """The campaign's shared inputs from the run flags, and the user's own requests."""
    from twin.cli.common import load_workload, resolve_deployment
    from twin.explore.trial import Base, Req

    sc, cfg, params = resolve_deployment(
        scenario=kw["scenario"], config_path=kw["config_path"],
        workload_spec=kw["workload_spec"], prefill_args=kw["prefill_args"],
        decode_args=kw["decode_args"], env_items=kw["env_items"], model=kw["model"],
        gpu=kw["gpu"])
    defects = make_defects(kw["defects"])
    ctx = click.get_current_context(silent=True)
    fixes = tuple(ctx.meta.get("twin_fixes", ())) if ctx is not None else ()
    if fixes:
        cfg = cfg.replace(fixes=tuple(sorted({*cfg.fixes, *fixes})))
    # Prefix hits are the trials' own (per request); a wedge is called after 5 s of no progress.
    params = params.replace(prefill_radix_tokens=0, decode_radix_tokens=0,
                            wedge_window_s=min(params.wedge_window_s, 5.0))
    workload = load_workload(kw["workload_spec"]) if kw["workload_spec"] else sc.workload()
    overrides = sc.overrides if not kw["workload_spec"] else {}
    user = tuple(Req(round(r.arrival_s - workload.requests[0].arrival_s, 6), r.input_len,
                     overrides.get(r.rid, {}).get("decode_prefix_len", 0),
                     overrides.get(r.rid, {}).get("prefill_prefix_len", 0))
                 for r in workload.requests[:8] if r.input_len > 0)
    return Base(cfg.replace(extra={k: v for k, v in cfg.extra.items() if k != "run"}), params,
                tuple(defects.sorted())), user


@click.command("explore", epilog=f"Exit status: {EXPLORE_EXIT_HELP}")
@deployment_options
@defect_option
@click.option("--budget", type=POSITIVE_FLOAT, default=None, metavar="SECONDS",
              help="Stop after this many seconds (after the round running then); default 60 "
                   "when --runs is not given.")
@click.option("--runs", type=POSITIVE_INT, default=None, metavar="N",
              help="Stop after N trials in all (a deterministic budget: the same seed and N "
                   "give the same findings).")
@click.option("--seed", type=int, default=0, show_default=True, help="Root seed of the campaign.")
@click.option("--out", "out", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="Write findings.md, findings.json, one folder per finding and the "
                   "campaign's state here.")
@click.option("--resume", "resume", type=click.Path(file_okay=False), default=None,
              metavar="DIR", help="Continue the campaign saved in DIR (its flags are kept; "
                                  "--runs and --budget say how much more to run).")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local",
              show_default=True, help="local: processes on this machine; ray: Ray tasks.")
@click.option("--workers", type=POSITIVE_INT, default=1, show_default=True,
              help="Local processes (1 runs in this process), or a private Ray instance's "
                   "CPUs.")
@click.option("--address", default=None, metavar="ADDR",
              help="Join this Ray cluster ('auto': the one `ray start` runs here).")
@click.option("--no-deploy", is_flag=True, help="Keep the deployment as given.")
@click.option("--no-workload", is_flag=True,
              help="Keep the workload as given (its first 8 requests).")
@click.option("--no-faults", is_flag=True, help="Inject no faults.")
@click.option("--fault-model", type=click.Choice(["sglang", "all"]), default="sglang",
              show_default=True,
              help="sglang: draw only faults SGLang's deployment can meet (late frames, send "
                   "timeouts, failed transfers, dead or restarted ranks, aborts); all: also "
                   "lost, duplicated and reordered frames, which ZMQ never produces "
                   "(docs/explore.md, the fault model).")
@click.option("--no-interleave", is_flag=True,
              help="Keep the simulator's seed at 0 (one ordering of frames per trial).")
@click.option("--corpus-cap", type=POSITIVE_INT, default=256, show_default=True,
              help="Trials kept for mutation at most (memory stays bounded).")
@click.option("--shrink-runs", type=POSITIVE_INT, default=150, show_default=True,
              help="Runs a finding's shrink may take at most.")
@click.option("--confirm-hw", is_flag=True,
              help="At the end, replay each finding's trace not yet tried on real rank "
                   "processes (`twin replay --mode hw`: zmq, NIXL, the kernels on this host) "
                   "and say in the table whether it ended the same way.")
@click.option("--json", "as_json", is_flag=True, help="Print findings.json at the end.")
def explore_command(budget: float | None, runs: int | None, seed: int, out: str | None,
                    resume: str | None, executor: str, workers: int, address: str | None,
                    no_deploy: bool, no_workload: bool, no_faults: bool, fault_model: str,
                    no_interleave: bool, corpus_cap: int, shrink_runs: int, confirm_hw: bool, as_json: bool,
                    **kw: Any) -> None:
    """Search for wedges, corruption and unexplained failures near a deployment.

    Trials vary the deployment (TP layouts, page size, chunk size, ring size down to the
    smallest that fits), small edge-case workloads, fault schedules of every kind and the
    order frames meet in; inputs that reach a new room transition, effect or allocator
    situation are kept and mutated. Each new finding (a signature: violation kind + diagnosis
    root) is shrunk and written to --out with a replayable trace, a `twin sim` command when
    one reproduces it, a pytest file and a story.
    """
    from twin.explore.artifacts import write_finding, write_summary
    from twin.explore.campaign import STATE_FILE, Campaign
    from twin.explore.faultmodel import classes_of
    from twin.explore.runner import explore
    from twin.explore.strategies import Strategies

    if address and executor != "ray":
        raise BadInput("--address needs --executor ray")
    if resume is not None:
        if out is not None and Path(out) != Path(resume):
            raise BadInput("--out: a resumed campaign writes to its own folder (--resume DIR)")
        if not (Path(resume) / STATE_FILE).is_file():
            raise BadInput(f"--resume {resume}: no {STATE_FILE} there (not a campaign folder)")
        try:
            campaign = Campaign.resume(Path(resume))
        except (ValueError, KeyError, OSError) as exc:
            raise BadInput(f"--resume {resume}: {exc}") from None
        out_dir = Path(resume)
    else:
        if out is None:
            raise BadInput("--out DIR is required (where findings are written), or --resume DIR")
        check_output_dir(out, "--out")
        out_dir = Path(out)
        if (out_dir / STATE_FILE).exists():
            raise BadInput(f"--out {out}: holds a campaign already; continue it with --resume "
                           f"{out}, or choose another folder")
        base, user = _base(kw)
        strategies = Strategies(deploy=not no_deploy, workload=not no_workload,
                                faults=not no_faults, interleave=not no_interleave,
                                fault_model=fault_model)
        campaign = Campaign(base, out_dir, seed=seed, strategies=strategies,
                            user_requests=user, corpus_cap=corpus_cap, shrink_runs=shrink_runs)
    if runs is None and budget is None:
        budget = 60.0
    if runs is not None and resume is None and runs < 1:
        raise BadInput("--runs must be at least 1")

    def make(job):  # type: ignore[no-untyped-def]
        from twin.advise.executors import RayUnavailable, make_executor

        try:
            return make_executor(job, executor, workers, address)
        except RayUnavailable as exc:
            raise BadInput(str(exc)) from None

    def on_finding(f) -> None:  # type: ignore[no-untyped-def]
        write_finding(campaign.base, f, out_dir)
        if not as_json:
            s = f.shrunk
            needs = ", ".join(classes_of(s.faults))
            click.echo(f"finding     {f.kind}: {f.root}\n            run {f.first_run}, "
                       f"{f.first_seconds:.1f} s; shrunk to {len(s.requests)} request(s), "
                       f"{len(s.faults)} fault(s)" + (f" ({needs})" if needs else "")
                       + f"; SGLang 0.5.23: {f.exposure.get('label', 'not computed')}"
                       + f" -> {out_dir}/findings/{f.slug}/", err=True)

    campaign.save()
    report = explore(campaign, make, runs=runs, budget_s=budget,
                     progress=not as_json and sys.stderr.isatty(), on_finding=on_finding,
                     on_round=campaign.save)
    campaign.save()
    if confirm_hw and not report.interrupted:
        _confirm_findings(campaign, out_dir, echo=not as_json)
    data = write_summary(campaign, out_dir, interrupted=report.interrupted)
    if as_json:
        emit_json(data)
    else:
        p = campaign.progress()
        cov = ", ".join(f"{k} {v['reached']}/{v['total']}" for k, v in data["coverage"].items())
        click.echo(f"explored    {p.runs} runs in {p.elapsed:.1f} s "
                   f"({data['runs_per_second']} runs/s), {p.invalid} invalid")
        click.echo(f"coverage    {cov}")
        click.echo(f"findings    {len(campaign.findings)} -> {out_dir}/findings.md")
        for f in campaign.findings.values():
            click.echo(f"            {f.kind}: {f.root} (x{f.hits}; SGLang 0.5.23: "
                       f"{f.exposure.get('label', 'not computed')})")
    if report.interrupted:
        click.echo(f"interrupted: findings so far are in {out_dir}; continue with "
                   f"--resume {out_dir}", err=True)
        sys.exit(1)
    sys.exit(campaign.exit_status())


def _confirm_findings(campaign: Any, out_dir: Path, *, echo: bool) -> None:
    """``--confirm-hw``: replay every finding not yet tried on real ranks; the verdicts go
    into the table and the campaign's state (a resumed campaign does not replay them again)."""
    from twin.explore.confirm import confirm_on_hardware

    for f in campaign.findings.values():
        if f.hw:
            continue
        f.hw = confirm_on_hardware(out_dir / "findings" / f.slug)
        campaign.save()
        if echo:
            click.echo(f"hardware    {f.slug}: {f.hw}", err=True)


@click.command("shrink", epilog=f"Exit status: {EXPLORE_EXIT_HELP}")
@click.argument("trace_path", metavar="TRACE", type=click.Path(dir_okay=False))
@click.option("-o", "--out", "out", type=click.Path(file_okay=False), default=None,
              metavar="DIR", help="Write the shrunk finding here (trace, command, test, story).")
@click.option("--max-runs", type=POSITIVE_INT, default=300, show_default=True,
              help="Runs the shrink may take at most.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def shrink_command(trace_path: str, out: str | None, max_runs: int, as_json: bool) -> None:
    """Shrink a trace whose run wedged, corrupted data or failed without a cause to the
    smallest run with the same signature (violation kind + diagnosis root)."""
    from twin.explore.shrink import shrink
    from twin.explore.tracefile import TraceTrialError, trial_from_trace

    check_output_dir(out, "--out")
    try:
        base, trial, recorded = trial_from_trace(trace_path)
    except TraceTrialError as exc:
        raise BadInput(str(exc)) from None
    from twin.explore.oracles import run_trial

    first = run_trial(base, trial)
    if first.signature is None:
        raise BadInput(f"{trace_path}: its run ends {first.status} with nothing to shrink (no "
                       f"wedge, corruption or failure without a cause)")
    if recorded and first.status != recorded:
        raise BadInput(f"{trace_path}: rebuilt from its header the run ends {first.status}, "
                       f"not {recorded} as recorded; it cannot be shrunk faithfully")
    res = shrink(base, trial, first.signature, max_runs=max_runs)
    from twin.explore.exposure import exposure

    told = exposure(base, res.trial, first.signature[0], needs_defects=tuple(res.result.needs))
    data: dict[str, Any] = {"kind": first.signature[0], "root": first.signature[1],
                            "status": first.status, "runs": res.runs,
                            "before": {"requests": len(trial.requests),
                                       "faults": len(trial.faults),
                                       "tokens": sum(r.input_len for r in trial.requests)},
                            "after": {"requests": len(res.trial.requests),
                                      "faults": len(res.trial.faults),
                                      "tokens": sum(r.input_len for r in res.trial.requests)},
                            "trial": res.trial.to_json(),
                            "sglang_exposure": told.to_json()}
    if out is not None:
        from twin.explore.artifacts import write_finding
        from twin.explore.campaign import Finding

        f = Finding(first.signature, first.status, 1, 0.0, trial, res.trial, res.runs,
                    diagnosis=res.result.diagnosis[:12], corruption=res.result.corruption[:12],
                    failures=res.result.failures, slug="shrunk", exposure=told.to_json())
        data["checks"] = write_finding(base, f, Path(out))
        data["dir"] = str(Path(out) / "findings" / "shrunk")
    if as_json:
        emit_json(data)
    else:
        b, a = data["before"], data["after"]
        click.echo(f"signature   {data['kind']}: {data['root']}")
        click.echo(f"shrunk      {b['requests']} request(s), {b['faults']} fault(s), "
                   f"{b['tokens']} tokens -> {a['requests']}, {a['faults']}, {a['tokens']} "
                   f"in {res.runs} run(s)")
        for i, r in enumerate(res.trial.requests):
            click.echo(f"request     {i}: {r.input_len} tokens at {r.at:g} s"
                       + (f", decode prefix {r.decode_prefix}" if r.decode_prefix else "")
                       + (f", prefill hit {r.prefill_prefix}" if r.prefill_prefix else ""))
        for fault in res.trial.faults:
            click.echo(f"fault       {fault}")
        click.echo(f"SGLang      0.5.23: {told.text()}")
        if out is not None:
            click.echo(f"written     {data['dir']}/")
    from twin.runtime.outcome import exit_code

    sys.exit(exit_code(first.status) if first.status in ("corrupted", "wedged", "failed")
             else 1)


COMMANDS = [explore_command, shrink_command]
