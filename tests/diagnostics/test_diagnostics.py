import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osdn_jax import dgps, diagnostics, ops
from osdn_jax.dgps import precond
from osdn_jax.testing import random_problem, rel_rms


def test_recall_is_perfect_for_orthogonal_keys_with_full_writes():
  """DeltaNet with β = 1 and orthonormal keys stores every pair exactly; a random state does not."""
  K = V = 8
  k = jnp.eye(K)[None, :, None, :]                                   # [1, T=8, H=1, K]
  v = jnp.asarray(np.random.default_rng(0).normal(size=(1, K, 1, V)))
  _, S = ops.delta_rule(k, k, v, jnp.ones((1, K, 1)), output_final_state=True, implementation="naive")
  assert float(jnp.max(diagnostics.recall_residual(S, k, v))) < 1e-12
  assert float(jnp.min(diagnostics.recall_residual(S * 0.5, k, v))) > 0.2


def test_state_norms_match_the_final_state():
  p = random_problem(0, T=30, decay="channel", k_write="key")
  a = p.arrays(jnp.float64, jnp.float64, jnp.float64)
  fro, spec = diagnostics.state_norms(a["k"], a["v"], a["beta"], k_write=a["k_write"], log_decay=a["log_decay"],
                                      initial_state=a["initial_state"])
  _, S = ops.delta_rule(a["q"], a["k"], a["v"], a["beta"], k_write=a["k_write"], log_decay=a["log_decay"],
                        initial_state=a["initial_state"], output_final_state=True, implementation="naive")
  assert rel_rms(fro[:, -1], jnp.sqrt(jnp.sum(S ** 2, (-2, -1)))) < 1e-12
  assert rel_rms(spec[:, -1], jnp.linalg.norm(S, ord=2, axis=(-2, -1))) < 1e-12


def test_step_eigenvalues_closed_form():
  """Without decay the step's spectrum is {1 (K−1 times), 1 − β⟨k, k̃⟩}; scalar decay scales all of it."""
  p = random_problem(1, T=10, decay="scalar", k_write="key")
  a = p.arrays(jnp.float64, jnp.float64, jnp.float64)
  lam = diagnostics.write_eigenvalue(a["k"], a["beta"], a["k_write"])
  eig = diagnostics.step_eigenvalues(a["k"], a["beta"], a["k_write"], a["log_decay"])
  smallest = np.sort(np.asarray(eig).real, axis=-1)[..., 0]
  decay = np.exp(np.asarray(a["log_decay"]))
  np.testing.assert_allclose(smallest, np.minimum(decay * np.asarray(lam), decay), atol=1e-10)
  np.testing.assert_allclose(np.sort(np.asarray(eig).real, -1)[..., -1], decay, atol=1e-10)


# --- how often OSDN's clip acts ------------------------------------------------------------------------------------

def _d_pass_problem(seed, B=2, T=40, G=2, K=6, retention=True):
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(B, T, G, K))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  u = jnp.asarray(k * k)
  sig = lambda x: jnp.asarray(1.0 / (1.0 + np.exp(-x)))
  return dict(u=u, n=jnp.sum(u, -1), beta=sig(rng.normal(size=(B, T, G))),
              retention=sig(rng.normal(size=(B, T, G)) + 2.0) if retention else None,
              d1=jnp.asarray(np.abs(rng.normal(size=(B, G, K))) + 0.5), d_init=jnp.ones((G, K)))


def test_clip_that_never_binds_never_acts():
  """Bounds far outside the path: every fraction is 0 and d is the unclipped chunked d-pass."""
  p = _d_pass_problem(0)
  opts = dict(eta=1.0, d_min=-1e6, d_max=1e6, apf_anchor="zero")
  act = jax.jit(lambda p: diagnostics.clip_activity(**p, **opts))(p)
  for name in ("below", "above", "entries", "tokens", "d_at_min", "d_at_max"):
    assert float(jnp.max(act[name])) == 0.0, name
  assert all(float(jnp.max(c)) == 0.0 for c in act["chunks"].values())
  ds, d_last, _, _ = diagnostics.clip_trajectory(**p, **opts)
  free, free_last = precond.osdn_d_pass(**p, eta=1.0, d_min=None, d_max=None, apf_anchor="zero", implementation="xla",
                                        chunk_size=16)
  assert rel_rms(ds, free) < 1e-12 and rel_rms(d_last, free_last) < 1e-12


def test_clip_that_always_binds_acts_everywhere():
  """d_min = d_max = 3 with d_1 = 1: every update of every channel leaves the point {3}, and d sits at the bound
  from the second token on."""
  p = dict(_d_pass_problem(1), d1=jnp.ones((2, 2, 6)))
  act = diagnostics.clip_activity(**p, eta=1.0, d_min=3.0, d_max=3.0, apf_anchor="zero", chunk_sizes=(16, 64))
  for name in ("entries", "tokens"):
    np.testing.assert_array_equal(act[name], 1.0)
  np.testing.assert_allclose(act["below"] + act["above"], 1.0, rtol=0, atol=1e-6)
  np.testing.assert_array_equal(act["chunks"][16], 1.0)
  np.testing.assert_array_equal(act["chunks"][64], 1.0)
  np.testing.assert_allclose(act["d_at_min"], 39 / 40, rtol=1e-6)


def test_clip_counts_exactly_the_updates_that_leave_the_box():
  """One head, K = 2, keys e_0, η = 100, β = 0 except tokens 3 and 10 (β = 1/2): d̄_0 = 50 − 24 d_0 there, so
  token 3 overshoots (1 → 26 > 8, clipped to 8) and token 10 undershoots (8 → −142 < 0, clipped to 0); every other
  update leaves d where it is, at a bound from token 4 on, which is no clip."""
  T = 20
  u = jnp.zeros((1, T, 1, 2)).at[..., 0].set(1.0)
  beta = jnp.zeros((1, T, 1)).at[0, jnp.array([3, 10]), 0].set(0.5)
  p = dict(u=u, n=jnp.ones((1, T, 1)), beta=beta, retention=None, d1=jnp.ones((1, 1, 2)), d_init=jnp.ones((1, 2)))
  opts = dict(eta=100.0, d_min=0.0, d_max=8.0, apf_anchor="zero")
  ds, d_last, below, above = diagnostics.clip_trajectory(**p, **opts)
  np.testing.assert_array_equal(np.argwhere(np.asarray(above)), [[0, 3, 0, 0]])
  np.testing.assert_array_equal(np.argwhere(np.asarray(below)), [[0, 10, 0, 0]])
  np.testing.assert_array_equal(ds[0, :, 0, 0], [1.0] * 4 + [8.0] * 7 + [0.0] * 9)
  np.testing.assert_array_equal(d_last, [[[0.0, 1.0]]])
  act = diagnostics.clip_activity(**p, **opts, chunk_sizes=(4, 8, 16))
  expected = dict(below=1 / 40, above=1 / 40, entries=2 / 40, tokens=2 / 20, d_at_min=9 / 40, d_at_max=7 / 40)
  for name, value in expected.items():
    np.testing.assert_allclose(act[name], [value], rtol=1e-6, err_msg=name)
  for c, value in ((4, 2 / 5), (8, 2 / 3), (16, 1 / 2)):   # tokens 3 and 10 in chunks 0 and 2 | 0 and 1 | 0
    np.testing.assert_allclose(act["chunks"][c], [value], rtol=1e-6, err_msg=f"C = {c}")


@pytest.mark.parametrize("anchor,retention", [("zero", False), ("zero", True), ("init", True)])
def test_clipped_path_is_the_reference_d_pass(anchor, retention):
  """With bounds that bind now and then, d and d_{T+1} are `osdn_d_pass(implementation="reference")`'s."""
  p = _d_pass_problem(2, T=60, retention=retention)
  opts = dict(eta=4.0, d_min=0.75, d_max=1.5, apf_anchor=anchor)
  ds, d_last, below, above = diagnostics.clip_trajectory(**p, **opts)
  ref, ref_last = precond.osdn_d_pass(**p, **opts, implementation="reference")
  assert rel_rms(ds, ref) < 1e-14 and rel_rms(d_last, ref_last) < 1e-14
  assert float(jnp.mean(below)) > 0.0 and float(jnp.mean(above)) > 0.0 and float(jnp.mean(below | above)) < 0.9


def test_d_pass_inputs_follow_the_point():
  """The d-pass built for a point is the one its write key runs: the same d as `osdn_write_key` (guard off)."""
  point = dgps.get("osdn-apf", apf_anchor="init", d_max=2.0, guard=None)
  p = random_problem(3, T=24, HV=4)
  a = p.arrays(jnp.float64, jnp.float64, jnp.float64)
  k = a["k"]
  r_logit = jnp.asarray(np.random.default_rng(3).normal(size=a["beta"].shape))
  arrays, opts = diagnostics.d_pass_inputs(point, k, a["beta"], {"r": r_logit})
  assert opts == dict(eta=1.0, d_min=0.0, d_max=2.0, apf_anchor="init")
  ds, d_last, _, _ = diagnostics.clip_trajectory(**arrays, **opts)
  k_write, d_ref = precond.osdn_write_key(k, a["beta"], retention=jax.nn.sigmoid(r_logit), d_max=2.0, guard=None,
                                          apf_anchor="init", implementation="reference")
  hv = a["beta"].shape[2]
  assert rel_rms(ds * jnp.repeat(k, hv // k.shape[2], axis=2), k_write) < 1e-14
  assert rel_rms(d_last, d_ref) < 1e-14
  with pytest.raises(ValueError, match="no OSDN d-pass"):
    diagnostics.d_pass_inputs(dgps.get("pdn"), k, a["beta"])
