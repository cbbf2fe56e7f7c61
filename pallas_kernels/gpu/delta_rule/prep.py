"""`prep`: per chunk, T = (I + A)⁻¹ and W = T diag(β)(K ⊙ e^G), U = T diag(β) V. Grid (B, HV, NC).

A = strictLower(diag(β)(K ⊙ e^G)(K̃ ⊙ e^{−G})ᵀ) comes from the Gram blocks of K and K̃ (`gram_blocks`), or from
`scores` (per-channel decay at chunks of two sub-blocks or more); T is formed as block rows [s, C]
(`intra.inverse_rows`). Under autodiff the forward also stores T, the backward's one residual; the backward
runs this kernel again with T given (the `wu` launch), forming only W and U.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gpu.chunk_math import F32, dot, row_scale
from pallas_kernels.gpu.common import pallas_call, split_refs
from pallas_kernels.gpu.delta_rule import factors, heuristics
from pallas_kernels.gpu.delta_rule import layout as L
from pallas_kernels.gpu.intra import ALL, Channel, block, decay_factor, inverse_rows, load


def gram_blocks(st, k_ref, kw_ref, beta_ref, g_ref):
  """A = diag(β) P (strictly lower) of one chunk as {(a, m): [s, s]} for m ≤ a; exact products (raw inputs,
  or fp32 operands for the per-channel factors)."""
  s, n = st.sub, st.num_sub
  if st.decay == "channel":
    ch = Channel(g_ref, s, n, st.k_block(st.config.diagonal.block_k), st.config.diagonal.factor)
    P = ch.scores(k_ref, kw_ref, strict=True)
  else:
    G = [load(g_ref, block(a, s)) for a in range(n)] if st.decay == "scalar" else [None] * n
    P = {}
    for a in range(n):
      ka = load(k_ref, block(a, s), dtype=None)
      for m in range(a + 1):
        p = dot(ka, load(kw_ref, block(m, s), dtype=None), tb=True)
        if a == m:
          p = p * decay_factor(G[a], s, strict=True)
        elif G[a] is not None:
          p = p * jnp.exp(G[a][:, None] - G[m][None, :])            # m < a: exponent ≤ 0
        P[a, m] = p
  return {(a, m): load(beta_ref, block(a, s))[:, None] * p for (a, m), p in P.items()}


def _kernel(st, source, emit_t, decayed, *refs):
  """T from `source` ("gram": the Gram blocks of K, K̃; "a": a given A [C, C] from `scores`; "t": a given T),
  then W, U, and T stored when emit_t. decayed: k_ref holds K ⊙ e^G (per channel) and G is not read."""
  has_g = st.decay != "none" and not decayed
  k_ref, kw_ref, v_ref, beta_ref, g_ref, given_ref, w_ref, u_ref, t_ref = split_refs(
      refs, 1, source == "gram", 1, 1, has_g, source != "gram", 1, 1, emit_t)
  s, n = st.sub, st.num_sub
  if source == "t":
    T = [given_ref[block(a, s), :] for a in range(n)]
  elif source == "a":
    T = inverse_rows({(a, m): given_ref[block(a, s), block(m, s)] for a in range(n) for m in range(a + 1)}, n, s)
  else:
    T = inverse_rows(gram_blocks(st, k_ref, kw_ref, beta_ref, g_ref), n, s)
  if emit_t:
    for a in range(n):
      t_ref[block(a, s), :] = T[a]
  # Row factors of K and V go on T's columns, so that K and V load straight into the dots (README, "Loads go
  # straight into dots").
  beta = load(beta_ref, ALL)
  if decayed:
    kf, k = beta, load(k_ref, ALL, dtype=None)
  elif st.decay == "channel":
    kf, k = beta, st.lo(row_scale(load(k_ref, ALL), factors.rows(load(g_ref, ALL))))
  else:
    kf = beta * factors.rows(load(g_ref, ALL)) if has_g else beta
    k = load(k_ref, ALL, dtype=None)
  for a in range(n):
    w_ref[block(a, s), :] = dot(st.lo(T[a] * kf[None, :]), k).astype(w_ref.dtype)
  v = load(v_ref, ALL, dtype=None)
  for a in range(n):
    u_ref[block(a, s), :] = dot(st.lo(T[a] * beta[None, :]), v).astype(u_ref.dtype)


def prep(st: L.Static, k, kw, v, beta, G, *, emit_t: bool = False, T=None, A=None, decayed: bool = False):
  """→ W [B, HV, T, K], U [B, HV, T, V] in st.mm (and T = (I + A)⁻¹ [B, HV, T, C] fp32 when emit_t). T is
  formed from the Gram blocks of k, kw; or from A = diag(β) strictLower(P) [B, HV, T, C] fp32 when given
  (`scores`); or given itself (the forward's T, in the backward: only W and U are formed). decayed (with A): k
  is `scores`' K ⊙ e^G [B, HV, T, K] and G is not read."""
  w = L.chunk_grid
  source = "t" if T is not None else ("a" if A is not None else "gram")
  emit_t = emit_t and source != "t"
  decayed = decayed and source == "a"
  in_specs = [L.head_major(st, st.key_dim, w) if decayed else L.tokens(st, st.key_dim, w, st.key_head)]
  args = [k]
  if source == "gram":
    in_specs.append(L.tokens(st, st.key_dim, w, st.kw_head))
    args.append(kw)
  in_specs += [L.tokens(st, st.value_dim, w), L.vector(st, w)]
  args += [v, beta]
  if st.decay != "none" and not decayed:
    in_specs.append(L.decay_spec(st, w))
    args.append(G)
  if source != "gram":
    in_specs.append(L.head_major(st, st.chunk, w))
    args.append(T if source == "t" else A)
  hv, t = (st.batch, st.value_heads), st.length
  out_specs = [L.head_major(st, st.key_dim, w), L.head_major(st, st.value_dim, w)]
  out_shape = [jax.ShapeDtypeStruct((*hv, t, st.key_dim), st.mm), jax.ShapeDtypeStruct((*hv, t, st.value_dim), st.mm)]
  if emit_t:
    out_specs.append(L.head_major(st, st.chunk, w))
    out_shape.append(jax.ShapeDtypeStruct((*hv, t, st.chunk), F32))
  kernel = lambda *refs: _kernel(st, source, emit_t, decayed, *refs)
  return pallas_call(kernel, grid=(st.batch, st.value_heads, st.num_chunks), in_specs=in_specs,
                     out_specs=out_specs, out_shape=out_shape, interpret=st.interpret,
                     num_warps=heuristics.prep_warps(st.config, st.decay, st.bf16_matmuls, source),
                     num_stages=st.stages, fp32_dots=st.fp32_dots,
                     name="delta_rule_wu" if source == "t" else "delta_rule_prep")(*args)
