"""The trainer's evaluation: the held-out loss logged every `eval_every` steps and at the end, equal to the mean
loss of the loaded model over the same validation batches computed independently, leaving the training steps as
they were; `python -m osdn_jax.eval` on a checkpoint (and on prepared token shards); and the command line's
manners: one-line errors, --help, the end-of-run summary."""
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from osdn_jax import data
from osdn_jax import eval as eval_cli
from osdn_jax.data import prepare
from osdn_jax.testing import override
from osdn_jax.train import configs, loop

REPO = pathlib.Path(__file__).resolve().parents[2]


def _source() -> str:
  """The text corpus where it is installed (`make data`), else random tokens."""
  try:
    data.sources.TextSource()
    return "text"
  except (FileNotFoundError, ValueError):
    return "random"


def _tiny(**changes):
  """The tiny config made small: 4 × 32 tokens, 6 steps logged every 3, evaluated every 2 on 2 batches,
  checkpoints every 2; quiet, synchronous."""
  c = configs.get_config("tiny")
  c.data.source = _source()
  c.progress, c.async_checkpoint, c.diagnostics_every = False, False, 0
  c.steps, c.log_every, c.checkpoint_every, c.eval_every, c.eval_batches = 6, 3, 2, 2, 2
  c.batch_size, c.seq_len, c.optimizer.warmup_steps = 4, 32, 1
  return override(c, changes)


def _metrics(workdir):
  return [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def _env(**extra):
  return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), **extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The same run with evaluation (every 2 steps) and without: {"on"/"off": (workdir, TrainResult)}."""
  root = tmp_path_factory.mktemp("eval")
  return {name: (root / name, loop.run(_tiny(eval_every=every), root / name))
          for name, every in (("on", 2), ("off", 0))}


def _independent_loss(model, pipeline, batches: int) -> tuple[float, float]:
  """(mean −log p per scored token, scored tokens) of `model` over the next `batches` batches of `pipeline`:
  the model's logits and optax's cross-entropy, nothing of the trainer's loss."""
  graph, state = nnx.split(model)
  logits_fn = jax.jit(lambda s, t, g: nnx.merge(graph, s)(t, segment_ids=g))
  total = count = 0.0
  for _ in range(batches):
    b = next(pipeline)
    logits = logits_fn(state, jnp.asarray(b["tokens"]), jnp.asarray(b["segment_ids"]))
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), jnp.asarray(b["targets"]))
    total += float(jnp.sum(nll * b["loss_mask"]))
    count += float(np.sum(b["loss_mask"]))
  pipeline.close()
  return total / count, count


# -- the loop ---------------------------------------------------------------------------------------------------
def test_eval_lines_at_eval_every_and_at_the_end(runs):
  """Evaluations at steps 2 and 4 (lines of their own: no training row is logged there) and at the last step 6
  (on its training row); TensorBoard gets the eval scalars; the result's summary holds the last one."""
  workdir, result = runs["on"]
  rows = _metrics(workdir)
  assert [r["step"] for r in rows] == [2, 3, 4, 6]
  evals = {r["step"]: r for r in rows if "eval_loss" in r}
  assert sorted(evals) == [2, 4, 6] and "loss" not in evals[2] and "loss" in evals[6] and "eval_loss" not in rows[1]
  for r in evals.values():
    assert np.isfinite(r["eval_loss"]) and r["eval_perplexity"] == pytest.approx(np.exp(r["eval_loss"]), rel=1e-12)
    assert 0 < r["eval_tokens"] <= 2 * 4 * 32
  if _source() == "text":   # random tokens teach nothing
    assert evals[6]["eval_loss"] < evals[2]["eval_loss"]
  events = b"".join(p.read_bytes() for p in (workdir / "tensorboard").iterdir())
  assert b"eval_loss" in events and b"eval_perplexity" in events
  assert result.metrics["eval_loss"] == evals[6]["eval_loss"]
  s = result.summary
  assert s["eval"]["step"] == 6 and s["eval"]["eval_loss"] == evals[6]["eval_loss"] and s["loss"] == rows[-1]["loss"]
  text = loop.describe(s, workdir)
  assert "steps 1-6 of 6" in text and "held-out loss" in text and str(workdir / "metrics.jsonl") in text
  assert [r["step"] for r in _metrics(runs["off"][0])] == [3, 6] and runs["off"][1].summary["eval"] is None


def test_training_is_the_same_with_and_without_evaluation(runs):
  """Every logged training value and every final parameter equal (fp32, CPU)."""
  (on_dir, on), (off_dir, off) = runs["on"], runs["off"]
  train_rows = lambda d: [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in _metrics(d) if "loss" in r]
  assert train_rows(on_dir) == train_rows(off_dir)
  for a, b in zip(jax.tree.leaves(on.state["params"]), jax.tree.leaves(off.state["params"])):
    np.testing.assert_array_equal(a, b)


def test_eval_loss_equals_an_independent_computation(runs):
  """The logged eval_loss of step 6 is the loaded model's mean −log p (its logits, optax's cross-entropy) over
  the same validation batches: the split's fixed, seeded pipeline."""
  workdir, _ = runs["on"]
  model, config = loop.load(workdir)
  pipeline = data.make_pipeline(dict(config.data, split="validation", prefetch=0), seq_len=config.seq_len,
                                batch_size=config.batch_size, seed=loop.EVAL_SEED)
  want, tokens = _independent_loss(model, pipeline, config.eval_batches)
  logged = _metrics(workdir)[-1]
  assert logged["eval_tokens"] == tokens
  np.testing.assert_allclose(logged["eval_loss"], want, rtol=1e-5)


def test_a_checkpoint_evaluates_to_the_logged_eval(runs):
  """`osdn_jax.eval.evaluate` (what `python -m osdn_jax.eval` prints): the newest checkpoint's eval_loss is the
  one logged at the last step, checkpoint 4's the one logged at step 4; another batch count, another number."""
  workdir, _ = runs["on"]
  logged = {r["step"]: r for r in _metrics(workdir) if "eval_loss" in r}
  for step in (None, 4):
    got = eval_cli.evaluate(workdir, step=step)
    want = logged[got["step"]]
    assert got["step"] == (6 if step is None else 4)
    assert got["eval_loss"] == want["eval_loss"] and got["tokens"] == want["eval_tokens"]
  assert eval_cli.evaluate(workdir, batches=1)["tokens"] <= 4 * 32
  with pytest.raises(FileNotFoundError, match="no checkpoint 5"):
    eval_cli.evaluate(workdir, step=5)


def test_eval_on_prepared_token_shards(runs, tmp_path):
  """--data=DIR: the validation split of prepared shards (bytes, the model's vocabulary), equal to the
  independent computation over it; a run whose data has no validation split stops before training, naming
  `eval_every`."""
  rng = np.random.default_rng(0)
  words = ["the", "king", "shall", "not", "sleep", "tonight", "and", "queen", "of", "night"]
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(12):
    (corpus / f"{'val' if i < 4 else 'doc'}{i:02d}.txt").write_text(" ".join(rng.choice(words, 80)))
  out = tmp_path / "shards"
  prepare.prepare([str(corpus / "doc*.txt")], "bytes", out, validation_input=[str(corpus / "val*.txt")],
                  workers=1, progress=False, verbose=False)
  workdir, _ = runs["on"]
  got = eval_cli.evaluate(workdir, data=out, batches=2)
  model, config = loop.load(workdir)
  pipeline = data.make_pipeline(dict(source="tokens", path=str(out), split="validation"), seq_len=config.seq_len,
                                batch_size=config.batch_size, seed=loop.EVAL_SEED)
  want, tokens = _independent_loss(model, pipeline, 2)
  assert got["tokens"] == tokens
  np.testing.assert_allclose(got["eval_loss"], want, rtol=1e-5)

  bare = tmp_path / "bare"
  prepare.prepare([str(corpus / "doc*.txt")], "bytes", bare, validation=0.0, workers=1, progress=False,
                  verbose=False)
  c = _tiny(**{"data.source": "tokens", "data.path": str(bare)})
  with pytest.raises(ValueError, match="validation split.*`eval_every` = 0"):
    loop.train(c, tmp_path / "run")
  assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("field,value", [("eval_every", -1), ("eval_batches", 0)])
def test_bad_eval_fields_name_the_field(field, value):
  with pytest.raises(ValueError, match=f"`{field}`"):
    configs.validate(_tiny(**{field: value}))


def test_named_configs_evaluate_where_a_validation_split_is_cheap():
  assert configs.get_config("tiny").eval_every == 100 and configs.get_config("mqar").eval_every == 0
  assert configs.get_config("340m").eval_every == configs.get_config("1.3b").eval_every == 500
  assert {"eval_every", "eval_batches"} <= set(loop.RESUMABLE)


# -- the command lines ------------------------------------------------------------------------------------------
@pytest.mark.slow     # `make test`: the eval CLI's errors and help, and a checkpoint's eval in process
def test_cli_trains_under_a_mesh_prints_a_summary_and_eval_prints_the_logged_eval(tmp_path):
  """`python -m osdn_jax.train` on 2 CPU devices (fsdp = 2) evaluates under the mesh and ends with its summary;
  `python -m osdn_jax.eval` (one device) prints the eval_loss it logged at the last step."""
  workdir = tmp_path / "run"
  env = _env(XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip())
  args = ["--config=tiny", f"--workdir={workdir}", f"--config.data.source={_source()}", "--config.steps=4",
          "--config.batch_size=4", "--config.seq_len=32", "--config.eval_every=3", "--config.eval_batches=2",
          "--config.log_every=2", "--config.checkpoint_every=4", "--config.diagnostics_every=0",
          "--config.optimizer.warmup_steps=1", "--config.progress=false", "--config.async_checkpoint=false",
          "--config.mesh.data=1", "--config.mesh.fsdp=2"]
  out = subprocess.run([sys.executable, "-m", "osdn_jax.train", *args], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = _metrics(workdir)
  assert [(r["step"], "eval_loss" in r) for r in rows] == [(2, False), (3, True), (4, True)]
  summary = out.stdout.strip().splitlines()
  assert len(summary) == 2, out.stdout
  assert "steps 1-4 of 4" in summary[0] and f"final training loss {rows[-1]['loss']:.4f}" in summary[0]
  assert f"held-out loss {rows[-1]['eval_loss']:.4f}" in summary[0] and "tokens/s" in summary[0]
  assert str(workdir / "checkpoints" / "4") in summary[1] and str(workdir / "metrics.jsonl") in summary[1]
  ev = subprocess.run([sys.executable, "-m", "osdn_jax.eval", f"--workdir={workdir}"], cwd=REPO, env=_env(),
                      capture_output=True, text=True, timeout=300)
  assert ev.returncode == 0, ev.stderr[-3000:]
  printed = json.loads(ev.stdout.strip().splitlines()[-1])
  assert set(printed) == {"step", "eval_loss", "eval_perplexity", "tokens"} and printed["step"] == 4
  assert printed["tokens"] == rows[-1]["eval_tokens"]
  np.testing.assert_allclose(printed["eval_loss"], rows[-1]["eval_loss"], rtol=1e-5)   # fsdp's sums vs 1 device


@pytest.mark.slow
def test_cli_errors_are_one_line_and_help_lists_the_fields(tmp_path):
  """An unknown --config name (listing the names), a work directory that is a file, a mistyped field: one line
  on stderr without a traceback, exit status 2 (usage errors), nothing written. --help exits 0 and lists the config's fields."""
  a_file = tmp_path / "file"
  a_file.write_text("not a directory")
  cases = {
      "name": (["--config=tinyy", f"--workdir={tmp_path / 'a'}"], ["'tinyy'", "tiny, 340m, 1.3b, mqar"]),
      "file": (["--config=tiny", f"--workdir={a_file}"], [str(a_file), "is a file"]),
      "field": (["--config=tiny", f"--workdir={tmp_path / 'b'}", "--config.stpes=3"],
                ["--config.stpes", "did you mean --config.steps"]),
      "help": (["--help"], []),
  }
  procs = {k: subprocess.Popen([sys.executable, "-m", "osdn_jax.train", *args], cwd=REPO, env=_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for k, (args, _) in cases.items()}
  outs = {k: (p.communicate(timeout=300), p.returncode) for k, p in procs.items()}
  for k, ((stdout, stderr), code) in outs.items():
    if k == "help":
      assert code == 0, stderr[-2000:]
      assert "eval_every" in stdout and "eval_batches" in stdout and "--workdir" in stdout
      continue
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, (k, stderr[-3000:])
    assert lines[0].startswith("train: ") and all(w in lines[0] for w in cases[k][1]), (k, lines[0])
  assert a_file.read_text() == "not a directory"
  assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
  with pytest.raises(NotADirectoryError, match="is a file"):     # the same from Python
    loop.run(_tiny(), a_file)
