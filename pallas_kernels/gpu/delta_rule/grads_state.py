"""`grads_state`: the state-side gradient terms, grid (B, HV, NC, K/BK), a static loop over V steps with three
[C, BK] accumulators:
    dq_state = scale (dO Sᵀ) ⊙ e^G,    −dW = dV_new Sᵀ (stored in the state dtype),    dk̃_state = (V_new dSᵀ) ⊙ e^{G_C − G}
and their share of dG, the chunk-end terms Σ_j k̃_j ⊙ dk̃_state_j + e^{G_C} ⊙ rowsum(S ⊙ dS) included.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gpu.chunk_math import F32, accumulate, dot, iota, last_row, row_scale
from pallas_kernels.gpu.common import pallas_call, split_refs
from pallas_kernels.gpu.delta_rule import factors
from pallas_kernels.gpu.delta_rule import layout as L
from pallas_kernels.gpu.intra import ALL, load


def _kernel(st, *refs):
  has_g = st.decay != "none"
  (q_ref, kw_ref, g_ref, sin_ref, dh_ref, do_ref, vn_ref, dvn_ref,
   dq_ref, dw_ref, dkw_ref, dg_ref) = split_refs(refs, has_g, has_g, has_g, 1, 1, 1, 1, 1,
                                             1, 1, 1, has_g)
  dqs = dws = dks = dgam = None
  bvg = st.grad_block_v
  for vb in range(st.value_dim // bvg):
    cs = slice(vb * bvg, (vb + 1) * bvg)
    S, dS = st.lo(sin_ref[:, cs]), st.lo(dh_ref[:, cs])                 # [BK, BV]
    do, vn, dvn = (st.lo(r[:, cs]) for r in (do_ref, vn_ref, dvn_ref))   # [C, BV]
    dqs = accumulate(dqs, dot(do, S, tb=True))
    dws = accumulate(dws, dot(dvn, S, tb=True))
    dks = accumulate(dks, dot(vn, dS, tb=True))
    if has_g:
      dgam = accumulate(dgam, jnp.sum(S.astype(F32) * dS.astype(F32), axis=1))
  dw_ref[...] = st.lo(dws).astype(dw_ref.dtype)                        # −dW, the operand of dT and dk
  if not has_g:
    dq_ref[...] = st.scale * dqs
    dkw_ref[...] = dks
    return
  G = load(g_ref, ALL)
  to_end = factors.to_end(st, G)[0]                                      # e^{G_C − G}
  dq = st.scale * row_scale(dqs, jnp.exp(G))
  dkw = row_scale(dks, to_end)
  dq_ref[...] = dq
  dkw_ref[...] = dkw
  kw = load(kw_ref, ALL)
  dg = load(q_ref, ALL) * dq - kw * dkw
  gl = last_row(G)
  extra = jnp.sum(kw * dkw, axis=0) + jnp.exp(gl) * dgam               # [BK]: the chunk-end terms
  dg = dg + jnp.where(iota(dg.shape, 0) == st.chunk - 1, extra[None, :], 0.0)
  dg_ref[...] = jnp.sum(dg, axis=1) if st.decay == "scalar" else dg


def grads_state(st: L.Static, q, kw, G, S_in, dS_out, V_new, dV_new, do):
  """→ dq_state, dk̃_state [B, T, HV, K] fp32, −dW [B, HV, T, K] in st.mm, dG_state (scalar: [NK, B, HV, T]
  partial sums; per channel [B, T, HV, K]; None without decay)."""
  bk = st.k_block(st.config.grads.block_k)
  nk = st.key_dim // bk
  w = L.chunk_v_grid
  has_g = st.decay != "none"
  in_specs, args = [], []
  if has_g:
    in_specs += [L.tokens(st, bk, w, st.key_head, split=True), L.tokens(st, bk, w, st.kw_head, split=True),
                 L.decay_spec(st, w, width=bk)]
    args += [q, kw, G]
  in_specs += [L.states_k(st, bk, w), L.states_k(st, bk, w), L.tokens(st, st.value_dim, w),
               L.head_major(st, st.value_dim, w), L.head_major(st, st.value_dim, w)]
  args += [S_in, dS_out, do, V_new, dV_new]
  b, hv, t, kd = st.batch, st.value_heads, st.length, st.key_dim
  out_specs = [L.tokens(st, bk, w, split=True), L.head_major(st, bk, w, split=True),
               L.tokens(st, bk, w, split=True)]
  out_shape = [L.f32((b, t, hv, kd)), jax.ShapeDtypeStruct((b, hv, t, kd), st.mm), L.f32((b, t, hv, kd))]
  if st.decay == "scalar":
    out_specs.append(L.parts(st, w))
    out_shape.append(L.f32((nk, b, hv, t)))
  elif st.decay == "channel":
    out_specs.append(L.tokens(st, bk, w, split=True))
    out_shape.append(L.f32((b, t, hv, kd)))
  kernel = lambda *refs: _kernel(st, *refs)
  outs = pallas_call(kernel, grid=(b, hv, st.num_chunks, nk), in_specs=in_specs, out_specs=out_specs,
                     out_shape=out_shape, interpret=st.interpret, num_warps=st.config.grads.warps_state,
                     num_stages=st.stages,
                     fp32_dots=st.fp32_dots, name="delta_rule_grads_state")(*args)
  dq_s, dws, dkw_s = outs[:3]
  dG_s = outs[3] if has_g else None
  return dq_s, dws, dkw_s, dG_s
