"""``twin hw``: the same inputs as ``twin sim``, on real processes, NIXL and kernels."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from twin.cli.common import (
    HW_FAULT_EXAMPLES,
    check_trace_out,
    deployment_options,
    emit_json,
    resolve_run,
    run_options,
)
from twin.cli.options import (
    POSITIVE_FLOAT,
    POSITIVE_INT,
    WRITE_ERRNOS,
    BadInput,
    agent_options,
    print_diagnosis,
    write_error,
)
from twin.runtime.outcome import EXIT_CODES_HELP, EXIT_ERROR


def _gpus(text: str | None, flag: str) -> list[int] | None:
    if not text:
        return None
    try:
        gpus = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadInput(f"{flag} {text!r}: expected comma-separated indices like 0,1,2,3") \
            from None
    if any(g < 0 for g in gpus):
        raise BadInput(f"{flag} {text!r}: GPU indices are not negative")
    return gpus


def apply_agent_options(options: Any, cfg: Any, *, listen: str | None, n_agents: int | None,
                        agent_timeout: float, heartbeat_timeout: float,
                        control_ports: str | None, data_ports: str | None) -> None:
    """Fill ``options`` (``HwOptions``) for a run across nodes; ``BadInput`` names the flag."""
    from twin.core.topology import Topology
    from twin.hw.netutil import parse_host_port, parse_port_range
    from twin.hw.nodes import PlacementError, parse_placement

    if listen is None:
        for flag, value in (("--agents", n_agents), ("--control-ports", control_ports),
                            ("--data-ports", data_ports)):
            if value is not None:
                raise BadInput(f"{flag} needs --listen HOST:PORT (a run across nodes)")
        return
    try:
        options.listen = parse_host_port(listen, allow_zero=False)
    except ValueError as exc:
        raise BadInput(f"--listen {exc}") from None
    for flag, text in (("--control-ports", control_ports), ("--data-ports", data_ports)):
        try:
            ports = parse_port_range(text)
        except ValueError as exc:
            raise BadInput(f"{flag} {exc}") from None
        setattr(options, flag[2:].replace("-", "_"), ports)
    table = cfg.extra.get("placement")
    if table is not None:
        try:
            options.placement = parse_placement(table, Topology(cfg), "--config: [placement]")
        except PlacementError as exc:
            raise BadInput(str(exc)) from None
        if n_agents is not None and n_agents != len(options.placement):
            raise BadInput(f"--agents {n_agents}: the config's [placement] table names "
                           f"{len(options.placement)} agent(s)")
    elif n_agents is None:
        raise BadInput("--listen: say how many agents to wait for with --agents N (or place "
                       "the ranks with a [placement] table in --config)")
    options.agents = n_agents or len(options.placement or [])
    options.agent_timeout_s = agent_timeout
    options.heartbeat_timeout_s = heartbeat_timeout


def replay_on_hardware(trace: Any, *, echo: Callable[[str], None] | None,
                       **across: Any) -> Any:
    """``twin replay --mode hw``, on this host or (``--listen``) across nodes."""
    from twin.hw.launcher import HwOptions, LaunchError, PoolError
    from twin.hw.replay import replay_hw

    options = HwOptions()
    apply_agent_options(options, trace.config, **across)
    try:
        return replay_hw(trace, options, echo=echo)
    except PoolError as exc:
        raise BadInput(f"{trace.path}: {exc}") from None
    except LaunchError as exc:
        click.echo(f"error       the ranks did not start: {exc}", err=echo is None)
        sys.exit(EXIT_ERROR)


def _hw_faults(specs) -> None:  # type: ignore[no-untyped-def]
    from twin.core.defects import Defects
    from twin.hw.run import HwInputError, check_supported

    try:
        check_supported(Defects(), [s.text for s in specs])
    except HwInputError as exc:
        raise BadInput(str(exc)) from None


@click.command("hw", epilog=f"Exit status: {EXIT_CODES_HELP}")
@deployment_options
@run_options(HW_FAULT_EXAMPLES)
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
@click.option("--kv-pool-pages", type=POSITIVE_INT, default=None, metavar="N",
              help="KV pool pages per rank. Default: enough for --max-concurrency of the "
                   "workload's longest requests. A pool smaller than one request is rejected "
                   "before launch; requests wait for pool space otherwise.")
@click.option("--timeout", "timeout_s", type=POSITIVE_FLOAT, default=300.0, show_default=True,
              help="Stop the run after this many seconds (status interrupted, exit 1).")
@click.option("--trace-out", type=click.Path(dir_okay=False), default=None,
              help="Write the trace (same format as `twin sim`).")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Write each rank's log (frames, full tracebacks) to LOG_DIR/NODE.log; "
                   "default: a temporary folder kept only when a rank fails.")
@agent_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary object.")
def hw_command(config_path, scenario, workload_spec, prefill_args, decode_args, env_items,
               model, gpu,
               scenario_defects, first_n, slowdown, defects, faults, seed, until,
               max_concurrency, device, prefill_gpus, decode_gpus, kernels, kv_pool_pages,
               timeout_s, trace_out, log_dir, listen, n_agents, agent_timeout,
               heartbeat_timeout, control_ports, data_ports, as_json) -> None:
    """Run a workload on real rank processes and verify every byte.

    One process per prefill and decode rank, pyzmq with SGLang's frames, NIXL WRITEs into the
    decode ring, torch (or Triton on CUDA) gather/scatter into paged KV pools. Inputs resolve
    exactly as in `twin sim` (same flags, same defaults, same deployment line); without
    --max-concurrency at most 4 requests are in flight. Ctrl-C, SIGTERM and SIGHUP stop the
    run and its ranks; the ranks also die with this process.

    Across nodes: `--listen HOST:PORT --agents N` waits for N `twin agent --join HOST:PORT`,
    one per node, places the ranks (the config's [placement] table, or by the agents' --role),
    prints the placement and each node's clock offset, and runs the same way (same verdicts,
    exit codes and trace).
    """
    from twin.cli.options import check_output_dir
    from twin.hw.launcher import HwOptions, LaunchError, PoolError, plan_pool
    from twin.hw.run import HwInputError, run_hw

    if device != "cuda":
        for flag, value in (("--prefill-gpus", prefill_gpus), ("--decode-gpus", decode_gpus)):
            if value is not None:
                raise BadInput(f"{flag} {value!r}: places ranks on GPUs, which only --device "
                               f"cuda uses (this run keeps its pools in host memory: --device "
                               f"{device})")
    check_trace_out(trace_out, workload_spec, config_path)
    check_output_dir(log_dir, "--log-dir")
    run = resolve_run(scenario=scenario, scenario_defects=scenario_defects,
                      config_path=config_path, workload_spec=workload_spec, first_n=first_n,
                      slowdown=slowdown, defects=defects, faults=faults,
                      prefill_args=prefill_args, decode_args=decode_args, env_items=env_items,
                      max_concurrency=max_concurrency, fault_check=_hw_faults, model=model,
                      gpu=gpu)
    options = HwOptions(device=device, prefill_gpus=_gpus(prefill_gpus, "--prefill-gpus"),
                        decode_gpus=_gpus(decode_gpus, "--decode-gpus"), timeout_s=timeout_s,
                        until_s=until, log_dir=log_dir,
                        kernels="" if kernels == "auto" else kernels)
    apply_agent_options(options, run.cfg, listen=listen, n_agents=n_agents,
                        agent_timeout=agent_timeout, heartbeat_timeout=heartbeat_timeout,
                        control_ports=control_ports, data_ports=data_ports)
    if options.across_nodes and (prefill_gpus or decode_gpus):
        raise BadInput("--prefill-gpus/--decode-gpus place ranks on this host; across nodes "
                       "give each agent its GPUs (twin agent --gpus) or use [placement]")
    concurrency = run.max_concurrency or options.max_concurrency
    run.max_concurrency = concurrency
    if device == "cuda" and not options.across_nodes:
        import torch

        if not torch.cuda.is_available():
            raise BadInput("--device cuda: no CUDA device is visible")
    from twin.hw.mooncake_transport import choose_transport

    try:
        transport, transport_note = choose_transport(run.cfg.disaggregation_transfer_backend,
                                                     device)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    if transport == "mooncake" and data_ports:
        transport_note += ("; --data-ports bounds NIXL's UCX ports only: the Mooncake engine "
                           "picks its own RPC/handshake and TCP data ports (give "
                           "--disaggregation-transfer-backend nixl to keep every data port in "
                           "the range)")
    try:
        plan = plan_pool(run.cfg, run.workload, run.params, run.overrides, options,
                         kv_pool_pages, concurrency)
    except (HwInputError, PoolError) as exc:
        raise BadInput(str(exc)) from None
    options.kv_pool_pages = plan.pages
    options.rank_bytes = dict(plan.bytes_per_rank)
    if not as_json:
        click.echo(f"deployment  {run.deployment_line()}")
        click.echo(f"workload    {run.workload_line()}")
        click.echo(f"kv pool     {plan.describe()}")
        from twin.hw.netutil import choose_ucx_modules

        click.echo(f"transfers   {transport_note}")
        click.echo(f"ucx         {choose_ucx_modules()}")
        for note in run.notes:
            click.echo(f"note        {note}")
    try:
        result = run_hw(run.cfg, run.workload, defects=run.defects,
                        faults=[f.text for f in run.faults], seed=seed, params=run.params,
                        options=options, trace_out=trace_out, request_overrides=run.overrides,
                        max_concurrency=concurrency, echo=None if as_json else click.echo)
    except HwInputError as exc:
        raise BadInput(str(exc)) from None
    except KeyboardInterrupt as exc:  # during start-up; the run itself handles its own
        why = exc.args[0] if exc.args else "Ctrl-C"
        click.echo(f"status      interrupted by {why} while starting the ranks; ranks stopped")
        sys.exit(EXIT_ERROR)
    except LaunchError as exc:
        if as_json:
            emit_json({"status": "crashed", "mode": "hw", "errors": [str(exc)],
                       "deployment": run.deployment_line()})
        else:
            click.echo("status      crashed (the ranks did not start)")
            click.echo(f"error       {exc}")
            if trace_out:
                click.echo(f"trace       {trace_out}")
        sys.exit(EXIT_ERROR)
    except OSError as exc:
        if trace_out is None or exc.errno not in WRITE_ERRNOS:
            raise
        raise write_error(exc, "--trace-out", trace_out) from None
    s = result.summary()
    if as_json:
        emit_json({**s, "deployment": run.deployment_line(), "workload_line": run.workload_line(),
                   "kv_pool": plan.describe(), "notes": run.notes + s["notes"]})
    else:
        from twin.cli.sim_cmd import print_blocked, print_faults, print_roots

        click.echo(f"status      {s['status']}")
        wrong = s["corrupted_requests"]
        check = (f"{wrong} with wrong bytes" if wrong else f"{s['verified']} byte-verified")
        click.echo(f"requests    {s['requests']}: {s['completed']} completed ({check}), "
                   f"{s['failed']} failed, {s['unfinished']} unfinished")
        click.echo(f"ran         {s['sim_seconds']:.2f} s, {s['events']} core events")
        print_blocked(s)
        for reason, n in s["failures"].items():
            click.echo(f"failed      {n} x {reason}")
        print_roots(s)
        print_faults(s["fault_report"])
        print_diagnosis(s["diagnosis"])
        for line in s["corruption"][:20]:
            click.echo(f"corruption  {line}")
        for line in s["errors"]:
            click.echo(f"error       {line}")
        for line in s["notes"]:
            click.echo(f"note        {line}")
        if s.get("log_dir"):
            click.echo(f"rank logs   {s['log_dir']}")
        if trace_out:
            click.echo(f"trace       {trace_out}")
    sys.exit(result.exit_code)


COMMANDS = [hw_command]
