"""The workload model: :class:`Request` and :class:`Workload`, immutable, digested and
serialisable; :class:`WorkloadError` for every malformed input."""

from __future__ import annotations

import hashlib
import itertools
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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


MAX_TOKENS = 2**31 - 1
"""The largest prompt or output length a workload may name (2**31 - 1): far beyond any model's
context, and what a 32-bit token count holds."""

RUN_BYTES_PER_REQUEST = 4096
"""Memory one request takes in a simulation, its share of the workload included: about 4 KiB
(peak resident memory of ``twin sim --workload poisson:n=N,rate=20000,input=16,output=1`` grew
by 79 MB from N = 10,000 to 30,000)."""


def available_memory() -> int | None:
    """Bytes this host can still give a process: ``MemAvailable`` from ``/proc/meminfo``, else
    the physical memory (``None`` where neither can be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def request_limit() -> int | None:
    """How many requests a run on this host can hold (``RUN_BYTES_PER_REQUEST`` each), or None
    where the memory is unknown."""
    avail = available_memory()
    return None if avail is None else max(1, avail // RUN_BYTES_PER_REQUEST)


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"  # pragma: no cover


def too_many_requests(n: int, limit: int | None) -> str | None:
    """Why ``n`` requests cannot be run on this host (``limit`` from ``request_limit``), or
    None when they fit."""
    if limit is None or n <= limit:
        return None
    avail = limit * RUN_BYTES_PER_REQUEST
    return (f"{n} requests would take about {_size(n * RUN_BYTES_PER_REQUEST)} of memory to "
            f"run (about {RUN_BYTES_PER_REQUEST // 1024} KiB each) and this host has "
            f"{_size(avail)} available: at most {limit} requests")


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
    lines = map(_request_line, requests)
    while batch := "".join(itertools.islice(lines, 4096)):  # not one string of every line
        h.update(batch.encode())
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
