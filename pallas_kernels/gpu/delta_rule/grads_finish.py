"""`grads_finish` (decay none / scalar): dq, dk, dk̃ and each K block's share of dβ and dG from the decayed pair
weights, as [C, C] × [C, BK] dots. Grid (B, HV, NC, K/BK); partial sums over K blocks are summed in XLA."""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.gpu.chunk_math import F32, dot, row_scale
from pallas_kernels.gpu.common import split_refs
from pallas_kernels.gpu.delta_rule import factors
from pallas_kernels.gpu.delta_rule import layout as L
from pallas_kernels.gpu.intra import ALL, load


def _kernel(st, *refs):
  """One K block: dq, dk, dk̃ from the decayed pair weights Mw = scale dM⊙Γ, Aw = dA⊙Γ as [C, C] × [C, BK]
  dots, plus this block's share of dβ and (scalar decay) dG."""
  has_g, sep = st.decay != "none", not st.same_keys
  (q_ref, k_ref, kw_ref, g_ref, beta_ref, t_ref, dw_ref, mw_ref, aw_ref, dqs_ref, dkws_ref,
   dq_ref, dk_ref, dkw_ref, dbeta_ref, dg_ref) = split_refs(refs, 1, 1, 1, has_g, *([1] * 9), sep, 1,
                                                        has_g)
  beta = load(beta_ref, ALL)[:, None]
  G = load(g_ref, ALL) if has_g else None
  eg = factors.rows(G)
  Mw, Aw = st.lo(mw_ref[...]), aw_ref[...].astype(F32)
  bAw = st.lo(beta * Aw)
  Aw = st.lo(Aw)
  q, k, kw = load(q_ref, ALL), load(k_ref, ALL), load(kw_ref, ALL)
  dq_p = dot(Mw, st.lo(kw))
  dq_ref[...] = (dqs_ref[...] + dq_p).astype(dq_ref.dtype)
  R = dot(Aw, st.lo(kw))
  dkb = -dot(st.lo(t_ref[...]), dw_ref[...], ta=True)                   # Tᵀ dW (the stored operand is −dW)
  dk = beta * (R + row_scale(dkb, eg))
  dbeta_ref[...] = jnp.sum(k * R, axis=1) + jnp.sum(dkb * row_scale(k, eg), axis=1)
  dkw_p = dot(Mw, st.lo(q), ta=True) + dot(bAw, st.lo(k), ta=True)
  dkw = dkws_ref[...] + dkw_p
  if sep:
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dkw_ref[...] = dkw.astype(dkw_ref.dtype)
  else:
    dk_ref[...] = (dk + dkw).astype(dk_ref.dtype)
  if has_g:
    dg_ref[...] = jnp.sum(q * dq_p + k * dk - kw * dkw_p, axis=1)


def grads_finish(st: L.Static, q, k, kw, beta, G, T, dws, Mw, Aw, dq_s, dkw_s):
  """Decay none / scalar → (dq, dk, dk_write or None) [B, T, HV, K] (`Static.dq_dtype`, `.dkw_dtype`), dβ's K
  part [NK, B, HV, T] and (scalar) dG's intra-chunk part [NK, B, HV, T] (partial sums over the K blocks, None
  without decay)."""
  bk = st.k_block(st.config.grads.block_k)
  nk = st.key_dim // bk
  w = L.chunk_v_grid
  has_g = st.decay != "none"
  ktok = lambda head=None: L.tokens(st, bk, w, head, split=True)
  in_specs = [ktok(st.key_head), ktok(st.key_head), ktok(st.kw_head)]
  args = [q, k, kw]
  if has_g:
    in_specs.append(L.vector(st, w))
    args.append(G)
  in_specs += [L.vector(st, w), L.head_major(st, st.chunk, w), L.head_major(st, bk, w, split=True),
               L.head_major(st, st.chunk, w), L.head_major(st, st.chunk, w), ktok(), ktok()]
  args += [beta, T, dws, Mw, Aw, dq_s, dkw_s]
  parts = 2 if has_g else 1
  dq, dk, dkw, *sums = L.launch_finish(
      st, _kernel, bk=bk, in_specs=in_specs, args=args, extra_specs=[L.parts(st, w)] * parts,
      extra_shapes=[L.f32((nk, st.batch, st.value_heads, st.length))] * parts, warps=st.config.grads.warps_finish,
      name="delta_rule_grads_finish")
  return dq, dk, dkw, sums[0], (sums[1] if has_g else None)
