"""Fault specs, shared by the simulator and the hardware mode, and the simulator's injector.

A spec is ``ACTION:TARGET[:key=value]...``::

    drop:WATERMARK:p=0.1          drop each WATERMARK with probability 0.1
    drop:WATERMARK:nth=3          drop the 3rd WATERMARK only
    delay:CHUNK_READY:ms=20:p=0.5 delay (extra latency); dup:KIND, reorder:KIND (held back ms=1)
    fail-send:CHUNK_READY:nth=1   the sender's socket raises: the frame is not sent
    fail-transfer:p=0.01          a staged WRITE ends in error (node=ID to restrict)
    crash:d0g0r0:at=2.5           the rank stops handling anything at t=2.5 s
    restart:d0g0r0:at=2.5:down=1  ... and comes back empty after 1 s
    abort:room=3:at=1.5           the request is aborted everywhere at t=1.5 s

Message kinds are the frame tags (STAGING_REQ, STAGING_RSP, WATERMARK, CHUNK_READY, KV_STATUS)
or ``*``; ``src=``/``dst=`` restrict to a node, ``room=``/``chunk=`` to one room or chunk
(``delay:STAGING_RSP:room=0:chunk=0:ms=50`` holds back every answer for that chunk).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from twin.core import wire

MESSAGE_ACTIONS = ("drop", "delay", "dup", "reorder", "fail-send")
ACTIONS = (*MESSAGE_ACTIONS, "fail-transfer", "crash", "restart", "abort")
KINDS = tuple(t.decode() for t in wire.MESSAGE_TYPES) + ("*",)
_FLOAT_KEYS = {"p", "ms", "at", "down"}
_INT_KEYS = {"nth", "room", "chunk"}
_STR_KEYS = {"src", "dst", "node"}


class FaultSpecError(ValueError):
    """A fault spec is malformed; the message names the spec and the key."""


@dataclass(frozen=True, slots=True)
class FaultSpec:
    action: str
    target: str = "*"
    p: float | None = None
    nth: int | None = None
    ms: float = 1.0
    at: float | None = None
    down: float | None = None
    room: int | None = None
    chunk: int | None = None
    src: str | None = None
    dst: str | None = None
    node: str | None = None
    text: str = ""

    def __str__(self) -> str:
        return self.text


def parse_fault(text: str) -> FaultSpec:
    """Parse one spec; ``FaultSpecError`` names what is wrong."""
    parts = text.strip().split(":")
    action = parts[0]
    if action not in ACTIONS:
        raise FaultSpecError(f"fault {text!r}: unknown action {action!r}; known: "
                             f"{', '.join(ACTIONS)}")
    kwargs: dict[str, object] = {"action": action, "text": text}
    rest = parts[1:]
    if action in MESSAGE_ACTIONS or action in ("crash", "restart"):
        if not rest or "=" in rest[0]:
            raise FaultSpecError(f"fault {text!r}: {action} needs a target "
                                 f"({'message kind' if action in MESSAGE_ACTIONS else 'node'})")
        kwargs["target"] = rest[0]
        rest = rest[1:]
        if action in MESSAGE_ACTIONS and kwargs["target"] not in KINDS:
            raise FaultSpecError(f"fault {text!r}: unknown message kind {kwargs['target']!r}; "
                                 f"known: {', '.join(KINDS)}")
    for item in rest:
        key, sep, value = item.partition("=")
        if not sep:
            raise FaultSpecError(f"fault {text!r}: expected key=value, got {item!r}")
        try:
            if key in _FLOAT_KEYS:
                kwargs[key] = float(value)
            elif key in _INT_KEYS:
                kwargs[key] = int(value)
            elif key in _STR_KEYS:
                kwargs[key] = value
            else:
                raise FaultSpecError(f"fault {text!r}: unknown key {key!r}")
        except ValueError as exc:
            if isinstance(exc, FaultSpecError):
                raise
            raise FaultSpecError(f"fault {text!r}: key {key!r}: bad value {value!r}") from None
    spec = FaultSpec(**kwargs)  # type: ignore[arg-type]
    if spec.p is not None and not 0 <= spec.p <= 1:
        raise FaultSpecError(f"fault {text!r}: key 'p': must be within [0, 1]")
    if action in ("crash", "restart", "abort") and spec.at is None:
        raise FaultSpecError(f"fault {text!r}: {action} needs at=SECONDS")
    if action == "abort" and spec.room is None:
        raise FaultSpecError(f"fault {text!r}: abort needs room=N")
    if action == "restart" and spec.down is None:
        raise FaultSpecError(f"fault {text!r}: restart needs down=SECONDS")
    return spec


@dataclass(slots=True)
class MessageFate:
    """What happens to one frame: delivered ``copies`` times after ``extra_s`` more latency."""

    copies: int = 1
    extra_s: float = 0.0
    send_failed: bool = False
    applied: tuple[str, ...] = ()


class FaultInjector:
    """Decides each frame's and transfer's fate from the specs; deterministic given ``rng``."""

    def __init__(self, specs: list[FaultSpec], rng: random.Random) -> None:
        self.specs = specs
        self.rng = rng
        self.counts = [0] * len(specs)

    def _fires(self, i: int, spec: FaultSpec) -> bool:
        self.counts[i] += 1
        if spec.nth is not None:
            return self.counts[i] == spec.nth
        if spec.p is not None:
            return self.rng.random() < spec.p
        return True

    def message(self, src: str, dst: str, msg: wire.Message) -> MessageFate:
        fate = MessageFate()
        kind = msg.TAG.decode()
        applied = []
        for i, spec in enumerate(self.specs):
            if spec.action not in MESSAGE_ACTIONS or spec.target not in (kind, "*"):
                continue
            if (spec.src and spec.src != src) or (spec.dst and spec.dst != dst):
                continue
            if spec.room is not None and getattr(msg, "room", None) != spec.room:
                continue
            if spec.chunk is not None and getattr(msg, "chunk_idx", None) != spec.chunk:
                continue
            if not self._fires(i, spec):
                continue
            applied.append(spec.text)
            if spec.action == "drop":
                fate.copies = 0
            elif spec.action == "dup":
                fate.copies += 1
            elif spec.action in ("delay", "reorder"):
                fate.extra_s += spec.ms / 1000
            elif spec.action == "fail-send":
                fate.send_failed = True
                fate.copies = 0
        fate.applied = tuple(applied)
        return fate

    def transfer_fails(self, node: str) -> str | None:
        for i, spec in enumerate(self.specs):
            if spec.action != "fail-transfer" or (spec.node and spec.node != node):
                continue
            if self._fires(i, spec):
                return spec.text
        return None

    def timed(self) -> list[FaultSpec]:
        return [s for s in self.specs if s.action in ("crash", "restart", "abort")]
