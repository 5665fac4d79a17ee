"""The twin's own control-plane messages (coordinator <-> rank <-> agent), typed and strictly
decoded: nothing read from a socket is ever unpickled, marshalled or evaluated.

Each message body is one class here with typed fields, encoded with MessagePack by msgspec and
decoded against its class (an unknown tag, a missing field or a value of the wrong type is a
:class:`BadFrame`). The core's events inside a message are the events' own classes (tagged
msgspec Structs, as in a trace line), decoded as strictly as the trace reader decodes them.

Which frame holds which body:

=================  =========================================================  ==============
frame tag          frames                                                     body
=================  =========================================================  ==============
``TWIN_CMD``       ``[tag, body]``                                            :data:`Command`
``TWIN_REC``       ``[tag, node, body]``                                      :class:`Records`
``TWIN_STATE``     ``[tag, node, body]``                                      :class:`RankState`
``TWIN_AGENT_LAUNCH`` ``[tag, body]``                                         :class:`Launch`
=================  =========================================================  ==============

The remaining twin frames (hello, directory, reports, agent join and heartbeats) carry JSON
objects and are read with :func:`json_object`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from twin.core import events as ev
from twin.core import snapshot as snap


class BadFrame(ValueError):
    """A frame whose body does not decode as its kind says: it is dropped, with one note."""


# -- commands (coordinator -> rank) ------------------------------------------------------------
class Feed(msgspec.Struct, tag="feed", frozen=True, forbid_unknown_fields=True):
    """Feed one driver input to the rank's core."""

    event: ev.Input


class SetupRequest(msgspec.Struct, tag="request", frozen=True, forbid_unknown_fields=True):
    """Allocate and fill a room's KV pages before its protocol starts."""

    room: int
    rid: int
    input_len: int
    decode_prefix_len: int
    computed: int | None = None  # the cached prefix; the whole request when None


class QueryState(msgspec.Struct, tag="state", frozen=True, forbid_unknown_fields=True):
    """Ask the rank for a :class:`RankState`."""


Command = Feed | SetupRequest | QueryState


def setup_request(d: dict[str, Any]) -> SetupRequest:
    """The setup command for a request dict (``room``, ``rid``, ``input_len``,
    ``decode_prefix_len`` and optionally ``computed``)."""
    return SetupRequest(room=int(d["room"]), rid=int(d["rid"]), input_len=int(d["input_len"]),
                        decode_prefix_len=int(d["decode_prefix_len"]),
                        computed=None if d.get("computed") is None else int(d["computed"]))


def request_dict(cmd: SetupRequest) -> dict[str, Any]:
    """The request dict a rank keeps for a setup command (``computed`` only when given)."""
    d = {"room": cmd.room, "rid": cmd.rid, "input_len": cmd.input_len,
         "decode_prefix_len": cmd.decode_prefix_len}
    if cmd.computed is not None:
        d["computed"] = cmd.computed
    return d


# -- rank -> coordinator ---------------------------------------------------------------------
class Records(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a rank has recorded since its last batch: ``(t, input, effects)`` per input, its
    reports, and the time up to which it has now sent everything."""

    records: list[tuple[float, ev.Input, list[ev.Effect]]]
    reports: list[dict[str, Any]]
    upto: float


class RankState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A rank's state for the diagnosis: its core's snapshot (one of the two), the next
    scripted input it waits for (replay), how many real inputs it holds back, and the first
    wrong byte range of each room the byte check found corrupt."""

    prefill: snap.PrefillSnapshot | None
    decode: snap.DecodeSnapshot | None
    next: ev.Input | None
    held: int
    mismatch: dict[int, str]

    @property
    def snapshot(self) -> snap.RankSnapshot | None:
        return self.prefill if self.prefill is not None else self.decode



def rank_state(snapshot: snap.RankSnapshot, next_event: Any, held: int,
               mismatch: dict[int, str]) -> RankState:
    is_prefill = isinstance(snapshot, snap.PrefillSnapshot)
    return RankState(prefill=snapshot if is_prefill else None,  # type: ignore[arg-type]
                     decode=None if is_prefill else snapshot,  # type: ignore[arg-type]
                     next=next_event,
                     held=held, mismatch=mismatch)


# -- coordinator -> agent --------------------------------------------------------------------
class Launch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The rank specs an agent starts (``twin.hw.rankspec.RankSpec`` fields; a script is a
    list of the core's inputs)."""

    specs: list[dict[str, Any]]


# -- codec -------------------------------------------------------------------------------------
_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {
    t: msgspec.msgpack.Decoder(t) for t in (Command, Records, RankState, Launch)}


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, kind: Any) -> Any:
    """``data`` decoded as ``kind`` (one of :data:`Command`, :class:`Records`,
    :class:`RankState`, :class:`Launch`); :class:`BadFrame` saying why if it does not."""
    try:
        return _decoders[kind].decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadFrame(str(exc)) from None


def feed(event: Any) -> Feed:
    """The command that feeds ``event`` (a core input) to a rank."""
    return Feed(event=event)


def encode_records(records: list[tuple[float, Any, list[Any]]], reports: list[dict[str, Any]],
                   upto: float) -> bytes:
    return encode(Records(records=records, reports=reports, upto=upto))


def decode_records(data: bytes, where: str) -> tuple[list[tuple[float, Any, list[Any]]],
                                                     list[dict[str, Any]], float]:
    """A :class:`Records` body; :class:`BadFrame` (naming ``where``) if any part is bad."""
    try:
        body: Records = decode(data, Records)
    except BadFrame as exc:
        raise BadFrame(f"{where}: {exc}") from None
    return body.records, body.reports, body.upto


def encode_launch(specs: list[Any]) -> bytes:
    """A :class:`Launch` body for ``RankSpec`` objects."""
    return encode(Launch(specs=[{**dataclasses.asdict(spec), "script": spec.script}
                                for spec in specs]))


def decode_launch(data: bytes, where: str) -> list[Any]:
    """The ``RankSpec`` objects of a :class:`Launch` body; :class:`BadFrame` if any is bad."""
    from twin.hw.rankspec import RankSpec

    body: Launch = decode(data, Launch)
    specs = []
    for d in body.specs:
        script = d.get("script")
        try:
            spec = msgspec.convert({**d, "script": None}, RankSpec, strict=True)
            if script is not None:
                spec.script = msgspec.convert(script, list[ev.Input], strict=True)
        except msgspec.ValidationError as exc:
            raise BadFrame(f"{where}: rank spec: {exc}") from None
        specs.append(spec)
    return specs


def json_object(data: bytes) -> dict[str, Any]:
    """A frame holding one JSON object; :class:`BadFrame` if it does not."""
    try:
        d = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise BadFrame(f"not JSON: {exc}") from None
    if not isinstance(d, dict):
        raise BadFrame(f"not a JSON object: {type(d).__name__}")
    return d
