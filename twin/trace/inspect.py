"""Terminal views of traces: ``summary``, ``room_timeline``, ``diff`` and ``first_divergence``.

Every function takes a trace as a path (read once, streamed, in order), an open
``TraceReader`` or an in-memory ``Trace`` (``read_trace``), and returns plain text (lines of at
most about 100 columns; long event text is cut with ``...``). Times are shown in milliseconds.
Memory holds what a view shows (the first ``max_rooms`` rooms of a summary, one room's lines,
``context`` lines of a diff), never the whole trace. ``room_timeline`` of an indexed trace file
reads only the blocks that name the room (``twin.trace.index``).
"""

from __future__ import annotations

import json
import os
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from twin.trace.format import DRIVER, Record, Trace, TraceReader, TraceSource, open_trace

__all__ = ["DiffResult", "compare", "diff", "event_text", "first_divergence", "room_timeline",
           "room_timeline_of_file", "summary", "summary_of_file"]

WIDTH = 100
_IGNORED_HEADER_KEYS = frozenset({"created", "software"})


def _ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.3f}"


def _cut(text: str, width: int = WIDTH) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _value_text(value: Any) -> str:
    if isinstance(value, dict):
        kind = value.get("kind") or value.get("type")
        inner = " ".join(f"{k}={_value_text(v)}" for k, v in value.items()
                         if k not in ("kind", "type"))
        return f"{kind}({inner})"
    if isinstance(value, list):
        return "[" + ",".join(_value_text(v) for v in value) + "]"
    if isinstance(value, str):
        return value if value and " " not in value else json.dumps(value)
    return json.dumps(value)


def event_text(rec: Record, omit: Iterable[str] = ()) -> str:
    """Compact one-line text of a record's payload: ``Type field=value ...``."""
    skip = {"type", *omit}
    parts = [rec.type]
    parts += [f"{k}={_value_text(v)}" for k, v in rec.data.items() if k not in skip]
    return " ".join(parts)


def _room_of(rec: Record) -> int | None:
    room = rec.data.get("room")
    if room is None:
        msg = rec.data.get("msg")
        if isinstance(msg, dict):
            room = msg.get("room")
    return room if isinstance(room, int) else None


def _status(src: Trace | TraceReader) -> str:
    return src.outcome["status"] if src.outcome is not None else "incomplete"


def _path(src: Trace | TraceReader) -> str:
    return src.path if isinstance(src, Trace) else src.name


# ---------------------------------------------------------------------------------------------
# summary
# ---------------------------------------------------------------------------------------------
def _config_line(src: Trace | TraceReader) -> str:
    c = src.config
    side = lambda s: (f"tp{s.tp_size}" + (f" dp{s.dp_size}" if s.dp_size > 1 else "")  # noqa: E731
                      + (f" x{s.instances}" if s.instances > 1 else ""))
    return (f"config: prefill {side(c.prefill)}, decode {side(c.decode)}, ring {c.ring_bytes} B, "
            f"chunked_prefill_size {c.chunked_prefill_size}, page_size {c.page_size}, "
            f"queues {c.transfer_queue_size}")


def _table(headers: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    out = [indent + "  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                              for i, (h, w) in enumerate(zip(headers, widths, strict=True)))]
    for r in rows:
        out.append(indent + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                      for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    return out


def _conclusion(entries: list[tuple[float, str]], expected: int) -> str:
    if not entries:
        return "-"
    failed = [t for t, s in entries if s != "Success"]
    if failed:
        return f"Failed@{_ms(min(failed))}"
    mark = "" if len(entries) >= expected else f" ({len(entries)}/{expected})"
    return f"Success@{_ms(max(t for t, _ in entries))}{mark}"


_SUMMARY_TYPES = frozenset({"StartTransfer", "ScatterDone", "Deferred", "RoomConcluded"})


@dataclass
class _RoomRow:
    arrival: float
    n_prefill: int
    n_decode: int
    first_xfer: float | None = None
    last_scatter: float | None = None
    deferrals: int = 0

    def __post_init__(self) -> None:
        self.prefill: list[tuple[float, str]] = []
        self.decode: list[tuple[float, str]] = []


def summary(trace: TraceSource, *, max_rooms: int = 200) -> str:
    """Header facts, outcome, event counts by type and node, and a per-room timing table (the
    first ``max_rooms`` rooms to arrive)."""
    if isinstance(trace, (Trace, TraceReader)):
        return _summary(trace, max_rooms)
    return summary_of_file(trace, max_rooms=max_rooms)[0]


def summary_of_file(path: str | os.PathLike[str], *, max_rooms: int = 200
                    ) -> tuple[str, list[str]]:
    """``summary`` of a trace file and the reader's warnings. A file with an index is scanned
    in two processes (``twin.trace.parallel``) when that pays; whatever that scan cannot
    vouch for is read again sequentially, so the text is the same either way."""
    from twin.trace.parallel import Fallback, parallel_scan

    scan = parallel_scan(path, _SUMMARY_TYPES, first_rooms=max_rooms)
    if scan is not None:
        try:
            return _summary(scan, max_rooms), scan.warnings
        except Fallback:
            pass
    reader = TraceReader(path, select=_SUMMARY_TYPES)
    return _summary(reader, max_rooms), reader.warnings


def _summary(src: Any, max_rooms: int) -> str:
    roles_of = {nid: n["role"] for nid, n in src.nodes.items()}
    rooms: dict[int, _RoomRow] = {}
    more_rooms = 0
    counts: Counter[tuple[str, str, str]] = Counter()
    in_memory = isinstance(src, Trace)
    first_t = last_t = None
    n_events = 0
    for r in src:
        if in_memory:
            counts[(r.node, r.dir, r.type)] += 1
            first_t = r.t if first_t is None else first_t
            last_t = r.t
            n_events += 1
        rtype = r.type
        if rtype == "RequestArrived":
            d = r.data
            if len(rooms) < max_rooms:
                rooms[d["room"]] = _RoomRow(r.t, len(d["prefill_node"]), len(d["decode_node"]))
            else:
                more_rooms += 1
            continue
        if rtype not in _SUMMARY_TYPES:
            continue
        d = r.data
        row = rooms.get(d.get("room"))  # type: ignore[arg-type]
        if row is None:
            continue
        if rtype == "StartTransfer":
            if row.first_xfer is None:
                row.first_xfer = r.t
        elif rtype == "ScatterDone":
            row.last_scatter = r.t
        elif rtype == "Deferred":
            row.deferrals += 1
        elif rtype == "RoomConcluded":
            (row.prefill if roles_of[r.node] == "prefill" else row.decode).append(
                (r.t, d["status"]))
    if not in_memory:
        counts = src.counts  # type: ignore[union-attr]
        first_t, last_t = src.first_t, src.last_t  # type: ignore[union-attr]
        n_events = sum(counts.values())

    h = src.header
    truncated = src.truncated
    complete = src.outcome is not None and not truncated
    state = "complete" if complete else ("truncated" if truncated else "incomplete")
    roles = Counter(roles_of.values())
    span = (last_t - first_t) if first_t is not None and last_t is not None else 0.0
    lines = [
        f"trace: {_path(src)}",
        f"mode {h['mode']}, format v{h['version']}, seed {h.get('seed')}, {state}, "
        f"status {_status(src)}",
        _cut(_config_line(src)),
        _cut(f"defects: {', '.join(h['defects']) or 'none'}; faults: "
             f"{', '.join(h['faults']) or 'none'}"),
        f"nodes: {len(src.nodes)} ({roles['prefill']} prefill, {roles['decode']} decode); "
        f"events: {n_events} over {_ms(span)} ms",
    ]
    o = src.outcome
    if o is not None:
        lines.append(f"outcome: {o['status']}: {o['completed']}/{o['requests']} completed, "
                     f"{o['failed']} failed")
        lines += [_cut(f"  diagnosis: {d}") for d in o["diagnosis"]]
        lines += [_cut(f"  corruption: {c}") for c in o["corruption"]]
    else:
        lines.append("outcome: none (the trace has no Outcome record)")
    lines += [_cut(f"warning: {w}") for w in src.warnings]

    # counts by type and node (by role when there are many nodes)
    many = len(src.nodes) > 6
    column = dict(roles_of) if many else {nid: nid for nid in src.nodes}
    column[DRIVER] = DRIVER
    cols = list(dict.fromkeys(column[n] for n in (*src.nodes, DRIVER)))
    by_type: dict[str, Counter[str]] = {}
    dir_of: dict[str, str] = {}
    for (node, direction, rtype), n in counts.items():
        by_type.setdefault(rtype, Counter())[column[node]] += n
        dir_of.setdefault(rtype, direction)
    used = [c for c in cols if any(by_type[t][c] for t in by_type)]
    rows = [[f"{t} ({dir_of[t]})", str(sum(c.values())), *(str(c[k] or "") for k in used)]
            for t, c in sorted(by_type.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))]
    lines += ["", "events by type:"] + _table(["type", "total", *used], rows)

    if rooms:
        lines += ["", "rooms (times in ms):"]
        table = [[str(room), _ms(x.arrival), _ms(x.first_xfer), _ms(x.last_scatter),
                  _conclusion(x.decode, x.n_decode), _conclusion(x.prefill, x.n_prefill),
                  str(x.deferrals)] for room, x in rooms.items()]
        lines += _table(["room", "arrival", "1st transfer", "last scatter", "decode", "prefill",
                         "deferrals"], table)
        if more_rooms:
            lines.append(f"  ... {more_rooms} more rooms")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# room timeline
# ---------------------------------------------------------------------------------------------
def _room_source(source: TraceSource, room: int) -> tuple[Trace | TraceReader, Iterable[Record]]:
    """A reader of ``source`` and the records to look at for ``room``: with a trace file's
    index, only the blocks from the first to one past the last naming the room (and any tail
    the index does not cover yet); otherwise everything."""
    if isinstance(source, (Trace, TraceReader)):
        return source, source
    from twin.trace.index import TraceIndex

    head = TraceReader(source, lazy=True)
    head.close()
    index = TraceIndex.load(source, head.header_line, os.path.getsize(source))
    if index is None or not index.blocks:
        full = TraceReader(source, lazy=True)
        return full, full
    blocks = index.blocks
    tail = index.tail()
    found = index.room_blocks(room)
    if found is None:
        first_blk, end_blk = tail, None
    else:
        first, last = found
        first_blk = blocks[first]
        end_blk = blocks[last + 1] if last + 1 < len(blocks) - 1 else None
    part = head.part((first_blk, end_blk))
    return part, part


def room_timeline(trace: TraceSource, room: int, *, width: int = WIDTH) -> str:
    """Every record about ``room`` on every node, in trace order, one line each.

    Besides records naming the room (directly or in a message), a transfer's ``TransferDone``
    and a deferral's ``WorkerPoll`` are shown when the worker was busy with or waiting on
    ``room``, and so is any input whose effects include a record about the room.
    """
    src, records = _room_source(trace, room)
    return _room_timeline(src, records, room, width)


def room_timeline_of_file(path: str | os.PathLike[str], room: int, *, width: int = WIDTH
                          ) -> tuple[str, list[str]]:
    """``room_timeline`` of a trace file and the warnings of the reader it read with (a
    trace cut short: the room may go on past the cut)."""
    src, records = _room_source(path, room)
    return _room_timeline(src, records, room, width), src.warnings


def _room_timeline(src: Trace | TraceReader, records: Iterable[Record], room: int,
                   width: int) -> str:
    busy: dict[tuple[str, int], int] = {}
    unshown: dict[str, Record] = {}  # each node's last input, while not yet shown
    lines = [f"room {room} in {_path(src)} (times in ms)"]
    found = False
    needles = (b'"room":%d,' % room, b'"room":%d}' % room)

    def show(r: Record) -> None:
        d = r.data
        text = event_text(r, omit=("room",) if _room_of(r) == room and "room" in d else ())
        arrow = {"in": "<-", "out": "->", "sys": "**"}[r.dir]
        lines.append(_cut(f"{_ms(r.t):>10}  {r.node:<7} {arrow} {text}", width))

    for r in records:
        raw = r.raw
        rtype = r.type
        if raw is not None and rtype not in _WORKER_TYPES and not (
                needles[0] in raw or needles[1] in raw):
            about = False  # the line names no such room (a cheap test on the raw text)
        else:
            d = r.data
            about = _room_of(r) == room
            if rtype in _WORKER_TYPES:
                key = (r.node, d.get("worker", -1))
                if rtype in ("StartTransfer", "Deferred"):
                    busy[key] = d["room"]
                elif busy.get(key) == room:
                    about = True
                    del busy[key]
        if r.dir == "in":
            unshown.pop(r.node, None)
            if not about:
                unshown[r.node] = r
                continue
        if not about:
            continue
        if r.dir == "out" and r.node in unshown:  # the input that caused this effect
            show(unshown.pop(r.node))
        found = True
        show(r)
    if isinstance(src, TraceReader):
        src.close()
    if not found:
        lines.append("  (no records" + (" up to where the trace ends early)" if src.truncated
                                        else ")"))
    if src.truncated:  # the room may go on past the cut: say so, as the summary does
        lines += [_cut(f"warning: {w}", width) for w in src.warnings]
    return "\n".join(lines) + "\n"


_WORKER_TYPES = frozenset({"StartTransfer", "Deferred", "TransferDone", "WorkerPoll"})


# ---------------------------------------------------------------------------------------------
# diff
# ---------------------------------------------------------------------------------------------
def _line(rec: Record | None) -> str | None:
    if rec is None:
        return None
    return f"#{rec.seq} t={_ms(rec.t)}ms {rec.node} {rec.dir} {event_text(rec)}"


def _same(a: Record, b: Record, t_tol: float) -> bool:
    return (a.node == b.node and a.dir == b.dir and abs(a.t - b.t) <= t_tol
            and (a.body == b.body or a.data == b.data))


def first_divergence(a: TraceSource, b: TraceSource, *, t_tol: float = 1e-9
                     ) -> tuple[int, str | None, str | None] | None:
    """The first event index where ``a`` and ``b`` differ, with each side's line (``None``
    where that trace has already ended); ``None`` when the event sequences agree.

    Events agree when node, direction and payload are equal and times differ by at most
    ``t_tol`` seconds. The traces are read side by side and only up to the divergence.
    """
    ia, ib = iter(open_trace(a)), iter(open_trace(b))
    i = 0
    while True:
        ra, rb = next(ia, None), next(ib, None)
        if ra is None and rb is None:
            return None
        if ra is None or rb is None or not _same(ra, rb, t_tol):
            return i, _line(ra), _line(rb)
        i += 1


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def _header_diff(a: Trace | TraceReader, b: Trace | TraceReader) -> list[str]:
    fa = _flatten({k: v for k, v in a.header.items() if k not in _IGNORED_HEADER_KEYS})
    fb = _flatten({k: v for k, v in b.header.items() if k not in _IGNORED_HEADER_KEYS})
    out = []
    for key in sorted(set(fa) | set(fb)):
        va, vb = fa.get(key, "<absent>"), fb.get(key, "<absent>")
        if va != vb:
            out.append(_cut(f"  {key}: {json.dumps(va)} != {json.dumps(vb)}"))
    return out


@dataclass
class DiffResult:
    """What ``compare`` found: ``text`` (as ``diff`` prints it) and the first divergence
    (``(index, line a, line b)``, or None when the event sequences agree)."""

    text: str
    divergence: tuple[int, str | None, str | None] | None

    @property
    def diverged(self) -> bool:
        return self.divergence is not None


def compare(a: TraceSource, b: TraceSource, *, t_tol: float = 1e-9,
            context: int = 3) -> DiffResult:
    """Walk ``a`` and ``b`` side by side once: header (without ``created``/``software``),
    first divergent event with ``context`` agreeing events before it, per-type count
    differences, outcomes."""
    sa, sb = open_trace(a), open_trace(b)
    ia, ib = iter(sa), iter(sb)
    before: deque[Record] = deque(maxlen=context)
    ca: Counter[str] = Counter()
    cb: Counter[str] = Counter()
    div: tuple[int, str | None, str | None] | None = None
    max_dt = 0.0
    i = 0
    while True:
        ra, rb = next(ia, None), next(ib, None)
        if ra is None and rb is None:
            break
        if ra is not None:
            ca[ra.type] += 1
        if rb is not None:
            cb[rb.type] += 1
        if div is None:
            if ra is None or rb is None or not _same(ra, rb, t_tol):
                div = (i, _line(ra), _line(rb))
                last = list(before)
            else:
                max_dt = max(max_dt, abs(ra.t - rb.t))
                if context:
                    before.append(ra)
        i += 1
    na, nb = sum(ca.values()), sum(cb.values())
    lines = [f"a: {_path(sa)} ({_status(sa)}, {na} events)",
             f"b: {_path(sb)} ({_status(sb)}, {nb} events)"]
    header = _header_diff(sa, sb)
    lines += ["header: identical"] if not header else ["header differs:", *header]
    if div is None:
        lines.append(f"events: identical (time tolerance {t_tol:g} s)")
    else:
        index, la, lb = div
        lines.append(f"events: first divergence at event #{index} (line {index + 2}; "
                     f"time tolerance {t_tol:g} s)")
        for r in last:
            lines.append(_cut(f"    {_line(r)}"))
        lines.append(_cut(f"  a {la if la is not None else '<trace ended>'}"))
        lines.append(_cut(f"  b {lb if lb is not None else '<trace ended>'}"))
    if max_dt > 0:
        lines.append(f"max time difference before the divergence: {max_dt:.3g} s")
    rows = [[t, str(ca[t]), str(cb[t]), f"{cb[t] - ca[t]:+d}"]
            for t in sorted(set(ca) | set(cb)) if ca[t] != cb[t]]
    if rows:
        lines += ["counts that differ:", *_table(["type", "a", "b", "b-a"], rows)]
    else:
        lines.append("counts by type: identical")
    oa, ob = sa.outcome, sb.outcome
    if oa == ob:
        lines.append(f"outcome: identical ({_status(sa)})")
    else:
        lines.append("outcome differs:")
        keys = sorted(set(oa or {}) | set(ob or {}))
        for k in keys:
            va, vb = (oa or {}).get(k, "<absent>"), (ob or {}).get(k, "<absent>")
            if va != vb:
                lines.append(_cut(f"  {k}: {json.dumps(va)} != {json.dumps(vb)}"))
    return DiffResult("\n".join(lines) + "\n", div)


def diff(a: TraceSource, b: TraceSource, *, t_tol: float = 1e-9, context: int = 3) -> str:
    """Human-readable comparison (``compare(a, b).text``)."""
    return compare(a, b, t_tol=t_tol, context=context).text
