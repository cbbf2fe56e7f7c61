"""Token-serial references of the preconditioners whose fast forms use scans (the oracles of precond.py).

OSDN's sequential form (`precond.osdn_write_key(method="sequential")`) and the exact preconditioner are
token-serial already and serve as their own references.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from osdn_jax.dgps import precond


def second_moment(k, beta_p, log_decay_p, *, initial_state=None):
  """A_t = exp(gᴾ_t) A_{t-1} + βᴾ_t k_t², one token at a time. Shapes as `precond.second_moment`."""
  ct = precond._ct(k, beta_p, log_decay_p)
  k, beta_p, log_decay_p = (jnp.asarray(x, ct) for x in (k, beta_p, log_decay_p))
  A0 = jnp.zeros((k.shape[0],) + k.shape[2:], ct) if initial_state is None else jnp.asarray(initial_state, ct)

  def body(A, x):
    k_t, b_t, g_t = x
    A = jnp.exp(g_t)[..., None] * A + b_t[..., None] * k_t * k_t
    return A, A

  A_T, A = lax.scan(body, A0, tuple(jnp.moveaxis(x, 1, 0) for x in (k, beta_p, log_decay_p)))
  return jnp.moveaxis(A, 0, 1), A_T


def pdn_write_key(k, beta_p, log_decay_p, center, *, x=1.5, eps=1e-6, initial_state=None):
  A, A_T = second_moment(k, beta_p, log_decay_p, initial_state=initial_state)
  return (precond.pdn_scale(A, center, x=x, eps=eps) * jnp.asarray(k, A.dtype)).astype(k.dtype), A_T


def atq_query(q, k, beta_p, log_decay_p, *, lam=1.0, initial_state=None):
  A, A_T = second_moment(k, beta_p, log_decay_p, initial_state=initial_state)
  return (jnp.asarray(q, A.dtype) / (A + lam)).astype(q.dtype), A_T
