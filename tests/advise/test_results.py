"""The result file: appended row by row, resumable, refusing another sweep's columns."""

from __future__ import annotations

from pathlib import Path

import pytest

from twin.advise.evaluate import empty_row
from twin.advise.results import ResultsError, ResultsFile, axis_names, read_results


def _row(pid: str, outcome: str = "clean", ring: int = 8) -> dict[str, object]:
    row = empty_row()
    row.update({"point_id": pid, "outcome": outcome, "x.staging_pool_size_mb": ring,
                "ttft_p99": 0.25, "failures": {"x": 1}, "seed": 0})
    return row


def test_rows_round_trip_and_resume(tmp_path: Path) -> None:
    path = tmp_path / "r.csv"
    with ResultsFile(path, ["staging_pool_size_mb"]) as f:
        f.append(_row("a"))
        f.append(_row("b", "error"))
    with ResultsFile(path, ["staging_pool_size_mb"]) as f:
        assert f.done_ids() == {"a"}  # errors are retried
        f.append(_row("c", "wedged", 16))
    rows = read_results(path)
    assert [r["point_id"] for r in rows] == ["a", "b", "c"]
    assert rows[0]["ttft_p99"] == 0.25 and rows[0]["x.staging_pool_size_mb"] == 8
    assert rows[0]["failures"] == '{"x": 1}' and rows[0]["tpot_p99"] is None
    assert axis_names(rows) == ["staging_pool_size_mb"]


def test_a_torn_last_row_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "r.csv"
    with ResultsFile(path, ["staging_pool_size_mb"]) as f:
        f.append(_row("a"))
        f.append(_row("b"))
    text = path.read_text()
    path.write_text(text[: len(text) - 20])  # killed while writing row b
    with ResultsFile(path, ["staging_pool_size_mb"]) as f:
        assert f.done_ids() == {"a"}
        f.append(_row("b"))
    assert [r["point_id"] for r in read_results(path)] == ["a", "b"]


def test_another_sweeps_columns_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.csv"
    ResultsFile(path, ["staging_pool_size_mb"]).close()
    with pytest.raises(ResultsError, match="other columns"):
        ResultsFile(path, ["chunked_prefill_size"])
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ResultsError, match="not a sweep result file"):
        read_results(tmp_path / "x.csv")


def test_digests_that_look_like_numbers_read_back_as_text(tmp_path: Path) -> None:
    """A point id or sweep fingerprint is 16 hex digits: all digits, or digits around one
    ``e``, would parse as a number, and the point would not be found on resume."""
    path = tmp_path / "r.csv"
    ids = ["1234567890123456", "12e4567890123456", "00000000000000ab"]
    with ResultsFile(path, []) as results:
        for pid in ids:
            results.append({"point_id": pid, "sweep": "9e99000000000000", "outcome": "clean"})
    with ResultsFile(path, []) as results:
        assert sorted(results.done_ids()) == sorted(ids)
        assert {r["sweep"] for r in results.rows} == {"9e99000000000000"}
    assert [r["point_id"] for r in read_results(path)] == ids
