"""`scores`: per-channel decay's Gram A and intra-chunk output scores, per chunk of two sub-blocks or more.
Grid (B, HV, NC).

A kernel of its own, so that neither `prep` nor `output` holds the factored operands of every sub-block at once.
`prep` then inverts the given A and `output` multiplies the given scores. With `Scores.tiles` the same K steps
store the decayed operands K ⊙ e^G, Q ⊙ e^G, K̃ ⊙ e^{G_C − G} and G_C, which prep, output and the state pass
load straight into their dots (the same roundings as forming them there).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gpu.chunk_math import F32, dot, iota, masked_exp, take_col
from pallas_kernels.gpu.common import pallas_call
from pallas_kernels.gpu.delta_rule import layout as L
from pallas_kernels.gpu.intra import ALL, Channel, block, load


def _spread(p, a, c):
  """An [s, s] block p placed at columns a·s … a·s + s − 1 of an [s, C] row block (zeros elsewhere)."""
  s = p.shape[0]
  col = iota((s, c), 1)
  out = jnp.zeros((s, c), F32)
  for j in range(s):
    out = jnp.where(col == a * s + j, take_col(p, j)[:, None], out)
  return out


def _kernel(st, q_ref, k_ref, kw_ref, beta_ref, g_ref, akk_ref, aqk_ref, *tile_refs):
  """One chunk, one row block a at a time: P[a, :] = Σ_c (x_a ⊙ e^{G_a − r_a})(y ⊙ e^{r_a − G})ᵀ over K column
  steps, an [s, kc] × [kc, C] dot whose columns beyond the reference are masked out before the exp.
  When the chunk's decays allow (`Channel.factored_ok`) r_a is block a's middle row and the one dot gives the
  diagonal block too (every factor ≤ e^40); else r_a is the row a·s − 1 (factors ≤ 1, columns < a·s) and the
  diagonal blocks are added pairwise after the loop. Each row block is stored once.
  tile_refs (kd, qd, kwd, gc): the same K steps also store K ⊙ e^G, Q ⊙ e^G and K̃ ⊙ e^{G_C − G} in st.mm, and
  G_C."""
  s, n, c = st.sub, st.num_sub, st.chunk
  kc = st.k_block(st.config.scores.block_k)
  factor = st.config.diagonal.factor
  ch = Channel(g_ref, s, n, st.k_block(st.config.diagonal.block_k), factor)
  ok = ch.factored_ok(range(n)) if factor else False
  row = iota((c, kc), 0)
  # Arithmetic selects on `ok` (a select of two constants on a traced bool lowered to i1 in JAX 0.11's Triton).
  ok_i = lax.convert_element_type(ok, jnp.int32)
  limit = [a * s + s * ok_i for a in range(n)]                        # y's rows kept: < limit

  def ref_row(a, cols):
    prev = load(g_ref, max(a * s - 1, 0), cols)                       # exact when not ok: factors ≤ 1
    return prev + ok_i.astype(F32) * (load(g_ref, a * s + s // 2 - 1, cols) - prev)

  def step(i, acc):
    kk, qk = acc
    cols = pl.ds(pl.multiple_of(i * kc, kc), kc)
    G, kw = load(g_ref, ALL, cols), load(kw_ref, ALL, cols)
    if tile_refs:
      k_decayed_ref, q_decayed_ref, kw_decayed_ref, gc_ref = tile_refs
      e, gc = jnp.exp(G), load(g_ref, c - 1, cols)
      k_decayed_ref[:, cols] = st.lo(load(k_ref, ALL, cols) * e)
      q_decayed_ref[:, cols] = st.lo(load(q_ref, ALL, cols) * e)
      kw_decayed_ref[:, cols] = st.lo(kw * jnp.exp(gc[None, :] - G))
      gc_ref[cols] = gc
    kk, qk = list(kk), list(qk)
    for a in range(n):
      r = ref_row(a, cols)[None, :]
      x = jnp.exp(load(g_ref, block(a, s), cols) - r)
      y = kw * masked_exp(r - G, row < limit[a])
      kk[a] = kk[a] + dot(load(k_ref, block(a, s), cols) * x, y, tb=True)
      qk[a] = qk[a] + dot(st.lo(load(q_ref, block(a, s), cols) * x), st.lo(y), tb=True)
    return tuple(kk), tuple(qk)

  zeros = tuple(jnp.zeros((s, c), F32) for _ in range(n))
  kk, qk = lax.fori_loop(0, st.key_dim // kc, step, (zeros, zeros))

  def pairwise():                                # steep decays: the diagonal blocks pairwise
    pair = Channel(g_ref, s, n, ch.kc, factor=False)
    dk = pair.diag_scores(k_ref, kw_ref, strict=True)
    dq = pair.diag_scores(q_ref, kw_ref, strict=False, mm=st.mm)
    return (tuple(_spread(p, a, c) for a, p in enumerate(dk)), tuple(_spread(p, a, c) for a, p in enumerate(dq)))

  if factor:
    dk, dq = lax.cond(ok, lambda: (zeros, zeros), pairwise)
  else:
    dk, dq = pairwise()
  cols = iota((s, c), 1)
  for a in range(n):
    rows = a * s + iota((s, c), 0)
    akk_ref[block(a, s), :] = load(beta_ref, block(a, s))[:, None] * jnp.where(rows > cols, kk[a] + dk[a], 0.0)
    aqk_ref[block(a, s), :] = jnp.where(rows >= cols, qk[a] + dq[a], 0.0).astype(aqk_ref.dtype)


def scores(st: L.Static, q, k, kw, beta, G, tiles: bool = False):
  """Per-channel decay at a chunk of several sub-blocks (`Static.scores_first`): → (A = diag(β) strictLower(P)
  [B, HV, T, C] fp32 in fp32 products, the Gram that builds T; the output's intra-chunk scores, Q K̃ᵀ decayed
  with its diagonal, [B, HV, T, C] in st.mm), every s×s block factored as in `intra.Channel`, zeros above the
  diagonal. A kernel of its own, so that neither the inverse nor the output holds the factored operands of
  every sub-block at once (they would spill registers at chunk 64).
  tiles (`Scores.tiles`): also → K ⊙ e^G, Q ⊙ e^G, K̃ ⊙ e^{G_C − G} [B, HV, T, K] in st.mm, the
  decayed operands that prep, output and the state pass would otherwise form from K, Q, K̃ and G (the same
  roundings: results unchanged), and G_C [B, HV, NC, K] fp32, all the state pass still needs of G (so G is
  not kept alive past this kernel)."""
  w = L.chunk_grid
  in_specs = [L.tokens(st, st.key_dim, w, st.key_head), L.tokens(st, st.key_dim, w, st.key_head),
              L.tokens(st, st.key_dim, w, st.kw_head), L.vector(st, w), L.decay_spec(st, w)]
  shape = (st.batch, st.value_heads, st.length, st.chunk)
  out_specs = [L.head_major(st, st.chunk, w)] * 2
  out_shape = [jax.ShapeDtypeStruct(shape, F32), jax.ShapeDtypeStruct(shape, st.mm)]
  if tiles:
    out_specs += [L.head_major(st, st.key_dim, w)] * 3 + [L.chunk_ends(st, w)]
    out_shape += ([jax.ShapeDtypeStruct((*shape[:3], st.key_dim), st.mm)] * 3
                  + [jax.ShapeDtypeStruct((*shape[:2], st.num_chunks, st.key_dim), F32)])
  return tuple(pallas_call(lambda *refs: _kernel(st, *refs), grid=(st.batch, st.value_heads, st.num_chunks),
                           in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                           interpret=st.interpret, num_warps=st.config.scores.warps, num_stages=st.stages,
                           fp32_dots=st.fp32_dots, name="delta_rule_scores")(q, k, kw, beta, G))


def takes_tiles(st: L.Static) -> bool:
  """Whether the forward takes its decayed operands from `scores` (`Scores.tiles`; not when the state pass forms
  the inter-chunk output, which needs Q and G themselves)."""
  return st.scores_first and st.config.scores.tiles and not st.fuse_inter
