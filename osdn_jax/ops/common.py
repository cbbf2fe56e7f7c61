"""Helpers shared by every implementation of the solves: the contract's constants, compute dtype, head grouping,
defaults."""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.spec import CHUNK_SIZES, LOG_DECAY_FLOOR  # noqa: F401  (the contract shared with the kernels)


def compute_dtype(dtype) -> jnp.dtype:
  """fp32 for 16- and 32-bit inputs, fp64 for fp64 inputs (only possible with x64 enabled)."""
  return jnp.promote_types(jnp.float32, dtype)


def default_scale(scale, key_dim: int) -> float:
  return key_dim ** -0.5 if scale is None else scale


def expand_heads(x, value_heads: int, axis: int):
  """Repeats key heads so that value head i reads key head i // g (GVA); no-op when already HV heads."""
  if x is None or x.shape[axis] == value_heads:
    return x
  return jnp.repeat(x, value_heads // x.shape[axis], axis=axis)


def prepare(q, k, v, beta, k_write, log_decay, state, *, head_axis: int):
  """Casts to the compute dtype and expands q, k, k_write to the value heads.

  Missing optionals come back as: beta → ones, k_write → k (expanded), state → zeros, log_decay → None.
  """
  ct = compute_dtype(q.dtype)
  hv = v.shape[head_axis]
  cast = lambda x: None if x is None else jnp.asarray(x, ct)
  q, k, v, beta, k_write, log_decay, state = map(cast, (q, k, v, beta, k_write, log_decay, state))
  q = expand_heads(q, hv, head_axis)
  k = expand_heads(k, hv, head_axis)
  k_write = k if k_write is None else expand_heads(k_write, hv, head_axis)
  if beta is None:
    beta = jnp.ones(v.shape[:head_axis + 1], ct)
  if state is None:
    state = jnp.zeros((v.shape[0], hv, q.shape[-1], v.shape[-1]), ct)
  return q, k, v, beta, k_write, log_decay, state
