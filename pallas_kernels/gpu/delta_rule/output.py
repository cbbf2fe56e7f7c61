"""`output`: O = scale · ((Q ⊙ e^G) S_in + tril((Q ⊙ e^G)(K̃ ⊙ e^{−G})ᵀ) V_new) per chunk. Grid (B, HV, NC, V/BV).

Decay none / scalar: one [C, K] × [K, C] score dot times the masked pairwise factor Γ. Per-channel decay: s×s
sub-blocks (`intra.Channel`), or the scores `scores` formed. With the inter-chunk part formed by the state pass
(`State.fuse_inter`) only the intra-chunk part is added here.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.gpu.chunk_math import dot, row_scale
from pallas_kernels.gpu.common import pallas_call, split_refs
from pallas_kernels.gpu.delta_rule import factors
from pallas_kernels.gpu.delta_rule import layout as L
from pallas_kernels.gpu.intra import ALL, Channel, block, full_scores, load


def output_kernel(st, *refs, inter=False, given=False, decayed=False):
  """One chunk's O; inter: sin_ref holds its inter-chunk part (Q⊙e^G) S_in [C, BV] (fp32) instead of S_in;
  given: p_ref holds the chunk's intra scores (`scores`), and kw is not read; decayed (with given): q_ref
  holds Q ⊙ e^G and G is not read."""
  has_g = st.decay != "none" and not decayed
  q_ref, kw_ref, g_ref, p_ref, sin_ref, vn_ref, o_ref = split_refs(
      refs, 1, not given, has_g, given, 1, 1, 1)
  S = None if inter else st.lo(sin_ref[...])
  if given:                                      # per-channel decay: (Q⊙e^G) S_in + P V_new, two whole-chunk dots
    if inter:
      acc = sin_ref[...]
    else:
      acc = dot(load(q_ref, ALL, dtype=None) if decayed else st.lo(load(q_ref, ALL) * jnp.exp(load(g_ref, ALL))), S)
    acc = acc + dot(p_ref[...], st.lo(vn_ref[...]))
    o_ref[...] = (st.scale * acc).astype(o_ref.dtype)
    return
  if st.decay != "channel":
    g = load(g_ref, ALL) if has_g else None
    q = q_ref[...]
    P = full_scores(q, kw_ref[...], g)
    acc = sin_ref[...] if inter else row_scale(dot(q, S), factors.rows(g))
    acc = acc + dot(st.lo(P), st.lo(vn_ref[...]))
    o_ref[...] = (st.scale * acc).astype(o_ref.dtype)
    return
  s, n = st.sub, st.num_sub
  ch = Channel(g_ref, s, n, st.k_block(st.config.diagonal.block_k), st.config.diagonal.factor)
  P = ch.scores(q_ref, kw_ref, strict=False, mm=st.mm)
  for a in range(n):
    acc = (sin_ref[block(a, s), :] if inter
           else dot(st.lo(load(q_ref, block(a, s)) * jnp.exp(ch.G(a))), S))
    for b in range(a + 1):
      acc = acc + dot(st.lo(P[a, b]), st.lo(load(vn_ref, block(b, s), dtype=None)))
    o_ref[block(a, s), :] = (st.scale * acc).astype(o_ref.dtype)


def output(st: L.Static, q, kw, G, S_in, V_new, out_dtype, *, kernel_body=None, inter=False, P=None,
           decayed: bool = False):
  """→ o [B, T, HV, V] in out_dtype. `kernel_body` replaces the kernel (tests: poisoned outputs). inter: S_in
  is the state pass's inter-chunk output [B, T, HV, V] fp32 (`state_pass(..., q=q)`). P: the intra-chunk
  scores of `scores` [B, HV, T, C] (then kw is not read); decayed (with P): q is `scores`' Q ⊙ e^G
  [B, HV, T, K] and G is not read."""
  bv = st.v_block(st.config.output.block_v)
  w = L.chunk_v_grid
  decayed = decayed and P is not None
  in_specs = [L.head_major(st, st.key_dim, w) if decayed else L.tokens(st, st.key_dim, w, st.key_head)]
  args = [q]
  if P is None:
    in_specs.append(L.tokens(st, st.key_dim, w, st.kw_head))
    args.append(kw)
  if st.decay != "none" and not decayed:
    in_specs.append(L.decay_spec(st, w))
    args.append(G)
  if P is not None:
    in_specs.append(L.head_major(st, st.chunk, w))
    args.append(P)
  in_specs += [L.tokens(st, bv, w, split=True) if inter else L.states(st, bv, w),
               L.head_major(st, bv, w, split=True)]
  args += [S_in, V_new]
  body = kernel_body or functools.partial(output_kernel, inter=inter, given=P is not None, decayed=decayed)
  kernel = lambda *refs: body(st, *refs)
  return pallas_call(kernel, grid=(st.batch, st.value_heads, st.num_chunks, st.value_dim // bv),
                     in_specs=in_specs, out_specs=L.tokens(st, bv, w, split=True),
                     out_shape=jax.ShapeDtypeStruct((st.batch, st.length, st.value_heads, st.value_dim),
                                                    out_dtype),
                     interpret=st.interpret, num_warps=st.config.output.warps, num_stages=st.stages,
                     fp32_dots=st.fp32_dots, name="delta_rule_output")(*args)
