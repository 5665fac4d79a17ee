"""The driver's own records (``dir: "sys"`` lines): one class each, the schema of its fields.

A line holds ``{"type": ClassName, **fields}``; a driver may add keys of its own, which readers
keep (``Record.data``). Records stay plain dicts in the writer and the readers; each is checked
against its class here (``check_record``), with the same strict rules as the events.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

from twin.trace.codec import TraceError, _error

OUTCOME_STATUSES = ("completed", "failed", "wedged", "corrupted", "interrupted", "crashed",
                    "until")


class SysRecord(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag=True):
    """Base of the driver records (unknown keys allowed: a driver may add its own)."""


class RequestArrived(SysRecord, frozen=True):
    """A request entered the system; introduces ``room`` (its bootstrap room).
    ``prefill_node``/``decode_node`` list the nodes that serve it."""

    room: int
    rid: str
    input_len: int
    output_len: int
    decode_prefix_len: int
    prefill_prefix_len: int
    prefill_node: list[str]
    decode_node: list[str]


class ForwardStart(SysRecord, frozen=True):
    """A prefill node started the forward pass that computes ``tokens`` tokens of ``room``."""

    room: int
    tokens: int


class ForwardEnd(SysRecord, frozen=True):
    """That forward pass finished (the matching ``ForwardStart`` has the same room)."""

    room: int
    tokens: int


class FaultInjected(SysRecord, frozen=True):
    """The driver injected fault ``fault`` (a fault spec string); ``detail`` says what it hit
    and ``room`` (an int, only when it touched one) which room: a replay names the fault on
    that room's wedge root, as the run did."""

    fault: str
    detail: str


class RequestLost(SysRecord, frozen=True):
    """The driver ended room ``room`` Failed outside the protocol (``reason``): its decode
    server died to restart, or was down when the request came, so the client got an error and
    no decode rank will conclude the room; a replay counts it failed."""

    room: int
    reason: str


class Note(SysRecord, frozen=True):
    """Free text from the driver."""

    text: str


class Metric(SysRecord, frozen=True):
    """A named number measured by the driver."""

    name: str
    value: float


class Outcome(SysRecord, frozen=True):
    """The run's verdict; the last line of a complete trace. ``status`` is one of
    ``completed``, ``failed``, ``wedged``, ``corrupted``, ``interrupted``, ``crashed``,
    ``until``."""

    status: Literal["completed", "failed", "wedged", "corrupted", "interrupted", "crashed",
                    "until"]
    completed: int
    failed: int
    requests: int
    diagnosis: list[str]
    corruption: list[str]


SYS_CLASSES: dict[str, type[SysRecord]] = {c.__name__: c for c in (
    RequestArrived, ForwardStart, ForwardEnd, FaultInjected, RequestLost, Note, Metric,
    Outcome)}


def _kind(hint: Any) -> str:
    if hint is int:
        return "int"
    if hint is float:
        return "number"
    if hint == list[str]:
        return "list[str]"
    return "str"  # str, or a Literal of strings


SYS_TYPES: dict[str, dict[str, str]] = {
    name: {f.name: _kind(f.type) for f in msgspec.structs.fields(cls)}
    for name, cls in SYS_CLASSES.items()}
"""Type -> required field -> JSON type (``int``, ``str``, ``number``, ``list[str]``), from the
classes (for the schema and the documentation tables)."""
SYS_DOCS: dict[str, str] = {name: " ".join((cls.__doc__ or "").split())
                            for name, cls in SYS_CLASSES.items()}


def check_record(record: Any, where: str, nodes: Any) -> str:
    """Check a driver record (a dict) against its class; its type. ``TraceError`` names the
    field; a ``RequestArrived``'s nodes must be in ``nodes``."""
    if type(record) is not dict:
        raise TraceError(where, "expected a record object")
    rtype = record.get("type")
    if type(rtype) is not str or rtype not in SYS_CLASSES:
        raise TraceError(where, f"unknown sys record type {rtype!r}; known: "
                         f"{', '.join(SYS_CLASSES)}", "type")
    try:
        rec = msgspec.convert(record, SYS_CLASSES[rtype], strict=True)
    except msgspec.ValidationError as exc:
        err = _error(where, exc)
        if err.field == "status":  # an Outcome's: name the statuses
            raise TraceError(where, f"expected one of {OUTCOME_STATUSES}, got "
                             f"{record.get('status')!r}", "status") from None
        raise err from None
    if type(rec) is Metric and not math.isfinite(rec.value):
        raise TraceError(where, f"expected a finite number, got {rec.value!r}", "value")
    if type(rec) is RequestArrived:
        for key in ("prefill_node", "decode_node"):
            for nid in getattr(rec, key):
                if nid not in nodes:
                    raise TraceError(where, f"unknown node {nid!r}", key)
    return rtype

