"""The MQAR grid (`experiments.grid`): several cells in one program train as the trainer's step trains each alone;
cells are identified by their whole protocol, skipped when done, and merged into one report."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import grid, mqar_oracle
from osdn_jax.train import get_config, optim

TINY = grid.Protocol(steps=6, batch_size=4, vocab_size=64, size="tiny", train_examples=32, test_examples=8,
                     implementation="xla", eval_every=3)


def test_make_at_is_make_at_that_learning_rate():
  """AdamW at a learning rate given apart (traced, per cell) updates as `make` at that rate, step after step."""
  opt = get_config("mqar").optimizer
  opt.lr, opt.warmup_steps = 3e-3, 2
  params = {"kernel": jnp.arange(6.0).reshape(2, 3), "scale": jnp.ones(3)}
  a, b = optim.make(opt, 10), optim.make_at(opt, 10, jnp.float32(3e-3))
  pa, pb, sa, sb = params, params, a.init(params), b.init(params)
  for i in range(4):
    g = jax.tree.map(lambda x: jnp.sin(x + i), params)
    ua, sa = a.update(g, sa, pa)
    ub, sb = b.update(g, sb, pb)
    pa, pb = optax.apply_updates(pa, ua), optax.apply_updates(pb, ub)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-9), pa, pb)


@pytest.mark.slow
def test_cells_side_by_side_train_as_alone(tmp_path):
  """Two learning rates in one program give what each gives in a program of its own (the cell axis is a vmap)."""
  cells = grid.cells_of(["dn"], [(16, 2)], [3e-3, 1e-2], [0])
  both = grid.Group(TINY, cells).run(log=lambda *_: None)
  alone = grid.Group(TINY, cells[1:]).run(log=lambda *_: None)
  for key in ("loss", "accuracy"):
    np.testing.assert_allclose([p[key] for p in both[1]["curve"]], [p[key] for p in alone[0]["curve"]],
                               rtol=2e-5)
  assert both[0]["curve"][0]["loss"] != both[1]["curve"][0]["loss"]


@pytest.mark.parametrize("reads", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_the_grid_step_is_the_oracle_loops_step(reads):
  """On the same rows in the same order and with one optimiser, the grid's vmapped trainer step and the oracle's
  plain loop lose the same, step after step: the trainer's path computes what a plain loop computes. With each
  optimiser (the oracle's AdamW, the trainer's config), and the two optimisers do differ; rows read once or
  with the kv block read twice."""
  protocol = dataclasses.replace(TINY, steps=20, eval_every=20, batch_size=8, train_examples=64, reads=reads)
  runs = {name: mqar_oracle.follow(protocol, grid.Cell("dn", 16, 2, 1e-2, 0), 10, name)
          for name in ("oracle", "trainer")}
  for run in runs.values():
    assert run["max_rel_diff"]["10"] < 1e-4, run
    assert run["grid"][0] != run["grid"][-1]
  assert abs(runs["oracle"]["grid"][-1] - runs["trainer"]["grid"][-1]) > 1e-4


def test_the_oracles_orders_and_their_recurrence():
  """The oracle's own samplers: "epoch" draws every row once per epoch, "replacement" independently; `recurrence`
  counts how often a drawn row was drawn within the w steps before, and the ages fall in their buckets."""
  epoch = mqar_oracle.draw("epoch", 0, rows=12, steps=9, batch=4)
  for e in range(3):
    assert sorted(epoch[3 * e:3 * e + 3].ravel()) == list(range(12))
  stats = mqar_oracle.recurrence(np.array([[0, 1], [2, 0], [1, 1], [3, 4]]), windows=(1, 2))
  # The draws' ages (steps since the row's last draw, 0: first): 0 0 | 0 1 | 2 2 | 0 0.
  assert stats["within_w"] == {"1": 1 / 8, "2": 3 / 8}
  assert stats["duplicate_in_batch"] == 1 / 8 and stats["draws_per_row"] == (1, 1.0, 3)
  drawn = mqar_oracle.recurrence(mqar_oracle.draw("replacement", 0, 2000, 300, 16), windows=(10,))
  by_epoch = mqar_oracle.recurrence(mqar_oracle.draw("epoch", 0, 2000, 300, 16), windows=(10,))
  assert drawn["within_w"]["10"] > 10 * by_epoch["within_w"]["10"]
  assert [mqar_oracle.age_bucket(a) for a in (0, 1, 10, 11, 100, 101, 1000, 1001)] == [0, 1, 1, 2, 2, 3, 3, 4]
  with pytest.raises(ValueError, match="order"):
    mqar_oracle.draw("sorted", 0, 10, 2, 2)


def test_the_oracle_refuses_an_unknown_optimiser():
  with pytest.raises(ValueError, match="`optimizer`"):
    mqar_oracle.train(steps=1, optimizer="adam")


@pytest.mark.slow
def test_the_oracles_optimisers():
  """The oracle trains with its own AdamW or the grid's (`trainer_optimizer`, the one `follow` checks against the
  grid's step above), and the two differ."""
  short = dict(length=16, kv=2, lr=1e-2, steps=4, batch_size=4, vocab_size=64, size="tiny", train_examples=16,
               test_examples=8, implementation="xla", evals=1, log=lambda *_: None)
  runs = [mqar_oracle.train(optimizer=name, **short) for name in ("oracle", "trainer")]
  assert runs[0]["curve"][-1][1] != runs[1]["curve"][-1][1]


@pytest.mark.slow
def test_cells_run_the_unpacked_kernels():
  """A cell's rows are single sequences: its step runs the unpacked solves, which the Pallas kernels serve (the
  packed path with traced segment ids refuses `implementation="pallas"` without a static segment count)."""
  protocol = dataclasses.replace(TINY, steps=2, eval_every=2, implementation="pallas")
  result = grid.Group(protocol, grid.cells_of(["dn"], [(16, 2)], [3e-3], [0])).run(log=lambda *_: None)
  assert np.isfinite(result[0]["final_loss"])


def test_epoch_order_visits_every_row_once_per_epoch():
  order = grid.epoch_order(3, rows=10, steps=7, batch=3)    # 3 batches per epoch, row 10 % 3 dropped each epoch
  for epoch in range(2):
    rows = order[3 * epoch:3 * epoch + 3].ravel()
    assert len(set(rows)) == 9 and set(rows) <= set(range(10))
  assert not np.array_equal(order[:3], order[3:6])


def test_replacement_order_draws_each_row_independently():
  """Rows drawn with replacement cover [0, rows), recur at short distances and inside a batch, and are drawn about
  equally often; the epoch order never repeats a row within an epoch."""
  order = grid.replacement_order(3, rows=50, steps=400, batch=8)
  assert order.shape == (400, 8) and order.dtype == np.int32
  assert order.min() == 0 and order.max() == 49
  counts = np.bincount(order.ravel(), minlength=50)
  assert counts.min() > 30 and counts.max() < 100     # 64 draws per row on average
  assert any(len(set(batch)) < 8 for batch in order)
  np.testing.assert_array_equal(order, grid.row_order("replacement", 3, 50, 400, 8))
  np.testing.assert_array_equal(grid.epoch_order(3, 50, 400, 8), grid.row_order("epoch", 3, 50, 400, 8))
  with pytest.raises(ValueError, match="order"):
    grid.row_order("shuffled", 3, 50, 400, 8)
  with pytest.raises(ValueError, match="order"):
    grid.Protocol(order="shuffled")


def test_the_order_is_part_of_a_cells_identity_and_epoch_cells_keep_their_names(tmp_path):
  """A cell file whose protocol has no `order` is an epoch-order cell under its own name (the committed cells' names
  are recomputed from their contents), and a cell trained with replacement is another cell."""
  committed = [p for p in sorted(pathlib.Path(__file__).parents[2].joinpath("docs/results/mqar").glob("*.json"))
               if "order" not in json.loads(p.read_text()).get("protocol", {"order": None})]
  assert len(committed) >= 5
  for path in committed[:5]:
    saved = json.loads(path.read_text())
    protocol = grid.Protocol(**{"order": "epoch", **saved["protocol"]})
    assert grid.Cell(**saved["cell"]).name(protocol) == path.stem
    shutil.copy(path, tmp_path / path.name)
    assert grid.done(tmp_path, protocol, grid.Cell(**saved["cell"]))
    drawn = dataclasses.replace(protocol, order="replacement")
    assert grid.Cell(**saved["cell"]).name(drawn) != path.stem
    assert not grid.done(tmp_path, drawn, grid.Cell(**saved["cell"]))
  assert {r["protocol"]["order"] for r in grid.read_cells(tmp_path)} == {"epoch"}


def test_sweep_skips_done_cells_and_a_changed_protocol_retrains(tmp_path):
  cells = grid.cells_of(["dn"], [(16, 2)], [3e-3], [0])
  logs = []
  first = grid.sweep(TINY, cells, tmp_path, log=logs.append)
  assert len(first) == 1 and grid.done(tmp_path, TINY, cells[0])
  assert grid.sweep(TINY, cells, tmp_path, log=logs.append) == []
  longer = dataclasses.replace(TINY, steps=9)
  assert not grid.done(tmp_path, longer, cells[0])
  saved = json.loads(first[0].read_text())
  assert saved["cell"] == dataclasses.asdict(cells[0]) and saved["protocol"]["steps"] == 6
  assert [p["step"] for p in saved["curve"]] == [3, 6]


def test_report_takes_the_best_learning_rate_by_its_seeds_mean(tmp_path):
  def cell(lr, seed, acc):
    c = grid.Cell("dn", 1024, 32, lr, seed)
    (tmp_path / f"{c.name(TINY)}.json").write_text(json.dumps(
        dict(cell=dataclasses.asdict(c), protocol=dataclasses.asdict(TINY), accuracy=acc, final_loss=1.0,
             curve=[dict(step=3, loss=2.0, accuracy=acc / 2), dict(step=6, loss=1.0, accuracy=acc)])))
  cell(1e-3, 0, 0.9), cell(1e-3, 1, 0.1), cell(3e-3, 0, 0.6), cell(3e-3, 1, 0.5)
  text = grid.report(tmp_path)
  assert "| dn | 55.0 (60.0 / 50.0) | – | – | – | 0.001, 0.003 |" in text
  assert "| dn (paper) | 99 | 99 | 85 | 46 |" in text
  assert (tmp_path / "grid.png").read_bytes()[:4] == b"\x89PNG"
  assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_report_sets_each_protocol_apart_rows_drawn_with_replacement_first(tmp_path):
  """Cells of two protocols are never mixed: each protocol has its own tables under a heading that says its order,
  and the one drawing rows with replacement comes first even when the other has more cells."""
  drawn, by_epoch = dataclasses.replace(TINY, order="replacement"), dataclasses.replace(TINY, order="epoch")
  for protocol, seeds, acc in ((drawn, [0], 0.9), (by_epoch, [0, 1], 0.1)):
    for seed in seeds:
      c = grid.Cell("dn", 1024, 64, 3e-3, seed)
      (tmp_path / f"{c.name(protocol)}.json").write_text(json.dumps(
          dict(cell=dataclasses.asdict(c), protocol=dataclasses.asdict(protocol), accuracy=acc, final_loss=1.0,
               curve=[dict(step=6, loss=1.0, accuracy=acc)])))
  text = grid.report(tmp_path)
  first, second = text.index("drawn with replacement"), text.index("in epoch order")
  assert first < text.index("| dn | – | 90.0 | – | – | 0.003 |") < second < text.index("| dn | – | 10.0 (10.0 / 10.0)")


def test_read_twice_cells_train_and_report_their_gain(tmp_path):
  """reads = 2: the rows hold the kv block twice (L + 2·kv tokens), and the report sets each cell read twice beside
  the same cell read once."""
  twice = dataclasses.replace(TINY, steps=2, eval_every=2, reads=2)
  cells = grid.cells_of(["dn"], [(16, 2)], [3e-3], [0])
  group = grid.Group(twice, cells)
  assert group.data[0][0][0].shape == (TINY.train_examples, 16 + 2 * 2)
  assert np.isfinite(group.run(log=lambda *_: None)[0]["final_loss"])
  assert cells[0].name(twice).startswith("dn_L16_kv2_lr0.003_reads2_s0_")
  for protocol, acc in ((TINY, 0.4), (dataclasses.replace(TINY, reads=2), 0.7)):
    c = grid.Cell("dn", 1024, 32, 1e-3, 0)
    (tmp_path / f"{c.name(protocol)}.json").write_text(json.dumps(
        dict(cell=dataclasses.asdict(c), protocol=dataclasses.asdict(protocol), accuracy=acc, final_loss=1.0,
             curve=[dict(step=6, loss=1.0, accuracy=acc)])))
  text = grid.report(tmp_path)
  assert "| dn | 40.0 | – | – | – | 0.001 |" in text
  assert "| dn | 1024 | 32 | 40.0 | 70.0 | +30.0 |" in text


def test_a_stopped_group_resumes_from_its_last_curve_point(tmp_path):
  """The group's state saved at a curve point is resumed by the next run: its curve equals an uninterrupted one."""
  cells = grid.cells_of(["dn"], [(16, 2)], [1e-2], [0])
  whole = grid.Group(TINY, cells).run(log=lambda *_: None)

  def stop(message):
    if "step 3" in message:
      raise KeyboardInterrupt
  prefix = tmp_path / "partial" / "group"
  with pytest.raises(KeyboardInterrupt):
    grid.Group(TINY, cells).run(log=stop, partial=prefix)
  logs = []
  resumed = grid.Group(TINY, cells).run(log=logs.append, partial=prefix)
  assert "  resumed at step 3" in logs
  # The rate leaves out each run's first chunk (it compiles); chunks of 1 step here: 5 of 6 steps for the whole run,
  # 2 of the resumed run's 3.
  assert whole[0]["timed_steps"] == 5 and resumed[0]["timed_steps"] == 2
  np.testing.assert_allclose([p["loss"] for p in resumed[0]["curve"][1:]], [p["loss"] for p in whole[0]["curve"][1:]],
                             rtol=1e-5)
  assert not list((tmp_path / "partial").iterdir())


def test_a_sweep_killed_while_ending_a_group_keeps_its_cells_and_clears_the_rest(tmp_path, monkeypatch):
  """The group's state is removed only after its cells are written: a sweep stopped in between leaves both, and the
  next sweep trains nothing and deletes that state, and what a removal stopped midway had renamed."""
  cells = grid.cells_of(["dn"], [(16, 2)], [1e-2], [0])
  removed = grid._remove_saved

  def stopped(directory):
    raise KeyboardInterrupt
  monkeypatch.setattr(grid, "_remove_saved", stopped)
  with pytest.raises(KeyboardInterrupt):
    grid.sweep(TINY, cells, tmp_path, log=lambda *_: None)
  monkeypatch.setattr(grid, "_remove_saved", removed)
  assert grid.done(tmp_path, TINY, cells[0])
  (group,) = [d for d in (tmp_path / "partial").iterdir() if d.is_dir()]
  assert [d.name for d in group.iterdir()] == ["3"]            # saved at step 3 of 6
  (tmp_path / "partial" / f"{group.name}-2{grid.REMOVING}").mkdir()
  logs = []
  assert grid.sweep(TINY, cells, tmp_path, log=logs.append) == []
  assert "1 of 1 cells done; 0 to train" in logs
  assert not list((tmp_path / "partial").iterdir())


@pytest.mark.slow     # `make test`: the sweep in process (skips, resumes, damaged files) and `--smoke`'s flags
def test_cli_smoke_trains_skips_and_reports(tmp_path):
  """`python -m experiments.grid --smoke` writes a JSON per cell and grid.md; run again, it trains nothing."""
  import os
  import pathlib
  import subprocess
  import sys
  root = pathlib.Path(__file__).resolve().parents[2]
  run = lambda: subprocess.run([sys.executable, "-m", "experiments.grid", "--smoke", f"--out={tmp_path}"], cwd=root,
                               env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600)
  first = run()
  assert first.returncode == 0, first.stderr[-3000:]
  assert len(list(tmp_path.glob("dn_L32_kv4_*.json"))) == 2
  assert "| dn |" in (tmp_path / "grid.md").read_text()
  second = run()
  assert "2 of 2 cells done; 0 to train" in second.stdout


def test_a_damaged_cell_file_is_named_set_aside_and_retrained(tmp_path):
  """A truncated cell file does not stop a sweep or a report: it is named in a warning, moved aside (kept, not
  deleted) and its cell trained again."""
  cells = grid.cells_of(["dn"], [(16, 2)], [3e-3], [0])
  path = grid.sweep(TINY, cells, tmp_path, log=lambda *_: None)[0]
  path.write_text(path.read_text()[:40])
  logs = []
  assert grid.report(tmp_path, log=logs.append) == "no cells in " + str(tmp_path) + "\n"
  assert any(str(path) in line for line in logs)
  assert not path.exists() and len(list(tmp_path.glob(path.name + ".damaged*"))) == 1
  assert grid.sweep(TINY, cells, tmp_path, log=logs.append) == [path]
  assert grid.done(tmp_path, TINY, cells[0])


@pytest.mark.parametrize("damage", ["bytes", pytest.param("truncated", marks=pytest.mark.slow)])
def test_a_damaged_partial_state_restarts_its_group_with_a_warning(tmp_path, damage):
  cells = grid.cells_of(["dn"], [(16, 2)], [1e-2], [0])
  whole = grid.Group(TINY, cells).run(log=lambda *_: None)
  prefix = tmp_path / "partial" / "group"

  def stop(message):
    if "step 3" in message:
      raise KeyboardInterrupt
  with pytest.raises(KeyboardInterrupt):
    grid.Group(TINY, cells).run(log=stop, partial=prefix)
  (step,) = [d for d in prefix.iterdir() if d.name.isdigit()]       # the trainer's checkpoint of step 3
  arrays = max((f for f in step.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
  data = arrays.read_bytes()
  arrays.write_bytes(data[:100] + np.random.default_rng(0).bytes(64) if damage == "bytes" else data[:len(data) // 2])
  logs = []
  again = grid.Group(TINY, cells).run(log=logs.append, partial=prefix)
  assert any("damaged" in line and str(prefix) in line for line in logs), logs
  assert len(list(prefix.glob("3.damaged-*"))) == 1              # kept, beside nothing else once the group ends
  assert [p["loss"] for p in again[0]["curve"]] == [p["loss"] for p in whole[0]["curve"]]


def test_smoke_runs_write_outside_the_committed_results(tmp_path, monkeypatch):
  """`--smoke` without `--out` writes to a new temporary directory, never into docs/results/mqar."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / "docs/results/mqar").mkdir(parents=True)
  out = grid.smoke_out("docs/results/mqar", explicit=False)
  assert pathlib.Path(out).resolve() != (tmp_path / "docs/results/mqar").resolve()
  assert grid.smoke_out("/somewhere/else", explicit=True) == "/somewhere/else"
