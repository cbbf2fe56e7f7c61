"""Element-wise affine recurrences x_t = a_t ⊙ x_{t-1} + b_t through `lax.associative_scan`.

The preconditioners' states (PDN's decayed second moment A_t, the OSDN d-recurrence in its unclipped form) are
such recurrences; a token-serial `lax.scan` of a tiny body is ~100× slower on a GPU, so they go through here.
Packed sequences: a `reset` flag marks segment starts, where x_{t-1} is replaced by the segment's initial
value; the combine drops the earlier part of the scan at a reset (a mask, never a −inf log-decay).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def _combine(earlier, later):
  a1, b1 = earlier
  a2, b2 = later
  return a2 * a1, a2 * b1 + b2


def _combine_reset(earlier, later):
  """As `_combine`, but where the later part holds a reset the earlier part is dropped.

  The dropped part is also replaced before it is multiplied: the branch a `where` does not take still gets a zero
  cotangent in the backward, and a2's gradient through a2 · b1 would be 0 · b1, NaN for a non-finite b1 of an
  earlier sequence (docs/faults.md). The values are those of the plain select."""
  a1, b1, r1 = earlier
  a2, b2, r2 = later
  a1 = jnp.where(r2, jnp.ones((), a1.dtype), a1)
  b1 = jnp.where(r2, jnp.zeros((), b1.dtype), b1)
  return jnp.where(r2, a2, a2 * a1), jnp.where(r2, b2, a2 * b1 + b2), r1 | r2


def _expand(x, ndim: int):
  return x.reshape(x.shape + (1,) * (ndim - x.ndim))


def affine_scan(a, b, *, initial=None, reset=None, num_segments: int | None = None, axis: int = 1):
  """All x_t of x_t = a_t ⊙ x_{t-1} + b_t along `axis`.

  Args:
    a, b: arrays of one shape (a may broadcast against b), time along `axis`.
    initial: without `reset`, x_0 shaped like b without `axis` (default 0). With `reset`, the per-segment
      initial values [N, *b.shape[axis+1:]] (default 0), segments numbered in row-major order over
      b.shape[:axis+1] (as `packing.segment_index`).
    reset: None, or bool of shape b.shape[:axis+1]: True where a segment starts (position 0 always does).
      At a reset x_{t-1} is replaced by the segment's initial value: x_t = a_t ⊙ initial[n] + b_t.
    num_segments: N for the per-segment last values when `initial` is not given.
  Returns:
    (xs shaped like b, last): without `reset` the last x along `axis`; with `reset` each segment's last x
    [N, *b.shape[axis+1:]] (None when N is unknown: no `initial` and no `num_segments`).
  """
  axis = axis % b.ndim
  a = jnp.broadcast_to(a, b.shape)
  if reset is not None:
    return _affine_scan_reset(a, b, initial, reset, num_segments, axis)
  if initial is not None:
    first = lax.index_in_dim(b, 0, axis, keepdims=True) + lax.index_in_dim(a, 0, axis, keepdims=True) * \
        jnp.expand_dims(initial, axis)
    b = lax.dynamic_update_index_in_dim(b, first.astype(b.dtype), 0, axis)
  _, xs = lax.associative_scan(_combine, (a, b), axis=axis)
  return xs, lax.index_in_dim(xs, -1, axis, keepdims=False)


def _affine_scan_reset(a, b, initial, reset, num_segments, axis):
  lead = b.shape[:axis + 1]
  reset = jnp.broadcast_to(reset, lead)
  reset = lax.dynamic_update_index_in_dim(reset, jnp.ones(lead[:axis] + (1,), bool), 0, axis)
  n = (jnp.cumsum(reset.reshape(-1).astype(jnp.int32)) - 1).reshape(lead)
  r = _expand(reset, b.ndim)
  if initial is not None:
    b = jnp.where(r, b + a * initial[n].astype(b.dtype), b)   # fold x_{t-1} = initial[n] into the start
  _, xs, _ = lax.associative_scan(_combine_reset, (a, b, jnp.broadcast_to(r, b.shape)), axis=axis)
  count = initial.shape[0] if initial is not None else num_segments
  if count is None:
    return xs, None
  # A segment ends where the next one starts or the row ends; ends have distinct segment numbers.
  nxt = jnp.concatenate([lax.slice_in_dim(reset, 1, None, axis=axis), jnp.ones(lead[:axis] + (1,), bool)],
                        axis=axis)
  last = jnp.zeros((count,) + b.shape[axis + 1:], b.dtype)
  return xs, last.at[jnp.where(nxt, n, count)].set(xs, mode="drop")
