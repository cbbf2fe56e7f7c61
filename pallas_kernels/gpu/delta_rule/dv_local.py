"""`dv_local`: the chunk-local part of dV_new, dV_loc = scale · Mᵀ dO with M the decayed causal scores
tril((Q⊙e^G)(K̃⊙e^{−G})ᵀ) (what V_new receives from the chunk's own outputs). Grid (B, HV, NC, V/BV)."""
from __future__ import annotations

import jax

from pallas_kernels.gpu.chunk_math import accumulate, dot
from pallas_kernels.gpu.common import pallas_call, split_refs
from pallas_kernels.gpu.delta_rule import layout as L
from pallas_kernels.gpu.intra import ALL, Channel, block, full_scores, load


def _kernel(st, *refs):
  has_g = st.decay != "none"
  q_ref, kw_ref, g_ref, do_ref, dvl_ref = split_refs(refs, 1, 1, has_g, 1, 1)
  if st.decay != "channel":
    M = full_scores(q_ref[...], kw_ref[...], load(g_ref, ALL) if has_g else None)
    dvl_ref[...] = (st.scale * dot(st.lo(M), st.lo(do_ref[...]), ta=True)).astype(dvl_ref.dtype)
    return
  s, n = st.sub, st.num_sub
  ch = Channel(g_ref, s, n, st.k_block(st.config.diagonal.block_k), st.config.diagonal.factor)
  P = ch.scores(q_ref, kw_ref, strict=False, mm=st.mm)
  for b in range(n):
    acc = None
    for a in range(b, n):
      acc = accumulate(acc, dot(st.lo(P[a, b]), st.lo(load(do_ref, block(a, s), dtype=None)), ta=True))
    dvl_ref[block(b, s), :] = (st.scale * acc).astype(dvl_ref.dtype)


def dv_local(st: L.Static, q, kw, G, do):
  """→ dV_loc [B, HV, T, V] in st.mm."""
  bv = st.v_block(st.config.output.block_v)
  w = L.chunk_v_grid
  in_specs = [L.tokens(st, st.key_dim, w, st.key_head), L.tokens(st, st.key_dim, w, st.kw_head)]
  args = [q, kw]
  if st.decay != "none":
    in_specs.append(L.decay_spec(st, w))
    args.append(G)
  in_specs.append(L.tokens(st, bv, w, split=True))
  args.append(do)
  kernel = lambda *refs: _kernel(st, *refs)
  return pallas_call(kernel, grid=(st.batch, st.value_heads, st.num_chunks, st.value_dim // bv),
                     in_specs=in_specs, out_specs=L.head_major(st, bv, w, split=True),
                     out_shape=jax.ShapeDtypeStruct((st.batch, st.value_heads, st.length, st.value_dim),
                                                    st.mm),
                     interpret=st.interpret, num_warps=st.config.output.warps, num_stages=st.stages,
                     fp32_dots=st.fp32_dots, name="delta_rule_dv_local")(*args)
