"""What a trial reached: the explorer's coverage keys, and the safety checks read off effects.

``CoverageRecorder`` is a run's recorder (the runtime hands it every input and its effects). It
collects keys in four families, each with a known universe so a campaign can say how much it
reached of the total:

* ``tr:``  room state x trigger pairs of ``twin/core/states.py`` (both transition tables),
  observed through ``states.observe`` for the run (``observe_transitions``; compiled ranks
  report too);
* ``fx:``  effect kinds, per side;
* ``al:``  allocator situations on a decode ring: allocating into an empty ring, wrapping to
  the next round, an oversized chunk, the ring filling up (a write deferred behind the
  watermark), freeing to empty, a stale watermark (an allocation into an empty ring that the
  ring's own watermark says is not free yet);
* ``dr:``  deferral reasons (allocation pending, watermark behind);
* ``ft:``  faults that fired, by action and frame kind (``ft:fail-send:CHUNK_READY``,
  ``ft:crash``): the fault kinds the explorer draws (``FAULT_KEYS``), so generation can prefer
  the ones no trial has fired yet.

It also checks two safety properties on the decode effects as they happen: live staging
allocations never overlap, and a decode rank's watermark never moves backwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from twin.core import events as ev
from twin.core import states
from twin.core.allocator import ALLOC_OVERSIZED, is_watermark_ready
from twin.runtime.faults import SENDER, in_scope, parse_fault

FRAME_FAULTS = tuple((action, kind) for action in ("drop", "delay", "dup", "reorder",
                                                   "fail-send")
                     for kind in sorted(SENDER)
                     if action != "fail-send" or SENDER[kind] == "prefill")
"""The frame faults the explorer draws: every message action on every frame kind, except a
``fail-send`` of a frame decode sends (the twin models only a prefill send that raises) and
``corrupt`` (a malformed peer, not a fault of the protocol's environment; give it with
``--fault``-style scenarios instead)."""
TIMED_FAULTS = ("fail-transfer", "crash", "restart", "abort")

TRANSITION_KEYS = tuple(
    [f"tr:prefill:{s.value}>{t.name}" for s, t in states.PREFILL_TRANSITIONS]
    + [f"tr:decode:{s.value}>{t.name}" for s, t in states.DECODE_TRANSITIONS])
PREFILL_EFFECTS = ("Send", "StartTransfer", "Deferred", "WakeWorkers", "WorkerIdle",
                   "ChunkQueued", "ChunkSkipped", "TargetsKnown", "RoomConcluded",
                   "RoomTornDown", "Dropped", "SetTimer")
DECODE_EFFECTS = ("Send", "SendMetadata", "Allocated", "Freed", "WatermarkMoved", "StartScatter",
                  "GroupPoll", "RoomHeld", "RoomReleased", "RoomConcluded", "Dropped",
                  "SetTimer")
EFFECT_KEYS = tuple([f"fx:prefill:{n}" for n in PREFILL_EFFECTS]
                    + [f"fx:decode:{n}" for n in DECODE_EFFECTS])
ALLOC_KEYS = ("al:alloc-empty", "al:alloc-wrap", "al:alloc-oversized", "al:ring-full",
              "al:free-to-empty", "al:stale-watermark")
DEFER_KEYS = ("dr:allocation-pending", "dr:watermark-behind")
FAULT_KEYS = tuple([f"ft:{a}:{k}" for a, k in FRAME_FAULTS] + [f"ft:{a}" for a in TIMED_FAULTS])
UNIVERSE = {"transitions": TRANSITION_KEYS, "effects": EFFECT_KEYS, "allocator": ALLOC_KEYS,
            "deferrals": DEFER_KEYS, "faults": FAULT_KEYS}


def fault_key(text: str) -> str:
    """The ``ft:`` key of a fault spec's text (``drop:STAGING_RSP:nth=2`` -> ``ft:drop:STAGING_RSP``)."""
    parts = text.split(":")
    if parts[0] in TIMED_FAULTS or len(parts) < 2:
        return f"ft:{parts[0]}"
    return f"ft:{parts[0]}:{parts[1]}"


def family(key: str) -> str | None:
    for name, keys in UNIVERSE.items():
        if key[:3] == keys[0][:3]:
            return name
    return None


def coverage_report(keys: set[str] | frozenset[str], faults: tuple[str, ...] = FAULT_KEYS
                    ) -> dict[str, tuple[int, int]]:
    """Per family: (reached, total); ``faults``: the fault kinds the campaign draws."""
    universes = {**UNIVERSE, "faults": faults}
    return {name: (len(keys & set(universe)), len(universe))
            for name, universe in universes.items()}


class CoverageRecorder:
    """A recorder for ``run_sim`` that keeps coverage keys and a short event log (for the
    finding's story), and checks allocation overlap and watermark monotonicity."""

    def __init__(self, ring_bytes: int, log_limit: int = 0, tap: Any = None) -> None:
        self.ring = ring_bytes
        self.tap = tap  # another recorder that hears every record too (``run_trial``'s tap)
        self.keys: set[str] = set()
        self.safety: list[str] = []
        self.failed: dict[int, str] = {}  # room -> the first reason a decode rank failed it
        self.log: list[tuple[float, str, str]] = []
        self.log_limit = log_limit
        self._live: dict[str, dict[int, tuple[int, int, int]]] = {}  # node -> id -> span, room
        self._wm: dict[str, tuple[int, int]] = {}
        self._round: dict[str, int] = {}

    def write_input(self, t: float, node: str, event: ev.Input) -> None:
        if self.tap is not None:
            self.tap.write_input(t, node, event)
        if self.log_limit and len(self.log) < self.log_limit:
            text = _input_text(event)
            if text:
                self.log.append((t, node, text))

    def write_effects(self, t: float, node: str, effects: list[ev.Effect]) -> None:
        if self.tap is not None:
            self.tap.write_effects(t, node, effects)
        role = "decode" if node.startswith("d") else "prefill"
        keys = self.keys
        for e in effects:
            name = type(e).__name__
            keys.add(f"fx:{role}:{name}")
            if role == "decode":
                self._decode_effect(t, node, e)
            elif type(e) is ev.Deferred:
                keys.add("dr:allocation-pending" if e.reason.startswith("allocation")
                         else "dr:watermark-behind")
                if not e.reason.startswith("allocation"):
                    keys.add("al:ring-full")
            if self.log_limit and len(self.log) < self.log_limit:
                text = _effect_text(e)
                if text:
                    self.log.append((t, node, text))

    def write_sys(self, t: float, node: str, record: dict[str, Any]) -> None:
        if self.tap is not None:
            self.tap.write_sys(t, node, record)
        if record.get("type") == "FaultInjected":
            text = str(record.get("fault", ""))
            self.keys.add(fault_key(text))
            if text.startswith(("crash:", "restart:")):
                self._forget(text)
        if self.log_limit and len(self.log) < self.log_limit and \
                record.get("type") == "FaultInjected":
            self.log.append((t, node, f"fault {record.get('fault')}: "
                             f"{record.get('detail', '')}".strip()))

    def _forget(self, fault: str) -> None:
        """A crash or restart fault fired: the ranks it took down start again from nothing (a
        restarted decode rank's ring is a new one, at round 0 with watermark (0, 0)), so their
        allocations and watermark are no longer held against what they do next."""
        spec = parse_fault(fault)
        for nodes in (self._live, self._wm, self._round):
            for n in [n for n in nodes if in_scope(spec, n)]:
                del nodes[n]

    def _decode_effect(self, t: float, node: str, e: ev.Effect) -> None:
        live = self._live.setdefault(node, {})
        if type(e) is ev.Allocated:
            if e.offset == ALLOC_OVERSIZED or e.offset < 0:
                self.keys.add("al:alloc-oversized")
                return
            if not live:
                self.keys.add("al:alloc-empty")
                if not is_watermark_ready(self._wm.get(node, (0, 0)), e.round,
                                          e.offset + e.size):
                    # Nothing else is live, yet the watermark says the region is not free.
                    self.keys.add("al:stale-watermark")
            if e.round > self._round.get(node, 0) and e.offset == 0:
                self.keys.add("al:alloc-wrap")
            self._round[node] = max(self._round.get(node, 0), e.round)
            a = e.round * self.ring + e.offset
            b = a + e.size
            for other, (s, f, room) in live.items():
                if s < b and a < f:
                    self.safety.append(
                        f"overlap: {node} allocation {e.alloc_id} (room {e.room}) [{a}, {b}) "
                        f"overlaps live allocation {other} (room {room}) [{s}, {f})")
            live[e.alloc_id] = (a, b, e.room)
        elif type(e) is ev.Freed:
            if live.pop(e.alloc_id, None) is not None and not live:
                self.keys.add("al:free-to-empty")
        elif type(e) is ev.RoomConcluded:
            if e.status == "Failed":
                self.failed.setdefault(e.room, e.reason or "failed")
        elif type(e) is ev.WatermarkMoved:
            prev = self._wm.get(node, (0, 0))
            wm = (e.round, e.tail)
            if wm < prev:
                self.safety.append(f"watermark: {node} moved backwards {prev} -> {wm}")
            self._wm[node] = max(prev, wm)


def _input_text(e: ev.Input) -> str:
    if type(e) is ev.MessageArrived:
        return f"<- {type(e.msg).__name__} from {e.src}: {_fields(e.msg)}"
    if type(e) in (ev.SendKV, ev.RoomAborted, ev.TransferDone, ev.ScatterDone, ev.SendFailed):
        return f"{type(e).__name__} {_fields(e)}"
    return ""


def _effect_text(e: ev.Effect) -> str:
    name = type(e).__name__
    if type(e) is ev.Send:
        return f"-> {type(e.msg).__name__} to {e.dst}: {_fields(e.msg)}"
    if name in ("Allocated", "Freed", "WatermarkMoved", "StartTransfer", "StartScatter",
                "Deferred", "RoomConcluded", "Dropped", "RankCrashed"):
        return f"{name} {_fields(e)}"
    return ""


_SKIP = {"session_id", "prefill_attn_tp", "writer_bytes", "decode_rank", "worker", "staged"}


def _fields(obj: Any) -> str:
    names = getattr(obj, "__slots__", ())
    parts = []
    for n in names:
        if n in _SKIP:
            continue
        v = getattr(obj, n, None)
        if v in (None, "", ()):
            continue
        parts.append(f"{n}={v}")
    return " ".join(parts)


@contextlib.contextmanager
def observe_transitions(keys: set[str]) -> Iterator[None]:
    """Within the block, every room transition the ranks take (compiled or pure) adds its
    ``tr:`` key."""
    pairs: set[tuple[object, object]] = set()
    before = states.observe(pairs)
    try:
        yield
    finally:
        states.observe(before)
        for state, trigger in pairs:
            side = "prefill" if isinstance(state, states.PrefillRoomState) else "decode"
            keys.add(f"tr:{side}:{state.value}>{trigger.name}")  # type: ignore[attr-defined]
