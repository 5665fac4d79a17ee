"""Seeded workload generators: :func:`poisson`, :func:`bursty`, :func:`shared_prefix`,
:func:`fixed`. They draw only from ``numpy.random.Generator(PCG64(seed))``."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from twin.workloads.model import (
    MAX_TOKENS,
    MOONCAKE_BLOCK_TOKENS,
    LengthSpec,
    Request,
    Workload,
    _is_int,
)


def _rng(seed: int) -> np.random.Generator:
    if not _is_int(seed) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    return np.random.Generator(np.random.PCG64(int(seed)))


def _check_len_spec(name: str, spec: LengthSpec) -> None:
    if _is_int(spec):
        if not 0 <= spec <= MAX_TOKENS:  # type: ignore[operator]
            raise ValueError(f"{name} must be in [0, {MAX_TOKENS}], got {spec!r}")
        return
    ok = isinstance(spec, tuple) and len(spec) == 2
    if ok:
        mean, std = spec  # type: ignore[misc]
        ok = all(isinstance(v, (int, float)) and math.isfinite(v) for v in spec)  # type: ignore
        ok = ok and 1 <= mean <= MAX_TOKENS and std >= 0
    if not ok:
        raise ValueError(f"{name} must be an int >= 0 or (mean >= 1, std >= 0), got {spec!r}")


#: Requests built per step from the generators' numpy draws: the draws stay arrays (8 bytes a
#: value) and only this many values at a time become Python objects beside the requests.
CHUNK = 1 << 16


def _lengths(rng: np.random.Generator, spec: LengthSpec, n: int) -> np.ndarray:
    """``n`` lengths: a constant, or rounded log-normal with the given mean/std, at least 1."""
    if _is_int(spec):
        return np.full(n, int(spec), dtype=np.int64)  # type: ignore[arg-type]
    mean, std = (float(v) for v in spec)  # type: ignore[union-attr]
    if std == 0:
        return np.full(n, max(1, round(mean)), dtype=np.int64)
    sigma2 = math.log1p((std / mean) ** 2)
    mu = math.log(mean) - sigma2 / 2
    vals = np.rint(rng.lognormal(mu, math.sqrt(sigma2), size=n))
    return np.clip(vals, 1, MAX_TOKENS).astype(np.int64)  # a huge std draws inf


def _poisson_arrivals(rng: np.random.Generator, n: int, rate_per_s: float) -> np.ndarray:
    if not (isinstance(rate_per_s, (int, float)) and rate_per_s > 0 and not math.isnan(rate_per_s)):
        raise ValueError(f"rate_per_s must be > 0 (inf: all at t=0), got {rate_per_s!r}")
    if math.isinf(rate_per_s) or n == 1:
        return np.zeros(n, dtype=np.float64)
    times = np.empty(n, dtype=np.float64)
    times[0] = 0.0
    np.cumsum(rng.exponential(1.0 / rate_per_s, size=n - 1), out=times[1:])
    return times


def _chunks(*arrays: np.ndarray) -> Iterator[tuple[int, tuple[list[Any], ...]]]:
    """``(offset, lists)``: ``CHUNK`` values of every array at a time, as Python objects."""
    n = len(arrays[0])
    for lo in range(0, n, CHUNK):
        yield lo, tuple(a[lo:lo + CHUNK].tolist() for a in arrays)


def _check_n(name: str, n: int) -> None:
    if not _is_int(n) or n < 1:
        raise ValueError(f"{name} must be an int >= 1, got {n!r}")


def _fmt_len(spec: LengthSpec) -> str:
    if _is_int(spec):
        return str(int(spec))  # type: ignore[arg-type]
    mean, std = spec  # type: ignore[misc]
    return f"{_fmt_num(mean)}~{_fmt_num(std)}"


def _fmt_num(v: float) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return repr(v) if isinstance(v, float) else str(v)


def _format_spec(kind: str, params: dict[str, Any]) -> str:
    parts = []
    for k, v in params.items():
        if v is None:
            continue
        parts.append(f"{k}={v if isinstance(v, str) else _fmt_num(v)}")
    return f"{kind}:" + ",".join(parts)


def _plain_requests(
    arrivals: np.ndarray, ins: np.ndarray, outs: np.ndarray, block_tokens: int
) -> tuple[Request, ...]:
    requests: list[Request] = []
    add = requests.append
    for lo, (ts, inps, outps) in _chunks(arrivals, ins, outs):
        for i, (t, a, b) in enumerate(zip(ts, inps, outps, strict=True), lo):
            add(Request(i, t, a, b, (), block_tokens))
    return tuple(requests)


def poisson(
    n: int,
    rate_per_s: float,
    input_len: LengthSpec,
    output_len: LengthSpec,
    seed: int = 0,
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> Workload:
    """``n`` requests with exponential inter-arrival gaps (Poisson process), first at t=0.

    ``rate_per_s=math.inf`` puts every request at t=0. Lengths are constant ints or ``(mean,
    std)`` log-normal draws. Requests carry no prefix hashes. Deterministic in ``seed``.
    """
    _check_n("n", n)
    _check_len_spec("input_len", input_len)
    _check_len_spec("output_len", output_len)
    rng = _rng(seed)
    arrivals = _poisson_arrivals(rng, n, rate_per_s)
    ins = _lengths(rng, input_len, n)
    outs = _lengths(rng, output_len, n)
    spec = _format_spec(
        "poisson",
        {
            "n": n,
            "rate": float(rate_per_s),
            "input": _fmt_len(input_len),
            "output": _fmt_len(output_len),
            "seed": seed,
            "block": block_tokens,
        },
    )
    return Workload("poisson", _plain_requests(arrivals, ins, outs, block_tokens), spec)


def bursty(
    n: int,
    burst_size: int,
    burst_gap_s: float,
    intra_gap_s: float,
    input_len: LengthSpec,
    output_len: LengthSpec,
    seed: int = 0,
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> Workload:
    """``n`` requests in bursts of ``burst_size`` (the last burst may be short).

    Within a burst requests are ``intra_gap_s`` apart; ``burst_gap_s`` separates the last request
    of a burst from the first of the next. Arrival times are deterministic; ``seed`` only drives
    ``(mean, std)`` lengths. Requests carry no prefix hashes.
    """
    _check_n("n", n)
    _check_n("burst_size", burst_size)
    for name, v in (("burst_gap_s", burst_gap_s), ("intra_gap_s", intra_gap_s)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    _check_len_spec("input_len", input_len)
    _check_len_spec("output_len", output_len)
    rng = _rng(seed)
    idx = np.arange(n)
    burst, pos = np.divmod(idx, burst_size)
    period = (burst_size - 1) * float(intra_gap_s) + float(burst_gap_s)
    arrivals = (burst * period + pos * float(intra_gap_s)).astype(np.float64)
    del idx, burst, pos
    ins = _lengths(rng, input_len, n)
    outs = _lengths(rng, output_len, n)
    spec = _format_spec(
        "bursty",
        {
            "n": n,
            "burst": burst_size,
            "gap": float(burst_gap_s),
            "intra": float(intra_gap_s),
            "input": _fmt_len(input_len),
            "output": _fmt_len(output_len),
            "seed": seed,
            "block": block_tokens,
        },
    )
    return Workload("bursty", _plain_requests(arrivals, ins, outs, block_tokens), spec)


class _HashIds:
    """Deterministic block-id allocator: shared ids per (group, position), fresh ids otherwise."""

    def __init__(self) -> None:
        self._shared: dict[tuple[int, int], int] = {}
        self._next = 0

    def fresh(self) -> int:
        self._next += 1
        return self._next - 1

    def shared(self, group: int, pos: int) -> int:
        key = (group, pos)
        hid = self._shared.get(key)
        if hid is None:
            hid = self._shared[key] = self.fresh()
        return hid

    def blocks(
        self, input_len: int, shared_len: int, group: int | None, bt: int
    ) -> tuple[int, ...]:
        """Ids for ``ceil(input_len / bt)`` blocks; full blocks inside the shared prefix are shared."""
        total = -(-input_len // bt)
        n_shared = shared_len // bt if group is not None else 0
        return tuple(
            self.shared(group, i) if i < n_shared else self.fresh()  # type: ignore[arg-type]
            for i in range(total)
        )


def shared_prefix(
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: LengthSpec,
    output_len: LengthSpec,
    rate_per_s: float,
    seed: int = 0,
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> Workload:
    """Groups of prompts sharing a system prompt, like SGLang's generated-shared-prefix benchmark.

    Each of the ``num_groups * prompts_per_group`` requests has ``input_len = system_prompt_len +
    question``; all prompts are shuffled and arrive as a Poisson process at ``rate_per_s``
    (``math.inf``: all at t=0). Every request has ``ceil(input_len / block_tokens)`` prefix hashes;
    the full blocks inside the system prompt are shared within the group, the rest are unique.
    ``shared_prefix_len = system_prompt_len`` and ``prefix_group`` is the group index.
    """
    _check_n("num_groups", num_groups)
    _check_n("prompts_per_group", prompts_per_group)
    if not _is_int(system_prompt_len) or system_prompt_len < 0:
        raise ValueError(f"system_prompt_len must be an int >= 0, got {system_prompt_len!r}")
    _check_len_spec("question_len", question_len)
    _check_len_spec("output_len", output_len)
    rng = _rng(seed)
    n = num_groups * prompts_per_group
    groups = np.repeat(np.arange(num_groups), prompts_per_group)
    order = rng.permutation(n)
    arrivals = _poisson_arrivals(rng, n, rate_per_s)
    questions = _lengths(rng, question_len, n)
    outs = _lengths(rng, output_len, n)
    ids = _HashIds()
    requests = []
    for lo, (gs, ts, qs, os_) in _chunks(groups[order], arrivals, questions, outs):
        for rid, (g, t, q, o) in enumerate(zip(gs, ts, qs, os_, strict=True), lo):
            inp = system_prompt_len + q
            hashes = ids.blocks(inp, system_prompt_len, g, block_tokens)
            requests.append(Request(rid, t, inp, o, hashes, block_tokens, system_prompt_len, g))
    spec = _format_spec(
        "shared-prefix",
        {
            "groups": num_groups,
            "per_group": prompts_per_group,
            "system": system_prompt_len,
            "question": _fmt_len(question_len),
            "output": _fmt_len(output_len),
            "rate": float(rate_per_s),
            "seed": seed,
            "block": block_tokens,
        },
    )
    return Workload("shared-prefix", tuple(requests), spec)


def fixed(
    requests: Sequence[Sequence[float | int]],
    *,
    name: str = "fixed",
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> Workload:
    """A hand-written workload from ``(arrival_s, input_len, output_len, shared_prefix_len)``.

    An optional fifth element sets ``prefix_group`` (default 0 when ``shared_prefix_len > 0``:
    all such requests share one nested prefix, so a 1,000-token and a 2,000-token shared prefix
    have their first 1,000 tokens in common). Rows are sorted stably by arrival (times are kept
    as given, not shifted to 0). Each request gets ``ceil(input_len / block_tokens)`` prefix
    hashes, shared for the full blocks of its group's prefix and unique otherwise.
    """
    rows = []
    for i, row in enumerate(requests):
        if len(row) not in (4, 5):
            raise ValueError(
                f"fixed row {i}: expected (arrival_s, input_len, output_len, shared_prefix_len"
                f"[, group]), got {row!r}"
            )
        t, inp, out, spl = row[:4]
        if not (isinstance(t, (int, float)) and math.isfinite(t)):
            raise ValueError(f"fixed row {i}: arrival_s must be a finite number, got {t!r}")
        for fname, v in (("input_len", inp), ("output_len", out), ("shared_prefix_len", spl)):
            if not _is_int(v) or v < 0:
                raise ValueError(f"fixed row {i}: {fname} must be an int >= 0, got {v!r}")
        if spl > inp:
            raise ValueError(f"fixed row {i}: shared_prefix_len {spl} > input_len {inp}")
        group = int(row[4]) if len(row) == 5 else (0 if spl > 0 else None)
        rows.append((float(t), int(inp), int(out), int(spl), group if spl > 0 else None))
    if not rows:
        raise ValueError("fixed: no requests")
    rows.sort(key=lambda r: r[0])
    ids = _HashIds()
    reqs = tuple(
        Request(rid, t, inp, out, ids.blocks(inp, spl, g, block_tokens), block_tokens, spl, g)
        for rid, (t, inp, out, spl, g) in enumerate(rows)
    )
    return Workload(name, reqs, f"fixed:n={len(reqs)}")
