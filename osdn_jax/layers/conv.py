"""The depthwise causal short convolution applied to q, k, v before the token mixer's solve."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from osdn_jax.ops import packing


class ShortConv(nnx.Module):
  """Depthwise causal convolution over time: y_t = Σ_{i<W} w_i · x_{t−(W−1)+i} per channel (no bias).

  weight [W, C], init U(−1/√W, 1/√W) (PyTorch's Conv1d default for a depthwise filter). The W − 1 inputs
  before the first token come from `tail` (a decoding cache) or are zero; with `segment_ids` a tap that
  reaches across a segment start reads zero, so packed sequences do not mix.
  """

  def __init__(self, channels: int, kernel_size: int = 4, *, dtype=None, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    bound = kernel_size ** -0.5
    self.kernel_size = kernel_size
    self.dtype = dtype
    self.weight = nnx.Param(jax.random.uniform(rngs.params(), (kernel_size, channels), param_dtype,
                                               -bound, bound))

  def _w(self, x):
    return self.weight[...].astype(self.dtype or x.dtype)

  def __call__(self, x, *, tail=None, segment_ids=None):
    """x [B, T, C]; tail None or [B, W−1, C] (the inputs before x); segment_ids None or [B, T].

    Returns (y [B, T, C], new tail [B, W−1, C]: the last W − 1 inputs, for decoding).
    """
    b, t, c = x.shape
    lag = self.kernel_size - 1
    if tail is None:
      tail = jnp.zeros((b, lag, c), x.dtype)
    xp = jnp.concatenate([tail.astype(x.dtype), x], axis=1)        # [B, W − 1 + T, C]
    w = self._w(x)
    seg = None if segment_ids is None else packing.segment_index(segment_ids)
    y = jnp.zeros_like(x)
    for i in range(self.kernel_size):
      shift = lag - i                                             # tap i reads x_{t − shift}
      tap = xp[:, i:i + t] * w[i]
      if seg is not None and shift:
        # x_{t−shift} is in t's segment iff no start lies in (t − shift, t]; padding (t < shift) never is.
        prev = jnp.pad(seg, ((0, 0), (shift, 0)), constant_values=-1)[:, :t]
        tap = jnp.where((prev == seg)[..., None], tap, 0)
      y = y + tap
    return y, xp[:, -lag:] if lag else xp[:, :0]

  def step(self, x, tail):
    """One token: x [B, C], tail [B, W−1, C]. Returns (y [B, C], new tail)."""
    window = jnp.concatenate([tail.astype(x.dtype), x[:, None]], axis=1)   # [B, W, C]
    y = jnp.einsum("bwc,wc->bc", window, self._w(x))
    return y, window[:, 1:]
