"""Token-serial oracles: the online (delta rule) and offline (linear attention) solves, one token at a time.

This file is the specification every fast path is tested against: the recurrences of docs/design.md §1, written as
plainly as possible. It computes in fp32, or in fp64 when the inputs are fp64 (x64 enabled).

Shapes (value heads HV = g·H; value head i reads key head i // g):
  q, k:       [B, T, H, K]        k_write: [B, T, H, K] or [B, T, HV, K] (defaults to k)
  v:          [B, T, HV, V]       beta:    [B, T, HV] (linear attention: optional, default 1)
  log_decay:  None | [B, T, HV] (one decay per head) | [B, T, HV, K] (one per key channel); natural log, ≤ 0
  state:      [B, HV, K, V]       outputs: o [B, T, HV, V] in q.dtype, final state in the compute dtype
  packed:     segment_ids [B, T] (see `packing`); initial and final states per segment, [N, HV, K, V]
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from osdn_jax.ops import common, packing

_HI = lax.Precision.HIGHEST


# ---------------------------------------------------------------------------------------------------------
# One token. Shapes without T: q, k, k_write [B, HV, K]; v [B, HV, V]; beta [B, HV]; g None, [B, HV] or
# [B, HV, K]; S [B, HV, K, V]. These are also the decoding steps of the public API.
# ---------------------------------------------------------------------------------------------------------
def decay_state(S, g):
  """S' = D S with D = 1, exp(g) (per head) or diag(exp(g)) (per key channel, scaling the rows of S)."""
  if g is None:
    return S
  d = jnp.exp(g)
  return S * (d[..., None, None] if g.ndim == S.ndim - 2 else d[..., None])


def read(S, q, scale):
  """o = Sᵀ (scale · q)."""
  return jnp.einsum("...k,...kv->...v", q * scale, S, precision=_HI)


def online_write(S, k, k_write, v, beta):
  """The delta-rule write on the decayed state S': S = S' + β k̃ (v − S'ᵀk)ᵀ."""
  resid = v - jnp.einsum("...k,...kv->...v", k, S, precision=_HI)
  return S + (beta[..., None] * k_write)[..., :, None] * resid[..., None, :]


def offline_write(S, k, v, beta):
  """The linear-attention write on the decayed state: S = S' + β k vᵀ."""
  return S + (beta[..., None] * k)[..., :, None] * v[..., None, :]


# ---------------------------------------------------------------------------------------------------------
# Whole sequences: a lax.scan over time of the steps above, emitting what the caller asks for per token.
# ---------------------------------------------------------------------------------------------------------
def emit_output(S_pre, S, q, k, v, scale):
  """o_t = S_tᵀ(scale q_t)."""
  del S_pre, k, v
  return read(S, q, scale)


def emit_residuals(S_pre, S, q, k, v, scale):
  """(v_t − S'_tᵀk_t, v_t − S_tᵀk_t): the residual against the decayed state, before and after the write."""
  del q, scale
  pred = lambda M: jnp.einsum("...k,...kv->...v", k, M, precision=_HI)
  return v - pred(S_pre), v - pred(S)


@functools.partial(jax.jit, static_argnames=("online", "emit", "num_segments"))
def _serial(q, k, v, beta, k_write, log_decay, state, scale, segment_ids=None, *, online: bool, emit,
            num_segments=None):
  out_dtype = q.dtype
  ct = common.compute_dtype(q.dtype)
  scale = jnp.asarray(scale, ct)
  packed = segment_ids is not None
  S0 = None if state is None or not packed else jnp.asarray(state, ct)
  q, k, v, beta, k_write, log_decay, state = common.prepare(
      q, k, v, beta, k_write, log_decay, None if packed else state, head_axis=2)
  if packed:
    seg, start = packing.segment_index(segment_ids), packing.segment_starts(segment_ids)
    finals = None if num_segments is None else jnp.zeros((num_segments,) + state.shape[1:], ct)
  else:   # one segment per row, which never restarts
    seg, start, finals = None, None, None

  def body(carry, x):
    S, finals = carry
    q_t, k_t, kw_t, v_t, b_t, g_t, n_t, start_t = x
    if packed:   # the first token of segment n starts from its initial state S0[n] (default 0)
      restart = jnp.zeros_like(S) if S0 is None else S0[n_t]
      S = jnp.where(start_t[:, None, None, None], restart, S)
    S_pre = decay_state(S, g_t)
    S = online_write(S_pre, k_t, kw_t, v_t, b_t) if online else offline_write(S_pre, k_t, v_t, b_t)
    if finals is not None:   # the last write to finals[n] is made by segment n's last token
      finals = finals.at[n_t].set(S)
    return (S, finals), emit(S_pre, S, q_t, k_t, v_t, scale)

  time_major = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)
  xs = tuple(map(time_major, (q, k, k_write, v, beta, log_decay, seg, start)))
  (S, finals), ys = lax.scan(body, (state, finals), xs)
  ys = jax.tree.map(lambda y: jnp.moveaxis(y, 0, 1), ys)
  if emit is emit_output:
    ys = ys.astype(out_dtype)
  return ys, (finals if packed else S)


def trajectory(emit, k, v, beta=None, *, q=None, k_write=None, log_decay=None, initial_state=None,
               scale=None, online=True, segment_ids=None, num_segments=None):
  """Runs the token-serial recurrence and returns (per-token emit(S'_t, S_t, q_t, k_t, v_t, scale), S_T).

  `emit` is a (hashable) function of one token's decayed state S'_t, state S_t and inputs (head-expanded,
  compute dtype); its results are stacked along axis 1. q defaults to k; beta may be None offline.

  Packed sequences (`segment_ids` [B, T], see `packing`): at the first token of segment n the state restarts
  from initial_state[n] ([N, HV, K, V], default zeros): S'_t = D_t S0[n]. The second result is then each
  segment's state after its last token, [N, HV, K, V], when num_segments = N is given (else None).
  """
  q = k if q is None else q
  scale = common.default_scale(scale, q.shape[-1])
  return _serial(q, k, v, beta, k_write, log_decay, initial_state, scale, segment_ids, online=online,
                 emit=emit, num_segments=num_segments)


def delta_rule(q, k, v, beta, *, k_write=None, log_decay=None, initial_state=None, scale=None,
               segment_ids=None, num_segments=None):
  """Token-serial online solve. Returns (o [B, T, HV, V], final state [B, HV, K, V]).

  Packed (`segment_ids` [B, T]): initial_state is [N, HV, K, V] and the final states are [N, HV, K, V]
  when num_segments = N is given, else None; see `trajectory`.
  """
  return trajectory(emit_output, k, v, beta, q=q, k_write=k_write, log_decay=log_decay,
                    initial_state=initial_state, scale=scale, segment_ids=segment_ids,
                    num_segments=num_segments)


def linear_attention(q, k, v, *, beta=None, log_decay=None, initial_state=None, scale=None, segment_ids=None,
                     num_segments=None):
  """Token-serial offline solve S_t = D_t S_{t-1} + β_t k_t v_tᵀ, o_t = S_tᵀ(scale q_t); packing as above."""
  return trajectory(emit_output, k, v, beta, q=q, log_decay=log_decay, initial_state=initial_state,
                    scale=scale, online=False, segment_ids=segment_ids, num_segments=num_segments)


def delta_rule_residuals(k, v, beta, *, k_write=None, log_decay=None, initial_state=None, segment_ids=None,
                         num_segments=None):
  """Per-token residuals of the online solve, measured through the recurrence.

  Returns ((r_pre, r_post), S_T) with r_pre = v_t − S'_tᵀk_t (against the decayed state, before the write)
  and r_post = v_t − S_tᵀk_t, both [B, T, HV, V]; ρ_t = ‖r_post‖² / ‖r_pre‖². Packing as `trajectory`.
  """
  return trajectory(emit_residuals, k, v, beta, k_write=k_write, log_decay=log_decay,
                    initial_state=initial_state, segment_ids=segment_ids, num_segments=num_segments)
