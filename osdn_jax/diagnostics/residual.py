"""Residual contraction of the online solve.

With f_t(S) = ½‖Sᵀk_t − v_t‖², one write contracts the residual against the decayed state by
ρ_t = f_t(S_t) / f_t(S'_t) = (1 − β_t⟨k_t, k̃_t⟩)² for any decay; q_geo = exp(mean_t log ρ_t).
"""
from __future__ import annotations

import jax.numpy as jnp

from osdn_jax.ops import common, naive

_TINY = 1e-30


def rho_closed_form(k, beta, k_write=None):
  """ρ_t = (1 − β_t⟨k_t, k̃_t⟩)² from the gates alone. k [B, T, H, K], beta [B, T, HV] → [B, T, HV]."""
  hv = beta.shape[2]
  k = common.expand_heads(k, hv, axis=2)
  kw = k if k_write is None else common.expand_heads(k_write, hv, axis=2)
  return (1.0 - beta * jnp.sum(k * kw, axis=-1)) ** 2


def rho_measured(k, v, beta, *, k_write=None, log_decay=None, initial_state=None):
  """ρ_t = ‖v_t − S_tᵀk_t‖² / ‖v_t − S'_tᵀk_t‖², measured through the token-serial recurrence."""
  (pre, post), _ = naive.delta_rule_residuals(k, v, beta, k_write=k_write, log_decay=log_decay,
                                              initial_state=initial_state)
  return jnp.sum(post ** 2, -1) / jnp.maximum(jnp.sum(pre ** 2, -1), _TINY)


def q_geo(rho, axis=None):
  """exp(mean log ρ) (ρ floored at 1e−30 so that exact contractions to 0 stay finite)."""
  return jnp.exp(jnp.mean(jnp.log(jnp.maximum(rho, _TINY)), axis=axis))
