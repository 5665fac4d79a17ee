"""Packed batches in, trace lines, blocks and the index's live state out: the ``RowEncoder`` of
``twin.trace.encoder`` and the ``LiveState`` it keeps for the index (``twin.trace.index``). The
batches are the trace writer's (``twin.trace.packio`` describes them); each event is read back
as its row (``twin.trace.rows``).

Compiled with the core by ``twin compile``: the per-row work (the line, its room, the live
state) then runs natively, each line one call into the generated ``twin.trace.emitters``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any, Final

from twin.core import events as ev
from twin.core import wire
from twin.trace.blocks import BlockSink
from twin.trace.emitters import event_line, event_room, float_text
from twin.trace.index import STATE_EVERY, BlockMeta, IndexWriter
from twin.trace.packers import unpack_event
from twin.trace.packio import K_END, K_FLUSH, K_IN, K_INOUT, K_OUT, K_RESET, K_SYS, K_TIME, Reader
from twin.trace.rows import CID, field_pos

__all__ = ["DRIVER", "JSON_TEXT", "LiveState", "RowEncoder"]

DRIVER: Final = "driver"
"""The pseudo node of run-level records (``dir`` must be ``"sys"``)."""
JSON_TEXT: Final[Any] = json.JSONEncoder(separators=(",", ":"), allow_nan=False,
                                         check_circular=False).encode
"""Compact JSON text as the trace writes it (header, driver records)."""

# the rows the live state follows: their tags, and where their fields sit
_TD: Final = CID[ev.TransferDone]
_TD_WORKER: Final = field_pos(ev.TransferDone, "worker")
_WP: Final = CID[ev.WorkerPoll]
_WP_WORKER: Final = field_pos(ev.WorkerPoll, "worker")
_SD: Final = CID[ev.ScatterDone]
_SD_ALLOC: Final = field_pos(ev.ScatterDone, "alloc_id")
_MA: Final = CID[ev.MessageArrived]
_MA_MSG: Final = field_pos(ev.MessageArrived, "msg")
_WM: Final = CID[wire.Watermark]
_WM_SESSION: Final = field_pos(wire.Watermark, "session_id")
_WM_ROUND: Final = field_pos(wire.Watermark, "round")
_WM_TAIL: Final = field_pos(wire.Watermark, "tail")
_ST: Final = CID[ev.StartTransfer]
_ST_WORKER: Final = field_pos(ev.StartTransfer, "worker")
_DF: Final = CID[ev.Deferred]
_DF_WORKER: Final = field_pos(ev.Deferred, "worker")
_WW: Final = CID[ev.WakeWorkers]
_WW_WORKERS: Final = field_pos(ev.WakeWorkers, "workers")
_SS: Final = CID[ev.StartScatter]
_SS_ALLOC: Final = field_pos(ev.StartScatter, "alloc_id")
_AL: Final = CID[ev.Allocated]
_AL_ALLOC: Final = field_pos(ev.Allocated, "alloc_id")
_AL_SIZE: Final = field_pos(ev.Allocated, "size")
_FR: Final = CID[ev.Freed]
_FR_ALLOC: Final = field_pos(ev.Freed, "alloc_id")
_WMM: Final = CID[ev.WatermarkMoved]
_SE: Final = CID[ev.Send]
_SE_MSG: Final = field_pos(ev.Send, "msg")
_SR: Final = CID[wire.StagingReq]
_SR_SESSION: Final = field_pos(wire.StagingReq, "session_id")
_HOOKED: Final = frozenset({_TD, _WP, _SD, _MA, _ST, _DF, _WW, _SS, _AL, _FR, _WMM, _SE})


class LiveState:
    """The open things of a trace, updated by the encoder for the lines it writes: ``lines``
    (key -> ``(seq, line)``: transfers and scatters in flight, deferral waits, forward passes,
    each decode node's latest watermark, each prefill node's newest watermark and first
    STAGING_REQ per session) and ``alloc`` (node -> alloc_id -> size of live allocations).
    ``snapshot_text()`` is the index's ``state`` object (``twin.trace.index``)."""

    def __init__(self) -> None:
        self.lines: dict[tuple[Any, ...], tuple[int, str]] = {}
        self.alloc: dict[str, dict[Any, Any]] = {}
        self._newest_wm: dict[tuple[str, Any], tuple[Any, Any]] = {}

    def on_row(self, tag: int, node: str, r: tuple[Any, ...], seq: int, line: str) -> None:
        """Note input or effect row ``r`` (``tag`` its class's), written as ``line``."""
        if tag not in _HOOKED:
            return
        lines = self.lines
        if tag == _MA:
            msg = r[_MA_MSG]
            if msg[0] == _WM:
                key = (node, msg[_WM_SESSION])
                value = (msg[_WM_ROUND], msg[_WM_TAIL])
                prev = self._newest_wm.get(key)
                if prev is None or value > prev:
                    self._newest_wm[key] = value
                    lines[("p", node, key[1])] = (seq, line)
        elif tag == _SE:
            msg = r[_SE_MSG]
            if msg[0] == _SR:
                lines.setdefault(("r", node, msg[_SR_SESSION]), (seq, line))
        elif tag == _TD:
            lines.pop(("x", node, r[_TD_WORKER]), None)
            lines.pop(("d", node, r[_TD_WORKER]), None)
        elif tag == _WP:
            lines.pop(("d", node, r[_WP_WORKER]), None)
        elif tag == _SD:
            lines.pop(("s", node, r[_SD_ALLOC]), None)
        elif tag == _ST:
            lines.pop(("d", node, r[_ST_WORKER]), None)
            lines[("x", node, r[_ST_WORKER])] = (seq, line)
        elif tag == _DF:
            lines.setdefault(("d", node, r[_DF_WORKER]), (seq, line))
        elif tag == _WW:
            for w in r[_WW_WORKERS]:
                lines.pop(("d", node, w), None)
        elif tag == _SS:
            lines[("s", node, r[_SS_ALLOC])] = (seq, line)
        elif tag == _AL:
            self.alloc.setdefault(node, {})[r[_AL_ALLOC]] = r[_AL_SIZE]
        elif tag == _FR:
            self.alloc.get(node, {}).pop(r[_FR_ALLOC], None)
        elif tag == _WMM:
            lines[("w", node)] = (seq, line)

    def on_sys(self, rtype: str, node: str, room: Any, seq: int, line: str) -> None:
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
                + ",".join([text.rstrip("\n") for _, text in lines]) + "]}")


class RowEncoder:
    """Packed batches (``twin.trace.packio``) -> lines -> blocks written to ``sink`` (and
    described to ``index``). ``nodes``: the header's node ids, in order (their codes)."""

    def __init__(self, sink: BlockSink, index: IndexWriter | None,
                 nodes: Mapping[str, Any], flush_every: int) -> None:
        self._sink = sink
        self._index = index
        self.flush_every = flush_every
        self._hard_limit = 2 * flush_every
        names = [*nodes, DRIVER]
        self._names: list[str] = names
        self._pin: list[str] = [f'"node":{json.dumps(n)},"dir":"in",' for n in names]
        self._pout: list[str] = [f'"node":{json.dumps(n)},"dir":"out",' for n in names]
        self._psys: list[str] = [f'"node":{json.dumps(n)},"dir":"sys",' for n in names]
        self._strs: list[str] = []
        self._seq = 0
        self._t = 0.0
        self._tt = '"t":0.0,'
        self._buf: list[str] = []
        self._rooms: set[Any] = set()
        self._live = LiveState()
        self._blk_seq = 0
        self._blk_t0 = 0.0
        self._blocks = 0
        self._state: str | None = '{"alloc":{},"lines":[]}'

    def feed(self, data: bytes, records: list[Any]) -> None:
        """Encode one packed batch (``data``; ``records``: its driver records), writing every
        block it completes."""
        r = Reader(data, self._strs)
        buf = self._buf
        rooms = self._rooms
        live = self._live
        flush_every = self.flush_every
        while True:
            kind = r.get_tag()
            if kind == K_TIME:
                t = r.get_float()
                self._t = t
                self._tt = '"t":' + float_text(t) + ","
                continue
            if kind == K_END:
                break
            if kind == K_SYS:
                code = r.get_int()
                rtype, room, record = records[r.get_int()]
                self._sys(code, rtype, room, record)
                continue
            if kind == K_FLUSH:
                self._drain()
                continue
            if kind == K_RESET:
                self._strs.clear()
                continue
            if kind != K_IN and kind != K_OUT and kind != K_INOUT:
                raise ValueError(f"a packed batch holds an unknown item kind {kind}")
            code = r.get_int()
            node = self._names[code]
            seq = self._seq
            if kind != K_OUT:
                row = unpack_event(r)
                if not buf:
                    self._blk_seq = seq
                    self._blk_t0 = self._t
                line = event_line(row, seq, self._tt + self._pin[code])
                buf.append(line)
                room = event_room(row)
                if room is not None:
                    rooms.add(room)
                live.on_row(row[0], node, row, seq, line)
                seq += 1
                if len(buf) >= self._hard_limit:
                    self._drain()
            if kind != K_IN:
                if not buf:
                    self._blk_seq = seq
                    self._blk_t0 = self._t
                head = self._tt + self._pout[code]
                for _ in range(r.get_int()):
                    row = unpack_event(r)
                    line = event_line(row, seq, head)
                    buf.append(line)
                    room = event_room(row)
                    if room is not None:
                        rooms.add(room)
                    live.on_row(row[0], node, row, seq, line)
                    seq += 1
                if len(buf) >= flush_every:
                    self._drain()
            self._seq = seq

    def _sys(self, code: int, rtype: str, room: Any, record: Any) -> None:
        node = self._names[code]
        seq = self._seq
        if not self._buf:
            self._blk_seq = seq
            self._blk_t0 = self._t
        record_text: str = JSON_TEXT(record)
        line = ('{"seq":' + str(seq) + "," + self._tt + self._psys[code]
                + record_text[1:] + "\n")
        self._buf.append(line)
        if room is not None:
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
        data = "".join(buf).encode("utf-8")
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
