"""`prep`: per chunk, T = (I + A)⁻¹ and W = T diag(β)(K ⊙ e^G), U = T diag(β) V. Grid (B, HV, NC).

A = strictLower(diag(β)(K ⊙ e^G)(K̃ ⊙ e^{−G})ᵀ) comes from the Gram blocks of K and K̃ (`gram_blocks`), or from
`scores` (per-channel decay at chunks of two sub-blocks or more); T is formed as block rows [s, C]
(`intra.inverse_rows`). Under autodiff the forward also stores T, the backward's one residual; the backward
runs this kernel again with T given (the `wu` launch), forming only W and U.

With PDN's write key formed here (`PdnKey`), K̃ is not read: from the second moment entering the chunk, A_in, each
sub-block's A_t = e^{gᴾ_t} A_{t−1} + βᴾ_t k_t ⊙ k_t comes from one [s, s] × [s, K] dot (the decayed pair factors
of the moment's own gates times k ⊙ k, plus A entering the sub-block decayed), then K̃ = M(A) ⊙ K
(`precond_key.pdn_scale`) goes into the Gram and is stored for the state pass and the output.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gpu import precond_key
from pallas_kernels.gpu.chunk_math import F32, dot, last_row, row_scale
from pallas_kernels.gpu.common import SQUEEZED as _SQ
from pallas_kernels.gpu.common import pallas_call, split_refs
from pallas_kernels.gpu.delta_rule import factors, heuristics
from pallas_kernels.gpu.delta_rule import layout as L
from pallas_kernels.gpu.intra import ALL, Channel, block, decay_factor, inverse_rows, load


class PdnKey(NamedTuple):
  """PDN's write key formed in `prep`: A_in, the second moment entering every chunk [B, NC, H, K] fp32; βᴾ and
  Gᴾ (in-chunk cumsum of the moment's log-decay) head-major [B, H, T] fp32; the center [H, K] fp32; x and ε
  (static)."""
  A_in: jax.Array
  beta: jax.Array
  G: jax.Array
  center: jax.Array
  x: float
  eps: float


def pdn_key_blocks(st, key, k_ref, ain_ref, bp_ref, gp_ref, c_ref, kw_out_ref):
  """PDN's write key of one chunk, block by block (a generator of n blocks [s, K] in k's dtype, each stored
  into kw_out_ref as it forms; `PdnKey`)."""
  s, n = st.sub, st.num_sub
  A_end, G_end, center = ain_ref[...], 0.0, c_ref[...]
  for a in range(n):
    k, G = load(k_ref, block(a, s)), load(gp_ref, block(a, s))
    pairs = decay_factor(G, s, strict=False) * load(bp_ref, block(a, s))[None, :]
    A = dot(pairs, k * k) + jnp.exp(G - G_end)[:, None] * A_end[None, :]        # Gᴾ non-increasing: e^{…} ≤ 1
    A_end, G_end = last_row(A), last_row(G)
    kw = (precond_key.pdn_scale(A, center[None, :], key.x, key.eps)[0] * k).astype(k_ref.dtype)
    kw_out_ref[block(a, s), :] = kw
    yield kw


def gram_blocks(st, k_ref, kw_ref, beta_ref, g_ref, kw_blocks=None):
  """A = diag(β) P (strictly lower) of one chunk as {(a, m): [s, s]} for m ≤ a; exact products (raw inputs,
  or fp32 operands for the per-channel factors). kw_blocks (decay none or scalar): K̃'s n blocks given as values
  (`pdn_key_blocks`, consumed in order: each block's column of P is formed before the next block, so one block
  of K̃ is live at a time) instead of kw_ref's."""
  s, n = st.sub, st.num_sub
  if st.decay == "channel":
    ch = Channel(g_ref, s, n, st.k_block(st.config.diagonal.block_k), st.config.diagonal.factor)
    P = ch.scores(k_ref, kw_ref, strict=True)
  else:
    G = [load(g_ref, block(a, s)) for a in range(n)] if st.decay == "scalar" else [None] * n

    def pair(ka, kwm, a, m):
      p = dot(ka, kwm, tb=True)
      if a == m:
        return p * decay_factor(G[a], s, strict=True)
      return p * jnp.exp(G[a][:, None] - G[m][None, :]) if G[a] is not None else p      # m < a: exponent ≤ 0
    if kw_blocks is None:
      P = {}
      for a in range(n):
        ka = load(k_ref, block(a, s), dtype=None)
        for m in range(a + 1):
          P[a, m] = pair(ka, load(kw_ref, block(m, s), dtype=None), a, m)
    else:
      P = {(a, m): pair(load(k_ref, block(a, s), dtype=None), kwm, a, m)
           for m, kwm in enumerate(kw_blocks) for a in range(m, n)}
  return {(a, m): load(beta_ref, block(a, s))[:, None] * p for (a, m), p in P.items()}


def _kernel(st, source, emit_t, decayed, key, *refs):
  """T from `source` ("gram": the Gram blocks of K, K̃; "a": a given A [C, C] from `scores`; "t": a given T),
  then W, U, and T stored when emit_t. decayed: k_ref holds K ⊙ e^G (per channel) and G is not read. key
  (`PdnKey`, with "gram"): K̃ formed here from the moment refs and stored."""
  has_g = st.decay != "none" and not decayed
  (k_ref, kw_ref, v_ref, beta_ref, g_ref, given_ref, key_refs, w_ref, u_ref, t_ref, kw_out_ref) = split_refs(
      refs, 1, source == "gram" and key is None, 1, 1, has_g, source != "gram", 4 if key else 0, 1, 1, emit_t,
      key is not None)
  s, n = st.sub, st.num_sub
  kw_blocks = None if key is None else pdn_key_blocks(st, key, k_ref, *key_refs, kw_out_ref)
  if source == "t":
    T = [given_ref[block(a, s), :] for a in range(n)]
  elif source == "a":
    T = inverse_rows({(a, m): given_ref[block(a, s), block(m, s)] for a in range(n) for m in range(a + 1)}, n, s)
  else:
    T = inverse_rows(gram_blocks(st, k_ref, kw_ref, beta_ref, g_ref, kw_blocks), n, s)
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


def prep(st: L.Static, k, kw, v, beta, G, *, emit_t: bool = False, T=None, A=None, decayed: bool = False,
         key: PdnKey | None = None):
  """→ W [B, HV, T, K], U [B, HV, T, V] in st.mm (and T = (I + A)⁻¹ [B, HV, T, C] fp32 when emit_t). T is
  formed from the Gram blocks of k, kw; or from A = diag(β) strictLower(P) [B, HV, T, C] fp32 when given
  (`scores`); or given itself (the forward's T, in the backward: only W and U are formed). decayed (with A): k
  is `scores`' K ⊙ e^G [B, HV, T, K] and G is not read. key (decay none or scalar, HV = H, kw None): PDN's
  write key formed here, and returned last (K̃ [B, T, H, K] in k's dtype)."""
  w = L.chunk_grid
  source = "t" if T is not None else ("a" if A is not None else "gram")
  if key is not None and (source != "gram" or st.decay == "channel" or st.value_heads != st.heads):
    raise ValueError("prep: PDN's key is formed only from the Gram blocks, without per-channel decay, HV = H")
  emit_t = emit_t and source != "t"
  decayed = decayed and source == "a"
  in_specs = [L.head_major(st, st.key_dim, w) if decayed else L.tokens(st, st.key_dim, w, st.key_head)]
  args = [k]
  if source == "gram" and key is None:
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
  if key is not None:
    in_specs += [pl.BlockSpec((_SQ, _SQ, _SQ, st.key_dim), lambda b, h, c: (b, c, h, 0)),     # [B, NC, H, K]
                 L.vector(st, w), L.vector(st, w), pl.BlockSpec((_SQ, st.key_dim), lambda b, h, c: (h, 0))]
    args += [key.A_in, key.beta, key.G, key.center]
  hv, t = (st.batch, st.value_heads), st.length
  out_specs = [L.head_major(st, st.key_dim, w), L.head_major(st, st.value_dim, w)]
  out_shape = [jax.ShapeDtypeStruct((*hv, t, st.key_dim), st.mm), jax.ShapeDtypeStruct((*hv, t, st.value_dim), st.mm)]
  if emit_t:
    out_specs.append(L.head_major(st, st.chunk, w))
    out_shape.append(jax.ShapeDtypeStruct((*hv, t, st.chunk), F32))
  if key is not None:
    out_specs.append(L.tokens(st, st.key_dim, w))
    out_shape.append(jax.ShapeDtypeStruct(k.shape, k.dtype))
  statics = None if key is None else key._replace(A_in=None, beta=None, G=None, center=None)
  kernel = lambda *refs: _kernel(st, source, emit_t, decayed, statics, *refs)
  warps = heuristics.prep_warps(st.config, st.decay, st.low_precision, source, key is not None)
  return pallas_call(kernel, grid=(st.batch, st.value_heads, st.num_chunks), in_specs=in_specs,
                     out_specs=out_specs, out_shape=out_shape, interpret=st.interpret, num_warps=warps,
                     num_stages=st.stages, fp32_dots=st.fp32_dots,
                     name="delta_rule_wu" if source == "t" else "delta_rule_prep")(*args)
