"""The prefill scheduler of one attention group: chunked forwards and ``send_kv_chunk`` calls.

Requests whose bootstrap finished wait in FIFO order. A forward takes up to
``chunked_prefill_size`` tokens, from the head request first (at most one request is chunked per
forward, as SGLang's chunked prefill). Before a request's first forward the scheduler prefetches
its STAGING_REQs and, with the cached-prefix early send, sends the prefill radix hit; after every
forward it sends the new KV of each request in the batch, the final one with ``last=True``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from twin.core import events as ev
from twin.core.config import TwinConfig
from twin.core.sendplan import early_send_end
from twin.core.topology import Topology
from twin.runtime.params import SimParams
from twin.runtime.requests import RequestState


class SchedulerHost(Protocol):
    """What a prefill scheduler needs from its simulation (``Simulation`` provides it)."""

    cfg: TwinConfig
    params: SimParams
    topo: Topology

    def time(self) -> float: ...
    def at(self, delay: float, fn: Callable[..., None], *args: Any) -> None: ...
    def feed(self, node: str, event: ev.Input) -> None: ...
    def sys(self, node: str, record: dict[str, Any]) -> None: ...
    def mark_progress(self) -> None: ...
    def prefill_finished(self, req: RequestState) -> None: ...


class PrefillScheduler:
    """Runs forwards back to back while requests wait; idle otherwise."""

    def __init__(self, sim: SchedulerHost, group: int) -> None:
        self.sim = sim
        self.group = group
        self.nodes = [n.id for n in sim.topo.prefill_groups[group].nodes]
        self.waiting: deque[RequestState] = deque()
        self.busy = False

    def admit(self, req: RequestState) -> None:
        self.waiting.append(req)
        if not self.busy:
            self._start()

    def _all(self, event: ev.Input) -> None:
        for node in self.nodes:
            self.sim.feed(node, event)

    def _start(self) -> None:
        sim = self.sim
        p = sim.params
        budget = sim.cfg.chunked_prefill_size
        batch: list[tuple[RequestState, int]] = []
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if req.finished:
                self.waiting.popleft()
                continue
            take = min(budget, req.input_len - req.extend_end)
            if req.first_batch:
                self._first_batch(req)
            batch.append((req, take))
            budget -= take
            if req.extend_end + take >= req.input_len:
                self.waiting.popleft()
            else:
                break
        if not batch:
            self.busy = False
            return
        self.busy = True
        tokens = sum(t for _, t in batch)
        ctx = sum(t * (r.extend_end + t / 2) for r, t in batch)
        duration = p.forward_overhead_s + tokens * p.prefill_s_per_token + ctx * p.prefill_s_per_token_ctx
        for req, take in batch:
            if req.first_forward_s < 0:
                req.first_forward_s = sim.time()
            sim.sys(self.nodes[0], {"type": "ForwardStart", "room": req.room, "tokens": take})
        sim.at(duration, self._finish, batch)

    def _first_batch(self, req: RequestState) -> None:
        sim = self.sim
        req.first_batch = False
        self._all(ev.Prefetch(room=req.room))
        end = early_send_end(req.extend_end, req.decode_prefix_len, sim.cfg.page_size)
        if sim.params.early_send_cached_prefix and end is not None:
            self._all(ev.SendKV(room=req.room, end_idx=end, last=False))

    def _finish(self, batch: list[tuple[RequestState, int]]) -> None:
        sim = self.sim
        sim.mark_progress()
        for req, take in batch:
            sim.sys(self.nodes[0], {"type": "ForwardEnd", "room": req.room, "tokens": take})
            if req.finished:
                continue
            req.extend_end += take
            last = req.extend_end >= req.input_len
            if last:
                req.prefill_done_s = sim.time()
                sim.prefill_finished(req)
            self._all(ev.SendKV(room=req.room, end_idx=req.extend_end, last=last))
        self._start()
