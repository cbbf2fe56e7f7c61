"""The SwiGLU feed-forward block."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx


def hidden_width(d_model: int, ratio: float = 4.0, multiple: int = 256) -> int:
  """The SwiGLU width of FLA and LLaMA: `multiple · ⌈(2/3 · ratio · D) / multiple⌉` (2816 for D = 1024)."""
  return multiple * math.ceil(2 * ratio * d_model / 3 / multiple)


class SwiGLU(nnx.Module):
  """y = W_down (silu(W_gate x) ⊙ W_up x); x [..., D] → [..., D], hidden F. No biases."""

  def __init__(self, d_model: int, hidden: int, *, dtype=None, param_dtype=jnp.float32, out_init_scale=1.0,
               rngs: nnx.Rngs):
    lin = lambda i, o, **kw: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                                        **kw)
    self.gate_proj = lin(d_model, hidden)
    self.up_proj = lin(d_model, hidden)
    self.down_proj = lin(hidden, d_model, kernel_init=nnx.initializers.variance_scaling(
        out_init_scale ** 2, "fan_in", "truncated_normal"))

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
