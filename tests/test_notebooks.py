"""The notebooks in ``notebooks/`` are stored with their outputs (a reader sees the tables and
plots the prose talks about) and re-executed here (kernel ``python3``, cwd the notebook folder);
a cell that raises fails the test.

Each notebook reads its input from an environment variable in its first code cell (tagged
``parameters``). Notebook 03 needs a Mooncake trace: the public one beside the repository
(``shared/traces/mooncake/synthetic_trace.jsonl``) when present, else a small trace in the same
format generated here and passed as ``TWIN_NB_TRACE``. Without any trace it stops with an error,
never silently.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
DEFAULT_TRACE = Path("shared") / "traces" / "mooncake" / "synthetic_trace.jsonl"


def test_there_are_notebooks() -> None:
    assert [p.name for p in NOTEBOOKS] >= ["01_ring_sizing.ipynb", "02_warmup_stall.ipynb",
                                           "03_production_trace.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_with_outputs(path: Path) -> None:
    book = nbformat.read(path, as_version=4)
    code = [c for c in book.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), path.name
    kinds = {o.output_type for c in code for o in c.outputs}
    assert "stream" in kinds and "display_data" in kinds, (path.name, kinds)
    assert not any(o.output_type == "error" for c in code for o in c.outputs)
    assert "parameters" in code[0].metadata.get("tags", []), path.name
    assert book.cells[-1].cell_type == "markdown", f"{path.name} ends without a conclusion"


def _sample_mooncake(path: Path, n: int = 120) -> None:
    rng = random.Random(11)
    with path.open("w") as f:
        for i in range(n):
            tokens = int(min(60000, rng.lognormvariate(8.5, 1.0))) + 64
            blocks = list(range(i * 200, i * 200 + (tokens + 511) // 512))
            f.write(json.dumps({"timestamp": i * 250, "input_length": tokens,
                                "output_length": 8, "hash_ids": blocks}) + "\n")


def _has_default_trace(folder: Path) -> bool:
    return any((base / DEFAULT_TRACE).is_file() for base in [folder, *folder.parents])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if path.stem.startswith("03") and not _has_default_trace(path.parent):
        sample = tmp_path / "sample_mooncake.jsonl"
        _sample_mooncake(sample)
        monkeypatch.setenv("TWIN_NB_TRACE", str(sample))
    book = nbformat.read(path, as_version=4)
    client = NotebookClient(book, timeout=180, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError when a cell raises
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert errors == []
    printed = "".join(o.get("text", "") for c in book.cells if c.cell_type == "code"
                      for o in c.outputs if o.output_type == "stream")
    assert printed.strip(), f"{path.name} printed nothing"


def test_production_trace_notebook_stops_loudly_without_a_trace(tmp_path: Path,
                                                                monkeypatch) -> None:
    path = next(p for p in NOTEBOOKS if p.stem.startswith("03"))
    book = nbformat.read(path, as_version=4)
    book.cells = [c for c in book.cells if c.cell_type == "code"][:1]  # the parameters cell
    monkeypatch.setenv("TWIN_NB_TRACE", str(tmp_path / "missing.jsonl"))
    client = NotebookClient(book, timeout=60, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    with pytest.raises(CellExecutionError, match="no such file"):
        client.execute()
    source = book.cells[0].source
    assert "raise FileNotFoundError" in source and "set TWIN_NB_TRACE" in source
