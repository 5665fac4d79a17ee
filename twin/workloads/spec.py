"""Workload spec strings from the command line (``poisson:n=500,rate=20``, a trace path, ...)."""

from __future__ import annotations

import math
import os
import re

from twin.workloads.generators import bursty, poisson, shared_prefix
from twin.workloads.model import (
    MAX_TOKENS,
    MOONCAKE_BLOCK_TOKENS,
    LengthSpec,
    Workload,
    WorkloadError,
    request_limit,
    too_many_requests,
)
from twin.workloads.readers import load_trace


def _spec_int(kind: str, key: str, text: str, minimum: int, maximum: int | None = None) -> int:
    try:
        v = int(text)
    except ValueError:
        v = None
    if v is None or v < minimum or (maximum is not None and v > maximum):
        what = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise WorkloadError(f"{kind}: key '{key}': expected an integer {what}, got {text!r}")
    return v


def _spec_n(kind: str, key: str, n: int) -> int:
    """``n`` requests, unless they cannot fit in this host's memory."""
    why = too_many_requests(n, request_limit())
    if why is not None:
        raise WorkloadError(f"{kind}: {key}: {why}")
    return n


def _spec_float(kind: str, key: str, text: str, *, positive: bool, allow_inf: bool) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    ok = not math.isnan(v) and (v > 0 if positive else v >= 0)
    ok = ok and (allow_inf or math.isfinite(v))
    if not ok:
        what = "a number > 0" if positive else "a number >= 0"
        what += " or 'inf'" if allow_inf else ""
        raise WorkloadError(f"{kind}: key '{key}': expected {what}, got {text!r}")
    return v


def _spec_len(kind: str, key: str, text: str) -> LengthSpec:
    if "~" not in text:
        return _spec_int(kind, key, text, 0, MAX_TOKENS)
    mean_s, _, std_s = text.partition("~")
    mean = _spec_float(kind, key, mean_s, positive=True, allow_inf=False)
    std = _spec_float(kind, key, std_s, positive=False, allow_inf=False)
    if not 1 <= mean <= MAX_TOKENS:
        raise WorkloadError(f"{kind}: key '{key}': mean must be in [1, {MAX_TOKENS}], got "
                            f"{text!r}")
    return (mean, std)


_SPEC_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # kind: (required keys, optional keys)
    "poisson": (("n", "rate"), ("input", "output", "seed", "block")),
    "bursty": (("n", "burst", "gap"), ("intra", "input", "output", "seed", "block")),
    "shared-prefix": (
        ("groups", "per_group", "system", "question"),
        ("output", "rate", "seed", "block"),
    ),
    "trace": (("path",), ("first_n", "slowdown")),
}
_SPEC_HELP = (
    "expected a trace file path, 'trace:path=P[,first_n=N][,slowdown=X]', "
    "'poisson:n=N,rate=R[,input=L][,output=L][,seed=S][,block=B]', "
    "'bursty:n=N,burst=K,gap=G[,intra=I][,input=L][,output=L][,seed=S][,block=B]' or "
    "'shared-prefix:groups=G,per_group=P,system=T,question=L[,output=L][,rate=R][,seed=S]"
    "[,block=B]'; a length L is an int or MEAN~STD"
)


def parse_workload_spec(spec: str) -> Workload:
    """Build a workload from a CLI string.

    Forms: a trace file path; ``trace:path=P,first_n=N,slowdown=X``;
    ``poisson:n=100,rate=5,input=2048,output=128,seed=1``;
    ``bursty:n=64,burst=16,gap=2.0,intra=0.01,input=1024,output=64``;
    ``shared-prefix:groups=4,per_group=8,system=4096,question=256,output=128,rate=10,seed=0``.
    Lengths are ints or ``MEAN~STD`` (log-normal); ``rate=inf`` sends everything at t=0.
    Defaults: input=1024, output=128, seed=0, block=512, intra=0, rate=inf (shared-prefix).
    A workload's ``source`` is such a spec (or a path) and reproduces the same digest.

    Raises:
        WorkloadError: unknown generator or key, missing key or bad value (the key is named),
            or a path that is not a file.
    """
    text = spec.strip()
    kind, sep, rest = text.partition(":")
    kind_norm = kind.strip().lower().replace("_", "-")
    if not sep or kind_norm not in _SPEC_KEYS:
        if os.path.isfile(text):
            return load_trace(text)
        raise WorkloadError(f"workload spec {spec!r}: not a file or known generator; {_SPEC_HELP}")
    required, optional = _SPEC_KEYS[kind_norm]
    params: dict[str, str] = {}
    # Split on commas that start a known key, so a trace path may itself contain commas.
    keys = "|".join(re.escape(key) for key in required + optional)
    splitter = rf",(?=\s*(?:{keys})\s*=)" if kind_norm == "trace" else ","
    items = [p for p in re.split(splitter, rest) if p.strip()]
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            raise WorkloadError(f"{kind_norm}: item {item.strip()!r} is not KEY=VALUE")
        if key not in required + optional:
            raise WorkloadError(
                f"{kind_norm}: unknown key '{key}' (expected one of "
                f"{', '.join(required + optional)})"
            )
        if key in params:
            raise WorkloadError(f"{kind_norm}: key '{key}' given twice")
        params[key] = value.strip()
    for key in required:
        if key not in params:
            raise WorkloadError(f"{kind_norm}: missing key '{key}'; {_SPEC_HELP}")
    k = kind_norm
    block = _spec_int(k, "block", params.get("block", str(MOONCAKE_BLOCK_TOKENS)), 1, MAX_TOKENS)
    seed = _spec_int(k, "seed", params.get("seed", "0"), 0)
    inp = _spec_len(k, "input", params.get("input", "1024"))
    out = _spec_len(k, "output", params.get("output", "128"))
    if k == "trace":
        first_n = _spec_int(k, "first_n", params["first_n"], 1) if "first_n" in params else None
        slowdown = _spec_float(
            k, "slowdown", params.get("slowdown", "1"), positive=True, allow_inf=False
        )
        if not os.path.isfile(params["path"]):
            raise WorkloadError(f"trace: key 'path': no such file {params['path']!r}")
        return load_trace(params["path"], first_n=first_n, slowdown=slowdown)
    if k == "poisson":
        n = _spec_n(k, "key 'n'", _spec_int(k, "n", params["n"], 1))
        rate = _spec_float(k, "rate", params["rate"], positive=True, allow_inf=True)
        return poisson(n, rate, inp, out, seed, block_tokens=block)
    if k == "bursty":
        return bursty(
            _spec_n(k, "key 'n'", _spec_int(k, "n", params["n"], 1)),
            _spec_int(k, "burst", params["burst"], 1),
            _spec_float(k, "gap", params["gap"], positive=False, allow_inf=False),
            _spec_float(k, "intra", params.get("intra", "0"), positive=False, allow_inf=False),
            inp,
            out,
            seed,
            block_tokens=block,
        )
    groups = _spec_int(k, "groups", params["groups"], 1)
    per_group = _spec_int(k, "per_group", params["per_group"], 1)
    _spec_n(k, "keys 'groups' x 'per_group'", groups * per_group)
    return shared_prefix(
        groups,
        per_group,
        _spec_int(k, "system", params["system"], 0, MAX_TOKENS),
        _spec_len(k, "question", params["question"]),
        out,
        _spec_float(k, "rate", params.get("rate", "inf"), positive=True, allow_inf=True),
        seed,
        block_tokens=block,
    )
