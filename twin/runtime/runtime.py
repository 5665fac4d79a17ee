"""The one runtime under every driver: feed core ranks, carry out their effects.

``Runtime`` holds the core ranks of one process (all of them in the simulator and the explorer,
one in a hardware rank process) and turns every effect into a driver action. The bookkeeping
that is the same in every mode lives here, once: frame and control fan-out, worker polls (one
pending poll per worker; a newer one replaces it), the late registration point, timeouts,
crashed ranks, dropped-input notes for diagnosis, and the progress clock the wedge monitor reads.
A decode rank's ``GroupPoll`` (its share of the MIN all-reduce of the group's polls) reaches a
peer held by this runtime in the same step, after the current input's effects (SGLang reduces
in lockstep); a peer in another process gets it through ``control``.
The protocol decides *when* (``Deferred.retry_at``, ``WakeWorkers.at``,
``SendMetadata.register_at``, ``SetTimer.at``); the driver only supplies:

* a clock: ``time()`` and ``feed_at(at, node, event, token)``, which calls
  ``runtime.fire(node, event, token)`` when ``at`` comes (in logical time, the explorer may
  take it in any order);
* a transport: ``transmit(src, dst, msg)`` for SGLang frames, ``control(src, dst, event)`` for
  the bootstrap metadata and abort notices that travel outside SGLang's frames;
* a data plane: ``start_transfer(node, effect)`` and ``start_scatter(node, effect)``.

Drivers observe any other effect through ``hooks`` (metrics, integrity, request bookkeeping).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from twin.core import events as ev
from twin.core import wire
from twin.core.decode import DecodeRank
from twin.core.prefill import PrefillRank

Rank = PrefillRank | DecodeRank
Hook = Callable[[str, Any], None]

PROGRESS_EFFECTS = (ev.Allocated, ev.StartTransfer, ev.StartScatter, ev.RoomConcluded,
                    ev.ChunkQueued, ev.RoomReleased)
"""Effects that count as progress for the wedge monitor (the same in every mode)."""

DROPPED_NOTES_PER_ROOM = 8


def note_dropped(notes: dict[int, list[str]], node: str, e: ev.Dropped) -> None:
    """Note input ``e`` that ``node`` dropped for its room's wedge diagnosis (the ``dropped`` of
    ``twin.runtime.diagnosis.diagnose``): at most ``DROPPED_NOTES_PER_ROOM`` per room."""
    if e.room >= 0:
        have = notes.setdefault(e.room, [])
        if len(have) < DROPPED_NOTES_PER_ROOM:
            have.append(f"{node} dropped {e.what}: {e.reason}")


_WORKER_POLLS: list[ev.WorkerPoll] = []


def worker_poll(worker: int) -> ev.WorkerPoll:
    """``WorkerPoll(worker)``, one shared instance per worker (the input is frozen, and a
    storm feeds a million of them)."""
    polls = _WORKER_POLLS
    while len(polls) <= worker:
        polls.append(ev.WorkerPoll(worker=len(polls)))
    return polls[worker]


class Driver(Protocol):
    """What a driver supplies to the runtime: clock, transport and data plane."""

    def time(self) -> float: ...
    def feed_at(self, at: float, node: str, event: ev.Input, token: int) -> None: ...
    def transmit(self, src: str, dst: str, msg: wire.Message) -> None: ...
    def control(self, src: str, dst: str, event: ev.Input) -> None: ...
    def start_transfer(self, node: str, e: ev.StartTransfer) -> None: ...
    def start_scatter(self, node: str, e: ev.StartScatter) -> None: ...


class InputRecorder(Protocol):
    """Where the runtime writes every input and the effects it returned. A recorder that
    also has ``record(t, node, event, effects)`` (``twin.trace.format.TraceWriter``) gets
    that one call per input instead of the two."""

    def write_input(self, t: float, node: str, event: Any) -> None: ...
    def write_effects(self, t: float, node: str, effects: list[Any]) -> None: ...


class Recorder(InputRecorder, Protocol):
    """A run's trace (``twin.trace.format.TraceWriter`` fits): inputs, effects, driver records."""

    def write_sys(self, t: float, node: str, record: dict[str, Any]) -> None: ...


def _two_calls(recorder: InputRecorder) -> Callable[[float, str, Any, list[Any]], None]:
    """``record`` for a recorder with only ``write_input`` and ``write_effects``."""
    def record(t: float, node: str, event: Any, effects: list[Any]) -> None:
        recorder.write_input(t, node, event)
        recorder.write_effects(t, node, effects)
    return record


class Runtime:
    """Feeds ``ranks`` and carries out their effects through ``driver``.

    ``scripted``: inputs come from a recorded script (replay on hardware), so the runtime
    schedules nothing of its own (no polls, registrations or ticks).
    """

    def __init__(self, ranks: dict[str, Rank], driver: Driver, *,
                 recorder: InputRecorder | None = None, hooks: Mapping[type, Hook] | None = None,
                 scripted: bool = False, clock: Callable[[], float] | None = None) -> None:
        self.ranks = ranks
        self.driver = driver
        self.recorder = recorder
        self._record: Callable[[float, str, Any, list[Any]], None] | None = (
            None if recorder is None else getattr(recorder, "record", None)
            or _two_calls(recorder))
        self.scripted = scripted
        self.crashed: dict[str, str] = {}
        self.dropped: dict[int, list[str]] = {}
        self.last_progress = 0.0
        self.inputs = 0
        self.polls_accounted = 0  # coalesced polls the cores ran without an input of their own
        self.settles = 0  # PollsDue inputs fed (no fed run has them)
        # node -> the latest poll token of each of its workers (a list: no key tuple per poll)
        self._poll_tokens: dict[str, list[int]] = {}
        self._feed_at = driver.feed_at  # bound once: called on every poll
        self._time = clock or driver.time  # ``clock``: a cheaper reader of the same time
        self._now = 0.0  # the time of the input being handled (effects happen then)
        self.current: ev.Input | None = None  # the input being handled (what a send answers)
        self._local: deque[tuple[str, ev.Input]] = deque()
        self._draining = False
        self._table = self._dispatch_table(hooks or {})
        # Prefill ranks whose cores account their own deferral re-polls (worker_polls
        # "coalesced"): their Deferred effects schedule nothing, their WakeWorkers do.
        self._coalesced = {n for n, r in ranks.items()
                                     if isinstance(r, PrefillRank) and r.coalesced}
        # node -> the event id each worker's chain of polls began with (a driver with
        # ``take_id`` and ``feed_at_id`` orders them so; others in the order they are asked)
        self._chain_ids: dict[str, list[int]] = {}
        self._take_id: Callable[[], int] | None = getattr(driver, "take_id", None)
        for node in self._coalesced:
            self._count_deferrals(ranks[node])

    # -- feeding -------------------------------------------------------------------------------
    def feed(self, node: str, event: ev.Input) -> list[ev.Effect]:
        """Hand ``event`` to ``node``'s core now and carry out its effects (none if crashed);
        then the group polls this produced for other ranks held here."""
        effects = self._feed(node, event)
        if self._local and not self._draining:
            self._draining = True
            try:
                while self._local:
                    self._feed(*self._local.popleft())
            finally:
                self._draining = False
        return effects

    def _feed(self, node: str, event: ev.Input) -> list[ev.Effect]:
        if node in self.crashed:
            return []
        rank = self.ranks[node]
        now = self._time()
        if now < rank.now:  # a wall clock read twice can step back by rounding
            now = rank.now
        self.inputs += 1
        self._now = now
        self.current = event
        effects = rank.handle(event, now)
        if isinstance(rank, PrefillRank) and rank.coalesced:
            self.polls_accounted += rank.accounted
        if isinstance(rank, PrefillRank) and rank.chain_starts and self._take_id is not None:
            ids = self._chain_ids.get(node)
            if ids is None:
                ids = self._chain_ids[node] = [0] * rank.num_workers
            for w in rank.chain_starts:
                ids[w] = self._take_id()
        record = self._record
        if record is not None:
            record(now, node, event, effects)
        table = self._table
        for e in effects:
            table[type(e)](node, e)
        return effects

    def schedule(self, node: str, at: float, event: ev.Input) -> None:
        """Feed ``event`` to ``node`` at time ``at`` (nothing when scripted)."""
        if not self.scripted:
            self.driver.feed_at(at, node, event, 0)

    def poll(self, node: str, worker: int, at: float) -> None:
        """Feed ``WorkerPoll(worker)`` at ``at``, replacing a poll of that worker not yet fed."""
        if self.scripted:
            return
        tokens = self._poll_tokens.get(node)
        if tokens is None:
            tokens = self._poll_tokens[node] = []
        while len(tokens) <= worker:
            tokens.append(0)
        token = tokens[worker] + 1
        tokens[worker] = token
        ids = self._chain_ids.get(node) if self._take_id is not None else None
        if ids is not None:
            self.driver.feed_at_id(at, ids[worker], node, worker_poll(worker), token)  # type: ignore[attr-defined]
        else:
            self._feed_at(at, node, worker_poll(worker), token)

    def _count_deferrals(self, rank: Rank) -> None:
        """A run that records nothing takes a coalesced rank's accounted deferrals as counts
        (``DeferralsCounted``); a recorded one gets each ``Deferred``."""
        if isinstance(rank, PrefillRank):
            rank.count_deferrals = self.recorder is None

    def is_current(self, node: str, event: ev.Input, token: int) -> bool:
        """Whether a scheduled input is still wanted: a poll replaced by a newer one is not."""
        if token == 0:
            return True
        tokens = self._poll_tokens.get(node)
        worker: int = event.worker  # type: ignore[union-attr]
        return tokens is not None and worker < len(tokens) and tokens[worker] == token

    def fire(self, node: str, event: ev.Input, token: int) -> None:
        """A scheduled input's time came: feed it unless a newer poll replaced it."""
        if self.is_current(node, event, token):
            self.feed(node, event)

    def restart(self, node: str, rank: Rank) -> None:
        """Replace ``node``'s core with a fresh one (a restarted rank) and let it run again."""
        self.ranks[node] = rank
        self.crashed.pop(node, None)
        if isinstance(rank, PrefillRank) and rank.coalesced:
            self._coalesced.add(node)
            self._count_deferrals(rank)

    # -- effects -------------------------------------------------------------------------------
    def _dispatch_table(self, hooks: Mapping[type, Hook]) -> dict[type, Hook]:
        transmit = self.driver.transmit

        def send(node: str, e: ev.Send) -> None:  # a closure: no attribute lookups per frame
            transmit(node, e.dst, e.msg)

        own: dict[type, Hook] = {
            ev.Send: send,
            ev.SendMetadata: self._metadata,
            ev.AbortNotice: self._abort_notice,
            ev.StartTransfer: self._start_transfer,
            ev.StartScatter: self._start_scatter,
            ev.Deferred: self._deferred,
            ev.WakeWorkers: self._wake,
            ev.SetTimer: self._timer,
            ev.RankCrashed: self._crashed,
            ev.Dropped: self._dropped,
            ev.Allocated: self._progress,
            ev.ChunkQueued: self._progress,
            ev.RoomConcluded: self._progress,
            ev.RoomReleased: self._progress,
            ev.GroupPoll: self._group_poll,
        }
        table: dict[type, Hook] = {}
        for t in ev.EFFECT_TYPES:
            first, extra = own.get(t), hooks.get(t)
            if first is not None and extra is not None:
                table[t] = _both(first, extra)
            else:
                table[t] = first or extra or _ignore
        return table

    def _metadata(self, node: str, e: ev.SendMetadata) -> None:
        target = ev.Target(session=e.session, decode_rank=e.decode_rank,
                                      total_pages=e.total_pages,
                                      decode_prefix_len=e.decode_prefix_len, dst_port=e.dst_port)
        boot = ev.RoomBootstrapped(room=e.room, targets=(target,))
        for p in e.prefill_ranks:
            self.driver.control(node, p, boot)
        if e.register_at is not None:
            self.schedule(node, e.register_at, ev.DecodeRoomRegister(room=e.room))

    def _abort_notice(self, node: str, e: ev.AbortNotice) -> None:
        aborted = ev.RoomAborted(room=e.room, reason=e.reason)
        for d in e.dsts:
            self.driver.control(node, d, aborted)

    def _group_poll(self, node: str, e: ev.GroupPoll) -> None:
        polled = ev.PeerPolled(room=e.room, peer=node, poll=e.poll)
        for peer in e.peers:
            if peer in self.ranks:
                self._local.append((peer, polled))
            else:
                self.driver.control(node, peer, polled)

    def _start_transfer(self, node: str, e: ev.StartTransfer) -> None:
        self.last_progress = self._now
        self.driver.start_transfer(node, e)

    def _start_scatter(self, node: str, e: ev.StartScatter) -> None:
        self.last_progress = self._now
        self.driver.start_scatter(node, e)

    def _deferred(self, node: str, e: ev.Deferred) -> None:
        if e.retry_at is not None and node not in self._coalesced:
            self.poll(node, e.worker, e.retry_at)

    def settle(self) -> None:
        """Feed ``PollsDue`` now to every live rank with coalesced polls, so the deferrals due
        before a stop are accounted (a run stopped at ``--until`` or for a wedge)."""
        for node in sorted(self._coalesced):
            if node not in self.crashed:
                self.settles += 1
                self.feed(node, ev.PollsDue())

    def _wake(self, node: str, e: ev.WakeWorkers) -> None:
        for w in e.workers:
            self.poll(node, w, e.at)

    def _timer(self, node: str, e: ev.SetTimer) -> None:
        self.schedule(node, e.at, ev.Tick())

    def _crashed(self, node: str, e: ev.RankCrashed) -> None:
        self.crashed[node] = e.reason

    def _dropped(self, node: str, e: ev.Dropped) -> None:
        note_dropped(self.dropped, node, e)

    def _progress(self, node: str, e: ev.Effect) -> None:
        self.last_progress = self._now


def _ignore(node: str, e: Any) -> None:
    pass


def _both(first: Hook, then: Hook) -> Hook:
    def run(node: str, e: Any) -> None:
        first(node, e)
        then(node, e)
    return run
