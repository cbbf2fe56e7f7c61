"""User code on the command line: `--imports=module` (osdn_jax.plugins) makes a point a module registers train
with the trainer and be measured by an experiment by name; a module that cannot be imported is a one-line flags
error naming it. `--config.point_options.NAME=VALUE` adds an option the config does not hold, which reaches the
model; an unknown option is refused naming it, and an unknown field stays refused."""
import json
import math
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from absl import flags

from osdn_jax import plugins
from osdn_jax.train import configs, loop

REPO = pathlib.Path(__file__).resolve().parents[1]

# The user's module: a point the registry does not have, registered under its own name.
MY_POINTS = textwrap.dedent("""
    from osdn_jax import dgps
    dgps.register(dgps.compose(decay="scalar", precond="pdn", name="my-pgdn"))
""")


def _user_dir(tmp_path) -> pathlib.Path:
  (tmp_path / "my_points.py").write_text(MY_POINTS)
  return tmp_path


def _run(args, cwd) -> subprocess.CompletedProcess:
  """`python -m <args>` in `cwd` (where the user's module is: the current directory), the repository importable."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _parse_config(argv, monkeypatch):
  """The trainer's --config flag parsed from `argv` on a FlagValues of its own (as `python -m osdn_jax.train`
  parses it; ml_collections reads the overrides from sys.argv)."""
  fv = flags.FlagValues()
  holder = configs.define_config_flag(flag_values=fv)
  argv = configs.flag_args(["prog", *argv])
  monkeypatch.setattr(sys, "argv", argv)
  fv(argv)
  return holder.value


# -- the trainer -------------------------------------------------------------------------------------------
@pytest.mark.slow     # `make test`: registration and lookup by the public names in process
def test_trainer_trains_a_point_an_imported_module_registers(tmp_path):
  """--imports=my_points with my_points.py in the current directory: my-pgdn-tiny trains two steps, with a point
  option the config did not hold (`x`), and config.json records both."""
  cwd = _user_dir(tmp_path)
  out = _run(["osdn_jax.train", "--imports=my_points", "--config=tiny", "--config.model=my-pgdn-tiny",
              "--config.point_options.x=3.0", "--config.steps=2", "--config.data.source=random",
              "--config.seq_len=16", "--config.batch_size=2", "--config.optimizer.warmup_steps=1",
              "--config.log_every=1", "--config.checkpoint_every=0", "--config.diagnostics_every=0",
              "--config.progress=false", "--config.async_checkpoint=false", "--workdir=run"], cwd)
  assert out.returncode == 0, out.stderr[-3000:]
  config = json.loads((cwd / "run" / "config.json").read_text())
  assert config["model"] == "my-pgdn-tiny" and config["point_options"] == {"x": 3.0}
  rows = [json.loads(line) for line in (cwd / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)


@pytest.mark.slow
def test_trainer_names_a_module_it_cannot_import(tmp_path):
  out = _run(["osdn_jax.train", "--imports=no_such_points", "--config=tiny", "--workdir=run"], tmp_path)
  assert out.returncode != 0
  lines = [line for line in out.stderr.splitlines() if "no_such_points" in line]
  assert len(lines) == 1 and "--imports" in lines[0] and "cannot import module 'no_such_points'" in lines[0], \
      out.stderr[-3000:]
  assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()


# -- an experiment -----------------------------------------------------------------------------------------
# The slow step: `make test` covers its pieces with test_trainer_trains_a_point_an_imported_module_registers (an
# --imports module's point, with an option, trains), test_experiment_names_a_module_it_cannot_import (the
# experiments read --imports) and tests/experiments/test_clis.py::test_registered_point_joins_experiments_by_name.
@pytest.mark.slow
def test_experiment_measures_an_imported_point_by_name(tmp_path):
  """experiments.mqar trains and scores `my-pgdn` (with an option) named in --variants; the command its results
  record reruns it with the same --imports."""
  cwd = _user_dir(tmp_path)
  out = _run(["experiments.mqar", "--imports=my_points", "--variants=my-pgdn:x=3.0", "--lengths=32", "--kv=4",
              "--lrs=3e-3", "--steps=2", "--batch_size=4", "--size=tiny", "--vocab_size=64", "--train_examples=8",
              "--test_examples=4", "--implementation=xla", "--out=out"], cwd)
  assert out.returncode == 0, out.stderr[-3000:]
  payload = json.loads((cwd / "out" / "mqar.json").read_text())
  assert [r["variant"] for r in payload["runs"]] == ["my-pgdn:x=3.0"]
  assert payload["command"].startswith("python -m experiments.mqar --imports=my_points --config.variants=my-pgdn:x=3.0")


def test_experiment_names_a_module_it_cannot_import(tmp_path):
  out = _run(["experiments.grid", "--imports=no_such_points", "--variants=my-pgdn", "--report", "--out=out"],
             tmp_path)
  assert out.returncode != 0
  lines = [line for line in out.stderr.splitlines() if "no_such_points" in line]
  assert len(lines) == 1 and "--imports" in lines[0] and "ModuleNotFoundError" in lines[0], out.stderr[-3000:]
  assert "Traceback" not in out.stderr


# -- the flag's pieces, in this process --------------------------------------------------------------------
def test_import_modules_puts_the_current_directory_on_the_path(tmp_path, monkeypatch):
  """A module beside the command (no side effects: this process's registry stays as it is); a file name instead
  of a module name is refused with a hint."""
  (tmp_path / "plain_user_module_for_imports.py").write_text("VALUE = 7\n")
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
  monkeypatch.setattr(plugins, "_IMPORTED", [])
  monkeypatch.delitem(sys.modules, "plain_user_module_for_imports", raising=False)
  [module] = plugins.import_modules(["plain_user_module_for_imports", ""])
  assert module.VALUE == 7 and plugins.imported() == ("plain_user_module_for_imports",)
  with pytest.raises(ImportError, match=r"cannot import module 'nope\.py' \(a module name, e\.g\. 'nope', not a"):
    plugins.import_modules(["nope.py"])


def test_plugins_import_only_the_standard_library():
  code = "import sys, osdn_jax.plugins; print(sorted(m for m in ('absl', 'jax', 'osdn_jax.dgps') if m in sys.modules))"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
  assert out.strip() == "[]", out


def test_imports_flag_is_defined_once_per_flag_values():
  fv = flags.FlagValues()
  a, b = plugins.define_imports_flag(fv), plugins.define_imports_flag(fv)
  fv(["prog"])
  assert a.name == b.name == "imports" and a.value == b.value == []


def test_point_option_from_the_command_line_reaches_the_model(monkeypatch):
  config = _parse_config(["--config=tiny", "--config.model=pdn-tiny", "--config.point_options.x=2.0",
                          "--config.point_options.center_init=0"], monkeypatch)
  configs.validate(config)
  assert dict(config.point_options) == {"x": 2.0, "center_init": 0}
  model = loop.model_config(config, 256)
  assert model.point.opts["x"] == 2.0 and dict(model.point_options)["x"] == 2.0


def test_unknown_point_option_is_refused_naming_it(monkeypatch):
  config = _parse_config(["--config=tiny", "--config.model=pdn-tiny", "--config.point_options.xx=2.0"],
                         monkeypatch)
  with pytest.raises(ValueError, match=r"`point_options` of 'pdn-tiny'.*unknown options \['xx'\]"):
    configs.validate(config)


def test_unknown_field_outside_point_options_is_still_refused(monkeypatch):
  """Only point_options takes new keys: a typo elsewhere stops the parse, naming the key."""
  for override, key in (("--config.stpes=3", "stpes"), ("--config.optimizer.lrr=0.1", "lrr")):
    with pytest.raises(KeyError, match=f'"{key}" does not exist'):
      _parse_config(["--config=tiny", override], monkeypatch)
