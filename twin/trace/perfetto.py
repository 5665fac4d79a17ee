"""Trace -> a Perfetto timeline: native protobuf (default) or Chrome trace-event JSON.

The trace is read once, in order; the timeline keeps only what is open (transfers in flight,
deferral waits, scatters, forward passes, live ring allocations, watermarks) and writes each
slice when it closes, so memory does not grow with the trace. The protobuf file is written with
the ``perfetto`` package's ``StreamingTraceProtoBuilder``, packet by packet, and opens in
https://ui.perfetto.dev; ``.json``/``.json.gz`` names (or ``fmt="json"``) write Chrome
trace-event JSON instead (also streamed).

Layout:

* one process per node (``pid`` = header order + 1, named ``"prefill p0g0r0"``), plus a
  ``driver`` process for run-level records;
* prefill nodes: track ``scheduler`` (instants) and one track per transfer worker (JSON
  ``tid = worker + 1``) holding transfer slices, deferral waits and the ``CHUNK_READY`` send
  markers; forward passes on ``forward`` tracks (JSON: the scheduler thread);
* decode nodes: track ``scheduler`` (instants) and ``scatter`` tracks (tid 1, 2, ...: a new
  lane only when scatters overlap).

Slices: transfers (``StartTransfer`` -> the next ``TransferDone`` of that node and worker),
scatters (``StartScatter`` -> ``ScatterDone`` with the same ``alloc_id``), forward passes
(``ForwardStart`` -> ``ForwardEnd`` of the room; overlapping passes get lanes), deferral waits
(``Deferred`` -> the worker's next ``WorkerPoll`` input or a ``WakeWorkers`` naming it). Slices
still open when the trace (or the window) ends close there with ``args.unfinished = true``.

Counters: ``ring occupancy`` bytes per decode node (``Allocated`` adds ``size``, ``Freed``
subtracts the size of that ``alloc_id``) and ``watermark lag <session>`` per prefill node: the
decode node's current watermark (its ``WatermarkMoved`` effects; session == decode node id)
minus the watermark that prefill node accepted from ``WATERMARK`` messages, in bytes:
``(decode_round - prefill_round) * ring_bytes + (decode_tail - prefill_tail)``. Zero means the
prefill side is up to date; a lag that stays positive is a lost or late watermark.

Flows link each ``Send`` of a ``CHUNK_READY`` to the ``StartScatter`` of the same room and chunk
that its destination started next. Instants mark ``RoomConcluded``, ``Dropped``,
``RankCrashed``, ``FaultInjected``, ``Note`` and ``Outcome``.

A window (``t_from``, ``t_to``, seconds of trace time) or a ``room`` cuts the output: slices
that overlap the window, instants and counters inside it (counters start with their value at
the window's start), and with ``room`` only that room's slices, instants and flows (and, unless
a window is given, counters while the room is live). On an indexed trace file
(``twin.trace.index``) the export seeks: it starts at the indexed state nearest before the
window (or the room) and stops after it.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any, cast

from twin.core import events as ev
from twin.core import wire
from twin.trace.codec import event_from_json, field_specs, message_to_json
from twin.trace.format import (
    DRIVER,
    Record,
    Trace,
    TraceReader,
    TraceSource,
    open_trace,
)

__all__ = ["export", "to_chrome_trace", "write_perfetto"]

_US = 1e6
_DEFAULTS: dict[type, dict[str, Any]] = {}
_REPEATED_NAMES = ("concluded ", "dropped ", "rank crashed", "fault ", "note", "Outcome")


def _us(t: float) -> float:
    return round(t * _US, 3)


def _args(event: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in field_specs(type(event)):
        name = f.name
        value = getattr(event, name)
        if isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, wire.StagingReq | wire.StagingRsp | wire.Watermark
                        | wire.ChunkReady | wire.TransferStatus):
            value = message_to_json(value)
        out[name] = value
    return out


# ---------------------------------------------------------------------------------------------
# Output formats
# ---------------------------------------------------------------------------------------------
class _Emitter:
    """Where the timeline goes. A track is ``(node, kind, index)``: kind ``scheduler``,
    ``worker`` (index = worker), ``scatter`` (index = lane, 1, 2, ...) or ``forward`` (lane)."""

    def event_args(self, event: Any) -> dict[str, Any]:
        """The args of a slice or instant made from ``event``: its fields."""
        return _args(event)

    def slice(self, track: tuple[str, str, int], name: str, cat: str, t0: float, t1: float,
              args: dict[str, Any], flows_in: Iterable[int] = ()) -> None:
        raise NotImplementedError

    def instant(self, track: tuple[str, str, int], name: str, cat: str, t: float,
                args: dict[str, Any], scope: str = "t") -> None:
        raise NotImplementedError

    def marker(self, track: tuple[str, str, int], name: str, cat: str, t: float,
               args: dict[str, Any], flow_out: int | None) -> None:
        """A zero-length mark (a CHUNK_READY send), the start of flow ``flow_out``."""
        raise NotImplementedError

    def counter(self, node: str, name: str, t: float, value: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _track_name(kind: str, index: int) -> str:
    if kind == "worker":
        return f"transfer worker {index}"
    if kind in ("scatter", "forward"):
        return kind if index == 1 else f"{kind} {index}"
    return "driver" if kind == "driver" else "scheduler"


class _JsonEmitter(_Emitter):
    """Chrome trace-event JSON, streamed to ``out`` (or kept in ``events``)."""

    def __init__(self, nodes: dict[str, dict[str, Any]], out: IO[str] | None) -> None:
        self.pid = {nid: i + 1 for i, nid in enumerate(nodes)}
        self.pid[DRIVER] = len(nodes) + 1
        self.events: list[dict[str, Any]] = []
        self._out = out
        self._first = True
        self._dumps = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode
        self.threads: set[tuple[int, int]] = set()
        if out is not None:
            out.write('{"traceEvents":[')
        names = {nid: f"{n['role']} {nid}" for nid, n in nodes.items()}
        names[DRIVER] = "driver"
        for nid, pid in self.pid.items():
            self._put({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "ts": 0,
                       "args": {"name": names[nid]}})
            self._put({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "ts": 0,
                       "args": {"sort_index": pid}})
            self._thread(pid, 0, "scheduler" if nid != DRIVER else "driver")

    def _put(self, item: dict[str, Any]) -> None:
        if self._out is None:
            self.events.append(item)
            return
        if not self._first:
            self._out.write(",")
        self._first = False
        self._out.write(self._dumps(item))

    def _thread(self, pid: int, tid: int, name: str) -> None:
        if (pid, tid) not in self.threads:
            self.threads.add((pid, tid))
            self._put({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "ts": 0,
                       "args": {"name": name}})

    def _tid(self, track: tuple[str, str, int]) -> tuple[int, int]:
        node, kind, index = track
        pid = self.pid[node]
        if kind == "worker":
            tid = index + 1
        elif kind == "scatter":
            tid = index
        else:
            return pid, 0  # scheduler, driver and forward passes share thread 0
        self._thread(pid, tid, _track_name(kind, index))
        return pid, tid

    def slice(self, track: tuple[str, str, int], name: str, cat: str, t0: float, t1: float,
              args: dict[str, Any], flows_in: Iterable[int] = ()) -> None:
        pid, tid = self._tid(track)
        ts = _us(t0)
        for fid in flows_in:
            self._put({"ph": "f", "bp": "e", "name": "CHUNK_READY", "cat": "chunk_ready",
                       "id": fid, "pid": pid, "tid": tid, "ts": ts})
        self._put({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts,
                   "dur": max(0.0, round(_us(t1) - ts, 3)), "args": args})

    def instant(self, track: tuple[str, str, int], name: str, cat: str, t: float,
                args: dict[str, Any], scope: str = "t") -> None:
        pid, tid = self._tid(track)
        self._put({"ph": "i", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": _us(t),
                   "s": scope, "args": args})

    def marker(self, track: tuple[str, str, int], name: str, cat: str, t: float,
               args: dict[str, Any], flow_out: int | None) -> None:
        pid, tid = self._tid(track)
        self._put({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": _us(t),
                   "dur": 0.0, "args": args})
        if flow_out is not None:
            self._put({"ph": "s", "name": "CHUNK_READY", "cat": cat, "id": flow_out,
                       "pid": pid, "tid": tid, "ts": _us(t)})

    def counter(self, node: str, name: str, t: float, value: int) -> None:
        self._put({"ph": "C", "name": name, "pid": self.pid[node], "tid": 0, "ts": _us(t),
                   "args": {"bytes": value}})

    def finish(self, other: dict[str, Any]) -> dict[str, Any] | None:
        if self._out is None:
            return {"traceEvents": self.events, "displayTimeUnit": "ms", "otherData": other}
        self._out.write('],"displayTimeUnit":"ms","otherData":' + self._dumps(other) + "}")
        return None


class _ProtoEmitter(_Emitter):
    """Perfetto's protobuf trace format (TrackEvent), through the ``perfetto`` package's
    streaming trace builder: track descriptors before their first event, debug annotation
    names and categories interned on one packet sequence, times in nanoseconds."""

    SEQ = 1

    def event_args(self, event: Any) -> dict[str, Any]:
        """The event's fields, less those at their default value (they cost bytes, say
        little, and the field tables in docs/trace-format.md give the defaults)."""
        defaults = _DEFAULTS.get(type(event))
        if defaults is None:
            defaults = _DEFAULTS[type(event)] = {
                f.name: f.default for f in field_specs(type(event)) if not f.required}
        return {k: v for k, v in _args(event).items()
                if k not in defaults or v != defaults[k]}

    def __init__(self, nodes: dict[str, dict[str, Any]], out: IO[bytes]) -> None:
        pb, StreamingTraceProtoBuilder = _proto_modules()  # noqa: N806 - a class
        self._pb = pb
        self._b = StreamingTraceProtoBuilder(out)
        self._te = pb.TrackEvent
        self.pid = {nid: i + 1 for i, nid in enumerate(nodes)}
        self.pid[DRIVER] = len(nodes) + 1
        self._names = {nid: f"{n['role']} {nid}" for nid, n in nodes.items()}
        self._names[DRIVER] = "driver"
        self._tracks: dict[tuple[Any, ...], int] = {}
        self._iids: dict[str, int] = {}
        self._cats: dict[str, int] = {}
        self._names_iid: dict[str, int] = {}
        self._first = True
        for nid in self.pid:
            self._process(nid)

    def _packet(self, interned: bool = True) -> Any:
        p = self._b.create_packet()
        p.trusted_packet_sequence_id = self.SEQ
        if self._first:
            p.sequence_flags = self._pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
            self._first = False
        elif interned:
            p.sequence_flags = self._pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
        return p

    def _process(self, node: str) -> int:
        key = ("p", node)
        uuid = self._tracks.get(key)
        if uuid is None:
            uuid = self._tracks[key] = len(self._tracks) + 1
            p = self._packet()
            d = p.track_descriptor
            d.uuid = uuid
            d.process.pid = self.pid[node]
            d.process.process_name = self._names[node]
            self._b.write_packet(p)
        return uuid

    def _track(self, track: tuple[str, str, int]) -> int:
        uuid = self._tracks.get(track)
        if uuid is None:
            node, kind, index = track
            parent = self._process(node)
            uuid = self._tracks[track] = len(self._tracks) + 1
            pid = self.pid[node]
            local = {"scheduler": 0, "driver": 0, "worker": 1 + index, "scatter": 100 + index,
                     "forward": 200 + index}[kind]
            p = self._packet()
            d = p.track_descriptor
            d.uuid = uuid
            d.parent_uuid = parent
            d.thread.pid = pid
            d.thread.tid = pid * 1000 + local
            d.thread.thread_name = _track_name(kind, index)
            self._b.write_packet(p)
        return uuid

    def _counter_track(self, node: str, name: str) -> int:
        key = ("c", node, name)
        uuid = self._tracks.get(key)
        if uuid is None:
            parent = self._process(node)
            uuid = self._tracks[key] = len(self._tracks) + 1
            p = self._packet()
            d = p.track_descriptor
            d.uuid = uuid
            d.parent_uuid = parent
            d.name = name
            d.counter.unit_name = "bytes"
            self._b.write_packet(p)
        return uuid

    def _intern(self, p: Any, table: dict[str, int], name: str, field: str) -> int:
        iid = table.get(name)
        if iid is None:
            iid = table[name] = len(table) + 1
            entry = getattr(p.interned_data, field).add()
            entry.iid = iid
            entry.name = name
        return iid

    def _annotate(self, p: Any, te: Any, args: dict[str, Any]) -> None:
        for key, value in args.items():
            a = te.debug_annotations.add()
            a.name_iid = self._intern(p, self._iids, key, "debug_annotation_names")
            self._value(p, a, value)

    def _name(self, p: Any, te: Any, name: str) -> None:
        if name.startswith(_REPEATED_NAMES):
            te.name_iid = self._intern(p, self._names_iid, name, "event_names")
        else:
            te.name = name

    def _value(self, p: Any, a: Any, value: Any) -> None:
        if value is None:
            a.string_value = "null"
        elif isinstance(value, bool):
            a.bool_value = value
        elif isinstance(value, int):
            a.int_value = value
        elif isinstance(value, float):
            a.double_value = value
        elif isinstance(value, str):
            a.string_value = value
        elif isinstance(value, dict):
            for k, v in value.items():
                entry = a.dict_entries.add()
                entry.name_iid = self._intern(p, self._iids, str(k), "debug_annotation_names")
                self._value(p, entry, v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                self._value(p, a.array_values.add(), v)
        else:
            a.string_value = str(value)

    def _event(self, t: float, uuid: int, kind: int, cat: str | None) -> tuple[Any, Any]:
        p = self._packet(cat is not None)
        p.timestamp = round(t * 1e9)
        te = p.track_event
        te.type = kind
        te.track_uuid = uuid
        if cat is not None:
            te.category_iids.append(self._intern(p, self._cats, cat, "event_categories"))
        return p, te

    def slice(self, track: tuple[str, str, int], name: str, cat: str, t0: float, t1: float,
              args: dict[str, Any], flows_in: Iterable[int] = ()) -> None:
        uuid = self._track(track)
        p, te = self._event(t0, uuid, self._te.TYPE_SLICE_BEGIN, cat)
        self._name(p, te, name)
        self._annotate(p, te, args)
        te.terminating_flow_ids.extend(flows_in)
        self._b.write_packet(p)
        p, te = self._event(max(t0, t1), uuid, self._te.TYPE_SLICE_END, None)
        self._b.write_packet(p)

    def instant(self, track: tuple[str, str, int], name: str, cat: str, t: float,
                args: dict[str, Any], scope: str = "t") -> None:
        p, te = self._event(t, self._track(track), self._te.TYPE_INSTANT, cat)
        self._name(p, te, name)
        self._annotate(p, te, args)
        self._b.write_packet(p)

    def marker(self, track: tuple[str, str, int], name: str, cat: str, t: float,
               args: dict[str, Any], flow_out: int | None) -> None:
        # An instant shows no label on its track: one interned name, room and chunk in args.
        p, te = self._event(t, self._track(track), self._te.TYPE_INSTANT, cat)
        te.name_iid = self._intern(p, self._names_iid, name.split(" ")[0], "event_names")
        self._annotate(p, te, {k: v for k, v in args.items() if k != "kind"})
        if flow_out is not None:
            te.flow_ids.append(flow_out)
        self._b.write_packet(p)

    def counter(self, node: str, name: str, t: float, value: int) -> None:
        p, te = self._event(t, self._counter_track(node, name), self._te.TYPE_COUNTER, None)
        te.counter_value = value
        self._b.write_packet(p)


# ---------------------------------------------------------------------------------------------
# The timeline: pairs records into slices, counters and flows
# ---------------------------------------------------------------------------------------------
class _Timeline:
    def __init__(self, src: Trace | TraceReader, out: _Emitter, *, t_from: float | None,
                 t_to: float | None, room: int | None) -> None:
        self.out = out
        self.role = {nid: n["role"] for nid, n in src.nodes.items()}
        self.ring_bytes = src.config.ring_bytes
        self.t_from = -math.inf if t_from is None else t_from
        self.t_to = math.inf if t_to is None else t_to
        self.room = room
        self.room_live = room is None  # counters go out while the room (if any) lives
        self.room_nodes: set[str] = set()
        self.last_input: dict[str, Any] = {}
        self.transfers: dict[tuple[str, int], tuple[float, ev.StartTransfer]] = {}
        self.deferrals: dict[tuple[str, int], tuple[float, ev.Deferred]] = {}
        self.scatters: dict[tuple[str, int], tuple[float, ev.StartScatter, int, list[int]]] = {}
        self.lanes: dict[tuple[str, str], set[int]] = {}
        self.forwards: dict[tuple[str, int], tuple[float, dict[str, Any], int]] = {}
        self.occupancy: dict[str, int] = {}
        self.alloc_size: dict[tuple[str, int], int] = {}
        self.decode_wm: dict[str, tuple[int, int]] = {}
        self.prefill_wm: dict[tuple[str, str], tuple[int, int]] = {}
        self.pending: dict[tuple[str, int, int], list[tuple[Any, ...]]] = {}
        self.counters: dict[tuple[str, str], tuple[float, int]] = {}
        self.started = False  # the window has begun
        self.counting = False  # counters go out (their values at the start went out)
        self.flow_id = 0
        self.now = 0.0

    # -- filters -----------------------------------------------------------------------------
    def _shows_room(self, room: int | None) -> bool:
        return self.room is None or room == self.room

    def _in_window(self, t: float) -> bool:
        return self.t_from <= t <= self.t_to

    def _overlaps(self, t0: float, t1: float) -> bool:
        return t1 >= self.t_from and t0 <= self.t_to

    def _slice(self, track: tuple[str, str, int], name: str, cat: str, t0: float, t1: float,
               args: dict[str, Any], room: int | None, flows_in: Iterable[int] = ()) -> None:
        if self._shows_room(room) and self._overlaps(t0, t1):
            self.out.slice(track, name, cat, t0, t1, args, flows_in)

    def _instant(self, track: tuple[str, str, int], name: str, cat: str, t: float,
                 args: dict[str, Any], room: int | None, scope: str = "t") -> None:
        if self._shows_room(room) and self._in_window(t):
            self.out.instant(track, name, cat, t, args, scope)

    def _counter(self, node: str, name: str, t: float, value: int) -> None:
        self.counters[(node, name)] = (t, value)
        if self.counting and t <= self.t_to:
            self.out.counter(node, name, t, value)

    def _count_from(self, t: float) -> None:
        """Counters go out from ``t`` on when the window has begun and the room lives: each
        starts with its value at ``t``."""
        if not self.counting and self.started and self.room_live:
            self.counting = True
            for (node, name), (_, value) in self.counters.items():
                self.out.counter(node, name, t, value)

    # -- per record --------------------------------------------------------------------------
    def feed(self, rec: Record) -> None:
        t = rec.t
        self.now = t
        if not self.started and t >= self.t_from:
            self.started = True
            self._count_from(max(self.t_from, t) if self.t_from > -math.inf else t)
        if rec.dir == "sys":
            self._sys(rec)
        elif rec.dir == "in":
            self._input(rec)
        else:
            self._effect(rec)

    def _lane(self, node: str, kind: str) -> int:
        lanes = self.lanes.setdefault((node, kind), set())
        lane = 1
        while lane in lanes:
            lane += 1
        lanes.add(lane)
        return lane

    def _sys(self, rec: Record) -> None:
        d, node, t = rec.data, rec.node, rec.t
        rtype = rec.type
        if rtype == "ForwardStart":
            self.forwards[(node, d["room"])] = (t, d, self._lane(node, "forward"))
        elif rtype == "ForwardEnd":
            start = self.forwards.pop((node, d["room"]), None)
            if start is not None:
                self.lanes[(node, "forward")].discard(start[2])
                self._slice((node, "forward", start[2]), f"forward room {d['room']}",
                            "forward", start[0], t,
                            {"room": d["room"], "tokens": start[1]["tokens"]}, d["room"])
        elif rtype == "RequestArrived" and self.room is not None and d["room"] == self.room:
            self.room_nodes = set(d["prefill_node"]) | set(d["decode_node"])
            self.room_live = True
            self._count_from(t)
        elif rtype in ("FaultInjected", "Note", "Outcome"):
            if self.room is not None and rtype != "Outcome":
                return
            label = {"FaultInjected": f"fault {d.get('fault')}", "Note": "note",
                     "Outcome": f"Outcome: {d.get('status')}"}[rtype]
            args = {k: v for k, v in d.items() if k != "type"}
            kind = "driver" if node == DRIVER else "scheduler"
            self._instant((node, kind, 0), label, rtype, t, args, None,
                          "g" if rtype == "Outcome" else "p")

    def _input(self, rec: Record) -> None:
        e, node, t = rec.event, rec.node, rec.t
        self.last_input[node] = e
        cls = type(e)
        if cls is ev.TransferDone:
            self._close_deferral(node, e.worker, t)
            start = self.transfers.pop((node, e.worker), None)
            if start is not None:
                done = {k: v for k, v in self.out.event_args(e).items() if k != "worker"}
                self._transfer_slice(node, start[1], start[0], t, **done)
        elif cls is ev.WorkerPoll:
            self._close_deferral(node, e.worker, t)
        elif cls is ev.ScatterDone:
            start = self.scatters.pop((node, e.alloc_id), None)
            if start is not None:
                t0, sc, lane, flows = start
                self.lanes[(node, "scatter")].discard(lane)
                self._slice((node, "scatter", lane), f"scatter room {sc.room} c{sc.chunk_idx}",
                            "scatter", t0, t, self.out.event_args(sc), sc.room, flows)
        elif cls is ev.MessageArrived and type(e.msg) is wire.Watermark:
            key = (node, e.msg.session_id)
            new, prev = (e.msg.round, e.msg.tail), self.prefill_wm.get(key)
            if prev is None or new > prev:  # the rank keeps the newest watermark only
                self.prefill_wm[key] = new if prev is None else max(new, prev)
                self._lag(node, e.msg.session_id, t)

    def _effect(self, rec: Record) -> None:
        e, node, t = rec.event, rec.node, rec.t
        cls = type(e)
        if cls is ev.StartTransfer:
            key = (node, e.worker)
            if key in self.transfers:  # never settled: close it where the next one starts
                t0, old = self.transfers.pop(key)
                self._transfer_slice(node, old, t0, t, unfinished=True)
            self._close_deferral(node, e.worker, t)
            self.transfers[key] = (t, e)
        elif cls is ev.Deferred:
            self.deferrals.setdefault((node, e.worker), (t, e))
        elif cls is ev.WakeWorkers:
            for w in e.workers:
                self._close_deferral(node, w, t)
        elif cls is ev.StartScatter:
            lane = self._lane(node, "scatter")
            flows = []
            for src_track, name, st, args, in_view in self.pending.pop(
                    (node, e.room, e.chunk_idx), []):
                fid = None
                if in_view and self._shows_room(e.room):
                    self.flow_id += 1
                    fid = self.flow_id
                    flows.append(fid)
                if in_view:
                    self.out.marker(src_track, name, "chunk_ready", st, args, fid)
            self.scatters[(node, e.alloc_id)] = (t, e, lane, flows)
        elif cls is ev.Send and type(e.msg) is wire.ChunkReady:
            self._chunk_ready(node, e.dst, e.msg, t)
        elif cls is ev.Send and type(e.msg) is wire.StagingReq:
            self.prefill_wm.setdefault((node, e.msg.session_id), (0, 0))
        elif cls is ev.Allocated:
            self.alloc_size[(node, e.alloc_id)] = e.size
            self.occupancy[node] = self.occupancy.get(node, 0) + e.size
            self._counter(node, "ring occupancy", t, self.occupancy[node])
        elif cls is ev.Freed:
            size = self.alloc_size.pop((node, e.alloc_id), None)
            if size is not None:
                self.occupancy[node] -= size
                self._counter(node, "ring occupancy", t, self.occupancy[node])
        elif cls is ev.WatermarkMoved:
            self.decode_wm[node] = (e.round, e.tail)
            for pnode, session in list(self.prefill_wm):
                if session == node:
                    self._lag(pnode, session, t)
        elif cls is ev.RoomConcluded:
            self._instant((node, "scheduler", 0), f"concluded {e.status}", "conclusion", t,
                          self.out.event_args(e), e.room)
            if self.room is not None and e.room == self.room and self.room_nodes:
                self.room_nodes.discard(node)
                if not self.room_nodes:  # the room ended: no more counters
                    self.room_live = self.counting = False
        elif cls is ev.Dropped:
            self._instant((node, "scheduler", 0), f"dropped {e.what}", "dropped", t,
                          self.out.event_args(e),
                          e.room)
        elif cls is ev.RankCrashed:
            self._instant((node, "scheduler", 0), "rank crashed", "crash", t,
                          self.out.event_args(e), None,
                          "p")

    # -- pieces ------------------------------------------------------------------------------
    def _transfer_slice(self, node: str, st: ev.StartTransfer, t0: float, t1: float,
                        **extra: Any) -> None:
        self._slice((node, "worker", st.worker),
                    f"room {st.room} c{st.chunk_idx} -> {st.session}", "transfer", t0, t1,
                    {**self.out.event_args(st), **extra}, st.room)

    def _close_deferral(self, node: str, worker: int, t: float) -> None:
        start = self.deferrals.pop((node, worker), None)
        if start is not None:
            t0, d = start
            self._slice((node, "worker", worker), f"deferred room {d.room} c{d.chunk_idx}",
                        "deferral", t0, t, self.out.event_args(d), d.room)

    def _chunk_ready(self, node: str, dst: str, msg: wire.ChunkReady, t: float) -> None:
        last = self.last_input.get(node)
        track = (node, "worker", last.worker) if type(last) is ev.TransferDone else (
            node, "scheduler", 0)
        in_view = self._shows_room(msg.room) and self._in_window(t)
        self.pending.setdefault((dst, msg.room, msg.chunk_idx), []).append(
            (track, f"CHUNK_READY room {msg.room} c{msg.chunk_idx}", t, message_to_json(msg),
             in_view))

    def _lag(self, pnode: str, session: str, t: float) -> None:
        d_round, d_tail = self.decode_wm.get(session, (0, 0))
        p_round, p_tail = self.prefill_wm.get((pnode, session), (0, 0))
        lag = (d_round - p_round) * self.ring_bytes + (d_tail - p_tail)
        self._counter(pnode, f"watermark lag {session}", t, lag)

    def finish(self, end_t: float) -> None:
        """Close what is still open at ``end_t`` (the trace's last time, or the window's end)."""
        t = min(end_t, self.t_to)
        if not self.started and t >= self.t_from:
            self.started = True
            self._count_from(t)
        for (node, _w), (t0, st) in sorted(self.transfers.items(), key=lambda kv: kv[1][0]):
            self._transfer_slice(node, st, t0, max(t0, t), unfinished=True)
        for (node, w), (t0, d) in list(self.deferrals.items()):
            self._slice((node, "worker", w), f"deferred room {d.room} c{d.chunk_idx}",
                        "deferral", t0, max(t0, t), {**self.out.event_args(d), "unfinished": True},
                        d.room)
        for (node, _a), (t0, sc, lane, flows) in self.scatters.items():
            self._slice((node, "scatter", lane), f"scatter room {sc.room} c{sc.chunk_idx}",
                        "scatter", t0, max(t0, t), {**self.out.event_args(sc), "unfinished": True},
                        sc.room,
                        flows)
        for (node, room), (t0, d, lane) in self.forwards.items():
            self._slice((node, "forward", lane), f"forward room {room}", "forward", t0,
                        max(t0, t), {"room": room, "tokens": d["tokens"], "unfinished": True},
                        room)
        for items in self.pending.values():  # CHUNK_READY sends no scatter answered
            for src_track, name, st, args, in_view in items:
                if in_view:
                    self.out.marker(src_track, name, "chunk_ready", st, args, None)
        self.transfers.clear()
        self.deferrals.clear()
        self.scatters.clear()
        self.forwards.clear()
        self.pending.clear()


# ---------------------------------------------------------------------------------------------
# Reading (with the index when there is one) and writing
# ---------------------------------------------------------------------------------------------
def _state_records(state: dict[str, Any], src: TraceReader) -> list[Record]:
    out = []
    for d in state.get("lines", []):
        d = dict(d)
        seq, t, node, direction = d.pop("seq"), d.pop("t"), d.pop("node"), d.pop("dir")
        where = f"{src.name} index state"
        event = event_from_json(d, where=where) if direction != "sys" else None
        out.append(Record(seq, float(t), node, direction, d["type"], d, event, seq + 2))
    return out


def _plan(source: TraceSource, t_from: float | None, t_to: float | None,
          room: int | None) -> tuple[Trace | TraceReader, list[Record], dict[str, Any]]:
    """The records to read: from a trace file's index, a reader of the blocks that matter, the
    open lines to feed first and the allocations live at its start."""
    src = open_trace(source)
    windowed = t_from is not None or t_to is not None or room is not None
    if not windowed or not isinstance(src, TraceReader) or src.partial:
        return src, [], {}
    from twin.trace.index import TraceIndex

    index = TraceIndex.load(src.path, src.header_line, os.path.getsize(src.path))
    if index is None or not index.blocks:
        return src, [], {}
    blocks = index.blocks
    first = 0 if t_from is None else index.at_time(t_from)
    last = len(blocks) - 1 if t_to is None else index.at_time(t_to)
    if room is not None:
        found = index.room_blocks(room)
        if found is None:
            src.close()
            return src.part((index.tail(), None)), [], {}
        first = max(first, found[0]) if t_from is not None else found[0]
        last = min(last, found[1] + 1) if t_to is not None else found[1] + 1
    start, state = index.state_before(min(first, len(blocks) - 1))
    end = blocks[last] if last < len(blocks) - 1 else None
    src.close()
    part = src.part((blocks[start], end))
    return part, _state_records(state, part), state.get("alloc", {})


def export(source: TraceSource, emitter: _Emitter, *, t_from: float | None = None,
           t_to: float | None = None, room: int | None = None) -> Trace | TraceReader:
    """Feed ``source`` (a path is streamed; an indexed file seeks) through the timeline into
    ``emitter``; returns the source read."""
    src, carried, alloc = _plan(source, t_from, t_to, room)
    tl = _Timeline(src, emitter, t_from=t_from, t_to=t_to, room=room)
    for node, items in alloc.items():
        for alloc_id, size in items:
            tl.alloc_size[(node, alloc_id)] = size
            tl.occupancy[node] = tl.occupancy.get(node, 0) + size
        if items:
            tl.counters[(node, "ring occupancy")] = (0.0, tl.occupancy[node])
    for rec in carried:
        tl.feed(rec)
    stop = t_to if t_to is not None else math.inf
    end_t = carried[-1].t if carried else 0.0
    for rec in src:
        if rec.t > stop:  # past the window: what is open closes at its end
            end_t = stop
            break
        tl.feed(rec)
        end_t = rec.t
    if isinstance(src, TraceReader):
        src.close()
    tl.finish(end_t)
    return src


def _other(src: Trace | TraceReader) -> dict[str, Any]:
    h = src.header
    status = src.outcome["status"] if src.outcome is not None else "incomplete"
    name = src.path if isinstance(src, Trace) else src.name
    return {"format": h.get("format"), "version": h.get("version"), "mode": h.get("mode"),
            "seed": h.get("seed"), "defects": h.get("defects"), "faults": h.get("faults"),
            "status": status, "source": os.path.basename(str(name))}


def to_chrome_trace(trace: TraceSource, **window: Any) -> dict[str, Any]:
    """Chrome trace-event JSON in memory (``{"traceEvents": [...], ...}``; small traces)."""
    src = open_trace(trace)
    emitter = _JsonEmitter(src.nodes, None)
    src = export(src, emitter, **window)
    doc = emitter.finish(_other(src))
    assert doc is not None
    return doc


def _format_of(path: Path) -> str:
    name = path.name
    return "json" if name.endswith((".json", ".json.gz")) else "proto"


def _proto_modules() -> tuple[Any, Any]:
    """Perfetto's protobuf classes and its streaming builder (imported on first use)."""
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
    from perfetto.trace_builder.proto_builder import StreamingTraceProtoBuilder

    return pb, StreamingTraceProtoBuilder


def write_perfetto(trace: TraceSource, out_path: str | os.PathLike[str], *,
                   fmt: str | None = None, t_from: float | None = None,
                   t_to: float | None = None, room: int | None = None) -> Path:
    """Write the timeline of ``trace`` to ``out_path``: Perfetto protobuf, or Chrome JSON for
    ``fmt="json"`` (the default for ``.json``/``.json.gz`` names); gzip when the name ends in
    ``.gz``. Streams: memory holds what is open, not the trace.

    The file is written under a temporary name in the same folder (``.NAME.PID.part``) and
    renamed to ``out_path`` when it is complete, so an error, a bad trace or an interrupt
    leaves no partial file (and an existing ``out_path`` as it was); the temporary is removed.
    A ``out_path`` that exists and is no regular file (a pipe, ``/dev/null``) is written to
    directly."""
    path = Path(out_path)
    fmt = fmt or _format_of(path)
    if fmt not in ("proto", "json"):
        raise ValueError(f"format must be 'proto' or 'json', got {fmt!r}")
    if fmt == "proto":  # imported before the temporary exists: an interrupt during an
        # import may be raised in the import system's clean-up callback, which swallows it
        _proto_modules()
    src = open_trace(trace)
    gz = path.name.endswith(".gz")
    window = {"t_from": t_from, "t_to": t_to, "room": room}
    direct = path.exists() and not path.is_file()
    target = path if direct else path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        with contextlib.ExitStack() as stack:
            raw = cast("IO[bytes]", stack.enter_context(open(target, "wb")))
            if gz:  # named as the file will be (gzip keeps the name in its header)
                raw = cast("IO[bytes]", stack.enter_context(
                    gzip.GzipFile(str(path), "wb", fileobj=raw)))
            if fmt == "json":
                f = stack.enter_context(io.TextIOWrapper(raw, encoding="utf-8"))
                emitter = _JsonEmitter(src.nodes, f)
                src = export(src, emitter, **window)
                emitter.finish(_other(src))
            else:
                export(src, _ProtoEmitter(src.nodes, raw), **window)
        if not direct:
            os.replace(target, path)
    except BaseException:
        if not direct:
            with contextlib.suppress(OSError):
                target.unlink()
        raise
    return path
