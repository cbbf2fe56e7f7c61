"""Backward kernels of the chunkwise online solve. The forward saves its inputs and T = (I + A)⁻¹; the
backward forms W and U from T (`delta_rule_fwd.prep` given T: the `wu` kernel), reruns `state_pass` (the chunk
states S_in and V_new; packed sequences reset as in the forward), then:

4. `dv_local`    chunk-parallel, grid (B, HV, NC, V/BV): dV_loc = scale · Mᵀ dO with M the decayed causal
                 scores tril((Q⊙e^G)(K̃⊙e^−G)ᵀ) (what V_new receives from the chunk's own outputs).
5. `state_bwd`   sequential in reverse, grid (B, HV, V/BV), the fp32 state gradient dS [K, BV] in registers:
                 dV_new = dV_loc + (K̃⊙e^{G_C−G}) dS;
                 dS ← e^{G_C} ⊙ dS + scale (Q⊙e^G)ᵀ dO − Wᵀ dV_new; emits dS leaving every chunk, dV_new
                 and dS0 (packed: dS restarts from dS_T[n] at segment n's last chunk, dS0[n] is stored at its
                 first).
6. `grads_state` chunk-parallel, grid (B, HV, NC, K/BK), a static loop over V blocks, three [C, BK]
                 accumulators: the state-side terms dq_state = scale (dO Sᵀ) ⊙ e^G, dW = −dV_new Sᵀ and
                 dk̃_state = (V_new dSᵀ) ⊙ e^{G_C − G}, and their share of dG (with the chunk-end terms).
7. `grads_intra` chunk-parallel, grid (B, HV, NC): every C×C quantity as whole-chunk dots — dM = scale dO V_newᵀ,
                 dT = dW (βK e^G)ᵀ + dV_new (βV)ᵀ, dA = −Tᵀ dT Tᵀ — then dv = β Tᵀ dV_new and dβ's V part. It stores
                 the pair weights [B, HV, T, C]: decay none / scalar the decayed scale·dM⊙Γ, dA⊙Γ (st.mm);
                 per channel the raw scale·dM, dA (fp32).
8. `grads_finish` (decay none / scalar) chunk-parallel, grid (B, HV, NC, K/BK): dq, dk, dk̃ and the K block's
                 share of dβ, dG, the decayed pair products as [C, C] × [C, BK] dots of the stored weights.
   `grads_pairs` (per channel) the same grid, a loop over K chunks of kc columns: the decayed pair products
                 through s×s sub-blocks (off-diagonal factored, diagonal as pairwise [s, s, kc] tensors) and
                 the same finish.
(`grads_intra` and the finish are two kernels, not one, so that neither holds the C×C tiles and the [C, K]
tiles at once: fused, the kernel spilled gigabytes of registers to local memory on an H200.)

Per chunk (S = state entering, dS = gradient of the state leaving):
  dW = −dV_new Sᵀ, dU = dV_new;  dT = dW (β K e^G)ᵀ + dU (β V)ᵀ;  dA = −Tᵀ dT Tᵀ (strictly lower)
  dq = scale (dO Sᵀ) ⊙ e^G + ∂⟨dM, M⟩/∂q,  dM = scale dO V_newᵀ
  dk = β (∂⟨dA, P⟩/∂k + e^G ⊙ Tᵀ dW),  P the undecorated decayed Gram (A = diag(β) P)
  dk̃ = (V_new dSᵀ) ⊙ e^{G_C − G} + ∂⟨dM, M⟩/∂k̃ + ∂⟨diag(β) dA, P⟩/∂k̃
  dv = β Tᵀ dU,  dβ = rowsum(k ⊙ ∂⟨dA, P⟩/∂(βk)) + rowsum(Tᵀ dW ⊙ K e^G) + rowsum(Tᵀ dU ⊙ V)
  dG = q ⊙ dq + k ⊙ dk − k̃ ⊙ dk̃, plus on the chunk's last row
       Σ_j k̃_j ⊙ dk̃_state_j + e^{G_C} ⊙ rowsum(S ⊙ dS)
(every q and k enters as x ⊙ e^{G_i}, every k̃ as x ⊙ e^{−G_j} or x ⊙ e^{G_C − G_j}). Partial sums over split
grid axes (dβ, scalar dG) come out with a leading axis and are summed in XLA.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gpu import layout as L
from pallas_kernels.gpu.chunk_math import F32, dot, iota, last_row, row_scale
from pallas_kernels.gpu.config import pallas_call
from pallas_kernels.gpu.delta_rule_fwd import (_split, chunk_decay_rows, decay_rows, decay_to_end,
                                               key_spec, launch_state_pass)
from pallas_kernels.gpu.intra import ALL, Channel, block, causal, decay_factor, full_scores, load


def _add(acc, x):
  return x if acc is None else acc + x


def _f32(shape):
  return jax.ShapeDtypeStruct(shape, F32)


def _key_grads(st, n_k: int):
  """Out shapes of the finishing kernels' dq, dk (and dk_write when n_k = 3), [B, T, HV, K]."""
  shape = (st.batch, st.length, st.value_heads, st.key_dim)
  dtypes = [st.dq_dtype, st.dq_dtype, st.dkw_dtype][:n_k]
  return [jax.ShapeDtypeStruct(shape, d) for d in dtypes]


# ---------------------------------------------------------------------------------------------------------
# 4. The chunk-local part of dV_new.
# ---------------------------------------------------------------------------------------------------------
def _dv_local_kernel(st, *refs):
  has_g = st.decay != "none"
  q_ref, kw_ref, g_ref, do_ref, dvl_ref = _split(refs, 1, 1, int(has_g), 1, 1)
  if st.decay != "channel":
    M = full_scores(q_ref[...], kw_ref[...], load(g_ref, ALL) if has_g else None)
    dvl_ref[...] = (st.scale * dot(st.lo(M), st.lo(do_ref[...]), ta=True)).astype(dvl_ref.dtype)
    return
  s, n = st.sub, st.num_sub
  ch = Channel(g_ref, s, n, st.blocks.k_block("diag", st.key_dim), st.blocks.factor_diag)
  P = ch.scores(q_ref, kw_ref, strict=False, mm=st.mm)
  for b in range(n):
    acc = None
    for a in range(b, n):
      acc = _add(acc, dot(st.lo(P[a, b]), st.lo(load(do_ref, block(a, s), dtype=None)), ta=True))
    dvl_ref[block(b, s), :] = (st.scale * acc).astype(dvl_ref.dtype)


def dv_local(st: L.Static, q, kw, G, do):
  """→ dV_loc [B, HV, T, V] in st.mm."""
  bv = st.blocks.v_block("out", st.value_dim)
  w = L.chunk_v_grid
  in_specs = [L.tokens(st, st.key_dim, w, st.key_head), L.tokens(st, st.key_dim, w, st.kw_head)]
  args = [q, kw]
  if st.decay != "none":
    in_specs.append(L.decay_spec(st, w))
    args.append(G)
  in_specs.append(L.tokens(st, bv, w, split=True))
  args.append(do)
  kernel = lambda *refs: _dv_local_kernel(st, *refs)
  return pallas_call(kernel, grid=(st.batch, st.value_heads, st.num_chunks, st.value_dim // bv),
                     in_specs=in_specs, out_specs=L.head_major(st, bv, w, split=True),
                     out_shape=jax.ShapeDtypeStruct((st.batch, st.value_heads, st.length, st.value_dim),
                                                    st.mm),
                     interpret=st.interpret, num_warps=st.blocks.warps_chunk, num_stages=st.stages,
                     fp32_dots=st.fp32_dots, name="delta_rule_dv_local")(*args)


# ---------------------------------------------------------------------------------------------------------
# 5. The reverse state pass.
# ---------------------------------------------------------------------------------------------------------
def _state_bwd_kernel(st, *refs):
  has_g, packed = st.decay != "none", st.segments > 0
  w_ref, q_ref, kw_ref, g_ref, do_ref, dvl_ref, info_ref, dst_ref, dvn_ref, dh_ref, ds0_ref = _split(
      refs, 1, 1, 1, int(has_g), 1, 1, int(packed), 1, 1, 1, 1)
  c_len, kd = st.chunk, st.key_dim
  lo, hi = L.lane_bounds(st, info_ref) if packed else (0, st.num_chunks)

  def body(i, dS):
    c = hi - 1 - i
    t0 = pl.multiple_of(c * c_len, c_len)
    if packed:                # the state leaving a segment's last chunk is that segment's final state
      seg, first, last = L.decode_chunk_info(info_ref[c])
      rows = pl.ds(pl.multiple_of(seg * kd, kd), kd)
      dS = jnp.where(last, dst_ref[rows, :].astype(F32), dS)
    dh_ref[pl.ds(pl.multiple_of(c * kd, kd), kd), :] = dS.astype(dh_ref.dtype)
    kw, q, do = (r[pl.ds(t0, c_len), :] for r in (kw_ref, q_ref, do_ref))   # loads straight into the dots
    gamma = k_rows = None
    if st.predecay:              # kw_ref, q_ref hold the decayed tiles: G's last row is all it needs (one row load)
      gamma = jnp.exp(g_ref[t0 + c_len - 1, :].astype(F32))[:, None]
    elif has_g:
      G = chunk_decay_rows(st, g_ref, t0)
      to_end, gamma = decay_to_end(st, G)
      if st.decay == "scalar":                   # row factors on the [C, BV] side of each dot
        k_rows = to_end
        do = row_scale(do.astype(F32), jnp.exp(G))
      else:
        kw = row_scale(kw.astype(F32), to_end)
        q = row_scale(q.astype(F32), jnp.exp(G))
    dvn = dvl_ref[pl.ds(t0, c_len), :].astype(F32) + row_scale(dot(st.lo(kw), st.lo(dS)), k_rows)
    dvn_ref[pl.ds(t0, c_len), :] = dvn.astype(dvn_ref.dtype)
    dS = dS if gamma is None else dS * gamma
    dS = (dS + st.scale * dot(st.lo(q), st.lo(do), ta=True)
          - dot(w_ref[pl.ds(t0, c_len), :], st.lo(dvn), ta=True))
    if packed:
      @pl.when(first)
      def _():                # the state entering a segment's first chunk is its initial state
        ds0_ref[rows, :] = dS
    return dS

  if packed:
    lax.fori_loop(0, hi - lo, body, jnp.zeros((kd, dst_ref.shape[-1]), F32))
  else:
    ds0_ref[...] = lax.fori_loop(0, st.num_chunks, body, dst_ref[...].astype(F32))


def state_bwd(st: L.Static, W, q, kw, G, do, dvl, dS_T, info=None):
  """→ (dV_new [B, HV, T, V] and dS leaving each chunk [B, HV, NC·K, V] in st.mm, dS0 [B, HV, K, V]
  fp32). Packed: `info`, dS_T and dS0 as in `delta_rule_fwd.state_pass` (dS0 rows of absent segments are
  not written)."""
  bv = st.state_block_v
  _, w = L.state_pass_grid(st)
  in_specs = [L.head_major(st, st.key_dim, w, whole=True), key_spec(st, w, st.key_head),
              key_spec(st, w, st.kw_head)]
  args = [W, q, kw]
  if st.decay != "none":
    in_specs.append(L.decay_spec(st, w, whole=True))
    args.append(G)
  in_specs += [L.tokens(st, bv, w, whole=True, split=True), L.head_major(st, bv, w, whole=True, split=True)]
  args += [do, dvl]
  return launch_state_pass(st, _state_bwd_kernel, in_specs, args, info, dS_T, "delta_rule_state_bwd")


# ---------------------------------------------------------------------------------------------------------
# 6. The state-side gradient terms, parallel over K blocks.
# ---------------------------------------------------------------------------------------------------------
def _grads_state_kernel(st, *refs):
  has_g = st.decay != "none"
  (q_ref, kw_ref, g_ref, sin_ref, dh_ref, do_ref, vn_ref, dvn_ref,
   dq_ref, dw_ref, dkw_ref, dg_ref) = _split(refs, int(has_g), int(has_g), int(has_g), 1, 1, 1, 1, 1,
                                             1, 1, 1, int(has_g))
  dqs = dws = dks = dgam = None
  bvg = st.grad_block_v
  for vb in range(st.value_dim // bvg):
    cs = slice(vb * bvg, (vb + 1) * bvg)
    S, dS = st.lo(sin_ref[:, cs]), st.lo(dh_ref[:, cs])                 # [BK, BV]
    do, vn, dvn = (st.lo(r[:, cs]) for r in (do_ref, vn_ref, dvn_ref))   # [C, BV]
    dqs = _add(dqs, dot(do, S, tb=True))
    dws = _add(dws, dot(dvn, S, tb=True))
    dks = _add(dks, dot(vn, dS, tb=True))
    if has_g:
      dgam = _add(dgam, jnp.sum(S.astype(F32) * dS.astype(F32), axis=1))
  dw_ref[...] = st.lo(dws).astype(dw_ref.dtype)                        # −dW, the operand of dT and dk
  if not has_g:
    dq_ref[...] = st.scale * dqs
    dkw_ref[...] = dks
    return
  G = load(g_ref, ALL)
  to_end = decay_to_end(st, G)[0]                                      # e^{G_C − G}
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
  bk = st.blocks.k_block("grad", st.key_dim)
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
  out_shape = [_f32((b, t, hv, kd)), jax.ShapeDtypeStruct((b, hv, t, kd), st.mm), _f32((b, t, hv, kd))]
  if st.decay == "scalar":
    out_specs.append(L.parts(st, w))
    out_shape.append(_f32((nk, b, hv, t)))
  elif st.decay == "channel":
    out_specs.append(L.tokens(st, bk, w, split=True))
    out_shape.append(_f32((b, t, hv, kd)))
  kernel = lambda *refs: _grads_state_kernel(st, *refs)
  outs = pallas_call(kernel, grid=(b, hv, st.num_chunks, nk), in_specs=in_specs, out_specs=out_specs,
                     out_shape=out_shape, interpret=st.interpret, num_warps=st.blocks.warps_grad_state,
                     num_stages=st.stages,
                     fp32_dots=st.fp32_dots, name="delta_rule_grads_state")(*args)
  dq_s, dws, dkw_s = outs[:3]
  dG_s = outs[3] if has_g else None
  return dq_s, dws, dkw_s, dG_s


# ---------------------------------------------------------------------------------------------------------
# 7. The C×C gradients (dM, dT, dA), dv and dβ's V part.
# ---------------------------------------------------------------------------------------------------------
def _intra_v_loop(st, t_lo, beta, do_ref, vn_ref, dvn_ref, v_ref, dv_ref):
  """dM = dO V_newᵀ, dTu = dV_new (βV)ᵀ [C, C] and dβ's V part, storing dv = β Tᵀ dV_new."""
  dM = dTu = dbeta = None
  bvg = st.grad_block_v
  for vb in range(st.value_dim // bvg):
    cs = slice(vb * bvg, (vb + 1) * bvg)
    do, vn, dvn = (st.lo(r[:, cs]) for r in (do_ref, vn_ref, dvn_ref))
    v = load(v_ref, ALL, cs)
    dM = _add(dM, dot(do, vn, tb=True))
    dTu = _add(dTu, dot(dvn, st.lo(beta * v), tb=True))
    dbv = dot(t_lo, dvn, ta=True)                                        # Tᵀ dV_new [C, BV]
    dv_ref[:, cs] = (beta * dbv).astype(dv_ref.dtype)
    dbeta = _add(dbeta, jnp.sum(dbv * v, axis=1))
  return dM, dTu, dbeta


def _inverse_grad(T, dT):
  """dA = −Tᵀ dT Tᵀ, strictly lower (fp32 at HIGHEST, as the products that build T)."""
  dA = -dot(dot(T, dT, ta=True), T, tb=True)
  return jnp.where(causal(T.shape[0], strict=True), dA, 0.0)


def _intra_dT(st, beta, k_ref, g_ref, dw_ref, dTu, eg):
  """dT = dTu + dW (βK e^G)ᵀ [C, C] over K blocks (the stored operand is −dW)."""
  bk = st.blocks.k_block("grad", st.key_dim)
  dT = dTu
  for i in range(st.key_dim // bk):
    cs = slice(i * bk, (i + 1) * bk)
    e = jnp.exp(load(g_ref, ALL, cs)) if st.decay == "channel" else eg
    kb = st.lo(beta * row_scale(load(k_ref, ALL, cs), e))             # β K e^G, as in prep
    dT = dT - dot(dw_ref[:, cs], kb, tb=True)
  return dT


def _grads_intra_kernel(st, *refs):
  has_g = st.decay != "none"
  (k_ref, v_ref, beta_ref, g_ref, t_ref, do_ref, vn_ref, dvn_ref, dw_ref,
   dv_ref, dbeta_ref, dm_ref, da_ref) = _split(refs, 1, 1, 1, int(has_g), *([1] * 9))
  T = t_ref[...].astype(F32)
  beta = load(beta_ref, ALL)[:, None]
  dM, dTu, dbeta = _intra_v_loop(st, st.lo(T), beta, do_ref, vn_ref, dvn_ref, v_ref, dv_ref)
  dbeta_ref[...] = dbeta
  G = load(g_ref, ALL) if st.decay == "scalar" else None               # [C] (per channel: by K block)
  dA = _inverse_grad(T, _intra_dT(st, beta, k_ref, g_ref, dw_ref, dTu, decay_rows(st, G)))
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
  out_shape = [jax.ShapeDtypeStruct((b, t, hv, vd), st.grad_dtype), _f32((b, hv, t)),
               jax.ShapeDtypeStruct((b, hv, t, st.chunk), pair_dtype),
               jax.ShapeDtypeStruct((b, hv, t, st.chunk), pair_dtype)]
  kernel = lambda *refs: _grads_intra_kernel(st, *refs)
  return tuple(pallas_call(kernel, grid=(b, hv, st.num_chunks), in_specs=in_specs, out_specs=out_specs,
                           out_shape=out_shape, interpret=st.interpret, num_warps=st.blocks.warps_grad,
                           num_stages=st.stages,
                           fp32_dots=st.fp32_dots, name="delta_rule_grads_intra")(*args))


# ---------------------------------------------------------------------------------------------------------
# 7b. Decay none / scalar: the pair gradients and the finish, parallel over K blocks.
# ---------------------------------------------------------------------------------------------------------
def _grads_finish_kernel(st, *refs):
  """One K block: dq, dk, dk̃ from the decayed pair weights Mw = scale dM⊙Γ, Aw = dA⊙Γ as [C, C] × [C, BK]
  dots, plus this block's share of dβ and (scalar decay) dG."""
  has_g, sep = st.decay != "none", not st.same_keys
  (q_ref, k_ref, kw_ref, g_ref, beta_ref, t_ref, dw_ref, mw_ref, aw_ref, dqs_ref, dkws_ref,
   dq_ref, dk_ref, dkw_ref, dbeta_ref, dg_ref) = _split(refs, 1, 1, 1, int(has_g), *([1] * 9), int(sep), 1,
                                                        int(has_g))
  beta = load(beta_ref, ALL)[:, None]
  G = load(g_ref, ALL) if has_g else None
  eg = decay_rows(st, G)
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
  bk = st.blocks.k_block("grad", st.key_dim)
  nk = st.key_dim // bk
  w = L.chunk_v_grid
  has_g, sep = st.decay != "none", not st.same_keys
  ktok = lambda head=None: L.tokens(st, bk, w, head, split=True)
  in_specs = [ktok(st.key_head), ktok(st.key_head), ktok(st.kw_head)]
  args = [q, k, kw]
  if has_g:
    in_specs.append(L.vector(st, w))
    args.append(G)
  in_specs += [L.vector(st, w), L.head_major(st, st.chunk, w), L.head_major(st, bk, w, split=True),
               L.head_major(st, st.chunk, w), L.head_major(st, st.chunk, w), ktok(), ktok()]
  args += [beta, T, dws, Mw, Aw, dq_s, dkw_s]
  b, hv, t = st.batch, st.value_heads, st.length
  n_k = 3 if sep else 2
  out_specs = [ktok() for _ in range(n_k)] + [L.parts(st, w)] * (2 if has_g else 1)
  out_shape = _key_grads(st, n_k) + [_f32((nk, b, hv, t))] * (2 if has_g else 1)
  kernel = lambda *refs: _grads_finish_kernel(st, *refs)
  outs = pallas_call(kernel, grid=(b, hv, st.num_chunks, nk), in_specs=in_specs, out_specs=out_specs,
                     out_shape=out_shape, interpret=st.interpret, num_warps=st.blocks.warps_finish,
                     num_stages=st.stages,
                     fp32_dots=st.fp32_dots, name="delta_rule_grads_finish")(*args)
  dq, dk = outs[:2]
  dkw = outs[2] if sep else None
  return dq, dk, dkw, outs[n_k], (outs[n_k + 1] if has_g else None)


# ---------------------------------------------------------------------------------------------------------
# 8. Per-channel decay: the decayed pair gradients through sub-blocks, and the finish.
# ---------------------------------------------------------------------------------------------------------
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
    dkw_p[a] = _add(dkw_p[a], dy)
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


def _grads_pairs_kernel(st, *refs):
  sep = not st.same_keys
  (q_ref, k_ref, kw_ref, g_ref, beta_ref, t_ref, dw_ref, dm_ref, da_ref, dqs_ref, dkws_ref, dgs_ref,
   dq_ref, dk_ref, dkw_ref, dbeta_ref, dg_ref) = _split(refs, *([1] * 14), int(sep), 1, 1)
  s, n = st.sub, st.num_sub
  bk = g_ref.shape[-1]
  kc = min(st.blocks.k_block("pairs", st.key_dim), bk)
  ch = Channel(g_ref, s, n, kc, st.blocks.factor_diag)
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
  bk = st.blocks.k_block("grad", st.key_dim)
  nk = st.key_dim // bk
  w = L.chunk_v_grid
  sep = not st.same_keys
  ktok = lambda head=None: L.tokens(st, bk, w, head, split=True)
  in_specs = [ktok(st.key_head), ktok(st.key_head), ktok(st.kw_head), L.decay_spec(st, w, width=bk),
              L.vector(st, w), L.head_major(st, st.chunk, w), L.head_major(st, bk, w, split=True),
              L.head_major(st, st.chunk, w), L.head_major(st, st.chunk, w), ktok(), ktok(), ktok()]
  args = [q, k, kw, G, beta, T, dws, dM, dA, dq_s, dkw_s, dG_s]
  b, hv, t, kd = st.batch, st.value_heads, st.length, st.key_dim
  n_k = 3 if sep else 2
  out_specs = [ktok() for _ in range(n_k)] + [L.parts(st, w), ktok()]
  out_shape = _key_grads(st, n_k) + [_f32((nk, b, hv, t)), _f32((b, t, hv, kd))]
  kernel = lambda *refs: _grads_pairs_kernel(st, *refs)
  outs = pallas_call(kernel, grid=(b, hv, st.num_chunks, nk), in_specs=in_specs, out_specs=out_specs,
                     out_shape=out_shape, interpret=st.interpret, num_warps=st.blocks.warps_pairs,
                     num_stages=st.stages,
                     fp32_dots=st.fp32_dots, name="delta_rule_grads_pairs")(*args)
  dq, dk = outs[:2]
  dkw = outs[2] if sep else None
  return dq, dk, dkw, outs[n_k], outs[n_k + 1]


def backward(st: L.Static, residuals, do, dS_T):
  """From the inputs (q, k, kw, v, beta, G, S0, info; `info` None unless packed) and the forward's
  T = (I + A)⁻¹: re-forms W, U from T, reruns the state pass (S_in, V_new) and returns the cotangents of
  (q, k, kw, v, beta, G, S0), per value head for q, k, kw (the wrapper sums the head groups)."""
  from pallas_kernels.gpu import delta_rule_fwd as fwd
  q, k, kw, v, beta, G, S0, info, T = residuals
  W, U = fwd.prep(st, k, kw, v, beta, G, T=T)
  kd, qd = fwd.decayed_tiles(st, kw, G, q) if st.predecay else (kw, q)
  V_new, S_in, _ = fwd.state_pass(st, W, U, kd, G, S0, info)
  dvl = dv_local(st, q, kw, G, do)
  dV_new, dS_out, dS0 = state_bwd(st, W, qd, kd, G, do, dvl, dS_T, info)
  dq_s, dws, dkw_s, dG_s = grads_state(st, q, kw, G, S_in, dS_out, V_new, dV_new, do)
  if st.decay == "scalar":
    dG_s = jnp.sum(dG_s, axis=0)
  dv, dbeta_v, dM, dA = grads_intra(st, k, v, beta, G, T, V_new, dV_new, do, dws)
  if st.decay == "channel":
    dq, dk, dkw, dbeta_k, dG = grads_pairs(st, q, k, kw, beta, G, T, dws, dM, dA, dq_s, dkw_s, dG_s)
  else:
    dq, dk, dkw, dbeta_k, dG_p = grads_finish(st, q, k, kw, beta, G, T, dws, dM, dA, dq_s, dkw_s)
    dG = None if dG_p is None else dG_s + jnp.sum(dG_p, axis=0)
  return dq, dk, dkw, dv, dbeta_v + jnp.sum(dbeta_k, axis=0), dG, dS0
