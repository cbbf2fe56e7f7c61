"""Forward kernels of the chunkwise online solve (DESIGN.md §2), for one padded problem (`layout.Static`).

1. `prep`   chunk-parallel, grid (B, HV, NC): the decayed Gram A = strictLower(diag(β)(K⊙e^G)(K̃⊙e^−G)ᵀ) as
            s×s blocks, T = (I + A)⁻¹ as block rows [s, C] (`intra.inverse_rows`), W = T diag(β)(K⊙e^G)
            [C, K] and U = T diag(β) V [C, V] as [s, C] × [C, ·] dots; under autodiff it also stores T (the
            backward's residual). With T given (`wu`, in the backward) only the W and U dots run.
2. `state_pass`  sequential, grid (B, HV, V/BV): a fori_loop over chunks with the fp32 state [K, BV] in
            registers: V_new = U − W S, S ← e^{G_C} ⊙ S + (K̃ ⊙ e^{G_C − G})ᵀ V_new; emits the state
            entering every chunk, V_new and the final state. With `BlockSizes.fuse_inter` the forward's pass
            emits the inter-chunk output (Q⊙e^G) S_in [B, T, HV, V] fp32 instead of the states.
3. `output` chunk-parallel, grid (B, HV, NC, V/BV): O = scale·((Q⊙e^G) S_in + tril(Q K̃ decayed) V_new) — one
            [C, K] × [K, C] score dot without per-channel decay, s×s sub-blocks with it.
Per-channel decay at chunks of two sub-blocks or more (`Static.scores_first`) runs `scores` first, grid
(B, HV, NC): the chunk's Gram A and its intra output scores [C, C], which prep inverts and the output kernel
multiplies (neither then holds the factored sub-block operands of a whole chunk).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gpu import layout as L
from pallas_kernels.gpu.chunk_math import F32, dot, iota, last_row, masked_exp, row_scale, take_col
from pallas_kernels.gpu.config import pallas_call
from pallas_kernels.gpu.intra import ALL, Channel, block, decay_factor, full_scores, inverse_rows, load


def _split(refs, *counts):
  """Splits a flat ref list into groups of the given sizes (0 → None)."""
  out, i = [], 0
  for n in counts:
    out.append(refs[i] if n == 1 else (None if n == 0 else refs[i:i + n]))
    i += n
  return out


def chunk_decay_rows(st, g_ref, t0, cols=None):
  """G of the chunk starting at token t0 from a whole-sequence ref: [C] or [C, K] (per channel: the K columns
  `cols`, a `pl.ds`, or all); None without decay."""
  if st.decay == "none":
    return None
  if st.decay == "scalar":
    return g_ref[pl.ds(t0, st.chunk)].astype(F32)
  return g_ref[pl.ds(t0, st.chunk), slice(None) if cols is None else cols].astype(F32)


def decay_to_end(st, G):
  """(e^{G_C − G} as a row factor, e^{G_C} as a factor on the state's rows) for a chunk's G."""
  gl = last_row(G)
  if st.decay == "scalar":
    return jnp.exp(gl - G), jnp.exp(gl)
  return jnp.exp(gl[None, :] - G), jnp.exp(gl)[:, None]


# ---------------------------------------------------------------------------------------------------------
# 1. W, U (and T) per chunk.
# ---------------------------------------------------------------------------------------------------------
def gram_blocks(st, k_ref, kw_ref, beta_ref, g_ref):
  """A = diag(β) P (strictly lower) of one chunk as {(a, m): [s, s]} for m ≤ a; exact products (raw inputs,
  or fp32 operands for the per-channel factors)."""
  s, n = st.sub, st.num_sub
  if st.decay == "channel":
    ch = Channel(g_ref, s, n, st.blocks.k_block("diag", st.key_dim), st.blocks.factor_diag)
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


def decay_rows(st, g):
  """e^G as a row factor: [C] (scalar), [C, K] (per channel) or None."""
  return None if g is None else jnp.exp(g)


def _prep_kernel(st, source, wu, emit_t, decayed, *refs):
  """T from `source` ("gram": the Gram blocks of K, K̃; "a": a given A [C, C] from `scores`; "t": a given T),
  then W, U when wu, and T stored when emit_t. decayed: k_ref holds K ⊙ e^G (per channel) and G is not read."""
  has_g = st.decay != "none" and not decayed
  k_ref, kw_ref, v_ref, beta_ref, g_ref, given_ref, w_ref, u_ref, t_ref = _split(
      refs, int(wu or source == "gram"), int(source == "gram"), int(wu), 1, int(has_g), int(source != "gram"),
      int(wu), int(wu), int(emit_t))
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
  if not wu:
    return
  # Row factors of K and V go on T's columns, so that K and V load straight into the dots (gpu/README.md, "Loads go
  # straight into dots"; H200: main-shape prep 0.273 → 0.212 ms).
  beta = load(beta_ref, ALL)
  if decayed:
    kf, k = beta, load(k_ref, ALL, dtype=None)
  elif st.decay == "channel":
    kf, k = beta, st.lo(row_scale(load(k_ref, ALL), decay_rows(st, load(g_ref, ALL))))
  else:
    kf = beta * decay_rows(st, load(g_ref, ALL)) if has_g else beta
    k = load(k_ref, ALL, dtype=None)
  for a in range(n):
    w_ref[block(a, s), :] = dot(st.lo(T[a] * kf[None, :]), k).astype(w_ref.dtype)
  v = load(v_ref, ALL, dtype=None)
  for a in range(n):
    u_ref[block(a, s), :] = dot(st.lo(T[a] * beta[None, :]), v).astype(u_ref.dtype)


def prep(st: L.Static, k, kw, v, beta, G, *, emit_t: bool = False, T=None, A=None, wu: bool = True,
         decayed: bool = False):
  """→ W [B, HV, T, K], U [B, HV, T, V] in st.mm (and T = (I + A)⁻¹ [B, HV, T, C] fp32 when emit_t). T is
  formed from the Gram blocks of k, kw; or from A = diag(β) strictLower(P) [B, HV, T, C] fp32 when given
  (`scores`); or given itself (the forward's T, in the backward: only W and U are formed). wu=False: T alone.
  decayed (with A): k is `scores`' K ⊙ e^G [B, HV, T, K] and G is not read."""
  w = L.chunk_grid
  source = "t" if T is not None else ("a" if A is not None else "gram")
  emit_t = emit_t and source != "t"
  decayed = decayed and source == "a"
  in_specs, args = [], []
  if wu or source == "gram":
    in_specs.append(L.head_major(st, st.key_dim, w) if decayed else L.tokens(st, st.key_dim, w, st.key_head))
    args.append(k)
  if source == "gram":
    in_specs.append(L.tokens(st, st.key_dim, w, st.kw_head))
    args.append(kw)
  if wu:
    in_specs.append(L.tokens(st, st.value_dim, w))
    args.append(v)
  in_specs.append(L.vector(st, w))
  args.append(beta)
  if st.decay != "none" and not decayed:
    in_specs.append(L.decay_spec(st, w))
    args.append(G)
  if source != "gram":
    in_specs.append(L.head_major(st, st.chunk, w))
    args.append(T if source == "t" else A)
  hv, t = (st.batch, st.value_heads), st.length
  out_specs, out_shape = [], []
  if wu:
    out_specs += [L.head_major(st, st.key_dim, w), L.head_major(st, st.value_dim, w)]
    out_shape += [jax.ShapeDtypeStruct((*hv, t, st.key_dim), st.mm),
                  jax.ShapeDtypeStruct((*hv, t, st.value_dim), st.mm)]
  if emit_t:
    out_specs.append(L.head_major(st, st.chunk, w))
    out_shape.append(jax.ShapeDtypeStruct((*hv, t, st.chunk), F32))
  kernel = lambda *refs: _prep_kernel(st, source, wu, emit_t, decayed, *refs)
  name = {"t": "delta_rule_wu"}.get(source, "delta_rule_prep" if wu else "delta_rule_inverse")
  return pallas_call(kernel, grid=(st.batch, st.value_heads, st.num_chunks), in_specs=in_specs,
                     out_specs=out_specs, out_shape=out_shape, interpret=st.interpret,
                     num_warps=_prep_warps(st, source),
                     num_stages=st.stages,
                     fp32_dots=st.fp32_dots, name=name)(*args)


def _prep_warps(st, source):
  if not st.low_precision:
    return st.blocks.warps_prep_fp32
  if st.decay != "channel":
    return st.blocks.warps_prep
  return st.blocks.warps_prep_scores if source == "a" else st.blocks.warps_prep_channel


def inverse(st: L.Static, k, kw, beta, G, A=None):
  """→ T = (I + A)⁻¹ [B, HV, T, C] fp32 alone (from the Gram blocks, or from a given A)."""
  T, = prep(st, k, kw, None, beta, G, A=A, emit_t=True, wu=False)
  return T


def _spread(p, a, c):
  """An [s, s] block p placed at columns a·s … a·s + s − 1 of an [s, C] row block (zeros elsewhere)."""
  s = p.shape[0]
  col = iota((s, c), 1)
  out = jnp.zeros((s, c), F32)
  for j in range(s):
    out = jnp.where(col == a * s + j, take_col(p, j)[:, None], out)
  return out


def _scores_kernel(st, q_ref, k_ref, kw_ref, beta_ref, g_ref, akk_ref, aqk_ref, *tile_refs):
  """One chunk, one row block a at a time: P[a, :] = Σ_c (x_a ⊙ e^{G_a − r_a})(y ⊙ e^{r_a − G})ᵀ over K column
  steps, an [s, kc] × [kc, C] dot whose columns beyond the reference are masked out before the exp.
  When the chunk's decays allow (`Channel.factored_ok`) r_a is block a's middle row and the one dot gives the
  diagonal block too (every factor ≤ e^40); else r_a is the row a·s − 1 (factors ≤ 1, columns < a·s) and the
  diagonal blocks are added pairwise after the loop. Each row block is stored once.
  tile_refs (kd, qd, kwd, gc): the same K steps also store K ⊙ e^G, Q ⊙ e^G and K̃ ⊙ e^{G_C − G} in st.mm, and
  G_C."""
  s, n, c = st.sub, st.num_sub, st.chunk
  kc = st.blocks.k_block("scores", st.key_dim)
  ch = Channel(g_ref, s, n, st.blocks.k_block("diag", st.key_dim), st.blocks.factor_diag)
  ok = ch.factored_ok(range(n)) if st.blocks.factor_diag else False
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
      kd_ref, qd_ref, kwd_ref, gc_ref = tile_refs
      e, gc = jnp.exp(G), load(g_ref, c - 1, cols)
      kd_ref[:, cols] = st.lo(load(k_ref, ALL, cols) * e)
      qd_ref[:, cols] = st.lo(load(q_ref, ALL, cols) * e)
      kwd_ref[:, cols] = st.lo(kw * jnp.exp(gc[None, :] - G))
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

  if st.blocks.factor_diag:
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
  every sub-block at once (at chunk 64 both spilled).
  tiles (`BlockSizes.scores_tiles`): also → K ⊙ e^G, Q ⊙ e^G, K̃ ⊙ e^{G_C − G} [B, HV, T, K] in st.mm, the
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
  return tuple(pallas_call(lambda *refs: _scores_kernel(st, *refs), grid=(st.batch, st.value_heads, st.num_chunks),
                           in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                           interpret=st.interpret, num_warps=st.blocks.warps_scores, num_stages=st.stages,
                           fp32_dots=st.fp32_dots, name="delta_rule_scores")(q, k, kw, beta, G))


# ---------------------------------------------------------------------------------------------------------
# 2. The sequential state pass.
# ---------------------------------------------------------------------------------------------------------
def _state_kernel(st, *refs, inter=False, ends=False):
  """ends: g_ref holds G_C per chunk [NC, K] (`scores`' tiles), not G."""
  has_g, packed = st.decay != "none", st.segments > 0
  w_ref, u_ref, kw_ref, g_ref, q_ref, info_ref, s0_ref, vn_ref, sin_ref, st_ref = _split(
      refs, 1, 1, 1, int(has_g), int(inter), int(packed), 1, 1, 1, 1)
  c_len, kd, kp = st.chunk, st.key_dim, st.state_k_piece
  # The state's K rows as separate [kp, BV] tiles (one piece: the whole tile, indexed exactly as a plain load).
  pieces = [pl.ds(i * kp, kp) for i in range(kd // kp)] if kp < kd else [slice(None)]

  def body(c, S):
    t0 = pl.multiple_of(c * c_len, c_len)
    tokens = pl.ds(t0, c_len)
    if packed:                                   # a segment's first chunk starts from its initial state
      seg, first, last = L.decode_chunk_info(info_ref[c])
      base = pl.multiple_of(seg * kd, kd)
      rows = [pl.ds(base + i * kp, kp) for i in range(len(pieces))]
      S = [jnp.where(first, s0_ref[r, :].astype(F32), s) for r, s in zip(rows, S)]
    ws = [dot(w_ref[tokens, ks], st.lo(s)) for ks, s in zip(pieces, S)]   # independent dots, then summed
    vn = u_ref[tokens, :].astype(F32) - functools.reduce(jnp.add, ws)
    ends_only = st.predecay and not inter       # (K̃ pre-decayed: the chunk's last row of G is all it needs)
    G = [chunk_decay_rows(st, g_ref, t0, ks) for ks in pieces] if has_g and not ends_only else [None] * len(pieces)
    if inter:                                    # the output kernel's (Q⊙e^G) S_in, off the chain of S
      if st.decay == "channel":
        qs = [row_scale(q_ref[tokens, ks].astype(F32), decay_rows(st, g)) for ks, g in zip(pieces, G)]
        sin_ref[tokens, :] = functools.reduce(jnp.add, [dot(st.lo(q), st.lo(s)) for q, s in zip(qs, S)])
      else:
        qs = functools.reduce(jnp.add, [dot(q_ref[tokens, ks], st.lo(s)) for ks, s in zip(pieces, S)])
        sin_ref[tokens, :] = row_scale(qs, decay_rows(st, G[0]))
    else:
      for i, s in enumerate(S):
        sin_ref[pl.ds(pl.multiple_of(c * kd + i * kp, kp), kp), :] = s.astype(sin_ref.dtype)
    vn_ref[tokens, :] = vn.astype(vn_ref.dtype)
    new = []
    for ks, s, g in zip(pieces, S, G):
      kw, vs = kw_ref[tokens, ks], vn           # K̃ straight from its load into the dot unless per channel
      if ends_only:                              # (predecay: kw_ref holds K̃ ⊙ e^{G_C − G} already)
        s = s * jnp.exp(load(g_ref, c if ends else t0 + c_len - 1, ks))[:, None]
      elif has_g:
        to_end, gamma = decay_to_end(st, g)
        if st.decay == "scalar":                 # e^{G_C − G} on the rows of V_new, not of K̃
          vs = row_scale(vn, to_end)
        elif not st.predecay:                    # (predecay with inter: kw_ref holds K̃ ⊙ e^{G_C − G} already)
          kw = row_scale(kw.astype(F32), to_end)
        s = s * gamma
      new.append(s + dot(st.lo(kw), st.lo(vs), ta=True))
    if packed:
      @pl.when(last)
      def _():                                   # a segment's last chunk leaves its final state
        for r, s in zip(rows, new):
          st_ref[r, :] = s
    return new

  if packed:
    S0 = [jnp.zeros((kp, s0_ref.shape[-1]), F32) for _ in pieces]
    lax.fori_loop(*L.lane_bounds(st, info_ref), body, S0)
  else:
    S_T = lax.fori_loop(0, st.num_chunks, body, [s0_ref[ks, :].astype(F32) for ks in pieces])
    for ks, s in zip(pieces, S_T):
      st_ref[ks, :] = s


def key_spec(st: L.Static, w, head):
  """A state pass's whole-sequence K̃ or Q: token-major [B, T, heads, K] (value head → `head`), or with
  `Static.predecay` the head-major decayed tile [B, HV, T, K] of `decayed_tiles`."""
  if st.predecay:
    return L.head_major(st, st.key_dim, w, whole=True)
  return L.tokens(st, st.key_dim, w, head, whole=True)


def _decayed_kernel(st, *refs):
  kw_ref, g_ref, q_ref, kd_ref, qd_ref = _split(refs, 1, 1, int(len(refs) == 5), 1, int(len(refs) == 5))
  G = load(g_ref, ALL)
  kd_ref[...] = row_scale(load(kw_ref, ALL), jnp.exp(last_row(G)[None, :] - G)).astype(kd_ref.dtype)
  if q_ref is not None:
    qd_ref[...] = row_scale(load(q_ref, ALL), jnp.exp(G)).astype(qd_ref.dtype)


def decayed_tiles(st: L.Static, kw, G, q=None):
  """Per-channel decay, `Static.predecay`: K̃ ⊙ e^{G_C − G} (and with q also Q ⊙ e^G) [B, HV, T, K] in st.mm,
  the operands the state passes would otherwise form from K̃ (Q) and G at every chunk step. Rounded as there."""
  w = L.chunk_grid
  in_specs = [L.tokens(st, st.key_dim, w, st.kw_head), L.decay_spec(st, w)]
  args = [kw, G]
  if q is not None:
    in_specs.append(L.tokens(st, st.key_dim, w, st.key_head))
    args.append(q)
  n = 1 + (q is not None)
  shape = jax.ShapeDtypeStruct((st.batch, st.value_heads, st.length, st.key_dim), st.mm)
  out = pallas_call(lambda *refs: _decayed_kernel(st, *refs), grid=(st.batch, st.value_heads, st.num_chunks),
                    in_specs=in_specs, out_specs=[L.head_major(st, st.key_dim, w)] * n, out_shape=[shape] * n,
                    interpret=st.interpret, num_warps=st.blocks.warps_chunk, num_stages=st.stages,
                    fp32_dots=st.fp32_dots, name="delta_rule_decayed_tiles")(*args)
  return tuple(out) if q is not None else out[0]


def state_pass(st: L.Static, W, U, kw, G, S0, info=None, q=None, ends=False):
  """→ (V_new [B, HV, T, V] and S_in [B, HV, NC·K, V] in st.mm, S_T [B, HV, K, V] fp32). Packed (`info` as
  `layout.chunk_info`): S0 and S_T are [1, HV, N·K, V] and S_T rows of absent segments are not written. With q
  [B, T, H, K] the second result is instead the inter-chunk output (Q⊙e^G) S_in [B, T, HV, V] fp32. With
  `Static.predecay`, kw is `decayed_tiles`' K̃ ⊙ e^{G_C − G} (or `scores`'); ends (with predecay, without q):
  G is `scores`' G_C [B, HV, NC, K]."""
  bv = st.state_block_v
  _, w = L.state_pass_grid(st)
  in_specs = [L.head_major(st, st.key_dim, w, whole=True), L.head_major(st, bv, w, whole=True, split=True),
              key_spec(st, w, st.kw_head)]
  args = [W, U, kw]
  inter = q is not None
  ends = ends and st.predecay and not inter
  if st.decay != "none":
    in_specs.append(L.chunk_ends(st, w, whole=True) if ends else L.decay_spec(st, w, whole=True))
    args.append(G)
  if inter:
    in_specs.append(L.tokens(st, st.key_dim, w, st.key_head, whole=True))
    args.append(q)
  return launch_state_pass(st, functools.partial(_state_kernel, inter=inter, ends=ends), in_specs, args, info, S0,
                           "delta_rule_state_fwd", inter=inter)


def launch_state_pass(st, body, in_specs, args, info, state, name, inter=False):
  """Runs a sequential state pass (forward or reverse) over `layout.state_pass_grid`; the inputs given, then
  the packed chunk info (when st.segments) and the state (S0 or dS_T); outputs `layout.state_pass_outputs`."""
  bv = st.state_block_v
  grid, w = L.state_pass_grid(st)
  if st.segments:
    in_specs, args = in_specs + [L.chunk_info(st)], args + [info]
  out_specs, out_shape = L.state_pass_outputs(st, bv, w, inter)
  return pallas_call(lambda *refs: body(st, *refs), grid=grid,
                     in_specs=in_specs + [L.state(st, bv, w)], out_specs=out_specs, out_shape=out_shape,
                     interpret=st.interpret, num_warps=st.blocks.warps_state, num_stages=st.state_stages,
                     fp32_dots=st.fp32_dots, name=name)(*args, state)


# ---------------------------------------------------------------------------------------------------------
# 3. Outputs.
# ---------------------------------------------------------------------------------------------------------
def _output_kernel(st, *refs, inter=False, given=False, decayed=False):
  """One chunk's O; inter: sin_ref holds its inter-chunk part (Q⊙e^G) S_in [C, BV] (fp32) instead of S_in;
  given: p_ref holds the chunk's intra scores (`scores`), and kw is not read; decayed (with given): q_ref
  holds Q ⊙ e^G and G is not read."""
  has_g = st.decay != "none" and not decayed
  q_ref, kw_ref, g_ref, p_ref, sin_ref, vn_ref, o_ref = _split(
      refs, 1, int(not given), int(has_g), int(given), 1, 1, 1)
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
    acc = sin_ref[...] if inter else row_scale(dot(q, S), decay_rows(st, g))
    acc = acc + dot(st.lo(P), st.lo(vn_ref[...]))
    o_ref[...] = (st.scale * acc).astype(o_ref.dtype)
    return
  s, n = st.sub, st.num_sub
  ch = Channel(g_ref, s, n, st.blocks.k_block("diag", st.key_dim), st.blocks.factor_diag)
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
  bv = st.blocks.v_block("out", st.value_dim)
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
  body = kernel_body or functools.partial(_output_kernel, inter=inter, given=P is not None, decayed=decayed)
  kernel = lambda *refs: body(st, *refs)
  return pallas_call(kernel, grid=(st.batch, st.value_heads, st.num_chunks, st.value_dim // bv),
                     in_specs=in_specs, out_specs=L.tokens(st, bv, w, split=True),
                     out_shape=jax.ShapeDtypeStruct((st.batch, st.length, st.value_heads, st.value_dim),
                                                    out_dtype),
                     interpret=st.interpret, num_warps=st.blocks.warps_chunk, num_stages=st.stages,
                     fp32_dots=st.fp32_dots, name="delta_rule_output")(*args)


def scores_tiles(st: L.Static) -> bool:
  """Whether the forward takes its decayed operands from `scores` (`BlockSizes.scores_tiles`)."""
  return st.scores_first and st.blocks.scores_tiles and not st.fuse_inter


def predecayed(st: L.Static) -> L.Static:
  """st with `predecay` on: the state pass then reads pre-decayed K̃ tiles (here `scores`')."""
  return dataclasses.replace(st, blocks=dataclasses.replace(st.blocks, predecay=True))


def forward(st: L.Static, q, k, kw, v, beta, G, S0, info=None, *, emit_t: bool = False):
  """The whole forward: (o [B, T, HV, V] in q.dtype, S_T [B, HV, K, V] fp32), and T = (I + A)⁻¹
  [B, HV, T, C] fp32 when emit_t (the one residual the backward keeps besides the inputs). Packed: `info`
  and the state layout of `state_pass`."""
  A = P = None
  tiles = scores_tiles(st)
  kd, qd, kwd = k, q, kw
  if tiles:                                      # K ⊙ e^G, Q ⊙ e^G and K̃ ⊙ e^{G_C − G} from `scores`
    A, P, kd, qd, kwd, G_end = scores(st, q, k, kw, beta, G, tiles=True)
  elif st.scores_first:
    A, P = scores(st, q, k, kw, beta, G)
  if st.blocks.split_prep:
    T = [inverse(st, k, kw, beta, G, A=A)]
    W, U = prep(st, k, kw, v, beta, G, T=T[0])
  else:
    W, U, *T = prep(st, kd, kw, v, beta, G, emit_t=emit_t, A=A, decayed=tiles)
  inter = st.fuse_inter
  if tiles:
    V_new, S_in, S_T = state_pass(predecayed(st), W, U, kwd, G_end, S0, info, ends=True)
  else:
    kwd = decayed_tiles(st, kw, G) if st.predecay else kw
    V_new, S_in, S_T = state_pass(st, W, U, kwd, G, S0, info, q=q if inter else None)
  o = output(st, qd, kw, G, S_in, V_new, q.dtype, inter=inter, P=P, decayed=tiles)
  return (o, S_T, T[0]) if emit_t else (o, S_T)
