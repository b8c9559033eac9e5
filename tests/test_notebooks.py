"""The notebooks: outputs cleared in git, Colab install cell, and each executes top to bottom."""

from __future__ import annotations

import ast
import os
import time
from pathlib import Path

import nbformat
import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = ["01_quickstart.ipynb", "02_advantage_pipeline.ipynb", "03_evaluate.ipynb"]
TIME_LIMIT_S = 600  # "a few minutes" each on a CPU; generous for a loaded machine


def test_the_three_notebooks_exist():
  assert [p.name for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_outputs_cleared_badge_and_install_cell(path):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.outputs == [] and c.execution_count is None for c in code), "outputs not cleared"
  intro = nb.cells[0].source
  assert "colab-badge.svg" in intro and f"notebooks/{path.name}" in intro
  # The first code cell installs the package only when it is not importable.
  tree = ast.parse(code[0].source)
  (node,) = [n for n in tree.body if isinstance(n, ast.Try)]
  assert ast.unparse(node.body[0]) == "import epgrpo_jax"
  assert [h.type.id for h in node.handlers] == ["ImportError"]
  assert "pip" in ast.unparse(node.handlers[0]) and "pip" not in ast.unparse(node.body)
  for c in code:  # everything is written under runs/ (relative to the working directory)
    assert "/tmp" not in c.source and "~/" not in c.source and "expanduser" not in c.source


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
  """One working directory for the module: 03 reuses the run of 01, all share the task cache."""
  return tmp_path_factory.mktemp("notebooks")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, workdir, monkeypatch):
  from nbclient import NotebookClient

  monkeypatch.setenv("EPGRPO_DATA_DIR", str(workdir / "data"))
  monkeypatch.delenv("XLA_FLAGS", raising=False)  # one CPU device, as a user has
  monkeypatch.setenv("MPLBACKEND", "Agg")
  before = set(os.listdir(workdir))
  nb = nbformat.read(path, as_version=4)
  client = NotebookClient(nb, timeout=TIME_LIMIT_S, kernel_name="python3",
                          resources={"metadata": {"path": str(workdir)}})
  start = time.perf_counter()
  client.execute()
  elapsed = time.perf_counter() - start
  assert elapsed < TIME_LIMIT_S, f"{path.name} took {elapsed:.0f}s"
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]
  assert not errors
  assert set(os.listdir(workdir)) - before <= {"runs", "data"}  # nothing else written
  assert (workdir / "runs" / "notebooks").is_dir()
