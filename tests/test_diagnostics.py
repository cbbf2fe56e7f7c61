import jax.numpy as jnp
import numpy as np

from osdn_jax import diagnostics, ops
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
