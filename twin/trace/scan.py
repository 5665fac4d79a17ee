"""The select reader's fast path over the lines it does not hand on (``TraceReader`` with
``select``, ``twin.trace.format``): compiled with the core by ``twin compile``.

A select reader checks every line's envelope (``format._ENV_RE``: seq, time, node, dir, type)
and counts it, but builds records only of the lines it selects, its driver records and the
lines it meets first. ``LineSkipper.run`` does that check for a run of lines whose envelope is
already known to be neither selected nor a driver record, natively, and stops at the first line
that needs more (a selected or new kind of line, a line the pattern does not match, a seq or
time out of order, a line that may not be whole JSON: the reader then handles it, and raises
what it raises).

A replay's reader (``twin.replay.forked``) also gives the skipper a ``Collector``: the skipper
then turns the input lines it meets into rows itself where it can vouch for them, and hands the
collector the effect lines' payloads, so that the reader builds no record for most lines.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, Final

from mypy_extensions import i64

__all__ = ["NUMBER_RE", "SEP", "Collector", "Kind", "LineSkipper", "is_number", "line_row"]

NUMBER_RE: Final = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?\Z")
"""A JSON number, whole (``format`` checks an envelope's time with it)."""

_SEQ: Final = b'{"seq":'
_QUOTES: Final = 12
"""The quotes of an envelope's node/dir/type text: ``"node":"N","dir":"D","type":"T"``."""
_SEQ_DIGITS: Final = 18
"""A longer seq goes to the reader (the pass counts in i64)."""


def is_number(raw: bytes, p: i64, end: i64) -> bool:
    """Whether ``raw[p:end]`` is a JSON number, whole (as ``NUMBER_RE`` matches)."""
    if p < end and raw[p] == 45:  # -
        p += 1
    if p >= end:
        return False
    c = raw[p]
    if c == 48:  # 0
        p += 1
    elif 49 <= c <= 57:
        p += 1
        while p < end and 48 <= raw[p] <= 57:
            p += 1
    else:
        return False
    if p < end and raw[p] == 46:  # .
        p += 1
        start: i64 = p
        while p < end and 48 <= raw[p] <= 57:
            p += 1
        if p == start:
            return False
    if p < end and (raw[p] == 101 or raw[p] == 69):  # e E
        p += 1
        if p < end and (raw[p] == 43 or raw[p] == 45):  # + -
            p += 1
        start = p
        while p < end and 48 <= raw[p] <= 57:
            p += 1
        if p == start:
            return False
    return p == end


class Kind:
    """A kind of line ``LineSkipper`` knows (by its node/dir/type text): its node, dir and
    type, where its payload starts in that text, whether the reader hands such lines on
    (``wanted``), where the payload goes to ``passed`` from (-1: it does not), whether the
    payload holds objects (``nested``: such a line ends in ``}}`` or ``]}``) and how many it
    passed over or handed on."""

    def __init__(self, node: str, direction: str, rtype: str, body_from_key: int,
                 wanted: bool, at: int, nested: bool = False) -> None:
        self.node = node
        self.direction = direction
        self.rtype = rtype
        self.body_from_key = body_from_key
        self.wanted = wanted
        self.at = at
        self.nested = nested
        self.n = 0


def line_row(raw: bytes, at: int, rtype: str, cache: dict[bytes, tuple[Any, ...]],
             cache_size: int, loads: Callable[[bytes], Any],
             decoders: dict[str, Callable[[dict[str, Any]], tuple[Any, ...] | None]]
             ) -> tuple[Any, ...] | None:
    """The row of the event on line ``raw`` (its payload from ``at``, type ``rtype``) when the
    fast decoder vouches for the line (``decoders``: ``twin.trace.rows.LINE_ROWS``; ``loads``
    parses the line), else None. Rows are kept in ``cache`` by payload text, up to
    ``cache_size`` of them: a frame sent to several ranks, a timer and a transfer completion
    repeat within a few hundred lines."""
    key = raw[at:]
    row = cache.get(key)
    if row is None:
        dec = decoders.get(rtype)
        if dec is None:
            return None
        try:
            d = loads(raw)
        except ValueError:
            return None
        if type(d) is not dict:
            return None
        row = dec(d)
        if row is None:
            return None
        if len(cache) >= cache_size:
            cache.clear()
        cache[key] = row
    return row


SEP: Final = b"\x1e"
"""Ends an input's effect payloads in a batch's text (``Collector``)."""


class Collector:
    """A replay reader's batches: the inputs of the nodes ``replayed`` and the ``followed``
    driver records, as items (``(1, t, node, row)``, ``(2, type, data)``), and the text of the
    effect lines recorded after each input of ``replayed``: its payloads one per line, then a
    line holding only ``SEP`` (JSON text holds no raw control character, so the grouping is
    unambiguous). ``ship()`` is called, to take and ``reset`` the batch, once it holds at least
    ``batch`` inputs and the last input's effects are complete.

    ``take`` turns an input line into its row itself (``line_row`` with ``loads``,
    ``decoders``, ``cache`` and ``cache_size``), or declines: the reader's record then takes the
    line (``add_input``), and raises what it raises. It declines a line whose row it cannot
    vouch for or whose room ``rooms`` does not hold (``room_at``: row tag -> where the room is
    checked, -1 for a tag without the check; a tag missing there is declined)."""

    def __init__(self, replayed: frozenset[str], followed: frozenset[str], batch: int,
                 ship: Callable[[], None], loads: Callable[[bytes], Any],
                 decoders: dict[str, Callable[[dict[str, Any]], tuple[Any, ...] | None]],
                 room_at: dict[int, int], rooms: set[int], partial: bool,
                 cache: dict[bytes, tuple[Any, ...]], cache_size: int) -> None:
        self.replayed = replayed
        self.followed = followed
        self.batch = batch
        self.ship = ship
        self.loads = loads
        self.decoders = decoders
        self.room_at = room_at
        self.rooms = rooms
        self.partial = partial
        self.cache = cache
        self.cache_size = cache_size
        self.items: list[tuple[Any, ...]] = []
        self.text: list[bytes] = []
        self.inputs = 0
        self.node: str | None = None  # of the input whose effect lines come next

    def reset(self) -> None:
        """Start a new batch."""
        self.items = []
        self.text = []
        self.inputs = 0

    def end_input(self) -> bool:
        """The last input's effect lines end here; False when none were being collected."""
        if self.node is None:
            return False
        self.text.append(SEP)
        self.node = None
        return True

    def boundary(self) -> None:
        """A record starts: the last input's effect lines end here, and a full batch ships."""
        if self.end_input() and self.inputs >= self.batch:
            self.ship()

    def add_input(self, t: float, node: str, row: tuple[Any, ...] | None) -> None:
        """An input of ``node`` at ``t``; ``row`` may be None for a node not replayed."""
        self.boundary()
        if node in self.replayed:
            self.node = node
            self.items.append((1, t, node, row))
            self.inputs += 1

    def add_sys(self, rtype: str, data: Any) -> None:
        """A driver record."""
        self.boundary()
        if rtype in self.followed:
            self.items.append((2, rtype, data))

    def effect(self, node: str, body: bytes) -> None:
        """An effect line of ``node``, its payload ``body``."""
        if node == self.node:
            self.text.append(body)

    def take(self, raw: bytes, at: int, node: str, rtype: str, t: float) -> bool:
        """Input line ``raw`` (its payload from ``at``) of ``node``, type ``rtype``, at ``t``,
        its envelope checked: collected (True) or declined (class docstring)."""
        if node not in self.replayed:
            self.add_input(t, node, None)
            return True
        row = line_row(raw, at, rtype, self.cache, self.cache_size, self.loads, self.decoders)
        if row is None:
            return False
        pos = self.room_at.get(row[0], -2)
        if pos == -2:
            return False
        if pos >= 0 and row[pos] not in self.rooms and not self.partial:
            return False
        self.add_input(t, node, row)
        return True


class LineSkipper:
    """Checks and counts runs of lines a select reader passes over (module docstring).

    It passes over lines whose envelope's node/dir/type text (``_ENV_RE``'s third group) was
    ``add``-ed as not wanted (their payload going to ``passed`` where ``Kind.at`` says), and
    stops after a line of a wanted kind, checked and counted: ``hit`` is then its kind and
    ``hit_at`` where its payload starts in the line (None when it stopped otherwise).
    ``add_counts`` adds how many of each kind it met to a reader's count by that text.

    With a ``collector``, the payloads go to it instead of ``passed``, and it passes over an
    input line of a wanted kind as well when the collector takes it (``Collector.take``)."""

    def __init__(self, passed: Callable[[str, bytes], None] | None,
                 collector: Collector | None = None) -> None:
        self.skip: dict[bytes, Kind] = {}
        self.passed = passed
        self.collector = collector
        self.last_t = 0.0
        self.last_tb = b""
        self.hit: Kind | None = None
        self.hit_at = 0

    def add(self, key: bytes, kind: Kind) -> None:
        """Know lines of node/dir/type text ``key`` from now on."""
        self.skip[key] = kind

    def add_counts(self, by_key: dict[bytes, int]) -> None:
        """Add the lines passed over to ``by_key`` (node/dir/type text -> lines)."""
        for key, kind in self.skip.items():
            if kind.n:
                by_key[key] = by_key.get(key, 0) + kind.n
                kind.n = 0

    def run(self, lines: list[bytes], i: int, lineno: int, last_t: float,
            last_tb: bytes) -> int:
        """Pass over ``lines[i:]`` (``lines[i]`` being line ``lineno + 1``, the line before at
        time ``last_t``, written ``last_tb``) while each is such a line, up to a line of a
        wanted kind included; the index after the last line taken (``len(lines)`` at the end).
        ``last_t``/``last_tb`` are then the last line's."""
        skip = self.skip
        passed = self.passed
        collector = self.collector
        self.hit = None
        n_lines = len(lines)
        # positions, digits and counts in i64: compiled, plain machine arithmetic
        want_seq: i64 = lineno - 1
        while i < n_lines:
            raw = lines[i]
            size: i64 = len(raw)
            if not raw.startswith(_SEQ):
                break
            p: i64 = 7
            seq: i64 = 0
            end: i64 = min(size, 7 + _SEQ_DIGITS)
            while p < end:
                c: i64 = raw[p]
                if c < 48 or c > 57:
                    break
                seq = seq * 10 + (c - 48)
                p += 1
            # ',"t":' (p == 7: no digits, a line for the reader to reject)
            if (p == 7 or seq != want_seq or p + 5 >= size or raw[p] != 44
                    or raw[p + 1] != 34 or raw[p + 2] != 116 or raw[p + 3] != 34
                    or raw[p + 4] != 58):
                break
            p += 5
            t0: i64 = p
            while p < size:
                c = raw[p]
                # [-+.0-9eE]
                if not (48 <= c <= 57 or c == 46 or c == 45 or c == 43 or c == 101 or c == 69):
                    break
                p += 1
            if p == t0 or p >= size or raw[p] != 44:
                break
            t1: i64 = p
            k0: i64 = p + 1
            # The key runs to its twelfth quote. Taken as it stands, it is one the reader has
            # matched against the envelope pattern already (``skip``), or the line goes back to
            # the reader: so the line matches the pattern exactly when it is found.
            quotes: i64 = 0
            p = k0
            while p < size:
                if raw[p] == 34:
                    quotes += 1
                    if quotes == _QUOTES:
                        break
                p += 1
            p += 1
            if quotes != _QUOTES or p >= size or (raw[p] != 44 and raw[p] != 125):  # [,}]
                break
            kind = skip.get(raw[k0:p])
            if kind is None:
                break
            # a line as the writer writes it ends in '}' (with an object inside, in '}}' or
            # ']}'; ``format.TraceReader._whole``); a line cut short cannot, and goes to the
            # reader, as does any other (which parses it)
            if raw[size - 1] != 125 or (kind.nested and raw[size - 2] != 125
                                         and raw[size - 2] != 93):
                break
            t_b = raw[t0:t1]
            if t_b != last_tb:
                if not is_number(raw, t0, t1):
                    break
                t = float(t_b)
                if not t >= last_t or not math.isfinite(t):
                    break
                last_t = t
                last_tb = t_b
            want_seq += 1
            kind.n += 1
            i += 1
            if kind.wanted:
                if (collector is not None and kind.direction == "in" and collector.take(
                        raw, k0 + kind.body_from_key, kind.node, kind.rtype, last_t)):
                    continue
                self.hit = kind
                self.hit_at = k0 + kind.body_from_key
                break
            if kind.at >= 0:
                if collector is not None:
                    collector.effect(kind.node, raw[k0 + kind.at:size - 1])
                elif passed is not None:
                    passed(kind.node, raw[k0 + kind.at:size - 1])
        self.last_t = last_t
        self.last_tb = last_tb
        return i
