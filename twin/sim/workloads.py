"""Request workloads for the simulator: trace readers, seeded generators and a prefix cache.

A :class:`Workload` is an immutable, arrival-ordered tuple of :class:`Request` objects plus a
``digest`` (sha256 of a canonical serialisation of the requests) that identifies it across runs
and machines. Workloads come from

* public production traces, read by :func:`load_trace` (format detected by content, optionally
  gzip-compressed): Mooncake JSON Lines and the Azure LLM inference CSV;
* seeded generators: :func:`poisson`, :func:`bursty`, :func:`shared_prefix` and :func:`fixed`;
* CLI strings, parsed by :func:`parse_workload_spec`.

:class:`PrefixCache` is a small deterministic LRU model of SGLang's radix cache, used to decide how
many prompt tokens of a request are already cached.

Everything here is pure Python plus numpy and deterministic: generators draw only from
``numpy.random.Generator(PCG64(seed))``.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import math
import os
import re
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import date
from typing import Any

import numpy as np

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "LengthSpec",
    "PrefixCache",
    "Request",
    "Workload",
    "WorkloadError",
    "bursty",
    "fixed",
    "load_trace",
    "parse_workload_spec",
    "poisson",
    "shared_prefix",
]

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block in Mooncake traces."""

LengthSpec = int | tuple[float, float]
"""A token length: a constant ``int``, or ``(mean, std)`` of a rounded log-normal (at least 1)."""

_DIGEST_HEADER = "staging-twin/workload/v1\n"
_JSON_FORMAT = "staging-twin/workload"
_JSON_VERSION = 1
_JSON_FIELDS = (
    "rid",
    "arrival_s",
    "input_len",
    "output_len",
    "block_tokens",
    "shared_prefix_len",
    "prefix_group",
    "prefix_hashes",
)
_EXPECTED_FORMATS = (
    "expected Mooncake JSON Lines (one object per line with 'timestamp', 'input_length', "
    "'output_length', 'hash_ids') or an Azure LLM inference CSV (header "
    "'TIMESTAMP,ContextTokens,GeneratedTokens'), optionally gzip-compressed"
)


class WorkloadError(ValueError):
    """Malformed trace, workload spec or serialised workload.

    Messages for trace rows read ``FILE:LINE: field 'NAME': problem`` (``LINE`` is 1-based).
    """


@dataclass(frozen=True, slots=True)
class Request:
    """One inference request.

    Attributes:
        rid: index in arrival order, ``0..n-1`` within its workload.
        arrival_s: arrival time in seconds.
        input_len: prompt tokens (>= 0).
        output_len: tokens to generate (>= 0).
        prefix_hashes: ids of the ``block_tokens``-sized prompt blocks, first block first; equal
            ids at the same position mean a reusable (cacheable) prefix. Empty if unknown.
        block_tokens: tokens per prefix block (512 for Mooncake).
        shared_prefix_len: explicit length of the prompt prefix shared with the other requests of
            ``prefix_group`` (set by generators; 0 if none).
        prefix_group: key of the group sharing ``shared_prefix_len`` tokens (``None`` if none).
            Lets :class:`PrefixCache` credit a shared prefix that ends inside a block.
    """

    rid: int
    arrival_s: float
    input_len: int
    output_len: int
    prefix_hashes: tuple[int, ...]
    block_tokens: int
    shared_prefix_len: int = 0
    prefix_group: int | None = None


def _request_line(r: Request) -> str:
    group = "-" if r.prefix_group is None else str(int(r.prefix_group))
    hashes = ",".join(map(str, r.prefix_hashes))
    return (
        f"{int(r.rid)} {float(r.arrival_s)!r} {int(r.input_len)} {int(r.output_len)} "
        f"{int(r.block_tokens)} {int(r.shared_prefix_len)} {group} {hashes}\n"
    )


def _digest(requests: Iterable[Request]) -> str:
    h = hashlib.sha256(_DIGEST_HEADER.encode())
    h.update("".join(map(_request_line, requests)).encode())
    return h.hexdigest()


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _validate_requests(requests: tuple[Request, ...]) -> None:
    prev = -math.inf
    for i, r in enumerate(requests):
        if not isinstance(r, Request):
            raise WorkloadError(f"request {i}: expected a Request, got {type(r).__name__}")
        if r.rid != i:
            raise WorkloadError(f"request {i}: rid is {r.rid}, expected {i} (arrival order)")
        t = r.arrival_s
        if not (isinstance(t, (float, int)) and math.isfinite(t)) or t < prev:
            raise WorkloadError(
                f"request {i}: arrival_s {t!r} is not a finite time >= the previous arrival"
            )
        prev = t
        if not (_is_int(r.input_len) and r.input_len >= 0):
            raise WorkloadError(f"request {i}: input_len {r.input_len!r} is not an int >= 0")
        if not (_is_int(r.output_len) and r.output_len >= 0):
            raise WorkloadError(f"request {i}: output_len {r.output_len!r} is not an int >= 0")
        if not (_is_int(r.block_tokens) and r.block_tokens > 0):
            raise WorkloadError(f"request {i}: block_tokens {r.block_tokens!r} is not an int > 0")
        if not (_is_int(r.shared_prefix_len) and 0 <= r.shared_prefix_len <= r.input_len):
            raise WorkloadError(
                f"request {i}: shared_prefix_len {r.shared_prefix_len!r} is not in [0, input_len]"
            )
        if r.prefix_group is not None and not _is_int(r.prefix_group):
            raise WorkloadError(f"request {i}: prefix_group {r.prefix_group!r} is not None or int")
        if type(r.prefix_hashes) is not tuple:
            raise WorkloadError(f"request {i}: prefix_hashes must be a tuple of ints")


@dataclass(frozen=True)
class Workload:
    """An immutable, arrival-ordered sequence of requests.

    Construct with ``Workload(name, requests, source)``; ``digest`` is computed when left empty and
    checked when given (a mismatch raises :class:`WorkloadError`). Requests must have
    ``rid == index`` and non-decreasing ``arrival_s``.

    Attributes:
        name: short human-readable name (file stem or generator name).
        requests: the requests, in arrival order.
        source: where it came from: a file path, or a spec that :func:`parse_workload_spec`
            accepts and that reproduces the same digest (``fixed:n=N`` for :func:`fixed`, which
            is descriptive only).
        digest: sha256 hex of the canonical serialisation of ``requests`` (name and source are
            not part of it), stable across runs, machines and file compression.
    """

    name: str
    requests: tuple[Request, ...] = field(repr=False)
    source: str
    digest: str = ""

    def __post_init__(self) -> None:
        requests = tuple(self.requests)
        object.__setattr__(self, "requests", requests)
        _validate_requests(requests)
        digest = _digest(requests)
        if self.digest and self.digest != digest:
            raise WorkloadError(
                f"workload {self.name!r}: digest mismatch (given {self.digest}, computed {digest})"
            )
        object.__setattr__(self, "digest", digest)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        """Seconds from the first to the last arrival (0.0 for fewer than two requests)."""
        if len(self.requests) < 2:
            return 0.0
        return float(self.requests[-1].arrival_s - self.requests[0].arrival_s)

    def to_jsonable(self, *, include_requests: bool = True) -> dict[str, Any]:
        """A JSON-ready dict for trace headers; requests are rows in the order of ``fields``.

        With ``include_requests=False`` only the summary (name, source, digest, counts) is kept;
        such a dict cannot be turned back into a workload.
        """
        out: dict[str, Any] = {
            "format": _JSON_FORMAT,
            "version": _JSON_VERSION,
            "name": self.name,
            "source": self.source,
            "digest": self.digest,
            "num_requests": len(self.requests),
            "duration_s": self.duration_s,
        }
        if include_requests:
            out["fields"] = list(_JSON_FIELDS)
            out["requests"] = [
                [
                    r.rid,
                    float(r.arrival_s),
                    r.input_len,
                    r.output_len,
                    r.block_tokens,
                    r.shared_prefix_len,
                    r.prefix_group,
                    list(r.prefix_hashes),
                ]
                for r in self.requests
            ]
        return out

    @classmethod
    def from_jsonable(cls, obj: dict[str, Any]) -> Workload:
        """Inverse of :meth:`to_jsonable`; verifies the digest. Raises :class:`WorkloadError`."""
        if not isinstance(obj, dict) or obj.get("format") != _JSON_FORMAT:
            raise WorkloadError(f"not a serialised workload (expected format {_JSON_FORMAT!r})")
        if obj.get("version") != _JSON_VERSION:
            raise WorkloadError(f"unsupported workload version {obj.get('version')!r}")
        if "requests" not in obj:
            raise WorkloadError("serialised workload has no 'requests' (summary only)")
        if obj.get("fields") != list(_JSON_FIELDS):
            raise WorkloadError(f"field 'fields': expected {list(_JSON_FIELDS)}")
        try:
            requests = tuple(
                Request(
                    rid=row[0],
                    arrival_s=float(row[1]),
                    input_len=row[2],
                    output_len=row[3],
                    block_tokens=row[4],
                    shared_prefix_len=row[5],
                    prefix_group=row[6],
                    prefix_hashes=tuple(row[7]),
                )
                for row in obj["requests"]
            )
        except (TypeError, IndexError, ValueError) as e:
            raise WorkloadError(f"field 'requests': malformed row ({e})") from None
        return cls(
            name=str(obj.get("name", "")),
            requests=requests,
            source=str(obj.get("source", "")),
            digest=str(obj.get("digest", "")),
        )


# --------------------------------------------------------------------------------------------
# Trace readers
# --------------------------------------------------------------------------------------------


def _show(value: object, limit: int = 60) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _field_error(file: str, line: int, name: str, expected: str, value: object) -> WorkloadError:
    return WorkloadError(f"{file}:{line}: field '{name}': expected {expected}, got {_show(value)}")


def _check_slowdown(slowdown: float) -> float:
    if not (isinstance(slowdown, (int, float)) and math.isfinite(slowdown) and slowdown > 0):
        raise WorkloadError(f"slowdown must be a finite number > 0, got {slowdown!r}")
    return float(slowdown)


def _check_first_n(first_n: int | None) -> None:
    if first_n is not None and not (_is_int(first_n) and first_n >= 1):
        raise WorkloadError(f"first_n must be None or an int >= 1, got {first_n!r}")


def _stem(path: str) -> str:
    name = os.path.basename(path)
    for suffix in (".gz", ".jsonl", ".json", ".csv", ".txt"):
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
    return name or "trace"


def _read_text(path: str) -> str:
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise WorkloadError(f"{path}: corrupt gzip data ({e})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise WorkloadError(
            f"{path}: not UTF-8 text (byte {e.start}); {_EXPECTED_FORMATS}"
        ) from None


def _nonneg_int(file: str, line: int, name: str, v: object) -> int:
    if type(v) is int and v >= 0:
        return v
    if type(v) is float and v.is_integer() and v >= 0:
        return int(v)
    raise _field_error(file, line, name, "a non-negative integer", v)


def _parse_mooncake(file: str, lines: list[str]) -> list[tuple[float, int, int, tuple[int, ...]]]:
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    loads = json.loads
    for lineno, text in enumerate(lines, 1):
        if not text or text.isspace():
            continue
        try:
            obj = loads(text)
        except ValueError as e:
            raise WorkloadError(f"{file}:{lineno}: invalid JSON ({e})") from None
        if type(obj) is not dict:
            raise WorkloadError(
                f"{file}:{lineno}: expected a JSON object, got {type(obj).__name__}"
            )
        for key in ("timestamp", "input_length", "output_length"):
            if key not in obj:
                raise WorkloadError(
                    f"{file}:{lineno}: field '{key}': missing (Mooncake rows need 'timestamp', "
                    "'input_length', 'output_length' and optionally 'hash_ids')"
                )
        ts = obj["timestamp"]
        if not (type(ts) in (int, float) and math.isfinite(ts) and ts >= 0):
            raise _field_error(file, lineno, "timestamp", "a non-negative number (ms)", ts)
        inp = obj["input_length"]
        if not (type(inp) is int and inp >= 0):
            inp = _nonneg_int(file, lineno, "input_length", inp)
        out = obj["output_length"]
        if not (type(out) is int and out >= 0):
            out = _nonneg_int(file, lineno, "output_length", out)
        hashes = obj.get("hash_ids", [])
        if type(hashes) is not list:
            raise _field_error(file, lineno, "hash_ids", "a list of integers", hashes)
        for h in hashes:
            if type(h) is not int:
                raise _field_error(file, lineno, "hash_ids", "a list of integers", h)
        rows.append((ts, inp, out, tuple(hashes)))
    return rows


_DATETIME_RE = re.compile(
    r"\s*(\d{4})-(\d{1,2})-(\d{1,2})[ T](\d{1,2}):(\d{2}):(\d{2})(?:[.,](\d+))?"
    r"\s*(Z|[+-]\d{2}:?\d{2})?\s*"
)
_AZURE_TS_EXAMPLE = '"2023-11-16 18:15:46.6805900"'


def _parse_datetime_ns(text: str, ordinals: dict[tuple[int, int, int], int]) -> int | None:
    """Nanoseconds since 0001-01-01 (UTC if an offset is given, else naive), or None if bad."""
    m = _DATETIME_RE.fullmatch(text)
    if m is None:
        return None
    y, mo, d, hh, mi, ss, frac, tz = m.groups()
    key = (int(y), int(mo), int(d))
    day = ordinals.get(key)
    if day is None:
        try:
            day = date(*key).toordinal()
        except ValueError:
            return None
        ordinals[key] = day
    h, mn, s = int(hh), int(mi), int(ss)
    if h > 23 or mn > 59 or s > 60:
        return None
    secs = day * 86400 + h * 3600 + mn * 60 + s
    if tz and tz != "Z":
        sign = -1 if tz[0] == "-" else 1
        digits = tz[1:].replace(":", "")
        secs -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    ns = int((frac or "")[:9].ljust(9, "0"))
    return secs * 1_000_000_000 + ns


def _parse_azure(file: str, lines: list[str], header_line: int) -> list[tuple[int, int, int]]:
    rows: list[tuple[int, int, int]] = []
    reader = csv.reader(lines[header_line - 1 :])
    header = [h.strip().lower() for h in next(reader)]
    cols = {}
    for name in ("TIMESTAMP", "ContextTokens", "GeneratedTokens"):
        if name.lower() not in header:
            raise WorkloadError(
                f"{file}:{header_line}: field '{name}': missing from the CSV header"
            )
        cols[name] = header.index(name.lower())
    i_ts, i_in, i_out = cols["TIMESTAMP"], cols["ContextTokens"], cols["GeneratedTokens"]
    width = len(header)
    ordinals: dict[tuple[int, int, int], int] = {}
    for lineno, row in enumerate(reader, header_line + 1):
        if not row or (len(row) == 1 and not row[0].strip()):
            continue
        if len(row) != width:
            raise WorkloadError(f"{file}:{lineno}: expected {width} columns, got {len(row)}")
        ns = _parse_datetime_ns(row[i_ts], ordinals)
        if ns is None:
            raise _field_error(
                file, lineno, "TIMESTAMP", f"a datetime like {_AZURE_TS_EXAMPLE}", row[i_ts]
            )
        vals = []
        for name, idx in (("ContextTokens", i_in), ("GeneratedTokens", i_out)):
            text = row[idx].strip()
            if not text.isdigit() or not text.isascii():
                raise _field_error(file, lineno, name, "a non-negative integer", row[idx])
            vals.append(int(text))
        rows.append((ns, vals[0], vals[1]))
    return rows


def load_trace(
    path: str | os.PathLike[str], *, first_n: int | None = None, slowdown: float = 1.0
) -> Workload:
    """Read a production request trace; the format is detected from the content, not the name.

    Formats (either may be gzip-compressed; detected by the gzip magic bytes):

    * Mooncake JSON Lines: one object per line with ``timestamp`` (ms, relative),
      ``input_length``, ``output_length`` and optional ``hash_ids`` (ints, one per 512-token
      prompt block). Extra keys are ignored; blank lines are skipped.
    * Azure LLM inference CSV: header with ``TIMESTAMP,ContextTokens,GeneratedTokens`` (any column
      order, extra columns allowed). ``TIMESTAMP`` is a datetime such as
      ``2023-11-16 18:15:46.6805900`` (any number of fractional digits, ``T`` or space separator,
      optional ``Z``/``+HH:MM`` offset). No prefix information: ``prefix_hashes`` is empty.

    Rows are sorted stably by timestamp (Mooncake traces need not be sorted), then the first
    ``first_n`` are kept. Arrival times are relative to the earliest row, so the first request
    arrives at 0.0, and are multiplied by ``slowdown`` (as SGLang's benchmark does).

    Raises:
        WorkloadError: unknown format, or a malformed row (message ``FILE:LINE: field 'NAME': ...``,
            e.g. negative lengths or timestamps, non-integer lengths, bad datetimes).
        OSError: the file cannot be read.
    """
    file = os.fspath(path)
    _check_first_n(first_n)
    slowdown = _check_slowdown(slowdown)
    # Physical lines only ("\n", optional "\r"), so reported line numbers match editors.
    lines = [ln[:-1] if ln.endswith("\r") else ln for ln in _read_text(file).split("\n")]
    first = next((i for i, t in enumerate(lines) if t.strip()), None)
    if first is None:
        raise WorkloadError(f"{file}: empty trace; {_EXPECTED_FORMATS}")
    head = lines[first].strip()
    requests: list[Request]
    if head.startswith("{"):
        moon = _parse_mooncake(file, lines)
        moon.sort(key=lambda row: row[0])
        if first_n is not None:
            moon = moon[:first_n]
        t0 = moon[0][0] if moon else 0
        bt = MOONCAKE_BLOCK_TOKENS
        requests = [
            Request(i, (ts - t0) / 1000.0 * slowdown, inp, out, hashes, bt)
            for i, (ts, inp, out, hashes) in enumerate(moon)
        ]
    elif "timestamp" in head.lower() and "contexttokens" in head.lower():
        azure = _parse_azure(file, lines, first + 1)
        azure.sort(key=lambda row: row[0])
        if first_n is not None:
            azure = azure[:first_n]
        ns0 = azure[0][0] if azure else 0
        bt = MOONCAKE_BLOCK_TOKENS
        requests = [
            Request(i, (ns - ns0) / 1e9 * slowdown, inp, out, (), bt)
            for i, (ns, inp, out) in enumerate(azure)
        ]
    else:
        raise WorkloadError(
            f"{file}:{first + 1}: unknown trace format; {_EXPECTED_FORMATS}; got {_show(head)}"
        )
    if not requests:
        raise WorkloadError(f"{file}: no requests")
    source = file
    if first_n is not None or slowdown != 1.0:
        source = _format_spec("trace", {"path": file, "first_n": first_n, "slowdown": slowdown})
    return Workload(_stem(file), tuple(requests), source)


# --------------------------------------------------------------------------------------------
# Generators
# --------------------------------------------------------------------------------------------


def _rng(seed: int) -> np.random.Generator:
    if not _is_int(seed) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    return np.random.Generator(np.random.PCG64(int(seed)))


def _check_len_spec(name: str, spec: LengthSpec) -> None:
    if _is_int(spec):
        if spec < 0:  # type: ignore[operator]
            raise ValueError(f"{name} must be >= 0, got {spec!r}")
        return
    ok = isinstance(spec, tuple) and len(spec) == 2
    if ok:
        mean, std = spec  # type: ignore[misc]
        ok = all(isinstance(v, (int, float)) and math.isfinite(v) for v in spec)  # type: ignore
        ok = ok and mean >= 1 and std >= 0
    if not ok:
        raise ValueError(f"{name} must be an int >= 0 or (mean >= 1, std >= 0), got {spec!r}")


def _lengths(rng: np.random.Generator, spec: LengthSpec, n: int) -> list[int]:
    """``n`` lengths: a constant, or rounded log-normal with the given mean/std, at least 1."""
    if _is_int(spec):
        return [int(spec)] * n  # type: ignore[arg-type]
    mean, std = (float(v) for v in spec)  # type: ignore[union-attr]
    if std == 0:
        return [max(1, round(mean))] * n
    sigma2 = math.log1p((std / mean) ** 2)
    mu = math.log(mean) - sigma2 / 2
    vals = np.rint(rng.lognormal(mu, math.sqrt(sigma2), size=n))
    return np.maximum(vals, 1).astype(np.int64).tolist()


def _poisson_arrivals(rng: np.random.Generator, n: int, rate_per_s: float) -> list[float]:
    if not (isinstance(rate_per_s, (int, float)) and rate_per_s > 0 and not math.isnan(rate_per_s)):
        raise ValueError(f"rate_per_s must be > 0 (inf: all at t=0), got {rate_per_s!r}")
    if math.isinf(rate_per_s) or n == 1:
        return [0.0] * n
    gaps = rng.exponential(1.0 / rate_per_s, size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps))).tolist()


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
    arrivals: list[float], ins: list[int], outs: list[int], block_tokens: int
) -> tuple[Request, ...]:
    return tuple(
        Request(i, t, a, b, (), block_tokens)
        for i, (t, a, b) in enumerate(zip(arrivals, ins, outs, strict=True))
    )


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
    arrivals = (burst * period + pos * float(intra_gap_s)).astype(np.float64).tolist()
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
    rows = zip(groups[order].tolist(), arrivals, questions, outs, strict=True)
    for rid, (g, t, q, o) in enumerate(rows):
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


# --------------------------------------------------------------------------------------------
# Spec strings
# --------------------------------------------------------------------------------------------


def _spec_int(kind: str, key: str, text: str, minimum: int) -> int:
    try:
        v = int(text)
    except ValueError:
        v = None
    if v is None or v < minimum:
        raise WorkloadError(f"{kind}: key '{key}': expected an integer >= {minimum}, got {text!r}")
    return v


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
        return _spec_int(kind, key, text, 0)
    mean_s, _, std_s = text.partition("~")
    mean = _spec_float(kind, key, mean_s, positive=True, allow_inf=False)
    std = _spec_float(kind, key, std_s, positive=False, allow_inf=False)
    if mean < 1:
        raise WorkloadError(f"{kind}: key '{key}': mean must be >= 1, got {text!r}")
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
    block = _spec_int(k, "block", params.get("block", str(MOONCAKE_BLOCK_TOKENS)), 1)
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
        n = _spec_int(k, "n", params["n"], 1)
        rate = _spec_float(k, "rate", params["rate"], positive=True, allow_inf=True)
        return poisson(n, rate, inp, out, seed, block_tokens=block)
    if k == "bursty":
        return bursty(
            _spec_int(k, "n", params["n"], 1),
            _spec_int(k, "burst", params["burst"], 1),
            _spec_float(k, "gap", params["gap"], positive=False, allow_inf=False),
            _spec_float(k, "intra", params.get("intra", "0"), positive=False, allow_inf=False),
            inp,
            out,
            seed,
            block_tokens=block,
        )
    return shared_prefix(
        _spec_int(k, "groups", params["groups"], 1),
        _spec_int(k, "per_group", params["per_group"], 1),
        _spec_int(k, "system", params["system"], 0),
        _spec_len(k, "question", params["question"]),
        out,
        _spec_float(k, "rate", params.get("rate", "inf"), positive=True, allow_inf=True),
        seed,
        block_tokens=block,
    )


# --------------------------------------------------------------------------------------------
# Prefix cache
# --------------------------------------------------------------------------------------------


class PrefixCache:
    """Deterministic LRU model of SGLang's radix (prefix) cache, sized in blocks.

    Entries are prompt blocks keyed by their prefix hash, plus one entry per ``prefix_group``
    holding the longest shared prefix inserted for that group (it costs one block if that prefix
    ends inside a block, else nothing: its full blocks are already hash entries).

    * :meth:`match` returns the cached prompt tokens of a request: ``k * block_tokens`` for the
      ``k`` leading ``prefix_hashes`` present, raised to ``min(group prefix, shared_prefix_len)``
      when the request's group has an entry and the full blocks of that prefix matched; capped at
      ``input_len - 1`` (at least one token is always prefilled). It does not change the cache.
    * :meth:`insert` records a request's blocks (and group prefix) as most recently used, then
      evicts least-recently-used entries until at most ``capacity_blocks`` blocks are held. Blocks
      are touched last-block-first, so a prompt's leading blocks are the last to be evicted, like
      the leaf-first eviction of a radix tree.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if not _is_int(capacity_blocks) or capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be an int >= 0, got {capacity_blocks!r}")
        self.capacity_blocks = int(capacity_blocks)
        self._lru: OrderedDict[object, int] = OrderedDict()  # key -> size in blocks
        self._groups: dict[int, int] = {}  # group -> cached shared prefix tokens
        self._used = 0

    @classmethod
    def from_tokens(
        cls, capacity_tokens: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS
    ) -> PrefixCache:
        """A cache holding ``capacity_tokens // block_tokens`` blocks."""
        return cls(capacity_tokens // block_tokens)

    @property
    def used_blocks(self) -> int:
        """Blocks currently held (<= ``capacity_blocks``)."""
        return self._used

    def __len__(self) -> int:
        return len(self._lru)

    def clear(self) -> None:
        """Drop every entry."""
        self._lru.clear()
        self._groups.clear()
        self._used = 0

    def match(self, request: Request) -> int:
        """Cached prompt tokens of ``request`` (see the class docstring); never mutates."""
        lru = self._lru
        k = 0
        for h in request.prefix_hashes:
            if h not in lru:
                break
            k += 1
        bt = request.block_tokens
        tokens = k * bt
        g = request.prefix_group
        if g is not None and request.shared_prefix_len > 0 and g in self._groups:
            shared = min(self._groups[g], request.shared_prefix_len)
            if k >= shared // bt:
                tokens = max(tokens, shared)
        return max(0, min(tokens, request.input_len - 1))

    def insert(self, request: Request) -> None:
        """Record ``request``'s prompt blocks as cached and most recently used; evict LRU."""
        lru = self._lru
        g = request.prefix_group
        if g is not None and request.shared_prefix_len > 0:
            length = max(self._groups.get(g, 0), request.shared_prefix_len)
            self._groups[g] = length
            self._touch(("group", g), 1 if length % request.block_tokens else 0)
        for h in reversed(request.prefix_hashes):
            self._touch(h, 1)
        while self._used > self.capacity_blocks:
            key, size = lru.popitem(last=False)
            self._used -= size
            if type(key) is tuple:
                del self._groups[key[1]]

    def _touch(self, key: object, size: int) -> None:
        old = self._lru.pop(key, None)
        if old is not None:
            self._used -= old
        self._lru[key] = size
        self._used += size
