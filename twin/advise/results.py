"""The result file of a sweep: one CSV row per finished point, appended as results arrive.

The header is the axis columns (``x.NAME``) followed by :data:`BASE_COLUMNS`. Rows are flushed
one by one, so an interrupted sweep loses at most the row being written; reopening the file
drops a torn last line and reports which points are done, so a resumed sweep skips them. Rows of
another sweep (another base config or workload) may share the file: their point ids differ.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from twin.advise.evaluate import BASE_COLUMNS

RETRY_OUTCOMES = ("error",)
"""Rows with these outcomes are run again by a resumed sweep."""


class ResultsError(ValueError):
    """The result file cannot be used (another sweep's columns, unreadable)."""


def header_for(axis_names: Iterable[str]) -> list[str]:
    return [f"x.{n}" for n in axis_names] + list(BASE_COLUMNS)


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, sort_keys=True, default=str)
    return value


TEXT_COLUMNS = frozenset({"point_id", "sweep"})
"""Columns read back as the text written: hex digests, which may look like numbers
(``"1234567890123456"``, ``"12e4567890abcdef"``)."""


def parse_cell(text: str, column: str = "") -> Any:
    """A CSV cell back as None, a bool, an int, a float or the string itself (always the
    string in :data:`TEXT_COLUMNS`)."""
    if text == "":
        return None
    if column in TEXT_COLUMNS:
        return text
    if text in ("true", "false"):
        return text == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


class ResultsFile:
    """Append-only CSV of result rows with resume support."""

    def __init__(self, path: str | Path, axis_names: Sequence[str]) -> None:
        self.path = Path(path)
        self.header = header_for(axis_names)
        self.rows: list[dict[str, Any]] = []
        if self.path.exists() and self.path.stat().st_size > 0:
            self._load()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("w", newline="") as f:
                csv.writer(f).writerow(self.header)
        self._file = self.path.open("a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=self.header, extrasaction="ignore")

    def _load(self) -> None:
        raw = self.path.read_bytes()
        if not raw.endswith(b"\n"):  # a torn last row from an interrupted sweep
            raw = raw[: raw.rfind(b"\n") + 1]
            self.path.write_bytes(raw)
        reader = csv.reader(io.StringIO(raw.decode("utf-8"), newline=""))
        header = next(reader, None)
        if header != self.header:
            raise ResultsError(
                f"{self.path}: holds a sweep with other columns ({_diff(header, self.header)}); "
                f"write to another file")
        self.rows.extend(_complete_rows(header, reader))

    def done_ids(self) -> set[str]:
        return {str(r["point_id"]) for r in self.rows if r.get("outcome") not in RETRY_OUTCOMES}

    def done_rows(self) -> dict[str, dict[str, Any]]:
        return {str(r["point_id"]): r for r in self.rows
                if r.get("outcome") not in RETRY_OUTCOMES}

    def append(self, row: dict[str, Any]) -> None:
        self._writer.writerow({k: _cell(row.get(k)) for k in self.header})
        self._file.flush()
        self.rows.append(row)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ResultsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _diff(have: list[str] | None, want: list[str]) -> str:
    if not have:
        return "no header"
    extra = [c for c in have if c not in want]
    missing = [c for c in want if c not in have]
    parts = []
    if extra:
        parts.append("it has " + ", ".join(extra[:6]))
    if missing:
        parts.append("this sweep needs " + ", ".join(missing[:6]))
    return "; ".join(parts) or "columns in another order"


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """Every complete row of a result file, cells parsed (JSON columns stay strings)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ResultsError(f"{p}: {exc.strerror or exc}") from None
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, None)
    if not header or "point_id" not in header or "outcome" not in header:
        raise ResultsError(f"{p}: not a sweep result file (no point_id/outcome columns)")
    return list(_complete_rows(header, reader))


def _complete_rows(header: list[str], reader: Iterable[list[str]]) -> Iterator[dict[str, Any]]:
    """The rows that have every column (a torn last row has not), cells parsed."""
    for cells in reader:
        if len(cells) == len(header):
            yield {k: parse_cell(v, k) for k, v in zip(header, cells, strict=True)}


def axis_names(rows_or_header: Sequence[dict[str, Any]] | Sequence[str]) -> list[str]:
    """The swept axes of a result file (its ``x.NAME`` columns, prefix removed)."""
    first = rows_or_header[0] if rows_or_header else None
    keys = list(first) if isinstance(first, dict) else [str(k) for k in rows_or_header]
    return [k[2:] for k in keys if isinstance(k, str) and k.startswith("x.")]


def json_cell(row: dict[str, Any], column: str) -> Any:
    """A JSON column of ``row`` decoded (None when empty or malformed)."""
    value = row.get(column)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return None
