"""A converted FLA checkpoint is a run: `train.load`, `osdn_jax.eval`, `models.generate` and the harness read it,
and its checkpoint goes back out to FLA unchanged; the command line does both ways."""
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osdn_jax import convert, eval as eval_lib, harness, models
from osdn_jax.train import loop
from tests.convert import helpers


def _tokens(tmp_path):
  """Byte-level token shards of a small text corpus (vocabulary 256) with a validation split."""
  from osdn_jax.data.prepare import prepare
  rng = np.random.default_rng(0)
  words = "the quick brown fox jumps over a lazy dog while seven wizards hex".split()
  for i in range(40):
    (tmp_path / f"{i}.txt").write_text(" ".join(rng.choice(words, 300)))
  prepare(str(tmp_path / "*.txt"), "byte", tmp_path / "tokens", validation=0.25, progress=False, verbose=False)
  return tmp_path / "tokens"


@pytest.mark.slow     # `make test`: the conversions in process (round trips, golden logits, refusals)
def test_run_loads_evaluates_generates_and_goes_back(tmp_path):
  model = helpers.model("pkda", vocab_size=256)
  convert.save_fla(model, tmp_path / "fla")
  convert.fla_to_run(tmp_path / "fla", tmp_path / "run", data=_tokens(tmp_path), config="tiny", seq_len=16,
                     batch_size=2, dtype="float32")
  loaded, config = loop.load(tmp_path / "run")
  tokens = jnp.array([[1, 2, 3, 4, 5]])
  np.testing.assert_array_equal(np.asarray(loaded(tokens)), np.asarray(model(tokens)))
  out, _ = models.generate(loaded, tokens, 4)
  want, _ = models.generate(model, tokens, 4)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
  result = eval_lib.evaluate(tmp_path / "run", batches=1)
  assert result["step"] == 0 and np.isfinite(result["eval_loss"]) and result["tokens"] > 0
  lm = harness.RunLM.from_workdir(tmp_path / "run", batch_size=2)
  (logp, _), = lm.loglikelihood([("the quick brown", " fox")])
  assert np.isfinite(logp) and logp < 0
  convert.run_to_fla(tmp_path / "run", tmp_path / "back")
  _, params = convert.read_fla(tmp_path / "back")
  same = jax.tree.map(lambda a, b: np.array_equal(a, b), convert.model_params(model), params)
  assert all(jax.tree.leaves(same))


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "osdn_jax.convert", *args], capture_output=True, text=True,
                        env={"JAX_PLATFORMS": "cpu", "PATH": ""})


@pytest.mark.slow
def test_command_line(tmp_path):
  convert.save_fla(helpers.model("dn"), tmp_path / "fla")
  done = _cli(f"--fla={tmp_path / 'fla'}", f"--workdir={tmp_path / 'run'}", "--config=tiny", "--seq_len=16")
  assert done.returncode == 0, done.stderr
  assert json.loads(done.stdout.splitlines()[-1])["point"] == "dn"
  done = _cli(f"--workdir={tmp_path / 'run'}", f"--to_fla={tmp_path / 'back'}")
  assert done.returncode == 0, done.stderr
  assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "delta_net"
  again = _cli(f"--fla={tmp_path / 'fla'}", f"--workdir={tmp_path / 'run'}")
  assert again.returncode == 1 and again.stderr.startswith("error: convert:") and "already holds a run" in again.stderr


def test_command_line_usage(tmp_path):
  both = _cli(f"--fla={tmp_path / 'fla'}", f"--to_fla={tmp_path / 'x'}", f"--workdir={tmp_path / 'run'}")
  assert both.returncode == 2 and both.stderr.startswith("error: ") and "exactly one of --fla" in both.stderr
