"""Chunkwise solves in pure JAX (the XLA path): the WY/UT form of DESIGN.md §2 with an asymmetric Gram.

Per chunk of C tokens, with G_i = Σ_{j≤i in the chunk} g_j (inclusive; per key channel for channel decay):

  A     = strictLower(diag(β) (K ⊙ e^G)(K̃ ⊙ e^−G)ᵀ)          T = (I + A)⁻¹   (blocked forward substitution)
  W     = T diag(β)(K ⊙ e^G)        U = T diag(β) V          V_new = U − W S
  O     = scale · ((Q ⊙ e^G) S + tril((Q ⊙ e^G)(K̃ ⊙ e^−G)ᵀ) V_new)
  S    ← e^{G_C} ⊙ S + (K̃ ⊙ e^{G_C − G})ᵀ V_new

The offline solve (linear attention) is the same with W = 0 and V_new = diag(β) V. Everything that does not
depend on the carried state (A, W, U, the intra-chunk scores) is computed for all chunks at once; a lax.scan over
chunks carries S. Overflow safety: every e^{G_i − G_j} is formed from a difference masked before exp (so it
is ≤ 1); for per-channel decay the off-diagonal sub-blocks factor through a reference point between the two
sub-blocks (both factors ≤ 1) and the diagonal sub-blocks are computed pairwise. Inputs are padded with zeros
to a multiple of C, which leaves the state untouched (β = 0, g = 0).

Shapes are those of `naive.py`; the work layout is [B, HV, NC, C, ...] (NC chunks of C tokens).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from osdn_jax.ops import common

_HI = lax.Precision.HIGHEST
LOG_DECAY_FLOOR = -30.0   # exp(−30) ≈ 1e−13: lower log-decays change nothing but lose precision in cumsums
SUB_CHUNK = 16            # sub-block size for the per-channel intra-chunk scores


def _einsum(spec, *xs):
  return jnp.einsum(spec, *xs, precision=_HI)


def _to_chunks(x, chunk):
  """[B, T, HV, ...] → [B, HV, NC, C, ...], zero-padding T up to a multiple of C."""
  if x is None:
    return None
  b, t = x.shape[:2]
  pad = -t % chunk
  x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  x = x.reshape(b, (t + pad) // chunk, chunk, *x.shape[2:])
  return jnp.moveaxis(x, 3, 1)


def _from_chunks(x, length):
  """[B, HV, NC, C, ...] → [B, T, HV, ...]."""
  x = jnp.moveaxis(x, 1, 3)
  return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]


def decay_cumsum(g):
  """Inclusive in-chunk cumulative log-decay G (clamped per step at LOG_DECAY_FLOOR); g [..., C, 1 or K]."""
  return jnp.cumsum(jnp.maximum(g, LOG_DECAY_FLOOR), axis=-2)


def _tril(n, strict=False):
  return jnp.tril(jnp.ones((n, n), bool), -1 if strict else 0)


def _masked_exp(diff, mask):
  """exp(diff) where mask, else 0 — masked before exp so that no inf (and no 0·inf in gradients) appears."""
  return jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)


def intra_scores(x, y, G):
  """Inclusive lower-triangular decayed scores M_ij = Σ_c x_ic y_jc e^{G_ic − G_jc} for j ≤ i, else 0.

  x, y: [..., C, K]; G: None (no decay), [..., C, 1] (scalar) or [..., C, K] (per channel). → [..., C, C].
  """
  c = x.shape[-2]
  mask = _tril(c)
  if G is None:
    return jnp.where(mask, _einsum("...ik,...jk->...ij", x, y), 0.0)
  if G.shape[-1] == 1:
    g = G[..., 0]
    return _einsum("...ik,...jk->...ij", x, y) * _masked_exp(g[..., :, None] - g[..., None, :], mask)
  return _intra_scores_channel(x, y, G)


def _intra_scores_channel(x, y, G):
  c, kd = x.shape[-2:]
  s = min(SUB_CHUNK, c)
  n = c // s
  lead = x.shape[:-2]
  xb, yb, gb = (a.reshape(*lead, n, s, kd) for a in (x, y, G))
  # Diagonal s×s sub-blocks: pairwise exponents, [..., n, s, s, K].
  mask = _tril(s)[:, :, None]
  e = _masked_exp(gb[..., :, :, None, :] - gb[..., :, None, :, :], mask)
  diag = _einsum("...aik,...ajk,...aijk->...aij", xb, yb, e)
  # Rows of sub-block a against every column j before it, through the reference point r_a = a·s − 1:
  # e^{G_i − G_j} = e^{G_i − G_r} · e^{G_r − G_j}, both exponents ≤ 0. Sub-block 0 has no such columns.
  ref = jnp.concatenate([G[..., :1, :], G[..., s - 1:c - 1:s, :]], axis=-2)           # [..., n, K]
  rows = xb * jnp.exp(gb - ref[..., :, None, :])                                      # [..., n, s, K]
  before = (jnp.arange(c)[None, :] < (jnp.arange(n) * s)[:, None])                    # [n, C]
  cols = y[..., None, :, :] * _masked_exp(ref[..., :, None, :] - G[..., None, :, :], before[..., None])
  off = jnp.where(before[:, None, :], _einsum("...aik,...ajk->...aij", rows, cols), 0.0)  # [..., n, s, C]
  blockdiag = jnp.einsum("...aij,ab->...aibj", diag, jnp.eye(n, dtype=diag.dtype))
  return (off + blockdiag.reshape(off.shape)).reshape(*lead, c, c)


def _invert_unit_lower(a):
  """(I + a)⁻¹ for strictly lower-triangular a [..., s, s], by forward substitution one row at a time."""
  s = a.shape[-1]
  rows = jnp.moveaxis(a, -2, 0)                                   # [s, ..., s]: row i of a

  def body(i, x):
    # Row i of x is e_i − Σ_{j<i} a_ij x_j; a_ij = 0 for j ≥ i, so the not-yet-final rows do not enter.
    row = jnp.eye(s, dtype=a.dtype)[i] - _einsum("...j,...jk->...k", rows[i], x)
    return lax.dynamic_update_index_in_dim(x, row, i, axis=x.ndim - 2)

  return lax.fori_loop(1, s, body, jnp.broadcast_to(jnp.eye(s, dtype=a.dtype), a.shape))


def solve_unit_lower(a, rhs):
  """(I + a)⁻¹ rhs for strictly lower-triangular a [..., C, C] and rhs [..., C, N].

  Pure matmuls (no LAPACK/cuBLAS triangular solve): the 16×16 diagonal blocks are inverted by forward
  substitution, then block forward substitution x_b = inv_b (rhs_b − Σ_{c<b} a_bc x_c) merges them.
  """
  c = a.shape[-1]
  s = min(SUB_CHUNK, c)
  n = c // s
  diag = jnp.stack([a[..., b * s:(b + 1) * s, b * s:(b + 1) * s] for b in range(n)], axis=-3)
  inv = _invert_unit_lower(diag)                                          # [..., n, s, s]

  def body(b, x):
    # Rows of x at and after block b are still 0, so a's whole block row can multiply all of x.
    r = lax.dynamic_slice_in_dim(rhs, b * s, s, axis=-2) - _einsum(
        "...ij,...jn->...in", lax.dynamic_slice_in_dim(a, b * s, s, axis=-2), x)
    xb = _einsum("...ij,...jn->...in", lax.dynamic_index_in_dim(inv, b, axis=-3, keepdims=False), r)
    return lax.dynamic_update_slice_in_dim(x, xb, b * s, axis=-2)

  return lax.fori_loop(0, n, body, jnp.zeros(rhs.shape, rhs.dtype))


def _decays(G):
  """(e^G, e^{G_C − G}, e^{G_C} shaped to scale the state's rows) for a chunk's inclusive cumsum G."""
  if G is None:
    return None, None, None
  return jnp.exp(G), jnp.exp(G[..., -1:, :] - G), jnp.exp(G[..., -1, :])[..., :, None]


def _chunk_recurrence(k, k_write, v, beta, G, state, *, online: bool):
  """The state pass: what enters each chunk and the chunk's corrected values.

  k, k_write [B, HV, NC, C, K]; v [B, HV, NC, C, V]; beta [B, HV, NC, C]; G None or [B, HV, NC, C, 1|K];
  state [B, HV, K, V]. Returns (S_in [B, HV, NC, K, V], V_new [B, HV, NC, C, V], final state).
  """
  c = k.shape[-2]
  e_in, e_out, gamma = _decays(G)
  bv = beta[..., None] * v
  if online:
    k_in = k if e_in is None else k * e_in
    a = jnp.where(_tril(c, strict=True), beta[..., None] * intra_scores(k, k_write, G), 0.0)
    wu = solve_unit_lower(a, jnp.concatenate([beta[..., None] * k_in, bv], axis=-1))
    w, u = wu[..., :k.shape[-1]], wu[..., k.shape[-1]:]
  else:
    w, u = None, bv
  kw_out = k_write if e_out is None else k_write * e_out

  def step(S, xs):
    w_c, u_c, kw_c, gamma_c = xs
    v_new = u_c if w_c is None else u_c - _einsum("...ck,...kv->...cv", w_c, S)
    S_next = S if gamma_c is None else gamma_c * S
    S_next = S_next + _einsum("...ck,...cv->...kv", kw_c, v_new)
    return S_next, (S, v_new)

  chunk_major = lambda x: None if x is None else jnp.moveaxis(x, 2, 0)
  S, (S_in, v_new) = lax.scan(step, state, tuple(map(chunk_major, (w, u, kw_out, gamma))))
  return jnp.moveaxis(S_in, 0, 2), jnp.moveaxis(v_new, 0, 2), S


def _chunk_solve(q, k, k_write, v, beta, g, state, scale, *, online: bool):
  """The chunkwise solve on chunked inputs (shapes of `_chunk_recurrence`, q like k) → (o like v, S_T)."""
  G = None if g is None else decay_cumsum(g)
  S_in, v_new, S = _chunk_recurrence(k, k_write, v, beta, G, state, online=online)
  e_in = _decays(G)[0]
  q_in = q if e_in is None else q * e_in
  o = _einsum("...ck,...kv->...cv", q_in, S_in) + _einsum("...ij,...jv->...iv", intra_scores(q, k_write, G),
                                                           v_new)
  return scale * o, S


@functools.partial(jax.jit, static_argnames=("online", "chunk_size"))
def _states(k, v, beta, k_write, log_decay, state, *, online: bool, chunk_size: int):
  t = k.shape[1]
  _, k, v, beta, k_write, log_decay, state = common.prepare(
      k, k, v, beta, k_write, log_decay, state, head_axis=2)
  if log_decay is not None and log_decay.ndim == 3:
    log_decay = log_decay[..., None]
  k, k_write, v, beta, g = (_to_chunks(x, chunk_size) for x in (k, k_write, v, beta, log_decay))
  G = None if g is None else decay_cumsum(g)
  S_in, v_new, S = _chunk_recurrence(k, k_write, v, beta, G, state, online=online)
  # S_t = e^{G_t} ⊙ S_in + Σ_{j≤t} (e^{G_t − G_j} ⊙ k̃_j) v_newⱼᵀ, pairwise per channel: [..., C, C, 1|K].
  c = k.shape[-2]
  mask = _tril(c)[..., None]
  pair = mask if G is None else _masked_exp(G[..., :, None, :] - G[..., None, :, :], mask)
  own = S_in[..., None, :, :] if G is None else jnp.exp(G)[..., None] * S_in[..., None, :, :]
  states = own + _einsum("...tjk,...jk,...jv->...tkv", jnp.broadcast_to(pair, pair.shape[:-1] + k.shape[-1:]),
                         k_write, v_new)
  return _from_chunks(states, t), S


def delta_rule_states(k, v, beta, *, k_write=None, log_decay=None, initial_state=None, chunk_size=64):
  """The state after every token of the online solve, chunkwise: [B, T, HV, K, V], and the final state.

  Memory is T·K·V per head (plus C·C·K per chunk for per-channel decay): meant for small V, e.g. the
  OSDN d-recurrence (V = 1) run as a delta rule.
  """
  return _states(k, v, beta, k_write, log_decay, initial_state, online=True, chunk_size=chunk_size)


@functools.partial(jax.jit, static_argnames=("online", "chunk_size"))
def _solve(q, k, v, beta, k_write, log_decay, state, scale, *, online: bool, chunk_size: int):
  out_dtype, t = q.dtype, q.shape[1]
  q, k, v, beta, k_write, log_decay, state = common.prepare(
      q, k, v, beta, k_write, log_decay, state, head_axis=2)
  if log_decay is not None and log_decay.ndim == 3:
    log_decay = log_decay[..., None]               # scalar decay as a trailing axis of size 1
  scale = jnp.asarray(scale, q.dtype)
  chunks = [_to_chunks(x, chunk_size) for x in (q, k, k_write, v, beta, log_decay)]
  o, S = _chunk_solve(*chunks, state, scale, online=online)
  return _from_chunks(o, t).astype(out_dtype), S


def delta_rule(q, k, v, beta, *, k_write=None, log_decay=None, initial_state=None, scale=None,
               chunk_size=64):
  """Chunkwise online solve. Shapes as `naive.delta_rule`; returns (o, final state)."""
  scale = common.default_scale(scale, q.shape[-1])
  return _solve(q, k, v, beta, k_write, log_decay, initial_state, scale, online=True,
                chunk_size=chunk_size)


def linear_attention(q, k, v, *, beta=None, log_decay=None, initial_state=None, scale=None, chunk_size=64):
  """Chunkwise offline solve. Shapes as `naive.linear_attention`; returns (o, final state)."""
  scale = common.default_scale(scale, q.shape[-1])
  return _solve(q, k, v, beta, None, log_decay, initial_state, scale, online=False,
                chunk_size=chunk_size)
