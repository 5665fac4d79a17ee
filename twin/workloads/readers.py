"""Production trace readers: Mooncake JSON Lines and the Azure LLM inference CSV (format
detected by content, plain or gzip), via :func:`load_trace`."""

from __future__ import annotations

import codecs
import csv
import gzip
import itertools
import json
import math
import os
import re
import zlib
from collections.abc import Iterable, Iterator
from datetime import date
from typing import Any

from twin.workloads.generators import _format_spec
from twin.workloads.model import (
    _EXPECTED_FORMATS,
    MAX_TOKENS,
    MOONCAKE_BLOCK_TOKENS,
    Request,
    Workload,
    WorkloadError,
    _is_int,
    request_limit,
    too_many_requests,
)

EXCERPT = 24
"""At most this many characters of a file are quoted in an error about it."""

MAX_LINE_BYTES = 1 << 20
"""The longest line a trace may have (a Mooncake row for a million-token prompt takes ~16 KB);
a longer one is an error, so a file with no line breaks is not read whole."""


def _show(value: object, limit: int = EXCERPT) -> str:
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


BLOCK_BYTES = 1 << 20
"""Read (and decompress) this much at a time."""

INFLATE_RATIO = 100
"""A gzip trace may decompress to ``INFLATE_RATIO`` times its size (at least ``INFLATE_FLOOR``
bytes): request traces compress about 5-20x, so more is a decompression bomb, not a trace."""
INFLATE_FLOOR = 64 << 20

def _lines(path: str) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each physical line (``\n`` ends a line, a ``\r`` before it is
    dropped; a block of blank lines is skipped whole), read and decompressed (gzip, detected by
    its magic bytes) a block at a time: memory holds a block and a line, whatever the file's
    size."""
    with open(path, "rb") as raw:
        packed = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        budget = max(INFLATE_FLOOR, INFLATE_RATIO * os.fstat(raw.fileno()).st_size)
        f: Any = gzip.GzipFile(fileobj=raw) if packed else raw
        lineno = 1  # of the line ``tail`` begins
        tail = b""
        total = 0
        while True:
            try:
                block = f.read(BLOCK_BYTES)
            except (OSError, EOFError, zlib.error) as e:
                if not packed:
                    raise
                raise WorkloadError(f"{path}: corrupt gzip data ({e})") from None
            total += len(block)
            if packed and total > budget:
                raise WorkloadError(
                    f"{path}: decompresses to more than {INFLATE_RATIO}x its size ({budget} "
                    f"bytes): not a request trace; {_EXPECTED_FORMATS}")
            if not block:
                if tail:
                    yield from _decode(path, lineno, tail.removesuffix(b"\r"))
                return
            data = tail + block
            end = data.rfind(b"\n")
            if end < 0:
                if len(data) > MAX_LINE_BYTES:
                    raise WorkloadError(f"{path}:{lineno}: line longer than {MAX_LINE_BYTES} "
                                        f"bytes; {_EXPECTED_FORMATS}")
                tail = data
                continue
            body, tail = data[:end], data[end + 1:]
            if body.isspace():  # blank lines only: skipped at C speed
                lineno += body.count(b"\n") + 1
                continue
            yield from _decode(path, lineno, body)
            lineno += body.count(b"\n") + 1


def _decode(path: str, lineno: int, body: bytes) -> Iterator[tuple[int, str]]:
    """The lines of ``body`` (whole lines, ``\n``-separated), the first numbered ``lineno``."""
    if lineno == 1 and body.startswith(codecs.BOM_UTF8):
        body = body[len(codecs.BOM_UTF8):]
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = lineno + body.count(b"\n", 0, e.start)
        col = e.start - (body.rfind(b"\n", 0, e.start) + 1)
        raise WorkloadError(
            f"{path}:{bad}: not UTF-8 text (byte {col} of the line); {_EXPECTED_FORMATS}"
        ) from None
    for i, line in enumerate(text.split("\n"), lineno):
        yield i, (line[:-1] if line.endswith("\r") else line)


def _count(file: str, lineno: int, rows: int, limit: int | None) -> None:
    why = too_many_requests(rows, limit)
    if why is not None:
        raise WorkloadError(f"{file}:{lineno}: the trace has more requests than fit: {why}")


def _nonneg_int(file: str, line: int, name: str, v: object) -> int:
    if (type(v) is int or (type(v) is float and v.is_integer())) and v >= 0:
        if v <= MAX_TOKENS:
            return int(v)
        raise _field_error(file, line, name, f"at most {MAX_TOKENS} tokens", v)
    raise _field_error(file, line, name, "a non-negative integer", v)


def _parse_mooncake(
    file: str, lines: Iterable[tuple[int, str]], limit: int | None
) -> list[tuple[float, int, int, tuple[int, ...]]]:
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    loads = json.loads
    cap = MAX_TOKENS
    for lineno, text in lines:
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
        if not (type(inp) is int and 0 <= inp <= cap):
            inp = _nonneg_int(file, lineno, "input_length", inp)
        out = obj["output_length"]
        if not (type(out) is int and 0 <= out <= cap):
            out = _nonneg_int(file, lineno, "output_length", out)
        hashes = obj.get("hash_ids", [])
        if type(hashes) is not list:
            raise _field_error(file, lineno, "hash_ids", "a list of integers", hashes)
        for h in hashes:
            if type(h) is not int:
                raise _field_error(file, lineno, "hash_ids", "a list of integers", h)
        rows.append((ts, inp, out, tuple(hashes)))
        if limit is not None and len(rows) > limit:
            _count(file, lineno, len(rows), limit)
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


def _parse_azure(
    file: str, lines: Iterator[tuple[int, str]], header_line: int, header_text: str,
    limit: int | None,
) -> list[tuple[int, int, int]]:
    rows: list[tuple[int, int, int]] = []
    at = [header_line]

    def texts() -> Iterator[str]:
        yield header_text
        for at[0], text in lines:
            yield text

    reader = csv.reader(texts())
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
    for row in reader:
        lineno = at[0]
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
            if len(text.lstrip("0")) > 10 or int(text) > MAX_TOKENS:  # no 5,000-digit int()
                raise _field_error(file, lineno, name, f"at most {MAX_TOKENS} tokens", row[idx])
            vals.append(int(text))
        rows.append((ns, vals[0], vals[1]))
        if limit is not None and len(rows) > limit:
            _count(file, lineno, len(rows), limit)
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
    limit = request_limit()
    # Physical lines only ("\n", optional "\r"), so reported line numbers match editors.
    lines = _lines(file)
    first, head_text = next(((i, t) for i, t in lines if t.strip()), (0, ""))
    if not first:
        raise WorkloadError(f"{file}: empty trace; {_EXPECTED_FORMATS}")
    head = head_text.strip()
    requests: list[Request]
    if head.startswith("{"):
        moon = _parse_mooncake(file, itertools.chain([(first, head_text)], lines), limit)
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
        azure = _parse_azure(file, lines, first, head_text, limit)
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
            f"{file}:{first}: unknown trace format; {_EXPECTED_FORMATS}; the line starts "
            f"{_show(head)}"
        )
    if not requests:
        raise WorkloadError(f"{file}: no requests")
    source = file
    if first_n is not None or slowdown != 1.0:
        source = _format_spec("trace", {"path": file, "first_n": first_n, "slowdown": slowdown})
    return Workload(_stem(file), tuple(requests), source)
