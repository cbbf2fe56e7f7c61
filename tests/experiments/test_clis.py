"""The experiments: every CLI runs end to end at its smoke size and writes its JSON, table and plot; the shared
pieces (variant names, the reproducing command, the best-over-learning-rates choice, merging parallel parts) do
what they say; a registered point joins by name."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from experiments import common, lm, mqar, passkey
from osdn_jax import dgps, testing

ROOT = pathlib.Path(__file__).resolve().parents[2]


needs_corpus = testing.needs_corpus()


@pytest.fixture(scope="session")
def compilation_cache(tmp_path_factory):
  """One persistent compilation cache for every smoke run of the session (they train the same small model)."""
  return str(tmp_path_factory.getbasetemp().parent / "experiments-xla-cache")


def _run(module: str, out: pathlib.Path, cache: str, *args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu", OSDN_PROGRESS="0", OSDN_COMPILATION_CACHE=cache)
  done = subprocess.run([sys.executable, "-m", f"experiments.{module}", f"--out={out}", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return done


@pytest.mark.parametrize("name", [pytest.param("mqar", marks=pytest.mark.slow), "demo",
                                  pytest.param("recall", marks=pytest.mark.slow),
                                  pytest.param("passkey", marks=pytest.mark.slow),
                                  pytest.param("lm", marks=[needs_corpus, pytest.mark.slow]),
                                  pytest.param("contraction", marks=[needs_corpus, pytest.mark.slow]),
                                  pytest.param("clip", marks=[needs_corpus, pytest.mark.slow])])
def test_cli_smoke(name, tmp_path, compilation_cache):
  """`python -m experiments.NAME --smoke` writes NAME.json (with the command that reruns it), NAME.md (a table
  with a row per variant) and a PNG."""
  done = _run(name, tmp_path, compilation_cache, "--smoke")
  payload = json.loads((tmp_path / f"{name}.json").read_text())
  assert payload["command"].startswith(f"python -m experiments.{name}")
  assert {"device", "jax", "date"} <= set(payload)
  table = (tmp_path / f"{name}.md").read_text()
  first = {"clip": "osdn-apf"}.get(name, "dn")      # clip measures OSDN points only
  assert table.startswith("| variant") and f"\n| {first} |" in table
  assert table in done.stdout
  png = (tmp_path / f"{name}.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
  if name == "clip":      # per layer, per head fractions, chunk counts at every C
    layer = payload["rows"][0]["layers"][0]
    assert set(layer["chunks"]) == {"16", "64", "128"} and len(layer["entries"]) == 2
    assert all(0.0 <= x <= 1.0 for key in ("below", "above", "tokens", "d_at_min") for x in layer[key])


def test_mqar_merge_reports_parts_together(tmp_path, compilation_cache):
  """Two parts of a sweep (one variant each) merged: one table with both variants, the parts' device kept, and
  the command of the whole sweep; nothing is trained again (no runs/ directory appears)."""
  parts = []
  for i, variant in enumerate(("dn", "pdn")):
    part = tmp_path / f"part{i}"
    part.mkdir()
    sweep = mqar.Sweep(**dict(mqar.SMOKE, variants=(variant,)))
    runs = [dict(variant=variant, length=32, kv=4, train_kv=4, lr=3e-3, reads=1, final_loss=4.0 - i,
                 steps=4, batch_size=4, accuracy=0.25 * (i + 1), q_geo=[0.5, 0.25], recall_residual=[0.9, 0.8],
                 state_norm=[1.0, 2.0])]
    common.write_results(part, "mqar", {"sweep": dataclasses.asdict(sweep), "runs": runs}, "",
                         provenance=dict(device="NVIDIA H200", jax="0.11.2", date="2026-12-02"))
    parts.append(str(part / "mqar.json"))
  out = tmp_path / "merged"
  _run("mqar", out, compilation_cache, "--merge=" + ",".join(parts))
  payload = json.loads((out / "mqar.json").read_text())
  assert payload["device"] == "NVIDIA H200" and payload["date"] == "2026-12-02"
  assert "--config.variants=dn,pdn" in payload["command"] and "--merge" not in payload["command"]
  table = (out / "mqar.md").read_text()
  assert "\n| dn | 25.0 |" in table and "\n| pdn | 50.0 |" in table
  assert not (out / "runs").exists()


def test_clip_takes_only_osdn_points():
  from experiments import clip
  assert set(clip.VARIANTS) == {"osdn", "osdn-gdn", "osdn-kda", "osdn-apf", "osdn-apf-gdn", "osdn-apf-kda"}
  clip.check_variant("osdn-apf:apf_anchor=init")
  with pytest.raises(ValueError, match="no OSDN d-pass"):
    clip.check_variant("pdn")


def test_parse_variant():
  assert common.parse_variant("pdn") == ("pdn", {})
  assert common.parse_variant("OSDN-APF:apf_anchor=init") == ("osdn-apf", {"apf_anchor": "init"})
  assert common.parse_variant("pdn:x=4.0") == ("pdn", {"x": 4.0})
  with pytest.raises(ValueError, match="unknown point"):
    common.parse_variant("nope")
  with pytest.raises(ValueError, match="unknown options"):
    common.parse_variant("dn:x=2")
  with pytest.raises(ValueError, match="option=value"):
    common.parse_variant("pdn:x")


def test_variant_config_sets_model_and_options():
  from osdn_jax.train import get_config, validate
  c = common.variant_config(get_config("mqar"), "osdn-apf:apf_anchor=init", "tiny")
  assert c.model == "osdn-apf-tiny" and dict(c.point_options) == {"apf_anchor": "init"}
  validate(c)


def test_command_lists_the_settings_that_differ():
  sweep = mqar.Sweep(variants=("dn", "pdn"), lengths=(1024,), steps=10)
  assert common.command("mqar", sweep) == ("python -m experiments.mqar --config.variants=dn,pdn --config.lengths=1024 "
                                          "--config.steps=10")
  assert common.command("mqar", mqar.Sweep()) == "python -m experiments.mqar"


def test_best_over_lrs_takes_the_highest_accuracy_then_the_lower_loss():
  runs = [dict(variant="dn", length=64, kv=4, lr=lr, accuracy=a, final_loss=l)
          for lr, a, l in ((1e-3, 0.5, 1.0), (3e-3, 0.7, 2.0), (1e-2, 0.7, 1.5))]
  assert mqar.best_over_lrs(runs)[("dn", 64, 4)]["lr"] == 1e-2


def test_sweep_runs_and_cells():
  per_cell = mqar.Sweep(variants=("dn",), lengths=(32, 64), kv=(4, 16), lrs=(1e-3, 3e-3))
  assert per_cell.cells() == [(32, 4), (64, 4), (64, 16)]          # 4·kv ≤ L
  assert len(per_cell.runs()) == 3 * 2
  one_model = mqar.Sweep(variants=("dn",), lengths=(64,), kv=(4, 8, 16), train_kv=16, lrs=(1e-3,))
  assert one_model.runs() == [("dn", 64, 16, 1e-3, (4, 8, 16))]
  c = one_model.config("pdn", 64, 16, 1e-3)
  assert (c.seq_len, c.loss_positions, c.data.mqar_pairs, c.model) == (64, 16, 16, "pdn-mqar")
  twice = mqar.Sweep(variants=("dn",), lengths=(64,), kv=(8,), reads=2)
  assert twice.config("dn", 64, 8, 1e-3).seq_len == 64 + 16


def test_registered_point_joins_experiments_by_name():
  point = dgps.compose(decay="scalar", precond="osdn-apf", apf_anchor="init", name="test-osdn-apf-gdn-init")
  try:
    dgps.register(point)
    assert common.parse_variant("test-osdn-apf-gdn-init") == ("test-osdn-apf-gdn-init", {})
    with pytest.raises(ValueError, match="already registered"):
      dgps.register(point)
    with pytest.raises(ValueError, match="already registered"):
      dgps.register(dgps.compose(name="dn"), replace=True)    # built-in points stay
    c = common.variant_config(mqar.Sweep().config("dn", 64, 4, 1e-3), "test-osdn-apf-gdn-init", "tiny")
    from osdn_jax.train.configs import validate
    validate(c)
  finally:
    dgps.POINTS.pop("test-osdn-apf-gdn-init", None)
  with pytest.raises(ValueError, match="name"):
    dgps.register(dgps.compose(name="has space"))


def test_a_run_is_reused_only_by_the_same_config(tmp_path):
  """The experiments' work directory names the whole trainer config: another step count, dtype, seed or data
  setting trains anew instead of resuming a finished run of the same variant and cell."""
  base = mqar.Sweep(**mqar.SMOKE).config("dn", 32, 4, 3e-3)
  same = mqar.Sweep(**mqar.SMOKE).config("dn", 32, 4, 3e-3)
  assert common.run_dir(base, tmp_path / "run") == common.run_dir(same, tmp_path / "run")
  for field, value in (("steps", 6), ("dtype", "bfloat16"), ("seed", 1), ("batch_size", 8)):
    other = base.copy_and_resolve_references()
    other[field] = value
    assert common.run_dir(other, tmp_path / "run") != common.run_dir(base, tmp_path / "run"), field
  other = base.copy_and_resolve_references()
  other.data.num_records = 32
  assert common.run_dir(other, tmp_path / "run") != common.run_dir(base, tmp_path / "run")


def _lm_row(variant, seed, loss, curve):
  return dict(variant=variant, seed=seed, validation_loss=loss, validation_perplexity=math.exp(loss),
              final_train_loss=curve[-1][1], curve=curve, tokens=3 * 2 * 64)


def test_lm_reports_each_variant_over_its_seeds():
  """Per variant: the mean validation loss over the seeds, the spread (largest − smallest), each seed's loss in seed
  order, the perplexity of the mean, and the training curve's mean and range at the steps every seed logged."""
  spec = lm.LM(**dict(lm.SMOKE, variants=("dn", "pdn"), seeds=(0, 1, 2)))
  rows = [_lm_row("pdn", 2, 1.5, [(1, 3.0), (2, 2.0)]), _lm_row("dn", 1, 2.0, [(1, 4.0), (2, 3.0), (3, 2.5)]),
          _lm_row("dn", 0, 1.0, [(1, 2.0), (2, 1.0)]), _lm_row("dn", 2, 1.5, [(1, 3.0), (2, 2.0)]),
          _lm_row("pdn", 0, 1.25, [(1, 3.0), (2, 2.0)]), _lm_row("pdn", 1, 1.75, [(1, 3.0), (2, 2.0)])]
  dn, pdn = lm.by_variant(rows, spec)
  assert (dn["variant"], dn["seeds"], dn["losses"]) == ("dn", [0, 1, 2], [1.0, 2.0, 1.5])
  assert dn["mean"] == pytest.approx(1.5) and dn["spread"] == pytest.approx(1.0)
  assert dn["perplexity"] == pytest.approx(math.exp(1.5))
  assert dn["steps"] == [1, 2] and dn["curve_mean"] == [3.0, 2.0]
  assert dn["curve_low"] == [2.0, 1.0] and dn["curve_high"] == [4.0, 3.0]
  assert pdn["mean"] == pytest.approx(1.5) and pdn["spread"] == pytest.approx(0.5)
  text = lm.table(rows, spec)
  assert "| dn | 1.5000 | 1.0000 | 1.0000 / 2.0000 / 1.5000 |" in text and "seeds 0, 1, 2" in text


@pytest.mark.slow
def test_lm_merges_a_one_seed_file_with_other_seeds(tmp_path, compilation_cache):
  """A file of one seed (`seed` in its settings, rows without a seed) merged with a part of another seed: one table
  over both seeds, and the command of the whole comparison."""
  old = tmp_path / "old"
  old.mkdir()
  settings = {k: v for k, v in dataclasses.asdict(lm.LM(**lm.SMOKE)).items() if k != "seeds"}
  row = {k: v for k, v in _lm_row("dn", 0, 2.0, [(1, 3.0)]).items() if k != "seed"}
  common.write_results(old, "lm", {"spec": dict(settings, seed=0), "rows": [row]}, "",
                       provenance=dict(device="cpu", jax="0.10.2", date="2026-12-04"))
  new = tmp_path / "new"
  new.mkdir()
  common.write_results(new, "lm", {"spec": dict(settings, seeds=[1]), "rows": [_lm_row("dn", 1, 3.0, [(1, 4.0)])]},
                       "", provenance=dict(device="cpu", jax="0.10.2", date="2026-12-04"))
  for name, parts in (("merged", (old, new)), ("reversed", (new, old))):     # each file's rows keep its own seed
    out = tmp_path / name
    _run("lm", out, compilation_cache, "--merge=" + ",".join(str(p / "lm.json") for p in parts))
    payload = json.loads((out / "lm.json").read_text())
    assert "--config.seeds=0,1" in payload["command"]
    assert "| dn | 2.5000 | 1.0000 | 2.0000 / 3.0000 |" in (out / "lm.md").read_text()


def test_passkey_reports_the_mean_over_seeds_and_each_seeds_score():
  """Per variant and length: the mean over depths and seeds; with several seeds, each seed's overall score."""
  spec = passkey.Passkey(**dict(passkey.SMOKE, variants=("gdn", "pgdn"), lengths=(200,), depths=(0.0, 1.0),
                                seeds=(0, 1)))
  hits = {("gdn", 0): (1.0, 1.0), ("gdn", 1): (0.5, 1.0), ("pgdn", 0): (0.0, 0.0), ("pgdn", 1): (1.0, 0.5)}
  rows = [dict(variant=v, seed=s, length=200, depth=d, exact_match=x, final_loss=0.1)
          for (v, s), xs in hits.items() for d, x in zip((0.0, 1.0), xs)]
  text = passkey.table(rows + [dict(rows[0], variant="pdn", seed=1)], dataclasses.replace(spec, variants=(
      "gdn", "pgdn", "pdn")))
  assert "| gdn | 88 | 88 | 100 / 75 |" in text and "| pgdn | 38 | 38 | 0 / 75 |" in text
  assert "| pdn | 100 | 100 | – / 100 |" in text and "seeds 0, 1" in text     # a variant run at one seed only
