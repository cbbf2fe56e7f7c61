"""RMSNorm over the last axis, computed in fp32 and returned in the compute dtype."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
  """y = x / rms(x) · w over the last axis (x [..., N], w [N], init 1).

  The statistics are fp32 whatever x's dtype; the result has `dtype` (default: x's dtype).
  """

  def __init__(self, features: int, *, eps: float = 1e-6, dtype=None, param_dtype=jnp.float32):
    self.eps = eps
    self.dtype = dtype
    self.scale = nnx.Param(jnp.ones((features,), param_dtype))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(self.dtype or x.dtype)
