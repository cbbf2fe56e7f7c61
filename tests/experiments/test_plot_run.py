"""experiments/plot_run.py on synthetic metrics.jsonl files (no training): reading (NaN values, a step logged
twice, per-layer lists), the PNG written for one run and for several overlaid, the command line's default
output, and the errors for a missing or empty metrics file."""
import json
import math
import os
import re
import subprocess
import sys

import pytest
from matplotlib import image

from experiments import plot_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _row(step, *, layers=0, **overrides):
  row = {"step": step, "loss": 5.0 / step, "grad_norm": 1.0 + 1.0 / step, "lr": 1e-3 * min(1.0, step / 4),
         "tokens_per_s": 100.0 if step == 1 else 5000.0 + step, "step_time_s": 0.1, "peak_memory_gb": 1.5}
  if layers:
    row["q_geo"] = [0.9 - 0.1 * i for i in range(layers)]
    row["state_norm"] = [1.0 + 0.01 * step * (i + 1) for i in range(layers)]
  row.update(overrides)
  return row


def _write_run(path, rows):
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for row in rows:
      f.write(json.dumps(row, allow_nan=True) + "\n")
  return str(path)


def _diagnosed_run(path):
  """Steps 1..12, step 5 logged twice (the second line wins), a NaN loss and a NaN q_geo, diagnostics every 4."""
  rows = [_row(s, layers=3 if s % 4 == 0 else 0) for s in range(1, 13)]
  rows[8]["loss"] = float("nan")
  rows[7]["q_geo"][1] = float("nan")
  rows.insert(6, _row(5, loss=123.0))
  return _write_run(path, rows)


def _check_png(path):
  with open(path, "rb") as f:
    head = f.read(8)
  assert head == PNG_SIGNATURE
  assert os.path.getsize(path) > 1000
  pixels = image.imread(path)
  assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100 and pixels.shape[2] in (3, 4)
  return pixels.shape


def test_read_metrics_keeps_the_last_line_of_a_step_in_step_order(tmp_path):
  run = _diagnosed_run(tmp_path / "run")
  rows = plot_run.read_metrics(run)
  assert [r["step"] for r in rows] == list(range(1, 13))
  assert rows[4]["loss"] == 123.0
  assert math.isnan(rows[8]["loss"])
  assert math.isnan(rows[7]["q_geo"][1]) and len(rows[7]["state_norm"]) == 3
  assert "q_geo" not in rows[0]


def test_one_run_with_diagnostics(tmp_path):
  run = _diagnosed_run(tmp_path / "run")
  out = plot_run.plot([run], str(tmp_path / "run.png"))
  assert out == str(tmp_path / "run.png")
  with_diagnostics = _check_png(out)
  plain = _check_png(plot_run.plot([_write_run(tmp_path / "plain", [_row(s) for s in range(1, 6)])],
                                   str(tmp_path / "plain.png")))
  assert with_diagnostics[0] > plain[0]   # a third row of panels: q_geo and ‖S‖


def test_several_runs_overlay_into_one_file(tmp_path):
  runs = [_diagnosed_run(tmp_path / "a"), _write_run(tmp_path / "b", [_row(s) for s in range(1, 20)]),
          _write_run(tmp_path / "x" / "a", [_row(s, layers=2) for s in range(2, 9, 2)])]   # a second "a"
  names = plot_run._names(runs)   # the run's directory name, with as much of its path as tells runs apart
  assert names[1] == "b" and names[2] == "x/a" and names[0].endswith("/a") and names[0] != names[2]
  out = tmp_path / "figures" / "cmp.png"
  assert plot_run.plot(runs, str(out)) == str(out)
  _check_png(out)
  assert sorted(os.listdir(tmp_path / "figures")) == ["cmp.png"]


def test_a_missing_or_empty_metrics_file_raises_naming_it(tmp_path):
  missing = tmp_path / "nothing"
  with pytest.raises(FileNotFoundError, match=re.escape(str(missing / "metrics.jsonl"))):
    plot_run.read_metrics(str(missing))
  with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
    plot_run.plot([_diagnosed_run(tmp_path / "ok"), str(missing)], str(tmp_path / "out.png"))
  assert not (tmp_path / "out.png").exists()
  empty = tmp_path / "empty"
  empty.mkdir()
  (empty / "metrics.jsonl").write_text("\n")
  with pytest.raises(ValueError, match=re.escape(str(empty / "metrics.jsonl"))):
    plot_run.read_metrics(str(empty))
  (empty / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"loss": 1.0}\n')
  with pytest.raises(ValueError, match="line 2"):
    plot_run.read_metrics(str(empty))


def test_command_line(tmp_path):
  run = _diagnosed_run(tmp_path / "run")
  cmd = [sys.executable, "-m", "experiments.plot_run"]
  done = subprocess.run(cmd + [run], cwd=ROOT, capture_output=True, text=True)
  assert done.returncode == 0, done.stderr
  assert done.stdout.strip() == os.path.join(run, "run.png")
  _check_png(os.path.join(run, "run.png"))
  other = _write_run(tmp_path / "other", [_row(s) for s in range(1, 4)])
  refused = subprocess.run(cmd + [run, other], cwd=ROOT, capture_output=True, text=True)
  assert refused.returncode != 0 and "--out" in refused.stderr
