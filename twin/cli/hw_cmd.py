"""``twin hw``: the same inputs as ``twin sim``, on real processes, NIXL and kernels."""

from __future__ import annotations

import sys

import click

from twin.cli.common import (
    BadInput,
    defect_option,
    emit_json,
    fault_option,
    resolve_run,
)


def _gpus(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadInput(f"GPU list {text!r}: expected comma-separated indices like 0,1,2,3") from None


@click.command("hw")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="TOML config (as for `twin sim`).")
@click.option("--scenario", default=None, metavar="NAME",
              help="Built-in scenario (see `twin scenarios`); default: 'default' cut to 16 "
                   "requests.")
@click.option("--scenario-defects", is_flag=True, help="Switch on the scenario's defects.")
@click.option("--workload", "workload_spec", default=None, metavar="FILE|SPEC",
              help="Trace file or generator spec (as for `twin sim`).")
@click.option("--first-n", type=int, default=None, help="Keep the first N requests.")
@defect_option
@fault_option
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where KV pools, staging buffers and rings live (DRAM or VRAM).")
@click.option("--prefill-gpus", default=None, metavar="LIST",
              help="GPUs of the prefill ranks, e.g. 0,1,2,3.")
@click.option("--decode-gpus", default=None, metavar="LIST",
              help="GPUs of the decode ranks, e.g. 4,5.")
@click.option("--kernels", type=click.Choice(["auto", "torch", "triton"]), default="auto",
              envvar="TWIN_KERNELS", show_default=True,
              help="Gather/scatter backend; auto: Triton on CUDA when installed, else torch "
                   "(also read from TWIN_KERNELS).")
@click.option("--kv-pool-pages", type=int, default=2048, show_default=True,
              help="KV pool pages per rank.")
@click.option("--max-concurrency", type=int, default=None,
              help="Requests in flight at once (default: the scenario's, else 4).")
@click.option("--timeout", "timeout_s", type=float, default=300.0, show_default=True,
              help="Stop the run after this many seconds.")
@click.option("--trace-out", type=click.Path(dir_okay=False), default=None,
              help="Write the trace (same format as `twin sim`).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary object.")
def hw_command(config_path, scenario, scenario_defects, workload_spec, first_n, defects, faults,
               seed, device, prefill_gpus, decode_gpus, kernels, kv_pool_pages, max_concurrency,
               timeout_s, trace_out, as_json) -> None:
    """Run a workload on real rank processes and verify every byte.

    One process per prefill and decode rank, pyzmq with SGLang's frames, NIXL WRITEs into the
    decode ring, torch (or Triton on CUDA) gather/scatter into paged KV pools. Exit status as
    `twin sim`: 0 clean, 2 bad input, 3 wedge, 4 corruption (1 if a rank crashed).
    """
    from twin.hw.launcher import HwOptions
    from twin.hw.run import HwInputError, run_hw

    if first_n is None and scenario is None and not workload_spec:
        first_n = 16
    run = resolve_run(scenario=scenario, scenario_defects=scenario_defects,
                      config_path=config_path, workload_spec=workload_spec, first_n=first_n,
                      slowdown=None, defects=defects, faults=faults,
                      max_concurrency=max_concurrency, sglang_defaults_for_own_workload=False)
    options = HwOptions(device=device, prefill_gpus=_gpus(prefill_gpus),
                        decode_gpus=_gpus(decode_gpus), kv_pool_pages=kv_pool_pages,
                        timeout_s=timeout_s, kernels="" if kernels == "auto" else kernels)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise BadInput("--device cuda: no CUDA device is visible")
    try:
        result = run_hw(run.cfg, run.workload, defects=run.defects,
                        faults=[f.text for f in run.faults], seed=seed, params=run.params,
                        options=options, trace_out=trace_out, request_overrides=run.overrides,
                        max_concurrency=run.max_concurrency)
    except HwInputError as exc:
        raise BadInput(str(exc)) from None
    s = result.summary()
    if as_json:
        emit_json(s)
    else:
        click.echo(f"status      {s['status']}")
        check = (f"{len(result.corruption)} with wrong bytes" if result.corruption
                 else f"{s['verified']} byte-verified")
        click.echo(f"requests    {s['requests']}: {s['completed']} completed ({check}), "
                   f"{s['failed']} failed, {s['unfinished']} unfinished")
        click.echo(f"ran         {s['sim_seconds']:.2f} s, {s['events']} core events")
        for line in s["diagnosis"]:
            click.echo(f"wedge       {line}")
        for line in s["corruption"][:20]:
            click.echo(f"corruption  {line}")
        for line in s["errors"]:
            click.echo(f"error       {line}")
        if trace_out:
            click.echo(f"trace       {trace_out}")
    sys.exit(result.exit_code)


COMMANDS = [hw_command]
