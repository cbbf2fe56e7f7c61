"""The notebooks of notebooks/: each runs top to bottom in a fresh kernel (CPU, training runs shortened through
OSDN_NOTEBOOK_STEPS) without a cell error, and each is committed without outputs. `make test` checks every
notebook's outputs; the slow step runs the four, whose pieces the quick suite tests on their own (composing and
checking a point: tests/dgps/test_compose.py; the MQAR sweep: tests/experiments/test_clis.py; a user's axis values:
tests/dgps/test_compose.py, tests/test_plugins.py; the trainer's run loaded and decoded:
tests/train/test_trainer.py, tests/models/)."""
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = ("01_compose_a_point.ipynb", "02_train_on_mqar.ipynb", "03_checkpoint_and_decode.ipynb",
            "04_your_own_preconditioner.ipynb")
# Optimiser steps of every training run in a notebook under test (their defaults are a few dozen).
STEPS = "8"


def test_the_notebooks_are_the_expected_ones():
  assert tuple(p.name for p in NOTEBOOKS) == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs(path):
  nb = json.loads(path.read_text())
  assert nb["metadata"]["kernelspec"]["name"] == "python3"
  for i, cell in enumerate(nb["cells"]):
    if cell["cell_type"] == "code":
      assert cell["outputs"] == [], f"{path.name}: code cell {i} has outputs (strip them before committing)"
      assert cell["execution_count"] is None, f"{path.name}: code cell {i} has an execution count"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, monkeypatch):
  nbclient = pytest.importorskip("nbclient")
  nbformat = pytest.importorskip("nbformat")
  # The kernel inherits this process's environment.
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("OSDN_NOTEBOOK_STEPS", STEPS)
  monkeypatch.setenv("OSDN_PROGRESS", "0")
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(ROOT)}})
  client.execute()   # raises CellExecutionError, naming the cell, on any error
