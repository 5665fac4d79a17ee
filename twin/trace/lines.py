"""The trace writer's two halves (compiled with the core by ``twin compile``). ``Batch``
checks each item and collects it; ``LineEncoder`` turns batches into lines (one msgspec encode
per event), blocks and the index's ``LiveState``, here or in a forked child that gets them as
msgpack (``pack_batch``), writing the same bytes either way: a block ends after an input's
effects once ``flush_every`` lines are buffered, at ``2 * flush_every`` after an input, after a
driver record once ``flush_every`` are buffered, and on ``flush``."""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Mapping, Sequence
from types import GenericAlias
from typing import Any, Final, Optional, Union, get_args

import msgspec

from twin.core import events as ev
from twin.core import wire
from twin.trace.blocks import BlockSink
from twin.trace.codec import _EFFECT, _INPUT, TraceError, decode_event, encode
from twin.trace.index import STATE_EVERY, BlockMeta, IndexWriter
from twin.trace.rooms import named_room

__all__ = ["DRIVER", "JSON_TEXT", "Batch", "Item", "LineEncoder", "LiveState", "float_text",
           "pack_batch", "unpack_batch"]

# The classes the encoder tests on every line, as module constants: compiled, a Final name
# is a C static, where ``ev.Send`` is two lookups on every use.
_Allocated: Final = ev.Allocated
_Deferred: Final = ev.Deferred
_Freed: Final = ev.Freed
_MessageArrived: Final = ev.MessageArrived
_RoomConcluded: Final = ev.RoomConcluded
_ScatterDone: Final = ev.ScatterDone
_Send: Final = ev.Send
_StagingReq: Final = wire.StagingReq
_StartScatter: Final = ev.StartScatter
_StartTransfer: Final = ev.StartTransfer
_TransferDone: Final = ev.TransferDone
_WakeWorkers: Final = ev.WakeWorkers
_Watermark: Final = wire.Watermark
_WatermarkMoved: Final = ev.WatermarkMoved
_WorkerPoll: Final = ev.WorkerPoll

DRIVER: Final = "driver"
"""The pseudo node of run-level records (``dir`` must be ``"sys"``)."""
JSON_TEXT: Final[Any] = json.JSONEncoder(separators=(",", ":"), allow_nan=False,
                                         check_circular=False).encode
"""Compact JSON text as the trace writes it (header, driver records)."""

Item = tuple[float, int, Any, Optional[list[Any]], Optional[dict[str, Any]]]  # noqa: UP045
"""``(t, node code, input or None, effects, driver record or None)``: one entry of a batch.
Effects None: the input's effects follow in a later item (``TraceWriter.write_input``)."""
_UNION: Any = Union
_BATCH: Any = GenericAlias(list, (GenericAlias(tuple, (
    float, int, _UNION[_INPUT, None], _UNION[GenericAlias(list, (_EFFECT,)), None],
    _UNION[dict[str, Any], None])),))
"""A batch's type, as msgpack decodes it: ``list[tuple[float, int, Input | None,
list[Effect] | None, dict | None]]``."""
_PACKER: Final = msgspec.msgpack.Encoder()
pack_batch = _PACKER.encode
"""A batch of items as msgpack bytes (what crosses the pipe to a forked encoder)."""
_pack_into: Final = _PACKER.encode_into
_HEAD: Final = struct.Struct(">BI")
unpack_batch = msgspec.msgpack.Decoder(_BATCH).decode
"""The items of ``pack_batch``'s bytes, events rebuilt as their classes."""


_FORWARD_KEYS: Final = ["type", "room", "tokens"]


def forward_record(record: dict[str, Any]) -> bool:
    """Whether ``record`` is a well-formed ``ForwardStart`` or ``ForwardEnd`` with no other
    key, its keys in the order a run writes them (the driver records a run writes most,
    checked without ``check_record`` and written without the json module)."""
    if list(record) != _FORWARD_KEYS:
        return False
    rtype = record["type"]
    return ((rtype == "ForwardStart" or rtype == "ForwardEnd")
            and type(record["room"]) is int and type(record["tokens"]) is int)


def _record_text(record: dict[str, Any]) -> bytes:
    """A driver record's ``JSON_TEXT`` without its opening brace; a ``forward_record`` (the
    common case) written directly, in the same bytes."""
    if forward_record(record):
        rtype: str = record["type"]
        text: bytes = b'"type":"%s","room":%d,"tokens":%d}' % (
            rtype.encode(), record["room"], record["tokens"])
        return text
    whole: str = JSON_TEXT(record)
    return whole[1:].encode()


def float_text(t: float) -> bytes:
    """A time as the trace writes it: the shortest text that reads back as the same float."""
    return encode(float(t))


_FLOATS: dict[type, bool] = {}
"""Event class -> whether it (or a frame it carries) has a float field: only those can hold
an infinity or NaN, so only their texts are searched for a ``null``."""


def _has_floats(t: type) -> bool:
    has = _FLOATS.get(t)
    if has is None:
        has = _FLOATS[t] = _holds_float(t, set())
    return has


def _holds_float(t: Any, seen: set[Any]) -> bool:
    """Whether type ``t`` is a float or holds one (in a Struct's fields, a union, a tuple)."""
    if t is float or t in seen:
        return t is float
    seen.add(t)
    if isinstance(t, type) and issubclass(t, msgspec.Struct):
        return any(_holds_float(f.type, seen) for f in msgspec.structs.fields(t))
    return any(_holds_float(a, seen) for a in get_args(t))


def _text(event: Any) -> bytes:
    """An event's JSON text without its opening brace. JSON has no infinities or NaN (msgspec
    writes them as null): an event whose text holds a null that does not read back is
    refused with ``ValueError``."""
    text = encode(event)
    if _has_floats(type(event)) and text.find(b"null") >= 0:  # (``in`` raises and clears
        # a TypeError on every call before it searches)
        try:
            decode_event(text, where=type(event).__name__)
        except TraceError as exc:
            raise ValueError(f"{exc}: not a finite number or not JSON") from None
    return text[1:]


class LiveState:
    """The open things of a trace, updated for the lines written: ``lines`` (key -> ``(seq,
    line)``: transfers and scatters in flight, deferral waits, forward passes, each decode
    node's latest watermark, each prefill node's newest watermark and first STAGING_REQ per
    session) and ``alloc`` (node -> alloc_id -> size of live allocations).
    ``snapshot_text()`` is the index's ``state`` object (``twin.trace.index``)."""

    def __init__(self) -> None:
        self.lines: dict[tuple[Any, ...], tuple[int, bytes]] = {}
        self.alloc: dict[str, dict[int, int]] = {}
        self._newest_wm: dict[tuple[str, str], tuple[int, int]] = {}

    def on_event(self, node: str, e: Any, seq: int, line: bytes) -> None:
        """Note input or effect ``e`` of ``node``, written as ``line``."""
        t = type(e)
        lines = self.lines
        if t is _MessageArrived:
            msg = e.msg
            if type(msg) is _Watermark:
                key = (node, msg.session_id)
                value = (msg.round, msg.tail)
                prev = self._newest_wm.get(key)
                if prev is None or value > prev:
                    self._newest_wm[key] = value
                    lines[("p", node, msg.session_id)] = (seq, line)
        elif t is _Send:
            if type(e.msg) is _StagingReq:
                lines.setdefault(("r", node, e.msg.session_id), (seq, line))
        elif t is _TransferDone:
            lines.pop(("x", node, e.worker), None)
            lines.pop(("d", node, e.worker), None)
        elif t is _WorkerPoll:
            lines.pop(("d", node, e.worker), None)
        elif t is _ScatterDone:
            lines.pop(("s", node, e.alloc_id), None)
        elif t is _StartTransfer:
            lines.pop(("d", node, e.worker), None)
            lines[("x", node, e.worker)] = (seq, line)
        elif t is _Deferred:
            lines.setdefault(("d", node, e.worker), (seq, line))
        elif t is _WakeWorkers:
            for w in e.workers:
                lines.pop(("d", node, w), None)
        elif t is _StartScatter:
            lines[("s", node, e.alloc_id)] = (seq, line)
        elif t is _Allocated:
            self.alloc.setdefault(node, {})[e.alloc_id] = e.size
        elif t is _Freed:
            self.alloc.get(node, {}).pop(e.alloc_id, None)
        elif t is _WatermarkMoved:
            lines[("w", node)] = (seq, line)

    def on_sys(self, rtype: str, node: str, room: Any, seq: int, line: bytes) -> None:
        """Note driver record ``rtype`` of ``room`` (or None), written as ``line``."""
        if rtype == "ForwardStart":
            self.lines[("f", node, room)] = (seq, line)
        elif rtype == "ForwardEnd":
            self.lines.pop(("f", node, room), None)

    def snapshot_text(self) -> str:
        """The ``state`` object as JSON text (its lines embedded as they were written)."""
        alloc = {n: sorted(a.items()) for n, a in self.alloc.items() if a}
        lines = sorted(self.lines.values())
        return ('{"alloc":' + json.dumps(alloc, separators=(",", ":")) + ',"lines":['
                + ",".join([text.decode().rstrip("\n") for _, text in lines]) + "]}")


class LineEncoder:
    """Batches of items -> lines -> blocks written to ``sink`` (and described to ``index``).
    ``nodes``: the header's node ids, in order (their codes; ``DRIVER`` follows them)."""

    def __init__(self, sink: BlockSink, index: IndexWriter | None,
                 nodes: Mapping[str, Any], flush_every: int) -> None:
        self._sink = sink
        self._index = index
        self.flush_every = flush_every
        self._hard_limit = 2 * flush_every
        names = [*nodes, DRIVER]
        self._names: list[str] = names
        self._heads = {d: [f',"node":{json.dumps(n)},"dir":"{d}",'.encode() for n in names]
                       for d in ("in", "out", "sys")}
        self._seq = 0
        self._t = 0.0
        self._tt = b'"t":0.0'
        self._buf: list[bytes] = []
        self._rooms: set[Any] = set()
        self._live = LiveState()
        self._blk_seq = 0
        self._blk_t0 = 0.0
        self._blocks = 0
        self._state: str | None = '{"alloc":{},"lines":[]}'

    def feed_packed(self, data: bytes) -> None:
        """``feed`` the items of a packed batch (``pack_batch``, or ``Batch(packed=True)``'s)."""
        self.feed(unpack_batch(data))

    def feed(self, items: Sequence[Item]) -> None:
        """Encode ``items`` in order, writing every block they complete."""
        buf = self._buf
        heads_in, heads_out = self._heads["in"], self._heads["out"]
        for t, code, inp, effects, record in items:
            if t != self._t:
                self._t = t
                self._tt = b'"t":' + float_text(t)
            if record is not None:
                self._sys(code, record)
                continue
            node = self._names[code]
            seq = self._seq
            if not buf:
                self._blk_seq = seq
                self._blk_t0 = t
            if inp is not None:
                self._line(node, inp, seq, heads_in[code])
                seq += 1
            if effects is None:  # its effects follow in another item: keep them together
                self._seq = seq
                if len(buf) >= self._hard_limit:
                    self._drain()
                continue
            head = heads_out[code]
            for e in effects:
                self._line(node, e, seq, head)
                seq += 1
            self._seq = seq
            if len(buf) >= self.flush_every:
                self._drain()

    def _line(self, node: str, e: Any, seq: int, head: bytes) -> None:
        """Write event ``e`` of ``node`` as line ``seq`` (``head``: its node and dir)."""
        line = b'{"seq":%d,%s%s%s\n' % (seq, self._tt, head, _text(e))
        self._buf.append(line)
        room = named_room(e)
        if room is not None:
            self._rooms.add(room)
        self._live.on_event(node, e, seq, line)

    def _sys(self, code: int, record: dict[str, Any]) -> None:
        node = self._names[code]
        seq = self._seq
        if not self._buf:
            self._blk_seq = seq
            self._blk_t0 = self._t
        line = b'{"seq":%d,%s%s%s\n' % (seq, self._tt, self._heads["sys"][code],
                                        _record_text(record))
        self._buf.append(line)
        rtype = record["type"]
        room = record.get("room")
        if type(room) is int:
            self._rooms.add(room)
        self._live.on_sys(rtype, node, room, seq, line)
        self._seq = seq + 1
        if len(self._buf) >= self.flush_every:
            self._drain()

    def _drain(self) -> None:
        buf = self._buf
        if not buf:
            return
        rooms = self._rooms
        rooms.discard(None)
        meta = BlockMeta(self._blk_seq, len(buf), self._blk_t0, self._t, sorted(rooms),
                         self._state)
        data = b"".join(buf)
        buf.clear()
        rooms.clear()
        self._blocks += 1
        self._state = self._live.snapshot_text() if self._blocks % STATE_EVERY == 0 else None
        self._sink.write(data, meta)

    def flush(self) -> None:
        """End the block here and wait until every block is in the file."""
        self._drain()
        self._sink.flush()

    def close(self) -> None:
        """Write the last block and close the file and the index."""
        try:
            self._drain()
        finally:
            try:
                self._sink.close()
            finally:
                if self._index is not None:
                    self._index.close()

    def abandon(self) -> None:
        """Close the files without writing what is buffered (after an error)."""
        with contextlib.suppress(Exception):
            self._sink.close()
        if self._index is not None:
            with contextlib.suppress(Exception):
                self._index.close()


class Batch:
    """The writer's batch in the making: the hot path of ``TraceWriter`` (compiled with the core).

    ``record`` (the runtime's one call per input), ``add_input`` and ``add_effects`` check each
    item (times non-decreasing and finite, the node declared, inputs and effects of the core's
    classes), note the rooms decode nodes conclude, and append it; ``ship()`` is called once
    ``limit`` items are collected. ``path`` names the file in errors (``path:line``).
    ``check_sys(record)`` checks a driver record other than the common ``ForwardStart`` and
    ``ForwardEnd`` (``write_sys``), raising ``TraceError`` without a place. ``packed``: each
    item is encoded as ``pack_batch`` would when it is added, while its objects are still in
    the cache, and ``take()`` returns the batch's bytes (for a forked encoder); otherwise
    ``take()`` returns the list of items."""

    def __init__(self, path: str, codes: dict[str, int], decode_nodes: set[str], limit: int,
                 ship: Any, check_sys: Any, packed: bool = False) -> None:
        self.path = path
        self.packed = packed
        self.buf = bytearray(_HEAD.size)  # packed: the items' msgpack after an array header
        self.count = 0  # items collected since the last ``take``
        self.codes = codes
        self.driver_code = len(codes)
        self.check_sys = check_sys
        self.decode_nodes = decode_nodes
        self.limit = limit
        self.ship = ship
        self.items: list[Any] = []
        self.lines = 0  # lines collected so far, handed on or not
        self.t = 0.0
        self.succeeded: set[int] = set()
        self.failed: set[int] = set()

    def where(self) -> str:
        """``path:line`` of the next line."""
        return f"{self.path}:{self.lines + 2}"

    def set_time(self, t: float) -> None:
        t = float(t)
        if not t >= self.t or not math.isfinite(t):
            raise TraceError(self.where(), f"time {t!r} is before {self.t!r} or not finite", "t")
        self.t = t

    def code(self, node: str, d: str) -> int:
        code = self.codes.get(node)
        if code is None:
            raise TraceError(self.where(), f"unknown node {node!r} for dir {d!r}", "node")
        return code

    def effects(self, node: str, effects: Any) -> list[Any]:
        """``effects`` as a list, each checked to be a core effect; notes conclusions."""
        out: list[Any] = effects if type(effects) is list else list(effects)
        for e in out:
            c = type(e)
            if c not in _EFFECT_CLASSES:
                raise TypeError(f"not a core effect: {c.__name__}")
            if c is _RoomConcluded and node in self.decode_nodes:
                (self.succeeded if e.status == "Success" else self.failed).add(e.room)
        return out

    def record(self, t: float, node: str, event: Any, effects: Any) -> None:
        """Record that ``node`` handled input ``event`` at time ``t`` and returned ``effects``."""
        if t != self.t:
            self.set_time(t)
        code = self.codes.get(node)
        if code is None:
            code = self.code(node, "in")
        if type(event) not in _INPUT_CLASSES:
            raise TypeError(f"not a core input: {type(event).__name__}")
        out = self.effects(node, effects)
        self.add((t, code, event, out, None), 1 + len(out))

    def add_input(self, t: float, node: str, event: Any) -> None:
        """An input whose effects follow with ``add_effects``."""
        if t != self.t:
            self.set_time(t)
        code = self.code(node, "in")
        if type(event) not in _INPUT_CLASSES:
            raise TypeError(f"not a core input: {type(event).__name__}")
        self.add((t, code, event, None, None), 1)

    def add_effects(self, t: float, node: str, effects: Any) -> None:
        """The effects of ``node``'s last input, in order."""
        if t != self.t:
            self.set_time(t)
        code = self.code(node, "out")
        out = self.effects(node, effects)
        self.add((t, code, None, out, None), len(out))

    def write_sys(self, t: float, node: str, record: Any) -> None:
        """A driver record of ``node`` (``DRIVER`` for the run's own) at time ``t``: copied,
        checked (``forward_record`` at a glance, else ``check_sys``), and appended."""
        if t != self.t:
            self.set_time(t)
        code = self.driver_code if node == DRIVER else self.code(node, "sys")
        rec = dict(record)
        if not forward_record(rec):
            try:
                self.check_sys(rec)
            except TraceError as exc:
                raise TraceError(self.where(), exc.detail, exc.field) from None
        self.add((t, code, None, None, rec), 1)

    def add(self, item: tuple[Any, ...], lines: int) -> None:
        """Append ``item`` (``lines`` trace lines), shipping the batch once it holds ``limit``
        items."""
        if self.packed:
            _pack_into(item, self.buf, -1)
        else:
            self.items.append(item)
        self.lines += lines
        self.count += 1
        if self.count >= self.limit:
            self.ship()

    def take(self) -> Any:
        """The items collected since the last call, None if there are none: ``pack_batch``'s
        bytes of them when ``packed``, else their list."""
        if not self.count:
            return None
        n = self.count
        self.count = 0
        if not self.packed:
            items = self.items
            self.items = []
            return items
        buf = self.buf
        _HEAD.pack_into(buf, 0, 0xDD, n)  # msgpack's array of up to 2**32 - 1 items
        data = bytes(buf)
        del buf[_HEAD.size:]
        return data


_INPUT_CLASSES: Final = frozenset(ev.INPUT_TYPES)
_EFFECT_CLASSES: Final = frozenset(ev.EFFECT_TYPES)
