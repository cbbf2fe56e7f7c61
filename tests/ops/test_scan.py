import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from osdn_jax.ops.scan import affine_scan
from osdn_jax.testing import examples, rel_rms


def _loop(a, b, x0):
  xs, x = [], x0
  for t in range(a.shape[1]):
    x = a[:, t] * x + b[:, t]
    xs.append(x)
  return np.stack(xs, 1), x


@settings(max_examples=examples(10))
@given(seed=st.integers(0, 2**31 - 1), with_initial=st.booleans())
def test_affine_scan_equals_the_loop(seed, with_initial):
  """affine_scan's states and last state equal the loop x_t = a_t x_{t−1} + b_t, with and without x_0."""
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


def _loop_reset(a, b, reset, initial):
  """Token by token: at a reset (and t = 0) x_{t-1} is the next segment's initial value (default 0)."""
  xs, last, n = np.zeros_like(b), [], -1
  for r in range(b.shape[0]):
    for t in range(b.shape[1]):
      if t == 0 or reset[r, t]:
        n += 1
        x = np.zeros(b.shape[2:]) if initial is None else initial[n]
        last.append(None)
      x = a[r, t] * x + b[r, t]
      xs[r, t] = last[n] = x
  return xs, np.stack(last)


@settings(max_examples=examples(10))
@given(seed=st.integers(0, 2**31 - 1), with_initial=st.booleans())
def test_affine_scan_with_resets_equals_the_loop(seed, with_initial):
  """With resets (segments of length 1 and random ones), the states and every segment's last state equal the
  loop restarting at each reset from the segment's initial value (zero without `initial`)."""
  rng = np.random.default_rng(seed)
  a, b = rng.uniform(0, 1.2, size=(3, 37, 5)), rng.normal(size=(3, 37, 5))
  reset = np.zeros((3, 37), bool)
  reset[1, 1:3] = True                       # segments of length 1
  free = np.argwhere(~reset & (np.arange(37) > 0))
  reset[tuple(free[rng.choice(len(free), size=8, replace=False)].T)] = True
  n = 3 + 2 + 8                              # a fixed N: one compile per `with_initial`
  x0 = rng.normal(size=(n, 5)) if with_initial else None
  scan = jax.jit(affine_scan, static_argnames=("num_segments",))
  xs, last = scan(jnp.asarray(a), jnp.asarray(b), reset=jnp.asarray(reset),
                  initial=None if x0 is None else jnp.asarray(x0), num_segments=n)
  ref, ref_last = _loop_reset(a, b, reset, x0)
  assert rel_rms(xs, ref) < 1e-12 and rel_rms(last, ref_last) < 1e-12


def test_affine_scan_with_resets_gradients():
  """Gradients through the resets equal those of a serial scan; nothing flows across a reset."""
  rng = np.random.default_rng(1)
  a, b = jnp.asarray(rng.uniform(0.2, 1, size=(2, 20, 3))), jnp.asarray(rng.normal(size=(2, 20, 3)))
  reset = np.zeros((2, 20), bool)
  reset[0, [5, 6, 13]] = reset[1, [1, 19]] = True
  n = np.cumsum(np.where(np.arange(20) == 0, True, reset).reshape(-1)).reshape(2, 20) - 1
  x0 = jnp.asarray(rng.normal(size=(int(n.max()) + 1, 3)))
  w = jnp.asarray(rng.normal(size=(2, 20, 3)))

  def serial(a, b, x0):
    def body(x, inp):
      a_t, b_t, r_t, n_t = inp
      x = a_t * jnp.where(r_t[:, None], x0[n_t], x) + b_t
      return x, x
    first = np.ones((2, 20), bool)
    first[:, 1:] = reset[:, 1:]
    inputs = (jnp.moveaxis(a, 1, 0), jnp.moveaxis(b, 1, 0), jnp.asarray(first.T), jnp.asarray(n.T))
    _, xs = jax.lax.scan(body, jnp.zeros((2, 3), a.dtype), inputs)
    return jnp.sum(jnp.moveaxis(xs, 0, 1) * w)

  fast = lambda a, b, x0: jnp.sum(affine_scan(a, b, initial=x0, reset=jnp.asarray(reset))[0] * w)
  grads = jax.jit(jax.grad(fast, (0, 1, 2)))(a, b, x0)
  for g1, g2 in zip(grads, jax.jit(jax.grad(serial, (0, 1, 2)))(a, b, x0)):
    assert rel_rms(g1, g2) < 1e-12
  # Only row 0's segment [6, 13) is read: every other b has exactly zero gradient.
  wsel = jnp.zeros_like(w).at[0, 6:13].set(1.0)
  gb = jax.jit(jax.grad(lambda b: jnp.sum(affine_scan(a, b, initial=x0, reset=jnp.asarray(reset))[0] * wsel)))(b)
  outside = np.ones((2, 20), bool)
  outside[0, 6:13] = False
  assert np.all(np.asarray(gb)[outside] == 0.0)
