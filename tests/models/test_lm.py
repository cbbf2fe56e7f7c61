"""Language models (osdn_jax.models): every point trains, decoding equals the forward, configs and counts."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from osdn_jax import dgps, models
from osdn_jax.testing import FP32_TOL, close, every_point, rel_rms

FAST_COMPILE = dict(xla_backend_optimization_level=0)   # CPU CI: compile time dominates these tiny runs
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 33)), jnp.int32)   # tiny vocab is 256


def _tiny(name, **overrides):
  return models.build(f"{name}-tiny", rngs=nnx.Rngs(0), **overrides)


def _loss(model, tokens):
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


# -------------------------------------------------------------------------------------------------------------
# Every point: build, forward, backward, overfit (one jitted train step per point).
# -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", every_point(dgps.names()))
def test_every_point_trains_and_overfits_a_tiny_batch(name):
  """The tiny model of a point builds, its train step has finite loss and nonzero gradient norm, starts near the
  uniform loss and halves it in 15 Adam steps on one batch. (`make test`: the points of COVERING_POINTS.)"""
  model = _tiny(name)
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  @jax.jit(compiler_options=FAST_COMPILE)
  def train_step(state, tokens):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(_loss)(model, tokens)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss, optax.tree.norm(grads)

  losses = []
  for _ in range(15):
    state, loss, grad_norm = train_step(state, TOKENS)
    assert np.isfinite(float(loss)) and np.isfinite(float(grad_norm)) and float(grad_norm) > 0, name
    losses.append(float(loss))
  assert abs(losses[0] - np.log(256)) < 0.5, f"{name}: initial loss {losses[0]:.3f} (uniform: 5.545)"
  assert losses[-1] < 0.5 * losses[0], f"{name}: loss {losses[0]:.3f} → {losses[-1]:.3f}"


# -------------------------------------------------------------------------------------------------------------
# Decoding.
# -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,value_heads", [("pgdn", None), ("osdn-apf-kda", 4)])
def test_prefill_then_decode_equals_the_forward(name, value_heads):
  model = _tiny(name, num_value_heads=value_heads)
  graphdef, params = nnx.split(model)
  tokens, t0 = TOKENS[:, :24], 13

  @jax.jit(compiler_options=FAST_COMPILE)
  def run(params, tokens):
    m = nnx.merge(graphdef, params)
    logits0, cache = m(tokens[:, :t0], return_cache=True)
    _, logits1 = jax.lax.scan(lambda c, tok: m.step(tok, c)[::-1], cache, tokens[:, t0:].T)
    return m(tokens), jnp.concatenate([logits0, jnp.moveaxis(logits1, 0, 1)], axis=1)

  full, decoded = run(params, tokens)
  assert close(decoded, full, *FP32_TOL), f"rel rms {rel_rms(decoded, full):.3g}"


def test_generate_is_greedy_under_the_forward_and_chains_through_its_state():
  model = _tiny("osdn-apf-gdn", num_value_heads=4)
  prompt = TOKENS[:, :7]
  first, state = models.generate(model, prompt, 3)
  second, state = models.generate(model, None, 3, state=state)
  greedy = jnp.concatenate([first, second], axis=1)
  assert greedy.dtype == jnp.int32 and int(state.position) == 13
  logits = jax.jit(lambda tokens: model(tokens), compiler_options=FAST_COMPILE)(
      jnp.concatenate([prompt, greedy], axis=1))
  np.testing.assert_array_equal(np.asarray(jnp.argmax(logits[:, 6:12], -1)), np.asarray(greedy))
  assert close(state.logits, logits[:, -1], *FP32_TOL)

  # Sampling: two chained calls draw what one call draws (token n uses fold_in(rng, n)).
  sample = dict(temperature=0.8, top_k=5, rng=jax.random.key(3))
  one, _ = models.generate(model, prompt, 6, **sample)
  first, state = models.generate(model, prompt, 3, **sample)
  second, _ = models.generate(model, None, 3, state=state, **sample)
  np.testing.assert_array_equal(np.asarray(jnp.concatenate([first, second], axis=1)), np.asarray(one))
  assert int(jnp.min(one)) >= 0 and int(jnp.max(one)) < 256

  # The public jitted prefill and step agree with the forward.
  _, cache = models.prefill(model, prompt)
  step_logits, _ = models.step(model, greedy[:, 0], cache)
  assert close(step_logits, logits[:, 7], *FP32_TOL)

  with pytest.raises(ValueError, match="rng"):
    models.generate(model, prompt, 2, temperature=1.0)


# -------------------------------------------------------------------------------------------------------------
# Configs, parameter counts, summary, dtypes.
# -------------------------------------------------------------------------------------------------------------
def test_named_configs():
  names = models.names()
  assert len(names) == len(dgps.names()) * len(models.SIZES) and "pgdn-340m" in names and "osdn-apf-kda-1.3b" in names
  c = models.config("pgdn-340m")
  assert (c.variant, c.d_model, c.num_heads, c.num_layers, c.vocab_size, c.hidden) == \
      ("pgdn", 1024, 8, 24, 32000, 2816)
  assert c.mixer.dims == dgps.Dims(heads=8, value_heads=8, key_dim=128, value_dim=128)
  assert models.config("gdn-1b").hidden == 4864 and models.config("gdn-1.3b").hidden == 5632
  assert models.config("OSDN-APF-GDN-Tiny").point is dgps.get("osdn-apf-gdn")
  assert models.config("pdn-tiny", point_options={"x": 2.0}).point.opts["x"] == 2.0


def test_parameter_counts_of_the_named_configs():
  for name in ("gdn-340m", "pgdn-340m"):
    n = models.count_params(name)
    assert abs(n - 340e6) <= 0.03 * 340e6, f"{name}: {n:,}"
  assert models.count_params("gdn-340m") == 341_791_104        # FLA's GDN recipe: 341.8M (tied, no gate)
  assert 1.25e9 < models.count_params("dn-1.3b") < 1.35e9      # DeltaNet 1.3B
  # The abstract count is the count of a real model.
  model = _tiny("osdn-apf-kda", num_value_heads=4)
  assert models.count_params(model) == models.count_params(model.cfg)
  parts, _ = models.param_counts(model)
  assert parts["embeddings"] == 256 * 64 and parts["norms"] == 5 * 64 and parts["mlps"] == 2 * 3 * 64 * 256


def test_summary_reports_parts_flops_and_state():
  s = models.summary("pgdn-340m", context_length=4096)
  text = str(s)
  for word in ("embeddings", "mixers", "MLPs", "norms", "FLOPs per token", "recurrent state"):
    assert word in text
  assert s.params["total"] == models.count_params("pgdn-340m")
  assert sum(s.mixer_parts.values()) == s.params["mixers"]
  # S: 24 layers × [8, 128, 128] fp32; PDN second moment 24 × [8, 128] fp32; conv tails 24 × 3 × 3072 fp32.
  assert s.state == dict(S=24 * 8 * 128 * 128 * 4, precond=24 * 8 * 128 * 4, conv=24 * 3 * 3072 * 4,
                         total=s.state["S"] + s.state["precond"] + s.state["conv"])
  assert s.flops["dense"] > 2 * (s.params["total"] - s.params["embeddings"])
  assert s.flops["total"] > s.flops["dense"] > 0
  print("\n" + text)


def test_bf16_compute_keeps_fp32_parameters():
  fp32, bf16 = _tiny("pgdn"), _tiny("pgdn", dtype=jnp.bfloat16)
  assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(nnx.state(bf16, nnx.Param)))
  forward = jax.jit(lambda state, tokens, graphdef: nnx.merge(graphdef, state)(tokens), static_argnums=2,
                    compiler_options=FAST_COMPILE)
  y32 = forward(nnx.state(fp32), TOKENS, nnx.graphdef(fp32))
  y16 = forward(nnx.state(bf16), TOKENS, nnx.graphdef(bf16))
  assert y16.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(y16)))
  assert rel_rms(y16, y32) < 3e-2


@pytest.mark.slow
def test_unrolled_layers_equal_the_scan():
  """`scan_layers=False` computes the function and gradients of the scanned stack, without the loop over layers."""
  scanned, unrolled = _tiny("pgdn"), _tiny("pgdn", scan_layers=False)
  graph_s, params = nnx.split(scanned, nnx.Param)
  graph_u = nnx.split(unrolled, nnx.Param)[0]
  loss = lambda graph, p: _loss(nnx.merge(graph, p), TOKENS)
  (ls, gs), (lu, gu) = (jax.value_and_grad(loss, argnums=1)(g, params) for g in (graph_s, graph_u))
  np.testing.assert_allclose(lu, ls, rtol=1e-6)
  assert max(jax.tree.leaves(jax.tree.map(rel_rms, gu, gs))) < 1e-5   # fp32 rounding of other fusions
  loops = lambda graph: jax.jit(loss, static_argnums=0).lower(graph, params).as_text().count("stablehlo.while")
  assert loops(graph_u) < loops(graph_s)


@pytest.mark.slow     # `make test`: PDN with x = 1 is its backbone (tests/dgps/test_points.py)
def test_pgdn_with_a_unit_key_scale_is_gdn():
  """PDN's key scale lies in [1/x, x], so at x = 1 the write key is the key: PGDN is then GDN plus parameters that
  change nothing (its preconditioner's gates and center). With GDN's parameters copied from it, the logits and the
  gradients of the shared parameters are GDN's (to fp32 rounding: PGDN's solve takes its write key as a second
  key), and the extra parameters' gradients are exactly 0."""
  pgdn, gdn = _tiny("pgdn", point_options={"x": 1.0}), models.build("gdn-tiny", rngs=nnx.Rngs(1))
  p_state = dict(nnx.to_flat_state(nnx.state(pgdn, nnx.Param)))
  g_state = dict(nnx.to_flat_state(nnx.state(gdn, nnx.Param)))
  assert set(g_state) < set(p_state)
  for path, var in g_state.items():
    var.set_value(p_state[path].get_value())
  nnx.update(gdn, nnx.from_flat_state(g_state))
  assert rel_rms(pgdn(TOKENS), gdn(TOKENS)) < 1e-6
  grads = lambda model: dict(nnx.to_flat_state(nnx.grad(_loss)(model, TOKENS)))
  p_grads, g_grads = grads(pgdn), grads(gdn)
  for path, g in p_grads.items():
    if path in g_grads:
      assert rel_rms(g.get_value(), g_grads[path].get_value()) < 1e-5, path
    else:
      assert not np.any(np.asarray(g.get_value())), path


@pytest.mark.parametrize("overrides,field", [
    (dict(num_heads=3), "`num_heads`"),
    (dict(num_value_heads=3), "`num_value_heads`"),
    (dict(vocab_size=0), "`vocab_size`"),
    (dict(chunk_size=48), "`chunk_size`"),
    (dict(dtype=jnp.int8), "`dtype`"),
    (dict(scan_layers=0), "`scan_layers`"),
])
def test_bad_configs_raise_value_errors_naming_the_field(overrides, field):
  with pytest.raises(ValueError, match=field):
    models.config("gdn-tiny", **overrides)


def test_unknown_variants_and_sizes():
  with pytest.raises(ValueError, match="`variant`"):
    models.config("gdnx-340m")
  with pytest.raises(ValueError, match="`variant`"):
    models.ModelConfig(variant="transformer", vocab_size=256, d_model=64, num_layers=2, num_heads=2)
  with pytest.raises(ValueError, match="size"):
    models.config("gdn-7b")
