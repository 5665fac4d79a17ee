"""Execute every notebook in ``notebooks/`` (kernel ``python3``, cwd the notebook folder); a
cell that raises fails the test. Notebooks are stored without outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks() -> None:
    assert [p.name for p in NOTEBOOKS] >= ["01_ring_sizing.ipynb", "02_warmup_stall.ipynb",
                                           "03_production_trace.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_without_outputs(path: Path) -> None:
    book = nbformat.read(path, as_version=4)
    for cell in book.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path) -> None:
    book = nbformat.read(path, as_version=4)
    client = NotebookClient(book, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError when a cell raises
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert errors == []
    printed = "".join(o.get("text", "") for c in book.cells if c.cell_type == "code"
                      for o in c.outputs if o.output_type == "stream")
    assert printed.strip(), f"{path.name} printed nothing"
