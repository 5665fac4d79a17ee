"""What the explorer varies, each a strategy a flag can turn off.

* ``deploy``    deployments near the user's: TP layouts (heterogeneous TP both ways, DP
                attention), page size, ``chunked_prefill_size``, ring sizes from the
                smallest that fits one full chunk up to a few chunks, and now and then a
                prefill staging buffer of one chunk (the pre-fix fixed-size buffer);
* ``workload``  small workloads built to hit edges: prompt lengths at chunk and ring boundaries
                (one page or one token either side), decode prefixes off the grid, prefill
                radix hits, serial and simultaneous arrivals;
* ``faults``    fault schedules drawn from the fault model's kinds (``fault_model``:
                ``"sglang"``, the default, draws the faults SGLang's deployment can meet:
                late frames, send timeouts, failed transfers, dead or restarted ranks,
                aborts; ``"all"`` adds lost, duplicated and reordered frames and a raising
                STAGING_REQ send; ``twin/explore/faultmodel.py``);
* ``interleave`` the order in which frames meet: the simulator's seed (it draws control-plane
                jitter), or, for a trial in three, the loopback cluster under a random or a PCT
                scheduler (``twin/explore/schedule.py``), where any pending action may go
                next. Without it every trial runs in the simulator with seed 0.

``generate`` draws a fresh trial; ``mutate`` changes one thing of a trial from the corpus.
Both take a ``random.Random``: the same stream gives the same trials.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from twin.core.config import TwinConfig
from twin.core.topology import Topology
from twin.explore.faultmodel import MODELS
from twin.explore.trial import Base, Deploy, InvalidTrial, Req, Trial
from twin.runtime.faults import MESSAGE_ACTIONS

NAMES = ("deploy", "workload", "faults", "interleave")


@dataclass(frozen=True)
class Strategies:
    deploy: bool = True
    workload: bool = True
    faults: bool = True
    interleave: bool = True
    fault_model: str = "sglang"  # a key of ``faultmodel.MODELS``

    def names(self) -> list[str]:
        return [n for n in NAMES if getattr(self, n)]


def smallest_ring(cfg: TwinConfig) -> int:
    """Bytes of one full chunk's region on the largest decode rank: the smallest ring in which
    every chunk fits."""
    pages = cfg.full_chunk_pages
    return max(cfg.region_layout(r, pages)[2] for r in range(cfg.decode.attn_tp_size))


def fixed_buffers(cfg: TwinConfig) -> list[int]:
    """Pages of a fixed-size prefill staging buffer (the pre-fix buffer, sized in bytes, not
    to the chunk): half a grid slot (a chunk does not fit: today's code fails the room, the
    silent slice fallback leaks its allocation), one slot, and four slots (an inflated,
    unaligned send fits)."""
    full = cfg.full_chunk_pages
    return sorted({p for p in (full // 2, full, full * 4) if p >= 1})


def _halves(n: int) -> list[int]:
    return sorted({max(1, n // 2), n, n * 2})


def gen_deploy(rng: random.Random, base: TwinConfig) -> Deploy:
    p_tp = rng.choice([t for t in _halves(base.prefill.tp_size) if t <= 8])
    d_tp = rng.choice([t for t in _halves(base.decode.tp_size) if t <= 8])
    dp_attn = p_tp >= 2 and rng.random() < 0.25
    dp = 2 if dp_attn else None
    page = rng.choice(sorted({base.page_size, 1, 16}))
    grid_pages = rng.choice([1, 2, 4, 8, 16])
    cps = page * grid_pages if page > 1 else rng.choice([16, 32, 64, 128])
    deploy = Deploy(prefill_tp=p_tp, prefill_dp=dp, prefill_dp_attn=dp_attn or None,
                    decode_tp=d_tp, page_size=page, chunked_prefill_size=cps)
    try:
        cfg = deploy.apply(base)
    except ValueError:
        return Deploy()
    ring = smallest_ring(cfg)
    factor = rng.choice([1.0, 1.0, 1.5, 2.0, 3.0, 4.0])
    staging = rng.choice(fixed_buffers(cfg)) if rng.random() < 0.25 else None
    return replace(deploy, ring_bytes=int(ring * factor), prefill_staging_pages=staging)


def gen_request(rng: random.Random, cfg: TwinConfig, at: float) -> Req:
    grid = cfg.grid_tokens
    page = cfg.page_size
    k = rng.choice([0, 1, 1, 2, 3])
    delta = rng.choice([-page, -1, 0, 1, page, grid // 2, rng.randrange(1, grid + 1)])
    n = max(1, k * grid + delta)
    decode_prefix = 0
    if n > page and rng.random() < 0.3:
        decode_prefix = page * rng.randrange(0, (n - 1) // page + 1)
        if rng.random() < 0.1 and page > 1 and decode_prefix + 1 < n:
            decode_prefix += 1  # unaligned: SGLang fails this room by design
    prefill_prefix = 0
    if rng.random() < 0.3:
        prefill_prefix = rng.choice([rng.randrange(0, n + 1), min(n, grid), min(n, page)])
    return Req(round(at, 4), n, decode_prefix, prefill_prefix)


def gen_requests(rng: random.Random, cfg: TwinConfig) -> tuple[Req, ...]:
    count = rng.choice([1, 2, 2, 3, 3, 4, 5])
    gap = rng.choice([0.0, 0.001, 0.02, 0.2, 0.5])
    return tuple(gen_request(rng, cfg, i * gap) for i in range(count))


def gen_fault(rng: random.Random, cfg: TwinConfig, requests: tuple[Req, ...],
              prefer: tuple[str, ...] = (), model: str = "sglang") -> str:
    """One fault. Its kind (a frame fault's action and frame kind, or a timed fault) is drawn
    from the fault ``model``'s kinds; when ``prefer`` names kinds no trial has fired yet,
    half the draws take one of those (coverage-guided, as a fuzzer favours rare branches)."""
    key = rng.choice(prefer) if prefer and rng.random() < 0.5 else \
        rng.choice(kind_draw(model))
    parts0 = key.split(":")[1:]
    action = parts0[0]
    topo = Topology(cfg)
    nodes = sorted(topo.nodes)
    rooms = len(requests)
    if action in MESSAGE_ACTIONS:
        kind = parts0[1]
        parts = [action, kind]
        if rng.random() < 0.7:
            parts.append(f"nth={rng.choice([1, 1, 2, 3])}")
        else:
            parts.append(f"p={rng.choice([0.1, 0.3])}")
        if rng.random() < 0.4 and rooms and kind != "WATERMARK":  # WATERMARK has no room
            parts.append(f"room={rng.randrange(rooms)}")
        if action in ("delay", "reorder"):
            parts.append(f"ms={rng.choice([1, 5, 20, 50])}")
        return ":".join(parts)
    if action == "fail-transfer":
        return f"fail-transfer:nth={rng.choice([1, 2, 3])}"
    t = round(rng.choice([0.001, 0.003, 0.01, 0.05]) + (requests[0].at if requests else 0), 4)
    if action == "crash":
        return f"crash:{rng.choice(nodes)}:at={t}"
    if action == "restart":
        # A rank of a TP group does not come back alone in SGLang (its server restarts): under
        # the sglang fault model a restart takes the rank's whole server.
        scope = ":scope=server" if model == "sglang" else ""
        return f"restart:{rng.choice(nodes)}:at={t}:down={rng.choice([0.01, 0.1])}{scope}"
    room = rng.randrange(max(rooms, 1))
    at = round((requests[room].at if room < rooms else 0.0) + rng.choice([0.001, 0.003, 0.01]),
               4)
    return f"abort:room={room}:at={at}"


def kind_draw(model: str) -> tuple[str, ...]:
    """The ``model``'s fault kinds with their weights: each frame fault once, each timed
    fault (``ft:crash``) as often as a frame action on a sixth of the frame faults (three
    for ``all``: frame faults take about two draws in three)."""
    keys = MODELS[model]
    frame = [k for k in keys if k.count(":") == 2]
    timed = [k for k in keys if k.count(":") == 1]
    return tuple(frame + [k for k in timed for _ in range(max(1, len(frame) // 6))])


def gen_schedule(rng: random.Random) -> str:
    """"" (the simulator) two times in three, else a loopback scheduler."""
    roll = rng.random()
    if roll < 2 / 3:
        return ""
    seed = rng.randrange(1 << 16)
    if roll < 5 / 6:
        return f"random:{seed}"
    return f"pct:{seed}:{rng.choice([1, 2, 3])}"


def gen_faults(rng: random.Random, cfg: TwinConfig, requests: tuple[Req, ...],
               prefer: tuple[str, ...] = (), model: str = "sglang") -> tuple[str, ...]:
    count = rng.choices([0, 1, 2], weights=[5, 4, 1])[0]
    return tuple(gen_fault(rng, cfg, requests, prefer, model) for _ in range(count))


def generate(rng: random.Random, base: Base, strategies: Strategies,
             user_requests: tuple[Req, ...] = (), prefer: tuple[str, ...] = ()) -> Trial:
    """A fresh trial. Without ``workload`` it replays the user's requests; without ``deploy``
    it keeps the user's deployment; without ``faults`` it injects none; without
    ``interleave`` the seed is 0. ``prefer``: fault kinds (``ft:`` keys) no trial has fired
    yet."""
    for _ in range(20):
        deploy = gen_deploy(rng, base.cfg) if strategies.deploy else Deploy()
        try:
            cfg = base.config(Trial(deploy))
        except InvalidTrial:
            continue
        requests = gen_requests(rng, cfg) if strategies.workload else user_requests
        faults = gen_faults(rng, cfg, requests, prefer, strategies.fault_model) \
            if strategies.faults else ()
        seed = rng.randrange(1 << 16) if strategies.interleave else 0
        schedule = gen_schedule(rng) if strategies.interleave else ""
        if schedule:
            faults = tuple(f for f in faults if f.startswith("abort"))
        trial = Trial(deploy, requests, faults, seed, schedule)
        try:
            base.check(trial)
        except InvalidTrial:
            continue
        return trial
    return Trial(Deploy(), user_requests or (Req(0.0, base.cfg.grid_tokens),), (), 0)


def mutate(rng: random.Random, base: Base, trial: Trial, strategies: Strategies,
           prefer: tuple[str, ...] = ()) -> Trial:
    """``trial`` with one or two things changed (each from an enabled strategy)."""
    out = trial
    for _ in range(rng.choice([1, 1, 2])):
        out = _mutate_once(rng, base, out, strategies, prefer)
    return out


def _mutate_once(rng: random.Random, base: Base, trial: Trial, s: Strategies,
                 prefer: tuple[str, ...]) -> Trial:
    try:
        cfg = base.config(trial)
    except InvalidTrial:
        cfg = base.cfg
    ops = []
    if s.workload:
        ops += ["req-change", "req-add", "req-drop"]
    if s.faults:
        ops += ["fault-add", "fault-drop", "fault-swap"]
    if s.deploy:
        ops += ["deploy", "ring"]
    if s.interleave:
        ops += ["seed"]
    if not ops:
        return trial
    op = rng.choice(ops)
    reqs = list(trial.requests)
    if op == "req-change" and reqs:
        i = rng.randrange(len(reqs))
        reqs[i] = replace(gen_request(rng, cfg, reqs[i].at))
        return trial.with_(requests=tuple(reqs))
    if op == "req-add" and len(reqs) < 8:
        at = (reqs[-1].at if reqs else 0.0) + rng.choice([0.0, 0.001, 0.05, 0.3])
        return trial.with_(requests=(*reqs, gen_request(rng, cfg, at)))
    if op == "req-drop" and len(reqs) > 1:
        del reqs[rng.randrange(len(reqs))]
        return trial.with_(requests=tuple(reqs), faults=())
    if op == "fault-add" and len(trial.faults) < 4:
        fault = gen_fault(rng, cfg, trial.requests, prefer, s.fault_model)
        if trial.schedule and not fault.startswith("abort"):
            return trial  # the loopback cluster takes only aborts
        return trial.with_(faults=(*trial.faults, fault))
    if op == "fault-drop" and trial.faults:
        f = list(trial.faults)
        del f[rng.randrange(len(f))]
        return trial.with_(faults=tuple(f))
    if op == "fault-swap" and trial.faults:
        f = list(trial.faults)
        f[rng.randrange(len(f))] = gen_fault(rng, cfg, trial.requests, prefer, s.fault_model)
        return trial.with_(faults=tuple(f))
    if op == "deploy":
        return trial.with_(deploy=gen_deploy(rng, base.cfg))
    if op == "ring":
        ring = smallest_ring(cfg)
        return trial.with_(deploy=replace(trial.deploy, ring_bytes=int(
            ring * rng.choice([1.0, 1.25, 1.5, 2.0, 3.0]))))
    schedule = gen_schedule(rng)
    faults = tuple(f for f in trial.faults if f.startswith("abort")) if schedule else \
        trial.faults
    return trial.with_(seed=rng.randrange(1 << 16), schedule=schedule, faults=faults)
