"""The prefill scheduler of one attention group: chunked forwards, ``send_kv_chunk`` calls and
the KV pool that holds each request until its transfer is done.

Requests whose bootstrap finished wait in FIFO order. A forward takes up to
``min(chunked_prefill_size, max_prefill_tokens)`` tokens, from the head request first (at most
one request is chunked per forward, as SGLang's chunked prefill). A request is admitted to its
first forward only if the KV pool has room for its prompt and fewer than
``max_running_requests`` requests are admitted; it holds that KV until every prefill rank of
the group concluded its transfer, seen at the scheduler's next loop iteration (the end of the
running forward, or at once when idle), as SGLang's ``process_disagg_prefill_inflight_queue``
does. So a slow ring, by holding transfers open, backs up prefill admission.

Before a request's first forward the scheduler prefetches its STAGING_REQs and, with the
cached-prefix early send, sends the prefill radix hit; after every forward it sends the new KV
of each request in the batch, the final one with ``last=True``.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from typing import Any, Final, Protocol

from twin.core import events as ev
from twin.core.config import TwinConfig
from twin.core.sendplan import early_send_end
from twin.core.topology import Topology
from twin.models.costs import ServerCosts
from twin.runtime.params import SimParams
from twin.runtime.requests import RequestState

# Built on every forward: Final names are C statics when compiled.
_Prefetch: Final = ev.Prefetch
_SendKV: Final = ev.SendKV


class SchedulerHost(Protocol):
    """What a prefill scheduler needs from its simulation (``Simulation`` provides it)."""

    cfg: TwinConfig
    params: SimParams
    topo: Topology
    seed: int
    recorder: Any  # None when the run records no trace: forward records are not built then

    def time(self) -> float: ...
    def at(self, delay: float, fn: Callable[..., object], *args: Any) -> None: ...
    def feed(self, node: str, event: ev.Input) -> list[ev.Effect]: ...
    def sys(self, node: str, record: dict[str, Any]) -> None: ...
    def mark_progress(self) -> None: ...
    def prefill_finished(self, req: RequestState) -> None: ...


class PrefillScheduler:
    """Runs forwards back to back while admitted requests wait; idle otherwise."""

    def __init__(self, sim: SchedulerHost, group: int, costs: ServerCosts) -> None:
        self.sim = sim
        self.group = group
        self.costs = costs
        self.nodes = [n.id for n in sim.topo.prefill_groups[group].nodes]
        self.waiting: deque[RequestState] = deque()
        self.busy = False
        self.capacity = costs.max_total_tokens
        self.max_running = costs.max_running_requests
        self.budget = min(sim.cfg.chunked_prefill_size, costs.args.max_prefill_tokens)
        self.held: dict[int, int] = {}  # room -> KV tokens held until its transfer is done
        self.used = 0
        self.peak_used = 0
        self.released: list[RequestState] = []  # transfers done, seen at the next iteration
        self.blocked_s = 0.0  # time the head request waited for KV pages or a slot
        self._blocked_since = -1.0
        self.series: list[tuple[float, int, int]] = []  # (t, KV tokens held, requests held)
        self._starting = False  # inside _start (its feeds may conclude rooms synchronously)
        self._jitter = sim.params.prefill_command_jitter_s
        self._rng = random.Random(f"{sim.seed}:commands:{group}")
        self._cmd_last: dict[str, float] = {}

    def admit(self, req: RequestState) -> None:
        self.waiting.append(req)
        if not self.busy and not self._starting:
            self._start()

    def transfer_done(self, req: RequestState) -> None:
        """Every prefill rank of the group concluded the room (Success or Failed)."""
        self.released.append(req)
        if not self.busy and not self._starting:
            self._start()

    def _all(self, event: ev.Input) -> None:
        if self._jitter <= 0:
            for node in self.nodes:
                self.sim.feed(node, event)
            return
        now = self.sim.time()
        for node in self.nodes:
            at = max(now + self._rng.expovariate(1 / self._jitter), self._cmd_last.get(node, 0.0))
            self._cmd_last[node] = at
            self.sim.at(at - now, self.sim.feed, node, event)

    def _release(self) -> None:
        for req in self.released:
            tokens = self.held.pop(req.room, None)
            if tokens is not None:
                self.used -= tokens
        if self.released:
            self.released = []
            self.series.append((self.sim.time(), self.used, len(self.held)))

    def _fits(self, req: RequestState) -> bool:
        """Whether ``req`` may start its first forward (KV pool and request slots)."""
        if req.room in self.held:
            return True
        need = req.input_len - req.prefill_prefix_len + 1
        if len(self.held) >= self.max_running or (self.held and self.used + need > self.capacity):
            return False
        self.held[req.room] = need
        self.used += need
        self.peak_used = max(self.peak_used, self.used)
        self.series.append((self.sim.time(), self.used, len(self.held)))
        return True

    def _start(self) -> None:
        self._starting = True
        try:
            self._start_forward()
            while not self.busy and self.released:  # a room concluded while starting
                self._start_forward()
        finally:
            self._starting = False

    def _start_forward(self) -> None:
        sim = self.sim
        self._release()
        budget = self.budget
        per_forward = sim.params.prefill_requests_per_forward or len(self.waiting)
        batch: list[tuple[RequestState, int]] = []
        while self.waiting and budget > 0 and len(batch) < per_forward:
            req = self.waiting[0]
            if req.finished:
                self.waiting.popleft()
                continue
            if not self._fits(req):
                if self._blocked_since < 0:
                    self._blocked_since = sim.time()
                break
            take = min(budget, req.input_len - req.extend_end)
            if req.first_batch:
                self._first_batch(req)
            batch.append((req, take))
            budget -= take
            if req.extend_end + take >= req.input_len:
                self.waiting.popleft()
            else:
                break
        if batch and self._blocked_since >= 0:
            self.blocked_s += sim.time() - self._blocked_since
            self._blocked_since = -1.0
        if not batch:
            self.busy = False
            return
        self.busy = True
        duration = self.costs.forward_s([(t, r.extend_end) for r, t in batch])
        recording = sim.recorder is not None
        for req, take in batch:
            if req.first_forward_s < 0:
                req.first_forward_s = sim.time()
            if recording:
                sim.sys(self.nodes[0], {"type": "ForwardStart", "room": req.room, "tokens": take})
        sim.at(duration, self._finish, batch)

    def _first_batch(self, req: RequestState) -> None:
        sim = self.sim
        req.first_batch = False
        self._all(_Prefetch(room=req.room))
        end = early_send_end(req.extend_end, req.decode_prefix_len, sim.cfg.page_size)
        if sim.params.early_send_cached_prefix and end is not None:
            self._all(_SendKV(room=req.room, end_idx=end, last=False))

    def _finish(self, batch: list[tuple[RequestState, int]]) -> None:
        sim = self.sim
        sim.mark_progress()
        recording = sim.recorder is not None
        for req, take in batch:
            if recording:
                sim.sys(self.nodes[0], {"type": "ForwardEnd", "room": req.room, "tokens": take})
            if req.finished:
                continue
            req.extend_end += take
            last = req.extend_end >= req.input_len
            if last:
                req.prefill_done_s = sim.time()
                sim.prefill_finished(req)
            self._all(_SendKV(room=req.room, end_idx=req.extend_end, last=last))
        self._start()
