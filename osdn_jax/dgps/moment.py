"""What the decayed diagonal second moment's two forms share (PDN and ATQ): the fast forms in `dgps.precond` and
the token-serial reference in `dgps.naive`. Imports run precond → naive → moment, so neither of the two imports
the other in a cycle; `precond` re-exports these names (`precond.pdn_scale`, `precond.num_segments`).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from osdn_jax.dgps import checks
from osdn_jax.ops import packing


def num_segments(segment_ids, initial_state):
  """N for per-segment final states: initial_state's leading dim, else counted from concrete ids, else None."""
  if initial_state is not None:
    return initial_state.shape[0]
  try:
    return packing.num_segments(segment_ids)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return None


def pdn_scale(A, center, *, x=1.5, eps=1e-6):
  """M = exp(−log(x) z / (1 + |z|)), z = log(A + ε) − c (c per head [H] or scalar); M ∈ (1/x, x). x ≥ 1, ε > 0."""
  checks.pdn("pdn_scale", x=x, eps=eps)
  z = jnp.log(A + eps) - jnp.asarray(center, A.dtype)[..., None]
  return jnp.exp(-math.log(x) * z / (1.0 + jnp.abs(z)))
