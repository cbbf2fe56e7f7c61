"""The grid-step benchmark (`benchmarks.grid_step`): one tiny group of cells measured on the CPU, its row appended."""
import json

from benchmarks import grid_step


def test_a_tiny_group_is_measured_and_its_row_appended(tmp_path):
  s = grid_step.Settings(length=32, kv=4, chunk=2, reps=1, rows=16, batch_size=4, vocab_size=128, size="tiny",
                         implementation="xla", profile=True)
  row, lines = grid_step.measure(s, "dn", 2)
  assert row["cells"] == 2 and row["variant"] == "dn" and row["ms_per_cell_step"] > 0 and row["compile_s"] > 0
  assert row["device_ms_per_cell_step"] == 0.0 and lines == []       # a CPU trace has no device lines
  path = str(tmp_path / "rows.json")
  grid_step.append(path, row)
  grid_step.append(path, dict(row, cells=3))
  assert [r["cells"] for r in json.load(open(path))] == [2, 3]
