"""Fit the simulator's cost model to hardware-mode traces (``twin calibrate``).

A hardware trace records every input each rank handled and every effect it returned, on one
clock. ``measure`` reads the pieces of the cost model straight out of it:

* control plane: each SGLang frame's ``Send`` on its source to its ``MessageArrived`` on its
  destination (``zmq_latency_s`` from the fast end, ``zmq_jitter_s`` the exponential whose
  median matches the median);
* bootstrap: arrival to the last prefill rank's ``RoomBootstrapped`` (``decode_prealloc_s``,
  which also absorbs the metadata path);
* kernels and transfers: ``StartScatter`` to ``ScatterDone`` and ``StartTransfer`` to
  ``TransferDone`` against their byte counts (launch cost and bandwidth; the scatter's excess
  over its kernel time is the decode loop's polling, ``decode_poll_interval_s``); a direct
  page write's (equal attention TP, ``staged`` False) against its count of writes, one per
  page, layer and K/V (``direct_write_s``, fitted only from traces that have such writes);
* prefill cadence: the gap between a room's successive ``SendKV`` calls
  (``forward_overhead_s``; the hardware mode's scheduler forwards one request at a time for a
  fixed time, and decodes nothing, so per-token and decode compute costs are zero).

``calibrate`` then simulates each trace's own workload with those costs and scales the three
parameters the measurement pins down least (control-plane jitter, the forward cadence and the
polling interval) so that the simulated per-room p50 transfer span and time until all KV landed
match the measured ones across the traces. ``write_costs`` writes the ``[sim]`` table and the
host the traces ran on (``twin.calibrate.host``); ``twin replay TRACE --config costs.toml``
compares any hardware trace with it, and says when the trace ran on another host.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from twin.calibrate.host import fitted_host, host_line, trace_host
from twin.calibrate.phases import room_phases, simulate_recorded
from twin.core import wire
from twin.runtime.params import SimParams
from twin.trace.format import Trace

PHASES = ("kv_done_s", "transfer_s")
"""What calibration matches: per room, arrival to all KV landed, and first StartTransfer to
last TransferDone (the phases ``twin replay`` compares)."""


@dataclass
class Measured:
    """What one hardware trace says about each part of the cost model (seconds, bytes)."""

    path: str
    frames: list[float] = field(default_factory=list)
    bootstrap: list[float] = field(default_factory=list)
    transfers: list[tuple[int, float]] = field(default_factory=list)  # staged: bytes, s
    # direct page writes: (writes, one per page, layer and K/V; bytes; seconds)
    direct: list[tuple[int, int, float]] = field(default_factory=list)
    transfer_busy: list[tuple[int, float]] = field(default_factory=list)  # per node: bytes, busy s
    scatters: list[tuple[int, float]] = field(default_factory=list)
    # per decode node, in start order: (start, done, bytes) of each scatter
    scatter_spans: dict[str, list[tuple[float, float, int]]] = field(default_factory=dict)
    forward_gaps: list[float] = field(default_factory=list)
    rank_skew: list[float] = field(default_factory=list)  # one scheduler call, across ranks
    phases: dict[int, dict[str, float]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        def q(values: list[float]) -> dict[str, float]:
            if not values:
                return {}
            a = np.asarray(values)
            return {"n": int(a.size), "p10": float(np.percentile(a, 10)),
                    "p50": float(np.median(a)), "p90": float(np.percentile(a, 90))}
        return {"frames_s": q(self.frames), "bootstrap_s": q(self.bootstrap),
                "write_s": q([d for _, d in self.transfers]),
                "direct_write_s": q([d for _, _, d in self.direct]),
                "scatter_s": q([d for _, d in self.scatters]),
                "forward_gap_s": q(self.forward_gaps), "rank_skew_s": q(self.rank_skew),
                "rank_write_Bps": q([b / t for b, t in self.transfer_busy if t > 0]),
                **{p: q([v[p] for v in self.phases.values() if p in v]) for p in PHASES}}


def measure(trace: Trace) -> Measured:
    """Read the cost model's pieces out of a hardware trace (see the module docstring)."""
    m = Measured(str(trace.path))
    arrival: dict[int, float] = {}
    booted: dict[int, float] = {}
    frames = _FrameMatcher()
    xfers: dict[tuple[str, int], tuple[float, int, int]] = {}  # -> (t, bytes, writes or 0)
    writes_per_page = 2 * trace.config.model.num_layers  # a direct write's, as simulated
    scatters: dict[tuple[str, int, int], tuple[float, int]] = {}
    per_room: dict[tuple[str, int], list[float]] = defaultdict(list)
    spans: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    calls: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    for rec in trace.events:
        t, kind = rec.t, rec.type
        if kind == "RequestArrived":
            arrival[rec.data["room"]] = t
            continue
        if rec.dir not in ("in", "out"):
            continue
        e = rec.event
        if kind == "Send":
            frames.sent(t, rec.node, e.dst, e.msg)
        elif kind == "MessageArrived":
            frames.arrived(t, e.src, rec.node, e.msg)
        elif kind == "RoomBootstrapped":
            booted[e.room] = max(booted.get(e.room, 0.0), t)
        elif kind == "StartTransfer":
            writes = 0 if e.staged else e.num_pages * writes_per_page
            xfers[(rec.node, e.worker)] = (t, e.nbytes, writes)
        elif kind == "TransferDone":
            posted = xfers.pop((rec.node, e.worker), None)
            if posted is not None and e.ok:
                t0, nbytes, writes = posted
                if writes:
                    m.direct.append((writes, nbytes, t - t0))
                else:
                    m.transfers.append((nbytes, t - t0))
                spans[rec.node].append((t0, t, nbytes))
        elif kind == "StartScatter":
            scatters[(rec.node, e.room, e.chunk_idx)] = (t, e.nbytes)
        elif kind == "ScatterDone":
            start = scatters.pop((rec.node, e.room, e.chunk_idx), None)
            if start is not None:
                m.scatters.append((start[1], t - start[0]))
                m.scatter_spans.setdefault(rec.node, []).append((start[0], t, start[1]))
        elif kind in ("Prefetch", "SendKV"):
            calls[(kind, e.room, getattr(e, "end_idx", -1))].append(t)
            per_room[(rec.node, e.room)].append(t)
    m.frames = frames.latencies
    m.bootstrap = [booted[r] - arrival[r] for r in booted if r in arrival]
    m.rank_skew = [max(v) - min(v) for v in calls.values() if len(v) > 1]
    # A rank's calls for one room come a forward apart, but commands delayed by scheduling
    # arrive in bunches: the room's mean gap is its cadence.
    m.forward_gaps = [(v[-1] - v[0]) / (len(v) - 1) for v in per_room.values() if len(v) > 1]
    for node_spans in spans.values():
        busy, end = 0.0, -math.inf
        for a, b, _ in sorted(node_spans):
            if b > end:
                busy += b - max(a, end)
                end = b
        m.transfer_busy.append((sum(n for _, _, n in node_spans), busy))
    m.phases = room_phases(trace)
    return m


class _FrameMatcher:
    """Pairs each frame's ``Send`` (source, time) with its ``MessageArrived`` at the
    destination: same destination and bytes, in order; the source too where the arrival names
    it (a hardware rank does not know the sender of every socket's frames)."""

    def __init__(self) -> None:
        self._sent: dict[tuple[str, tuple[bytes, ...]], deque[tuple[float, str]]] = \
            defaultdict(deque)
        self.latencies: list[float] = []

    def sent(self, t: float, src: str, dst: str, msg: wire.Message) -> None:
        self._sent[(dst, tuple(wire.encode(msg)))].append((t, src))

    def arrived(self, t: float, src: str, dst: str, msg: wire.Message) -> None:
        q = self._sent.get((dst, tuple(wire.encode(msg))))
        if not q:
            return
        for i, (t0, s) in enumerate(q):
            if not src or s == src:
                del q[i]
                self.latencies.append(t - t0)
                return


LINE_SPAN = 1.5
"""A fixed cost is told from a cost per byte only over sizes at least this far apart (the
slope through two sizes 6% apart is the noise of their medians)."""


def _fit_line(points: list[tuple[int, float]], *, flat: bool = True) -> tuple[float, float]:
    """``(intercept, seconds per byte)`` through the median duration of each byte size.

    Sizes spanning at least ``LINE_SPAN`` (largest over smallest): least squares; a line that
    falls with size (the time does not grow with the bytes: latency, not bandwidth) is the
    flat line through the median of every duration (the proportional one without ``flat``),
    and a line with a negative intercept the proportional one. One size: the
    proportional line (nothing separates a fixed cost from a cost per byte), as with sizes
    too close together for a slope."""
    by: dict[int, list[float]] = defaultdict(list)
    for b, d in points:
        by[b].append(d)
    xs = np.array(sorted(by), dtype=float)
    ys = np.array([float(np.median(by[int(b)])) for b in xs])
    if len(xs) >= 2 and xs[-1] >= LINE_SPAN * xs[0]:
        slope, intercept = np.polyfit(xs, ys, 1)
        if slope <= 0 and flat:
            return float(np.median([d for _, d in points])), 0.0
        if slope > 0 and intercept >= 0:
            return float(intercept), float(slope)
    return 0.0, float(np.median(ys / xs))


WRITE_FAST_END = 50
"""Percentile of each size's WRITE times at or below which a WRITE is taken as unqueued: on
the 2-core reference host the lower half fits another workload best (p10 and p25 read too
fast a WRITE, p100, the median line, leaves no spread for the wait;
``benchmarks/bench_calibration.py``)."""


_P = TypeVar("_P", bound=tuple[Any, ...])


def _fast_end(points: Sequence[_P], q: float = 10) -> list[_P]:
    """The points (size first, seconds last) at or below the ``q``-th percentile duration of
    their size: the ones that did not queue or wait on the host's scheduler."""
    by: dict[Any, list[float]] = defaultdict(list)
    for p in points:
        by[p[0]].append(p[-1])
    cut = {b: float(np.percentile(v, q)) for b, v in by.items()}
    return [p for p in points if p[-1] <= cut[p[0]]]


def _scatter_costs(spans: list[dict[str, list[tuple[float, float, int]]]]
                   ) -> tuple[float, float, float]:
    """``(launch, seconds per byte, polling interval)`` of the decode ranks' scatters.

    A rank runs its scatters one after another (the simulator's stream does too), so one
    scatter's start-to-done time holds the scatters queued before it and the wait for the
    decode loop to see it. The scatters that did neither (the fast end, p10 of each byte
    size) give the fixed cost of a scatter and its cost per byte (``_fit_line``; with one
    size, the ranks' busy time, the union of their scatters' spans, over the bytes). What is
    left of each scatter's time once the queue is replayed (done minus its finish on a
    serial stream) is the wait for the decode loop to see it, on average half the polling
    interval."""
    points = [(n, b - a) for per_node in spans for node_spans in per_node.values()
              for a, b, n in node_spans]
    sizes = [n for n, _ in points]
    if sizes and max(sizes) >= LINE_SPAN * min(sizes):
        launch, per_byte = _fit_line(_fast_end(points))
        launch = max(launch, 1e-6)
    else:
        launch, busy, nbytes, count = 1e-6, 0.0, 0, 0
        for per_node in spans:
            for node_spans in per_node.values():
                end = -math.inf
                for a, b, n in sorted(node_spans):
                    if b > end:
                        busy += b - max(a, end)
                        end = b
                    nbytes += n
                    count += 1
        per_byte = max(0.0, busy - launch * count) / max(1, nbytes)
    waits = []
    for per_node in spans:
        for node_spans in per_node.values():
            free = -math.inf
            for a, b, n in sorted(node_spans):
                free = max(a, free) + launch + n * per_byte
                waits.append(max(0.0, b - free))
    return launch, per_byte, max(1e-4, 2 * float(np.median(waits)))


def scatter_cost_per_byte(m: Measured, params: SimParams | None = None) -> float | None:
    """Seconds per byte of the decode ranks' scatters in one trace, their fixed costs included
    (on a CPU host it tracks the host's speed during the run): each scatter at the median of its
    size's unqueued end (p10, as the fit reads them), or, with ``params``, at what those costs
    (``kernel_launch_s`` and ``scatter_bandwidth_Bps``) charge a scatter of its size. None
    without scatters."""
    sizes = Counter(n for n, _ in m.scatters)
    nbytes = sum(n * c for n, c in sizes.items())
    if nbytes <= 0:
        return None
    if params is None:
        fast: dict[int, list[float]] = defaultdict(list)
        for n, d in _fast_end(m.scatters):
            fast[n].append(d)
        seconds = sum(c * float(np.median(fast[n])) for n, c in sizes.items())
    else:
        seconds = sum(c * (params.kernel_launch_s + n / params.scatter_bandwidth_Bps)
                      for n, c in sizes.items())
    return seconds / nbytes if seconds > 0 else None


def direct_params(measured: list[Measured], base: SimParams | None = None,
                  stalls: bool = False) -> SimParams:
    """Cost parameters read straight from the traces (before the joint fit); with ``stalls``
    the frames' spread goes to per-process stalls instead of per-frame jitter."""
    base = base or SimParams()
    frames = [x for m in measured for x in m.frames]
    boot = [x for m in measured for x in m.bootstrap]
    gaps = [x for m in measured for x in m.forward_gaps]
    scat = [x for m in measured for x in m.scatters]
    xfer = [x for m in measured for x in m.transfers]
    changes: dict[str, Any] = {
        # The hardware mode's prefill: one request per forward, a fixed time per forward; no
        # decode compute.
        "prefill_s_per_token": 0.0, "prefill_s_per_token_ctx": 0.0,
        "prefill_requests_per_forward": 1, "decode_step_s": 0.0, "decode_s_per_seq": 0.0,
        "decode_s_per_ctx_token": 0.0, "ranks_per_nic": 1,
        # Its gathers and scatters run in the rank's own loop (torch copies, synchronised on
        # CUDA), so a rank handles nothing else meanwhile.
        "blocking_kernels": True,
    }
    if frames:
        lo = float(np.percentile(frames, 5))
        changes["zmq_latency_s"] = lo
        changes["zmq_jitter_s"] = max(0.0, (float(np.median(frames)) - lo) / math.log(2))
        if stalls:
            # A frame that reaches a descheduled process waits out the rest of its stall (the
            # rest of an exponential is exponential): the median excess over the fast end sets
            # the stall, run and stall periods start equal (the fit scales both), and only
            # the fast end's spread (the 10th percentile) is left to per-frame jitter.
            above = np.asarray(frames) - lo
            stall = float(np.median(above)) / math.log(2)
            changes["process_stall_s"] = stall
            changes["process_run_s"] = stall
            changes["zmq_jitter_s"] = float(np.percentile(above, 10))
    if boot:
        changes["decode_prealloc_s"] = max(0.0, float(np.median(boot))
                                           - changes.get("zmq_latency_s", base.zmq_latency_s))
    if gaps:
        changes["forward_overhead_s"] = float(np.median(gaps))
    skew = [x for m in measured for x in m.rank_skew]
    if skew:
        # Two ranks' exponential delays of mean mu differ by an exponential of mean mu.
        changes["prefill_command_jitter_s"] = float(np.median(skew)) / math.log(2)
    launch = base.kernel_launch_s
    if scat:
        launch, per_byte, poll = _scatter_costs([m.scatter_spans for m in measured])
        changes["kernel_launch_s"] = launch
        changes["scatter_bandwidth_Bps"] = 1.0 / per_byte if per_byte > 0 else 1e15
        changes["decode_poll_interval_s"] = poll
    if xfer:
        # A WRITE's time against its size (median per size). On a host where WRITEs overlap
        # and wait on process scheduling more than on bytes, that time is latency: per-byte
        # cost goes to the gather (which does not queue), the rest to the WRITE's latency,
        # and the NIC is not the bottleneck. A rank's busy time (``transfer_busy``) says so:
        # its bytes over the time any WRITE was in flight is far below a NIC's bandwidth.
        # The lower half of each size (the WRITEs that no queue or scheduling delay held
        # back) gives the WRITE itself: a fixed cost and a cost per byte, or a flat line
        # where the time does not grow with the bytes (``_fit_line``; a proportional fit
        # there over-predicted a larger workload's WRITEs by their fixed cost). The median's
        # excess over that line is an exponential wait (its median is ln 2 times its mean).
        intercept, per_byte = _fit_line(_fast_end(xfer, WRITE_FAST_END))
        changes["gather_bandwidth_Bps"] = 1.0 / per_byte if per_byte > 0 else 1e15
        changes["rdma_latency_s"] = max(0.0, intercept - launch)
        changes["nic_bandwidth_Bps"] = 1e15
        fit = [intercept + b * per_byte for b, _ in xfer]
        excess = float(np.median([d - f for (_, d), f in zip(xfer, fit, strict=True)]))
        changes["transfer_jitter_s"] = max(0.0, excess / math.log(2))
    direct = [x for m in measured for x in m.direct]
    if direct:
        _fit_direct_writes(direct, bool(xfer), changes, base)
    return base.replace(**changes)


def _fit_direct_writes(direct: list[tuple[int, int, float]], staged: bool,
                       changes: dict[str, Any], base: SimParams) -> None:
    """Set ``direct_write_s`` in ``changes`` from direct page writes ``(writes, bytes,
    seconds)``: the median, over the fast end (p10 of each write count, as for staged
    WRITEs), of a write's time beyond its latency and its bytes' cost (bytes over
    ``nic_bandwidth_Bps``, as the simulator charges a direct write) per page, layer and K/V.
    The latency is the staged WRITEs' (``staged``); without any, the line of the direct
    writes' time against their count gives both (its intercept the WRITE latency, its slope
    the cost of a write; proportional when the time does not grow with the count) and sets
    the WRITE latency, its jitter and an unlimited NIC. A fit that leaves no positive cost
    sets nothing."""
    fast = _fast_end(direct)  # p10 of each write count
    nic = 1e15 if not staged else float(changes.get("nic_bandwidth_Bps",
                                                    base.nic_bandwidth_Bps))
    if staged:
        latency = float(changes["rdma_latency_s"])
        per_write = float(np.median([(d - latency - b / nic) / c for c, b, d in fast]))
    else:
        # the time a write count adds (all of it, when it does not grow with the count)
        latency, per_write = _fit_line([(c, d) for c, _, d in fast], flat=False)
    if per_write <= 0:
        return
    changes["direct_write_s"] = per_write
    if not staged:
        changes["rdma_latency_s"] = latency
        changes["nic_bandwidth_Bps"] = nic
        excess = float(np.median([d - latency - c * per_write - b / nic
                                  for c, b, d in direct]))
        changes["transfer_jitter_s"] = max(0.0, excess / math.log(2))


def direct_write_fit(measured: list[Measured], params: SimParams,
                     base: SimParams | None = None) -> tuple[bool, str]:
    """Whether ``params`` (``direct_params`` of ``measured`` over ``base``) fitted
    ``direct_write_s`` from the traces' direct page writes or kept ``base``'s (by default
    ``SimParams``'), and a line saying which and why."""
    count = sum(len(m.direct) for m in measured)
    kept = (base or SimParams()).direct_write_s
    if count == 0:
        return False, (f"direct_write_s kept at {kept:g} s: the traces have no direct page "
                       f"writes (every room was staged)")
    if params.direct_write_s == kept:
        return False, (f"direct_write_s kept at {kept:g} s: the {count} direct page writes "
                       f"took no time beyond their latency")
    return True, (f"direct_write_s fitted to {params.direct_write_s:.4g} s per page, layer and "
                  f"K/V from {count} direct page writes")


class _Frames:
    """A simulation recorder keeping each SGLang frame's latency, matched as ``measure``
    matches them in a hardware trace."""

    def __init__(self) -> None:
        self.matcher = _FrameMatcher()

    @property
    def latencies(self) -> list[float]:
        return self.matcher.latencies

    def write_input(self, t: float, node: str, event: Any) -> None:
        if type(event).__name__ == "MessageArrived":
            self.matcher.arrived(t, event.src, node, event.msg)

    def write_effects(self, t: float, node: str, effects: list[Any]) -> None:
        for e in effects:
            if type(e).__name__ == "Send":
                self.matcher.sent(t, node, e.dst, e.msg)

    def write_sys(self, t: float, node: str, record: dict[str, Any]) -> None:
        pass


def simulate_phases(trace: Trace, params: SimParams, seeds: tuple[int, ...] = (0,)
                    ) -> dict[str, float]:
    """The p50 of each phase over the rooms of ``trace``'s run simulated with ``params``
    (the median over ``seeds``), of the frame latency (``frame_s``), and ``mismatch``: the
    share of the runs that ended otherwise than the recorded run (a wedge the jitter opened)."""
    out: dict[str, list[float]] = {p: [] for p in (*PHASES, "frame_s")}
    mismatched = 0
    for seed in seeds:
        frames = _Frames()
        result = simulate_recorded(trace, params, seed, recorder=frames)
        mismatched += trace.outcome is not None and result.status != trace.status
        if frames.latencies:
            out["frame_s"].append(float(np.median(frames.latencies)))
        done = [r for r in result.sim.metrics.done if r.status == "Success"]
        if done:
            out["kv_done_s"].append(float(np.median([r.kv_done_s - r.arrival_s for r in done])))
            spans = [r.last_transfer_s - r.first_transfer_s for r in done
                     if r.first_transfer_s >= 0]
            if spans:
                out["transfer_s"].append(float(np.median(spans)))
    phases = {p: float(np.median(v)) for p, v in out.items() if v}
    return {**phases, "mismatch": mismatched / max(1, len(seeds))}


def measured_phases(m: Measured) -> dict[str, float]:
    """The p50 of each phase over the trace's rooms, and of its frame latencies."""
    out = {}
    for p in PHASES:
        values = [v[p] for v in m.phases.values() if p in v]
        if values:
            out[p] = float(np.median(values))
    if m.frames:
        out["frame_s"] = float(np.median(m.frames))
    return out


@dataclass
class Calibration:
    """The fitted parameters and how well they reproduce each calibration trace."""

    params: SimParams
    direct: SimParams
    scales: dict[str, float]
    fit: list[dict[str, Any]]
    measured: list[Measured]
    notes: list[str] = field(default_factory=list)  # e.g. whether direct_write_s was fitted
    direct_write_fitted: bool = False
    host: dict[str, Any] | None = None
    """The host the traces ran on (``twin.calibrate.host.fitted_host``); None when unknown."""
    host_unknown: str = ""
    """Why ``host`` is None."""

    @property
    def fields(self) -> tuple[str, ...]:
        """The ``[sim]`` fields this calibration sets: ``FITTED``, and ``direct_write_s``
        where it was fitted from the traces' direct page writes."""
        return FITTED + (("direct_write_s",) if self.direct_write_fitted else ())

    def report(self) -> dict[str, Any]:
        return {"params": _fitted(self.params, self.fields), "scales": self.scales,
                "traces": self.fit, "notes": self.notes, "host": self.host}


FITTED = ("zmq_latency_s", "zmq_jitter_s", "rdma_latency_s", "transfer_jitter_s",
          "nic_bandwidth_Bps",
          "ranks_per_nic", "gather_bandwidth_Bps", "scatter_bandwidth_Bps", "kernel_launch_s",
          "forward_overhead_s", "prefill_s_per_token", "prefill_s_per_token_ctx",
          "prefill_requests_per_forward", "prefill_command_jitter_s", "decode_poll_interval_s", "decode_step_s",
          "decode_s_per_seq", "decode_s_per_ctx_token", "decode_prealloc_s", "process_stall_s",
          "process_run_s", "blocking_kernels")
"""The ``[sim]`` fields calibration sets."""

MISMATCH_PENALTY = 4.0
"""Loss per trace whose every simulated run ends otherwise than the recorded run."""

SCALED = ("zmq_latency_s", "zmq_jitter_s", "prefill_command_jitter_s", "forward_overhead_s",
          "decode_poll_interval_s")
"""Fields the joint fit scales (the ones a trace's measurement pins down least)."""

PRIOR_WEIGHT = 0.0
"""Loss per squared natural log of each scale: how strongly the fit keeps to what the traces
measured directly. Off by default: 0.05 to 1 traded one cross-workload miss for another on
the traces ``docs/simulator.md`` reports."""

STALL_SCALED = ("process_stall_s", "process_run_s")
"""Also scaled when the fit models per-process stalls (``calibrate(stalls=True)``)."""


def _fitted(p: SimParams, fields: tuple[str, ...] = FITTED) -> dict[str, Any]:
    d = p.to_dict()
    return {k: (float(f"{d[k]:.6g}") if isinstance(d[k], float) else d[k]) for k in fields}


def _scaled(p: SimParams, scales: dict[str, float]) -> SimParams:
    return p.replace(**{k: getattr(p, k) * s for k, s in scales.items()})


def _loss(traces: list[Trace], targets: list[dict[str, float]], params: SimParams,
          seeds: tuple[int, ...]) -> tuple[float, list[dict[str, float]]]:
    total = 0.0
    sims = []
    for trace, want in zip(traces, targets, strict=True):
        got = simulate_phases(trace, params, seeds)
        sims.append(got)
        for p in (*PHASES, "frame_s"):
            if p in want and got.get(p, 0) > 0:
                total += math.log(got[p] / want[p]) ** 2
            elif p in want:
                total += 100.0
        # A run that wedges where the recorded one completed is worse than any p50 miss the
        # fit trades against (a factor of e on one phase costs 1).
        total += MISMATCH_PENALTY * got.get("mismatch", 0.0)
    return total, sims


def calibrate(traces: list[Trace], base: SimParams | None = None,
              seeds: tuple[int, ...] = (0, 1, 2), steps: tuple[float, ...] = (2, 1, 0.5, 0.25),
              scaled: tuple[str, ...] | None = None, stalls: bool = False,
              prior: float = PRIOR_WEIGHT) -> Calibration:
    """Measure the traces, then scale ``scaled`` (default ``SCALED``, and ``STALL_SCALED``
    with ``stalls``) to match every trace's p50 phases: a coordinate search in log2 space,
    each step size (``steps``) until no move helps. ``stalls`` models the host's delays as
    per-process stalls (``twin/sim/stalls.py``) rather than as per-frame jitter.

    The measured frame latencies already include the waits of per-link FIFO order, which the
    simulator adds again to each drawn latency; the jitter scale is how much of the measured
    spread is left for the draw."""
    if scaled is None:
        scaled = SCALED + (STALL_SCALED if stalls else ())
    measured = [measure(t) for t in traces]
    direct = direct_params(measured, base, stalls=stalls)
    targets = [measured_phases(m) for m in measured]
    scales = dict.fromkeys(scaled, 1.0)

    def penalty(sc: dict[str, float]) -> float:
        return prior * sum(math.log(v) ** 2 for v in sc.values())

    best, sims = _loss(traces, targets, direct, seeds)
    for step in steps:
        improved = True
        while improved and best > 1e-4:
            improved = False
            for name in scaled:
                for sign in (1, -1):
                    factor = scales[name] * 2 ** (sign * step)
                    if not 2 ** -8 <= factor <= 2 ** 4:
                        continue
                    trial = {**scales, name: factor}
                    loss, trial_sims = _loss(traces, targets, _scaled(direct, trial), seeds)
                    loss += penalty(trial)
                    if loss < best - 1e-9:
                        best, scales, sims, improved = loss, trial, trial_sims, True
                        break
    params = _scaled(direct, scales)
    fit = [{"trace": m.path, "measured_p50": targets[i], "simulated_p50": sims[i],
            "ratio_p50": {p: round(sims[i][p] / targets[i][p], 4) for p in (*PHASES, "frame_s")
                          if p in targets[i] and p in sims[i]}}
           for i, m in enumerate(measured)]
    fitted, note = direct_write_fit(measured, direct, base)
    host, unknown = fitted_host([trace_host(t) for t in traces])
    return Calibration(params, direct, {k: round(v, 4) for k, v in scales.items()}, fit,
                       measured, [note], fitted, host, unknown)


def write_costs(cal: Calibration, path: str | Path) -> Path:
    """Write the ``[sim]`` table (with a comment naming the traces, the fit and the host
    they ran on: ``twin.calibrate.host``)."""
    import tomli_w

    p = Path(path)
    lines = ["# Cost model fitted by `twin calibrate` to hardware-mode traces:",
             host_line(cal.host, cal.host_unknown)]
    for f in cal.fit:
        ratio = ", ".join(f"{k} {v:.3f}" for k, v in f["ratio_p50"].items())
        lines.append(f"#   {f['trace']}: simulated/measured p50 {ratio}")
    lines.append(f"# joint-fit scales: {', '.join(f'{k} x{v:g}' for k, v in cal.scales.items())}")
    lines.extend(f"# {note}" for note in cal.notes)
    body = tomli_w.dumps({"sim": _fitted(cal.params, cal.fields)})
    p.write_text("\n".join(lines) + "\n" + body)
    return p


def costs_from(config_path: str | None) -> SimParams | None:
    """The ``[sim]`` costs of a config file (``twin replay --config``); None without one.
    ``ConfigError`` names the file and field."""
    if config_path is None:
        return None
    from twin.core.config import TwinConfig

    cfg = TwinConfig.from_toml(config_path)
    return SimParams.from_dict(cfg.extra.get("sim", {}), config_path)
