"""Would SGLang 0.5.23 meet this finding? The exposure label of a finding.

A finding may need a defect switch (an upstream bug fixed before 0.5.23) or come from a
proposed fix (a change beyond 0.5.23); the core's defaults are 0.5.23's behaviour. Two checks
answer the question, both deterministic:

a. **The twin with SGLang's behaviour.** The finding's shrunk trial runs again with no defect
   and no fix on. Does the same verdict class still occur (``corrupted``: corruption or an
   unsafe allocator state; ``wedged``: a wedge, a livelock or a leak; ``failed-without-cause``)?
   If not, the switch that made the difference is named: the defects the finding needs, or
   the one switch that brings the verdict back when turned on alone over SGLang's defaults.
b. **Against the wheel, where the decode differential can.** Each decode rank's inputs of that
   run (rooms, frames, scatter completions, its TP group's polls, aborts, time) are fed to
   SGLang 0.5.23's own decode code from the wheel (``twin/reference/decode_machine.py``), which
   must decide what the twin's rank decided, input by input, to the end: the frames sent
   (STAGING_RSP, WATERMARK; not ABORT), the scatters submitted, the allocations freed and the
   rooms concluded. Where the adapter cannot follow (a room held for deferred release, a
   crashed or restarted decode rank, an input it does not model, a switch on), the check says
   so ("unchecked on decode: why"); it never guesses.

The label (``Exposure``): ``exposed`` (a and b agree: SGLang 0.5.23 meets it), ``not exposed``
(with SGLang's behaviour the verdict goes; the detail names the switch), or ``unchecked`` (the
detail says why: the wheel unavailable, a decode rank the adapter cannot follow to the end,
the twin's decode and SGLang's differing, the twin itself raising). The prefill side is not
checked against the wheel (no prefill adapter yet; docs/fidelity.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twin.core import events as ev
from twin.core import wire
from twin.core.config import TwinConfig
from twin.core.topology import Topology
from twin.explore.oracles import TrialResult, run_trial
from twin.explore.trial import Base, Trial
from twin.reference.sglang_wheel import SGLANG_VERSION as SGLANG

EXPOSED = "exposed"
NOT_EXPOSED = "not exposed"
UNCHECKED = "unchecked"

_CLASS = {"corrupted": "corrupted", "unsafe": "corrupted", "wedged": "wedged",
          "livelock": "wedged", "leak": "wedged"}


def verdict_class(kind: str) -> str:
    """A finding kind's verdict class: ``corrupted`` (corruption, an unsafe allocator state),
    ``wedged`` (a wedge, a livelock, a leak), else the kind itself (``failed-without-cause``,
    ``error``, ``crashed``)."""
    head = kind.split(":", 1)[0]
    return _CLASS.get(head, head)


@dataclass(frozen=True)
class Exposure:
    """A finding's exposure label and why."""

    label: str
    detail: str

    def to_json(self) -> dict[str, str]:
        return {"label": self.label, "detail": self.detail}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Exposure:
        return cls(str(d["label"]), str(d.get("detail", "")))

    def text(self) -> str:
        return f"{self.label} ({self.detail})" if self.detail else self.label


def sglang_base(base: Base) -> Base:
    """``base`` as SGLang 0.5.23 runs it: no defect, no fix (coverage off: not needed)."""
    return Base(base.cfg.replace(fixes=()), base.params, (), coverage=False)


def _ends(res: TrialResult) -> str:
    if res.signature is None:
        return f"{res.status} with no finding"
    return f"{res.signature[0]} ({res.signature[1]})"


def exposure(base: Base, trial: Trial, kind: str, *, needs_defects: tuple[str, ...] = (),
             should_stop: Callable[[], bool] | None = None,
             note: Callable[[str], None] | None = None) -> Exposure:
    """The exposure label of a finding of ``kind`` whose shrunk trial is ``trial`` (found with
    ``base``'s defects and fixes; ``needs_defects``: the defects it needs). ``should_stop``
    cuts the search for the switch that made a difference short (the label stays, the
    detail says so); ``note`` hears of a wheel download before it starts (stderr by
    default)."""
    want = verdict_class(kind)
    if want in ("error", "crashed"):
        return Exposure(UNCHECKED, "the twin itself raised on this trial (or a worker died): a "
                                   "bug of the twin, not a protocol verdict")
    plain = sglang_base(base)
    log = DecodeLog()
    res = run_trial(plain, trial, tap=log)
    got = verdict_class(res.signature[0]) if res.signature else None
    if got == "error":
        return Exposure(UNCHECKED, f"with SGLang's behaviour (no defect, no fix) the twin "
                                   f"itself raised: {res.signature[1] if res.signature else ''}")
    if got != want and not base.defects and not base.cfg.fixes:
        return Exposure(UNCHECKED, f"no defect or fix was on, yet the shrunk trial run again "
                                   f"ends {_ends(res)}: it does not show its verdict again")
    if got != want:
        why = _difference(base, trial, want, needs_defects, should_stop)
        other = " instead (another verdict, not this one)" if got else ""
        return Exposure(NOT_EXPOSED, f"with SGLang's behaviour (no defect, no fix) it ends "
                                     f"{_ends(res)}{other}; {why}")
    same = f"with SGLang's behaviour (no defect, no fix) it still ends {_ends(res)}"
    check = check_decode(plain.config(trial), log, note=note)
    if check.unavailable:
        return Exposure(UNCHECKED, f"SGLang {SGLANG} wheel unavailable: {check.unavailable}; "
                                   f"{same}")
    if check.differs:
        return Exposure(UNCHECKED, f"{same}; the twin's decode and SGLang {SGLANG}'s differ: "
                                   f"{check.differs}")
    if check.unchecked:
        return Exposure(UNCHECKED, f"{same}; unchecked on decode: {check.unchecked_text()} "
                                   f"({check.agreed_text()})")
    return Exposure(EXPOSED, f"{same}; SGLang {SGLANG}'s decode code from the wheel made the "
                             f"same decisions ({check.agreed_text()})")


def _difference(base: Base, trial: Trial, want: str, needs: tuple[str, ...],
                should_stop: Callable[[], bool] | None) -> str:
    """Which switch made the difference between the finding and SGLang's behaviour."""
    if needs:
        return (f"it needs defect{'s' if len(needs) > 1 else ''} {', '.join(needs)} (fixed "
                f"upstream before {SGLANG})")
    switches = [("defect", d) for d in sorted(base.defects)] + \
        [("fix", f) for f in sorted(base.cfg.fixes)]
    plain = sglang_base(base)
    for what, name in switches:
        if should_stop is not None and should_stop():
            return (f"the switches on were {', '.join(n for _, n in switches)} (out of time "
                    f"before naming the one)")
        one = Base(plain.cfg.replace(fixes=(name,)) if what == "fix" else plain.cfg,
                   plain.params, (name,) if what == "defect" else (), coverage=False)
        res = run_trial(one, trial, defects=one.defects)
        if res.signature is not None and verdict_class(res.signature[0]) == want:
            where = "fixed upstream" if what == "defect" else f"not in {SGLANG}"
            return f"{what} {name} ({where}) alone brings it back"
    return (f"no single switch brings it back; it needs {', '.join(n for _, n in switches)} "
            f"together")


# -- (b) the decode ranks against the wheel ---------------------------------------------------


class DecodeLog:
    """A ``run_trial`` tap keeping every decode rank's inputs with their effects, in order, and
    where crash and restart faults took decode ranks down and brought them back empty."""

    def __init__(self) -> None:
        self.steps: dict[str, list[tuple[float, Any, list[Any]]]] = {}
        # (time, "down" and the fault's text or "up" and the node, each known rank's step count)
        self._marks: list[tuple[float, str, str, dict[str, int]]] = []

    def clear(self) -> None:
        self.steps.clear()
        self._marks.clear()

    def write_input(self, t: float, node: str, event: Any) -> None:
        if node.startswith("d"):
            self.steps.setdefault(node, []).append((t, event, []))

    def write_effects(self, t: float, node: str, effects: list[Any]) -> None:
        steps = self.steps.get(node)
        if steps:
            steps[-1][2].extend(effects)

    def write_sys(self, t: float, node: str, record: dict[str, Any]) -> None:
        kind = record.get("type")
        text = str(record.get("fault" if kind == "FaultInjected" else "text", ""))
        if kind == "FaultInjected" and text.startswith(("crash:", "restart:")):
            self._marks.append((t, "down", text, self._where()))
        elif kind == "Note" and text.endswith(" restarted with empty state"):
            self._marks.append((t, "up", text.split()[0], self._where()))

    def _where(self) -> dict[str, int]:
        return {n: len(s) for n, s in self.steps.items()}

    def timeline(self, node: str) -> list[tuple[float, Any, list[Any]]]:
        """``node``'s steps with ``Down(fault)`` and ``Up()`` marks where a crash or restart
        fault took it down and where it came back with empty state."""
        from twin.runtime.faults import in_scope, parse_fault

        out = list(self.steps.get(node, []))
        inserts: list[tuple[int, int, tuple[float, Any, list[Any]]]] = []
        for order, (t, kind, text, where) in enumerate(self._marks):
            if kind == "down" and in_scope(parse_fault(text.split(";")[0]), node):
                inserts.append((where.get(node, 0), order, (t, Down(text), [])))
            elif kind == "up" and text == node:
                inserts.append((where.get(node, 0), order, (t, Up(), [])))
        for at, _, mark in sorted(inserts, key=lambda x: (-x[0], -x[1])):
            out.insert(at, mark)
        return out


@dataclass(frozen=True)
class Down:
    """A timeline mark: a crash or restart fault took the rank down."""

    fault: str


@dataclass(frozen=True)
class Up:
    """A timeline mark: the rank came back with empty state (a restart)."""


@dataclass
class DecodeCheck:
    """What feeding a run's decode ranks to SGLang's code showed."""

    unavailable: str = ""  # why the wheel could not be had
    differs: str = ""  # the first input where SGLang decided otherwise
    # Ranks not followed to the end: (rank and where it stopped, why); ("", why) for all.
    unchecked: list[tuple[str, str]] = field(default_factory=list)
    agreed: dict[str, int] = field(default_factory=dict)  # rank -> inputs that agreed
    ranks: int = 0
    notes: list[str] = field(default_factory=list)  # ranks a fault took down or restarted

    def agreed_text(self) -> str:
        n = sum(self.agreed.values())
        return (f"{n} input(s) of {self.ranks} decode rank(s) agreed"
                + (f"; {', '.join(self.notes)}" if self.notes else ""))

    def unchecked_text(self) -> str:
        """Why, each reason once, with the ranks (and where each stopped) it stopped."""
        by_why: dict[str, list[str]] = {}
        for where, why in self.unchecked:
            by_why.setdefault(why, []).append(where)
        return "; ".join(f"{', '.join(w for w in wheres if w)}: {why}" if any(wheres) else why
                         for why, wheres in by_why.items())


_POLLS = {"Success": 4, "Failed": 0}  # the twin's shared polls -> KVPoll


def check_decode(cfg: TwinConfig, log: DecodeLog, *, defects: tuple[str, ...] = (),
                 note: Callable[[str], None] | None = None) -> DecodeCheck:
    """Feed every decode rank's inputs in ``log`` (a run of ``cfg`` with ``defects`` on) to
    SGLang 0.5.23's decode code and compare its decisions with the twin's, input by input."""
    from twin.reference.decode_machine import SglangDecodeRank
    from twin.reference.sglang_wheel import ReferenceUnavailable, load, say_on_stderr

    out = DecodeCheck(ranks=len(log.steps))
    try:
        load(note or say_on_stderr)
    except ReferenceUnavailable as exc:
        out.unavailable = str(exc).splitlines()[0][:300]
        return out
    why_not = _unfollowable(cfg, defects)
    if why_not:
        out.unchecked = [("", why_not)]
        return out
    topo = Topology(cfg)

    def fresh(node: str) -> Any:
        return SglangDecodeRank(
            ring_bytes=cfg.ring_bytes, page_size=cfg.page_size,
            decode_tp=cfg.decode.attn_tp_size, tp_rank=topo.nodes[node].rank,
            total_kv_heads=cfg.model.num_kv_heads, head_bytes=cfg.bytes_per_head_token,
            num_layers=cfg.model.num_layers, timeout_s=cfg.waiting_timeout_s,
            note=note or say_on_stderr)

    for node in sorted(log.steps):
        try:
            agreed, where, stop, notes = _follow(cfg, topo, node, fresh, log.timeline(node))
        except ReferenceUnavailable as exc:
            out.unavailable = str(exc).splitlines()[0][:300]
            return out
        out.agreed[node] = agreed
        out.notes += [f"{node} {n}" for n in notes]
        if stop.startswith("differ:"):
            out.differs = f"{node} {where}: {stop.removeprefix('differ:')}"
            return out
        if stop:
            out.unchecked.append((f"{node} from {where}", stop))
    return out


def _unfollowable(cfg: TwinConfig, defects: tuple[str, ...]) -> str:
    """Why no decode rank of ``cfg`` can be followed at all, or ""."""
    if defects:
        return f"defects on ({', '.join(defects)}): the wheel is {SGLANG}, which has them fixed"
    if cfg.fixes:
        return f"fixes on ({', '.join(cfg.fixes)}): the wheel is {SGLANG}, without them"
    if cfg.decode.pp_size > 1:
        return "decode PP > 1: the adapter drives one decode stage"
    return ""


def _follow(cfg: TwinConfig, topo: Topology, node: str, fresh: Callable[[str], Any],
            steps: list[tuple[float, Any, list[Any]]]) -> tuple[int, str, str, list[str]]:
    """Feed ``node``'s timeline to SGLang's code (a fresh rank from ``fresh``, again after a
    restart): (inputs that agreed, where it stopped, why: "" at the end, ``differ:`` and what
    where SGLang decided otherwise; what a crash or restart did to the rank)."""
    sgl = fresh(node)
    agreed = 0
    down = ""
    notes: list[str] = []
    inputs = sum(1 for _, e, _ in steps if not isinstance(e, (Down, Up)))
    for t, event, effects in steps:
        if isinstance(event, Down):
            down = event.fault
            notes.append(f"went down at {t * 1e3:.3f} ms ({event.fault})")
            continue
        if isinstance(event, Up):
            sgl, down = fresh(node), ""  # the process came back empty: so does SGLang's
            notes.append(f"came back empty at {t * 1e3:.3f} ms, checked as a fresh rank")
            continue
        where = f"input {agreed + 1} of {inputs} (t={t * 1e3:.3f} ms, {_name(event)})"
        if down:
            # A dead rank handles nothing (the twin's answers are Dropped); neither would
            # SGLang's dead process.
            agreed += 1
            continue
        for e in effects:
            if isinstance(e, ev.RoomHeld):
                return agreed, where, ("a failed room held for deferred KV release (the "
                                       "adapter concludes with deferred release off: the "
                                       "scheduler's hold is not loaded code)"), notes
            if isinstance(e, ev.RankCrashed):
                return agreed, where, f"the twin's rank crashed ({e.reason[:80]})", notes
        sgl.at(t)
        try:
            skip = _feed(cfg, topo, node, sgl, t, event)
        except Exception as exc:  # SGLang's code raised where the twin did not
            return agreed, where, (f"differ:SGLang's code raised {type(exc).__name__}: "
                                   f"{exc}")[:300], notes
        if skip:
            return agreed, where, skip, notes
        frames, scatters, freed, concluded = sgl.drain()
        got = {
            "frames": sorted((e.dst, wire.encode(e.msg)) for e in effects
                             if isinstance(e, ev.Send) and not isinstance(e.msg, wire.Abort)),
            "scatters": [(e.room, e.chunk_idx, e.offset, e.page_start, e.num_pages)
                         for e in effects if isinstance(e, ev.StartScatter)],
            "freed": [e.alloc_id for e in effects if isinstance(e, ev.Freed)],
            "concluded": [(e.room, e.status) for e in effects
                          if isinstance(e, ev.RoomConcluded)],
        }
        want = {"frames": sorted((d, f) for d, f in frames if f[0] != b"ABORT"),
                "scatters": scatters, "freed": freed, "concluded": concluded}
        for key in got:
            if got[key] != want[key]:
                return agreed, where, (f"differ:{key}: the twin {_short(got[key])}, SGLang "
                                       f"{_short(want[key])}"), notes
        agreed += 1
    return agreed, "", "", notes


def _feed(cfg: TwinConfig, topo: Topology, node: str, sgl: Any, t: float, e: Any) -> str:
    """Hand input ``e`` to ``sgl``; "" or why the adapter cannot follow it."""
    kind = type(e)
    if kind is ev.MessageArrived:
        msg = e.msg
        if isinstance(msg, wire.StagingReq):
            sgl.on_staging_req(wire.encode(msg))
        elif isinstance(msg, wire.ChunkReady):
            sgl.on_chunk_ready(wire.encode(msg))
        elif isinstance(msg, wire.TransferStatus):
            sgl.on_status(msg.room, int(msg.status), msg.prefill_rank)
        else:
            return f"a {type(msg).__name__} frame, which the adapter does not model"
    elif kind is ev.DecodeRoomInit:
        ranks = [topo.nodes[p] for p in e.prefill_ranks]
        sgl.on_room(e.room, list(e.prefill_ranks), [p.unique_rank for p in ranks],
                    e.prefill_attn_tp, e.decode_prefix_len, pp_ranks=[p.pp_rank for p in ranks],
                    pp_size=cfg.prefill.pp_size, peers=tuple(g for g in e.group if g != node),
                    staged=cfg.stage_equal_tp or e.prefill_attn_tp != cfg.decode.attn_tp_size)
    elif kind is ev.ScatterDone:
        sgl.on_scatter_done(e.alloc_id)
    elif kind is ev.Tick:
        sgl.on_time(t)
    elif kind is ev.RoomAborted:
        sgl.on_abort(e.room)
    elif kind is ev.PeerPolled:
        poll = _POLLS.get(e.poll)
        if poll is None:
            return f"peer poll {e.poll!r} (deferred release), which the adapter does not model"
        sgl.on_peer_poll(e.room, e.peer, poll)
    else:
        return f"input {kind.__name__}, which the adapter does not model"
    return ""


def _name(e: Any) -> str:
    if type(e) is ev.MessageArrived:
        return f"{type(e.msg).__name__} from {e.src}"
    room = getattr(e, "room", None)
    return type(e).__name__ + (f" room {room}" if room is not None else "")


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 160 else text[:157] + "..."
