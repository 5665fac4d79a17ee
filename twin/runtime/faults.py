"""Fault specs, shared by the simulator and the hardware mode, and the simulator's injector.

A spec is ``ACTION:TARGET[:key=value]...``::

    drop:WATERMARK:p=0.1          drop each WATERMARK with probability 0.1
    drop:WATERMARK:nth=3          drop the 3rd WATERMARK only
    delay:CHUNK_READY:ms=20:p=0.5 extra latency; frames behind it on its socket wait too
    reorder:CHUNK_READY:ms=1      hold back this frame only: later frames overtake it
    dup:CHUNK_READY               deliver twice
    fail-send:CHUNK_READY:nth=1   the sender's socket raises: the frame is not sent
    fail-transfer:p=0.01          a staged WRITE ends in error (node=ID to restrict)
    crash:d0g0r0:at=2.5           the rank stops handling anything at t=2.5 s
    crash:p0g1r0:at=2:scope=server  ... and takes its whole server with it, as SGLang's
                                  scheduler does when it raises (SIGQUIT to the server's
                                  launcher, which kills the process tree)
    restart:d0g0r0:at=2.5:down=1  ... and comes back empty after 1 s
    abort:room=3:at=1.5           the request is aborted everywhere at t=1.5 s
    corrupt:STAGING_REQ:field=chunk_idx:value=100000
                                  the frame leaves with that field rewritten (a malformed
                                  or hostile peer): chunk_idx, offsets, sizes, room ids; any
                                  integer, negative or out of range

Message kinds are the frame tags (STAGING_REQ, STAGING_RSP, WATERMARK, CHUNK_READY, KV_STATUS)
or ``*``; ``src=``/``dst=`` restrict to a node, ``room=``/``chunk=`` to one room or chunk
(``delay:STAGING_RSP:room=0:chunk=0:ms=50`` holds back every answer for that chunk).

A spec that could never fire is rejected: a key its action does not read (``at=`` on a drop),
``nth=0``, a negative or non-finite number, and (``check_faults``, once the deployment and the
workload are known) a node, room or chunk that does not exist, or a sender that never sends that
kind. ``FaultInjector.fired`` counts how often each spec fired; ``fault_report`` lists them.
"""

from __future__ import annotations

import difflib
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from twin.core import wire

if TYPE_CHECKING:
    from twin.core.config import TwinConfig
    from twin.core.topology import Topology

MESSAGE_ACTIONS = ("drop", "delay", "dup", "reorder", "fail-send", "corrupt")
ACTIONS = (*MESSAGE_ACTIONS, "fail-transfer", "crash", "restart", "abort")
KINDS = tuple(t.decode() for t in wire.MESSAGE_TYPES) + ("*",)
_FLOAT_KEYS = {"p", "ms", "at", "down"}
_INT_KEYS = {"nth", "room", "chunk", "value"}
_STR_KEYS = {"src", "dst", "node", "field", "scope"}
SCOPES = ("rank", "server")
#: The keys each action reads (any other key would be silently ignored, so it is rejected).
KEYS = {
    "drop": {"p", "nth", "room", "chunk", "src", "dst"},
    "dup": {"p", "nth", "room", "chunk", "src", "dst"},
    "fail-send": {"p", "nth", "room", "chunk", "src", "dst"},
    "corrupt": {"p", "nth", "room", "chunk", "src", "dst", "field", "value"},
    "delay": {"p", "nth", "ms", "room", "chunk", "src", "dst"},
    "reorder": {"p", "nth", "ms", "room", "chunk", "src", "dst"},
    "fail-transfer": {"p", "nth", "node"},
    "crash": {"at", "scope"},
    "restart": {"at", "down", "scope"},
    "abort": {"room", "at"},
}
#: Which side sends each frame kind, and which fields it carries.
SENDER = {"STAGING_REQ": "prefill", "CHUNK_READY": "prefill", "KV_STATUS": "prefill",
          "STAGING_RSP": "decode", "WATERMARK": "decode"}
_HAS_ROOM = {"STAGING_REQ", "STAGING_RSP", "CHUNK_READY", "KV_STATUS", "*"}
_HAS_CHUNK = {"STAGING_REQ", "STAGING_RSP", "CHUNK_READY", "*"}


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
    field: str | None = None
    value: int | None = None
    scope: str | None = None  # crash/restart: "rank" (the default) or "server"
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
    allowed = KEYS[action]
    for item in rest:
        key, sep, value = item.partition("=")
        if not sep:
            raise FaultSpecError(f"fault {text!r}: expected key=value, got {item!r}")
        if key in kwargs:
            raise FaultSpecError(f"fault {text!r}: key {key!r} given twice")
        if key in _FLOAT_KEYS | _INT_KEYS | _STR_KEYS and key not in allowed:
            raise FaultSpecError(f"fault {text!r}: key {key!r} does not apply to {action} "
                                 f"(its keys: {', '.join(sorted(allowed))})")
        try:
            if key in _FLOAT_KEYS:
                kwargs[key] = float(value)
            elif key in _INT_KEYS:
                kwargs[key] = int(value)
            elif key in _STR_KEYS:
                kwargs[key] = value
            else:
                close = difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.5)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise FaultSpecError(f"fault {text!r}: unknown key {key!r}{hint} (keys of "
                                     f"{action}: {', '.join(sorted(allowed))})")
        except ValueError as exc:
            if isinstance(exc, FaultSpecError):
                raise
            raise FaultSpecError(f"fault {text!r}: key {key!r}: bad value {value!r}") from None
    for key in _FLOAT_KEYS:
        if key in kwargs and not math.isfinite(kwargs[key]):  # type: ignore[arg-type]
            raise FaultSpecError(f"fault {text!r}: key {key!r}: must be a finite number")
    spec = FaultSpec(**kwargs)  # type: ignore[arg-type]
    if spec.p is not None and not 0 <= spec.p <= 1:
        raise FaultSpecError(f"fault {text!r}: key 'p': must be within [0, 1]")
    if spec.p is not None and spec.nth is not None:
        raise FaultSpecError(f"fault {text!r}: give p= or nth=, not both (nth wins silently)")
    if spec.nth is not None and spec.nth < 1:
        raise FaultSpecError(f"fault {text!r}: key 'nth': counts from 1, got {spec.nth}")
    if spec.ms < 0:
        raise FaultSpecError(f"fault {text!r}: key 'ms': must not be negative")
    if spec.at is not None and spec.at < 0:
        raise FaultSpecError(f"fault {text!r}: key 'at': must not be negative")
    if spec.down is not None and spec.down <= 0:
        raise FaultSpecError(f"fault {text!r}: key 'down': must be positive")
    if action == "corrupt":
        _check_corrupt(spec)
    for key in ("room", "chunk"):
        if getattr(spec, key) is not None and getattr(spec, key) < 0:
            raise FaultSpecError(f"fault {text!r}: key {key!r}: must not be negative")
    if action in ("crash", "restart", "abort") and spec.at is None:
        raise FaultSpecError(f"fault {text!r}: {action} needs at=SECONDS")
    if action == "abort" and spec.room is None:
        raise FaultSpecError(f"fault {text!r}: abort needs room=N")
    if spec.scope is not None and spec.scope not in SCOPES:
        raise FaultSpecError(f"fault {text!r}: key 'scope': expected one of "
                             f"{', '.join(SCOPES)}, got {spec.scope!r}")
    if action == "restart" and spec.down is None:
        raise FaultSpecError(f"fault {text!r}: restart needs down=SECONDS")
    target = spec.target
    if action in MESSAGE_ACTIONS and target != "*":
        if spec.room is not None and target not in _HAS_ROOM:
            raise FaultSpecError(f"fault {text!r}: {target} frames carry no room; room= "
                                 f"would never match")
        if spec.chunk is not None and target not in _HAS_CHUNK:
            raise FaultSpecError(f"fault {text!r}: {target} frames carry no chunk; chunk= "
                                 f"would never match")
    return spec


def corruptible_fields(kind: str) -> list[str]:
    """The integer fields of frame kind ``kind`` that ``corrupt`` can rewrite."""
    cls = wire.MESSAGE_TYPES[kind.encode()]
    return [name for name in cls.__struct_fields__
            if name not in wire._STR_FIELDS and name not in ("status", "failure_reason")]


def _check_corrupt(spec: FaultSpec) -> None:
    text = spec.text
    if spec.target == "*":
        raise FaultSpecError(f"fault {text!r}: corrupt needs one message kind (its fields "
                             f"differ), not '*'")
    fields = corruptible_fields(spec.target)
    if spec.field is None or spec.value is None:
        raise FaultSpecError(f"fault {text!r}: corrupt needs field=NAME and value=INTEGER "
                             f"(fields of {spec.target}: {', '.join(fields)})")
    if spec.field not in fields:
        raise FaultSpecError(f"fault {text!r}: {spec.target} has no integer field "
                             f"{spec.field!r} (its fields: {', '.join(fields)})")


def check_faults(specs: Iterable[FaultSpec], cfg: TwinConfig, input_lens: list[int]) -> None:
    """Reject specs that cannot fire in this deployment and workload: unknown nodes (with a
    suggestion), rooms past the workload, chunks past the longest request's chunk count, a
    sender that never sends that kind, a transfer fault on a node that starts no transfer."""
    from twin.core.topology import Topology

    nodes = Topology(cfg).nodes
    ids = sorted(nodes)

    def node(spec: FaultSpec, key: str, value: str) -> str:
        if value not in nodes:
            close = difflib.get_close_matches(value, ids, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            shown = ", ".join(ids[:16]) + (", ..." if len(ids) > 16 else "")
            raise FaultSpecError(f"fault {spec.text!r}: {key} {value!r} is not a node of this "
                                 f"deployment{hint} (nodes: {shown})")
        return nodes[value].role

    for spec in specs:
        if spec.action in ("crash", "restart"):
            node(spec, "node", spec.target)
        if spec.node is not None:
            role = node(spec, "node", spec.node)
            if spec.action == "fail-transfer" and role != "prefill":
                raise FaultSpecError(f"fault {spec.text!r}: node {spec.node!r} is a decode "
                                     f"rank; transfers start on prefill ranks")
        for key in ("src", "dst"):
            value = getattr(spec, key)
            if value is None:
                continue
            role = node(spec, key, value)
            sender = SENDER.get(spec.target)
            if sender is not None:
                receiver = "decode" if sender == "prefill" else "prefill"
                if role != (sender if key == "src" else receiver):
                    raise FaultSpecError(f"fault {spec.text!r}: {spec.target} goes from "
                                         f"{sender} to {receiver} ranks; {key}={value} is a "
                                         f"{role} rank, so it would never fire")
        if spec.action == "fail-send" and (
                SENDER.get(spec.target) == "decode"
                or (spec.target not in SENDER and (spec.src is None
                                                   or nodes[spec.src].role != "prefill"))):
            # Only a prefill rank's core handles a send that raises (SGLang's CHUNK_READY and
            # KV_STATUS paths); a failed decode send is not modelled.
            raise FaultSpecError(f"fault {spec.text!r}: fail-send models a prefill rank's send "
                                 f"that raises; decode's sends (STAGING_RSP, WATERMARK) cannot "
                                 f"fail this way in the twin (drop them instead), so give a "
                                 f"prefill frame kind or src=<prefill rank>")
        n_requests = len(input_lens)
        if spec.room is not None and spec.room >= n_requests:
            raise FaultSpecError(f"fault {spec.text!r}: room {spec.room} does not exist; the "
                                 f"workload has rooms 0..{n_requests - 1}")
        if spec.chunk is not None and input_lens:
            lens = [input_lens[spec.room]] if spec.room is not None else input_lens
            chunk_tokens = cfg.full_chunk_pages * cfg.page_size
            chunks = max(-(-n // chunk_tokens) for n in lens)
            if spec.chunk >= chunks:
                whose = f"room {spec.room}" if spec.room is not None else "the longest request"
                raise FaultSpecError(f"fault {spec.text!r}: chunk {spec.chunk} does not exist; "
                                     f"{whose} sends chunks 0..{max(chunks - 1, 0)}")


def fault_report(specs: list[FaultSpec], fired: list[int]) -> list[dict[str, Any]]:
    """One entry per spec: ``{"fault", "fired"}`` plus ``"note"`` for one that never fired."""
    out: list[dict[str, Any]] = []
    for spec, n in zip(specs, fired, strict=True):
        entry: dict[str, Any] = {"fault": spec.text, "fired": n}
        if n == 0:
            entry["note"] = "never fired"
        out.append(entry)
    return out


@dataclass(slots=True)
class MessageFate:
    """What happens to one frame: delivered ``copies`` times after ``extra_s`` more latency.

    ``hold_s`` of that latency comes from ``delay``, which stalls the sending socket's
    connection (the frames behind it on the same socket wait too, as on one TCP stream);
    the rest comes from ``reorder``, which holds only this frame, so later frames overtake it.
    """

    copies: int = 1
    extra_s: float = 0.0
    hold_s: float = 0.0
    send_failed: bool = False
    applied: tuple[str, ...] = ()
    rewrite: tuple[tuple[str, int], ...] = ()

    def frame(self, msg: wire.Message) -> wire.Message:
        """``msg`` as it leaves the sender: with the ``corrupt`` faults' fields rewritten."""
        if not self.rewrite:
            return msg
        changes: dict[str, Any] = dict(self.rewrite)
        out: wire.Message = msgspec.structs.replace(msg, **changes)
        return out


class FaultInjector:
    """Decides each frame's and transfer's fate from the specs; deterministic given ``rng``."""

    def __init__(self, specs: list[FaultSpec], rng: random.Random) -> None:
        self.specs = specs
        self.rng = rng
        self.counts = [0] * len(specs)
        self.fired = [0] * len(specs)

    def _fires(self, i: int, spec: FaultSpec) -> bool:
        self.counts[i] += 1
        if spec.nth is not None:
            hit = self.counts[i] == spec.nth
        elif spec.p is not None:
            hit = self.rng.random() < spec.p
        else:
            hit = True
        self.fired[i] += hit
        return hit

    def message(self, src: str, dst: str, msg: wire.Message) -> MessageFate:
        fate = MessageFate()
        kind = wire.tag_of(msg).decode()
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
                if spec.action == "delay":
                    fate.hold_s += spec.ms / 1000
            elif spec.action == "fail-send":
                fate.send_failed = True
                fate.copies = 0
            elif spec.action == "corrupt":
                assert spec.field is not None and spec.value is not None
                fate.rewrite += ((spec.field, spec.value),)
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


def in_scope(spec: FaultSpec, node: str) -> bool:
    """Whether a ``crash`` or ``restart`` takes ``node`` down: its target, or with
    ``scope=server`` every rank of the target's server (node ids ``p0g1r0``: the role and
    instance before the ``g``)."""
    if node == spec.target:
        return True
    return spec.scope == "server" and node[:node.find("g")] == spec.target[:spec.target.find("g")]


def scope_nodes(topo: Topology, spec: FaultSpec) -> list[str]:
    """``in_scope``'s ranks of ``topo``, the target first."""
    return [spec.target] + [n for n in topo.nodes if n != spec.target and in_scope(spec, n)]
