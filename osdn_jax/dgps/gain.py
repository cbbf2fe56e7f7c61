"""The G axis: the write gain β_t [B, T, HV] as a pure function of a projected logit b = W_β x and the keys.

With L2-normalised keys NLMS and Longhorn reduce to the σ gain, so the points that use them skip the
normalisation (see the registry).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from osdn_jax.dgps import checks
from osdn_jax.ops import common


def _sq_norm(k, heads):
  return jnp.sum(jnp.square(common.expand_heads(k, heads, axis=2)), axis=-1)


def sigmoid(b, k=None):
  """β = σ(b) ∈ (0, 1) (the default)."""
  del k
  return jax.nn.sigmoid(b)


def sigmoid2(b, k=None):
  """β = 2σ(b) ∈ (0, 2): allows negative eigenvalues 1 − β‖k‖²; unsafe with PDN and OSDN."""
  del k
  return 2.0 * jax.nn.sigmoid(b)


def one(b, k=None):
  """β = 1."""
  del k
  return jnp.ones_like(b)


def nlms(b, k, eps=1e-6):
  """Normalised LMS with a learned step: β = σ(b) / (‖k‖² + ε), ε > 0 (zero keys)."""
  checks.number("nlms", "eps", eps, low=0.0, low_open=True)
  return jax.nn.sigmoid(b) / (_sq_norm(k, b.shape[-1]) + eps)


def longhorn(b, k):
  """Longhorn: β = σ(b) / (1 + σ(b)‖k‖²) (the implicit, closed-form online-regression step)."""
  s = jax.nn.sigmoid(b)
  return s / (1.0 + s * _sq_norm(k, b.shape[-1]))
