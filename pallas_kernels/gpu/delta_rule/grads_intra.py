"""`grads_intra`: the C×C gradients of one chunk as whole-chunk dots, grid (B, HV, NC).

    dM = scale dO V_newᵀ,   dT = dW (βK e^G)ᵀ + dV_new (βV)ᵀ,   dA = −Tᵀ dT Tᵀ (strictly lower, fp32),
    dv = β Tᵀ dV_new and dβ's V part.
It stores the pair weights [B, HV, T, C] for the finish: decay none / scalar the decayed scale·dM⊙Γ, dA⊙Γ (state
dtype); per channel the raw scale·dM, dA (fp32). (The finish is a kernel of its own so that neither holds the
C×C tiles and the [C, K] tiles at once.)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gpu.chunk_math import F32, accumulate, dot, row_scale
from pallas_kernels.gpu.common import pallas_call, split_refs
from pallas_kernels.gpu.delta_rule import factors
from pallas_kernels.gpu.delta_rule import layout as L
from pallas_kernels.gpu.intra import ALL, causal, decay_factor, load


def _intra_v_loop(st, t_lo, beta, do_ref, vn_ref, dvn_ref, v_ref, dv_ref):
  """dM = dO V_newᵀ, dTu = dV_new (βV)ᵀ [C, C] and dβ's V part, storing dv = β Tᵀ dV_new."""
  dM = dTu = dbeta = None
  bvg = st.grad_block_v
  for vb in range(st.value_dim // bvg):
    cs = slice(vb * bvg, (vb + 1) * bvg)
    do, vn, dvn = (st.lo(r[:, cs]) for r in (do_ref, vn_ref, dvn_ref))
    v = load(v_ref, ALL, cs)
    dM = accumulate(dM, dot(do, vn, tb=True))
    dTu = accumulate(dTu, dot(dvn, st.lo(beta * v), tb=True))
    dbv = dot(t_lo, dvn, ta=True)                                        # Tᵀ dV_new [C, BV]
    dv_ref[:, cs] = (beta * dbv).astype(dv_ref.dtype)
    dbeta = accumulate(dbeta, jnp.sum(dbv * v, axis=1))
  return dM, dTu, dbeta


def _inverse_grad(T, dT):
  """dA = −Tᵀ dT Tᵀ, strictly lower (fp32 at HIGHEST, as the products that build T)."""
  dA = -dot(dot(T, dT, ta=True), T, tb=True)
  return jnp.where(causal(T.shape[0], strict=True), dA, 0.0)


def _intra_dT(st, beta, k_ref, g_ref, dw_ref, dTu, eg):
  """dT = dTu + dW (βK e^G)ᵀ [C, C] over K blocks (the stored operand is −dW)."""
  bk = st.k_block(st.config.grads.block_k)
  dT = dTu
  for i in range(st.key_dim // bk):
    cs = slice(i * bk, (i + 1) * bk)
    e = jnp.exp(load(g_ref, ALL, cs)) if st.decay == "channel" else eg
    kb = st.lo(beta * row_scale(load(k_ref, ALL, cs), e))             # β K e^G, as in prep
    dT = dT - dot(dw_ref[:, cs], kb, tb=True)
  return dT


def _kernel(st, *refs):
  has_g = st.decay != "none"
  (k_ref, v_ref, beta_ref, g_ref, t_ref, do_ref, vn_ref, dvn_ref, dw_ref,
   dv_ref, dbeta_ref, dm_ref, da_ref) = split_refs(refs, 1, 1, 1, has_g, *([1] * 9))
  T = t_ref[...].astype(F32)
  beta = load(beta_ref, ALL)[:, None]
  dM, dTu, dbeta = _intra_v_loop(st, st.lo(T), beta, do_ref, vn_ref, dvn_ref, v_ref, dv_ref)
  dbeta_ref[...] = dbeta
  G = load(g_ref, ALL) if st.decay == "scalar" else None               # [C] (per channel: by K block)
  dA = _inverse_grad(T, _intra_dT(st, beta, k_ref, g_ref, dw_ref, dTu, factors.rows(G)))
  if st.decay == "channel":                                            # raw: grads_pairs applies sub-blocks
    dm_ref[...] = st.scale * dM
    da_ref[...] = dA
    return
  gam = decay_factor(G, st.chunk, strict=False)                        # the decayed pair weights
  dm_ref[...] = (st.scale * dM * gam).astype(dm_ref.dtype)
  da_ref[...] = (dA * gam).astype(da_ref.dtype)


def grads_intra(st: L.Static, k, v, beta, G, T, V_new, dV_new, do, dws):
  """→ dv [B, T, HV, V] (in `Static.grad_dtype`), dβ's V part [B, HV, T], and the pair weights [B, HV, T, C]:
  decay none / scalar scale·dM⊙Γ and dA⊙Γ in st.mm (for `grads_finish`); per channel raw scale·dM and dA in
  fp32 (for `grads_pairs`)."""
  w = L.chunk_grid
  kd, vd = st.key_dim, st.value_dim
  in_specs = [L.tokens(st, kd, w, st.key_head), L.tokens(st, vd, w), L.vector(st, w)]
  args = [k, v, beta]
  if st.decay != "none":
    in_specs.append(L.decay_spec(st, w))
    args.append(G)
  in_specs += [L.head_major(st, st.chunk, w), L.tokens(st, vd, w), L.head_major(st, vd, w),
               L.head_major(st, vd, w), L.head_major(st, kd, w)]
  args += [T, do, V_new, dV_new, dws]
  b, hv, t = st.batch, st.value_heads, st.length
  pair_dtype = F32 if st.decay == "channel" else st.mm
  out_specs = [L.tokens(st, vd, w), L.vector(st, w), L.head_major(st, st.chunk, w),
               L.head_major(st, st.chunk, w)]
  out_shape = [jax.ShapeDtypeStruct((b, t, hv, vd), st.grad_dtype), L.f32((b, hv, t)),
               jax.ShapeDtypeStruct((b, hv, t, st.chunk), pair_dtype),
               jax.ShapeDtypeStruct((b, hv, t, st.chunk), pair_dtype)]
  kernel = lambda *refs: _kernel(st, *refs)
  return tuple(pallas_call(kernel, grid=(b, hv, st.num_chunks), in_specs=in_specs, out_specs=out_specs,
                           out_shape=out_shape, interpret=st.interpret, num_warps=st.config.grads.warps_intra,
                           num_stages=st.stages,
                           fp32_dots=st.fp32_dots, name="delta_rule_grads_intra")(*args))
