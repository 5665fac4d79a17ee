"""The byte layout of a packed batch: how the trace writer hands its records to the encoder.

The writer (``twin.trace.format.TraceWriter``) and a recording runtime append each record to a
``Packer`` as it comes, field by field, through the generated ``twin.trace.packers``; every
thousand items or so the bytes go to the ``RowEncoder`` (``twin.trace.rowenc``), in this process
or in a forked child (``twin.trace.encoder``), which reads them back with a ``Reader`` into the
rows of ``twin.trace.rows`` and writes their lines. Compiled with the core, packing a field is
one native write: no tuple per event, no boxed int per field, no ``marshal`` walk of the batch.

A batch is a sequence of items, each a kind byte (``K_*``) and its body, ending with ``K_END``:

* ``K_TIME`` f64: the time of the items that follow;
* ``K_IN`` node, event; ``K_OUT`` node, n, n events; ``K_INOUT`` node, event, n, n events: an
  input handled on ``node`` (a code: its position in the header's nodes) and the effects it
  returned (``K_INOUT`` with n = 0: it returned none; ``K_IN``: they come in their own item);
* ``K_SYS`` node, i: driver record ``i`` of the batch's side list (``(type, room, record)``);
* ``K_FLUSH``: end the block here; ``K_RESET``: forget the strings defined so far.

An event is its class's row tag (a byte) and its fields in declaration order: ints as i64 (one
beyond i64 as ``-2**63``, then the length and ASCII of its digits), floats as f64 (finite
only), bools as a byte, an optional field as a presence byte and the value, a list as its
length (i64) and its items, a nested message as its tag and fields, a nested target as its
fields, a ``KVPoll`` member as its value. A string is a code (i64) into the strings the
batches defined so far; a new string is ``-1``, its UTF-8 length and bytes, and takes the next
code. Tags and codes mean something only between one packer and the reader of its batches.
"""

from __future__ import annotations

from typing import Any, Final

from librt.strings import (
    BytesWriter,
    read_f64_le,
    read_i64_le,
    write_f64_le,
    write_i64_le,
)
from mypy_extensions import i64

__all__ = ["K_END", "K_FLUSH", "K_IN", "K_INOUT", "K_OUT", "K_RESET", "K_SYS", "K_TIME",
           "STRINGS_KEPT", "Packer", "Reader"]

K_END: Final = 0
K_TIME: Final = 1
K_IN: Final = 2
K_OUT: Final = 3
K_INOUT: Final = 4
K_SYS: Final = 5
K_FLUSH: Final = 6
K_RESET: Final = 7

_SHORT: Final = 2**60
_I64_MAX: Final = 2**63 - 1
_WIDE: Final = -(2**63)
"""An int field's escape: an int beyond i64 (or this one) follows as its decimal digits."""
_WIDE_I64: Final[i64] = -9223372036854775807 - 1
"""``_WIDE`` as an i64 (compared natively; the boxed ``_WIDE`` is converted at every use)."""

_SEEN_MASK: Final = 63

STRINGS_KEPT: Final = 50_000
"""Past this many strings defined, the next batch starts with ``K_RESET`` (a run that names
a new session per request would otherwise grow the table without bound)."""


class Packer:
    """One batch being written, and the state that spans batches (the string codes, the time
    last written, the lines packed so far). Item framing is ``twin.trace.packing``'s; each
    class's fields are the generated ``twin.trace.packers``'."""

    def __init__(self, nodes: list[str], decode: set[str], driver: str) -> None:
        self.node_code: dict[str, int] = {n: i for i, n in enumerate([*nodes, driver])}
        """Node id -> its code (the header's nodes, then ``driver``: driver records only)."""
        self.driver = len(nodes)
        self.decode: set[int] = {self.node_code[n] for n in decode}
        """The decode nodes' codes: their ``RoomConcluded`` effects count as the room's end."""
        self.succeeded: set[int] = set()
        self.failed: set[int] = set()
        """Rooms a decode node concluded with ``Success``, and otherwise."""
        self.w = BytesWriter()
        self.strs: dict[str, int] = {}
        self.fresh: list[str] = []
        """Strings this item defined (forgotten again if the item is rolled back)."""
        self.t = 0.0
        """The time of the last ``K_TIME`` written."""
        self.items = 0
        """Items in this batch."""
        self.lines = 0
        """Trace lines the items packed so far become (every batch)."""
        self.sys: list[Any] = []
        """This batch's driver records: ``(type, room, record)``."""
        self.keep_strings = STRINGS_KEPT
        self._seen: list[Any] = [None] * (_SEEN_MASK + 1)
        self._seen_code: list[int] = [0] * (_SEEN_MASK + 1)
        """String objects lately packed and their codes, by address (a cache of ``strs``)."""

    # -- fields ---------------------------------------------------------------------------------
    def put_tag(self, v: int) -> None:
        self.w.append(v)

    def put_int(self, v: int) -> None:
        if -_SHORT < v < _SHORT or _WIDE < v <= _I64_MAX:  # the first: native compares
            write_i64_le(self.w, v)
        else:  # beyond i64 (a 64-bit unsigned room id): the escape, then its digits
            write_i64_le(self.w, _WIDE)
            self._put_bytes(str(v).encode("ascii"))

    def put_float(self, v: float) -> None:
        if not v - v == 0.0:
            raise ValueError(f"out of range float value {v!r}: traces hold finite numbers only")
        write_f64_le(self.w, v)

    def put_bool(self, v: bool) -> None:
        self.w.append(1 if v else 0)

    def put_str(self, v: str) -> None:
        slot = (id(v) >> 4) & _SEEN_MASK
        if self._seen[slot] is v:  # the same object as lately: its code, no dict lookup
            write_i64_le(self.w, self._seen_code[slot])
            return
        code = self.strs.get(v, -1)
        if code >= 0:
            self._seen[slot] = v
            self._seen_code[slot] = code
            write_i64_le(self.w, code)
            return
        write_i64_le(self.w, -1)
        self._put_bytes(v.encode("utf-8"))
        self.strs[v] = len(self.strs)
        self.fresh.append(v)

    def _put_bytes(self, data: bytes) -> None:
        write_i64_le(self.w, len(data))
        self.w.write(data)

    # -- items ----------------------------------------------------------------------------------
    def time(self, t: float) -> None:
        """Write ``K_TIME`` when ``t`` is not the time last written."""
        if t != self.t:
            if not t - t == 0.0:
                raise ValueError(f"time {t!r} is not finite")
            self.w.append(K_TIME)
            write_f64_le(self.w, t)
            self.t = t

    def rollback(self, size: i64, t: float, lines: int) -> None:
        """Undo an item that failed half-way: the bytes from ``size`` on, the strings it
        defined, the time it wrote."""
        self.w.truncate(size)
        for v in self.fresh:
            del self.strs[v]
            slot = (id(v) >> 4) & _SEEN_MASK
            if self._seen[slot] is v:
                self._seen[slot] = None
        self.fresh.clear()
        self.t = t
        self.lines = lines

    def take(self) -> tuple[bytes, list[Any]]:
        """This batch (its bytes and driver records); the next one starts empty."""
        self.w.append(K_END)
        data = self.w.getvalue()
        sys = self.sys
        self.w = BytesWriter()
        self.sys = []
        self.items = 0
        if len(self.strs) > self.keep_strings:
            self.strs.clear()
            self._seen = [None] * (_SEEN_MASK + 1)
            self.w.append(K_RESET)
        return data, sys


class Reader:
    """Reads one batch of a ``Packer``'s (``strs``: the strings of the batches before, kept by
    the caller and added to here)."""

    def __init__(self, data: bytes, strs: list[str]) -> None:
        self.data = data
        self.pos: i64 = 0
        self.strs = strs

    def get_tag(self) -> int:
        v = self.data[self.pos]
        self.pos += 1
        return v

    def get_int(self) -> int:
        v = read_i64_le(self.data, self.pos)
        self.pos += 8
        if v == _WIDE_I64:
            return int(self._get_bytes().decode("ascii"))
        return v

    def get_float(self) -> float:
        v = read_f64_le(self.data, self.pos)
        self.pos += 8
        return v

    def get_bool(self) -> bool:
        v = self.data[self.pos]
        self.pos += 1
        return v != 0

    def get_str(self) -> str:
        code = read_i64_le(self.data, self.pos)
        self.pos += 8
        if code >= 0:
            return self.strs[code]
        v = self._get_bytes().decode("utf-8")
        self.strs.append(v)
        return v

    def _get_bytes(self) -> bytes:
        n = read_i64_le(self.data, self.pos)
        start = self.pos + 8
        end = start + n
        if n < 0 or end > len(self.data):
            raise ValueError("a packed batch is cut short")
        self.pos = end
        return self.data[start:end]
