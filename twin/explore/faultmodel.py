"""Faults as SGLang meets them: where each fault kind the explorer can draw happens in a real
deployment, and which ones SGLang's transports never produce.

A finding is only worth a fix upstream if SGLang can meet its faults. ZMQ over TCP delivers
the frames of one socket in order, once each, while the connection lives; a frame is lost only
with its peer (a dead process, a reset connection), which ``crash`` and ``restart`` model. So a
campaign draws the realistic kinds by default (``--fault-model sglang``) and every kind the
simulator has only when asked (``--fault-model all``); each finding names the classes of the
faults its shrunk repro still needs (docs/explore.md has the table).
"""

from __future__ import annotations

from dataclasses import dataclass

from twin.explore.coverage import FAULT_KEYS


@dataclass(frozen=True)
class FaultClass:
    """A class of fault: whether SGLang 0.5.23's deployment can meet it, and where."""

    name: str
    realistic: bool
    where: str


CLASSES: dict[str, FaultClass] = {c.name: c for c in (
    FaultClass("dead-peer", True,
               "a rank process dies (OOM, an exception, a lost node), or its server dies and "
               "is restarted empty (a TP group's rank never comes back alone: the sglang "
               "model draws restarts with scope=server); unsent frames and rooms go with it"),
    FaultClass("failed-transfer", True,
               "a NIXL or Mooncake WRITE ends in error (the remote segment gone, a transport "
               "timeout: Mooncake's MC_TRANSFER_TIMEOUT)"),
    FaultClass("send-timeout", True,
               "zmq raises Again after the socket's SNDTIMEO (prefill's manager socket, 30 s: "
               "CHUNK_READY, KV_STATUS) because the peer stopped reading"),
    FaultClass("late-frame", True,
               "a frame is late (a slow link, a busy sending thread): frames behind it on "
               "its socket wait too, frames on other sockets overtake it"),
    FaultClass("client-abort", True, "the client or the router aborts a request mid-transfer"),
    FaultClass("lost-frame", False,
               "never on a live ZMQ connection; a frame to a dead peer is lost with the peer "
               "(dead-peer models that)"),
    FaultClass("duplicate-frame", False, "ZMQ never delivers a frame twice"),
    FaultClass("reordered-frame", False,
               "frames of one ZMQ socket arrive in order (one TCP stream); across sockets a "
               "late frame reorders them (late-frame)"),
    FaultClass("unraised-send", False,
               "STAGING_REQ's prefetch socket sets no SNDTIMEO: its send blocks, it never "
               "raises"),
    FaultClass("malformed-field", False,
               "a buggy or hostile peer rewrites a field (corrupt:): not drawn by the "
               "explorer; give it to twin sim --fault"),
)}

_BY_ACTION = {"crash": "dead-peer", "restart": "dead-peer", "fail-transfer": "failed-transfer",
              "delay": "late-frame", "abort": "client-abort", "drop": "lost-frame",
              "dup": "duplicate-frame", "reorder": "reordered-frame",
              "corrupt": "malformed-field"}


def fault_class(text: str) -> FaultClass:
    """The class of a fault spec (``delay:WATERMARK:ms=5``) or of an ``ft:`` coverage key."""
    parts = text.removeprefix("ft:").split(":")
    action = parts[0]
    if action == "fail-send":
        return CLASSES["unraised-send" if parts[1:2] == ["STAGING_REQ"] else "send-timeout"]
    return CLASSES[_BY_ACTION[action]]


MODELS: dict[str, tuple[str, ...]] = {
    "sglang": tuple(k for k in FAULT_KEYS if fault_class(k).realistic),
    "all": FAULT_KEYS,
}
"""The fault kinds (``ft:`` keys) each ``--fault-model`` draws."""


def classes_of(faults: tuple[str, ...] | list[str]) -> list[str]:
    """The fault classes a trial's faults belong to, sorted, each once."""
    return sorted({fault_class(f).name for f in faults})
