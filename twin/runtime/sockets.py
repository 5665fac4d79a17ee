"""SGLang's ZMQ sockets on the staging path, and what a send to a peer that is gone does.

Every frame the twin sends leaves one rank's socket from one of the rank's threads. While the
peer is alive a send returns at once (the frame is queued and flushed). Once the peer's process
is gone, libzmq keeps queueing on a socket that keeps its pipe (a socket that reconnects): up to
the send high-water mark (``SNDHWM``, 1000 messages unless set; a multipart frame is one
message). Past it ``send_multipart`` blocks the sending thread until ``SNDTIMEO`` expires (then
raises ``zmq.Again``, which the staging code swallows: the frame is lost) or forever when no
timeout is set; everything else that thread does waits meanwhile.

The table below is SGLang 0.5.23's (paths under ``sglang/srt/disaggregation/``):

==========================  =====================================  ==============================
socket (twin name)          frames, thread                         options
==========================  =====================================  ==============================
decode receiver socket      WATERMARK after a free: decode          ``common/conn.py`` ~2739-2754
(``receiver``), one per     scheduler (``advance_scatter``          (``CommonKVReceiver._connect``,
prefill endpoint, shared    ``staging_handler.py`` ~372-386, from   class-level cache): LINGER 0,
by every request of the     ``utils.py`` ~346; ``release_room``     SNDTIMEO
decode process              ~249). WATERMARK snapshot to a new      ``SGLANG_DISAGGREGATION_ZMQ_
                            subscriber and STAGING_RSP: the KV      SEND_TIMEOUT`` (1 s,
                            manager's listener thread (~958,        ``environ.py`` ~760), SNDHWM
                            ~892-911). Metadata and ABORT: decode   and RECONNECT_IVL left at
                            scheduler (conn.py ~2566-2576,          libzmq's defaults (1000
                            ~2818-2830, ~2988-2998)                 messages, 100 ms: queues)
prefill manager socket      CHUNK_READY: transfer worker            ``common/conn.py`` ~1664-1703
(``manager``), one per      (conn.py ~826-833); KV_STATUS           (``CommonKVManager._connect``):
decode endpoint             (~795-806) and ABORT_ACK (~1030-1040):  LINGER 0, RECONNECT_IVL -1,
                            transfer worker / scheduler             SNDTIMEO 30 s (1 s with
                                                                    ``prefill_complete``
                                                                    allocation), SNDHWM 1000
prefill prefetch socket     STAGING_REQ: prefill scheduler, before  ``staging_handler.py``
(``prefetch``), its own     the forward (``nixl/conn.py``           ~1000-1007: a bare
context, one per decode     ~1045-1082)                             ``zmq.Context().socket(PUSH)``:
endpoint                                                            no SNDTIMEO (blocks forever),
                                                                    LINGER -1, SNDHWM 1000,
                                                                    RECONNECT_IVL 100 ms
==========================  =====================================  ==============================

Both drivers take the table from here: the simulator's ``SendBlocking`` (``twin.sim.sockets``)
models what these options do to a send to a dead peer, and the hardware mode's ranks open their
real sockets with them (``twin.hw.control.ControlSocket.configure``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from twin.core import events as ev
from twin.core import wire

SCHEDULER: Final = "scheduler"
LISTENER: Final = "listener"
TRANSFER_WORKER: Final = "transfer-worker"
WATERMARK_SENDER: Final = "watermark-sender"  # with the #36049 fix, one per subscriber


@dataclass(frozen=True, slots=True)
class SocketSpec:
    """One kind of socket: its options as SGLang sets them, and where."""

    name: str
    sndhwm: int  # messages queued to a peer before a send blocks
    sndtimeo_s: float  # math.inf: no timeout, the send blocks forever
    linger_s: float  # math.inf: -1
    reconnect_ivl_s: float  # -1: no reconnect
    source: str


#: SGLang's defaults; ``SimParams.zmq_send_timeout_s`` and ``zmq_sndhwm`` replace the first two.
RECEIVER = SocketSpec("receiver", 1000, 1.0, 0.0, 0.1, "common/conn.py ~2739-2754")
MANAGER = SocketSpec("manager", 1000, 30.0, 0.0, -1.0, "common/conn.py ~1664-1703")
PREFETCH = SocketSpec("prefetch", 1000, math.inf, math.inf, 0.1,
                      "common/staging_handler.py ~1000-1007")
SOCKETS: Final = (RECEIVER, MANAGER, PREFETCH)


def configured(send_timeout_s: float, sndhwm: int) -> dict[str, SocketSpec]:
    """The table by socket name with a run's settings applied: ``send_timeout_s`` replaces
    the receiver socket's SNDTIMEO (``SGLANG_DISAGGREGATION_ZMQ_SEND_TIMEOUT``), ``sndhwm``
    every socket's high-water mark (``SimParams.zmq_send_timeout_s``, ``zmq_sndhwm``)."""
    out = {}
    for spec in SOCKETS:
        timeout = send_timeout_s if spec is RECEIVER else spec.sndtimeo_s
        out[spec.name] = SocketSpec(spec.name, sndhwm, timeout, spec.linger_s,
                                    spec.reconnect_ivl_s, spec.source)
    return out



def socket_of(role: str, msg: wire.Message | None) -> SocketSpec:
    """The socket a ``role`` rank sends ``msg`` on (``None``: a control notice, metadata)."""
    if role == "decode":
        return RECEIVER
    return PREFETCH if type(msg) is wire.StagingReq else MANAGER


def thread_of(role: str, msg: wire.Message | None, cause: ev.Input | None,
              watermark_sender: bool) -> str:
    """The thread of a ``role`` rank that sends ``msg`` while it handles ``cause``."""
    if role == "decode":
        if type(msg) is wire.StagingRsp:
            return LISTENER
        if type(msg) is wire.Watermark:
            if type(cause) is ev.MessageArrived and type(cause.msg) is wire.StagingReq:
                return LISTENER  # the snapshot to a new subscriber
            return WATERMARK_SENDER if watermark_sender else SCHEDULER
        return SCHEDULER  # metadata, ABORT
    if type(msg) is wire.StagingReq:
        return SCHEDULER
    return TRANSFER_WORKER  # CHUNK_READY, KV_STATUS, ABORT_ACK


