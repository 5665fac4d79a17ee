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
latest watermark, each prefill node's newest watermark and first STAGING_REQ per session),
as the encoder's ``twin.trace.rowenc.LiveState`` keeps them.

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

__all__ = ["INDEX_SUFFIX", "Block", "IndexWriter", "TraceIndex", "index_path"]

INDEX_FORMAT = "staging-twin-trace-index"
INDEX_VERSION = 1
INDEX_SUFFIX = ".idx"
STATE_EVERY = 16


def index_path(trace_path: str | os.PathLike[str]) -> Path:
    """Where the index of ``trace_path`` lives."""
    return Path(f"{os.fspath(trace_path)}{INDEX_SUFFIX}")


def header_digest(header_line: bytes) -> str:
    return hashlib.sha1(header_line.rstrip(b"\n")).hexdigest()


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
