"""Recall on stored pairs: how well the state retrieves the values written earlier.

‖S_tᵀk_j − v_j‖² / ‖v_j‖² averaged over earlier pairs (k_j, v_j). Unlike ρ_t this depends on the values and
on what later writes did to earlier memories, so it is not a function of the gates alone.
"""
from __future__ import annotations

import jax.numpy as jnp

from osdn_jax.ops import common


def recall_residual(S, k, v, *, weights=None):
  """Mean relative recall residual of state S [B, HV, K, V] on pairs k [B, N, H, K], v [B, N, HV, V].

  weights: optional [B, N] (e.g. a mask of which pairs count). Returns [B, HV].
  """
  hv = v.shape[2]
  k = common.expand_heads(k, hv, axis=2)
  pred = jnp.einsum("bnhk,bhkv->bnhv", k, S.astype(k.dtype))
  err = jnp.sum((pred - v) ** 2, -1) / jnp.maximum(jnp.sum(v * v, -1), 1e-30)        # [B, N, HV]
  w = jnp.ones(err.shape[:2], err.dtype) if weights is None else jnp.asarray(weights, err.dtype)
  return jnp.sum(err * w[..., None], 1) / jnp.maximum(jnp.sum(w, 1), 1e-30)[..., None]
