"""Element-wise affine recurrences x_t = a_t ⊙ x_{t-1} + b_t through `lax.associative_scan`.

The preconditioners' states (PDN's decayed second moment A_t, the OSDN d-recurrence in its unclipped form) are
such recurrences; a token-serial `lax.scan` of a tiny body is ~100× slower on a GPU, so they go through here.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def _combine(earlier, later):
  a1, b1 = earlier
  a2, b2 = later
  return a2 * a1, a2 * b1 + b2


def affine_scan(a, b, *, initial=None, axis: int = 1):
  """All x_t of x_t = a_t ⊙ x_{t-1} + b_t along `axis`, with x_0 = `initial` (default 0).

  Args:
    a, b: arrays of one shape (a may broadcast against b), time along `axis`.
    initial: x_0, shaped like b without `axis` (default zeros).
  Returns:
    (xs shaped like b, the last x).
  """
  a = jnp.broadcast_to(a, b.shape)
  if initial is not None:
    first = lax.index_in_dim(b, 0, axis, keepdims=True) + lax.index_in_dim(a, 0, axis, keepdims=True) * \
        jnp.expand_dims(initial, axis)
    b = lax.dynamic_update_index_in_dim(b, first.astype(b.dtype), 0, axis)
  _, xs = lax.associative_scan(_combine, (a, b), axis=axis)
  return xs, lax.index_in_dim(xs, -1, axis, keepdims=False)
