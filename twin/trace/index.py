"""The trace index: a small file beside a trace (``TRACE.idx``) that lets readers seek.

``TraceWriter`` writes it as it writes the trace's blocks (see ``twin.trace.blocks``). Line 1
is a header; every later line describes one block of trace lines::

    {"format": "staging-twin-trace-index", "version": 1, "codec": "zstd",
     "header_sha1": "...", "state_every": 16}
    {"b": 1, "off": 412, "end": 23001, "seq": 0, "n": 1000, "t0": 0.0, "t1": 1.52,
     "rooms": [0, 1, 2], "state": {"alloc": {...}, "lines": [...]}}

``off``..``end`` are the block's bytes in the trace file (reading can start at ``off``),
``seq`` its first event and ``n`` its number of lines, ``t0``/``t1`` the times of its first and
last lines, ``rooms`` every room a line of the block names (a ``room`` field, or its message's).
Every ``state_every``-th block (and the first) also carries ``state``: what was open when the
block began, so a viewer can start there as if it had read everything before: ``alloc`` (live
ring allocations per decode node, ``[alloc_id, size]``) and ``lines``, the trace lines still
open (transfers and scatters in flight, deferral waits, forward passes, each decode node's
latest watermark, each prefill node's newest watermark and first STAGING_REQ per session).

The index is a cache: a reader checks that its header hash matches the trace and otherwise
ignores it (and scans). A killed writer leaves an index of the blocks it finished.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from twin.core import events as ev
from twin.core import wire
from twin.trace.rows import CID, Row, field_pos

__all__ = ["INDEX_SUFFIX", "Block", "IndexWriter", "LiveState", "TraceIndex", "index_path"]

INDEX_FORMAT = "staging-twin-trace-index"
INDEX_VERSION = 1
INDEX_SUFFIX = ".idx"
STATE_EVERY = 16

# where the fields the live state follows sit in their rows
_TD_WORKER = field_pos(ev.TransferDone, "worker")
_WP_WORKER = field_pos(ev.WorkerPoll, "worker")
_SD_ALLOC = field_pos(ev.ScatterDone, "alloc_id")
_MA_MSG = field_pos(ev.MessageArrived, "msg")
_WM = CID[wire.Watermark]
_WM_SESSION = field_pos(wire.Watermark, "session_id")
_WM_ROUND = field_pos(wire.Watermark, "round")
_WM_TAIL = field_pos(wire.Watermark, "tail")
_ST_WORKER = field_pos(ev.StartTransfer, "worker")
_DF_WORKER = field_pos(ev.Deferred, "worker")
_WW_WORKERS = field_pos(ev.WakeWorkers, "workers")
_SS_ALLOC = field_pos(ev.StartScatter, "alloc_id")
_AL_ALLOC = field_pos(ev.Allocated, "alloc_id")
_AL_SIZE = field_pos(ev.Allocated, "size")
_FR_ALLOC = field_pos(ev.Freed, "alloc_id")
_SE_MSG = field_pos(ev.Send, "msg")
_SR = CID[wire.StagingReq]
_SR_SESSION = field_pos(wire.StagingReq, "session_id")


def index_path(trace_path: str | os.PathLike[str]) -> Path:
    """Where the index of ``trace_path`` lives."""
    return Path(f"{os.fspath(trace_path)}{INDEX_SUFFIX}")


def header_digest(header_line: bytes) -> str:
    return hashlib.sha1(header_line.rstrip(b"\n")).hexdigest()


# ---------------------------------------------------------------------------------------------
# What is open (kept by the writer, restored by viewers)
# ---------------------------------------------------------------------------------------------
class LiveState:
    """The open things of a trace, updated by the writer for the records it writes.

    ``hooks`` maps a core event class to ``fn(node, row, seq, line)`` for inputs and effects
    (``row``: the event as ``twin.trace.rows`` reduces it); ``sys_hooks`` maps a driver record
    type to ``fn(node, room, seq, line)``.
    """

    def __init__(self) -> None:
        self.lines: dict[tuple[Any, ...], tuple[int, str]] = {}
        self.alloc: dict[str, dict[int, int]] = {}
        self._newest_wm: dict[tuple[str, str], tuple[int, int]] = {}
        self.hooks: dict[type, Callable[[str, Row, int, str], None]] = {
            ev.TransferDone: self._transfer_done, ev.WorkerPoll: self._worker_poll,
            ev.ScatterDone: self._scatter_done, ev.MessageArrived: self._message,
            ev.StartTransfer: self._start_transfer, ev.Deferred: self._deferred,
            ev.WakeWorkers: self._wake, ev.StartScatter: self._start_scatter,
            ev.Allocated: self._allocated, ev.Freed: self._freed,
            ev.WatermarkMoved: self._watermark_moved, ev.Send: self._send,
        }
        self.sys_hooks: dict[str, Callable[[str, Any, int, str], None]] = {
            "ForwardStart": self._forward_start, "ForwardEnd": self._forward_end,
        }

    # inputs
    def _transfer_done(self, node: str, r: Row, seq: int, line: str) -> None:
        self.lines.pop(("x", node, r[_TD_WORKER]), None)
        self.lines.pop(("d", node, r[_TD_WORKER]), None)

    def _worker_poll(self, node: str, r: Row, seq: int, line: str) -> None:
        self.lines.pop(("d", node, r[_WP_WORKER]), None)

    def _scatter_done(self, node: str, r: Row, seq: int, line: str) -> None:
        self.lines.pop(("s", node, r[_SD_ALLOC]), None)

    def _message(self, node: str, r: Row, seq: int, line: str) -> None:
        msg = r[_MA_MSG]
        if msg[0] == _WM:
            key = (node, msg[_WM_SESSION])
            value = (msg[_WM_ROUND], msg[_WM_TAIL])
            prev = self._newest_wm.get(key)
            if prev is None or value > prev:
                self._newest_wm[key] = value
                self.lines[("p",) + key] = (seq, line)

    # effects
    def _start_transfer(self, node: str, r: Row, seq: int, line: str) -> None:
        self.lines.pop(("d", node, r[_ST_WORKER]), None)
        self.lines[("x", node, r[_ST_WORKER])] = (seq, line)

    def _deferred(self, node: str, r: Row, seq: int, line: str) -> None:
        self.lines.setdefault(("d", node, r[_DF_WORKER]), (seq, line))

    def _wake(self, node: str, r: Row, seq: int, line: str) -> None:
        for w in r[_WW_WORKERS]:
            self.lines.pop(("d", node, w), None)

    def _start_scatter(self, node: str, r: Row, seq: int, line: str) -> None:
        self.lines[("s", node, r[_SS_ALLOC])] = (seq, line)

    def _allocated(self, node: str, r: Row, seq: int, line: str) -> None:
        self.alloc.setdefault(node, {})[r[_AL_ALLOC]] = r[_AL_SIZE]

    def _freed(self, node: str, r: Row, seq: int, line: str) -> None:
        self.alloc.get(node, {}).pop(r[_FR_ALLOC], None)

    def _watermark_moved(self, node: str, r: Row, seq: int, line: str) -> None:
        self.lines[("w", node)] = (seq, line)

    def _send(self, node: str, r: Row, seq: int, line: str) -> None:
        msg = r[_SE_MSG]
        if msg[0] == _SR:
            self.lines.setdefault(("r", node, msg[_SR_SESSION]), (seq, line))

    # driver records
    def _forward_start(self, node: str, room: Any, seq: int, line: str) -> None:
        self.lines[("f", node, room)] = (seq, line)

    def _forward_end(self, node: str, room: Any, seq: int, line: str) -> None:
        self.lines.pop(("f", node, room), None)

    def snapshot_text(self) -> str:
        """The ``state`` object as JSON text (its lines embedded as they were written)."""
        alloc = {n: sorted(a.items()) for n, a in self.alloc.items() if a}
        lines = sorted(self.lines.values())
        return ('{"alloc":' + json.dumps(alloc, separators=(",", ":")) + ',"lines":['
                + ",".join(text.rstrip("\n") for _, text in lines) + "]}")


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
@dataclass
class BlockMeta:
    """What the trace writer knows about a block when it hands it over."""

    seq: int
    n: int
    t0: float
    t1: float
    rooms: list[int]
    state: str | None


class IndexWriter:
    """Appends one line per written block (called from the block writer's thread)."""

    def __init__(self, trace_path: str | os.PathLike[str], codec: str,
                 header_line: bytes) -> None:
        self.path = index_path(trace_path)
        self._f: IO[str] = open(self.path, "w", encoding="ascii")  # noqa: SIM115
        self._block = 0
        head = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "codec": codec,
                "header_sha1": header_digest(header_line), "state_every": STATE_EVERY}
        self._f.write(json.dumps(head, separators=(",", ":")) + "\n")
        self._f.flush()

    def block(self, meta: BlockMeta, offset: int, end: int) -> None:
        self._block += 1
        text = (f'{{"b":{self._block},"off":{offset},"end":{end},"seq":{meta.seq},'
                f'"n":{meta.n},"t0":{meta.t0!r},"t1":{meta.t1!r},"rooms":['
                + ",".join(map(str, meta.rooms)) + "]")
        if meta.state is not None:
            text += ',"state":' + meta.state
        self._f.write(text + "}\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    """One indexed block: its bytes ``off``..``end``, first ``seq``, ``n`` lines, times."""

    b: int
    off: int
    end: int
    seq: int
    n: int
    t0: float
    t1: float
    has_state: bool


class TraceIndex:
    """A trace's index, checked against the trace (``load`` returns None when unusable)."""

    def __init__(self, path: Path, blocks: list[Block]) -> None:
        self.path = path
        self.blocks = blocks

    @classmethod
    def load(cls, trace_path: str | os.PathLike[str], header_line: bytes,
             file_size: int) -> TraceIndex | None:
        """The index beside ``trace_path`` if it belongs to this trace (same header line) and
        points inside the file; None otherwise."""
        path = index_path(trace_path)
        try:
            f = open(path, "rb")  # noqa: SIM115
        except OSError:
            return None
        blocks: list[Block] = []
        with f:
            try:
                head = json.loads(f.readline())
            except ValueError:
                return None
            if (type(head) is not dict or head.get("format") != INDEX_FORMAT
                    or head.get("version") != INDEX_VERSION
                    or head.get("header_sha1") != header_digest(header_line)):
                return None
            for raw in f:
                if not raw.endswith(b"\n"):
                    break  # a line cut by a killed writer
                head_part = raw.split(b',"rooms":', 1)[0] + b"}"
                try:
                    d = json.loads(head_part)
                    blk = Block(d["b"], d["off"], d["end"], d["seq"], d["n"], float(d["t0"]),
                                float(d["t1"]), b',"state":' in raw)
                except (ValueError, KeyError, TypeError):
                    return None
                if blk.end > file_size or blk.b != len(blocks) + 1:
                    return None
                blocks.append(blk)
        return cls(path, blocks)

    def tail(self) -> Block:
        """A block from the end of the last indexed one to the end of the file (the lines a
        killed writer did not index; none in a complete trace), for ``TraceReader`` spans."""
        last = self.blocks[-1]
        return Block(last.b + 1, last.end, last.end, last.seq + last.n, 0, last.t1, last.t1,
                     False)

    def _scan(self, want: Callable[[dict[str, Any]], Any]) -> Iterable[tuple[Block, Any]]:
        with open(self.path, "rb") as f:
            f.readline()
            for blk, raw in zip(self.blocks, f, strict=False):
                yield blk, want(json.loads(raw))

    def last_block_of_first_rooms(self, n: int) -> int | None:
        """Position of the last block naming any of the first ``n`` rooms to appear (a room
        appears first with its ``RequestArrived``; all rooms first named in the block where the
        count reaches ``n`` are included); None when fewer than ``n`` rooms appear."""
        first: set[int] = set()
        last = None
        for i, (_, rooms) in enumerate(self._scan(lambda d: d["rooms"])):
            if len(first) < n:
                first.update(rooms)
                if len(first) < n:
                    continue
                last = i
            elif not first.isdisjoint(rooms):
                last = i
        return last if len(first) >= n else None

    def room_blocks(self, room: int) -> tuple[int, int] | None:
        """Positions (in ``blocks``) of the first and last block naming ``room``."""
        first = last = None
        for i, (_, rooms) in enumerate(self._scan(lambda d: d["rooms"])):
            if room in rooms:
                first = i if first is None else first
                last = i
        return None if first is None else (first, last)  # type: ignore[return-value]

    def at_time(self, t: float) -> int:
        """Position of the block holding the first line at time >= ``t`` (or the last one)."""
        for i, blk in enumerate(self.blocks):
            if blk.t1 >= t:
                return i
        return max(0, len(self.blocks) - 1)

    def state_before(self, i: int) -> tuple[int, dict[str, Any]]:
        """The latest block at or before position ``i`` that carries a state, and its state."""
        j = i
        while j > 0 and not self.blocks[j].has_state:
            j -= 1
        if not self.blocks[j].has_state:
            return j, {"alloc": {}, "lines": []}
        with open(self.path, "rb") as f:
            f.readline()
            for k, raw in enumerate(f):
                if k == j:
                    return j, json.loads(raw)["state"]
        return j, {"alloc": {}, "lines": []}  # pragma: no cover - checked on load
