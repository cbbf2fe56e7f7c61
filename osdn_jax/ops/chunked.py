"""Chunkwise solves in pure JAX (the XLA path): the WY/UT form of docs/design.md §2 with an asymmetric Gram.

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

Packed sequences (`segment_ids`) take a separate path (`_packed_solve`, with masks inside each chunk; see its
section); with segment_ids=None none of its code runs.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from osdn_jax.ops import common, packing, scan
from osdn_jax.ops.common import LOG_DECAY_FLOOR

_HI = lax.Precision.HIGHEST
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


def _work_layout(q, k, v, beta, k_write, log_decay, state, chunk):
  """The solves' common preparation: the compute dtype and value-head expansion (`common.prepare`), scalar
  log-decays as a trailing axis of size 1, then every per-token input in the work layout. Returns ([q, k,
  k_write, v, beta, g] as [B, HV, NC, C, ...] (g None without decay), the state in the compute dtype)."""
  q, k, v, beta, k_write, log_decay, state = common.prepare(q, k, v, beta, k_write, log_decay, state, head_axis=2)
  if log_decay is not None and log_decay.ndim == 3:
    log_decay = log_decay[..., None]               # scalar decay as a trailing axis of size 1
  return [_to_chunks(x, chunk) for x in (q, k, k_write, v, beta, log_decay)], state


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


def _same(seg):
  """[..., C] segment numbers → [..., C, C]: True where tokens i and j are in one segment."""
  return seg[..., :, None] == seg[..., None, :]


def intra_scores(x, y, G, seg=None):
  """Inclusive lower-triangular decayed scores M_ij = Σ_c x_ic y_jc e^{G_ic − G_jc} for j ≤ i, else 0.

  x, y: [..., C, K]; G: None (no decay), [..., C, 1] (scalar) or [..., C, K] (per channel). → [..., C, C].
  seg: None, or [..., C] segment numbers (broadcasting against x's leading axes): pairs of two segments are 0,
  and G may restart at segment starts (it is then monotone within each segment only).
  """
  c = x.shape[-2]
  mask = _tril(c) if seg is None else _tril(c) & _same(seg)
  if G is None:
    return jnp.where(mask, _einsum("...ik,...jk->...ij", x, y), 0.0)
  if G.shape[-1] == 1:
    g = G[..., 0]
    return _einsum("...ik,...jk->...ij", x, y) * _masked_exp(g[..., :, None] - g[..., None, :], mask)
  return _intra_scores_channel(x, y, G, seg)


def _intra_scores_channel(x, y, G, seg=None):
  c, kd = x.shape[-2:]
  s = min(SUB_CHUNK, c)
  n = c // s
  lead = x.shape[:-2]
  xb, yb, gb = (a.reshape(*lead, n, s, kd) for a in (x, y, G))
  # Diagonal s×s sub-blocks: pairwise exponents, [..., n, s, s, K].
  mask = _tril(s)[:, :, None]
  if seg is not None:
    sb = seg.reshape(*seg.shape[:-1], n, s)
    mask = mask & _same(sb)[..., None]
  e = _masked_exp(gb[..., :, :, None, :] - gb[..., :, None, :, :], mask)
  diag = _einsum("...aik,...ajk,...aijk->...aij", xb, yb, e)
  # Rows of sub-block a against every column j before it, through the reference point r_a = a·s − 1:
  # e^{G_i − G_j} = e^{G_i − G_r} · e^{G_r − G_j}, both exponents ≤ 0. Sub-block 0 has no such columns.
  ref = jnp.concatenate([G[..., :1, :], G[..., s - 1:c - 1:s, :]], axis=-2)           # [..., n, K]
  before = (jnp.arange(c)[None, :] < (jnp.arange(n) * s)[:, None])                    # [n, C]
  if seg is None:
    rows = xb * jnp.exp(gb - ref[..., :, None, :])                                    # [..., n, s, K]
    cols_mask = before
  else:
    # G restarts at segment starts, so the exponents are ≤ 0 only within r_a's segment: keep the rows and
    # columns in it (a pair of one segment with r_a between them is in r_a's segment; other pairs are 0).
    seg_ref = jnp.concatenate([seg[..., :1], seg[..., s - 1:c - 1:s]], axis=-1)      # [..., n]
    rows = xb * _masked_exp(gb - ref[..., :, None, :], (sb == seg_ref[..., None])[..., None])
    cols_mask = before & (seg[..., None, :] == seg_ref[..., :, None])
  cols = y[..., None, :, :] * _masked_exp(ref[..., :, None, :] - G[..., None, :, :], cols_mask[..., None])
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


def _wu(k, k_write, v, beta, G, e_in, *, online: bool, seg=None):
  """(W, U) of every chunk: W = T diag(β)(K ⊙ e^G), U = T diag(β) V with T = (I + A)⁻¹, A the strictly lower
  decayed Gram diag(β)(K ⊙ e^G)(K̃ ⊙ e^−G)ᵀ (pairs of two segments masked when packed); offline (A = 0,
  no erase): (None, diag(β) V)."""
  bv = beta[..., None] * v
  if not online:
    return None, bv
  k_in = k if e_in is None else k * e_in
  a = jnp.where(_tril(k.shape[-2], strict=True), beta[..., None] * intra_scores(k, k_write, G, seg), 0.0)
  wu = solve_unit_lower(a, jnp.concatenate([beta[..., None] * k_in, bv], axis=-1))
  return wu[..., :k.shape[-1]], wu[..., k.shape[-1]:]


def _chunk_recurrence(k, k_write, v, beta, G, state, *, online: bool):
  """The state pass: what enters each chunk and the chunk's corrected values.

  k, k_write [B, HV, NC, C, K]; v [B, HV, NC, C, V]; beta [B, HV, NC, C]; G None or [B, HV, NC, C, 1|K];
  state [B, HV, K, V]. Returns (S_in [B, HV, NC, K, V], V_new [B, HV, NC, C, V], final state).
  """
  e_in, e_out, gamma = _decays(G)
  w, u = _wu(k, k_write, v, beta, G, e_in, online=online)
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


# ---------------------------------------------------------------------------------------------------------
# Packed sequences. Per chunk, with G restarted at every segment start (so e^{G_i} is the decay since the
# later of the chunk start and the token's segment start, and e^{G_i − G_j} within a segment is unchanged):
# pairs (i, j) of two segments are masked in A and in the scores (T = (I + A)⁻¹ is then block diagonal by
# segment), the carried state reaches only the segment that continues from the previous chunk ("cont"
# tokens), tokens of segments that start inside the chunk read their own initial state S0[n], and the state
# carried out of a chunk is that of the segment of its last token. Final states are accumulated in the scan
# carry by a scatter over segment numbers. Everything here is a mask: no −inf log-decay.
# ---------------------------------------------------------------------------------------------------------
class _Segments(NamedTuple):
  """Per-token segment bookkeeping in the work layout [B, 1, NC, C] (broadcasts over the heads)."""
  n: jax.Array       # segment number (zero padding joins the row's last segment, which it leaves unchanged)
  start: jax.Array   # first token of its segment
  end: jax.Array     # last token of its segment (the padded row's last token ends the row's last segment)
  cont: jax.Array    # in the segment entering the chunk from the previous one (no start at or before it)


def _segment_chunks(segment_ids, chunk: int) -> _Segments:
  b, t = segment_ids.shape
  pad = -t % chunk
  n = jnp.pad(packing.segment_index(segment_ids), ((0, 0), (0, pad)), mode="edge")
  start = jnp.pad(packing.segment_starts(segment_ids), ((0, 0), (0, pad)))
  end = jnp.concatenate([start[:, 1:], jnp.ones((b, 1), bool)], axis=1)
  n, start, end = (x.reshape(b, 1, (t + pad) // chunk, chunk) for x in (n, start, end))
  return _Segments(n, start, end, jnp.cumsum(start, axis=-1) == 0)


def segment_decay_cumsum(g, start):
  """G restarted at segment starts: Σ g_j from the later of the chunk start and the segment start to i.

  g [..., C, 1|K] (clamped at LOG_DECAY_FLOOR); start [..., C] (broadcasting against g's leading axes).
  """
  g = jnp.maximum(g, LOG_DECAY_FLOOR)
  return scan.affine_scan(jnp.ones((), g.dtype), g, reset=start, axis=g.ndim - 2)[0]


def _initial_reads(xs, S0, seg: _Segments):
  """x_iᵀ S0[n_i] for the tokens of segments that start inside their chunk (0 for cont tokens).

  xs: list of [B, HV, NC, C, K]; S0 [N, HV, K, V] → list of [B, HV, NC, C, V]. Chunk by chunk: the per-token
  gather of S0 is a transient [B, HV, C, K, V], recomputed in the backward (jax.checkpoint), never stored.
  """
  x = jnp.stack([jnp.where(seg.cont[..., None], 0.0, x) for x in xs])        # [m, B, HV, NC, C, K]

  @jax.checkpoint
  def one(args):
    x_c, n_c = args                                                         # [m, B, HV, C, K], [B, 1, C]
    s0 = jnp.moveaxis(S0[n_c[:, 0]], 1, 2)                                  # [B, HV, C, K, V]
    return _einsum("mbhck,bhckv->mbhcv", x_c, s0)

  ys = lax.map(one, (jnp.moveaxis(x, 3, 0), jnp.moveaxis(seg.n, 2, 0)))      # [NC, m, B, HV, C, V]
  return list(jnp.moveaxis(ys, 0, 3))


def _final_terms(k_write, G, seg: _Segments, num_segments: int):
  """What the scan needs to accumulate each segment's final state in the chunk where the segment ends.

  F[n] = e^{G_e} ⊙ S_init + Σ_{j in n, in the chunk} (k̃_j ⊙ e^{G_e − G_j}) v_newⱼᵀ, e = n's last token.
  Returns per chunk (k̃_j ⊙ e^{G_e(j) − G_j} [B, HV, NC, C, K], its target n or N (dropped) [B, 1, NC, C],
  the coefficient e^{G_e} of the carried state for the cont segment ending in the chunk [B, HV|1, NC, 1|K]
  and its target [B, 1, NC]), and the coefficient e^{G_e} of S0 per segment [N, HV|1, 1|K] (nonzero for
  segments that start and end inside one chunk).
  """
  c = seg.n.shape[-1]
  decay = jnp.ones(seg.n.shape + (1,), k_write.dtype) if G is None else jnp.exp(G)   # e^{G_i}
  # e(j): the last token of j's segment in the chunk (the chunk's last token for the continuing segment).
  e = lax.cummin(jnp.where(seg.end, jnp.arange(c), c - 1), axis=seg.n.ndim - 1, reverse=True)
  kd = k_write if G is None else k_write * jnp.exp(
      jnp.take_along_axis(G, jnp.broadcast_to(e[..., None], G.shape[:-1] + (1,)), axis=-2) - G)
  ends_here = ~(seg.n == seg.n[..., -1:]) | seg.end[..., -1:]
  target = jnp.where(ends_here, seg.n, num_segments)
  cont_end = seg.cont & seg.end
  gc = jnp.sum(jnp.where(cont_end[..., None], decay, 0.0), axis=-2)
  target_c = jnp.where(jnp.any(cont_end, axis=-1), seg.n[..., 0], num_segments)
  # S0 coefficients: scattered by the end token of each segment that starts inside its last chunk.
  hv = k_write.shape[1]
  d0 = jnp.moveaxis(jnp.broadcast_to(decay, (decay.shape[0], hv) + decay.shape[2:]), 1, 3)   # [B, NC, C, HV, .]
  idx0 = jnp.where(seg.end & ~seg.cont, seg.n, num_segments)[:, 0]
  coef0 = jnp.zeros((num_segments,) + d0.shape[3:], d0.dtype).at[idx0].add(d0, mode="drop")
  return (kd, target, gc, target_c), coef0


def _add_finals(finals, S, v_new, kd, target, gc, target_c):
  """Scatter-adds one chunk's final-state terms (shapes of `_final_terms` without NC) into finals [N, ...]."""
  upd = kd[..., :, None] * v_new[..., None, :]                              # [B, HV, C, K, V]
  finals = finals.at[target[:, 0]].add(jnp.moveaxis(upd, 2, 1), mode="drop")
  return finals.at[target_c[:, 0]].add(jnp.broadcast_to(gc[..., None] * S, S.shape), mode="drop")


def _packed_solve(q, k, k_write, v, beta, g, S0, scale, seg: _Segments, *, online: bool, num_segments):
  """The chunkwise solve of packed sequences on chunked inputs (shapes of `_chunk_recurrence`, q like k).

  S0: None (zeros) or [N, HV, K, V]. → (o like v, final states [N, HV, K, V] or None when num_segments is
  None).
  """
  G = None if g is None else segment_decay_cumsum(g, seg.start)
  e_in = None if G is None else jnp.exp(G)
  q_in = q if e_in is None else q * e_in
  w, u = _wu(k, k_write, v, beta, G, e_in, online=online, seg=seg.n)
  r_q = None
  if S0 is not None:   # segments starting inside a chunk: V_new = U − W S0[n], o += (Q ⊙ e^G) S0[n]
    reads = _initial_reads([q_in] if w is None else [q_in, w], S0, seg)
    r_q = reads[0]
    u = u if w is None else u - reads[1]
  cont = seg.cont[..., None]
  w = None if w is None else jnp.where(cont, w, 0.0)
  # The state carried out of the chunk is its last token's segment's: S_init decayed plus its tokens' writes.
  last = (seg.n == seg.n[..., -1:])[..., None]
  kw_out = jnp.where(last, k_write if G is None else k_write * _masked_exp(G[..., -1:, :] - G, last), 0.0)
  gamma = None if G is None else jnp.exp(G[..., -1, :])[..., :, None]
  restart = None
  if S0 is not None:
    restart = jnp.moveaxis(S0[seg.n[:, 0, :, -1]], 1, 2)                     # [B, HV, NC, K, V]
    restart = restart if gamma is None else gamma * restart
  keep = seg.cont[..., -1][..., None, None]                                  # [B, 1, NC, 1, 1]
  fins, finals, coef0 = (None,) * 4, None, None
  if num_segments is not None:
    fins, coef0 = _final_terms(k_write, G, seg, num_segments)
    finals = jnp.zeros((num_segments,) + k_write.shape[1:2] + (k.shape[-1], v.shape[-1]), v.dtype)

  def step(carry, xs):
    S, finals = carry
    w_c, u_c, kw_c, gamma_c, keep_c, restart_c, fin_c = xs
    v_new = u_c if w_c is None else u_c - _einsum("...ck,...kv->...cv", w_c, S)
    carried = S if gamma_c is None else gamma_c * S
    S_next = jnp.where(keep_c, carried, 0.0 if restart_c is None else restart_c)
    S_next = S_next + _einsum("...ck,...cv->...kv", kw_c, v_new)
    if finals is not None:
      finals = _add_finals(finals, S, v_new, *fin_c)
    return (S_next, finals), (S, v_new)

  chunk_major = lambda x: None if x is None else jnp.moveaxis(x, 2, 0)
  state = jnp.zeros(k.shape[:2] + (k.shape[-1], v.shape[-1]), v.dtype)   # chunk 0 starts a segment per row
  xs = jax.tree.map(chunk_major, (w, u, kw_out, gamma, keep, restart, fins))
  (_, finals), (S_in, v_new) = lax.scan(step, (state, finals), xs)
  S_in, v_new = jnp.moveaxis(S_in, 0, 2), jnp.moveaxis(v_new, 0, 2)
  o = _einsum("...ck,...kv->...cv", jnp.where(cont, q_in, 0.0), S_in)
  o = o + _einsum("...ij,...jv->...iv", intra_scores(q, k_write, G, seg.n), v_new)
  o = o if r_q is None else o + r_q
  if finals is not None and S0 is not None:
    finals = finals + coef0[..., None] * S0
  return scale * o, finals


@functools.partial(jax.jit, static_argnames=("online", "chunk_size", "num_segments"))
def _solve_packed(q, k, v, beta, k_write, log_decay, S0, scale, segment_ids, *, online: bool,
                  chunk_size: int, num_segments):
  out_dtype, t = q.dtype, q.shape[1]
  chunks, _ = _work_layout(q, k, v, beta, k_write, log_decay, None, chunk_size)
  ct = chunks[0].dtype
  S0 = None if S0 is None else jnp.asarray(S0, ct)
  seg = _segment_chunks(segment_ids, chunk_size)
  o, finals = _packed_solve(*chunks, S0, jnp.asarray(scale, ct), seg, online=online, num_segments=num_segments)
  return _from_chunks(o, t).astype(out_dtype), finals


@functools.partial(jax.jit, static_argnames=("online", "chunk_size"))
def _states(k, v, beta, k_write, log_decay, state, *, online: bool, chunk_size: int):
  t = k.shape[1]
  (_, k, k_write, v, beta, g), state = _work_layout(k, k, v, beta, k_write, log_decay, state, chunk_size)
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
  chunks, state = _work_layout(q, k, v, beta, k_write, log_decay, state, chunk_size)
  o, S = _chunk_solve(*chunks, state, jnp.asarray(scale, chunks[0].dtype), online=online)
  return _from_chunks(o, t).astype(out_dtype), S


def _dispatch(online, q, k, v, beta, k_write, log_decay, initial_state, scale, chunk_size, segment_ids,
              num_segments):
  scale = common.default_scale(scale, q.shape[-1])
  if segment_ids is None:
    return _solve(q, k, v, beta, k_write, log_decay, initial_state, scale, online=online,
                  chunk_size=chunk_size)
  return _solve_packed(q, k, v, beta, k_write, log_decay, initial_state, scale, segment_ids, online=online,
                       chunk_size=chunk_size, num_segments=num_segments)


def delta_rule(q, k, v, beta, *, k_write=None, log_decay=None, initial_state=None, scale=None,
               chunk_size=64, segment_ids=None, num_segments=None):
  """Chunkwise online solve. Shapes as `naive.delta_rule`; returns (o, final state).

  Packed (`segment_ids` [B, T]): initial_state [N, HV, K, V] (default zeros); the final states [N, HV, K, V]
  come back when num_segments = N is given, else None.
  """
  return _dispatch(True, q, k, v, beta, k_write, log_decay, initial_state, scale, chunk_size, segment_ids,
                   num_segments)


def linear_attention(q, k, v, *, beta=None, log_decay=None, initial_state=None, scale=None, chunk_size=64,
                     segment_ids=None, num_segments=None):
  """Chunkwise offline solve. Shapes as `naive.linear_attention`; returns (o, final state); packing as above."""
  return _dispatch(False, q, k, v, beta, None, log_decay, initial_state, scale, chunk_size, segment_ids,
                   num_segments)
