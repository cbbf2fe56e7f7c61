"""pallas_kernels.osdn_math: the closed-form partials the kernels use against autodiff of the same token."""
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import osdn_math as om


def test_step_coef_grads_match_autodiff():
  rng = np.random.default_rng(0)
  beta, s, p = (jnp.asarray(rng.uniform(0.05, 1.0, 7)), jnp.asarray(rng.normal(size=7)),
                jnp.asarray(rng.normal(size=7)))
  n = jnp.asarray(rng.uniform(0.5, 2.0, 7))
  eta = 0.3
  coef, vjp = jax.vjp(lambda b, m: om.step_coef(eta, b, m, s), beta, n)
  want_beta, want_n = vjp(p)
  got_beta, got_n = om.step_coef_grads(eta, beta, n, s, coef, p)
  np.testing.assert_allclose(got_beta, want_beta, rtol=1e-6)
  np.testing.assert_allclose(got_n, want_n, rtol=1e-6)
