"""The README's "Use" snippet runs as pasted (in a fresh interpreter: it registers an axis value and a point)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def use_snippet() -> str:
  text = README.read_text()
  start = text.index("```python\n", text.index("\n## Use\n")) + len("```python\n")
  return text[start:text.index("```\n", start)]


@pytest.mark.slow     # a subprocess that imports and compiles afresh: the slow step
def test_the_use_snippet_runs_as_pasted(tmp_path):
  script = tmp_path / "use.py"
  script.write_text(use_snippet())
  done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.startswith("True\n") and "pgdn-340m" in done.stdout
