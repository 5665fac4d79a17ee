"""Terminal views of traces: ``summary``, ``room_timeline``, ``diff`` and ``first_divergence``.

All functions take ``Trace`` objects (``read_trace``) and return plain text (lines of at most
about 100 columns; long event text is cut with ``...``). Times are shown in milliseconds.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from twin.trace.format import DRIVER, Record, Trace

__all__ = ["diff", "event_text", "first_divergence", "room_timeline", "summary"]

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


# ---------------------------------------------------------------------------------------------
# summary
# ---------------------------------------------------------------------------------------------
def _config_line(trace: Trace) -> str:
    c = trace.config
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


def summary(trace: Trace, *, max_rooms: int = 200) -> str:
    """Header facts, outcome, event counts by type and node, and a per-room timing table."""
    h = trace.header
    ev = trace.events
    state = "complete" if trace.complete else ("truncated" if trace.truncated else "incomplete")
    roles = Counter(n["role"] for n in trace.nodes.values())
    span = ev[-1].t - ev[0].t if ev else 0.0
    lines = [
        f"trace: {trace.path}",
        f"mode {h['mode']}, format v{h['version']}, seed {h.get('seed')}, {state}, "
        f"status {trace.status}",
        _cut(_config_line(trace)),
        _cut(f"defects: {', '.join(h['defects']) or 'none'}; faults: "
             f"{', '.join(h['faults']) or 'none'}"),
        f"nodes: {len(trace.nodes)} ({roles['prefill']} prefill, {roles['decode']} decode); "
        f"events: {len(ev)} over {_ms(span)} ms",
    ]
    o = trace.outcome
    if o is not None:
        lines.append(f"outcome: {o['status']}: {o['completed']}/{o['requests']} completed, "
                     f"{o['failed']} failed")
        lines += [_cut(f"  diagnosis: {d}") for d in o["diagnosis"]]
        lines += [_cut(f"  corruption: {c}") for c in o["corruption"]]
    else:
        lines.append("outcome: none (the trace has no Outcome record)")
    lines += [_cut(f"warning: {w}") for w in trace.warnings]

    # counts by type and node (by role when there are many nodes)
    many = len(trace.nodes) > 6
    column = ({nid: n["role"] for nid, n in trace.nodes.items()} if many
              else {nid: nid for nid in trace.nodes})
    column[DRIVER] = DRIVER
    cols = list(dict.fromkeys(column[n] for n in (*trace.nodes, DRIVER)))
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    for r in ev:
        counts[r.type][column[r.node]] += 1
    used = [c for c in cols if any(counts[t][c] for t in counts)]
    rows = [[f"{t} ({_dir_of(ev, t)})", str(sum(c.values())), *(str(c[k] or "") for k in used)]
            for t, c in sorted(counts.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))]
    lines += ["", "events by type:"] + _table(["type", "total", *used], rows)

    rooms = _room_rows(trace)
    if rooms:
        lines += ["", "rooms (times in ms):"]
        shown = rooms[:max_rooms]
        lines += _table(["room", "arrival", "1st transfer", "last scatter", "decode", "prefill",
                         "deferrals"], shown)
        if len(rooms) > max_rooms:
            lines.append(f"  ... {len(rooms) - max_rooms} more rooms")
    return "\n".join(lines) + "\n"


def _dir_of(events: list[Record], rtype: str) -> str:
    for r in events:
        if r.type == rtype:
            return r.dir
    return "?"


def _room_rows(trace: Trace) -> list[list[str]]:
    arrival: dict[int, float] = {}
    serving: dict[int, tuple[int, int]] = {}
    first_xfer: dict[int, float] = {}
    last_scatter: dict[int, float] = {}
    deferrals: Counter[int] = Counter()
    concluded: dict[int, dict[str, list[tuple[float, str]]]] = defaultdict(
        lambda: {"prefill": [], "decode": []})
    for r in trace.events:
        d = r.data
        if r.type == "RequestArrived":
            arrival[d["room"]] = r.t
            serving[d["room"]] = (len(d["prefill_node"]), len(d["decode_node"]))
        elif r.type == "StartTransfer":
            first_xfer.setdefault(d["room"], r.t)
        elif r.type == "ScatterDone":
            last_scatter[d["room"]] = r.t
        elif r.type == "Deferred":
            deferrals[d["room"]] += 1
        elif r.type == "RoomConcluded":
            role = trace.nodes[r.node]["role"]
            concluded[d["room"]][role].append((r.t, d["status"]))
    rows = []
    for room, t in arrival.items():
        n_prefill, n_decode = serving[room]
        c = concluded.get(room, {"prefill": [], "decode": []})
        rows.append([str(room), _ms(t), _ms(first_xfer.get(room)), _ms(last_scatter.get(room)),
                     _conclusion(c["decode"], n_decode), _conclusion(c["prefill"], n_prefill),
                     str(deferrals[room])])
    return rows


# ---------------------------------------------------------------------------------------------
# room timeline
# ---------------------------------------------------------------------------------------------
def room_timeline(trace: Trace, room: int, *, width: int = WIDTH) -> str:
    """Every record about ``room`` on every node, in trace order, one line each.

    Besides records naming the room (directly or in a message), a transfer's ``TransferDone``
    and a deferral's ``WorkerPoll`` are shown when the worker was busy with or waiting on
    ``room``, and so is any input whose effects include a record about the room.
    """
    busy: dict[tuple[str, int], int] = {}
    unshown: dict[str, Record] = {}  # each node's last input, while not yet shown
    lines = [f"room {room} in {trace.path} (times in ms)"]
    found = False

    def show(r: Record) -> None:
        d = r.data
        text = event_text(r, omit=("room",) if _room_of(r) == room and "room" in d else ())
        arrow = {"in": "<-", "out": "->", "sys": "**"}[r.dir]
        lines.append(_cut(f"{_ms(r.t):>10}  {r.node:<7} {arrow} {text}", width))

    for r in trace.events:
        d = r.data
        about = _room_of(r) == room
        key = (r.node, d.get("worker", -1))
        if r.type in ("StartTransfer", "Deferred"):
            busy[key] = d["room"]
        elif r.type in ("TransferDone", "WorkerPoll") and busy.get(key) == room:
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
    if not found:
        lines.append("  (no records)")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# diff
# ---------------------------------------------------------------------------------------------
def _line(rec: Record | None) -> str | None:
    if rec is None:
        return None
    return f"#{rec.seq} t={_ms(rec.t)}ms {rec.node} {rec.dir} {event_text(rec)}"


def _same(a: Record, b: Record, t_tol: float) -> bool:
    return (a.node == b.node and a.dir == b.dir and abs(a.t - b.t) <= t_tol
            and a.data == b.data)


def first_divergence(a: Trace, b: Trace, *, t_tol: float = 1e-9
                     ) -> tuple[int, str | None, str | None] | None:
    """The first event index where ``a`` and ``b`` differ, with each side's line (``None``
    where that trace has already ended); ``None`` when the event sequences agree.

    Events agree when node, direction and payload are equal and times differ by at most
    ``t_tol`` seconds.
    """
    ea, eb = a.events, b.events
    for i in range(max(len(ea), len(eb))):
        ra = ea[i] if i < len(ea) else None
        rb = eb[i] if i < len(eb) else None
        if ra is None or rb is None or not _same(ra, rb, t_tol):
            return i, _line(ra), _line(rb)
    return None


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def _header_diff(a: Trace, b: Trace) -> list[str]:
    fa = _flatten({k: v for k, v in a.header.items() if k not in _IGNORED_HEADER_KEYS})
    fb = _flatten({k: v for k, v in b.header.items() if k not in _IGNORED_HEADER_KEYS})
    out = []
    for key in sorted(set(fa) | set(fb)):
        va, vb = fa.get(key, "<absent>"), fb.get(key, "<absent>")
        if va != vb:
            out.append(_cut(f"  {key}: {json.dumps(va)} != {json.dumps(vb)}"))
    return out


def diff(a: Trace, b: Trace, *, t_tol: float = 1e-9, context: int = 3) -> str:
    """Human-readable comparison: header (without ``created``/``software``), first divergent
    event with ``context`` agreeing events before it, per-type count differences, outcomes."""
    lines = [f"a: {a.path} ({a.status}, {len(a.events)} events)",
             f"b: {b.path} ({b.status}, {len(b.events)} events)"]
    header = _header_diff(a, b)
    lines += ["header: identical"] if not header else ["header differs:", *header]
    div = first_divergence(a, b, t_tol=t_tol)
    if div is None:
        lines.append(f"events: identical (time tolerance {t_tol:g} s)")
    else:
        index, la, lb = div
        lines.append(f"events: first divergence at event #{index} (line {index + 2}; "
                     f"time tolerance {t_tol:g} s)")
        for r in a.events[max(0, index - context):index]:
            lines.append(_cut(f"    {_line(r)}"))
        lines.append(_cut(f"  a {la if la is not None else '<trace ended>'}"))
        lines.append(_cut(f"  b {lb if lb is not None else '<trace ended>'}"))
    n = min(len(a.events), len(b.events))
    dts = [abs(a.events[i].t - b.events[i].t) for i in range(div[0] if div else n)]
    if dts and max(dts) > 0:
        lines.append(f"max time difference before the divergence: {max(dts):.3g} s")
    ca, cb = Counter(r.type for r in a.events), Counter(r.type for r in b.events)
    rows = [[t, str(ca[t]), str(cb[t]), f"{cb[t] - ca[t]:+d}"]
            for t in sorted(set(ca) | set(cb)) if ca[t] != cb[t]]
    if rows:
        lines += ["counts that differ:", *_table(["type", "a", "b", "b-a"], rows)]
    else:
        lines.append("counts by type: identical")
    oa, ob = a.outcome, b.outcome
    if oa == ob:
        lines.append(f"outcome: identical ({a.status})")
    else:
        lines.append("outcome differs:")
        keys = sorted(set(oa or {}) | set(ob or {}))
        for k in keys:
            va, vb = (oa or {}).get(k, "<absent>"), (ob or {}).get(k, "<absent>")
            if va != vb:
                lines.append(_cut(f"  {k}: {json.dumps(va)} != {json.dumps(vb)}"))
    return "\n".join(lines) + "\n"
