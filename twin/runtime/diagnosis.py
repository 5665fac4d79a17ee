"""Wedge diagnosis from the ranks' snapshots: a wait-for graph, its roots first.

Works on any mapping of node id to a rank snapshot (``rank.snapshot()``), so the simulator, a
replay and the hardware mode explain a wedge the same way. Every blocked piece of work (a chunk
on a prefill worker, a decode room waiting for transfer status) points at what it waits for; a
chunk that waits for a watermark pinned by another room's unscattered chunk points at that
chunk in turn. Following the pointers ends at a *root*: a crashed rank, a STAGING_RSP that never
came, a watermark never sent, a stale empty-ring watermark, a leaked allocation, and so on.
``Diagnosis.roots`` lists each root once with how much work waits behind it (largest first), and
names any injected fault on its path; ``details`` keeps one line per blocked piece of work.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from twin.core.allocator import is_watermark_ready
from twin.core.fixes import DROP_LATE_STAGING_REQ
from twin.core.snapshot import (
    DecodeRoomView,
    DecodeSnapshot,
    PrefillSnapshot,
    RankSnapshot,
    StagingInfo,
    TargetView,
)
from twin.core.states import DecodeRoomState
from twin.runtime.faults import parse_fault

RootKey = tuple[object, ...]


@dataclass
class Diagnosis:
    """Roots first (``root: ...`` lines), then one detail line per blocked piece of work."""

    roots: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [*self.roots, *self.details]


@dataclass
class _Root:
    line: str  # may hold ``{subjects}``: the sessions or ranks the root spans
    rooms: set[int] = field(default_factory=set)
    items: int = 0
    fault_rooms: set[int] = field(default_factory=set)
    subjects: set[str] = field(default_factory=set)

    def text(self) -> str:
        return self.line.replace("{subjects}", ", ".join(sorted(self.subjects)))


class _Graph:
    def __init__(self, snapshots: Mapping[str, RankSnapshot], dropped: Mapping[int, list[str]],
                 faults: Mapping[int, list[str]], crashed: Mapping[str, str],
                 restarted: Mapping[str, str]) -> None:
        self.crashed = crashed
        self.restarted = restarted
        self.nodes_of: Mapping[int, tuple[str, ...]] = {}
        self.prefills = {n: s for n, s in snapshots.items() if isinstance(s, PrefillSnapshot)}
        self.decodes = {n: s for n, s in snapshots.items() if isinstance(s, DecodeSnapshot)}
        self.dropped = dropped
        self.faults = faults
        self.roots: dict[RootKey, _Root] = {}
        # (room, chunk_idx, session) -> (prefill node, staging info or None, busy)
        self.chunks: dict[tuple[int, int, str], tuple[str, StagingInfo | None, bool]] = {}
        self._memo: dict[tuple[int, int, str], RootKey] = {}

    def root(self, key: RootKey, line: str, *, fault_room: int | None = None,
             subject: str = "") -> RootKey:
        r = self.roots.get(key)
        if r is None:
            r = self.roots[key] = _Root(line)
        if fault_room is not None:
            r.fault_rooms.add(fault_room)
        if subject:
            r.subjects.add(subject)
        return key

    def crash_root(self, node: str) -> RootKey:
        """The one root of every piece of work that waits on crashed rank ``node``."""
        return self.root(("crash", node), f"{node} crashed: {self.crashed[node]}")

    def listener_root(self, dec: DecodeSnapshot) -> RootKey:
        """The one root of every piece of work that waits on a decode rank whose listener
        thread ended (it handles no frame; its rooms fail at their waiting timeout)."""
        return self.root(("listener", dec.node),
                         f"{dec.node}: {dec.listener_dead}: the rank handles no frame any more "
                         f"(STAGING_REQ, CHUNK_READY, KV_STATUS, ABORT_ACK); each of its rooms "
                         f"fails at its waiting timeout")

    def crashed_of(self, nodes: list[str] | tuple[str, ...]) -> str | None:
        """The first of ``nodes`` that crashed, or None."""
        return next((n for n in nodes if n in self.crashed), None)

    def charge(self, key: RootKey, room: int) -> None:
        r = self.roots[key]
        r.items += 1
        r.rooms.add(room)

    # -- why a chunk write cannot go ---------------------------------------------------------
    def chunk_root(self, room: int, chunk: int, session: str,
                   seen: frozenset[tuple[int, int, str]] = frozenset()) -> RootKey:
        ident = (room, chunk, session)
        if ident in self._memo:
            return self._memo[ident]
        if ident in seen:
            return self.root(("cycle", ident), f"room {room} chunk {chunk} -> {session} waits "
                             f"on itself through the watermark (a cycle)")
        key = self._chunk_root(room, chunk, session, seen | {ident})
        self._memo[ident] = key
        return key

    def late_root(self, node: str, droom: DecodeRoomView) -> RootKey:
        """The root for a room's chunks that ``node`` allocated again after scattering them."""
        chunks = ", ".join(str(i) for i, c in sorted(droom.chunks.items()) if c.late)
        return self.root(("late-staging-req", node, droom.room),
                         f"{node}: room {droom.room}: a STAGING_REQ for chunks {chunks} arrived "
                         f"after they were scattered (it travels on its own socket and was "
                         f"overtaken) and got a fresh allocation that nothing will scatter; it "
                         f"pins the watermark until the waiting timeout fails the room "
                         f"(--fix {DROP_LATE_STAGING_REQ} drops such requests)",
                         fault_room=droom.room)

    def _chunk_root(self, room: int, chunk: int, session: str,
                    seen: frozenset[tuple[int, int, str]]) -> RootKey:
        found = self.chunks.get((room, chunk, session))
        dec = self.decodes.get(session)
        if dec is not None and dec.listener_dead:
            return self.listener_root(dec)
        droom = dec.rooms.get(room) if dec is not None else None
        if found is None and droom is not None and (alloc := droom.chunks.get(chunk)) is not None \
                and alloc.late:
            return self.late_root(session, droom)
        if found is None:
            return self.root(("no-write", room, chunk, session),
                             f"room {room} chunk {chunk}: no prefill worker holds its write to "
                             f"{session} (never queued, or its room was torn down)",
                             fault_room=room)
        node, info, busy = found
        if (dead := self.crashed_of((node, session))) is not None:
            return self.crash_root(dead)
        if busy:
            return self.root(("in-flight", node, room, chunk),
                             f"{node}: the WRITE of room {room} chunk {chunk} to {session} "
                             f"never completed", fault_room=room)
        if info is None:
            why = ""
            for note in self.dropped.get(room, []):
                if "STAGING_REQ" in note:
                    why = f" ({note})"
                    break
            return self.root(("no-rsp", room),
                             f"room {room}: STAGING_RSPs never reached prefill (chunk, decode -> "
                             f"prefill: {{subjects}}){why}", fault_room=room,
                             subject=f"{chunk} {session} -> {node}")
        if info.oversized:
            return self.root(("oversized", room, chunk),
                             f"room {room} chunk {chunk}: the chunk is larger than {session}'s "
                             f"ring (allocation oversized)")
        wm = self.prefills[node].watermarks.get(session, (0, 0))
        if dec is None:
            return self.root(("no-watermark", node, session),
                             f"{node} waits for a watermark from {session}, which is not in this "
                             f"run's snapshots")
        if is_watermark_ready(dec.watermark, info.round, info.end):
            stale = (f"; {node} restarted and decode still counts it as subscribed, so it "
                     f"sent the new session no snapshot (a stale WATERMARK subscriber, sglang "
                     f"PR #36049)" if node in self.restarted else "")
            return self.root(("never-sent", node),
                             f"decode's watermark would admit the waiting chunks of {node} "
                             f"(it knows {wm}) but was never sent to this session "
                             f"(from {{subjects}}){stale}", subject=f"{session} at {dec.watermark}")
        return self.pin_root(dec, seen)

    def pin_root(self, dec: DecodeSnapshot, seen: frozenset[tuple[int, int, str]]) -> RootKey:
        s = dec.node
        if not dec.live:
            return self.root(("empty", s), f"{s}'s ring is empty at watermark {dec.watermark} "
                             f"(head {dec.head}, round {dec.round})")
        a = dec.live[0]
        if (a.round, a.offset) != dec.watermark:
            return self.root(("stale", s), f"{s}'s watermark {dec.watermark} is stale: the ring "
                             f"emptied and its watermark stayed at the old head instead of "
                             f"moving to (round + 1, 0)")
        for room in dec.rooms.values():
            if room.held and (a.alloc_id in room.held_scattered or a.alloc_id in room.scattering
                              or any(c.alloc_id == a.alloc_id for c in room.chunks.values())):
                return self.root(("held", s, room.room),
                                 f"{s}: failed room {room.room} holds its staging until every "
                                 f"prefill rank acknowledged its ABORT ({len(room.acks)} of "
                                 f"{len(room.prefill_ranks)}) or {room.release_at:.3f}s "
                                 f"(deferred decode KV release)")
            if a.alloc_id in room.scattering:
                return self.root(("scatter", s, a.alloc_id),
                                 f"{s}: the scatter of room {room.room} chunk "
                                 f"{room.scattering[a.alloc_id]} never finished")
            for chunk_idx, c in room.chunks.items():
                if c.alloc_id == a.alloc_id:
                    return self.chunk_root(room.room, chunk_idx, s, seen)
        return self.root(("leaked", s, a.alloc_id),
                         f"{s}'s watermark is pinned by alloc {a.alloc_id} of a room that is no "
                         f"longer registered (leaked: never released)")


def _pinning(dec: DecodeSnapshot) -> str:
    """Describe the allocation at the decode watermark (the oldest live one)."""
    wm = dec.watermark
    if not dec.live:
        return f"{dec.node} ring is empty at watermark {wm} (head {dec.head}, round {dec.round})"
    a = dec.live[0]
    if (a.round, a.offset) != wm:
        return (f"{dec.node} watermark {wm} is stale: the oldest live allocation is alloc "
                f"{a.alloc_id} at ({a.round}, {a.offset}); the ring emptied and its watermark "
                f"stayed at the old head instead of moving to (round + 1, 0)")
    owner = "an unregistered room (leaked)"
    for room in dec.rooms.values():
        for chunk_idx, info in room.chunks.items():
            if info.alloc_id == a.alloc_id:
                arrived = room.arrivals.get(chunk_idx, 0)
                owner = (f"room {room.room} chunk {chunk_idx}, unscattered: {arrived} of "
                         f"{len(room.prefill_ranks)} CHUNK_READY arrived")
        if a.alloc_id in room.scattering:
            owner = f"room {room.room} chunk {room.scattering[a.alloc_id]}, scatter in flight"
    return (f"{dec.node} watermark {wm} is pinned by alloc {a.alloc_id} "
            f"[{a.offset}, {a.offset + a.size}) round {a.round}: {owner}")


def crash_reason(fault: str) -> str:
    """Why a rank stopped, for a ``crash:`` or ``restart:`` fault spec ``fault``: the fault and
    when it fired (its ``at=``), as the simulator and a replay both name it."""
    at = parse_fault(fault).at
    return f"crashed by fault {fault} at t={at:g} s" if at is not None else \
        f"crashed by fault {fault}"


def restart_reason(fault: str) -> str:
    """``crash_reason`` of a ``restart:`` fault, and when the rank came back empty."""
    spec = parse_fault(fault)
    back = (spec.at or 0.0) + (spec.down or 0.0)
    return f"{crash_reason(fault)}, restarted with empty state at t={back:g} s"


def _note_fault(notes: dict[int, list[str]], room: int, fault: str, detail: str) -> None:
    """Add fault ``fault`` that fired on ``detail`` to ``notes`` of ``room`` (the ``faults``
    of ``diagnose``): each distinct note once, at most eight per room, none for room -1."""
    if room < 0:
        return
    have = notes.setdefault(room, [])
    note = f"{fault} ({detail})"
    if note not in have and len(have) < 8:
        have.append(note)


def fault_record(notes: dict[int, list[str]], fault: str, detail: str,
                 room: int) -> dict[str, Any]:
    """The ``FaultInjected`` driver record of fault ``fault`` that fired on ``detail``, with the
    ``room`` it touched when one (>= 0), noted in ``notes`` for that room's wedge diagnosis."""
    rec: dict[str, Any] = {"type": "FaultInjected", "fault": fault, "detail": detail}
    if room >= 0:
        rec["room"] = room
    _note_fault(notes, room, fault, detail)
    return rec


def note_fault_record(notes: dict[int, list[str]], d: Mapping[str, Any]) -> None:
    """Note the fault of a recorded ``FaultInjected`` record ``d`` (as ``fault_record`` wrote it)
    in ``notes``; records without a room (older traces, faults on no room) note nothing."""
    room = d.get("room")
    if type(room) is int:
        _note_fault(notes, room, d["fault"], d["detail"])


def diagnose(snapshots: Mapping[str, RankSnapshot], crashed: Mapping[str, str],
             unfinished: set[int], dropped: Mapping[int, list[str]] | None = None,
             faults: Mapping[int, list[str]] | None = None,
             nodes_of: Mapping[int, tuple[str, ...]] | None = None,
             restarted: Mapping[str, str] | None = None) -> Diagnosis:
    """Why ``unfinished`` rooms cannot progress: roots first, then every blocked item.

    ``dropped`` holds the ranks' notes of dropped inputs per room; ``faults`` the injected
    faults that touched each room (named on the root they lie on); ``nodes_of`` the ranks
    each room was placed on, when the driver knows it: an unfinished room no rank holds
    (it arrived at a crashed rank, which handles nothing) is charged to a crashed one;
    ``restarted`` the ranks that crashed and came back empty: a room waiting for the status of
    one that no longer knows the room was lost in that restart (one root per restart).
    """
    g = _Graph(snapshots, dropped or {}, faults or {}, crashed, restarted or {})
    g.nodes_of = nodes_of or {}
    details: list[str] = [f"{node} crashed: {why}" for node, why in sorted(crashed.items())]
    for node in sorted(crashed):
        g.charge(g.crash_root(node), -1)
    for node, snap in g.prefills.items():
        for w in snap.workers:
            for c in ([w.busy] if w.busy else []) + list(w.queue):
                room = snap.rooms.get(c.room)
                if room is None:
                    continue
                for t in room.targets:
                    g.chunks.setdefault((c.room, c.chunk_idx, t.session),
                                        (node, t.staging.get(c.chunk_idx), c is w.busy))
    for node, snap in sorted(g.prefills.items()):
        for wi, w in enumerate(snap.workers):
            seen: set[tuple[int, int]] = set()
            for c in ([w.busy] if w.busy else []) + list(w.queue):
                if c.room not in unfinished or (c.room, c.page_start) in seen:
                    continue
                seen.add((c.room, c.page_start))
                room = snap.rooms.get(c.room)
                if room is None:
                    continue
                line = _chunk_line(g, node, wi, c.chunk_idx, c.room, room.targets, c is w.busy)
                if line is None:
                    continue
                text, session = line
                details.append(text)
                g.charge(g.chunk_root(c.room, c.chunk_idx, session), c.room)
    for node, dec in sorted(g.decodes.items()):
        for droom in sorted(dec.rooms.values(), key=lambda r: r.room):
            if droom.room not in unfinished:
                continue
            if node in crashed:
                details.append(f"{node}: room {droom.room} sits on a crashed rank")
                key = g.crash_root(node)
            elif dec.listener_dead:
                details.append(f"{node}: room {droom.room} sits on a rank whose listener "
                               f"thread ended")
                key = g.listener_root(dec)
            elif not droom.registered:
                details.append(f"{node}: room {droom.room} is not registered yet")
                key = g.root(("unregistered", node, droom.room),
                             f"{node}: room {droom.room} was never registered")
            elif droom.state is DecodeRoomState.WAITING:
                missing = sorted(set(droom.prefill_ranks) - droom.success_ranks)
                details.append(f"{node}: room {droom.room} waits for transfer status from "
                               f"{', '.join(missing)}")
                key = _status_root(g, node, droom.room, missing)
            elif late := sorted(i for i, c in droom.chunks.items() if c.late):
                chunks = ", ".join(str(c) for c in late)
                details.append(f"{node}: room {droom.room} has all-ranks Success but chunks "
                               f"{chunks} were allocated again after they had been scattered")
                key = g.late_root(node, droom)
            elif droom.chunks:
                chunks = ", ".join(str(c) for c in sorted(droom.chunks))
                details.append(f"{node}: room {droom.room} has all-ranks Success but chunks "
                               f"{chunks} were never scattered (no CHUNK_READY)")
                key = g.root(("no-chunk-ready", node, droom.room),
                             f"{node}: room {droom.room} chunks {chunks} never got their "
                             f"CHUNK_READY", fault_room=droom.room)
            else:
                continue
            g.charge(key, droom.room)
    held = {r for snap in snapshots.values() for r in snap.rooms}
    unheld: list[int] = []
    for rid in sorted(unfinished - held):
        dead = g.crashed_of((nodes_of or {}).get(rid, ()))
        if dead is None:
            unheld.append(rid)
        else:
            details.append(f"room {rid} was placed on crashed rank {dead}")
            g.charge(g.crash_root(dead), rid)
    roots = _root_lines(g)
    if unheld:
        # Not a root of their own: the driver holds them back (no KV pool pages or no
        # concurrency slot) while the rooms above hold theirs.
        roots.append(f"queued: {len(unheld)} unfinished room(s) are held by no rank (rooms "
                     f"{', '.join(str(r) for r in unheld[:8])}{', ...' if len(unheld) > 8 else ''}"
                     f"): not admitted yet, they wait for what the rooms above hold")
    return Diagnosis(roots=roots, details=details)


def _chunk_line(g: _Graph, node: str, wi: int, chunk_idx: int, room: int,
                targets: tuple[TargetView, ...],
                busy: bool) -> tuple[str, str] | None:
    """The detail line of one blocked chunk and the session it waits on (first blocking one)."""
    for t in targets:
        info = t.staging.get(chunk_idx)
        head = f"{node} worker {wi}: room {room} chunk {chunk_idx} -> {t.session}"
        if busy:
            return f"{head}: WRITE in flight", t.session
        if info is None:
            why = "waits for its allocation (no STAGING_RSP)"
            for note in g.dropped.get(room, []):
                if "STAGING_REQ" in note:
                    why += f"; {note}"
                    break
            return f"{head}: {why}", t.session
        if info.oversized:
            return f"{head}: allocation oversized", t.session
        wm = g.prefills[node].watermarks.get(t.session, (0, 0))
        if not is_watermark_ready(wm, info.round, info.end):
            line = (f"{head}: waits for watermark: needs round {info.round} end {info.end}, "
                    f"prefill knows {wm}")
            dec = g.decodes.get(t.session)
            if dec is not None:
                if is_watermark_ready(dec.watermark, info.round, info.end):
                    line += (f"; decode's watermark {dec.watermark} would admit it but was "
                             f"never sent to this session")
                else:
                    line += f"; {_pinning(dec)}"
            return line, t.session
    return None


def _status_root(g: _Graph, node: str, room: int, missing: list[str]) -> RootKey:
    """A decode room waiting for transfer status waits on the first blocked chunk of a missing
    prefill rank, or, if none holds one, on the rank that never wrote; on a crashed one first
    (a crashed rank is the one root of every room that waits on it, not one root per room)."""
    if (dead := g.crashed_of(missing)) is not None:
        return g.crash_root(dead)
    # A restarted rank that lost the room: a writer of this rank's, or any prefill rank of the
    # room's group (the group's forward and bootstrap wait for every rank).
    for p in (*missing, *g.nodes_of.get(room, ())):
        snap = g.prefills.get(p)
        if p in g.restarted and snap is not None and room not in snap.rooms:
            return g.root(("restart", p), f"{p} {g.restarted[p]}: the rooms it held when it "
                          f"crashed are lost (no transfer status will come; decode fails each "
                          f"at its waiting timeout)")
    for (r, chunk, session), (pnode, _, _) in sorted(g.chunks.items()):
        if r == room and pnode in missing and session == node:
            return g.chunk_root(r, chunk, session)
    dropped = {n.split(" dropped metadata: ", 1)[0]: n.split(": ", 1)[1]
               for n in g.dropped.get(room, []) if " dropped metadata: " in n}
    if missing and all(p in dropped for p in missing):
        # One root for every room whose metadata prefill turned away, by the reason it gave
        reason = dropped[missing[0]]
        return g.root(("metadata-dropped", reason),
                      f"prefill dropped decode's metadata ({reason}): those rooms will get no "
                      f"transfer status, and decode fails each at its waiting timeout "
                      f"(SGLANG_DISAGGREGATION_WAITING_TIMEOUT). Prefill has failed a room "
                      f"before its metadata arrives when its bootstrap timeout "
                      f"(SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT) fired first, as when decode "
                      f"admits requests later than that (its KV pool full under overload), or "
                      f"when the room was aborted", fault_room=room)
    return g.root(("no-status", room), f"room {room}: {', '.join(missing)} never reported a "
                  f"transfer status and holds no chunk of it", fault_room=room)


def _root_lines(g: _Graph) -> list[str]:
    out = []
    ranked = sorted(g.roots.values(), key=lambda r: (-r.items, r.line))
    for r in ranked:
        if r.items == 0:
            continue
        rooms = sorted(x for x in r.rooms if x >= 0)
        behind = (f"{r.items - (-1 in r.rooms)} blocked item(s) of {len(rooms)} room(s) wait "
                  f"on it" if rooms else "")
        line = f"root: {r.text()}" + (f" [{behind}]" if behind else "")
        fired: dict[str, int] = {}
        for room in sorted(r.fault_rooms):
            for note in g.faults.get(room, []):
                name = note.split(" (", 1)[0]
                fired[name] = fired.get(name, 0) + 1
        if fired:
            line += "; injected fault on this path: " + ", ".join(
                f"{name} (fired on {n} message(s))" for name, n in sorted(fired.items()))
        out.append(line)
    return out
