"""The DGPS axes: preconditioners against their token-serial references, the paper identities, the registry.
(PDN's and ATQ's scans against their loops on drawn problems: tests/ops/test_properties.py.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osdn_jax import diagnostics, dgps, ops
from osdn_jax.dgps import precond
from osdn_jax.testing import COVERING_POINTS, close, every_point, random_point_inputs, random_problem, rel_rms

DECAYS = ("none", "scalar", "channel")
TIGHT = 1e-12   # fp64 fast form vs fp64 reference


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _gates(seed, B=2, T=50, H=2, HV=4, K=8):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.normal(size=s))
  sig = lambda x: jax.nn.sigmoid(x)
  return dict(k=jnp.asarray(_unit(rng.normal(size=(B, T, H, K)))), q=f(B, T, H, K),
              beta_p=sig(f(B, T, H)), log_decay_p=jax.nn.log_sigmoid(f(B, T, H) + 2.0), center=f(H) * 0.3,
              A0=jnp.abs(f(B, H, K)), beta=sig(f(B, T, HV)), retention=sig(f(B, T, HV) + 2.0),
              d0=jnp.abs(f(B, HV, K)) + 0.5)


def _grads(fn, args, seed=3):
  """Values and gradients of a random projection of fn(*args) (all outputs) w.r.t. every arg."""
  out = fn(*args)
  rng = np.random.default_rng(seed)
  ws = jax.tree.map(lambda o: jnp.asarray(rng.normal(size=o.shape)), out)
  loss = lambda *a: sum(jnp.sum(o * w) for o, w in zip(jax.tree.leaves(fn(*a)), jax.tree.leaves(ws)))
  return out, jax.grad(loss, argnums=tuple(range(len(args))))(*args)


def _assert_same(fast, ref, tol=TIGHT):
  for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(ref)):
    assert rel_rms(a, b) < tol, rel_rms(a, b)


@pytest.mark.parametrize("anchor", ["zero", "init"])
@pytest.mark.parametrize("learned_r", [False, True], ids=["r=1", "apf"])
def test_osdn_chunked_equals_sequential(anchor, learned_r):
  g = _gates(2)
  beta = g["beta"].at[:, ::9].set(0.0)                 # β = 0 tokens: the chunked form must stay finite
  r = g["retention"].at[:, 5].set(0.0) if learned_r else None   # and r = 0 (full forgetting)

  def run(impl):
    def fn(k, beta, r, d0):
      return precond.osdn_write_key(k, beta, retention=r, eta=0.8, d_init=0.9, d_min=None, d_max=None,
                                    apf_anchor=anchor, initial_state=d0, implementation=impl, chunk_size=16)
    return fn

  args = (g["k"], beta, r, g["d0"]) if learned_r else (g["k"], beta, g["d0"])
  wrap = (lambda f: f) if learned_r else (lambda f: lambda k, b, d0: f(k, b, None, d0))
  fast = _grads(wrap(run("xla")), args)            # unclipped and unpacked: the exact chunked form
  ref = _grads(wrap(run("reference")), args)
  _assert_same(fast, ref, 1e-11)
  jax.tree.map(lambda x: np.testing.assert_(np.all(np.isfinite(np.asarray(x)))), fast)


@pytest.mark.parametrize("which", ["pdn", "atq", "osdn-seq", "osdn-chunked", "apf"])
def test_preconditioner_chaining(which):
  """Two halves through the preconditioner's final state equal one run."""
  g = _gates(4, T=60)

  def run(sl, state):
    cut = lambda x: x[:, sl]
    if which == "pdn":
      return precond.pdn_write_key(cut(g["k"]), cut(g["beta_p"]), cut(g["log_decay_p"]), g["center"],
                                   initial_state=state)
    if which == "atq":
      return precond.atq_query(cut(g["q"]), cut(g["k"]), cut(g["beta_p"]), cut(g["log_decay_p"]),
                               initial_state=state)
    bounded = which != "osdn-chunked"
    return precond.osdn_write_key(
        cut(g["k"]), cut(g["beta"]), retention=cut(g["retention"]) if which == "apf" else None,
        d_min=0.0 if bounded else None, d_max=8.0 if bounded else None, initial_state=state, chunk_size=16)

  whole, s = run(slice(None), None)
  a, s1 = run(slice(0, 23), None)
  b, s2 = run(slice(23, None), s1)
  _assert_same((jnp.concatenate([a, b], 1), s2), (whole, s))


@pytest.mark.parametrize("decay", DECAYS)
def test_pdn_with_x_one_is_the_backbone(decay):
  p = random_problem(5, T=40, decay=decay)
  a = p.arrays(jnp.float64, jnp.float64, jnp.float64)
  g = _gates(5, T=40)
  k_write, _ = precond.pdn_write_key(a["k"], g["beta_p"], g["log_decay_p"], g["center"], x=1.0)
  np.testing.assert_array_equal(np.asarray(k_write), np.asarray(a["k"]))
  o1, _ = ops.delta_rule(a["q"], a["k"], a["v"], a["beta"], k_write=k_write, log_decay=a["log_decay"])
  o2, _ = ops.delta_rule(a["q"], a["k"], a["v"], a["beta"], log_decay=a["log_decay"])
  np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_osdn_without_learning_is_deltanet(impl):
  p = random_problem(6, T=40, H=2, HV=4, decay="scalar")
  a = p.arrays(jnp.float64, jnp.float64, jnp.float64)
  k_write, d = precond.osdn_write_key(a["k"], a["beta"], eta=0.0, d_init=1.0, guard=None, d_min=None,
                                      d_max=None, implementation=impl, chunk_size=16)
  np.testing.assert_allclose(np.asarray(k_write), np.repeat(np.asarray(a["k"]), 2, axis=2), rtol=0, atol=1e-15)
  np.testing.assert_allclose(np.asarray(d), 1.0, rtol=0, atol=1e-15)


def _adversarial_keys(seed, B=2, T=200, H=2, K=16):
  """L2-normalised keys built to stress a diagonal preconditioner: spiky (one dominant channel), repeated
  (the same key many times, so A grows on few channels) and isotropic, mixed."""
  rng = np.random.default_rng(seed)
  iso = rng.normal(size=(B, T, H, K))
  spiky = rng.normal(size=(B, T, H, K)) * 0.05
  spiky[..., 0] += 3.0 * np.sign(rng.normal(size=(B, T, H)))
  repeat = np.broadcast_to(rng.normal(size=(B, 1, H, K)), (B, T, H, K))
  pick = rng.integers(0, 3, size=(B, T, H, 1))
  return jnp.asarray(_unit(np.where(pick == 0, iso, np.where(pick == 1, spiky, repeat))))


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("which", ["pdn", "osdn", "osdn-apf"])
def test_guard_keeps_every_step_stable(which, decay):
  k = _adversarial_keys(7)
  rng = np.random.default_rng(7)
  B, T, H, K = k.shape
  beta = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(B, T, H)) * 3 + 2))           # β ≤ 1, often ≈ 1
  if which == "pdn":
    k_write, _ = precond.pdn_write_key(k, beta, jax.nn.log_sigmoid(jnp.asarray(rng.normal(size=(B, T, H)))),
                                       jnp.asarray([-3.0, 2.0]), x=2.0)
  else:
    r = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(B, T, H)))) if which == "osdn-apf" else None
    k_write, _ = precond.osdn_write_key(k, beta, retention=r, eta=4.0, d_init=3.0)   # aggressive learning
  s = beta * jnp.sum(k * k_write, -1)
  assert float(jnp.min(s)) >= 0.0 and float(jnp.max(s)) <= 2.0 + 1e-12
  g = None if decay == "none" else jax.nn.log_sigmoid(
      jnp.asarray(rng.normal(size=(B, T, H) if decay == "scalar" else (B, T, H, K))))
  eig = diagnostics.step_eigenvalues(k[:, :60], beta[:, :60], k_write[:, :60],
                                     None if g is None else g[:, :60])
  assert float(np.max(np.abs(eig))) <= 1.0 + 1e-9


def test_theorem_3_1_exact_atk_equals_exact_atq():
  """PDN paper Thm 3.1 (β-weighted, λ = 1, no decay, S_0 = 0): exact-ATK DeltaNet = exact-ATQ linear attention."""
  rng = np.random.default_rng(8)
  B, T, H, K, V = 2, 64, 2, 8, 5
  q = jnp.asarray(rng.normal(size=(B, T, H, K)))
  k = jnp.asarray(rng.normal(size=(B, T, H, K)))
  v = jnp.asarray(rng.normal(size=(B, T, H, V)))
  beta = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(B, T, H))))
  k_write, _ = precond.exact_write_key(k, beta, lam=1.0)
  q_tilde, _ = precond.exact_query(q, k, beta, lam=1.0)
  o_atk, _ = ops.delta_rule(q, k, v, beta, k_write=k_write, scale=1.0, implementation="naive")
  o_atq, _ = ops.linear_attention(q_tilde, k, v, beta=beta, scale=1.0, implementation="naive")
  assert rel_rms(o_atk, o_atq) <= 1e-10
  o_xla, _ = ops.delta_rule(q, k, v, beta, k_write=k_write, scale=1.0, implementation="xla", chunk_size=16)
  assert rel_rms(o_xla, o_atq) <= 1e-10


def test_covering_points_take_every_axis_value():
  """COVERING_POINTS (what `make test` runs of the every-point tests) take every value of every axis that the
  named points take."""
  points = [dgps.get(n) for n in COVERING_POINTS]
  for axis in ("decay", "gain", "precond", "solve"):
    assert {getattr(p, axis) for p in points} == {getattr(p, axis) for p in dgps.POINTS.values()}, axis


@pytest.mark.parametrize("name", every_point(dgps.names()))
def test_every_point_runs_and_matches_its_serial_composition(name):
  """A point (preconditioner pass and solve, fp32, XLA) against its own token-serial composition in fp64:
  outputs, states and the gradients of every input, feature and parameter. (`make test`: COVERING_POINTS.)"""
  point = dgps.get(name)
  dims = dgps.Dims(heads=2, value_heads=4, key_dim=16, value_dim=8)
  q, k, v, features, params = random_point_inputs(point, dims, seed=len(name))

  def run(impl, dtype):
    cast = lambda t: jax.tree.map(lambda x: x.astype(dtype), t)

    def loss_and_out(q, k, v, features, params):
      o, st = point(q, k, v, features, params, output_final_state=True, chunk_size=16, implementation=impl)
      w = jnp.cos(jnp.arange(o.size, dtype=o.dtype)).reshape(o.shape)
      return jnp.sum(o * w) + jnp.sum(jnp.sin(st["S"])), (o, st)

    (_, out), grads = jax.jit(jax.value_and_grad(loss_and_out, argnums=(0, 1, 2, 3, 4), has_aux=True))(
        *cast((q, k, v, features, params)))
    return out, grads

  (o, st), grads = run("xla", jnp.float32)
  (o_ref, st_ref), grads_ref = run("naive", jnp.float64)
  jax.tree.map(lambda x: np.testing.assert_(np.all(np.isfinite(np.asarray(x)))), (o, st, grads))
  assert close(o, o_ref, 1e-5, 1e-6) and close(st["S"], st_ref["S"], 1e-5, 1e-6)
  if st["precond"] is not None:
    assert close(st["precond"], st_ref["precond"], 1e-5, 1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    assert close(a, b, 1e-4, 1e-6), rel_rms(a, b)


def test_registry_keys_and_errors():
  assert {"dn", "gdn", "kda", "pdn", "pgdn", "pkda", "osdn", "osdn-gdn", "osdn-kda", "osdn-apf",
          "osdn-apf-gdn", "osdn-apf-kda", "dn-fixed-d", "la", "retnet", "mamba2", "gla", "pla", "pmamba2",
          "pgla", "mesa", "longhorn", "nlms"} == set(dgps.names())
  assert all(dgps.get(n).doc for n in dgps.names())
  assert dgps.get("PGDN").precond == "pdn" and dict(dgps.get("pgdn", x=2.0).options)["x"] == 2.0
  point = dgps.compose(decay="channel", precond="osdn-apf", apf_anchor="init")
  assert point.opts["apf_bias"] == 2.0 and point.feature_shapes(dgps.Dims(2, 2, 8, 8))["precond"]["r"] == (2,)
  with pytest.raises(ValueError, match="unknown point"):
    dgps.get("mesanet")
  with pytest.raises(ValueError, match="`decay`"):
    dgps.compose(decay="cubic")
  with pytest.raises(ValueError, match="sets the read query, which the 'online' solve does not read"):
    dgps.compose(precond="atq", solve="online")
  with pytest.raises(ValueError, match="sets the write key, which the 'offline' solve does not read"):
    dgps.compose(precond="pdn", solve="offline")
  with pytest.raises(ValueError, match="unknown options"):
    dgps.get("pdn", eta=1.0)
  with pytest.raises(ValueError, match="`value_heads`"):
    dgps.Dims(heads=3, value_heads=4, key_dim=8, value_dim=8)


_LENS = ((5, 1, 20, 14), (16, 24))   # two rows: a length-1 segment, boundaries on and off chunk edges


def _packed(point, dims, seed, dtype=jnp.float32):
  seg = np.stack([np.concatenate([np.full(n, i) for i, n in enumerate(row)]) for row in _LENS])
  return random_point_inputs(point, dims, seed, B=2, T=40, dtype=dtype), jnp.asarray(seg, jnp.int32)


@pytest.mark.parametrize("name", ["pgdn", "pkda", "pmamba2", "osdn-apf-gdn", "osdn-unbounded"])
def test_packed_points_equal_separate_segments(name):
  """Packed preconditioners and solves: every state restarts per segment, values and gradients."""
  point = dgps.get("osdn", d_min=None, d_max=None) if name == "osdn-unbounded" else dgps.get(name)
  dims = dgps.Dims(heads=2, value_heads=4, key_dim=8, value_dim=8)
  (q, k, v, f, prm), seg = _packed(point, dims, seed=3)
  s0 = point.initial_state(len(sum(_LENS, ())), dims)
  # Non-zero per-segment initial states (positive, as a second moment or a write scale must be).
  s0 = jax.tree.map(lambda x: x + 0.1 * (1.5 + jnp.cos(jnp.arange(x.size, dtype=x.dtype))).reshape(x.shape), s0)

  def run(impl, dtype):
    cast = lambda t: jax.tree.map(lambda x: x.astype(dtype), t)

    def loss(q, k, v, f, prm, s0):
      o, st = point(q, k, v, f, prm, state=s0, segment_ids=seg, output_final_state=True, chunk_size=16,
                    implementation=impl)
      w = jnp.cos(jnp.arange(o.size, dtype=o.dtype)).reshape(o.shape)
      return jnp.sum(o * w) + jnp.sum(jnp.sin(st["S"])) + jnp.sum(jnp.sin(st["precond"])), (o, st)

    grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))   # one compile
    return grad_fn(*cast((q, k, v, f, prm, s0)))

  (_, (o, st)), grads = run("xla", jnp.float32)
  (_, (o_ref, st_ref)), grads_ref = run("naive", jnp.float64)
  for a, b in zip(jax.tree.leaves((o, st, grads)), jax.tree.leaves((o_ref, st_ref, grads_ref))):
    assert close(a, b, 1e-4, 1e-6), rel_rms(a, b)
  # The packed reference equals separate runs of each segment (row 0's third segment, with its own state).
  f64 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float64), t)
  cut = lambda x: x[:1, 6:26]
  o_sep, st_sep = point(*f64(jax.tree.map(cut, (q, k, v, f))), f64(prm), output_final_state=True,
                        implementation="naive", state=f64(jax.tree.map(lambda x: x[2:3], s0)))
  assert rel_rms(o_ref[:1, 6:26], o_sep) < 1e-12
  assert rel_rms(st_ref["precond"][2:3], st_sep["precond"]) < 1e-12


def test_no_gradient_crosses_a_segment_boundary():
  point = dgps.get("pgdn")
  dims = dgps.Dims(heads=2, value_heads=2, key_dim=8, value_dim=8)
  (q, k, v, f, prm), seg = _packed(point, dims, seed=4)

  def later_loss(k, f):
    o, _ = point(q, k, v, f, prm, segment_ids=seg, chunk_size=16)
    return jnp.sum(o[0, 26:] ** 2)             # row 0's last segment only

  dk, df = jax.jit(jax.grad(later_loss, argnums=(0, 1)))(k, f)
  assert float(jnp.max(jnp.abs(dk[0, :26]))) == 0.0 and float(jnp.max(jnp.abs(dk[1]))) == 0.0
  assert float(jnp.max(jnp.abs(dk[0, 26:]))) > 0.0
  for leaf in jax.tree.leaves(df):
    assert float(jnp.max(jnp.abs(leaf[0, :26]))) == 0.0


def test_initial_state_matches_an_empty_history():
  """Point.initial_state is what a fresh sequence starts from: passing it changes nothing."""
  for name in ("pgdn", "osdn-apf", "pmamba2", "gdn"):
    point = dgps.get(name)
    dims = dgps.Dims(heads=2, value_heads=2, key_dim=8, value_dim=8)
    q, k, v, f, prm = random_point_inputs(point, dims, 5, B=2, T=20)
    o1, s1 = point(q, k, v, f, prm, output_final_state=True, chunk_size=16)
    o2, s2 = point(q, k, v, f, prm, state=point.initial_state(2, dims), output_final_state=True, chunk_size=16)
    np.testing.assert_allclose(np.asarray(o1), np.asarray(o2), rtol=1e-6, atol=1e-7)
