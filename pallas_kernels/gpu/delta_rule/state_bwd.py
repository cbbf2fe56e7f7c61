"""`state_bwd`: the reverse state pass, grid (B, HV, V/BV); packed (N lanes, HV, V/BV).

A reverse `fori_loop` over chunks with the fp32 state gradient dS [K, BV] in registers:
    dV_new = dV_loc + (K̃ ⊙ e^{G_C − G}) dS,    dS ← e^{G_C} ⊙ dS + scale (Q ⊙ e^G)ᵀ dO − Wᵀ dV_new
It stores dS leaving every chunk, dV_new and dS0. Packed: dS restarts from dS_T[n] at segment n's last chunk
and dS0[n] is stored at its first.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gpu.chunk_math import F32, dot, row_scale
from pallas_kernels.gpu.common import split_refs
from pallas_kernels.gpu.delta_rule import factors, state_fwd
from pallas_kernels.gpu.delta_rule import layout as L


def _kernel(st, *refs):
  has_g, packed = st.decay != "none", st.segments > 0
  w_ref, q_ref, kw_ref, g_ref, do_ref, dvl_ref, info_ref, dst_ref, dvn_ref, dh_ref, ds0_ref = split_refs(
      refs, 1, 1, 1, has_g, 1, 1, packed, 1, 1, 1, 1)
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
      G = factors.chunk_rows(st, g_ref, t0)
      to_end, gamma = factors.to_end(st, G)
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
  fp32). Packed: `info`, dS_T and dS0 as in `state_fwd.state_pass` (dS0 rows of absent segments are
  not written)."""
  bv = st.state_block_v
  _, w = L.state_pass_grid(st)
  in_specs = [L.head_major(st, st.key_dim, w, whole=True), state_fwd.key_spec(st, w, st.key_head),
              state_fwd.key_spec(st, w, st.kw_head)]
  args = [W, q, kw]
  if st.decay != "none":
    in_specs.append(L.decay_spec(st, w, whole=True))
    args.append(G)
  in_specs += [L.tokens(st, bv, w, whole=True, split=True), L.head_major(st, bv, w, whole=True, split=True)]
  args += [do, dvl]
  return state_fwd.launch(st, _kernel, in_specs, args, info, dS_T, "delta_rule_state_bwd")
