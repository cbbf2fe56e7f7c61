"""Bad arguments are a one-line `ValueError` naming the argument (and what it should be) before anything is traced:
ids, names, states, caches, flags and sizes that used to pass with a wrong result or fail with another error."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from osdn_jax import dgps, models, ops
from osdn_jax.data import TextSource
from osdn_jax.ops import context
from osdn_jax.testing import random_point_inputs
from osdn_jax.train import configs

B, T, H, K = 2, 4, 1, 4
DIMS = dgps.Dims(heads=1, value_heads=2, key_dim=4, value_dim=4)   # H ≠ HV: a head-count mix-up shows


def _qkv(hv=H):
  rng = np.random.default_rng(0)
  f = lambda *s: rng.standard_normal(s).astype(np.float32)
  return f(B, T, H, K), f(B, T, H, K), f(B, T, hv, K), np.full((B, T, hv), 0.5, np.float32)


# --- ops ---------------------------------------------------------------------------------------------------------
def test_segment_ids_that_do_not_fit_int32_with_x64_off():
  """int64 ids ≥ 2³¹ would be truncated to int32 by the cast, merging segments: they are refused by value."""
  q, k, v, beta = _qkv()
  ids = np.array([[0, 0, 2 ** 32, 2 ** 32], [1, 1, 1, 1]], np.int64)
  with jax.enable_x64(False):
    with pytest.raises(ValueError, match=r"delta_rule: `segment_ids` must be ids in \[-2147483648, 2147483647\].*"
                                         r"got 4294967296 at \[0, 2\]"):
      ops.delta_rule(q, k, v, beta, segment_ids=ids, implementation="reference")
    fits = np.minimum(ids, 2 ** 31 - 1)                # int64 ids that fit int32 are fine: 3 segments
    _, S = ops.delta_rule(q, k, v, beta, segment_ids=fits, output_final_state=True, implementation="reference")
    assert S.shape == (3, H, K, K)


def test_scale_given_as_a_string_and_q_as_a_list():
  q, k, v, beta = _qkv()
  with pytest.raises(ValueError, match=r"delta_rule: `scale` must be a real scalar or None, got '1'"):
    ops.delta_rule(q, k, v, beta, scale="1")
  with pytest.raises(ValueError, match=r"linear_attention: `q` must be an array \(jax.Array or numpy.ndarray\), "
                                       "got list"):
    ops.linear_attention(q.tolist(), k, v)
  with pytest.raises(ValueError, match=r"delta_rule_step: `beta` must be an array"):
    ops.delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0].tolist(), np.zeros((B, H, K, K), np.float32))


def test_output_final_state_must_be_a_bool():
  q, k, v, beta = _qkv()
  with pytest.raises(ValueError, match="delta_rule: `output_final_state` must be a bool, got 'no'"):
    ops.delta_rule(q, k, v, beta, output_final_state="no")
  with pytest.raises(ValueError, match="linear_attention: `output_final_state` must be a bool, got 0"):
    ops.linear_attention(q, k, v, output_final_state=0)


def _context_solve(initial_state, *, segment_ids=None, **kw):
  q, k, v, beta = _qkv()
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("context",))
  tok = jax.sharding.PartitionSpec(None, "context")
  seg = [] if segment_ids is None else [segment_ids]

  def body(q, k, v, beta, *seg):
    return context.delta_rule(q, k, v, beta, axis_name="context", initial_state=initial_state,
                              segment_ids=seg[0] if seg else None, **dict(dict(output_final_state=True), **kw))
  return jax.shard_map(body, mesh=mesh, in_specs=(tok,) * (4 + len(seg)),
                       out_specs=(tok, jax.sharding.PartitionSpec()), check_vma=False)(q, k, v, beta, *seg)


def test_context_initial_state_of_the_wrong_shape():
  with pytest.raises(ValueError, match=r"context.delta_rule: `initial_state` must be of shape \[B, HV, K, V\] = "
                                       r"\(2, 1, 4, 4\), got shape \(2, 1, 4, 5\)"):
    _context_solve(np.zeros((B, H, K, K + 1), np.float32))
  with pytest.raises(ValueError, match=r"`initial_state` must be of shape \[B, HV, K, V\] = \(2, 1, 4, 4\), got "
                                       r"shape \(3, 1, 4, 4\)"):
    _context_solve(np.zeros((B + 1, H, K, K), np.float32))
  ids = np.array([[0, 0, 1, 1], [0, 1, 1, 1]], np.int32)
  with pytest.raises(ValueError, match=r"`initial_state` must be of shape \[N, HV, K, V\] = \(4, 1, 4, 4\), got "
                                       r"shape \(4, 2, 4, 4\)"):
    _context_solve(np.zeros((4, 2, K, K), np.float32), segment_ids=ids)
  with pytest.raises(ValueError, match="context.delta_rule: `output_final_state` must be a bool, got 'no'"):
    _context_solve(None, output_final_state="no")


# --- dgps --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [123, None, b"gdn"], ids=["int", "None", "bytes"])
def test_registry_names_must_be_strings(name):
  with pytest.raises(ValueError, match=rf"dgps.get: `name` must be a registry name \(a str\), got {name!r}"):
    dgps.get(name)


def test_model_config_names_must_be_strings():
  with pytest.raises(ValueError, match=r"models.config: `name` must be a config name '<point>-<size>' .*got 123"):
    models.config(123)


def _point(name):
  point = dgps.get(name)
  q, k, v, f, prm = random_point_inputs(point, DIMS, 0, B=B, T=3)
  return point, (q, k, v, f, prm), (q[:, 0], k[:, 0], v[:, 0], jax.tree.map(lambda x: x[:, 0], f), prm)


@pytest.mark.parametrize("name,shape,want", [
    ("pgdn", (B, 2, 4), r"\[B, H, K\] = \(2, 1, 4\), got shape \(2, 2, 4\)"),     # OSDN's [B, HV, K] given to PDN
    ("pgdn", (1, 1, 4), r"\[B, H, K\] = \(2, 1, 4\), got shape \(1, 1, 4\)"),
    ("osdn", (B, 1, 4), r"\[B, HV, K\] = \(2, 2, 4\), got shape \(2, 1, 4\)"),
    ("gdn", (B, 1, 4), r"must be None \(precond 'identity' carries no state\), got shape \(2, 1, 4\)"),
], ids=["pgdn-heads", "pgdn-rows", "osdn-heads", "gdn-stateless"])
def test_a_preconditioner_state_of_the_wrong_shape(name, shape, want):
  point, seq, tok = _point(name)
  state = dict(point.initial_state(B, DIMS), precond=jnp.zeros(shape))
  match = rf"DGPS point {name!r}: `state\[\"precond\"\]` " + (want if name == "gdn" else
                                                             "must be the preconditioner's state of shape " + want)
  with pytest.raises(ValueError, match=match):
    point.step(*tok, state)
  with pytest.raises(ValueError, match=match):
    point(*seq, state=state)


def test_step_needs_the_solve_state_and_a_stateful_preconditioners_state():
  point, _, tok = _point("pgdn")
  state = point.initial_state(B, DIMS)
  with pytest.raises(ValueError, match=r"DGPS point 'pgdn': `state` must hold \"S\", the solve's state "
                                       r"\[B, HV, K, V\] = \(2, 2, 4, 4\)"):
    point.step(*tok, {"precond": state["precond"]})
  with pytest.raises(ValueError, match=r"`state\[\"precond\"\]` must be the preconditioner's state \[B, H, K\] = "
                                       r"\(2, 1, 4\) \(`Point.initial_state`\), got None"):
    point.step(*tok, {"S": state["S"], "precond": None})


# --- models: decoding caches -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
  pgdn, gdn = models.build("pgdn-tiny", rngs=nnx.Rngs(0)), models.build("gdn-tiny", rngs=nnx.Rngs(0))

  def cache(model, batch, layers=None):
    cfg, d = model.cfg, model.cfg.mixer.dims
    lead = (layers or cfg.num_layers, batch)
    conv = lead + (cfg.conv_size - 1, 2 * d.heads * d.key_dim + d.value_heads * d.value_dim)
    precond = jnp.zeros(lead + (d.heads, d.key_dim)) if model.cfg.point.stateful_precond else None
    return models.Cache(jnp.zeros(lead + (d.value_heads, d.key_dim, d.value_dim)), precond, jnp.zeros(conv))
  return pgdn, gdn, cache


def test_a_cache_of_another_batch_size_or_layer_count(tiny):
  pgdn, _, cache = tiny
  token, tokens = jnp.zeros((3,), jnp.int32), jnp.zeros((3, 2), jnp.int32)
  with pytest.raises(ValueError, match=r"step: `cache` holds 2 sequences, the input has 3 \(`cache.S` must be "
                                       r"\[L, B, HV, K, V\] = \(2, 3, 2, 32, 32\), got \(2, 2, 2, 32, 32\)\)"):
    models.step(pgdn, token, cache(pgdn, 2))
  with pytest.raises(ValueError, match="prefill: `cache` holds 2 sequences, the input has 3"):
    models.prefill(pgdn, tokens, cache=cache(pgdn, 2))
  with pytest.raises(ValueError, match="step: `cache` holds 3 layers, the model has 2"):
    models.step(pgdn, token, cache(pgdn, 3, layers=3))
  with pytest.raises(ValueError, match=r"DGPSMixer.step: `cache` must hold B = 3 sequences"):
    pgdn.step(token, cache(pgdn, 2))


def test_a_cache_of_another_point(tiny):
  pgdn, gdn, cache = tiny
  token = jnp.zeros((2,), jnp.int32)
  with pytest.raises(ValueError, match=r"step: `cache` is not a 'pgdn' model's \(`cache.precond` must be "
                                       r"\(2, 2, 2, 32\), got None"):
    models.step(pgdn, token, cache(gdn, 2))
  with pytest.raises(ValueError, match="prefill: `cache` is not a 'pgdn' model's"):
    models.prefill(pgdn, token[:, None], cache=cache(gdn, 2))
  with pytest.raises(ValueError, match=r"step: `cache` is not a 'gdn' model's"):
    models.step(gdn, token, cache(pgdn, 2))
  with pytest.raises(ValueError, match=r"DGPS point 'pgdn': `state\[\"precond\"\]` .* got None"):
    pgdn.step(token, cache(gdn, 2))


# --- data, experiments, training ---------------------------------------------------------------------------------
def test_a_corpus_file_that_is_not_utf8_is_named(tmp_path):
  (tmp_path / "good.txt").write_text("To be, or not to be.\n", encoding="utf-8")
  (tmp_path / "latin1.txt").write_bytes("Ay, there's the rub: caf\u00e9.\n".encode("latin-1"))
  with pytest.raises(ValueError, match=r"TextSource: .*latin1\.txt is not UTF-8 text \(byte 0xe9 at offset 24\)"):
    TextSource(tmp_path)


def test_mqar_kv_that_fits_no_length():
  from experiments import mqar
  with pytest.raises(ValueError, match=r"mqar: `kv` 100 fits none of `lengths` \(32,\): a cell needs 4·kv ≤ L"):
    mqar.check_grid((32,), (4, 100))
  with pytest.raises(ValueError, match=r"`kv` 100 fits none of `lengths` \(256,\)"):
    mqar.Sweep(lengths=(256,), kv=(16, 100))       # `python -m experiments.recall --kv=100`'s sweep
  with pytest.raises(ValueError, match=r"`train_kv` 16 fits none of `lengths` \(32,\)"):
    mqar.Sweep(lengths=(32,), kv=(4,), train_kv=16)
  assert mqar.Sweep(lengths=(32, 64), kv=(4, 16)).cells() == [(32, 4), (64, 4), (64, 16)]


def test_context_parallelism_must_divide_seq_len():
  c = configs.get_config("tiny")
  c.mesh.context, c.seq_len = 2, 63
  with pytest.raises(ValueError, match=r"train config: `mesh.context` \(2\) must divide `seq_len` \(63\)"):
    configs.validate(c)
  c.seq_len = 64
  configs.validate(c)
