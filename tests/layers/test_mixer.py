"""The DGPS token mixer (osdn_jax.layers): one module for every registry point, decoding, packing, init."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from osdn_jax import dgps, diagnostics, layers
from osdn_jax.testing import FP32_TOL, close, rel_rms

FAST_COMPILE = dict(xla_backend_optimization_level=0)   # CPU CI: compile time dominates these tiny runs
D, H = 64, 2
B, T, T0 = 2, 20, 11


def _mixer(name, **kw):
  cfg = layers.MixerConfig(name, d_model=D, num_heads=H, **kw)
  return layers.DGPSMixer(cfg, rngs=nnx.Rngs(0))


def _x(seed=0, b=B, t=T):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(b, t, D)), jnp.float32)


def _assert_close(got, want, what):
  rtol, atol = FP32_TOL
  assert close(got, want, rtol, atol), f"{what}: rel rms {rel_rms(got, want):.3g}"


# -------------------------------------------------------------------------------------------------------------
# Decoding: prefill + one-token steps, and a chunked prefill continued from a cache, equal the full forward.
# -------------------------------------------------------------------------------------------------------------
def _run_split(mixer, fn):
  """jit(fn(merged mixer, *args)) over the mixer's parameters."""
  graphdef, params = nnx.split(mixer)
  jitted = jax.jit(lambda p, *args: fn(nnx.merge(graphdef, p), *args), compiler_options=FAST_COMPILE)
  return lambda *args: jitted(params, *args)


def _decode(m, cache, xs):
  """Token-by-token steps over xs [B, t, D] from cache: ([B, t, D], cache)."""
  cache, ys = jax.lax.scan(lambda c, xt: m.step(xt, c)[::-1], cache, jnp.moveaxis(xs, 1, 0))
  return jnp.moveaxis(ys, 0, 1), cache


# Every axis value the named points use (decays none/scalar/channel/constant/sigmoid, gains σ/1/Longhorn/NLMS,
# preconditioners identity/PDN/ATQ/OSDN/APF/fixed/MesaNet, both solves), with grouped value heads. Every point also
# trains in test_models; the sensitivity of this check: a 10% error in S or 1.5× in the preconditioner's state
# gives a relative error of 1e-2 to 2e-1, against ~3e-7 measured.
DECODE_POINTS = ["dn", "gdn", "kda", "retnet", "gla", "longhorn", "nlms", "pgdn", "pkda", "pmamba2", "osdn",
                 "osdn-apf-kda", "dn-fixed-d", "mesa"]


def test_decode_points_cover_every_axis_value_of_the_named_points():
  points = [dgps.get(n) for n in DECODE_POINTS]
  for axis in ("decay", "gain", "precond", "solve"):
    assert {getattr(p, axis) for p in points} == {getattr(p, axis) for p in dgps.POINTS.values()}, axis


@pytest.mark.parametrize("name", DECODE_POINTS)
def test_mixer_prefill_and_decode_match_the_forward(name):
  mixer = _mixer(name, num_value_heads=2 * H)        # grouped value heads (g = 2) on every point

  def run(m, x):
    y0, cache = m(x[:, :T0], return_cache=True)
    return m(x), y0, _decode(m, cache, x[:, T0:])[0], cache

  full, y0, steps, cache = _run_split(mixer, run)(_x())
  assert full.shape == (B, T, D) and bool(jnp.all(jnp.isfinite(full)))
  _assert_close(y0, full[:, :T0], "prefill")
  _assert_close(steps, full[:, T0:], "token-by-token decode after the prefill")
  dims = mixer.cfg.dims
  assert cache.S.shape == (B, dims.value_heads, dims.key_dim, dims.value_dim) and cache.S.dtype == jnp.float32
  assert cache.conv.shape == (B, 3, 2 * H * dims.key_dim + dims.value_heads * dims.value_dim)
  assert (cache.precond is None) == (not mixer.cfg.point.stateful_precond)


@pytest.mark.parametrize("name", ["pgdn", "osdn-apf-kda", "pgla"])
def test_mixer_state_carries_across_calls(name):
  """Two prefills chained through the cache, and two decode runs chained, equal one call."""
  mixer = _mixer(name)

  def run(m, x):
    y0, cache = m(x[:, :T0], return_cache=True)
    y1, _ = m(x[:, T0:], cache=cache, return_cache=True)
    d0, cache = _decode(m, cache, x[:, T0:T0 + 4])
    d1, _ = _decode(m, cache, x[:, T0 + 4:])
    return m(x), y1, jnp.concatenate([d0, d1], axis=1)

  full, y1, steps = _run_split(mixer, run)(_x(1))
  _assert_close(y1, full[:, T0:], "prefill continued from the cache")
  _assert_close(steps, full[:, T0:], "decode continued from the cache")


# -------------------------------------------------------------------------------------------------------------
# Packed sequences (segment_ids).
# -------------------------------------------------------------------------------------------------------------
SEGMENTS = [[0] * 7 + [1] * 13, [3] * 2 + [5] * 4 + [6] * 14]   # ids only mark boundaries


def _segments():
  """(row, start, end) of every segment of SEGMENTS."""
  out = []
  for b, row in enumerate(SEGMENTS):
    starts = [t for t in range(len(row)) if t == 0 or row[t] != row[t - 1]] + [len(row)]
    out += [(b, s, e) for s, e in zip(starts[:-1], starts[1:])]
  return out


def _alone(x):
  """Every segment as its own row, left-aligned (what follows it cannot reach it: the mixer is causal)."""
  rows = []
  for b, s, e in _segments():
    rows.append(jnp.concatenate([x[b, s:e], jnp.zeros((T - (e - s), x.shape[-1]), x.dtype)]))
  return jnp.stack(rows)


def _compare_packed(packed, alone):
  for n, (b, s, e) in enumerate(_segments()):
    _assert_close(packed[b, s:e], alone[n, :e - s], f"segment {n} (row {b}, tokens {s}..{e - 1})")


def test_short_conv_does_not_leak_across_segment_starts():
  conv = layers.ShortConv(8, 4, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, 8)), jnp.float32)
  seg = jnp.asarray(SEGMENTS, jnp.int32)
  y, _ = conv(x, segment_ids=seg)
  _compare_packed(y, conv(_alone(x))[0])
  # Perturbing a segment changes nothing outside it.
  bumped = x.at[0, :7].add(100.0).at[1, 2:6].add(100.0)
  y2, _ = conv(bumped, segment_ids=seg)
  np.testing.assert_array_equal(np.asarray(y2[0, 7:]), np.asarray(y[0, 7:]))
  np.testing.assert_array_equal(np.asarray(y2[1, :2]), np.asarray(y[1, :2]))
  np.testing.assert_array_equal(np.asarray(y2[1, 6:]), np.asarray(y[1, 6:]))
  # Without segments, the tail carries: the step equals the sequence forward.
  _, tail = conv(x[:, :5])
  y_step, _ = conv.step(x[:, 5], tail)
  _assert_close(y_step, conv(x[:, :6])[0][:, 5], "conv step")


@pytest.mark.parametrize("name", ["dn", "gdn", "kda", "la", "pgdn", "osdn-apf-gdn"])
def test_mixer_packed_sequences_equal_separate_runs(name):
  run = _run_split(_mixer(name), lambda m, x, seg: m(x, segment_ids=seg))
  x = _x(2)
  packed = run(x, jnp.asarray(SEGMENTS, jnp.int32))
  _compare_packed(packed, run(_alone(x), None))


def test_packed_sequences_refuse_a_cache():
  mixer = _mixer("dn")
  with pytest.raises(ValueError, match="segment_ids"):
    mixer(_x(), segment_ids=jnp.asarray(SEGMENTS, jnp.int32), return_cache=True)


# -------------------------------------------------------------------------------------------------------------
# Structure and initialisation.
# -------------------------------------------------------------------------------------------------------------
def _values(tree):
  return jax.tree.map(lambda v: np.asarray(v[...]), tree, is_leaf=lambda v: isinstance(v, nnx.Variable))


@pytest.mark.parametrize("name", ["gdn", "mamba2", "kda", "gla"])
def test_decay_gates_start_in_their_documented_ranges(name):
  mixer = _mixer(name, num_value_heads=2 * H)
  dims = mixer.cfg.dims
  p = _values(mixer.point_params)["decay"]
  hv, k = dims.value_heads, dims.key_dim
  assert p["A_log"].shape == (hv,)
  assert np.all(p["A_log"] >= 0.0) and np.all(p["A_log"] <= np.log(16.0) + 1e-6)   # A ~ U(1, 16)
  assert p["dt_bias"].shape == ((hv,) if mixer.cfg.point.decay == "scalar" else (hv, k))
  dt = np.log1p(np.exp(p["dt_bias"]))                                                # softplus
  assert np.all(dt >= 1e-3 - 1e-7) and np.all(dt <= 0.1 + 1e-7)                    # dt ~ logU(1e-3, 0.1)
  a = mixer.features["decay"]["a"]
  if mixer.cfg.point.decay == "channel":          # low rank D → 16 → HV·K, as in KDA and GLA
    assert a.down.kernel.shape == (D, 16) and a.proj.kernel.shape == (16, hv * k)
  else:
    assert a.down is None and a.proj.kernel.shape == (D, hv)
  assert a.proj.bias is None


def test_preconditioner_parameters_start_as_documented():
  pdn = _values(_mixer("pgdn").point_params)["precond"]
  np.testing.assert_array_equal(pdn["center"], np.full((H,), -0.2, np.float32))      # PDN's center c_h
  assert pdn["A_log"].shape == (H,) and pdn["dt_bias"].shape == (H,)                  # its own (untied) gates
  for options, bias in (((), 8.0), ((("apf_anchor", "init"),), 2.0)):
    point = dgps.get("osdn-apf-gdn", **dict(options))
    r = _mixer(point).features["precond"]["r"]
    np.testing.assert_array_equal(np.asarray(r.proj.bias[...]), np.full((H,), bias, np.float32))
  gain = _mixer("gdn").features["gain"]["b"]
  assert gain.proj.bias is None                                                       # β = σ(W_β x)


def test_every_point_builds_with_fp32_parameters_and_the_kda_family_is_gated():
  for name in dgps.names():
    mixer = _mixer(name)
    leaves = jax.tree.leaves(nnx.state(mixer, nnx.Param))
    assert all(x.dtype == jnp.float32 for x in leaves), name
    gated = name in ("kda", "pkda", "osdn-kda", "osdn-apf-kda")
    assert (mixer.g_proj is not None) == gated, name
    assert set(mixer.features) == {a for a, fs in mixer.cfg.point.features().items() if fs}, name


def test_bad_mixer_configs_name_the_field():
  with pytest.raises(ValueError, match="`num_heads`"):
    layers.MixerConfig("gdn", d_model=64, num_heads=3)
  with pytest.raises(ValueError, match="`num_value_heads`"):
    layers.MixerConfig("gdn", d_model=64, num_heads=2, num_value_heads=3)
  with pytest.raises(ValueError, match="`point`"):
    layers.MixerConfig("gdn2", d_model=64, num_heads=2)
  with pytest.raises(ValueError, match="`chunk_size`"):
    layers.MixerConfig("gdn", d_model=64, num_heads=2, chunk_size=48)
  with pytest.raises(ValueError, match="`dtype`"):
    layers.MixerConfig("gdn", d_model=64, num_heads=2, dtype=jnp.int32)


@pytest.mark.parametrize("name", [pytest.param("pdn", marks=pytest.mark.slow), "osdn-apf-kda"])
def test_diagnostics_recall_residual_weights(name):
  """The recall residual averages over the weighted positions of the rows that have any: weights of ones equal
  no weights, scaling them changes nothing, a row with zero weight drops out (as if it were not in the batch),
  and selecting the first positions gives another value; ‖S_T‖ is the norm of the state the layer returns."""
  m, x = _mixer(name), _x(3)
  every = m.diagnostics(x)
  _assert_close(m.diagnostics(x, jnp.ones(x.shape[:2]))["recall_residual"], every["recall_residual"], "ones")
  _assert_close(m.diagnostics(x, 3.0 * jnp.ones(x.shape[:2]))["recall_residual"], every["recall_residual"], "x3")
  first_row = jnp.zeros(x.shape[:2]).at[0].set(1.0)
  _assert_close(m.diagnostics(x, first_row)["recall_residual"], m.diagnostics(x[:1])["recall_residual"], "row")
  early = jnp.zeros(x.shape[:2]).at[:, :5].set(1.0)
  assert abs(float(m.diagnostics(x, early)["recall_residual"]) - float(every["recall_residual"])) > 1e-4
  _, cache = m(x, return_cache=True)
  norm = jnp.mean(jnp.sqrt(jnp.sum(jnp.square(cache.S.astype(jnp.float32)), axis=(-2, -1))))
  _assert_close(every["state_norm"], norm, "state norm")


@pytest.mark.parametrize("name", ["osdn", "osdn-apf-kda"])
def test_solve_inputs_build_the_layers_own_d_pass(name):
  """The d-pass built from the mixer's solve inputs (`diagnostics.d_pass_inputs`, on the value heads) ends at the d
  the layer's forward returns in its cache."""
  m, x = _mixer(name, num_value_heads=4), _x(4)
  prep = m.solve_inputs(x)
  arrays, opts = diagnostics.d_pass_inputs(m.cfg.point, prep["k"], prep["beta"], prep["features"].get("precond"))
  _, d_last, _, _ = diagnostics.clip_trajectory(**arrays, **opts)
  _, cache = m(x, return_cache=True)
  assert d_last.shape == cache.precond.shape == (B, 4, D // H)
  _assert_close(d_last, cache.precond, "d_{T+1}")
