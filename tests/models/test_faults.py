"""Faults at the model's and the trainer's inputs: token ids outside the vocabulary (concrete: a ValueError naming
the position; traced: checked mode names it, otherwise NaN at that position only), generate's arguments, the data
pipeline's and the train step's checks."""
import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from osdn_jax import checking, data, models
from osdn_jax.data import pipeline as pipeline_lib
from osdn_jax.train import configs, loop
from osdn_jax.train.step import checked_train_step, graphdef, make_train_step

V = 256                                            # the tiny configs' vocabulary
TOKENS = np.random.default_rng(0).integers(0, V, (2, 24)).astype(np.int32)


@pytest.fixture(scope="module")
def model():
  return models.build("pgdn-tiny", rngs=nnx.Rngs(0), num_layers=1)


def _bad(value, seed, shape=TOKENS.shape):
  """TOKENS [B, T] (or its first column [B]) with `value` at a random position; returns (tokens, position)."""
  rng = np.random.default_rng(seed)
  at = tuple(int(rng.integers(0, n)) for n in shape)
  tokens = TOKENS[:, 0].copy() if len(shape) == 1 else TOKENS.copy()
  tokens[at] = value
  return tokens, at


def _where(at):
  return r"\[" + ", ".join(map(str, at)) + r"\]"


# -- concrete ids: a ValueError naming the argument, the position and the id -----------------------------------
ENTRIES = {
    "call": (lambda m, t: m(t), "LanguageModel: `tokens`", 2),
    "hidden": (lambda m, t: m.hidden(t), "LanguageModel.hidden: `tokens`", 2),
    "diagnostics": (lambda m, t: m.diagnostics(t), "LanguageModel.diagnostics: `tokens`", 2),
    "model_step": (lambda m, t: m.step(t, None), "LanguageModel.step: `token`", 1),
    "prefill": (lambda m, t: models.prefill(m, t), "prefill: `tokens`", 2),
    "step": (lambda m, t: models.step(m, t, None), "step: `token`", 1),
    "generate": (lambda m, t: models.generate(m, t, 2), "generate: `prompt`", 2),
}


@pytest.mark.parametrize("value", [-1, V, V + 5])
@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_concrete_ids_outside_the_vocabulary_name_the_position(model, entry, value):
  fn, name, rank = ENTRIES[entry]
  tokens, at = _bad(value, seed=sum(map(ord, entry)) + value, shape=TOKENS.shape[:rank])
  with pytest.raises(ValueError, match=rf"^{name}{_where(at)} = {value} is outside the vocabulary \[0, {V}\)$"):
    fn(model, tokens)


@pytest.mark.parametrize("entry,tokens,expected", [
    ("call", TOKENS[0], r"`tokens` must be an integer array \[B, T\], got shape \(24,\)"),
    ("call", TOKENS.astype(np.float32), r"`tokens` must be an integer array \[B, T\], got shape \(2, 24\) float32"),
    ("hidden", TOKENS > 3, r"`tokens` must be an integer array \[B, T\], got shape \(2, 24\) bool"),
    ("model_step", TOKENS, r"`token` must be an integer array \[B\], got shape \(2, 24\)"),
    ("prefill", TOKENS[:, :0], r"`tokens` must be an integer array \[B, T\] with B ≥ 1 and T ≥ 1, got shape "
                               r"\(2, 0\)"),
    ("step", TOKENS[0].astype(np.float32), r"`token` must be an integer array \[B\]"),
])
def test_tokens_of_another_rank_or_dtype_are_value_errors(model, entry, tokens, expected):
  fn, name, _ = ENTRIES[entry]
  with pytest.raises(ValueError, match=name.split(":")[0] + ": " + expected):
    fn(model, tokens)


# -- traced ids: checked mode names the position; otherwise NaN at that position only --------------------------
@pytest.mark.parametrize("entry,value", [("call", V), ("hidden", -1), ("model_step", V + 5), ("prefill", -1),
                                         ("generate", V)])
def test_traced_ids_in_checked_mode_name_the_position(model, entry, value):
  fn, name, rank = ENTRIES[entry]
  cache = models.prefill(model, TOKENS)[1] if rank == 1 else None
  run = (lambda t: fn(model, t)) if rank == 2 else (lambda t: model.step(t, cache))
  tokens, at = _bad(value, seed=7, shape=TOKENS.shape[:rank])
  where = "LanguageModel.step: `token`" if rank == 1 else (
      "LanguageModel.hidden: `tokens`" if entry == "hidden" else "LanguageModel: `tokens`")
  with pytest.raises(ValueError, match=rf"{where}{_where(at)} = {value} is outside the vocabulary \[0, {V}\)"):
    checking.checked(run, jit=True)(jnp.asarray(tokens))
  checking.checked(run, jit=True)(jnp.asarray(TOKENS if rank == 2 else TOKENS[:, 0]))   # good ids pass


@pytest.mark.parametrize("value", [-1, V, V + 5])
def test_without_checked_mode_a_bad_id_is_nan_from_its_position_on(model, value):
  """Under jit (not checked) the bad id embeds as NaN: −1 does not wrap around to V − 1; the logits before it
  and those of the other row stay finite."""
  graph, params = nnx.split(model)
  forward = jax.jit(lambda p, t: nnx.merge(graph, p)(t))
  tokens, t = TOKENS.copy(), 9
  tokens[0, t] = value
  finite = np.isfinite(np.asarray(forward(params, tokens))).all(-1)
  assert finite[0, :t].all() and not finite[0, t:].any() and finite[1].all(), finite
  step_logits, _ = jax.jit(lambda p, tok, c: nnx.merge(graph, p).step(tok, c))(
      params, jnp.asarray([value, 3]), models.prefill(model, TOKENS)[1])
  assert not np.isfinite(step_logits[0]).any() and np.isfinite(step_logits[1]).all()


def test_a_bad_id_in_a_packed_row_leaves_the_other_sequences_finite(model):
  """Row 0 packs three sequences [0, 8), [8, 17), [17, 24); a bad id at 11: NaN at 11..16 only."""
  graph, params = nnx.split(model)
  forward = jax.jit(lambda p, t, s: nnx.merge(graph, p)(t, segment_ids=s))
  seg = np.repeat(np.array([[0] * 8 + [1] * 9 + [2] * 7]), 2, axis=0).astype(np.int32)
  tokens = TOKENS.copy()
  tokens[0, 11] = V
  finite = np.isfinite(np.asarray(forward(params, tokens, seg))).all(-1)
  want = np.ones_like(finite)
  want[0, 11:17] = False
  np.testing.assert_array_equal(finite, want)


# -- generate's arguments -------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes,expected", [
    (dict(prompt=np.zeros((1, 0), np.int32)), r"`prompt` must be an integer array \[B, T\] with B ≥ 1 and T ≥ 1"),
    (dict(prompt=TOKENS[0]), r"`prompt` must be an integer array \[B, T\], got shape \(24,\)"),
    (dict(prompt=TOKENS.astype(np.float32)), r"`prompt` must be an integer array \[B, T\], got shape \(2, 24\) float"),
    (dict(num_tokens=-1), r"`num_tokens` must be an int ≥ 0, got -1"),
    (dict(num_tokens=2.0), r"`num_tokens` must be an int ≥ 0, got 2.0"),
    (dict(temperature=float("nan")), r"`temperature` must be a finite real ≥ 0, got nan"),
    (dict(temperature=float("inf")), r"`temperature` must be a finite real ≥ 0, got inf"),
    (dict(temperature=-1.0), r"`temperature` must be a finite real ≥ 0, got -1.0"),
    (dict(top_k=0), r"`top_k` must be an int in \[1, vocab_size = 256\] or None, got 0"),
    (dict(top_k=True), r"`top_k` must be an int in \[1, vocab_size = 256\] or None, got True"),
    (dict(top_k=V + 1), r"`top_k` must be an int in \[1, vocab_size = 256\] or None, got 257"),
])
def test_generate_rejects_bad_arguments_by_name(model, changes, expected):
  args = dict(dict(prompt=TOKENS, num_tokens=2), **changes)
  with pytest.raises(ValueError, match="generate: " + expected):
    models.generate(model, args.pop("prompt"), args.pop("num_tokens"), **args)


def test_generate_of_zero_tokens_returns_the_state_after_the_prompt(model):
  tokens, state = models.generate(model, TOKENS, 0)
  assert tokens.shape == (2, 0) and tokens.dtype == jnp.int32 and int(state.position) == TOKENS.shape[1]
  np.testing.assert_allclose(state.logits, models.prefill(model, TOKENS)[0][:, -1], rtol=1e-5, atol=1e-5)
  more, _ = models.generate(model, None, 0, state=state)
  assert more.shape == (2, 0)
  with pytest.raises(ValueError, match="generate: `prompt` has 1 rows but `state` holds 2 sequences"):
    models.generate(model, TOKENS[:1], 1, state=state)


# -- the data pipeline and the trainer ------------------------------------------------------------------------
def test_the_pipeline_checks_every_batch_before_returning_it():
  rows = [{"tokens": np.array([1, 2, 3], np.int32), "targets": np.array([2, 3, 4], np.int32)},
          {"tokens": np.array([1, 2, 3], np.int32), "targets": np.array([2, 9, 4], np.int32)}]
  batches = grain.MapDataset.source(rows).to_iter_dataset().batch(1)
  pipe = data.Pipeline(batches, vocab_size=5, tokenizer=None, signature={})
  assert next(pipe)["tokens"].shape == (1, 3)
  with pytest.raises(pipeline_lib.TokenIdError, match=r"^data: `targets`\[0, 1\] = 9 is outside the vocabulary "
                                                      r"\[0, 5\)$") as info:
    next(pipe)
  assert (info.value.name, info.value.row, info.value.position, info.value.value) == ("targets", 0, 1, 9)


def _batch(tokens):
  return {"tokens": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
          "segment_ids": jnp.zeros((2, 23), jnp.int32), "loss_mask": jnp.ones((2, 23), jnp.float32)}


def test_the_checked_train_step_raises_for_ids_that_bypass_the_host_check(model):
  """A step built by hand and given a batch straight (no pipeline): its error names the bad position; a good
  batch gives no error and the plain step's results."""
  cfg = model.cfg
  params = nnx.state(model, nnx.Param).to_pure_dict()
  tx = optax.sgd(0.1)
  state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
           "rng": jax.random.key_data(jax.random.key(0))}
  plain = make_train_step(graphdef(cfg), tx, loss_chunk=16)
  checked = jax.jit(checked_train_step(plain, V), static_argnums=2)
  error, (_, metrics) = checked(state, _batch(TOKENS), 1)
  checking.throw(error)
  _, want = jax.jit(plain, static_argnums=2)(state, _batch(TOKENS), 1)
  np.testing.assert_allclose(metrics["loss"], want["loss"], rtol=1e-6)

  bad, (row, col) = _bad(V + 3, seed=3)
  error, (_, metrics) = checked(state, _batch(bad), 1)
  name, col = ("tokens", col) if col < 23 else ("targets", col - 1)
  with pytest.raises(ValueError, match=rf"^`{name}`\[{row}, {col}\] = {V + 3} is outside the vocabulary"):
    checking.throw(error)
  seg = np.zeros((2, 23), np.int32)
  seg[1, 5:] = 1
  seg[1, 12] = 0
  error, _ = checked(state, dict(_batch(TOKENS), segment_ids=jnp.asarray(seg)), 4)
  with pytest.raises(ValueError, match=r"`segment_ids` must be non-decreasing along each row, got 1 → 0 at "
                                       r"\[1, 12\]"):
    checking.throw(error)


def _tiny_run() -> ml_collections.ConfigDict:
  c = configs.get_config("tiny")
  c.data.source, c.progress, c.async_checkpoint = "random", False, False
  c.model, c.seq_len, c.batch_size, c.steps, c.log_every, c.checkpoint_every, c.diagnostics_every = \
      "pgdn-tiny", 16, 2, 2, 0, 1, 0
  c.optimizer.warmup_steps = 1
  c.eval_every = 0     # the faults here are the training batches'
  return c


def _pipeline_of_ids_to(monkeypatch, top: int):
  """make_pipeline gives ids in [0, top) but reports the vocabulary 256 (the model's)."""
  real = data.make_pipeline

  def fake(cfg, **kwargs):
    pipe = real(dict(cfg, vocab_size=top), **kwargs)
    pipe.vocab_size = V
    return pipe

  monkeypatch.setattr(loop.data_lib, "make_pipeline", fake)


def test_the_loop_stops_at_a_batch_with_ids_outside_the_vocabulary(tmp_path, monkeypatch):
  _pipeline_of_ids_to(monkeypatch, 1000)
  with pytest.raises(pipeline_lib.TokenIdError, match=r"^step 1: `tokens`\[\d+, \d+\] = \d+ is outside the "
                                                      r"vocabulary \[0, 256\)$"):
    loop.train(_tiny_run(), tmp_path)
  assert not list((tmp_path / "checkpoints").glob("[0-9]*"))


def test_a_failed_device_check_stops_the_loop_before_a_checkpoint(tmp_path, monkeypatch):
  """Ids that get past the host (its check disabled) are caught by the checked step, read before the first
  checkpoint: a ValueError naming the step, not a NaN loss, and nothing saved."""
  _pipeline_of_ids_to(monkeypatch, 1000)
  monkeypatch.setattr(pipeline_lib, "check_token_ids", lambda *args, **kwargs: None)
  message = r"^step 1: `tokens`\[\d+, \d+\] = \d+ is outside the vocabulary \[0, 256\)$"
  with pytest.raises(ValueError, match=message) as info:
    loop.train(_tiny_run(), tmp_path)
  assert not isinstance(info.value, pipeline_lib.TokenIdError)      # the device's check, not the host's
  assert not list((tmp_path / "checkpoints").glob("[0-9]*"))
