"""What every kernel backend's wrappers compute in plain JAX around their kernels, the same on each platform.

The solves (`delta_rule`, `linear_attention`; their wrapper is `delta_rule_shell`): the input dtypes, the traced
scale folded into q, the chunk-aligned row of packed sequences (`packed`), padding of tokens, gates and states, the
scalar decay's in-chunk cumsum, per-channel log-decays handed on in a dtype the kernels read, per-value-head gradients summed
over each key head's group, and the offline solve as the online one with a zero erase key. The preconditioners:
PDN's key scale M(A) and ATQ's query, the transforms of `precond_key` (pure jnp: also valid on a kernel's register
values). `arrays` holds the helpers of every op family (padding one axis, the static scale, argument checks);
what differs between platforms (padded widths, the chunk a kernel runs at, its layouts) stays in the backend.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp

from pallas_kernels import packed
from pallas_kernels.arrays import pad_axis
from pallas_kernels.spec import LOG_DECAY_FLOOR

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def fold_scale(q, scale, scale_arr):
  """(q, the kernels' static scale): a static scale (`arrays.scale_parts`) as it is; a traced one (scale None,
  scale_arr its fp32 value) multiplied into q, and the kernels run at scale 1."""
  if scale is None:
    return (q * scale_arr).astype(q.dtype), 1.0
  return q, float(scale)


def padded_length(t: int, span: int) -> int:
  """T rounded up to a multiple of `span` (the chunk): padded tokens have β = 0 and g = 0, so they leave the state
  unchanged."""
  return -(-t // span) * span


class Row(NamedTuple):
  """Packed sequences laid out in one chunk-aligned row (`packed.chunk_aligned`)."""
  length: int          # L
  pos: object          # [B·T] int32: each token's position in the row
  info: object         # [L/C + N + 1] int32: per-chunk codes, lane bounds
  present: object      # [N] bool: segment n has tokens


def to_row(segment_ids, num_segments: int, chunk: int, *arrays):
  """(Row, each of `arrays` [B, T, ...] laid out as [1, L, ...]; None stays None) for segment numbers [B, T]."""
  length = packed.row_length(segment_ids.size, num_segments, chunk)
  pos, info, present = packed.chunk_aligned(segment_ids, num_segments, chunk)
  laid_out = [None if x is None else packed.to_row(x, pos, length) for x in arrays]
  return Row(length, pos, info, present), laid_out


def from_row(row: Row, o, S, b: int, t: int):
  """o [1, L, ...] → [B, T, ...], and the final states S [N, ...] with those of segments without tokens zeroed
  (as the oracle has them)."""
  S = jnp.where(row.present.reshape((-1,) + (1,) * (S.ndim - 1)), S, 0.0)
  return packed.from_row(o, row.pos, b, t), S


def pad_tokens(x, length: int, width: int, dtype=None):
  """[B, T, heads, D] zero-padded to [B, length, heads, width] (cast to `dtype` first where given)."""
  x = x if dtype is None else x.astype(dtype)
  return pad_axis(pad_axis(x, 1, length), 3, width)


def head_major(x, length: int):
  """A gate [B, T, HV] → fp32 [B, HV, length], zero-padded."""
  return jnp.swapaxes(pad_axis(x.astype(jnp.float32), 1, length), 1, 2)


def chunk_cumsum(g, chunk: int):
  """Inclusive cumsum within chunks along axis 1 of g [B, T, ...] (T a multiple of chunk)."""
  b, t = g.shape[:2]
  return jnp.cumsum(g.reshape(b, t // chunk, chunk, *g.shape[2:]), axis=2).reshape(g.shape)


def scalar_decay(log_decay, length: int, chunk: int):
  """Scalar log-decays [B, T, HV] → G [B, HV, length] fp32: clamped at LOG_DECAY_FLOOR, zero-padded, cumsummed
  within each chunk."""
  g = pad_axis(jnp.maximum(log_decay.astype(jnp.float32), LOG_DECAY_FLOOR), 1, length)
  return jnp.swapaxes(chunk_cumsum(g, chunk), 1, 2)


def channel_log_decay(log_decay, length: int, width: int):
  """Per-channel log-decays [B, T, HV, K] → [B, length, HV, width], zero-padded, in bf16 or fp32 (other dtypes
  cast to fp32); the floor and the cumsum are the kernels'."""
  g = log_decay if log_decay.dtype in SUPPORTED_DTYPES else log_decay.astype(jnp.float32)
  return pad_tokens(g, length, width)


def pad_state(state, key_dim: int, value_dim: int):
  """A state [rows, HV, K, V] → fp32 [rows, HV, key_dim, value_dim], zero-padded."""
  return pad_axis(pad_axis(state.astype(jnp.float32), 2, key_dim), 3, value_dim)


def group_sum(x, heads: int):
  """Per-value-head partials [B, T, HV, ..., D] → [B, T, heads, D]: summed over each key head's HV / heads value
  heads and over every axis between the heads and D (e.g. one partial per block of V)."""
  b, t, hv = x.shape[:3]
  if x.ndim == 4 and hv == heads:
    return x
  grouped = x.reshape(b, t, heads, hv // heads, *x.shape[3:])
  return grouped.sum(axis=tuple(range(3, x.ndim)))


def linear_attention(delta_rule, q, k, v, *, beta=None, **options):
  """The offline solve S_t = D_t S_{t−1} + β_t k_t v_tᵀ through a backend's `delta_rule`: the online solve with a
  zero erase key and k as the write key (A = 0, T = I, W = 0, V_new = βV) computes it exactly. β default 1."""
  if beta is None:
    beta = jnp.ones(v.shape[:3], jnp.float32)
  return delta_rule(q, jnp.zeros_like(q), v, beta, k_write=k, **options)


def pdn_scale(A, center, x: float, eps: float):
  """(M, u) of PDN's key scale for the second moment A and the center (broadcasting against A):
  z = log(A + ε) − c, u = 1 / (1 + |z|), M = exp(−log(x) z u) ∈ (1/x, x); u serves the backward,
  ∂M/∂z = −log(x) M u²."""
  z = jnp.log(A + eps) - center
  u = 1.0 / (1.0 + jnp.abs(z))
  return jnp.exp(-math.log(x) * z * u), u


def precond_transform(transform: str, A, k, p, *, x: float, eps: float, lam: float):
  """PDN's write key M(A) ⊙ k ("pdn"; p the center) or ATQ's query p / (A + λ) ("atq"; p the query), in the
  dtype of A, k and p (the callers' fp32)."""
  if transform == "pdn":
    return pdn_scale(A, p, x, eps)[0] * k
  return p / (A + lam)
