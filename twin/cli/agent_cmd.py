"""``twin agent``: start this node's ranks for a coordinator (``twin hw --listen``)."""

from __future__ import annotations

import sys

import click

from twin.cli.options import POSITIVE_FLOAT, BadInput


def _gpus(text: str | None) -> list[int] | None:
    from twin.cli.hw_cmd import _gpus as parse

    return parse(text, "--gpus")


@click.command("agent")
@click.option("--join", "join", required=True, metavar="HOST:PORT",
              help="The coordinator's --listen address.")
@click.option("--role", type=click.Choice(["prefill", "decode"]), default=None,
              help="Which side's ranks this node takes (placement by role); default: either.")
@click.option("--gpus", default=None, metavar="LIST",
              help="This node's GPUs for its ranks, in order, e.g. 0,1,2,3 (with --device "
                   "cuda); also how many ranks it takes at most.")
@click.option("--name", default=None,
              help="This agent's name (as in the config's [placement] table); default: the "
                   "host name.")
@click.option("--address", default=None, metavar="IP",
              help="The address this node's ranks listen on and UCX uses; default: the local "
                   "address of the route to the coordinator.")
@click.option("--control-ports", default=None, metavar="FIRST-LAST",
              help="Ports this agent's and its ranks' control sockets listen on (default: any "
                   "free port for the agent, the coordinator's --control-ports for its "
                   "ranks).")
@click.option("--data-ports", default=None, metavar="FIRST-LAST",
              help="Ports UCX's TCP transport listens on, as UCX_TCP_PORT_RANGE (default: the "
                   "coordinator's --data-ports, else any free port).")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Each rank's log (and frames) in LOG_DIR/NODE.log; default: a temporary "
                   "folder kept only when a rank fails.")
@click.option("--join-timeout", type=POSITIVE_FLOAT, default=300.0, show_default=True,
              metavar="S", help="Give up if the coordinator does not answer within S seconds.")
@click.option("--heartbeat-timeout", type=POSITIVE_FLOAT, default=None, metavar="S",
              help="Stop this node's ranks and exit 1 after S seconds without a word from the "
                   "coordinator; default: the coordinator's --heartbeat-timeout.")
def agent_command(join, role, gpus, name, address, control_ports, data_ports, log_dir,
                  join_timeout, heartbeat_timeout) -> None:
    """Join a run across nodes and start this node's ranks when it begins.

    The coordinator (`twin hw --listen HOST:PORT --agents N`) measures this node's clock offset,
    places ranks on it (its [placement] table, or by --role), and this agent starts them,
    reports any that die, and stops them when the run ends, when the coordinator goes silent
    (exit 1) or when the agent is stopped; they also die with it. One agent per node serves one
    run. Exit status: 0 the run ended, 1 the coordinator was lost or the agent could not join,
    2 bad input.
    """
    from twin.hw.agent import run_agent
    from twin.hw.netutil import parse_port_range

    try:
        cports = parse_port_range(control_ports)
    except ValueError as exc:
        raise BadInput(f"--control-ports {exc}") from None
    try:
        dports = parse_port_range(data_ports)
    except ValueError as exc:
        raise BadInput(f"--data-ports {exc}") from None
    try:
        code = run_agent(join, name=name, role=role, gpus=_gpus(gpus), address=address,
                         control_ports=cports, data_ports=dports, log_dir=log_dir,
                         join_timeout_s=join_timeout, heartbeat_timeout_s=heartbeat_timeout,
                         echo=lambda line: click.echo(line))
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    except OSError as exc:
        raise BadInput(f"cannot listen for the coordinator: {exc}") from None
    sys.exit(code)


COMMANDS = [agent_command]
