"""The SimPy model of a disaggregated deployment, driving the protocol core unchanged.

``Simulation`` owns one core rank per prefill and decode attention-TP rank and carries out their
effects with modelled costs (``SimParams``): control frames over ZMQ with latency and jitter
(FIFO per link), staged WRITEs over NICs shared by ranks, gather and scatter kernels, the prefill
scheduler's chunked forwards with its KV pool, and the decode scheduler's loop (continuous
batching, KV pool, retraction, scatter polling once per iteration; ``decode_loop.py``).
Compute costs and pools come from the deployment (``twin.models.costs``). Randomness comes from
streams seeded from one root seed, so a seed reproduces a run exactly.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Generator
from typing import Any, Final

import simpy
from simpy.core import EmptySchedule, StopSimulation

from twin.core import events as ev
from twin.core import wire
from twin.core.config import TwinConfig, polls_coalescible
from twin.core.decode import DecodeRank
from twin.core.defects import Defects
from twin.core.fixes import STALE_WATERMARK_SUBSCRIBERS
from twin.core.integrity import IntegrityModel
from twin.core.prefill import PrefillRank
from twin.core.topology import Topology, build_rank, build_ranks
from twin.models.costs import Deployment
from twin.runtime.collector import paced_collector
from twin.runtime.diagnosis import crash_reason, fault_record, restart_reason
from twin.runtime.faults import FaultInjector, FaultSpec, scope_nodes
from twin.runtime.params import SimParams
from twin.runtime.placement import Placement
from twin.runtime.requests import RequestState
from twin.runtime.runtime import Recorder, Runtime
from twin.runtime.signals import held_for_safe_points
from twin.sim.clock import CalendarEnvironment
from twin.sim.decode_loop import DecodeLoop
from twin.sim.metrics import Metrics
from twin.sim.scheduler import PrefillScheduler
from twin.sim.sockets import SendBlocking
from twin.sim.stalls import ProcessStalls
from twin.workloads import Request, Workload

# Read on every frame or call; Final names are C statics when the engine is compiled
# (a call to a factory of the compiled core is native already).
_PREFETCH: Final = wire.PREFETCH_SOCKET
_CONTROL: Final = wire.CONTROL_SOCKET
_STAGING_REQ: Final = wire.StagingReq
_Allocated: Final = ev.Allocated
_DecodeRoomInit: Final = ev.DecodeRoomInit
_DeferralsCounted: Final = ev.DeferralsCounted
_Deferred: Final = ev.Deferred
_Freed: Final = ev.Freed
_MessageArrived: Final = ev.MessageArrived
_PeerPolled: Final = ev.PeerPolled
_RankCrashed: Final = ev.RankCrashed
_RoomAborted: Final = ev.RoomAborted
_RoomConcluded: Final = ev.RoomConcluded
_ScatterDone: Final = ev.ScatterDone
_SendFailed: Final = ev.SendFailed
_TargetsKnown: Final = ev.TargetsKnown
_TransferDone: Final = ev.TransferDone
_WatermarkMoved: Final = ev.WatermarkMoved
_NORMAL: Final = 1  # simpy.events.NORMAL: the priority of a Timeout


def _expovariate_inlinable() -> bool:
    """Whether ``Random.expovariate(rate)`` is ``-log(1 - random()) / rate`` here (it is in
    every CPython 3.x so far): then the frame path draws jitter without the method call."""
    a, b = random.Random(1), random.Random(1)
    return all(a.expovariate(r) == -math.log(1.0 - b.random()) / r for r in (0.5, 2.0, 1e4, 7.3))


_INLINE_EXPOVARIATE = _expovariate_inlinable()


class _DataPlaneCosts:
    """The ``SimParams`` read on every transfer and scatter, as native fields (the params
    are a Python dataclass, whose fields compiled code reads by name)."""

    def __init__(self, p: SimParams) -> None:
        self.kernel_launch_s: float = p.kernel_launch_s
        self.gather_bandwidth_Bps: float = p.gather_bandwidth_Bps
        self.scatter_bandwidth_Bps: float = p.scatter_bandwidth_Bps
        self.nic_bandwidth_Bps: float = p.nic_bandwidth_Bps
        self.rdma_latency_s: float = p.rdma_latency_s
        self.transfer_jitter_s: float = p.transfer_jitter_s
        self.ranks_per_nic: int = p.ranks_per_nic
        self.direct_write_s: float = p.direct_write_s
        self.mooncake_transfer_timeout_s: float = p.mooncake_transfer_timeout_s


class _Call:
    """A plain callback at a time: the simulation's own events (frames, completions, timers),
    kept in its ``Calendar`` beside SimPy's queue. It takes one event id from SimPy's counter,
    like the Timeout it stands for, so events run in the order SimPy would run them: by
    ``(t, eid)``."""

    __slots__ = ("t", "eid", "fn", "args")

    def __init__(self, t: float, eid: int, fn: Callable[..., object],
                 args: tuple[Any, ...]) -> None:
        self.t = t
        self.eid = eid
        self.fn = fn
        self.args = args


def _before(a: _Call, b: _Call) -> bool:
    """Whether ``a`` runs before ``b``."""
    return a.t < b.t or (a.t == b.t and a.eid < b.eid)


def _push(heap: list[_Call], call: _Call) -> None:
    """``heapq.heappush`` ordered by ``_before`` (native field compares when compiled)."""
    heap.append(call)
    pos = len(heap) - 1
    while pos > 0:
        parent_pos = (pos - 1) >> 1
        parent = heap[parent_pos]
        if not _before(call, parent):
            break
        heap[pos] = parent
        pos = parent_pos
    heap[pos] = call


def _pop(heap: list[_Call]) -> _Call:
    """``heapq.heappop`` ordered by ``_before``; ``heap`` must not be empty."""
    last = heap.pop()
    if not heap:
        return last
    first = heap[0]
    # the smaller child moves up until a leaf is free, then ``last`` sifts up from it
    end = len(heap)
    pos = 0
    child = 1
    while child < end:
        right = child + 1
        if right < end and not _before(heap[child], heap[right]):
            child = right
        heap[pos] = heap[child]
        pos = child
        child = 2 * pos + 1
    while pos > 0:
        parent_pos = (pos - 1) >> 1
        parent = heap[parent_pos]
        if not _before(last, parent):
            break
        heap[pos] = parent
        pos = parent_pos
    heap[pos] = last
    return first


class _Link:
    """When the last frame from one rank to one peer arrives, per sending socket: frames keep
    their order within a (source, destination, socket)."""

    __slots__ = ("prefetch", "control")

    def __init__(self) -> None:
        self.prefetch = 0.0
        self.control = 0.0

    def after(self, socket: str, t: float) -> float:
        """The arrival of a frame sent on ``socket`` that would arrive at ``t`` (not before the
        socket's previous frame), noted as the socket's last."""
        if socket == _PREFETCH:
            if self.prefetch > t:
                t = self.prefetch
            self.prefetch = t
        else:
            if self.control > t:
                t = self.control
            self.control = t
        return t


class EventIds:
    """The event-id counter shared by SimPy's queue and the ``Calendar``: it replaces the
    environment's ``itertools.count`` (SimPy draws with ``next``; the calendar
    with ``take``, a native call when compiled). ``repr`` reads as the count's."""

    __slots__ = ("n",)

    def __init__(self, start: int = 0) -> None:
        self.n = start

    def __iter__(self) -> EventIds:
        return self

    def __next__(self) -> object:  # boxed: a native int would not fill the iterator slot
        return self.take()

    def take(self) -> int:
        """The next id (a native call from the compiled calendar)."""
        n = self.n
        self.n = n + 1
        return n

    def __repr__(self) -> str:
        return f"count({self.n})"


class Calendar:
    """The pending ``_Call``s in ``(t, eid)`` order, in two parts: ``soon`` holds every call
    before ``edge``, sorted latest first (the next call is ``soon[-1]``: a pop is a list pop),
    and ``later``, a binary heap, every call at or after it. Most calls come due within
    microseconds to milliseconds while timers wait minutes, so ``soon`` stays a few dozen
    calls long while ``later`` holds the thousands of timers; when ``soon`` runs dry,
    ``refill`` moves the next ``horizon`` simulated seconds of ``later`` into it. Event ids
    come from the counter ``eids`` that SimPy draws from too, so calls of one time run in the
    order they were scheduled."""

    __slots__ = ("now", "soon", "later", "edge", "horizon", "eids", "stop_signal")

    def __init__(self, eids: EventIds, horizon: float = 1.0) -> None:
        self.now = 0.0
        """The simulation's clock (SimPy's too: ``twin.sim.clock``)."""
        self.soon: list[_Call] = []
        self.later: list[_Call] = []
        self.edge = 0.0
        self.horizon = horizon
        self.eids = eids
        self.stop_signal = 0
        """A stopping signal (SIGINT, SIGTERM, SIGHUP) noted during ``Simulation.run``, 0 while
        none: ``_run_until`` returns before the next call once it is set, so that the run acts
        on it between two events (``twin.runtime.signals.held_for_safe_points``)."""

    def __len__(self) -> int:
        return len(self.soon) + len(self.later)

    def add(self, t: float, fn: Callable[..., object], args: tuple[Any, ...]) -> None:
        """Call ``fn(*args)`` at time ``t``, after every call and event scheduled before."""
        self.add_as(t, self.eids.take(), fn, args)

    def add_as(self, t: float, eid: int, fn: Callable[..., object],
               args: tuple[Any, ...]) -> None:
        """Call ``fn(*args)`` at time ``t`` in the place of event id ``eid`` (one taken
        earlier: a coalesced chain of polls keeps the place its first poll had)."""
        call = _Call(t, eid, fn, args)
        if t >= self.edge:
            _push(self.later, call)
            return
        soon = self.soon
        lo = 0
        hi = len(soon)
        while lo < hi:  # the first position whose call runs before this one (``_before``,
            mid = (lo + hi) >> 1  # written out: a call per step costs the pure path 5%)
            other = soon[mid]
            if t < other.t or (t == other.t and eid < other.eid):
                lo = mid + 1
            else:
                hi = mid
        soon.insert(lo, call)

    def refill(self) -> bool:
        """With ``soon`` empty: move the calls of the next ``horizon`` seconds of ``later``
        into it; False when there are none."""
        later = self.later
        if not later:
            return False
        soon = self.soon
        edge = self.edge = later[0].t + self.horizon
        while later and later[0].t < edge:
            soon.append(_pop(later))
        soon.reverse()
        return True


_ULPS_PER_BINADE: Final = 1 << 52  # a binade [2**e, 2**(e + 1)) holds 2**52 doubles


def next_tick_after(t: float, step: float, target: float) -> float:
    """The first of ``t + step``, ``(t + step) + step``, ... (each sum rounded, as a loop that
    adds ``step`` to the time computes it) that is later than ``target``, without the loop.

    Within one binade every double is a multiple of its ulp ``u``, and adding ``step`` rounds
    the same way at each of them unless ``step``'s remainder is exactly ``u / 2`` (a tie,
    which ties-to-even breaks by parity): there, ``n`` additions are one multiplication. So
    the walk takes at most a few single additions per binade, and the result is the very
    double the loop would reach."""
    x = t + step
    while x <= target:
        y = x + step
        if y == x:
            raise ValueError(f"a step of {step!r} s no longer moves a clock at {x!r} s")
        u = math.ulp(x)
        xi = int(x / u)  # exact: x is a multiple of u, below 2**53 * u
        top = 2 * _ULPS_PER_BINADE  # the next binade starts at top * u
        di = int((y - x) / u) if y - x > 0.0 else 0
        # steps from xi, xi + di, ... stay safely inside the binade (room for rounding up)
        room = (top - di - 2 - xi) // di + 1 if di > 0 and xi <= top - di - 2 else 0
        x1 = x + u
        if room < 2 or (x1 + step) - x1 != y - x:  # near the binade's end, or a tie
            x = y
            continue
        need = (int(target / u) - xi) // di + 1  # steps until past target (target / u exact)
        x = (xi + di * min(room, need)) * u
    return x


def _run_until(env: simpy.Environment, calendar: Calendar, stop: simpy.Event | None) -> None:
    """``env.run(until=stop)`` over SimPy's queue and ``calendar`` together: whichever holds
    the next event by (time, priority, id) runs it, the calendar's calls as Timeouts of
    normal priority would. Raises ``RuntimeError`` as SimPy does when both empty before
    ``stop``; with ``stop=None``, returns then."""
    if stop is not None:
        if stop.callbacks is None:
            return
        if StopSimulation.callback not in stop.callbacks:  # (a run resumed after a signal)
            stop.callbacks.append(StopSimulation.callback)
    queue: Any = env._queue
    soon = calendar.soon
    step = env.step
    try:
        while True:
            if calendar.stop_signal:
                return
            if soon or calendar.refill():
                call = soon[-1]
                t = call.t
                if queue:
                    head = queue[0]
                    ht = head[0]
                    if ht < t or (ht == t and (head[1] < _NORMAL or (head[1] == _NORMAL
                                                                     and head[2] < call.eid))):
                        step()
                        continue
                soon.pop()
                calendar.now = t
                fn = call.fn  # a local: read as a field, not looked up as a method
                fn(*call.args)
            elif queue:
                step()
            elif stop is None:
                return
            else:
                raise EmptySchedule
    except StopSimulation:
        return
    except EmptySchedule:
        raise RuntimeError(f'No scheduled events left but "until" event was not triggered: '
                           f"{stop}") from None


def sim_config(cfg: TwinConfig, params: SimParams) -> TwinConfig:
    """``cfg`` as a simulation with ``params`` runs it: its deferral re-polls coalesced
    where ``params.coalesce_polls`` asks and nothing rules it out (stalled or blocked rank
    processes handle inputs late; ``polls_coalescible``), else as they are."""
    if (params.coalesce_polls and cfg.worker_polls == "fed" and polls_coalescible(cfg)
            and params.process_stall_s <= 0 and not params.blocking_kernels):
        return cfg.replace(worker_polls="coalesced")
    return cfg


class Simulation:
    """One simulated run: ``run()`` returns when every request ended, a wedge is found, or
    ``until`` is reached. It is the runtime's driver: SimPy's clock, modelled links and NICs."""

    def __init__(self, cfg: TwinConfig, workload: Workload, *, defects: Defects | None = None,
                 faults: list[FaultSpec] | None = None, seed: int = 0,
                 params: SimParams | None = None, recorder: Recorder | None = None,
                 request_overrides: dict[int, dict[str, int]] | None = None,
                 max_concurrency: int | None = None,
                 deployment: Deployment | None = None) -> None:
        self.params = params or SimParams()
        cfg = self.cfg = sim_config(cfg, self.params)
        self.workload = workload
        self.defects = defects or Defects()
        self.deployment = deployment or Deployment.build(cfg, self.params)
        self.seed = seed
        self.recorder = recorder
        # The simulation's own calls, beside SimPy's queue; one clock and one event-id
        # counter for both
        self.calendar = Calendar(EventIds())
        self.env: simpy.Environment = CalendarEnvironment(self.calendar)
        self.topo = Topology(cfg)
        self.runtime = Runtime(build_ranks(self.topo, self.defects), self, recorder=recorder,
                               hooks={
                                   _Allocated: self._on_allocated,
                                   _Freed: self._on_freed,
                                   _WatermarkMoved: self._on_watermark,
                                   _Deferred: self._on_deferred,
                                   _DeferralsCounted: self._on_deferrals_counted,
                                   _TargetsKnown: self._on_targets_known,
                                   _RoomConcluded: self._on_concluded,
                                   _RankCrashed: self._on_rank_crashed,
                               },
                               clock=self.time)
        self.feed = self.runtime.feed
        """Hand an input to a node's core now and carry out its effects."""
        self._fire = self.runtime.fire
        self.rng_net = random.Random(f"{seed}:net")
        p = self.params
        self.stalls: ProcessStalls | None = None
        self.busy_until: dict[str, float] = {}  # blocking kernels: node -> busy until
        self._blocking = p.blocking_kernels
        if p.process_stall_s > 0:  # a stalled node's inputs wait until it runs again
            self.stalls = ProcessStalls(p.process_stall_s, p.process_run_s, seed)
        if self.stalls is not None or self._blocking:
            self.feed = self._feed_when_running
            self._fire = self._fire_when_running
        self._zmq_latency_s = p.zmq_latency_s
        self._costs = _DataPlaneCosts(p)
        self._writes_per_page = 2 * cfg.model.num_layers  # K and V of every layer
        # Mooncake's synchronous write gives up after its timeout (0: never); NIXL polls.
        self._write_timeout_s = p.mooncake_transfer_timeout_s if cfg.is_mooncake else 0.0
        self._jitter_rate = 1 / p.zmq_jitter_s if p.zmq_jitter_s > 0 else 0.0
        self._expovariate = self.rng_net.expovariate
        self._net_random = self.rng_net.random if _INLINE_EXPOVARIATE else None
        self.rng_data = random.Random(f"{seed}:data")
        self.injector = FaultInjector(list(faults or []), random.Random(f"{seed}:faults"))
        self._faulty = bool(self.injector.specs)  # read on every frame
        # Sends that block on a dead peer (twin/sim/sockets.py); checked once a rank died
        self.sockets = SendBlocking(send_timeout_s=p.zmq_send_timeout_s, sndhwm=p.zmq_sndhwm,
                                    fix=cfg.fix_set.on(STALE_WATERMARK_SUBSCRIBERS),
                                    heartbeat_s=p.heartbeat_interval_s * p.heartbeat_max_failure)
        self._dead_peers = False
        self.integrity = IntegrityModel(cfg.ring_bytes, cfg.prefill.pp_size)
        self.metrics = Metrics(self.topo)
        self.requests: dict[int, RequestState] = {}
        self.schedulers = [PrefillScheduler(self, i, self.deployment.prefill)
                           for i in range(len(self.topo.prefill_groups))]
        self.decode_loops = [DecodeLoop(self, i, self.deployment.decode)
                             for i in range(len(self.topo.decode_groups))]
        self.metrics.loops = [loop.series for loop in self.decode_loops]
        self._loop_of = {n.id: self.decode_loops[i] for i, g in enumerate(self.topo.decode_groups)
                         for n in g.nodes}
        self.placement = Placement(cfg, self.topo, self.params, request_overrides,
                                   pools=(self.deployment.prefill.max_total_tokens,
                                          self.deployment.decode.max_total_tokens))
        self._links: dict[str, dict[str, _Link]] = {}  # src -> dst -> its sockets' last frames
        self.nic_free: dict[str, float] = {}
        self.stream_free: dict[str, float] = {}
        self.alloc_span: dict[tuple[str, int], tuple[int, int]] = {}
        self.fault_notes: dict[int, list[str]] = {}  # room -> injected faults that touched it
        self.restarted: dict[str, str] = {}  # node -> how it crashed and came back empty
        self.crash_times: dict[str, float] = {}  # node -> when it (last) died
        self.unfinished = len(workload.requests)
        self.arrived = 0
        self.done = self.env.event()
        self.stop_reason = ""
        self.progress_cb: Callable[[float], None] | None = None
        # Closed-loop clients (like a benchmark's --max-concurrency): a request is sent at its
        # arrival time or when one of the ``max_concurrency`` slots frees, whichever is later.
        self.slots = simpy.Resource(self.env, max_concurrency) if max_concurrency else None
        self._slot_req: dict[int, Any] = {}
        self._want: dict[tuple[str, int], int] = {}
        self._room_init: dict[tuple[int, int],
                              list[tuple[str, tuple[str, ...], tuple[str, ...]]]] = {}
        self._ticks: set[Any] = set()  # the watchers' pending ticks (SimPy events)
        self._tick_due = self._wake_watcher  # one bound method: calendar calls compare to it

    # -- what the runtime reads ----------------------------------------------------------------
    @property
    def ranks(self) -> dict[str, PrefillRank | DecodeRank]:
        return self.runtime.ranks

    @property
    def crashed(self) -> dict[str, str]:
        return self.runtime.crashed

    @property
    def inputs(self) -> int:
        """Inputs fed to the cores (a coalesced poll is not one)."""
        return self.runtime.inputs

    @property
    def polls(self) -> int:
        """Inputs fed plus the coalesced polls the cores accounted: the fed run's input
        count, whichever form of polls ran (what an event budget counts)."""
        rt = self.runtime
        return rt.inputs + rt.polls_accounted - rt.settles

    @property
    def last_dropped(self) -> dict[int, list[str]]:
        return self.runtime.dropped

    def mark_progress(self) -> None:
        """Something moved forward now (the wedge monitor's clock)."""
        self.runtime.last_progress = self.calendar.now

    # -- driver: clock -------------------------------------------------------------------------
    def time(self) -> float:
        return self.calendar.now  # a native field (read on every input)

    def at(self, delay: float, fn: Callable[..., object], *args: Any) -> None:
        """Call ``fn(*args)`` ``delay`` seconds from now (as a Timeout of ``max(0, delay)``
        with that callback would, one SimPy event)."""
        self.calendar.add(self.calendar.now + (delay if delay > 0.0 else 0.0), fn, args)

    def _stalled(self, node: str, fn: Callable[..., object], *args: Any) -> bool:
        """True when ``node`` is stalled now: ``fn(*args)`` is then called again when it runs
        (after whatever reached it before, in order)."""
        now = self.calendar.now
        end = self.stalls.end(node, now) if self.stalls is not None else now
        busy = self.busy_until.get(node, 0.0)
        if busy > end:
            end = busy
        if end > now:
            self.at(end - now, fn, *args)
            return True
        return False

    def _feed_when_running(self, node: str, event: ev.Input) -> list[ev.Effect]:
        if self._stalled(node, self._feed_when_running, node, event):
            return []
        return self.runtime.feed(node, event)

    def _fire_when_running(self, node: str, event: ev.Input, token: int) -> None:
        if not self._stalled(node, self._fire_when_running, node, event, token):
            self.runtime.fire(node, event, token)

    def feed_at(self, at: float, node: str, event: ev.Input, token: int) -> None:
        now = self.calendar.now
        delay = at - now
        # An input without a poll token is always wanted: feed it without ``fire``'s check.
        t = now + (delay if delay > 0.0 else 0.0)
        if token:
            self.calendar.add(t, self._fire, (node, event, token))
        else:
            self.calendar.add(t, self.feed, (node, event))

    def take_id(self) -> int:
        """An event id for a call scheduled later with ``feed_at_id``."""
        return self.calendar.eids.take()

    def feed_at_id(self, at: float, eid: int, node: str, event: ev.Input, token: int) -> None:
        """``feed_at`` ordered among calls at the same time as event id ``eid``."""
        now = self.calendar.now
        self.calendar.add_as(at if at > now else now, eid, self._fire, (node, event, token))

    def sys(self, node: str, record: dict[str, Any]) -> None:
        if self.recorder is not None:
            self.recorder.write_sys(self.calendar.now, node, record)

    # -- driver: control plane -----------------------------------------------------------------
    def transmit(self, src: str, dst: str, msg: wire.Message) -> None:
        if self._faulty or self._dead_peers:
            self._transmit_faulty(src, dst, msg)
            return
        # No faults: one copy, no extra delay (the same arithmetic as ``_transmit_faulty``).
        now = self.calendar.now
        jitter = self._jitter_rate
        if not jitter:
            delay = self._zmq_latency_s + 0.0
        elif self._net_random is not None:  # ``expovariate(jitter)``, inlined
            delay = self._zmq_latency_s + -math.log(1.0 - self._net_random()) / jitter
        else:
            delay = self._zmq_latency_s + self._expovariate(jitter)
        t = now + delay
        if self._blocking:  # sent once the sender's kernels for this input have run
            t += max(0.0, self.busy_until.get(src, 0.0) - now)
        t = self._link(src, dst).after(_PREFETCH if type(msg) is _STAGING_REQ else _CONTROL, t)
        delay = t - now
        self.calendar.add(now + (delay if delay > 0.0 else 0.0), self.feed,
                       (dst, _MessageArrived(src=src, msg=msg)))

    def _transmit_faulty(self, src: str, dst: str, msg: wire.Message) -> None:
        p = self.params
        fate = self.injector.message(src, dst, msg)
        if fate.applied:
            detail = f"{wire.tag_of(msg).decode()} {src}->{dst}"
            self._fault(src, ";".join(fate.applied), detail, getattr(msg, "room", -1))
            if fate.send_failed:
                self.feed(src, _SendFailed(dst=dst, msg=msg))
                return
        delay = p.zmq_latency_s + (self.rng_net.expovariate(1 / p.zmq_jitter_s)
                                   if p.zmq_jitter_s > 0 else 0.0)
        socket = wire.socket_of(msg)  # FIFO per sending socket, not per peer
        msg = fate.frame(msg)  # a corrupt fault rewrites fields before the frame leaves
        copies, extra = fate.copies, fate.extra_s
        if fate.hold_s:
            # A delay stalls the socket: this frame and every later one on it wait.
            delay += fate.hold_s
            extra -= fate.hold_s
        if self._blocking:
            delay += max(0.0, self.busy_until.get(src, 0.0) - self.calendar.now)
        if self._dead_peers:  # the send may wait for its thread, block, or go nowhere
            depart = self._socket_send(src, dst, msg, None)
            if depart < 0:
                return
            delay += depart - self.calendar.now
        t = self._link(src, dst).after(socket, self.calendar.now + delay)
        arrived = _MessageArrived(src=src, msg=msg)
        for i in range(copies):
            self.at(t + extra + i * 1e-6 - self.calendar.now, self.feed, dst, arrived)

    def control(self, src: str, dst: str, event: ev.Input) -> None:
        """Metadata (on decode's control socket, in order with its frames) and other notices:
        the control link's latency and order, no jitter."""
        delay = self.params.zmq_latency_s
        if self._dead_peers:
            depart = self._socket_send(src, dst, None, event)
            if depart < 0:
                return
            delay += depart - self.calendar.now
        t = self._link(src, dst).after(_CONTROL, self.calendar.now + delay)
        self.at(t - self.calendar.now, self.feed, dst, event)

    def _link(self, src: str, dst: str) -> _Link:
        """The link from ``src`` to ``dst`` (made on first use)."""
        peers = self._links.get(src)
        if peers is None:
            peers = self._links[src] = {}
        link = peers.get(dst)
        if link is None:
            link = peers[dst] = _Link()
        return link

    def _socket_send(self, src: str, dst: str, msg: wire.Message | None,
                     notice: ev.Input | None) -> float:
        """When a frame (or a control notice) from ``src`` leaves, or -1 if it never reaches
        ``dst`` (``SendBlocking.send``)."""
        if notice is not None and type(notice) is _PeerPolled:
            return self.calendar.now  # decode group peers: a collective, not a ZMQ socket
        dead = dst in self.runtime.crashed
        server_dead = False
        if dead and self.topo.nodes[dst].role == "prefill":  # decode's heartbeat probes it
            server_dead = self._server_dead(self.topo.nodes[dst].instance)
        return self.sockets.send(self.calendar.now, src, self.topo.nodes[src].role, dst, dead,
                                 msg, self.runtime.current, server_dead)

    def scheduler_blocked_until(self, nodes: list[str]) -> float:
        """Until when the scheduler thread of any of ``nodes`` sits in a blocked send."""
        if not self._dead_peers:
            return 0.0
        return max(self.sockets.blocked_until(n) for n in nodes)

    def _on_rank_crashed(self, node: str, e: ev.RankCrashed) -> None:
        self._dead_peers = True
        self.crash_times[node] = self.calendar.now
        self._check_server(node)

    def _server_dead(self, instance: int) -> bool:
        """Whether every rank of prefill server ``instance`` is gone (its bootstrap endpoint,
        which decode's bootstrap queries and heartbeat probe, with it)."""
        crashed = self.runtime.crashed
        return all(n.id in crashed for g in self.topo.prefill_groups if g.instance == instance
                   for n in g.nodes)

    def _check_server(self, node: str) -> None:
        """``node`` died: if that took its whole prefill server, decode's heartbeat gives up
        on the server ``heartbeat_interval_s x heartbeat_max_failure`` later."""
        n = self.topo.nodes[node]
        if n.role == "prefill" and self._server_dead(n.instance):
            self.at(self.sockets.heartbeat_s, self._heartbeat_failed, n.instance)

    def _heartbeat_failed(self, instance: int) -> None:
        """SGLang's ``_handle_node_failure`` (common/conn.py ~2057-2083): the heartbeat
        failed ``heartbeat_max_failure`` probes in a row, so decode fails every room of that
        prefill server (unless the server came back meanwhile)."""
        if not self._server_dead(instance):
            return
        p = self.params
        reason = (f"prefill server p{instance} failed decode's heartbeat "
                  f"({p.heartbeat_max_failure} probes {p.heartbeat_interval_s:g} s apart)")
        self.sys("driver", {"type": "Note", "text": (
            f"{reason}: SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL {p.heartbeat_interval_s:g} s, "
            f"SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE {p.heartbeat_max_failure}; decode "
            f"fails the server's rooms")})
        for req in list(self.requests.values()):
            if not req.finished and \
                    self.topo.prefill_groups[req.prefill_group].instance == instance:
                self.abort(req.room, reason)

    # -- driver: data plane --------------------------------------------------------------------
    def start_transfer(self, node: str, e: ev.StartTransfer) -> None:
        p = self._costs
        now = self.calendar.now
        req = self.requests.get(e.room)
        if req is not None and req.first_transfer_s < 0:
            req.first_transfer_s = now
        wire_s = e.nbytes / p.nic_bandwidth_Bps
        if e.staged:  # gather the head slice into the staging buffer, one bulk WRITE
            gather = p.kernel_launch_s + e.nbytes / p.gather_bandwidth_Bps
        else:  # straight from the KV pool: one WRITE per page, layer and K/V
            gather = 0.0
            wire_s += e.num_pages * self._writes_per_page * p.direct_write_s
        if self._blocking:  # the gather holds the process; the WRITE is posted after it
            gather += max(0.0, self.busy_until.get(node, 0.0) - now)
            self.busy_until[node] = now + gather
        nic = self.metrics.nic_of(node, p.ranks_per_nic)
        start = max(now + gather, self.nic_free.get(nic, 0.0))
        self.nic_free[nic] = start + wire_s
        self.metrics.nic_busy(nic, wire_s, e.nbytes)
        done = start + wire_s + p.rdma_latency_s
        if p.transfer_jitter_s > 0:
            done += self.rng_data.expovariate(1 / p.transfer_jitter_s)
        timeout = self._write_timeout_s
        if timeout > 0 and done - (now + gather) > timeout:
            # Mooncake's batch_transfer_sync (called after the gather) returns -1 at its
            # timeout with the batch still running: the worker is free again then, the room
            # is poisoned, and the bytes still land when the batch ends (mooncake/conn.py
            # ~2478 _poison_unsettled_send).
            self.at(gather + timeout, self._transfer_timed_out, node, e, timeout)
            self.at(done - now, self._late_write_lands, e)
            return
        self.at(done - now, self._transfer_done, node, e, now)

    def _transfer_timed_out(self, node: str, e: ev.StartTransfer, timeout: float) -> None:
        self.feed(node, _TransferDone(
            worker=e.worker, ok=False, settled=False,
            error=f"batch_transfer_sync_write timed out after {timeout:g} s "
                  f"(MC_TRANSFER_TIMEOUT); the batch may still be writing"))

    def _late_write_lands(self, e: ev.StartTransfer) -> None:
        """The bytes of a write whose call timed out, landing when its batch ends."""
        self.integrity.on_transfer(e.session, e)

    def _transfer_done(self, node: str, e: ev.StartTransfer, t0: float) -> None:
        failed = self.injector.transfer_fails(node) if self._faulty else None
        if failed:
            detail = f"room {e.room} chunk {e.chunk_idx} write to {e.session}"
            self._fault(node, failed, detail, e.room)
            self.feed(node, _TransferDone(worker=e.worker, ok=False, error=failed))
            return
        self.integrity.on_transfer(e.session, e)
        now = self.calendar.now
        req = self.requests.get(e.room)
        if req is not None:
            req.last_transfer_s = now
        self.metrics.transfer(now - t0, e.nbytes)
        self.feed(node, _TransferDone(worker=e.worker))

    def start_scatter(self, node: str, e: ev.StartScatter) -> None:
        p = self._costs
        now = self.calendar.now
        start = max(now, self.stream_free.get(node, 0.0))
        finish = start + p.kernel_launch_s + e.nbytes / p.scatter_bandwidth_Bps
        self.stream_free[node] = finish
        if self._blocking:
            self.busy_until[node] = finish
        self.at(start - now, self.integrity.on_scatter, node, e, list(e.writer_bytes))
        # The scatter's event is seen by the decode loop's next poll after it finished.
        self._loop_of[node].scatter_started(
            node, finish,
            _ScatterDone(room=e.room, chunk_idx=e.chunk_idx, alloc_id=e.alloc_id))

    def _fault(self, node: str, fault: str, detail: str, room: int) -> None:
        """Record a fault that fired (with the room it touched, when one) and note it for the
        wedge diagnosis (``fault_record``; a replay notes it again from the record)."""
        self.sys(node, fault_record(self.fault_notes, fault, detail, room))

    # -- hooks: metrics, integrity and requests ------------------------------------------------
    def _on_deferred(self, node: str, e: ev.Deferred) -> None:
        req = self.requests.get(e.room)
        if req is not None:
            req.deferrals += 1
        self.metrics.deferral(node)

    def _on_deferrals_counted(self, node: str, e: ev.DeferralsCounted) -> None:
        requests = self.requests
        total = 0
        for room, n in zip(e.rooms, e.counts, strict=True):
            req = requests.get(room)
            if req is not None:
                req.deferrals += n
            total += n
        self.metrics.deferrals[node] += total

    def _on_targets_known(self, node: str, e: ev.TargetsKnown) -> None:
        req = self.requests.get(e.room)
        if req is None or req.finished:
            return
        key = (node, req.decode_group)
        want = self._want.get(key)
        if want is None:  # the topology is fixed: count each pair's targets once
            want = self._want[key] = len(self.topo.targets_of(
                self.topo.nodes[node], self.topo.decode_groups[req.decode_group]))
        group = len(self.topo.prefill_groups[req.prefill_group].nodes)
        if req.note_targets(node, len(e.sessions), want, group):
            req.bootstrap_done_s = self.calendar.now
            self.schedulers[req.prefill_group].admit(req)

    def _on_concluded(self, node: str, e: ev.RoomConcluded) -> None:
        req = self.requests.get(e.room)
        if req is None:
            return
        if self.topo.nodes[node].role != "decode":
            group = len(self.topo.prefill_groups[req.prefill_group].nodes)
            if req.note_prefill_concluded(node, group):
                self.schedulers[req.prefill_group].transfer_done(req)
            return
        self.integrity.on_concluded(node, e.room, e.status, self.placement.total_pages(req))
        group = len(self.topo.decode_groups[req.decode_group].nodes)
        status = req.note_concluded(node, e.status, e.reason, group)
        if status is not None:
            self.conclude(req, status, req.reason)

    def _on_allocated(self, node: str, e: ev.Allocated) -> None:
        self.alloc_span[(node, e.alloc_id)] = (e.offset, e.size)
        self.metrics.occupancy(node, self.calendar.now, e.size)

    def _on_freed(self, node: str, e: ev.Freed) -> None:
        span = self.alloc_span.pop((node, e.alloc_id), None)
        if span is not None:
            self.integrity.on_freed(node, span[0], span[1])
            self.metrics.occupancy(node, self.calendar.now, -span[1])

    def _on_watermark(self, node: str, e: ev.WatermarkMoved) -> None:
        self.metrics.watermark_lag(node, self.calendar.now, e.lag_bytes)

    # -- requests ----------------------------------------------------------------------------
    def _arrive(self, r: Request) -> None:
        self.arrived += 1
        self.mark_progress()
        req = self.placement.place(r, self.calendar.now)
        self.requests[req.room] = req
        self.sys("driver", self.placement.arrival_record(req))
        self.at(self.params.decode_prealloc_s, self._decode_arrive, req)
        self.at(self.cfg.bootstrap_timeout_s, self._bootstrap_deadline, req)

    def _decode_arrive(self, req: RequestState) -> None:
        if req.finished:
            return
        if self.restarted:
            down = [n.id for n in self.topo.decode_groups[req.decode_group].nodes
                    if n.id in self.runtime.crashed and n.id in self.restarted]
            if down:  # the decode server, restarting, is not there to take the request
                self._fail_at_decode(req, f"decode rank {down[0]} is down "
                                          f"({self.runtime.crashed[down[0]]})")
                return
        self.decode_loops[req.decode_group].arrived(req)
        instance = self.topo.prefill_groups[req.prefill_group].instance
        if self._dead_peers and self._server_dead(instance):
            # decode's bootstrap query to the server's endpoint is refused: the receiver fails
            self.abort(req.room, f"prefill server p{instance} is gone: its bootstrap endpoint "
                                 f"refused decode's query")

    def decode_admitted(self, req: RequestState) -> None:
        """The decode loop pre-allocated the request's KV: register the room on every decode
        rank of its group (each sends its metadata to prefill)."""
        key = (req.prefill_group, req.decode_group)
        ranks = self._room_init.get(key)
        if ranks is None:  # the topology is fixed: each decode rank's writers and group, once
            pg = self.topo.prefill_groups[req.prefill_group]
            ranks = self._room_init[key] = [
                (d.id, self.topo.writers_of(d, pg), self.topo.decode_group_of(d))
                for d in self.topo.decode_groups[req.decode_group].nodes]
        init_pages = self.placement.total_pages(req)
        attn_tp = self.cfg.prefill.attn_tp_size
        for node, writers, group in ranks:
            self.feed(node, _DecodeRoomInit(
                room=req.room, prefill_ranks=writers, prefill_attn_tp=attn_tp,
                decode_prefix_len=req.decode_prefix_len, total_pages=init_pages, group=group))

    def _bootstrap_deadline(self, req: RequestState) -> None:
        """SGLang's bootstrap timeout fails only the prefill sender (its own poll); decode
        learns nothing and gives up at its waiting timeout."""
        if req.bootstrap_done_s >= 0 or req.finished:
            return
        reason = "bootstrap timeout: decode metadata never reached every rank"
        for n in self.topo.prefill_groups[req.prefill_group].nodes:
            self.feed(n.id, _RoomAborted(room=req.room, reason=reason))

    def abort(self, room: int, reason: str) -> None:
        """Abort a request everywhere (client abort, bootstrap timeout)."""
        req = self.requests.get(room)
        if req is None or req.finished:
            return
        nodes = [n.id for n in self.topo.prefill_groups[req.prefill_group].nodes]
        nodes += [n.id for n in self.topo.decode_groups[req.decode_group].nodes]
        for n in nodes:
            self.feed(n, _RoomAborted(room=room, reason=reason))
        if not req.finished and self.decode_loops[req.decode_group].abandon(req):
            # Still waiting for decode KV pages: no decode rank knows the room.
            self.conclude(req, "Failed", reason)
            self.request_ended(req)

    def conclude(self, req: RequestState, status: str, reason: str = "") -> None:
        """Every decode rank of the group concluded the room: its KV landed (or it failed).
        The decode loop picks it up at its next poll."""
        req.status = status
        req.reason = reason
        req.kv_done_s = self.calendar.now
        self.mark_progress()
        self.decode_loops[req.decode_group].room_concluded(req)

    def first_token(self, req: RequestState) -> None:
        req.first_token_s = self.calendar.now

    def request_ended(self, req: RequestState) -> None:
        """The request's last token streamed, or it failed: the client has its answer."""
        req.end_s = self.calendar.now
        self.unfinished -= 1
        self.mark_progress()
        self.metrics.request_done(req)
        slot = self._slot_req.pop(req.rid, None)
        if slot is not None and self.slots is not None:
            self.slots.release(slot)
        if req.status == "Success":
            self.placement.decode_done(self.workload.requests[req.rid], req.decode_group,
                                       self.decode_loops[req.decode_group].used)
        if self.unfinished == 0 and not self.done.triggered:
            self.stop_reason = "all requests ended"
            self.done.succeed()

    def prefill_finished(self, req: RequestState) -> None:
        self.placement.prefill_done(self.workload.requests[req.rid], req.prefill_group,
                                    self.schedulers[req.prefill_group].used)

    # -- timed faults and the run loop -------------------------------------------------------
    def _timed_fault(self, spec: FaultSpec) -> None:
        self.sys("driver", {"type": "FaultInjected", "fault": spec.text, "detail": ""})
        if spec.action == "abort":
            req = self.requests.get(spec.room or 0)
            if req is not None:
                self.abort(req.room, f"aborted by fault {spec.text}")
            return
        if spec.target not in self.ranks:
            return
        for node in self._fault_scope(spec):
            self.runtime.crashed[node] = crash_reason(spec.text)
            self.crash_times[node] = self.calendar.now
            self._dead_peers = True
            self._check_server(node)
            if spec.action == "restart":
                self.restarted[node] = restart_reason(spec.text)
                self.at(spec.down or 0.0, self._restart, node)
                if self.topo.nodes[node].role == "decode":
                    self._lose_decode_requests(node)

    def _lose_decode_requests(self, node: str) -> None:
        """``node``'s decode process died to come back empty (a restart): the requests its
        server held die with it, as a client of a decode server that went away gets an
        error, and its group's scheduler starts empty. Their prefill rooms are left to the
        protocol. (A rank that stays dead keeps its requests: the run's wedge names it.)"""
        group = next(i for i, g in enumerate(self.topo.decode_groups)
                     if any(n.id == node for n in g.nodes))
        reason = f"lost with decode rank {node} ({self.restarted[node]})"
        for req in self.decode_loops[group].lose_all():
            self._fail_at_decode(req, reason)

    def _fail_at_decode(self, req: RequestState, reason: str) -> None:
        """End ``req`` Failed outside the protocol: its decode server is gone (the client
        gets an error)."""
        if req.end_s >= 0:
            return
        if req.kv_done_s < 0:
            req.kv_done_s = self.calendar.now
        req.status, req.reason = "Failed", reason
        self.sys("driver", {"type": "RequestLost", "room": req.room, "reason": reason})
        self.mark_progress()
        self.request_ended(req)

    def _fault_scope(self, spec: FaultSpec) -> list[str]:
        """The ranks a crash or restart takes down that are still running."""
        return [n for n in scope_nodes(self.topo, spec)
                if n == spec.target or n not in self.runtime.crashed]

    def _restart(self, node: str) -> None:
        self.runtime.restart(node, build_rank(self.cfg, self.topo.nodes[node], self.defects))
        self.sockets.revived(node)
        self.integrity.restarted(node)
        self.sys("driver", {"type": "Note", "text": f"{node} restarted with empty state"})

    def _arrivals(self) -> Generator[simpy.Event, Any, None]:
        env, calendar = self.env, self.calendar
        for r in self.workload.requests:
            if r.arrival_s > calendar.now:
                yield env.timeout(r.arrival_s - calendar.now)
            if self.slots is not None:
                slot = self.slots.request()
                yield slot
                self._slot_req[r.rid] = slot
            self._arrive(r)

    def watch(self, check: Callable[[], str], every: float) -> None:
        """Ask ``check()`` every ``every`` simulated seconds (at least 1 ms) until the run is
        done: a non-empty answer is the run's stop reason and stops it there, so a stopped run
        is the full run's exact prefix. Call before ``run`` (which adds the wedge monitor).
        While no request is in flight the ticks up to the next arrival are skipped
        (``_idle_wake``): ``check`` must answer from the requests in flight and the results of
        finished ones, as the wedge monitor and the advisor's early stop do."""
        self.env.process(self._watch(check, max(every, 1e-3)))

    def _watch(self, check: Callable[[], str], every: float
               ) -> Generator[simpy.Event, Any, None]:
        env = self.env
        ticks = self._ticks
        while not self.done.triggered:
            wake = self._idle_wake(every)
            tick = env.timeout(every) if wake is None else wake
            ticks.add(tick)
            yield tick
            ticks.discard(tick)
            reason = check()
            if reason:
                self.stop_reason = reason
                if not self.done.triggered:
                    self.done.succeed()
                return

    def _idle_wake(self, every: float) -> simpy.Event | None:
        """With no request in flight and nothing else happening, a watcher's ticks ask a
        question whose answer cannot change (nothing in flight can wedge or run late), so the
        ticks up to the next pending event (an arrival, a timer, a frame; not another
        watcher's tick) are skipped: the event returned fires at the first tick after it, the
        very instant the watcher would have reached adding ``every`` tick by tick
        (``next_tick_after``). None while requests are in flight or the next tick comes
        first."""
        requests = self.workload.requests
        if self.arrived != len(requests) - self.unfinished:
            return None
        now = self.calendar.now
        if self.arrived < len(requests) and requests[self.arrived].arrival_s < now + every:
            return None  # the next arrival comes before the next tick: no scan needed
        due = self._next_event_time()
        if now + every > due or due == math.inf:
            return None
        wake = self.env.event()
        self.calendar.add(next_tick_after(now, every, due), self._tick_due, (wake,))
        return wake

    def _wake_watcher(self, wake: simpy.Event) -> None:
        wake.succeed()

    def _next_event_time(self) -> float:
        """When the next event other than a watcher's tick is due (inf: none is)."""
        due = math.inf
        ticks = self._ticks
        queue: Any = self.env._queue
        for entry in queue:  # (time, priority, event id, event)
            if entry[0] < due and entry[3] not in ticks:
                due = entry[0]
        tick_due = self._tick_due
        for calls in (self.calendar.soon, self.calendar.later):
            for call in calls:
                if call.t < due and call.fn is not tick_due:
                    due = call.t
        return due

    def _monitor(self, window: float) -> Generator[simpy.Event, Any, None]:
        """The wedge monitor's process: ``_wedge_check`` every quarter ``window``."""
        return self._watch(lambda: self._wedge_check(window), max(window / 4, 1e-3))

    def _wedge_check(self, window: float) -> str:
        """Requests in flight and no progress for ``window`` is a wedge. Also reports progress
        to ``progress_cb``."""
        now = self.calendar.now
        if self.progress_cb is not None:
            self.progress_cb(now)
        in_flight = self.arrived - (len(self.workload.requests) - self.unfinished)
        idle = now - self.runtime.last_progress
        if idle >= window and self._dead_peers and any(
                now < until < math.inf for until in self.sockets.busy.values()):
            return ""  # a thread sits in a send that will return: slow, not stuck
        return "wedge" if in_flight > 0 and idle >= window else ""

    def run_pending(self) -> None:
        """Run what is scheduled, and what that schedules, until nothing is left (a test
        that drives the driver's methods by hand, without requests, uses it)."""
        _run_until(self.env, self.calendar, None)

    def run(self, until: float | None = None, *, monitor: bool = True) -> str:
        """Run to the end; returns the stop reason: ``all requests ended``, ``wedge``,
        ``event queue empty`` or ``until``. ``monitor=False`` runs without the no-progress
        monitor, leaving the fallback wedge detection (the event queue empties)."""
        env = self.env
        if not self.workload.requests:
            return "all requests ended"
        env.process(self._arrivals())
        for spec in self.injector.timed():
            self.at(spec.at or 0.0, self._timed_fault, spec)
        if monitor:
            env.process(self._monitor(self.params.wedge_window_s))
        stop = self.done if until is None else (self.done | env.timeout(until))
        calendar = self.calendar

        def note_signal(signum: int) -> None:
            calendar.stop_signal = signum

        try:
            # Ctrl-C, SIGTERM and SIGHUP are acted on between two events: the loop returns
            # before the next call once one is noted (the calendar's own field), and the
            # handler from before the run decides here (it raises, or the run goes on).
            with paced_collector(), held_for_safe_points(note_signal) as noted:
                while True:
                    _run_until(env, calendar, stop)
                    if not calendar.stop_signal:
                        break
                    calendar.stop_signal = 0
                    noted.deliver()
        except RuntimeError as exc:  # SimPy: no scheduled events left before ``stop``
            if "No scheduled events left" not in str(exc):
                raise
            self.stop_reason = "event queue empty"
        if not self.stop_reason:
            self.stop_reason = "until"
        self.runtime.settle()  # coalesced polls due before the stop are counted
        self.metrics.prefill_pools = [s.series for s in self.schedulers]
        self.metrics.serving = self.serving_summary()
        self.metrics.send_blocked_s = self.sockets.totals(self.calendar.now)
        self.metrics.send_blocked_by_frame = {k: round(v, 6) for k, v in
                                              sorted(self.sockets.by_frame.items())}
        self.metrics.send_blocked_by_thread = {k: round(v, 6) for k, v in
                                               sorted(self.sockets.by_thread.items())}
        return self.stop_reason

    def serving_summary(self) -> dict[str, Any]:
        """The deployment's model, GPU, pools and cost source, and what the pools did."""
        d = self.deployment
        return {
            "model": d.model.name, "gpu": d.gpu.name, "costs": d.source,
            "prefill": {"max_total_tokens": d.prefill.max_total_tokens,
                        "max_running_requests": d.prefill.max_running_requests,
                        "peak_kv_tokens": max((s.peak_used for s in self.schedulers), default=0),
                        "blocked_s": round(sum(s.blocked_s for s in self.schedulers), 6)},
            "decode": {"max_total_tokens": d.decode.max_total_tokens,
                       "max_running_requests": d.decode.max_running_requests,
                       "steps": sum(x.steps_run for x in self.decode_loops),
                       "retractions": sum(x.retractions for x in self.decode_loops)},
        }
