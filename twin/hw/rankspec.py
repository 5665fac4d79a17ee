"""What the coordinator and a rank process share before the rank has imported anything heavy:
the twin's own coordinator <-> rank frame tags and the rank's start-up spec.

Kept apart from ``twin.hw.rank`` (torch, NIXL, the core's drivers) so that the coordinator, which
only starts ranks and routes their frames, never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from twin.hw.netutil import LOOPBACK_HOST

# Coordinator <-> rank frames (the twin's own; SGLang's frames travel between ranks).
HELLO, DIRECTORY, START, CMD, RECORDS, REPORT, STATE, STOP = (
    b"TWIN_HELLO", b"TWIN_DIR", b"TWIN_START", b"TWIN_CMD", b"TWIN_REC", b"TWIN_REPORT",
    b"TWIN_STATE", b"TWIN_STOP")
META, ABORT, PEER = b"TWIN_META", b"TWIN_ABORT", b"TWIN_PEER"
# A rank's warm-up round trip with each peer before the first request (twin.hw.warmup).
WARM, WARM_ACK = b"TWIN_WARM", b"TWIN_WARM_ACK"


@dataclass
class RankSpec:
    """Everything a spawned rank needs (picklable)."""

    node: str
    role: str
    rank: int
    unique_rank: int
    config: dict[str, Any]
    defects: list[str]
    faults: list[str]
    coordinator: str
    device: str = "cpu"
    kv_pool_pages: int = 4096
    seed: int = 0
    kernels: str = ""
    script: list[Any] | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    nodes_by_unique: dict[int, str] = field(default_factory=dict)
    bind_host: str = LOOPBACK_HOST  # where the rank's control socket listens
    control_ports: tuple[int, int] | None = None  # within these ports (inclusive), if given
    env: dict[str, str] | None = None  # the launcher's environment at start (twin.hw.procs)
    # The run's secret key (twin.hw.auth); set by whoever starts the rank, never sent to agents.
    secret: bytes | None = field(default=None, repr=False)
    # A prefill rank's PP stage (``pp_size > 1``): its pool holds that stage's layers only.
    pp_rank: int = 0
    # SGLang's sockets and heartbeat as the run's ``[sim]`` settings have them
    # (``twin.runtime.sockets.configured``; ``twin.hw.heartbeat``).
    zmq_send_timeout_s: float = 1.0
    zmq_sndhwm: int = 1000
    heartbeat_interval_s: float = 5.0
    heartbeat_max_failure: int = 2
