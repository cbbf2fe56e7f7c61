"""The trainer: configs and their errors, the optimiser's mask and schedule, the chunked loss and the remat
policies against the plain forms, the sharded step against one device (8 fake CPU devices), kill-and-resume,
the fallback from a damaged checkpoint, the NaN guard, and what a run writes."""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from osdn_jax import data, models
from osdn_jax.models.config import REMAT_POLICIES
from osdn_jax.train import __main__ as cli
from osdn_jax.train import configs, loop, mesh as mesh_lib, optim
from osdn_jax.train.loss import cross_entropy, plain_cross_entropy
from osdn_jax.testing import override, rel_rms
from osdn_jax.train.step import graphdef, loss_sum, segments_bound

REPO = pathlib.Path(__file__).resolve().parents[2]
F32 = jnp.float32


def _tiny(**changes) -> ml_collections.ConfigDict:
  """The tiny config on random tokens (no corpus needed), quiet, synchronous checkpoints."""
  c = configs.get_config("tiny")
  c.data.source = "random"
  c.progress = False
  c.async_checkpoint = False
  return override(c, changes)


def _metrics(workdir):
  return [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


# -- configs -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(configs.CONFIGS))
def test_named_configs_validate(name):
  configs.validate(configs.get_config(name))


@pytest.mark.parametrize("field,value,match", [
    ("model", "nope-340m", "`model`"), ("model", "gdn-7b", "unknown size"), ("dtype", "float64", "`dtype`"),
    ("remat", "everything", "`remat`"), ("batch_size", 0, "`batch_size`"), ("grad_accum", 3, "`grad_accum`"),
    ("steps", 0, "`steps`"), ("optimizer.b2", 1.0, "optimizer.b1` and `optimizer.b2"),
    ("optimizer.lr", -1.0, "optimizer.lr"), ("optimizer.lr", float("inf"), "optimizer.lr"),
    ("optimizer.lr", float("nan"), "optimizer.lr"), ("optimizer.eps", float("inf"), "optimizer.eps"),
    ("optimizer.clip", float("nan"), "optimizer.clip"), ("optimizer.warmup_steps", 500, "warmup_steps"),
    ("mesh.data", 0, "mesh.data"), ("mesh.tensor", -1, "at most one"), ("implementation", "cuda", "implementation"),
])
def test_bad_configs_name_the_field(field, value, match):
  c = _tiny(**{field: value})
  if field == "mesh.tensor":
    c.mesh.data = -1
  with pytest.raises(ValueError, match=match):
    configs.validate(c)


def test_mesh_and_head_errors():
  with pytest.raises(ValueError, match="must equal the number of devices"):
    mesh_lib.axis_sizes({"data": 3, "fsdp": 1, "tensor": 1}, 1)
  assert mesh_lib.axis_sizes({"data": -1, "fsdp": 2, "tensor": 2}, 8) == {"data": 2, "fsdp": 2, "context": 1,
                                                                          "tensor": 2}
  assert mesh_lib.axis_sizes({"data": 1, "fsdp": 2, "context": -1, "tensor": 1}, 8)["context"] == 4
  mesh = mesh_lib.make_mesh({"data": 1, "fsdp": 1, "tensor": 1})
  mesh_lib.check_tensor_axis(models.config("gdn-tiny"), mesh)
  with pytest.raises(ValueError, match="unknown `config`"):
    configs.get_config("huge")


def test_named_config_flag_becomes_the_config_file():
  argv = cli.configs.flag_args(["prog", "--config=tiny", "--workdir=x", "--config.steps=3", "--config", "340m"])
  assert argv[1] == f"--config={configs.__file__}:tiny" and argv[2:4] == ["--workdir=x", "--config.steps=3"]
  assert argv[5] == f"{configs.__file__}:340m"
  assert cli.configs.flag_args(["prog", "--config=my.py:x"])[1] == "--config=my.py:x"


# -- optimiser ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["pgdn", "osdn-apf-gdn"])
def test_weight_decay_mask(variant):
  """Decay on the matrices; none on norm scales, biases (APF's retention) or the point's parameters (A_log,
  dt_bias, PDN's center)."""
  params = nnx.state(models.build(f"{variant}-tiny"), nnx.Param).to_pure_dict()
  flat = {"/".join(str(getattr(k, "key", k)) for k in path): m
          for path, m in jax.tree_util.tree_flatten_with_path(optim.decay_mask(params))[0]}
  assert flat["embed"] and flat["blocks/mixer/q_proj/kernel"] and flat["blocks/mlp/down_proj/kernel"]
  assert flat["blocks/mixer/conv/weight"] and flat["blocks/mixer/features/decay/a/proj/kernel"]
  assert not flat["blocks/mixer_norm/scale"] and not flat["final_norm/scale"]
  biases = [k for k in flat if k.endswith("bias")]
  point = [k for k in flat if "point_params" in k]
  assert point and not any(flat[k] for k in point + biases)
  assert any(k.endswith("center") for k in point) if variant == "pgdn" else biases


def test_weight_decay_mask_reads_an_nnx_state():
  """`nnx.split`'s State (leaves under each variable's `value`) gets the same mask as the pure dict."""
  graph, state = nnx.split(models.build("pgdn-tiny"), nnx.Param)
  pure = jax.tree.leaves(optim.decay_mask(nnx.state(nnx.merge(graph, state), nnx.Param).to_pure_dict()))
  assert jax.tree.leaves(optim.decay_mask(state)) == pure and 0 < sum(pure) < len(pure)


def test_schedule_warms_up_then_decays_to_a_tenth():
  opt = _tiny().optimizer
  s = optim.schedule(opt, 100)
  assert float(s(0)) == 0.0 and float(s(opt.warmup_steps)) == pytest.approx(opt.lr)
  after = np.array([float(s(i)) for i in range(opt.warmup_steps, 101)])
  assert np.all(np.diff(after) <= 1e-12) and after[-1] == pytest.approx(0.1 * opt.lr)


# -- loss and remat ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,chunk", [(F32, 8), (jnp.bfloat16, 16), (F32, 64)])
def test_chunked_cross_entropy_equals_the_plain_one(dtype, chunk):
  """T = 37 (padded to the chunk), masked tokens, values and gradients of hidden and embed."""
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.normal(size=(3, 37, 16)), dtype)
  embed = jnp.asarray(rng.normal(size=(50, 16)) * 0.3, F32)
  targets = jnp.asarray(rng.integers(0, 50, (3, 37)), jnp.int32)
  mask = jnp.asarray(rng.random((3, 37)) > 0.2, F32)
  f = jax.jit(jax.value_and_grad(lambda h, e: cross_entropy(h, e, targets, mask, chunk=chunk), argnums=(0, 1)))
  g = jax.jit(jax.value_and_grad(lambda h, e: plain_cross_entropy(h, e, targets, mask), argnums=(0, 1)))
  (a, (ah, ae)), (b, (bh, be)) = f(hidden, embed), g(hidden, embed)
  tol = 1e-6 if dtype == F32 else 1e-2     # bf16: the embedding's gradient is summed over pieces in fp32
  np.testing.assert_allclose(a, b, rtol=1e-6)
  assert rel_rms(ah, bh) < tol and rel_rms(ae, be) < tol, (rel_rms(ah, bh), rel_rms(ae, be))


def test_run_returns_the_model_and_load_rebuilds_it(tmp_path):
  """`run` returns the final state and model; `load` rebuilds the same parameters from the work directory (and
  the point's options from its config); a directory without a run is a FileNotFoundError."""
  c = _tiny(steps=2, checkpoint_every=2, log_every=1, batch_size=2, seq_len=16, model="osdn-apf-tiny",
            **{"optimizer.warmup_steps": 1})
  c.point_options.apf_anchor = "init"
  result = loop.run(c, tmp_path / "run")
  assert result.metrics["step"] == 2 and isinstance(result.metrics["loss"], float)
  assert result.model_config.point.opts["apf_anchor"] == "init"
  model, config = loop.load(tmp_path / "run")
  assert config.model == "osdn-apf-tiny" and model.cfg.point.opts["apf_anchor"] == "init"
  got = nnx.state(model, nnx.Param).to_pure_dict()
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(result.state["params"])):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(FileNotFoundError, match="config.json"):
    loop.load(tmp_path)


def test_loss_on_scored_positions_equals_the_full_loss():
  """loss_positions = the most scored positions of any row: the same loss and gradients as the head over every
  position; fewer positions drop the later scored ones of the fuller rows (and change the loss)."""
  cfg = models.config("pdn-tiny", vocab_size=64)
  graph, params = graphdef(cfg), nnx.state(models.build(cfg), nnx.Param).to_pure_dict()
  rng = np.random.default_rng(1)
  mask = np.zeros((3, 40), np.float32)
  for row, count in enumerate((5, 2, 0)):
    mask[row, rng.choice(40, count, replace=False)] = 1
  batch = {"tokens": jnp.asarray(rng.integers(0, 64, (3, 40)), jnp.int32),
           "targets": jnp.asarray(rng.integers(0, 64, (3, 40)), jnp.int32),
           "segment_ids": jnp.zeros((3, 40), jnp.int32), "loss_mask": jnp.asarray(mask)}
  value_grad = lambda n: jax.jit(jax.value_and_grad(
      lambda p: loss_sum(graph, p, batch, loss_chunk=16, segments_per_row=1, loss_positions=n)))(params)
  (full, g_full), (sparse, g_sparse) = value_grad(0), value_grad(5)
  np.testing.assert_allclose(sparse, full, rtol=1e-5)
  assert max(rel_rms(a, b) for a, b in zip(jax.tree.leaves(g_sparse), jax.tree.leaves(g_full))) < 1e-5
  assert abs(float(value_grad(3)[0]) - float(full)) > 1e-3


@pytest.mark.slow     # `make test`: what each policy saves (test_solve_policies_keep_the_first_pass)
@pytest.mark.parametrize("variant", ["pgdn", "osdn-apf-kda"])
def test_remat_policies_equal_no_remat(variant):
  """Every policy: the same loss and the same gradient of every parameter (fp32, packed rows)."""
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, 256, (2, 33))
  seg = np.sort(rng.integers(0, 3, (2, 32)), axis=1)
  batch = dict(tokens=jnp.asarray(tokens[:, :-1], jnp.int32), targets=jnp.asarray(tokens[:, 1:], jnp.int32),
               segment_ids=jnp.asarray(seg, jnp.int32), loss_mask=jnp.ones((2, 32), F32))
  results, remats = {}, {}
  for policy in REMAT_POLICIES:
    cfg = models.config(f"{variant}-tiny", remat=policy, chunk_size=16)
    params = nnx.state(models.build(cfg), nnx.Param).to_pure_dict()
    fn = jax.value_and_grad(lambda p, b: loss_sum(graphdef(cfg), p, b, loss_chunk=8))
    remats[policy] = len(re.findall(r"\b(remat2|checkpoint)\[", str(jax.make_jaxpr(fn)(params, batch))))
    results[policy] = jax.jit(fn)(params, batch)
  # Every policy but "none" adds a rematerialised block to the loss pieces' own.
  assert all(n > remats["none"] for p, n in remats.items() if p != "none"), remats
  want_loss, want_grads = results["none"]
  for policy, (value, grads) in results.items():
    np.testing.assert_allclose(value, want_loss, rtol=1e-6, err_msg=policy)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
      assert rel_rms(a, b) < 1e-5, (policy, rel_rms(a, b))     # recomputation may fuse (round) differently


@pytest.mark.parametrize("point,extra", [("pdn", 2), ("osdn", 4)])
def test_solve_policies_keep_the_first_pass(point, extra, capsys):
  """Under "solve" and "dots_solve" a block keeps the preconditioner's first pass for its backward (named
  "precond_pass"): PDN's write key and its chunk carries; OSDN's write key and the d-pass kernels' d, flags and
  tables. So the backward reruns none of the first pass's kernels (Pallas, interpret mode here)."""
  from jax.ad_checkpoint import print_saved_residuals
  from osdn_jax import ops
  from osdn_jax.dgps import precond
  rng = np.random.default_rng(0)
  k, v = (jnp.asarray(rng.normal(size=(1, 64, 2, 16)), F32) for _ in range(2))
  beta = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(1, 64, 2)), F32))

  def block(k, beta):
    if point == "pdn":
      key, _ = precond.pdn_write_key(k, beta, jnp.log(beta), 0.1, implementation="pallas")
    else:
      key, _ = precond.osdn_write_key(k, beta, implementation="pallas")
    return jnp.sum(ops.delta_rule(k, k, v, beta, k_write=key, implementation="pallas")[0])

  def saved(policy):
    print_saved_residuals(jax.checkpoint(block, policy=policy), k, beta)
    return capsys.readouterr().out.strip().splitlines()
  without = saved(jax.checkpoint_policies.save_only_these_names("solve_out", "delta_rule_T"))
  for name in ("solve", "dots_solve"):
    lines = saved(REMAT_POLICIES[name])
    assert len(lines) == len(without) + extra and any("precond_pass" in line for line in lines), (name, lines)


def test_segments_bound():
  assert segments_bound(np.zeros((2, 8), np.int32)) == 1           # one sequence per row: unpacked
  assert segments_bound(np.array([[0, 0, 1, 1], [0, 0, 0, 0]])) == 4
  ids = np.array([[0, 0, 1, 2, 3, 4, 5, 5], [0, 0, 0, 0, 0, 0, 0, 1]])
  assert segments_bound(ids) == 8 and segments_bound(ids, minimum=1) == 8
  assert segments_bound(np.array([[0, 1, 2, 2]]), minimum=1) == 4


# -- sharding (8 fake CPU devices, in a fresh process) ----------------------------------------------------
_SHARDED = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np, optax
    jax.config.update("jax_enable_x64", False)
    from osdn_jax.train import configs, loop, mesh as mesh_lib
    from osdn_jax.train.step import init_state, graphdef, make_train_step, segments_bound
    assert jax.device_count() == 8
    c = configs.get_config("tiny"); c.model = sys.argv[1]
    cfg = loop.model_config(c, 256)
    tx = optax.sgd(1.0)          # the update is the gradient itself
    rng = np.random.default_rng(0)
    t = rng.integers(0, 256, (8, 49)).astype(np.int32)
    seg = np.sort(rng.integers(0, 3, (8, 48)), axis=1).astype(np.int32)
    batch = dict(tokens=t[:, :-1], targets=t[:, 1:], segment_ids=seg, loss_mask=np.ones((8, 48), np.float32))
    def run(shape, accum):
      m = mesh_lib.make_mesh(dict(zip(("data", "fsdp", "tensor"), shape)), jax.devices()[:int(np.prod(shape))])
      sh = loop.shard_state(jax.eval_shape(lambda: init_state(cfg, tx, 0)), m)
      state = jax.jit(lambda: init_state(cfg, tx, 0), out_shardings=sh)()
      before = jax.device_get(state["params"])
      fn = jax.jit(make_train_step(graphdef(cfg), tx, grad_accum=accum, loss_chunk=16),
                   in_shardings=(sh, mesh_lib.batch_sharding(m)), out_shardings=(sh, None), static_argnums=2)
      with jax.set_mesh(m):
        state, met = fn(state, loop.global_batch(batch, mesh_lib.batch_sharding(m)), segments_bound(seg))
      grads = jax.tree.map(lambda a, b: a - b, before, jax.device_get(state["params"]))
      return float(met["loss"]), grads
    loss0, g0 = run((1, 1, 1), 1)
    worst = 0.0
    meshes = {"combined": [((2, 2, 2), 1), ((1, 4, 1), 2)], "separate": [((4, 1, 2), 1), ((1, 8, 1), 1)]}
    for shape, accum in sum((meshes[m] for m in sys.argv[2].split(",")), []):
      loss, g = run(shape, accum)
      assert abs(loss - loss0) <= 1e-6 * abs(loss0), (shape, loss, loss0)
      for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
        err = float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-30))
        worst = max(worst, err)
        assert err < 1e-4, (shape, accum, err)    # sums split over devices: fp32 rounding, not O(1) errors
      flat = lambda t: np.concatenate([x.ravel() for x in jax.tree.leaves(t)])
      assert np.linalg.norm(flat(g) - flat(g0)) <= 1e-5 * np.linalg.norm(flat(g0)), shape
    print("worst relative rms", worst)
""")


@pytest.mark.parametrize("variant,meshes", [
    pytest.param("pgdn", "combined", marks=pytest.mark.slow),
    pytest.param("pgdn", "separate", marks=pytest.mark.slow),
    pytest.param("osdn-apf-gdn", "combined,separate", marks=pytest.mark.slow)])
def test_sharded_step_equals_one_device(variant, meshes):
  """Loss and every parameter's gradient equal the single-device step (fp32); the recurrence runs under
  shard_map over rows × heads. "combined": data × fsdp × tensor, and fsdp with 2 microbatches; "separate":
  data × tensor, and fsdp alone."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  out = subprocess.run([sys.executable, "-c", _SHARDED, f"{variant}-tiny", meshes], capture_output=True,
                       text=True, env=env, cwd=REPO, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "worst relative rms" in out.stdout


# -- runs ---------------------------------------------------------------------------------------------------
def test_run_writes_config_metrics_diagnostics_and_events(tmp_path):
  c = _tiny(steps=4, log_every=1, checkpoint_every=2, diagnostics_every=2, **{"optimizer.warmup_steps": 1})
  last = loop.train(c, tmp_path)
  rows = _metrics(tmp_path)
  assert [r["step"] for r in rows] == [1, 2, 3, 4] and last["step"] == 4
  for r in rows:
    assert {"loss", "grad_norm", "lr", "tokens_per_s"} <= set(r) and np.isfinite(r["loss"])
    assert 0.0 <= r["data_wait"] < 1.0
  for r in rows[1::2]:
    assert len(r["q_geo"]) == len(r["state_norm"]) == 2
    assert all(0 < q <= 1 for q in r["q_geo"]) and all(s > 0 for s in r["state_norm"])
  assert json.loads((tmp_path / "config.json").read_text())["model"] == "gdn-tiny"
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]
  assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tensorboard").iterdir())


def _damage(step_dir: pathlib.Path) -> None:
  """Overwrites every array file of a checkpoint's state with garbage of the same size."""
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and "metadata" not in p.name]
  assert files
  for p in files:
    p.write_bytes(b"\x00garbage" * max(1, p.stat().st_size // 8))


@pytest.mark.slow     # `make test`: test_integrity's resume from the checkpoint before a damaged one
def test_damaged_latest_checkpoint_falls_back_to_the_previous(tmp_path, caplog):
  c = _tiny(steps=6, log_every=1, checkpoint_every=2)
  loop.train(_tiny(steps=6, log_every=1, checkpoint_every=2), tmp_path / "run")
  want = _metrics(tmp_path / "run")          # the uninterrupted run's
  _damage(tmp_path / "run" / "checkpoints" / "6")
  with caplog.at_level("WARNING"):
    loop.train(c, tmp_path / "run")
  assert any("checkpoints/6 cannot be restored" in r.getMessage() and "falling back" in r.getMessage()
             for r in caplog.records)
  got = _metrics(tmp_path / "run")
  assert [r["step"] for r in got] == list(range(1, 7))
  np.testing.assert_array_equal([r["loss"] for r in got], [r["loss"] for r in want])
  other = _tiny(steps=6, log_every=1, checkpoint_every=2, model="pgdn-tiny")   # no checkpoint fits this model
  with pytest.raises(RuntimeError, match="can be restored into this run's state"):
    loop.train(other, tmp_path / "run")


def test_nan_guard_names_step_metric_and_last_checkpoint(tmp_path, monkeypatch):
  real = loop.make_train_step

  def poisoned(*args, **kwargs):
    step = real(*args, **kwargs)

    def wrapped(state, batch, bound=None):
      new, metrics = step(state, batch, bound)
      return new, dict(metrics, loss=jnp.where(new["step"] == 3, jnp.nan, metrics["loss"]))
    return wrapped

  monkeypatch.setattr(loop, "make_train_step", poisoned)
  with pytest.raises(loop.NonFiniteError, match=r"step 3: `loss` is nan; the last good checkpoint is checkpoint 2"):
    loop.train(_tiny(steps=8, log_every=1, checkpoint_every=2), tmp_path)
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
  assert [r["step"] for r in _metrics(tmp_path)] == [1, 2]


def test_out_of_range_token_ids_stop_before_the_device():
  batch = {"tokens": np.zeros((2, 5), np.int32), "targets": np.zeros((2, 5), np.int32)}
  data.pipeline.check_token_ids(batch, 256, "step 1")
  batch["targets"][1, 3] = 256
  with pytest.raises(ValueError, match=r"step 7: `targets`\[1, 3\] = 256 is outside the vocabulary \[0, 256\)"):
    data.pipeline.check_token_ids(batch, 256, "step 7")
  batch["tokens"][0, 2] = -1
  with pytest.raises(ValueError, match=r"`tokens`\[0, 2\] = -1"):
    data.pipeline.check_token_ids(batch, 256, "step 7")


def _corpus_or_skip():
  try:
    data.sources.TextSource()
  except (FileNotFoundError, ValueError) as e:
    pytest.skip(f"the text corpus is not installed (run `make data`): {e}")


@pytest.mark.slow    # the gate keeps the checkpoint fallbacks (tests/train/test_crash_safety.py); the slow step kills runs
def test_killed_and_resumed_run_logs_the_same_losses(tmp_path):
  """The README's tiny run on the text corpus, SIGKILLed once its step-4 checkpoint exists, then started again:
  every step's loss equals the uninterrupted run's (fp32, CPU). The three runs share a persistent compilation
  cache of their own (the later two load the programs the first compiled)."""
  _corpus_or_skip()
  steps = 16
  cmd = lambda d: [sys.executable, "-m", "osdn_jax.train", "--config=tiny", f"--workdir={d}",
                   f"--config.steps={steps}", "--config.checkpoint_every=2", "--config.log_every=1",
                   "--config.progress=false"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  whole, killed = tmp_path / "whole", tmp_path / "killed"
  subprocess.run(cmd(whole), check=True, env=env, cwd=REPO, capture_output=True, timeout=600)
  proc = subprocess.Popen(cmd(killed), env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 600
  while not (killed / "checkpoints" / "4").is_dir() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  interrupted = _metrics(killed)
  assert len(interrupted) < steps, "the run finished before it could be killed"
  out = subprocess.run(cmd(killed), check=True, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert "resumed from checkpoint" in out.stderr
  want, got = _metrics(whole), _metrics(killed)
  assert [r["step"] for r in got] == list(range(1, steps + 1))
  np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-6, atol=0)


def test_metrics_writer_drops_a_torn_last_line_and_names_a_bad_one(tmp_path, caplog):
  """A metrics.jsonl whose last line was cut mid-write (a kill, a full disk) resumes with that line dropped and a
  warning; a bad line before the last is an error naming the file and line."""
  from osdn_jax.train.metrics import Writer
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
  Writer(tmp_path, enabled=True, resume_step=2).close()
  assert path.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
  assert "torn last line" in caplog.text
  path.write_text('{"step": 1, "loss": 2.0}\nnot json\n{"step": 2, "loss": 1.5}\n')
  with pytest.raises(ValueError, match="metrics.jsonl, line 2"):
    Writer(tmp_path, enabled=True, resume_step=2)
