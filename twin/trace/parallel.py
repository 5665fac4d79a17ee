"""An indexed trace's select scan in two processes (``twin trace summary``).

A select reader (``TraceReader(select=...)``) spends nearly all its time checking every line's
envelope. The index makes the blocks independent, so ``ParallelScan`` splits them in groups
and forks one helper that reads every other group (``OWN_EVERY``) with its own span
readers (``TraceReader.part``, every check the sequential reader makes) and sends back, group
by group and in order, the records they select and their line counts; this process reads the
remaining groups itself and yields everything in trace order. Memory stays flat: the helper
waits on a full pipe.

The seams between groups are checked too (each group starts with the seq and time its
predecessor ended with; its lines add up to the index's count; a room is introduced once; no
line after the ``Outcome``). Anything amiss, a stale index included, raises ``Fallback``, and
the caller reads the trace sequentially instead: errors and their line numbers are always the
sequential reader's.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
from collections import Counter
from collections.abc import Container, Iterator
from pathlib import Path
from typing import Any

import msgspec

from twin.trace.encoder import can_fork, open_pipe, read_frame, write_frame
from twin.trace.format import Record, TraceReader
from twin.trace.index import Block, TraceIndex, index_path

__all__ = ["Fallback", "ParallelScan", "parallel_scan"]

_pack = msgspec.msgpack.Encoder().encode
_unpack = msgspec.msgpack.Decoder().decode
"""The helper's messages to its parent, as msgpack (plain values: tuples come back as lists)."""

GROUP_BLOCKS = 4
"""Blocks per group (about 4,000 lines)."""
OWN_EVERY = 2
"""This process reads every other group (and builds and hands on every selected record)."""
MIN_BLOCKS = 4 * GROUP_BLOCKS * OWN_EVERY
"""Fewer blocks than this are read sequentially (forking would cost more than it saves)."""


_DRIVER_ONLY: frozenset[str] = frozenset()


class Fallback(Exception):  # noqa: N818 - a signal to the caller, not an error
    """The parallel scan cannot vouch for what it read: read the trace sequentially."""


def parallel_scan(path: str | os.PathLike[str], select: Container[str], *,
                  first_rooms: int | None = None) -> ParallelScan | None:
    """A ``ParallelScan`` of the trace file ``path``, or None where one does not pay or
    cannot run (no usable index, a short trace, no ``fork``, other threads running).

    With ``first_rooms`` the caller needs the selected records only of the first
    ``first_rooms`` rooms to arrive (the summary's table): past the last block the index says
    names one of them, only driver records are yielded (every line is still read, checked and
    counted)."""
    if not can_fork() or not index_path(path).exists():  # no header read for nothing
        return None
    head = TraceReader(path, lazy=True)
    head.close()
    index = TraceIndex.load(path, head.header_line, os.path.getsize(path))
    if index is None or len(index.blocks) < MIN_BLOCKS or not _contiguous(index.blocks):
        return None
    return ParallelScan(head, index, select, first_rooms)


def _contiguous(blocks: list[Block]) -> bool:
    """The index's blocks follow one another in bytes, seq and time."""
    return all(b.off == a.end and b.seq == a.seq + a.n and b.t0 >= a.t1 and b.n > 0
               for a, b in zip(blocks, blocks[1:]))  # noqa: B905 - one shorter


class ParallelScan:
    """A select reader's records and, after iteration, its ``counts``, ``first_t``, ``last_t``,
    ``outcome``, ``truncated`` and ``warnings``, read in two processes (module docstring).
    Iterating raises ``Fallback`` when the result cannot be trusted."""

    def __init__(self, head: TraceReader, index: TraceIndex, select: Container[str],
                 first_rooms: int | None = None) -> None:
        self.path: Path = head.path
        self.name = head.name
        self.header_line = head.header_line
        self.header = head.header
        self.config = head.config
        self.nodes = head.nodes
        self.select = select
        self.counts: Counter[tuple[str, str, str]] = Counter()
        self.first_t: float | None = None
        self.last_t: float | None = None
        self.outcome: dict[str, Any] | None = None
        self.truncated = False
        self.warnings: list[str] = []
        self.rooms = head.rooms
        """Rooms introduced so far; the records' own lazy checks (``Record.event``) read them
        through their source, the header reader (its payload caches too)."""
        self._head = head
        self._blocks = blocks = index.blocks
        self._tail = index.tail()
        self._groups = [blocks[i:i + GROUP_BLOCKS] for i in range(0, len(blocks), GROUP_BLOCKS)]
        last = None if first_rooms is None else index.last_block_of_first_rooms(first_rooms)
        self._full_groups = len(self._groups) if last is None else last // GROUP_BLOCKS + 1
        """Groups read with ``select``; the later ones yield driver records only."""
        self._started = False
        self.helper_pid: int | None = None
        """The helper process while iterating (reaped when the iteration ends or is closed)."""

    def __iter__(self) -> Iterator[Record]:
        if self._started:
            raise RuntimeError("a ParallelScan can be iterated once")
        self._started = True
        return self._records()

    # -- this process ------------------------------------------------------------------------
    def _records(self) -> Iterator[Record]:
        r, w = open_pipe()
        pid = os.fork()
        if pid == 0:  # the helper: never returns
            os.close(r)
            self._helper(w)
        self.helper_pid = pid
        os.close(w)
        src = os.fdopen(r, "rb")
        finished = False
        try:
            last_t = 0.0
            for g, group in enumerate(self._groups):
                if self.outcome is not None:
                    raise Fallback("lines after the Outcome record")
                if g % OWN_EVERY == 0:
                    part = self._head.part((group[0], group[-1]), select=self._select(g))
                    for rec in part:
                        self._sys(rec)
                        rec._src = self._head
                        yield rec
                    got = (part.counts, part.first_t, part.last_t, part.truncated,
                           part.warnings)
                else:
                    recs, counts, first_t, last_t_g, truncated, warnings = self._receive(src)
                    for rec in self._rebuild(recs):
                        self._sys(rec)
                        yield rec
                    got = (Counter({(n, d, t): k for n, d, t, k in counts}), first_t, last_t_g,
                           truncated, warnings)
                last_t = self._seam(group, got, last_t)
            finished = True
            ended = self.outcome is not None
            tail = self._head.part((self._tail, None), select=self.select)
            for rec in tail:
                self._sys(rec)
                rec._src = self._head
                yield rec
            if tail.first_t is not None and (tail.first_t < last_t or ended):
                raise Fallback("the tail does not follow the indexed blocks")
            self.counts.update(tail.counts)
            if tail.last_t is not None:
                self.last_t = tail.last_t
            self.truncated = tail.truncated
            self.warnings += tail.warnings
            if self.outcome is None:
                self.warnings.append(f"{self.name}: no Outcome record: trace is incomplete")
        except Fallback:
            raise
        except Exception as exc:  # a TraceError, an I/O error: the sequential reader says
            raise Fallback(str(exc)) from exc
        finally:
            src.close()
            if not finished:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)

    def _select(self, g: int) -> Container[str]:
        return self.select if g < self._full_groups else _DRIVER_ONLY

    def _seam(self, group: list[Block], got: tuple[Any, ...], last_t: float) -> float:
        """Merge one group's counts and times; check it carries on from the one before."""
        counts, first_t, group_last_t, truncated, warnings = got
        if (truncated or warnings or first_t is None or first_t < last_t
                or sum(counts.values()) != sum(b.n for b in group)):
            raise Fallback(f"block {group[0].b}: not as the index describes it")
        self.counts.update(counts)
        if self.first_t is None:
            self.first_t = first_t
        self.last_t = group_last_t
        return group_last_t  # type: ignore[no-any-return]

    def _sys(self, rec: Record) -> None:
        """The checks on driver records that need the whole trace (a part reader cannot)."""
        if rec.dir != "sys":
            return
        if self.outcome is not None:
            raise Fallback("a line after the Outcome record")
        if rec.type == "RequestArrived":
            room = rec.data["room"]
            if room in self.rooms:
                raise Fallback(f"room {room} introduced twice")
            self.rooms.add(room)
        elif rec.type == "Outcome":
            self.outcome = rec.data

    def _receive(self, src: Any) -> Any:
        payload = read_frame(src)
        if payload is None:
            raise Fallback("the helper ended early")
        msg = _unpack(payload)
        if msg[0] != "ok":
            raise Fallback(f"the helper failed: {msg[1]}")
        return msg[1:]

    def _rebuild(self, recs: list[tuple[Any, ...]]) -> Iterator[Record]:
        for r in recs:
            if r[0]:  # a driver record: (1, seq, t, node, type, data)
                _, seq, t, node, rtype, data = r
                yield Record(seq, t, node, "sys", rtype, data, None, seq + 2)
            else:  # (0, seq, t, node, dir, type, raw, body_at)
                _, seq, t, node, direction, rtype, raw, body_at = r
                yield Record(seq, t, node, direction, rtype, None, None, seq + 2, raw, body_at,
                             self._head)

    # -- the helper --------------------------------------------------------------------------
    def _helper(self, w: int) -> None:
        code = 0
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides
            gc.freeze()
            for g, group in enumerate(self._groups):
                if g % OWN_EVERY == 0:
                    continue
                try:
                    part = self._head.part((group[0], group[-1]), select=self._select(g))
                    recs = [(1, rec.seq, rec.t, rec.node, rec.type, rec.data)
                            if rec.dir == "sys" else
                            (0, rec.seq, rec.t, rec.node, rec.dir, rec.type, rec.raw,
                             rec._body_at) for rec in part]
                    msg: tuple[Any, ...] = (
                        "ok", recs, [(*k, n) for k, n in part.counts.items()], part.first_t,
                        part.last_t, part.truncated, part.warnings)
                except Exception as exc:  # noqa: BLE001 - the parent falls back
                    msg = ("error", f"{type(exc).__name__}: {exc}")
                write_frame(w, _pack(msg))
                if msg[0] != "ok":
                    break
        except BaseException:  # noqa: BLE001 - a closed pipe: the parent is done with us
            code = 1
        finally:
            os._exit(code)
