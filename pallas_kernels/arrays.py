"""Array helpers every kernel backend's wrappers share (plain JAX, outside the kernels)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def pad_axis(x, axis: int, size: int):
  """x zero-padded at the end of `axis` to `size`."""
  if x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad)


def scale_parts(scale, key_dim: int):
  """(python float, None) for a concrete scale (default key_dim ** −0.5); (None, fp32 array) for a traced one."""
  if scale is None:
    return key_dim ** -0.5, None
  try:
    return float(scale), None
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None, jnp.asarray(scale, jnp.float32)
