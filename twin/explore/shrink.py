"""Shrinking a finding: the smallest trial that still shows the same signature.

Greedy passes in the spirit of delta debugging, repeated until none makes progress or the run
budget is spent: drop requests, drop faults, put deployment fields back to the base (then
halve TP sizes and the ring down to the smallest that fits), drop prefixes, shorten prompts
(to grid boundaries, then by halves), simplify fault filters, pull arrivals together and set the
seed to 0. A candidate is kept only when it shows the same signature (violation kind + root)
and is smaller by ``rank``, so a shrink always ends and never trades the finding for another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from twin.explore.oracles import TrialResult, run_trial
from twin.explore.strategies import smallest_ring
from twin.explore.trial import Base, Deploy, InvalidTrial, Trial

Runner = Callable[[Trial], TrialResult]


def rank(t: Trial) -> tuple[int, int, float, int]:
    """Smaller is simpler: size, then a non-zero seed, spread of arrivals, fault text."""
    return (t.size(), int(t.seed != 0), sum(r.at for r in t.requests),
            sum(len(f) for f in t.faults))


@dataclass
class ShrinkResult:
    trial: Trial
    result: TrialResult
    runs: int


def shrink(base: Base, trial: Trial, signature: tuple[str, str], *, max_runs: int = 300,
           runner: Runner | None = None, should_stop: Callable[[], bool] | None = None
           ) -> ShrinkResult:
    """The smallest trial found that keeps ``signature``."""
    run = runner or (lambda t: run_trial(base, t))
    seen: set[str] = {trial.key()}
    best = trial
    best_result = run(trial)
    runs = 1
    progress = True
    while progress and runs < max_runs:
        progress = False
        for cand in _candidates(base, best):
            if runs >= max_runs or (should_stop is not None and should_stop()):
                break
            key = cand.key()
            if key in seen or rank(cand) >= rank(best):
                continue
            seen.add(key)
            res = run(cand)
            runs += 1
            if res.signature == signature:
                best, best_result, progress = cand, res, True
                break
    return ShrinkResult(best, best_result, runs)


def _candidates(base: Base, t: Trial) -> Iterator[Trial]:
    reqs = list(t.requests)
    for i in range(len(reqs)):
        if len(reqs) > 1:
            rest = reqs[:i] + reqs[i + 1:]
            yield t.with_(requests=tuple(rest), faults=tuple(_renumber(f, i) for f in t.faults
                                                              if _renumber(f, i) is not None))
    for i in range(len(t.faults)):
        yield t.with_(faults=t.faults[:i] + t.faults[i + 1:])
    d = t.deploy
    for name in ("prefill_dp_attn", "prefill_dp", "prefill_tp", "decode_tp", "page_size",
                 "chunked_prefill_size", "ring_bytes", "prefill_staging_pages"):
        if getattr(d, name) is not None:
            yield t.with_(deploy=replace(d, **{name: None}))
    try:
        cfg = base.config(t)
    except InvalidTrial:
        return
    if cfg.prefill.tp_size > 1:
        yield t.with_(deploy=replace(d, prefill_tp=cfg.prefill.tp_size // 2))
    if cfg.decode.tp_size > 1:
        yield t.with_(deploy=replace(d, decode_tp=cfg.decode.tp_size // 2))
    ring = smallest_ring(cfg)
    if cfg.ring_bytes > ring:
        yield t.with_(deploy=replace(d, ring_bytes=ring))
    for i, r in enumerate(reqs):
        def at(i: int, **ch: object) -> Trial:
            new = list(reqs)
            new[i] = replace(reqs[i], **ch)  # type: ignore[arg-type]
            return t.with_(requests=tuple(new))
        if r.prefill_prefix:
            yield at(i, prefill_prefix=0)
        if r.decode_prefix:
            yield at(i, decode_prefix=0)
        grid = cfg.grid_tokens
        for n in sorted({(r.input_len // grid) * grid, r.input_len // 2, grid, cfg.page_size,
                         r.input_len - cfg.page_size, r.input_len - 1}):
            if 1 <= n < r.input_len and r.decode_prefix < n and r.prefill_prefix <= n:
                yield at(i, input_len=n)
        if r.prefill_prefix > 1:
            yield at(i, prefill_prefix=r.prefill_prefix // 2)
        if r.at > 0:
            prev = reqs[i - 1].at if i else 0.0
            yield at(i, at=prev)
    for i, f in enumerate(t.faults):
        parts = f.split(":")
        simpler = [p for p in parts if not p.startswith(("room=", "chunk=", "src=", "dst="))]
        if len(simpler) < len(parts):
            yield t.with_(faults=t.faults[:i] + (":".join(simpler),) + t.faults[i + 1:])
    if t.seed:
        yield t.with_(seed=0)
    if t.schedule.startswith("pct:") and not t.schedule.endswith(":1"):
        kind, seed, _ = t.schedule.split(":")
        yield t.with_(schedule=f"pct:{seed}:1")
    if d != Deploy() and d.fields() > 1:
        yield t.with_(deploy=Deploy())


def _renumber(fault: str, removed: int) -> str | None:
    """``fault`` after request ``removed`` left the workload: rooms behind it move down one;
    a fault on that very room goes (None)."""
    parts = fault.split(":")
    for j, p in enumerate(parts):
        if p.startswith("room="):
            room = int(p[5:])
            if room == removed:
                return None
            if room > removed:
                parts[j] = f"room={room - 1}"
    return ":".join(parts)
