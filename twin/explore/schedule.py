"""Message interleavings on the logical-time loopback cluster (``twin/explore/loopback.py``).

A trial whose ``schedule`` is set runs on the loopback ``Cluster`` instead of the simulator:
every pending delivery, completion and poll may go next (frames keep FIFO order per source,
destination and socket), and a scheduler picks which:

* ``random:SEED``        uniformly among the choices;
* ``pct:SEED:DEPTH``     probabilistic concurrency testing (Burckhardt et al., ASPLOS 2010)
                         adapted to message passing: every channel (a frame's source,
                         destination and socket; a completion's rank and kind) gets a random
                         priority when it first has something pending, the highest-priority
                         choice goes, and at ``DEPTH - 1`` random steps the channel that goes
                         is demoted below every other. A bug that needs ``DEPTH`` ordering
                         constraints is hit with probability at least ``1 / (n * k^(DEPTH-1))``
                         for ``n`` channels and ``k`` steps, instead of the vanishing odds of a
                         uniformly random walk.

The run takes the scheduler's pick until nothing is pending; with rooms unfinished and nothing
but a timeout left, that is a wedge (diagnosed on the ranks' snapshots, roots first, before
any timeout fires); otherwise the clock moves on to the next scheduled input. An abort fault
(``abort:room=R:at=T``) aborts room ``R`` on both sides once the logical clock reaches ``T``;
the other fault kinds belong to the simulator and are not taken by a loopback trial.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from twin.core import events as ev
from twin.core.defects import Defects
from twin.explore.coverage import CoverageRecorder
from twin.explore.loopback import Action, Cluster, InvariantViolation, Livelock
from twin.runtime.faults import parse_fault

MAX_STEPS = 10_000
MAX_PENDING = 1_000
"""A loopback run still busy after ``MAX_STEPS`` steps, or with more than ``MAX_PENDING``
actions pending at once (re-requests piling up faster than one step a millisecond takes
them, as lost-control recovery does while a room waits for a 300 s timeout), is a
``livelock``: either way each step costs more than the trial is worth."""
LOOPBACK_CHUNKS = 64
"""Chunk writes (chunks x prefill ranks) a loopback trial may hold at most: each step takes
one action while every deferred worker re-polls each step, so a large trial spends its steps
polling; the property tests' trials stay below 50."""
SCHEDULERS = ("random", "pct")



def parse_schedule(text: str) -> tuple[str, int, int]:
    """``(kind, seed, depth)`` of ``random:SEED`` or ``pct:SEED:DEPTH``; ``ValueError``."""
    parts = text.split(":")
    if parts[0] == "random" and len(parts) == 2:
        return "random", int(parts[1]), 0
    if parts[0] == "pct" and len(parts) == 3 and int(parts[2]) >= 1:
        return "pct", int(parts[1]), int(parts[2])
    raise ValueError(f"schedule {text!r}: expected random:SEED or pct:SEED:DEPTH")


def _channel(a: Action) -> tuple[str, ...]:
    link = Cluster.link_of(a)
    return link if link is not None else (a.kind, a.node)


FAIR_STEPS = 64
"""A choice left waiting this many steps goes next, whatever the scheduler prefers: a worker
re-polling a deferred chunk every step would otherwise starve the frames that unblock it (in
logical time a re-poll is due again one step later), a livelock of the scheduler, not of the
protocol. PCT's guarantee is stated for fair schedules too."""


class _Fair:
    """Remembers when each pending action was first offered; the oldest one past
    ``FAIR_STEPS`` wins."""

    def __init__(self) -> None:
        self.first: dict[int, int] = {}
        self.step = 0

    def overdue(self, cluster: Cluster, choices: list[int]) -> int | None:
        self.step += 1
        seen = self.first
        oldest, age = None, FAIR_STEPS
        live = set()
        for i in choices:
            key = cluster.pending[i].seq
            live.add(key)
            born = seen.setdefault(key, self.step)
            if self.step - born >= age:
                oldest, age = i, self.step - born
        if len(seen) > 4 * len(live) + 64:
            self.first = {k: v for k, v in seen.items() if k in live}
        return oldest


class RandomScheduler:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(f"random:{seed}")
        self.fair = _Fair()

    def __call__(self, cluster: Cluster, choices: list[int]) -> int:
        due = self.fair.overdue(cluster, choices)
        return due if due is not None else self.rng.choice(choices)


class PCTScheduler:
    """PCT over channels (see the module docstring)."""

    def __init__(self, seed: int, depth: int, steps: int = 400) -> None:
        self.rng = random.Random(f"pct:{seed}:{depth}")
        self.prio: dict[tuple[str, ...], float] = {}
        self.change = set(self.rng.sample(range(steps), min(depth - 1, steps)))
        self.step = 0
        self.low = 0.0
        self.fair = _Fair()

    def __call__(self, cluster: Cluster, choices: list[int]) -> int:
        due = self.fair.overdue(cluster, choices)
        if due is not None:
            return due
        prio = self.prio
        best, best_p = choices[0], -1.0
        for i in choices:
            ch = _channel(cluster.pending[i])
            p = prio.get(ch)
            if p is None:
                p = prio[ch] = 1.0 + self.rng.random()
            if p > best_p:
                best, best_p = i, p
        if self.step in self.change:
            self.low -= 1.0
            prio[_channel(cluster.pending[best])] = self.low
        self.step += 1
        return best


def make_scheduler(text: str) -> Callable[[Cluster, list[int]], int]:
    kind, seed, depth = parse_schedule(text)
    return RandomScheduler(seed) if kind == "random" else PCTScheduler(seed, depth)


class _Watched(Cluster):
    """The loopback cluster with the explorer's coverage recorder on every rank's effects."""

    def __init__(self, *args: object, recorder: CoverageRecorder, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.watch = recorder

    def write_input(self, t: float, node: str, event: ev.Input) -> None:
        super().write_input(t, node, event)
        self.watch.write_input(t, node, event)

    def write_effects(self, t: float, node: str, effects: list[ev.Effect]) -> None:
        super().write_effects(t, node, effects)
        self.watch.write_effects(t, node, effects)


class LoopbackRun:
    """What a loopback run ended with (the simulator's ``SimResult`` in the terms the oracles
    read)."""

    def __init__(self) -> None:
        self.status = "completed"
        self.diagnosis: list[str] = []
        self.corruption: list[str] = []
        self.corruption_kinds: list[str] = []
        self.safety: list[str] = []
        self.failures: dict[str, int] = {}
        self.leaks: list[str] = []
        self.aborted: set[int] = set()
        self.steps = 0


class Driver:
    """What a loopback run asks at every step: which pending action goes next (``pick``), how
    many of the requests not yet added arrive now (``admit``) and on which prefill group
    (``group``), and which rooms to abort now, on which side (``aborts``: ``(room, "decode" |
    "prefill" | "both")``).

    This one is the explorer's: every request at the start, the trial's ``abort`` faults on both
    sides once the logical clock reaches them, and ``schedule``'s scheduler. The property tests
    (``tests/core/test_properties.py``) drive the same run with Hypothesis instead."""

    def __init__(self, schedule: str, faults: tuple[str, ...] = ()) -> None:
        self.scheduler = make_scheduler(schedule)
        self.timed = sorted((spec.at or 0.0, spec.room or 0)
                            for spec in map(parse_fault, faults) if spec.action == "abort")

    def pick(self, cluster: Cluster, choices: list[int]) -> int:
        return self.scheduler(cluster, choices)

    def admit(self, cluster: Cluster, waiting: int) -> int:
        return waiting

    def group(self, cluster: Cluster, room: int) -> int:
        """The prefill group (DP attention group or instance) room ``room`` goes to: round
        robin, as a load balancer spreads serial requests."""
        return room % len(cluster.topo.prefill_groups)

    def aborts(self, cluster: Cluster) -> list[tuple[int, str]]:
        out = []
        while self.timed and self.timed[0][0] <= cluster.now:
            out.append((self.timed.pop(0)[1], "both"))
        return out

    def next_abort_at(self) -> float | None:
        """When the next timed abort is due (the clock jumps there when nothing else is)."""
        return self.timed[0][0] if self.timed else None


def run_loopback(cfg: object, requests: list[tuple[int, int, int]], faults: tuple[str, ...],
                 defects: Defects, schedule: str, recorder: CoverageRecorder,
                 driver: Driver | None = None, max_steps: int = MAX_STEPS,
                 step_s: float = 1e-3) -> LoopbackRun:
    """Run ``requests`` (``(input_len, decode_prefix, prefill_prefix)``) on a loopback cluster:
    ``driver`` (default: ``Driver(schedule, faults)``) admits them, aborts rooms and picks each
    step, each taking ``step_s`` of logical time. The run ends when nothing is pending and no
    input is scheduled (every timeout fired); a rank that still holds a room or a live
    allocation then is a leak."""
    from twin.core.config import TwinConfig
    from twin.runtime.diagnosis import diagnose

    assert isinstance(cfg, TwinConfig)
    c = _Watched(cfg, defects, recorder=recorder, step_s=step_s)
    drive = driver if driver is not None else Driver(schedule, faults)
    out = LoopbackRun()
    waiting = list(enumerate(requests))
    aborted = out.aborted

    def admit(n: int) -> None:
        for _ in range(min(n, len(waiting))):
            room, (size, dpre, ppre) = waiting.pop(0)
            c.add_request(room, size, decode_prefix_len=dpre, prefill_prefix_len=ppre,
                          prefill_group=drive.group(c, room))

    admit(drive.admit(c, len(waiting)))
    try:
        while True:
            for room, side in drive.aborts(c):
                if room in c.rooms and room not in aborted:
                    aborted.add(room)
                    plan = c.rooms[room]
                    nodes = []
                    if side in ("decode", "both"):
                        nodes += [n.id for n in c.topo.decode_groups[plan.decode_group].nodes]
                    if side in ("prefill", "both"):
                        nodes += [n.id for n in c.topo.prefill_groups[plan.prefill_group].nodes]
                    for node in nodes:
                        c._feed(node, ev.RoomAborted(room=room, reason=f"{side} abort"))
            cs = c.choices()
            if cs:
                if len(c.pending) > MAX_PENDING:
                    raise Livelock(f"{len(c.pending)} actions pending: {c.busy_report()}")
                if out.steps >= max_steps:
                    raise Livelock(f"still busy after {max_steps} steps: {c.busy_report()}")
                c.step(drive.pick(c, cs))
                out.steps += 1
                if waiting:
                    admit(drive.admit(c, len(waiting)))
                continue
            if waiting:  # nothing to do until the next request arrives: it arrives now
                admit(max(1, drive.admit(c, len(waiting))))
                continue
            if c.advance(timeouts=False) is not None:
                continue  # a re-poll or a registration came due
            due = drive.next_abort_at()
            if due is not None:
                c.now = max(c.now, due)
                continue
            unfinished = set(c.unfinished())
            if unfinished and not out.diagnosis:
                snaps = {n: r.snapshot() for n, r in c.ranks.items()}
                crashed = dict(x.split(": ", 1) for x in c.crashed if ": " in x)
                d = diagnose(snaps, crashed, unfinished).lines()
                out.diagnosis = [f"wedge: {len(unfinished)} room(s) unfinished with nothing "
                                 f"left but timeouts (rooms {sorted(unfinished)})", *d]
                out.status = "wedged"
            if c.advance() is None:
                break
    except InvariantViolation as exc:
        out.safety.append(f"invariant: {exc}")
        out.status = "corrupted"
    except Livelock as exc:
        out.status = "livelock"
        out.diagnosis = [f"root: livelock: {str(exc).split(':', 1)[0]}"]
    out.safety += recorder.safety
    out.corruption = [str(v) for v in c.integrity.violations]
    out.corruption_kinds = [v.kind for v in c.integrity.violations]
    if out.corruption:
        out.status = "corrupted"
    if out.status in ("completed", "wedged"):
        out.leaks = leaks(c)
    if out.status == "completed":
        failed = [r for r in c.rooms if c.outcome(r) == "Failed" and r not in aborted]
        if failed or aborted:
            out.status = "failed"
        for r in failed:
            reason = recorder.failed.get(r, "failed")[:120]
            out.failures[reason] = out.failures.get(reason, 0) + 1
        if aborted:
            out.failures["aborted by fault"] = len(aborted)
    return out


def leaks(c: Cluster) -> list[str]:
    """What a quiescent cluster still holds: a rank's room state, a decode rank's live staging
    allocation, a room that never concluded (each is a leak once every timeout has fired)."""
    from twin.core.snapshot import DecodeSnapshot

    out = [f"room {r} never concluded" for r in sorted(c.rooms) if c.outcome(r) == "pending"]
    for node, rank in sorted(c.ranks.items()):
        if node in {x.split(": ", 1)[0] for x in c.crashed}:
            continue
        snap = rank.snapshot()
        if snap.rooms:
            out.append(f"{node} still holds rooms {sorted(snap.rooms)}")
        if isinstance(snap, DecodeSnapshot) and snap.live:
            out.append(f"{node} still holds {len(snap.live)} live staging allocation(s)")
    return out
