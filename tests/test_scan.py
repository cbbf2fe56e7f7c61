import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from osdn_jax.ops.scan import affine_scan
from osdn_jax.testing import rel_rms


def _loop(a, b, x0):
  xs, x = [], x0
  for t in range(a.shape[1]):
    x = a[:, t] * x + b[:, t]
    xs.append(x)
  return np.stack(xs, 1), x


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), with_initial=st.booleans())
def test_affine_scan_equals_the_loop(seed, with_initial):
  rng = np.random.default_rng(seed)
  a, b = rng.uniform(0, 1.2, size=(3, 37, 5)), rng.normal(size=(3, 37, 5))
  x0 = rng.normal(size=(3, 5)) if with_initial else None
  xs, last = affine_scan(jnp.asarray(a), jnp.asarray(b), initial=None if x0 is None else jnp.asarray(x0))
  ref, ref_last = _loop(a, b, np.zeros((3, 5)) if x0 is None else x0)
  assert rel_rms(xs, ref) < 1e-12 and rel_rms(last, ref_last) < 1e-12


def test_affine_scan_gradients():
  rng = np.random.default_rng(0)
  a, b, x0 = (jnp.asarray(rng.uniform(0.2, 1, size=(2, 20, 3))), jnp.asarray(rng.normal(size=(2, 20, 3))),
              jnp.asarray(rng.normal(size=(2, 3))))
  w = jnp.asarray(rng.normal(size=(2, 20, 3)))

  def serial(a, b, x0):
    def body(x, ab):
      x = ab[0] * x + ab[1]
      return x, x
    _, xs = jax.lax.scan(body, x0, (jnp.moveaxis(a, 1, 0), jnp.moveaxis(b, 1, 0)))
    return jnp.sum(jnp.moveaxis(xs, 0, 1) * w)

  fast = lambda a, b, x0: jnp.sum(affine_scan(a, b, initial=x0)[0] * w)
  for g1, g2 in zip(jax.grad(fast, (0, 1, 2))(a, b, x0), jax.grad(serial, (0, 1, 2))(a, b, x0)):
    assert rel_rms(g1, g2) < 1e-12
