"""Token-serial references of the preconditioners whose fast forms use scans (the oracles of precond.py; they run
as `implementation="reference"` of `second_moment`, `pdn_write_key` and `atq_query`).

OSDN's d-pass (`precond.osdn_d_pass(implementation="reference")`) and the exact preconditioner are token-serial
`lax.scan`s already and serve as their own references.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from osdn_jax.dgps import checks
from osdn_jax.dgps.moment import num_segments, pdn_scale
from osdn_jax.ops import common, packing


def second_moment(k, beta_p, log_decay_p, *, initial_state=None, segment_ids=None):
  """A_t = exp(gᴾ_t) A_{t-1} + βᴾ_t k_t², one token at a time (restarting from initial_state[n] at the start
  of segment n when packed). Shapes as `precond.second_moment`."""
  ct = common.compute_dtype(jnp.result_type(k, beta_p, log_decay_p))
  k, beta_p, log_decay_p = (jnp.asarray(x, ct) for x in (k, beta_p, log_decay_p))
  b, t, h, kd = k.shape
  if segment_ids is None:
    starts, seg, count = jnp.zeros((b, t), bool), jnp.zeros((b, t), jnp.int32), b
  else:
    starts, seg = packing.segment_starts(segment_ids), packing.segment_index(segment_ids)
    count = num_segments(segment_ids, initial_state)
  init = jnp.zeros((count or b, h, kd), ct) if initial_state is None else jnp.asarray(initial_state, ct)
  A0 = init if segment_ids is None else jnp.zeros((b, h, kd), ct)

  def body(A, x):
    k_t, b_t, g_t, start_t, seg_t = x
    A = jnp.where(start_t[:, None, None], init[jnp.minimum(seg_t, init.shape[0] - 1)], A)
    A = jnp.exp(g_t)[..., None] * A + b_t[..., None] * k_t * k_t
    return A, A

  A_T, A = lax.scan(body, A0, tuple(jnp.moveaxis(x, 1, 0) for x in (k, beta_p, log_decay_p, starts, seg)))
  A = jnp.moveaxis(A, 0, 1)
  if segment_ids is None:
    return A, A_T
  if count is None:
    return A, None
  ends = jnp.concatenate([starts[:, 1:], jnp.ones_like(starts[:, :1])], axis=1)
  return A, jnp.zeros((count, h, kd), ct).at[jnp.where(ends, seg, count)].set(A, mode="drop")


def pdn_write_key(k, beta_p, log_decay_p, center, *, x=1.5, eps=1e-6, initial_state=None, segment_ids=None):
  A, A_T = second_moment(k, beta_p, log_decay_p, initial_state=initial_state, segment_ids=segment_ids)
  return (pdn_scale(A, center, x=x, eps=eps) * jnp.asarray(k, A.dtype)).astype(k.dtype), A_T


def atq_query(q, k, beta_p, log_decay_p, *, lam=1.0, initial_state=None, segment_ids=None):
  checks.lam("atq_query", lam)
  A, A_T = second_moment(k, beta_p, log_decay_p, initial_state=initial_state, segment_ids=segment_ids)
  return (jnp.asarray(q, A.dtype) / (A + lam)).astype(q.dtype), A_T
