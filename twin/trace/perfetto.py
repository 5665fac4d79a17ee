"""Trace -> Chrome trace-event JSON, for ui.perfetto.dev (or chrome://tracing).

Layout:

* one process per node (``pid`` = header order + 1, named ``"prefill p0g0r0"``), plus a
  ``driver`` process for run-level records;
* prefill nodes: thread 0 ``scheduler`` (forward passes, instants) and one thread per transfer
  worker (``tid = worker + 1``) holding transfer slices, deferral waits and the ``CHUNK_READY``
  send markers;
* decode nodes: thread 0 ``scheduler`` (instants) and ``scatter`` threads (tid 1, 2, ...: a new
  lane only when scatters overlap).

Slices (``"X"``, microseconds): transfers (``StartTransfer`` -> the next ``TransferDone`` of that
node and worker), scatters (``StartScatter`` -> ``ScatterDone`` with the same ``alloc_id``),
forward passes (``ForwardStart`` -> ``ForwardEnd`` of the room), deferral waits (``Deferred`` ->
the worker's next ``WorkerPoll`` input or a ``WakeWorkers`` naming it). Slices still open when
the trace ends close at its last time with ``args.unfinished = true``.

Counters (``"C"``): ``ring occupancy`` bytes per decode node (``Allocated`` adds ``size``,
``Freed`` subtracts the size of that ``alloc_id``) and ``watermark lag <session>`` per prefill
node: the decode node's current watermark (its ``WatermarkMoved`` effects; session == decode node
id) minus the watermark that prefill node accepted from ``WATERMARK`` messages, in bytes:
``(decode_round - prefill_round) * ring_bytes + (decode_tail - prefill_tail)``. Zero means the
prefill side is up to date; a lag that stays positive is a lost or late watermark.

Flow arrows (``"s"`` -> ``"f"``) link each ``Send`` of a ``CHUNK_READY`` to the ``StartScatter``
of the same room and chunk that its destination started next. Instants mark ``RoomConcluded``,
``Dropped``, ``RankCrashed``, ``FaultInjected``, ``Note`` and ``Outcome``.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

from twin.core import events as ev
from twin.core import wire
from twin.trace.codec import message_to_json
from twin.trace.format import DRIVER, Record, Trace

__all__ = ["to_chrome_trace", "write_perfetto"]

_US = 1e6


def _us(t: float) -> float:
    return round(t * _US, 3)


def _args(event: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in event.__slots__:
        value = getattr(event, name)
        if isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, wire.StagingReq | wire.StagingRsp | wire.Watermark
                        | wire.ChunkReady | wire.TransferStatus):
            value = message_to_json(value)
        out[name] = value
    return out


class _Builder:
    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.out: list[dict[str, Any]] = []
        self.pid = {nid: i + 1 for i, nid in enumerate(trace.nodes)}
        self.pid[DRIVER] = len(trace.nodes) + 1
        self.role = {nid: n["role"] for nid, n in trace.nodes.items()}
        self.ring_bytes = trace.config.ring_bytes
        self.threads: set[tuple[int, int]] = set()
        self.last_input: dict[str, Any] = {}
        self.transfers: dict[tuple[str, int], tuple[float, ev.StartTransfer]] = {}
        self.deferrals: dict[tuple[str, int], tuple[float, ev.Deferred]] = {}
        self.scatters: dict[tuple[str, int], tuple[float, ev.StartScatter, int]] = {}
        self.lanes: dict[str, set[int]] = {}
        self.forwards: dict[tuple[str, int], tuple[float, dict[str, Any]]] = {}
        self.occupancy: dict[str, int] = {}
        self.alloc_size: dict[tuple[str, int], int] = {}
        self.decode_wm: dict[str, tuple[int, int]] = {}
        self.prefill_wm: dict[tuple[str, str], tuple[int, int]] = {}
        self.pending_flows: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
        self.flow_id = 0
        self.end_t = trace.events[-1].t if trace.events else 0.0
        self._metadata()

    # -- helpers -----------------------------------------------------------------------------
    def _metadata(self) -> None:
        names = {nid: f"{n['role']} {nid}" for nid, n in self.trace.nodes.items()}
        names[DRIVER] = "driver"
        for nid, pid in self.pid.items():
            self.out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "ts": 0,
                             "args": {"name": names[nid]}})
            self.out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                             "ts": 0, "args": {"sort_index": pid}})
            self._thread(pid, 0, "scheduler" if nid != DRIVER else "driver")

    def _thread(self, pid: int, tid: int, name: str) -> None:
        if (pid, tid) not in self.threads:
            self.threads.add((pid, tid))
            self.out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "ts": 0,
                             "args": {"name": name}})

    def _worker_tid(self, node: str, worker: int) -> int:
        tid = worker + 1
        self._thread(self.pid[node], tid, f"transfer worker {worker}")
        return tid

    def _slice(self, node: str, tid: int, name: str, cat: str, t0: float, t1: float,
               args: dict[str, Any]) -> dict[str, Any]:
        ts = _us(t0)
        item = {"ph": "X", "name": name, "cat": cat, "pid": self.pid[node], "tid": tid,
                "ts": ts, "dur": max(0.0, round(_us(t1) - ts, 3)), "args": args}
        self.out.append(item)
        return item

    def _instant(self, node: str, name: str, cat: str, t: float, args: dict[str, Any],
                 scope: str = "t") -> None:
        self.out.append({"ph": "i", "name": name, "cat": cat, "pid": self.pid[node], "tid": 0,
                         "ts": _us(t), "s": scope, "args": args})

    def _counter(self, node: str, name: str, t: float, value: int) -> None:
        self.out.append({"ph": "C", "name": name, "pid": self.pid[node], "tid": 0, "ts": _us(t),
                         "args": {"bytes": value}})

    # -- per record --------------------------------------------------------------------------
    def feed(self, rec: Record) -> None:
        if rec.dir == "sys":
            self._sys(rec)
        elif rec.dir == "in":
            self.last_input[rec.node] = rec.event
            self._input(rec)
        else:
            self._effect(rec)

    def _sys(self, rec: Record) -> None:
        d, node, t = rec.data, rec.node, rec.t
        if rec.type == "ForwardStart":
            self.forwards[(node, d["room"])] = (t, d)
        elif rec.type == "ForwardEnd":
            start = self.forwards.pop((node, d["room"]), None)
            if start is not None:
                self._slice(node, 0, f"forward room {d['room']}", "forward", start[0], t,
                            {"room": d["room"], "tokens": start[1]["tokens"]})
        elif rec.type in ("FaultInjected", "Note", "Outcome"):
            label = {"FaultInjected": f"fault {d.get('fault')}", "Note": "note",
                     "Outcome": f"Outcome: {d.get('status')}"}[rec.type]
            args = {k: v for k, v in d.items() if k != "type"}
            self._instant(node, label, rec.type, t, args, "g" if rec.type == "Outcome" else "p")

    def _input(self, rec: Record) -> None:
        e, node, t = rec.event, rec.node, rec.t
        cls = type(e)
        if cls is ev.TransferDone:
            self._close_deferral(node, e.worker, t)
            start = self.transfers.pop((node, e.worker), None)
            if start is not None:
                self._transfer_slice(node, start[1], start[0], t, ok=e.ok, error=e.error)
        elif cls is ev.WorkerPoll:
            self._close_deferral(node, e.worker, t)
        elif cls is ev.ScatterDone:
            start = self.scatters.pop((node, e.alloc_id), None)
            if start is not None:
                t0, sc, lane = start
                self.lanes[node].discard(lane)
                self._slice(node, lane, f"scatter room {sc.room} c{sc.chunk_idx}", "scatter",
                            t0, t, _args(sc))
        elif cls is ev.MessageArrived and isinstance(e.msg, wire.Watermark):
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
            lanes = self.lanes.setdefault(node, set())
            lane = 1
            while lane in lanes:
                lane += 1
            lanes.add(lane)
            self._thread(self.pid[node], lane, "scatter" if lane == 1 else f"scatter {lane}")
            self.scatters[(node, e.alloc_id)] = (t, e, lane)
            for start in self.pending_flows.pop((node, e.room, e.chunk_idx), []):
                self.out.append(start)
                self.out.append({"ph": "f", "bp": "e", "name": "CHUNK_READY",
                                 "cat": "chunk_ready", "id": start["id"], "pid": self.pid[node],
                                 "tid": lane, "ts": _us(t)})
        elif cls is ev.Send and isinstance(e.msg, wire.ChunkReady):
            self._chunk_ready(node, e.dst, e.msg, t)
        elif cls is ev.Send and isinstance(e.msg, wire.StagingReq):
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
            self._instant(node, f"concluded {e.status}", "conclusion", t, _args(e))
        elif cls is ev.Dropped:
            self._instant(node, f"dropped {e.what}", "dropped", t, _args(e))
        elif cls is ev.RankCrashed:
            self._instant(node, "rank crashed", "crash", t, _args(e), "p")

    # -- pieces ------------------------------------------------------------------------------
    def _transfer_slice(self, node: str, st: ev.StartTransfer, t0: float, t1: float,
                        **extra: Any) -> None:
        tid = self._worker_tid(node, st.worker)
        self._slice(node, tid, f"room {st.room} c{st.chunk_idx} -> {st.session}", "transfer",
                    t0, t1, {**_args(st), **extra})

    def _close_deferral(self, node: str, worker: int, t: float) -> None:
        start = self.deferrals.pop((node, worker), None)
        if start is not None:
            t0, d = start
            self._slice(node, self._worker_tid(node, worker),
                        f"deferred room {d.room} c{d.chunk_idx}", "deferral", t0, t, _args(d))

    def _chunk_ready(self, node: str, dst: str, msg: wire.ChunkReady, t: float) -> None:
        last = self.last_input.get(node)
        tid = self._worker_tid(node, last.worker) if type(last) is ev.TransferDone else 0
        self._slice(node, tid, f"CHUNK_READY room {msg.room} c{msg.chunk_idx}", "chunk_ready",
                    t, t, message_to_json(msg))
        self.flow_id += 1
        start = {"ph": "s", "name": "CHUNK_READY", "cat": "chunk_ready", "id": self.flow_id,
                 "pid": self.pid[node], "tid": tid, "ts": _us(t)}
        self.pending_flows.setdefault((dst, msg.room, msg.chunk_idx), []).append(start)

    def _lag(self, pnode: str, session: str, t: float) -> None:
        d_round, d_tail = self.decode_wm.get(session, (0, 0))
        p_round, p_tail = self.prefill_wm.get((pnode, session), (0, 0))
        lag = (d_round - p_round) * self.ring_bytes + (d_tail - p_tail)
        self._counter(pnode, f"watermark lag {session}", t, lag)

    def finish(self) -> None:
        t = self.end_t
        for (node, _w), (t0, st) in sorted(self.transfers.items(), key=lambda kv: kv[1][0]):
            self._transfer_slice(node, st, t0, t, unfinished=True)
        for (node, w) in list(self.deferrals):
            start = self.deferrals.pop((node, w))
            self._slice(node, self._worker_tid(node, w),
                        f"deferred room {start[1].room} c{start[1].chunk_idx}", "deferral",
                        start[0], t, {**_args(start[1]), "unfinished": True})
        for (node, _a), (t0, sc, lane) in self.scatters.items():
            self._slice(node, lane, f"scatter room {sc.room} c{sc.chunk_idx}", "scatter", t0, t,
                        {**_args(sc), "unfinished": True})
        for (node, room), (t0, d) in self.forwards.items():
            self._slice(node, 0, f"forward room {room}", "forward", t0, t,
                        {"room": room, "tokens": d["tokens"], "unfinished": True})
        self.transfers.clear()
        self.scatters.clear()
        self.forwards.clear()


def to_chrome_trace(trace: Trace) -> dict[str, Any]:
    """Chrome trace-event JSON (``{"traceEvents": [...], "displayTimeUnit": "ms"}``)."""
    b = _Builder(trace)
    for rec in trace.events:
        b.feed(rec)
    b.finish()
    h = trace.header
    other = {"format": h.get("format"), "version": h.get("version"), "mode": h.get("mode"),
             "seed": h.get("seed"), "defects": h.get("defects"), "faults": h.get("faults"),
             "status": trace.status, "source": os.path.basename(trace.path)}
    return {"traceEvents": b.out, "displayTimeUnit": "ms", "otherData": other}


def write_perfetto(trace: Trace, out_path: str | os.PathLike[str]) -> Path:
    """Write ``to_chrome_trace(trace)`` to ``out_path`` (gzip when it ends in ``.gz``)."""
    path = Path(out_path)
    text = json.dumps(to_chrome_trace(trace), separators=(",", ":"))
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path
