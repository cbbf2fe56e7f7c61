"""Backward kernels of the chunkwise online solve. Nothing but the inputs is saved by the forward: the
backward reruns `prep` (W and T = (I + A)⁻¹) and `state_pass` (the chunk states S_in and V_new), then:

4. `dv_local`   chunk-parallel, grid (B, HV, NC, V/BV): dV_loc = scale · Mᵀ dO with M the decayed causal
                scores tril((Q⊙e^G)(K̃⊙e^−G)ᵀ) (what V_new receives from the chunk's own outputs).
5. `state_bwd`  sequential in reverse, grid (B, HV, V/BV), the fp32 state gradient dS [K, BV] in registers:
                dV_new = dV_loc + (K̃⊙e^{G_C−G}) dS;
                dS ← e^{G_C} ⊙ dS + scale (Q⊙e^G)ᵀ dO − Wᵀ dV_new; emits dS leaving every chunk, dV_new
                and dS0.
6. `grads`      chunk-parallel, grid (B, HV, NC), a static loop over V blocks: dq, dk, dk_write, dv, dβ and
                the gradient of the in-chunk cumulative log-decay G (the wrapper's autodiff turns it into the
                log-decay gradient: a reverse cumsum, masked by the clamp).

Per chunk (S = state entering, dS = gradient of the state leaving, all C×C matrices as s×s blocks):
  dW = −dV_new Sᵀ, dU = dV_new;  dT = dW (β K e^G)ᵀ + dU (β V)ᵀ;  dA = −Tᵀ dT Tᵀ (strictly lower)
  dq = scale (dO Sᵀ) ⊙ e^G + ∂⟨dM, M⟩/∂q,  dM = scale dO V_newᵀ
  dk = β (∂⟨dA, P⟩/∂k + e^G ⊙ Tᵀ dW),  P the undecorated decayed Gram (A = diag(β) P)
  dk̃ = (V_new dSᵀ) ⊙ e^{G_C − G} + ∂⟨dM, M⟩/∂k̃ + ∂⟨diag(β) dA, P⟩/∂k̃
  dv = β Tᵀ dU,  dβ = rowsum(k ⊙ ∂⟨dA, P⟩/∂(βk)) + rowsum(Tᵀ dW ⊙ K e^G) + rowsum(Tᵀ dU ⊙ V)
  dG = q ⊙ dq + k ⊙ dk − k̃ ⊙ dk̃, plus on the chunk's last row
       Σ_j k̃_j ⊙ dk̃_state_j + e^{G_C} ⊙ rowsum(S ⊙ dS)
(every q and k enters as x ⊙ e^{G_i}, every k̃ as x ⊙ e^{−G_j} or x ⊙ e^{G_C − G_j}).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gpu import layout as L
from pallas_kernels.gpu.chunk_math import F32, ChunkDecay, Pairs, dot, iota, row_scale, sub_rows
from pallas_kernels.gpu.config import pallas_call
from pallas_kernels.gpu.delta_rule_fwd import _split, chunk_decay_rows, decay_to_end


# ---------------------------------------------------------------------------------------------------------
# 4. The chunk-local part of dV_new.
# ---------------------------------------------------------------------------------------------------------
def _dv_local_kernel(st, *refs):
  has_g = st.decay != "none"
  q_ref, kw_ref, g_ref, do_ref, dvl_ref = _split(refs, 1, 1, int(has_g), 1, 1)
  s, n = st.sub, st.num_sub
  pairs = Pairs(ChunkDecay(st.decay, g_ref, s, n), st.mm)
  q = [sub_rows(q_ref, a, s) for a in range(n)]
  kw = [sub_rows(kw_ref, a, s) for a in range(n)]
  do = [st.lo(sub_rows(do_ref, a, s)) for a in range(n)]
  for b in range(n):
    acc = dot(st.lo(pairs.scores(q, kw, b, b)), do[b], ta=True)
    for a in range(b + 1, n):
      acc = acc + dot(st.lo(pairs.scores(q, kw, a, b)), do[a], ta=True)
    dvl_ref[b * s:(b + 1) * s, :] = (st.scale * acc).astype(dvl_ref.dtype)


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
                     name="delta_rule_dv_local")(*args)


# ---------------------------------------------------------------------------------------------------------
# 5. The reverse state pass.
# ---------------------------------------------------------------------------------------------------------
def _state_bwd_kernel(st, *refs):
  has_g = st.decay != "none"
  w_ref, q_ref, kw_ref, g_ref, do_ref, dvl_ref, dst_ref, dvn_ref, dh_ref, ds0_ref = _split(
      refs, 1, 1, 1, int(has_g), 1, 1, 1, 1, 1, 1)
  c_len, kd, nc = st.chunk, st.key_dim, st.num_chunks

  def body(i, dS):
    c = nc - 1 - i
    t0 = pl.multiple_of(c * c_len, c_len)
    dh_ref[pl.ds(pl.multiple_of(c * kd, kd), kd), :] = dS.astype(dh_ref.dtype)
    kw = kw_ref[pl.ds(t0, c_len), :].astype(F32)
    q = q_ref[pl.ds(t0, c_len), :].astype(F32)
    gamma = None
    if has_g:
      G = chunk_decay_rows(st, g_ref, t0)
      to_end, gamma = decay_to_end(st, G)
      kw = row_scale(kw, to_end)
      q = row_scale(q, jnp.exp(G))
    dvn = dvl_ref[pl.ds(t0, c_len), :].astype(F32) + dot(st.lo(kw), st.lo(dS))
    dvn_ref[pl.ds(t0, c_len), :] = dvn.astype(dvn_ref.dtype)
    dS = dS if gamma is None else dS * gamma
    return (dS + st.scale * dot(st.lo(q), st.lo(do_ref[pl.ds(t0, c_len), :]), ta=True)
            - dot(w_ref[pl.ds(t0, c_len), :], st.lo(dvn), ta=True))

  ds0_ref[...] = lax.fori_loop(0, nc, body, dst_ref[...].astype(F32))


def state_bwd(st: L.Static, W, q, kw, G, do, dvl, dS_T):
  """→ (dV_new [B, HV, T, V] and dS leaving each chunk [B, HV, NC·K, V] in st.mm, dS0 [B, HV, K, V]
  fp32)."""
  bv = st.blocks.v_block("state", st.value_dim)
  w = L.seq_grid
  in_specs = [L.head_major(st, st.key_dim, w, whole=True),
              L.tokens(st, st.key_dim, w, st.key_head, whole=True),
              L.tokens(st, st.key_dim, w, st.kw_head, whole=True)]
  args = [W, q, kw]
  if st.decay != "none":
    in_specs.append(L.decay_spec(st, w, whole=True))
    args.append(G)
  in_specs += [L.tokens(st, bv, w, whole=True, split=True), L.head_major(st, bv, w, whole=True, split=True),
               L.state(st, bv, w)]
  args += [do, dvl, dS_T]
  hv = (st.batch, st.value_heads)
  out_specs = [L.head_major(st, bv, w, whole=True, split=True), L.states(st, bv, w, whole=True),
               L.state(st, bv, w)]
  out_shape = [jax.ShapeDtypeStruct((*hv, st.length, st.value_dim), st.mm),
               jax.ShapeDtypeStruct((*hv, st.num_chunks * st.key_dim, st.value_dim), st.mm),
               jax.ShapeDtypeStruct((*hv, st.key_dim, st.value_dim), F32)]
  kernel = lambda *refs: _state_bwd_kernel(st, *refs)
  return pallas_call(kernel, grid=(st.batch, st.value_heads, st.value_dim // bv), in_specs=in_specs,
                     out_specs=out_specs, out_shape=out_shape, interpret=st.interpret,
                     num_warps=st.blocks.warps_state, num_stages=st.stages,
                     name="delta_rule_state_bwd")(*args)


# ---------------------------------------------------------------------------------------------------------
# 6. Per-chunk input gradients.
# ---------------------------------------------------------------------------------------------------------
def _add(acc, x):
  return x if acc is None else acc + x


def _grad_kernel(st, *refs):
  has_g, sep = st.decay != "none", not st.same_keys
  (q_ref, k_ref, kw_ref, v_ref, beta_ref, g_ref, t_ref, sin_ref, dh_ref, vn_ref, dvn_ref, do_ref,
   dq_ref, dk_ref, dkw_ref, dv_ref, dbeta_ref, dg_ref) = _split(
       refs, 1, 1, 1, 1, 1, int(has_g), 1, 1, 1, 1, 1, 1, 1, 1, int(sep), 1, 1, int(has_g))
  s, n = st.sub, st.num_sub
  dec = ChunkDecay(st.decay, g_ref, s, n)
  pairs = Pairs(dec, st.mm)
  rows = lambda ref, a, cs=None: (sub_rows(ref, a, s) if cs is None else ref[a * s:(a + 1) * s, cs])
  beta = [rows(beta_ref, a).astype(F32)[:, None] for a in range(n)]
  T = {(a, b): t_ref[a * s:(a + 1) * s, b * s:(b + 1) * s] for a in range(n) for b in range(a + 1)}
  lower = [(a, b) for a in range(n) for b in range(a + 1)]
  Tl = {ab: st.lo(t) for ab, t in T.items()}

  # The V loop: everything that contracts over V, and dv.
  dq_s, dvn_s, dkw_s = [None] * n, [None] * n, [None] * n      # dO Sᵀ, dV_new Sᵀ, V_new dSᵀ: [s, K]
  dM, dTu = dict.fromkeys(lower), dict.fromkeys(lower)          # dO V_newᵀ, dV_new (βV)ᵀ: [s, s]
  dgam, dbeta = None, [None] * n
  bvg = st.blocks.v_block("grad", st.value_dim)
  for vb in range(st.value_dim // bvg):
    cs = slice(vb * bvg, (vb + 1) * bvg)
    S, dS = st.lo(sin_ref[:, cs]), st.lo(dh_ref[:, cs])
    do = [st.lo(rows(do_ref, a, cs)) for a in range(n)]
    vn = [st.lo(rows(vn_ref, a, cs)) for a in range(n)]
    dvn = [st.lo(rows(dvn_ref, a, cs)) for a in range(n)]
    v = [rows(v_ref, a, cs).astype(F32) for a in range(n)]
    for a in range(n):
      dq_s[a] = _add(dq_s[a], dot(do[a], S, tb=True))
      dvn_s[a] = _add(dvn_s[a], dot(dvn[a], S, tb=True))
      dkw_s[a] = _add(dkw_s[a], dot(vn[a], dS, tb=True))
    for a, b in lower:
      dM[a, b] = _add(dM[a, b], dot(do[a], vn[b], tb=True))
      dTu[a, b] = _add(dTu[a, b], dot(dvn[a], st.lo(beta[b] * v[b]), tb=True))
    if has_g:
      dgam = _add(dgam, jnp.sum(S.astype(F32) * dS.astype(F32), axis=1))
    for b in range(n):
      dbv = None
      for a in range(b, n):
        dbv = _add(dbv, dot(Tl[a, b], dvn[a], ta=True))
      dv_ref[b * s:(b + 1) * s, cs] = beta[b] * dbv
      dbeta[b] = _add(dbeta[b], jnp.sum(dbv * v[b], axis=1))

  # Through W = T (β K e^G) and T = (I + A)⁻¹ (dW = −dV_new Sᵀ). (q, k, k̃ are loaded only now, after the
  # V loop, to keep the loop's live registers down.)
  q = [rows(q_ref, a).astype(F32) for a in range(n)]
  k = [rows(k_ref, a).astype(F32) for a in range(n)]
  kw = [rows(kw_ref, a).astype(F32) for a in range(n)]
  e = [dec.rows(a) for a in range(n)]
  kb = [beta[b] * row_scale(k[b], e[b]) for b in range(n)]
  dvn_sl, kbl = [st.lo(x) for x in dvn_s], [st.lo(x) for x in kb]
  dT = {(a, b): dTu[a, b] - dot(dvn_sl[a], kbl[b], tb=True) for a, b in lower}
  dkb = []
  for b in range(n):
    acc = None
    for a in range(b, n):
      acc = _add(acc, dot(Tl[a, b], dvn_sl[a], ta=True))
    dkb.append(-acc)
  Y = {}
  for a, d in lower:                                             # Y = Tᵀ dT, the blocks with d ≤ a
    for c in range(a, n):
      Y[a, d] = _add(Y.get((a, d)), dot(T[c, a], dT[c, d], ta=True))
  strict = iota((s, s), 0) > iota((s, s), 1)
  dA = {}
  for a, b in lower:                                             # dA = −Tᵀ dT Tᵀ = −Y Tᵀ
    acc = None
    for d in range(b + 1):
      acc = _add(acc, dot(Y[a, d], T[b, d], tb=True))
    dA[a, b] = jnp.where(strict, -acc, 0.0) if a == b else -acc

  # Through the decayed pair products: M (q, k̃) and the Gram P (k, k̃).
  dM = {ab: st.scale * w for ab, w in dM.items()}
  bdA = {(a, b): beta[a] * w for (a, b), w in dA.items()}
  (dq_p, R), dkw_p = pairs.grads([dM, dA], kw, [(dM, q), (bdA, k)])

  to_end = [dec.to_end(a) for a in range(n)]
  extra = None                                                   # dG at the chunk's last row
  for a in range(n):
    dq = st.scale * row_scale(dq_s[a], e[a]) + dq_p[a]
    dk = beta[a] * (R[a] + row_scale(dkb[a], e[a]))
    dkw_state = row_scale(dkw_s[a], to_end[a])
    dkw = dkw_state + dkw_p[a]
    dbeta[a] = dbeta[a] + jnp.sum(k[a] * R[a], axis=1) + jnp.sum(dkb[a] * row_scale(k[a], e[a]), axis=1)
    dq_ref[a * s:(a + 1) * s, :] = dq
    if sep:
      dk_ref[a * s:(a + 1) * s, :] = dk
      dkw_ref[a * s:(a + 1) * s, :] = dkw
    else:
      dk_ref[a * s:(a + 1) * s, :] = dk + dkw
    dbeta_ref[a * s:(a + 1) * s] = dbeta[a]
    if has_g:
      dg = q[a] * dq + k[a] * dk - kw[a] * dkw
      extra = _add(extra, jnp.sum(kw[a] * dkw_state, axis=0))
      if a == n - 1:
        extra = extra + jnp.exp(dec.last()) * dgam
        dg = dg + jnp.where(iota(dg.shape, 0) == s - 1, extra[None, :], 0.0)
      if st.decay == "scalar":
        dg_ref[a * s:(a + 1) * s] = jnp.sum(dg, axis=1)
      else:
        dg_ref[a * s:(a + 1) * s, :] = dg


def grads(st: L.Static, q, k, kw, v, beta, G, T, S_in, dS_out, V_new, dV_new, do):
  """→ (dq, dk, dk_write or None, dv) [B, T, HV, ·] per value head, dβ [B, HV, T], dG (G's layout); fp32.

  With st.same_keys, dk already holds dk + dk_write and dk_write is None.
  """
  w = L.chunk_grid
  kd, vd = st.key_dim, st.value_dim
  in_specs = [L.tokens(st, kd, w, st.key_head), L.tokens(st, kd, w, st.key_head),
              L.tokens(st, kd, w, st.kw_head), L.tokens(st, vd, w), L.vector(st, w)]
  args = [q, k, kw, v, beta]
  if st.decay != "none":
    in_specs.append(L.decay_spec(st, w))
    args.append(G)
  in_specs += [L.head_major(st, st.chunk, w), L.states(st, vd, w), L.states(st, vd, w),
               L.head_major(st, vd, w), L.head_major(st, vd, w), L.tokens(st, vd, w)]
  args += [T, S_in, dS_out, V_new, dV_new, do]
  tok = lambda width: jax.ShapeDtypeStruct((st.batch, st.length, st.value_heads, width), F32)
  out_specs = [L.tokens(st, kd, w), L.tokens(st, kd, w)]
  out_shape = [tok(kd), tok(kd)]
  if not st.same_keys:
    out_specs.append(L.tokens(st, kd, w))
    out_shape.append(tok(kd))
  out_specs += [L.tokens(st, vd, w), L.vector(st, w)]
  out_shape += [tok(vd), jax.ShapeDtypeStruct((st.batch, st.value_heads, st.length), F32)]
  if st.decay != "none":
    out_specs.append(L.decay_spec(st, w))
    out_shape.append(jax.ShapeDtypeStruct(
        (st.batch, st.value_heads, st.length) if st.decay == "scalar" else tok(kd).shape, F32))
  kernel = lambda *refs: _grad_kernel(st, *refs)
  outs = pallas_call(kernel, grid=(st.batch, st.value_heads, st.num_chunks), in_specs=in_specs,
                     out_specs=out_specs, out_shape=out_shape, interpret=st.interpret,
                     num_warps=st.blocks.warps_grad, num_stages=st.stages,
                     name="delta_rule_grads")(*args)
  outs = list(outs)
  dq, dk = outs[:2]
  dkw = None if st.same_keys else outs[2]
  rest = outs[2 if st.same_keys else 3:]
  dv, dbeta = rest[:2]
  dG = rest[2] if st.decay != "none" else None
  return dq, dk, dkw, dv, dbeta, dG


def backward(st: L.Static, residuals, do, dS_T):
  """Recomputes W, T, S_in, V_new and returns the cotangents of (q, k, kw, v, beta, G, S0), per value head
  for q, k, kw (the wrapper sums the head groups)."""
  from pallas_kernels.gpu import delta_rule_fwd as fwd
  q, k, kw, v, beta, G, S0 = residuals
  W, U, T = fwd.prep(st, k, kw, v, beta, G, emit_t=True, name_suffix="_bwd")
  V_new, S_in, _ = fwd.state_pass(st, W, U, kw, G, S0)
  dvl = dv_local(st, q, kw, G, do)
  dV_new, dS_out, dS0 = state_bwd(st, W, q, kw, G, do, dvl, dS_T)
  dq, dk, dkw, dv, dbeta, dG = grads(st, q, k, kw, v, beta, G, T, S_in, dS_out, V_new, dV_new, do)
  return dq, dk, dkw, dv, dbeta, dG, dS0
