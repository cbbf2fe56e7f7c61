"""`grads_pairs` (per-channel decay): the decayed pair gradients through s×s sub-blocks and the finish, grid
(B, HV, NC, K/BK), a loop over K chunks of kc columns. Off-diagonal blocks are factored through the reference row
(both factors ≤ 1); diagonal blocks through their middle row where the decays allow, else as pairwise [s, s, kc]
tensors (`intra.Channel.diag_grads`)."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gpu.chunk_math import F32, accumulate, dot
from pallas_kernels.gpu.common import split_refs
from pallas_kernels.gpu.delta_rule import layout as L
from pallas_kernels.gpu.intra import ALL, Channel, block, load


def _pairs_chunk(st, ch, cols, refs, dbeta):
  """One K chunk (columns `cols`, kc wide) of `grads_pairs`: stores dq, dk, dk̃ there; returns, per row block,
  (dβ + this chunk's share [s], dG [s, kc])."""
  (q_ref, k_ref, kw_ref, beta_ref, t_ref, dw_ref, dm_ref, da_ref, dqs_ref, dkws_ref, dgs_ref,
   dq_ref, dk_ref, dkw_ref) = refs
  s, n = ch.s, ch.n
  lo = st.lo
  q, k, kw = ([load(r, block(a, s), cols) for a in range(n)] for r in (q_ref, k_ref, kw_ref))
  beta = [load(beta_ref, block(a, s))[:, None] for a in range(n)]
  dq_p, R, dkw_p = [None] * n, [None] * n, [None] * n
  for a in range(n):
    ba = block(a, s)
    wm, wa = dm_ref[ba, ba], da_ref[ba, ba]
    (dq_p[a], R[a]), dy = ch.diag_grads(a, cols, kw[a], [wm, wa], [(wm, q[a]), (beta[a] * wa, k[a])])
    dkw_p[a] = accumulate(dkw_p[a], dy)
    if a == 0:
      continue
    fa = ch.row_factor(a, cols)
    xq, xk = lo(q[a] * fa), lo(k[a] * fa)
    for b in range(a):
      bb = block(b, s)
      fb = ch.col_factor(a, b, cols)
      yb = lo(kw[b] * fb)
      wm, wa = dm_ref[ba, bb], da_ref[ba, bb]
      dq_p[a] = dq_p[a] + dot(lo(wm), yb) * fa
      R[a] = R[a] + dot(lo(wa), yb) * fa
      t = dot(lo(wm), xq, ta=True) + dot(lo(beta[a] * wa), xk, ta=True)
      dkw_p[b] = dkw_p[b] + t * fb
  out = []
  for a in range(n):
    ba = block(a, s)
    eg = jnp.exp(ch.G(a, cols))
    dkb = -dot(lo(t_ref[:, ba]), dw_ref[:, cols], ta=True)             # (Tᵀ dW) rows of block a
    dk = beta[a] * (R[a] + dkb * eg)
    dkw = load(dkws_ref, ba, cols) + dkw_p[a]
    dq_ref[ba, cols] = (load(dqs_ref, ba, cols) + dq_p[a]).astype(dq_ref.dtype)
    if dkw_ref is not None:
      dk_ref[ba, cols] = dk.astype(dk_ref.dtype)
      dkw_ref[ba, cols] = dkw.astype(dkw_ref.dtype)
    else:
      dk_ref[ba, cols] = (dk + dkw).astype(dk_ref.dtype)
    db = dbeta[a] + jnp.sum(k[a] * R[a], axis=1) + jnp.sum(dkb * (k[a] * eg), axis=1)
    dg = load(dgs_ref, ba, cols) + q[a] * dq_p[a] + k[a] * dk - kw[a] * dkw_p[a]
    out.append((db, dg))
  return out


def _kernel(st, *refs):
  sep = not st.same_keys
  (q_ref, k_ref, kw_ref, g_ref, beta_ref, t_ref, dw_ref, dm_ref, da_ref, dqs_ref, dkws_ref, dgs_ref,
   dq_ref, dk_ref, dkw_ref, dbeta_ref, dg_ref) = split_refs(refs, *([1] * 14), sep, 1, 1)
  s, n = st.sub, st.num_sub
  bk = g_ref.shape[-1]
  kc = min(st.k_block(st.config.grads.block_k_pairs), bk)
  ch = Channel(g_ref, s, n, kc, st.config.diagonal.factor)
  io = (q_ref, k_ref, kw_ref, beta_ref, t_ref, dw_ref, dm_ref, da_ref, dqs_ref, dkws_ref, dgs_ref,
        dq_ref, dk_ref, dkw_ref)

  def step(cols, dbeta):
    parts = _pairs_chunk(st, ch, cols, io, dbeta)
    for a, (_, dg) in enumerate(parts):
      dg_ref[block(a, s), cols] = dg
    return tuple(db for db, _ in parts)

  zeros = tuple(jnp.zeros((s,), F32) for _ in range(n))
  if bk == kc:
    dbeta = step(ALL, zeros)
  else:
    dbeta = lax.fori_loop(0, bk // kc, lambda i, d: step(pl.ds(pl.multiple_of(i * kc, kc), kc), d), zeros)
  for a in range(n):
    dbeta_ref[block(a, s)] = dbeta[a]


def grads_pairs(st: L.Static, q, k, kw, beta, G, T, dws, dM, dA, dq_s, dkw_s, dG_s):
  """Per channel → (dq, dk, dk_write or None) [B, T, HV, K] (`Static.dq_dtype`, `.dkw_dtype`), dβ's K part
  [NK, B, HV, T], dG [B, T, HV, K]."""
  bk = st.k_block(st.config.grads.block_k)
  nk = st.key_dim // bk
  w = L.chunk_v_grid
  ktok = lambda head=None: L.tokens(st, bk, w, head, split=True)
  in_specs = [ktok(st.key_head), ktok(st.key_head), ktok(st.kw_head), L.decay_spec(st, w, width=bk),
              L.vector(st, w), L.head_major(st, st.chunk, w), L.head_major(st, bk, w, split=True),
              L.head_major(st, st.chunk, w), L.head_major(st, st.chunk, w), ktok(), ktok(), ktok()]
  args = [q, k, kw, G, beta, T, dws, dM, dA, dq_s, dkw_s, dG_s]
  b, hv, t, kd = st.batch, st.value_heads, st.length, st.key_dim
  return L.launch_finish(st, _kernel, bk=bk, in_specs=in_specs, args=args, extra_specs=[L.parts(st, w), ktok()],
                         extra_shapes=[L.f32((nk, b, hv, t)), L.f32((b, t, hv, kd))],
                         warps=st.config.grads.warps_pairs, name="delta_rule_grads_pairs")
