"""``twin agent``: one node's part of a hardware run across nodes.

An agent joins a coordinator (``twin hw --listen HOST:PORT --agents N``), answers its clock
round trips, and when the run begins starts the rank processes the coordinator placed on this
node (the same ``rank_main`` as a single-node run), bound to this node's address. It then
watches them and the coordinator:

* every rank that exits is reported (exit code or signal, the last lines of its log);
* heartbeats go both ways; a coordinator silent for the heartbeat timeout (dead, or this node's
  network lost) makes the agent stop its ranks (SIGTERM, then SIGKILL) and exit 1;
* at the end of the run the coordinator says stop: leftover ranks are stopped, and the agent
  says goodbye and exits 0;
* the ranks die with the agent even if it is killed with SIGKILL (``lifeline``).

The ranks' UCX settings default to what crossing hosts needs, unless the environment already
sets them: ``UCX_NET_DEVICES`` the interface holding this node's address (not on hosts with RDMA
devices, where UCX picks them itself), ``UCX_TCP_PORT_RANGE`` the data ports. The ranks listen
only on this node's address, within the control ports if given.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

from twin.hw import messages
from twin.hw.auth import SECRET_ENV, SECRET_FILE_ENV, RunKey, key_from_env
from twin.hw.control import ControlError, ControlSocket
from twin.hw.hostmem import available_host_bytes
from twin.hw.lifeline import LOG_ENV, PARENT_ENV, rank_log_path
from twin.hw.netutil import (
    format_port_range,
    has_rdma_devices,
    interface_of,
    is_unspecified,
    local_address_towards,
    parse_host_port,
)
from twin.hw.nodes import (
    AGENT_BYE,
    AGENT_ERROR,
    AGENT_EXIT,
    AGENT_JOIN,
    AGENT_LAUNCH,
    AGENT_PING,
    AGENT_PONG,
    AGENT_REJECT,
    AGENT_STOP,
    AGENT_WELCOME,
    ROLES,
    Beater,
)
from twin.hw.procs import start_rank

EXIT_OK, EXIT_LOST, EXIT_BAD = 0, 1, 2
POLL_MS = 100


class AgentError(RuntimeError):
    """The agent could not join or start its ranks."""


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _tail(path: str, lines: int = 3) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    kept = [x.rstrip() for x in text.splitlines() if x.strip()]
    return "\n".join(kept[-lines:])


def _cuda_info() -> tuple[int, list[int]]:
    """(visible CUDA devices, free bytes of each); (0, []) without torch or CUDA."""
    try:
        import torch

        if not torch.cuda.is_available():
            return 0, []
        n = torch.cuda.device_count()
        return n, [int(torch.cuda.mem_get_info(i)[0]) for i in range(n)]
    except Exception:  # noqa: BLE001 - a failed probe only loses the memory check
        return 0, []


UCX_KEYS = ("UCX_TLS", "UCX_NET_DEVICES", "UCX_TCP_PORT_RANGE")


def rank_env(address: str, data_ports: tuple[int, int] | None) -> dict[str, str]:
    """The UCX settings this node's ranks get on top of the environment: the interface of
    ``address`` unless ``UCX_NET_DEVICES`` is set or the host has RDMA devices (UCX picks those
    itself), and the data ports (a given range wins over the environment)."""
    out: dict[str, str] = {}
    iface = interface_of(address)
    if iface is not None and not has_rdma_devices() and "UCX_NET_DEVICES" not in os.environ:
        out["UCX_NET_DEVICES"] = iface
    if data_ports is not None:
        out["UCX_TCP_PORT_RANGE"] = f"{data_ports[0]}-{data_ports[1]}"
    return out


def effective_ucx(updates: dict[str, str]) -> dict[str, str]:
    """The UCX settings the ranks will see (environment plus ``updates``)."""
    env = {**{k: os.environ[k] for k in UCX_KEYS if k in os.environ}, **updates}
    return {k: env[k] for k in UCX_KEYS if k in env}


class Agent:
    """One node's agent; :meth:`run` returns its exit code."""

    def __init__(self, join: str, *, name: str | None = None, role: str | None = None,
                 gpus: list[int] | None = None, address: str | None = None,
                 control_ports: tuple[int, int] | None = None,
                 data_ports: tuple[int, int] | None = None, log_dir: str | None = None,
                 join_timeout_s: float = 300.0, heartbeat_timeout_s: float | None = None,
                 echo: Callable[[str], None] = print, key: RunKey | None = None) -> None:
        if role is not None and role not in ROLES:
            raise ValueError(f"--role {role!r}: expected prefill or decode")
        host, port = parse_host_port(join)
        if is_unspecified(host):
            raise ValueError(f"--join {join!r}: give the coordinator's address, not 0.0.0.0")
        key = key or key_from_env()
        if key is None:
            raise ValueError(f"no run secret: set {SECRET_FILE_ENV} to the secret file the "
                             f"coordinator wrote (or {SECRET_ENV} to its contents); "
                             f"`twin hw --listen` prints where it is")
        self.key = key
        self.coordinator = f"tcp://{host}:{port}"
        self.address = address or local_address_towards(host, port)
        self.name = name or socket.gethostname()
        self.role = role
        self.gpus = gpus
        self.control_ports = control_ports
        self.data_ports = data_ports
        self.own_log_dir = log_dir is None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="twin-agent-logs-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.frame_logs = log_dir is not None
        self.join_timeout_s = join_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.heartbeat_s = 0.5
        self.echo = echo
        self.sock = ControlSocket(host=self.address, ports=control_ports,
                                  send_timeout_ms=5000, key=key)
        self.procs: dict[str, Any] = {}
        self.reported: set[str] = set()
        self.failed = False
        self.stopping_since: float | None = None
        self.last_heard = time.monotonic()
        self.beater: Beater | None = None

    # -- talking to the coordinator ------------------------------------------------------------
    def _send(self, frames: list[bytes], timeout_ms: int = 0) -> bool:
        try:
            self.sock.send(self.coordinator, frames, timeout_ms=timeout_ms)
            return True
        except ControlError:
            return False

    def _join(self) -> None:
        cuda, free = _cuda_info()
        self.ucx = rank_env(self.address, self.data_ports)
        info = {"name": self.name, "endpoint": self.sock.endpoint, "address": self.address,
                "hostname": socket.gethostname(), "pid": os.getpid(), "role": self.role,
                "gpus": self.gpus, "cuda_devices": cuda, "gpu_free": free,
                "mem_available": available_host_bytes(), "log_dir": self.log_dir,
                "control_ports": format_port_range(self.control_ports),
                "data_ports": format_port_range(self.data_ports),
                "ucx": effective_ucx(self.ucx)}
        body = [AGENT_JOIN, json.dumps(info).encode()]
        self.echo(f"agent       {self.name}: joining {self.coordinator} from {self.sock.endpoint}")
        deadline = time.monotonic() + self.join_timeout_s
        while True:
            if time.monotonic() > deadline:
                raise AgentError(f"no answer from the coordinator at {self.coordinator} within "
                                 f"{self.join_timeout_s:g} s")
            self._send(body, timeout_ms=1000)
            frames = self.sock.recv_frames(timeout_ms=2000)
            while frames is not None:
                tag = bytes(frames[0])
                if tag == AGENT_WELCOME:
                    w = messages.json_object(frames[1])
                    self.name = w["name"]
                    self.heartbeat_s = float(w.get("heartbeat_s", 0.5))
                    if self.heartbeat_timeout_s is None:
                        self.heartbeat_timeout_s = float(w.get("heartbeat_timeout_s", 10.0))
                    if self.control_ports is None and w.get("control_ports"):
                        self.control_ports = tuple(w["control_ports"])  # type: ignore[assignment]
                    if self.data_ports is None and w.get("data_ports"):
                        self.data_ports = tuple(w["data_ports"])  # type: ignore[assignment]
                        self.ucx = rank_env(self.address, self.data_ports)
                    self.last_heard = time.monotonic()
                    self.beater = Beater(self.heartbeat_s, self.key)
                    self.beater.set(self.name, self.coordinator)
                    self.beater.start()
                    self.echo(f"agent       {self.name}: joined; heartbeat timeout "
                              f"{self.heartbeat_timeout_s:g} s")
                    return
                if tag == AGENT_REJECT:
                    raise AgentError(f"the coordinator refused this agent: "
                                     f"{_reason(frames)}")
                frames = self.sock.recv_frames(timeout_ms=0)

    # -- ranks ---------------------------------------------------------------------------------
    def _launch(self, specs: list[Any]) -> None:
        env = {PARENT_ENV: str(os.getpid()), LOG_ENV: self.log_dir}
        if self.frame_logs and "TWIN_HW_LOG_DIR" not in os.environ:
            env["TWIN_HW_LOG_DIR"] = self.log_dir
        env.update(self.ucx)
        os.environ.update(env)
        names = []
        for spec in specs:
            spec.secret = self.key.secret
            spec.coordinator = self.coordinator
            spec.bind_host = self.address
            spec.control_ports = self.control_ports
            proc = start_rank(spec)
            self.procs[spec.node] = proc
            names.append(f"{spec.node} ({spec.device}, pid {proc.pid})")
        self.echo(f"agent       {self.name}: started {', '.join(names) or 'no ranks'}")

    def _check_ranks(self) -> None:
        for node, p in self.procs.items():
            if node in self.reported or p.is_alive():
                continue
            self.reported.add(node)
            code = p.exitcode
            if code != 0 and self.stopping_since is None:
                self.failed = True
            log = rank_log_path(self.log_dir, node)
            self._send([AGENT_EXIT, self.name.encode(), json.dumps(
                {"node": node, "exitcode": code if code is not None else -1,
                 "text": f"rank process {'ended' if code == 0 else 'died'} "
                         f"({_exit_text(code)})",
                 "tail": _tail(log)}).encode()], timeout_ms=1000)

    def _stop_ranks(self, grace_s: float = 5.0) -> None:
        deadline = time.monotonic() + grace_s
        while any(p.is_alive() for p in self.procs.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
        for p in self.procs.values():
            p.join(3)
            if p.is_alive():
                p.kill()
                p.join(3)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> int:
        try:
            self._join()
            return self._loop()
        except AgentError as exc:
            self.echo(f"error       {exc}")
            return EXIT_LOST
        except KeyboardInterrupt as exc:
            self.echo(f"agent       {self.name}: interrupted by "
                      f"{exc.args[0] if exc.args else 'Ctrl-C'}; stopping its ranks")
            self._send([AGENT_ERROR, self.name.encode(), json.dumps(
                {"detail": "the agent was interrupted"}).encode()], timeout_ms=500)
            self._stop_ranks(grace_s=0)
            return EXIT_LOST
        finally:
            if self.beater is not None:
                self.beater.halt.set()
            self._stop_ranks(grace_s=0)
            if self.sock.refused:
                self.echo(f"agent       {self.name}: refused {self.sock.refused} connection(s) "
                          f"from processes without the run's key")
            self.sock.close(linger_ms=1000)
            if self.beater is not None:
                self.beater.join(5)
            if self.own_log_dir and not self.failed:
                shutil.rmtree(self.log_dir, ignore_errors=True)

    def _loop(self) -> int:
        timeout = self.heartbeat_timeout_s or 10.0
        while True:
            frames = self.sock.recv_frames(timeout_ms=POLL_MS)
            while frames is not None:
                self.last_heard = time.monotonic()
                tag = bytes(frames[0])
                if tag == AGENT_PING and not _is_ping(frames):
                    self.echo(f"agent       {self.name}: dropped a TWIN_AGENT_PING frame that "
                              f"is not [tag, seq, t1]")
                elif tag == AGENT_PING:
                    self._send([AGENT_PONG, self.name.encode(), frames[1], frames[2],
                                repr(time.monotonic()).encode()], timeout_ms=1000)
                elif tag == AGENT_LAUNCH:
                    try:
                        specs = messages.decode_launch(frames[1], "TWIN_AGENT_LAUNCH")
                    except (messages.BadFrame, IndexError) as exc:
                        self.echo(f"agent       {self.name}: dropped a TWIN_AGENT_LAUNCH frame "
                                  f"that does not decode: {str(exc)[:200]}")
                        frames = self.sock.recv_frames(timeout_ms=0)
                        continue
                    try:
                        self._launch(specs)
                    except Exception as exc:  # noqa: BLE001 - reported, then the run ends
                        self.failed = True
                        self._send([AGENT_ERROR, self.name.encode(), json.dumps(
                            {"detail": f"cannot start its ranks: {exc}"}).encode()], 1000)
                elif tag == AGENT_STOP and self.stopping_since is None:
                    self.stopping_since = time.monotonic()
                frames = self.sock.recv_frames(timeout_ms=0)
            now = time.monotonic()
            self._check_ranks()
            if self.stopping_since is not None:
                self._stop_ranks(grace_s=max(0.0, 5.0 - (now - self.stopping_since)))
                self._check_ranks()
                self._send([AGENT_BYE, self.name.encode()], timeout_ms=1000)
                self.echo(f"agent       {self.name}: the run ended"
                          + ("; its ranks stopped" if self.procs else " before its ranks "
                             "started"))
                return EXIT_OK
            if now - self.last_heard > timeout:
                self.failed = True
                self.echo(f"error       {self.name}: no word from the coordinator for "
                          f"{timeout:g} s (it died or this node's network is down); stopping "
                          f"its ranks")
                self._stop_ranks(grace_s=0)
                return EXIT_LOST


def _is_ping(frames: list[bytes]) -> bool:
    """``[AGENT_PING, seq (int), t1 (float)]``, both short ASCII numbers."""
    if len(frames) != 3 or len(frames[1]) > 20 or len(frames[2]) > 40:
        return False
    try:
        int(frames[1])
        float(frames[2])
    except ValueError:
        return False
    return True


def _reason(frames: list[bytes]) -> str:
    try:
        return str(messages.json_object(frames[1]).get("reason", ""))[:500]
    except (messages.BadFrame, IndexError):
        return "(no reason given)"


def run_agent(join: str, **kwargs: Any) -> int:
    """Join the coordinator at ``join`` and serve one run; the exit code."""
    from twin.runtime.signals import signals_interrupt

    with signals_interrupt():
        agent = Agent(join, **kwargs)
        with contextlib.suppress(Exception):
            os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        return agent.run()
