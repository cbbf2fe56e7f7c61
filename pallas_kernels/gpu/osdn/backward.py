"""The d-pass backward: the adjoint in reverse token order, split into a sequential kernel and a parallel one.

With λ the cotangent of d_{t+1} (d_{T+1}'s cotangent to start), m_t the clip's derivative at d̄_{t+1} (1 inside,
0 outside, ½ at a bound, exactly as `jnp.clip`'s), μ = m_t ⊙ λ, p = ⟨u_t, μ⟩ and c_t = η β_t² / n_t:
    ∂u_t = coef_t μ − c_t p d_t      ∂β_t = η p (1 − 2 β_t s_t) / n_t      ∂n_t = −coef_t p / n_t
    ∂r_t = ⟨d_t − o, μ⟩ (o = 0 for "zero")      ∂o += (1 − r_t) μ ("init")
    λ ← r_t μ − c_t p u_t + ∂ds_t                 (∂d_1 = λ after token 1)
The forward saved d_t, so s_t and d̄_{t+1} are recomputed per token off the dependency chain.

Sequential kernel, grid (B, G): token by token, except through the blocks the forward flagged (clip derivative
1 throughout), where it carries only λ (`blocks.block_chain`) and stores the λ entering each. Parallel kernel,
grid (B, G, NB): the per-token gradients of every flagged block from that λ (`blocks.block_adjoint`), written in
place into the sequential kernel's outputs. With `Config.chain` and every block flagged (no clip anywhere, the
common case) the sequential kernel is compiled without the per-block `lax.cond` and loads each block during
the previous one (`lax.cond` on the flags picks that kernel or the general one); with `Config.spans` that
branch runs the chain over spans instead (`_spanned`, `spans.py`). Packed: λ restarts from the
segment's d_{T+1} cotangent at a last token and ∂d1[segment] is stored at a first.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import osdn_math as om
from pallas_kernels.gpu.common import pallas_call, split_refs
from pallas_kernels.gpu.osdn import layout as L
from pallas_kernels.gpu.osdn import spans, tables
from pallas_kernels.gpu.osdn.blocks import block_adjoint, block_chain
from pallas_kernels.gpu.osdn.loops import F32, block_loop, pre_clip, sequential, sequential_tokens


def _kernel(st, chain_only: bool, *refs):
  """chain_only: every block is flagged (no per-block `lax.cond`; the block's loads issued one block early)."""
  packed, blocked = st.segments > 0, st.blocked
  (u_ref, b_ref, n_ref, r_ref, c_ref, o_ref, ds_ref, gds_ref, gl_ref, tb_ref, wb_ref, gm_ref, ok_ref,
   du_ref, db_ref, dn_ref, dr_ref, dd1_ref, do_ref, lam_ref) = split_refs(
       refs, 1, 1, 1, st.has_r, packed, st.has_o, 1, 1, 1, blocked, blocked, blocked and st.has_r, blocked,
       1, 1, 1, st.has_r, 1, st.has_o, blocked)
  o = o_ref[...] if st.has_o else None
  load, step = _token_fns(st, u_ref, b_ref, n_ref, r_ref, c_ref, o, ds_ref, gds_ref, gl_ref, du_ref, db_ref,
                          dn_ref, dr_ref, dd1_ref)
  lam0 = jnp.zeros((st.key_dim,), F32) if packed else gl_ref[...].astype(F32)
  bt = st.config.block_t_bwd
  if blocked:
    Lb = st.solve_t
    nb, rem = divmod(st.length, Lb)

    def fetch(blk):
      rows = pl.ds(blk * Lb, Lb)
      return (L.u_of(st, u_ref[rows, :]), gds_ref[rows, :], b_ref[rows], n_ref[rows], r_ref[rows] if st.has_r else None,
              tb_ref[blk, :, :], wb_ref[blk, :], gm_ref[blk, :, :] if st.has_r else None)

    def block(blk, x, carry):
      u, g, b, n, r, tb, wb, gm = x
      serial = lambda: sequential_tokens(st, load, step, blk * Lb, Lb, bt, carry, reverse=True)

      def chain():                        # λ only; `_blocks_kernel` forms the block's gradients from λ_L
        lam_ref[blk, :] = carry[0]
        return block_chain(st, u, g, b, n, r, carry[0], tb, wb, gm), carry[1]
      return chain() if chain_only else lax.cond(ok_ref[blk] != 0, chain, serial)

    carry = sequential_tokens(st, load, step, nb * Lb, rem, bt, (lam0, jnp.zeros_like(lam0)), reverse=True)
    lam, acc_o = block_loop(nb, fetch, block, carry, prefetch=chain_only, reverse=True)
  else:
    lam, acc_o = sequential(st, load, step, (lam0, jnp.zeros_like(lam0)), True, bt)
  if not packed:
    dd1_ref[...] = lam
  if st.has_o:
    do_ref[...] = acc_o


def _across_kernel(st, *refs):
  """Over chain spans, every block flagged, grid (B, G): the T mod L tokens after the last block token by
  token (their gradients and ∂o), then λ at the end of every span ([NS, K]) from λ after the last block,
  one span's map (`spans.maps`) per step in reverse."""
  (u_ref, b_ref, n_ref, r_ref, o_ref, ds_ref, gds_ref, gl_ref, mm_ref, mv_ref,
   du_ref, db_ref, dn_ref, dr_ref, do_ref, lam_ref) = split_refs(
       refs, 1, 1, 1, st.has_r, st.has_o, 1, 1, 1, 1, 1, 1, 1, 1, st.has_r, st.has_o, 1)
  load, step = _token_fns(st, u_ref, b_ref, n_ref, r_ref, None, o_ref[...] if st.has_o else None, ds_ref,
                          gds_ref, gl_ref, du_ref, db_ref, dn_ref, dr_ref, None)
  nb, rem = divmod(st.length, st.solve_t)
  lam = gl_ref[...].astype(F32)
  lam, acc_o = sequential_tokens(st, load, step, nb * st.solve_t, rem, st.config.block_t_bwd,
                                 (lam, jnp.zeros_like(lam)), reverse=True)
  if st.has_o:
    do_ref[...] = acc_o

  def span(j, x, lam):                 # λ at the end of span j → at its start, the end of span j − 1
    A, a = x
    lam_ref[j, :] = lam
    return jnp.sum(A * lam[None, :], axis=1) + a
  lam = block_loop(st.chain_spans, lambda j: (mm_ref[j - 1, :, :], mv_ref[j - 1, :]), span, lam,
                   prefetch=True, reverse=True, start=1)
  lam_ref[0, :] = lam


def _span_kernel(st, *refs):
  """Over chain spans, every block flagged, grid (B, G, NS): program j runs the blocks of span j in
  reverse from λ at its end (`_across_kernel`) and stores λ at the end of each block, as `_kernel` does;
  span 0's program stores ∂d_1."""
  u_ref, b_ref, n_ref, r_ref, gds_ref, tb_ref, wb_ref, gm_ref, ls_ref, dd1_ref, lam_ref = split_refs(
      refs, 1, 1, 1, st.has_r, 1, 1, 1, st.has_r, 1, 1, 1)
  Lb, per, nb = st.solve_t, st.config.spans, st.num_blocks
  j = pl.program_id(2)

  def fetch(blk):
    rows = pl.ds(blk * Lb, Lb)
    return (L.u_of(st, u_ref[rows, :]), gds_ref[rows, :], b_ref[rows], n_ref[rows], r_ref[rows] if st.has_r else None,
            tb_ref[blk, :, :], wb_ref[blk, :], gm_ref[blk, :, :] if st.has_r else None)

  def block(blk, x, lam):
    lam_ref[blk, :] = lam
    return block_chain(st, *x[:5], lam, *x[5:])

  lam = block_loop(nb, fetch, block, ls_ref[...], prefetch=True, reverse=True, start=j * per,
                   stop=jnp.minimum(j * per + per, nb))

  @pl.when(j == 0)
  def _():
    dd1_ref[...] = lam


def _spanned(st, u, n, beta, r, o, ds, g_ds, g_last, tabs):
  """`_kernel`'s outputs with every block flagged (du, dβ, dn[, dr], ∂d_1[, ∂o], λ at the end of every block),
  over chain spans: the spans' maps (`spans.maps`), the tail and the pass across spans
  (`_across_kernel`), then the blocks per span (`_span_kernel`). The rows of du, dβ, dn, dr are only the
  tail's; `_blocks` writes every block's."""
  b, t, g, k = st.batch, st.length, st.heads, st.key_dim
  ns, nb = st.chain_spans, st.num_blocks
  mm, mv = spans.maps(st, True, u, n, beta, r, g_ds, tabs)
  mm_spec, mv_spec, vec_spec = spans.across_specs(st)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, F32)
  rs = [L.scalars(st)] if st.has_r else []
  grads = list(pallas_call(
      functools.partial(_across_kernel, st), grid=(b, g),
      in_specs=[L.rows(st), L.scalars(st), L.scalars(st)] + rs + ([L.param_vec(st)] if st.has_o else []) +
      [L.rows(st), L.rows(st), L.head_vec(st), mm_spec, mv_spec],
      out_specs=[L.rows(st), L.scalars(st), L.scalars(st)] + rs + ([L.batch_vec(st)] if st.has_o else []) +
      [vec_spec],
      out_shape=[f32(b, t, g, k), f32(b, t, g), f32(b, t, g)] + ([f32(b, t, g)] if st.has_r else []) +
      ([f32(b, g, k)] if st.has_o else []) + [f32(b, ns, g, k)],
      interpret=st.interpret, num_warps=st.config.warps_spans, num_stages=1, name="osdn_d_pass_bwd_across")(
          *([u, beta, n] + ([r] if st.has_r else []) + ([o] if st.has_o else []) + [ds, g_ds, g_last, mm, mv])))
  lam_spans = grads.pop()
  over = lambda specs: [L.over_spans(s) for s in specs]
  dd1, lam_blocks = pallas_call(
      functools.partial(_span_kernel, st), grid=(b, g, ns),
      in_specs=over([L.rows(st), L.scalars(st), L.scalars(st)] + rs + [L.rows(st)] + L.table_specs(st)) +
      [L.span_specs(st)["vec"]],
      out_specs=over([L.head_vec(st), L.per_block(st, k)]), out_shape=[f32(b, g, k), f32(b, nb, g, k)],
      interpret=st.interpret, num_warps=st.warps, num_stages=1, name="osdn_d_pass_bwd_chain")(
          *([u, beta, n] + ([r] if st.has_r else []) + [g_ds] + list(tabs) + [lam_spans]))
  n_rows = 3 + st.has_r
  return grads[:n_rows] + [dd1] + grads[n_rows:] + [lam_blocks]


def _token_fns(st, u_ref, b_ref, n_ref, r_ref, c_ref, o, ds_ref, gds_ref, gl_ref, du_ref, db_ref, dn_ref, dr_ref,
               dd1_ref):
  """(load, step) of the token-by-token adjoint: step writes token t's gradients and carries (λ, ∂o); packed
  (c_ref not None), λ restarts from the segment's d_{T+1} cotangent at a last token and a first token stores
  ∂d1[segment]."""
  packed = c_ref is not None

  def load(t):
    code = L.decode(c_ref[t]) if packed else None
    g_last = gl_ref[code[0], :] if packed else None
    return (L.u_of(st, u_ref[t, :]), ds_ref[t, :], gds_ref[t, :], b_ref[t], n_ref[t], r_ref[t] if st.has_r else None,
            code, g_last)

  def step(t, x, carry):
    lam, acc_o = carry
    u, d, g_d, b, n, r, code, g_last = x
    if packed:                            # d_{t+1} of a segment's last token is that segment's d_{T+1}
      seg, first, last = code
      lam = jnp.where(last, g_last, lam)
    d_bar, coef, s = pre_clip(st, d, u, b, n, r, o)
    m = om.clip_grad(d_bar, st.d_min, st.d_max)
    mu = lam if m is None else m * lam
    p = jnp.sum(u * mu)
    c = om.erase_coef(st.eta, b, n)
    du_ref[t, :] = coef * mu - (c * p) * d
    db_ref[t], dn_ref[t] = om.step_coef_grads(st.eta, b, n, s, coef, p)
    if st.has_r:
      dr_ref[t] = jnp.sum((d - o) * mu) if st.has_o else jnp.sum(d * mu)
      lam_prev = r * mu - (c * p) * u
    else:
      lam_prev = mu - (c * p) * u
    if st.has_o:
      acc_o = acc_o + (1.0 - r) * mu
    lam_prev = lam_prev + g_d
    if packed:
      @pl.when(first)
      def _():                            # d of a segment's first token is its d1
        dd1_ref[seg, :] = lam_prev
    return lam_prev, acc_o
  return load, step


def backward(st, u, n, beta, r, codes, o, ds, smooth, saved, g_ds, g_last):
  """smooth [B, NB, G] int32 (blocked only, else None): the forward's per-block flag, 1 where the clip's
  derivative is 1 throughout the block; those blocks run as a λ chain here. saved: the forward's (saved, Γ)
  (`forward.forward`). Returns the cotangents of (u, n, β, r, d1, d_init)."""
  packed, blocked = st.segments > 0, st.blocked
  tabs = []
  if blocked:
    tb, wb, gamma = tables.backward(st, u, n, beta, r, g_ds, *saved)
    tabs = [tb, wb] + ([gamma] if st.has_r else [])
  args = [u, beta, n] + ([r] if st.has_r else []) + ([codes] if packed else []) + \
      ([o] if st.has_o else []) + [ds, g_ds, g_last] + tabs + ([smooth] if blocked else [])
  in_specs = [L.rows(st), L.scalars(st), L.scalars(st)] + ([L.scalars(st)] if st.has_r else []) + \
      ([L.codes(st)] if packed else []) + ([L.param_vec(st)] if st.has_o else []) + \
      [L.rows(st), L.rows(st), L.head_vec(st)] + (L.table_specs(st) if tabs else []) + \
      ([L.per_block(st)] if blocked else [])
  b, t, g, k = st.batch, st.length, st.heads, st.key_dim
  nb = st.num_blocks if blocked else 0
  rows, scal, vec = (jax.ShapeDtypeStruct(s, F32) for s in ((b, t, g, k), (b, t, g), (st.segments or b, g, k)))
  # dO per (batch, head) program: [B, G, K] even when packed (summed over B below).
  out_specs = [L.rows(st), L.scalars(st), L.scalars(st)] + ([L.scalars(st)] if st.has_r else []) + \
      [L.head_vec(st)] + ([L.batch_vec(st)] if st.has_o else []) + ([L.per_block(st, k)] if blocked else [])
  out_shape = [rows, scal, scal] + ([scal] if st.has_r else []) + [vec] + \
      ([jax.ShapeDtypeStruct((b, g, k), F32)] if st.has_o else []) + \
      ([jax.ShapeDtypeStruct((b, nb, g, k), F32)] if blocked else [])
  call = lambda chain_only: list(pallas_call(
      functools.partial(_kernel, st, chain_only), grid=(b, g), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, interpret=st.interpret, num_warps=st.warps, num_stages=1,
      name="osdn_d_pass_bwd_chain" if chain_only else "osdn_d_pass_bwd")(*args))
  if blocked and st.config.chain:
    if st.chain_spans:
      fast = lambda: _spanned(st, u, n, beta, r, o, ds, g_ds, g_last, tabs)
    else:
      fast = lambda: call(True)
    outs = lax.cond(jnp.all(smooth != 0), fast, lambda: call(False))
  else:
    outs = call(False)
  du, dbeta, dn = outs[:3]
  dr = outs[3] if st.has_r else None
  dd1 = outs[3 + st.has_r]
  do = outs[4 + st.has_r] if st.has_o else None
  if blocked:
    du, dbeta, dn, dr, do_blocks = _blocks(st, u, n, beta, r, o, ds, g_ds, tabs, outs[-1], smooth,
                                           (du, dbeta, dn, dr))
    if st.has_o:
      do = do + jnp.sum(do_blocks, axis=1)
  return du, dn, dbeta, dr, dd1, None if do is None else jnp.sum(do, axis=0)


def _blocks_kernel(st, *refs):
  (u_ref, ds_ref, g_ref, b_ref, n_ref, r_ref, o_ref, tb_ref, wb_ref, gm_ref, lam_ref, ok_ref,
   _du, _db, _dn, _dr, du_ref, db_ref, dn_ref, dr_ref, do_ref) = split_refs(
       refs, 1, 1, 1, 1, 1, st.has_r, st.has_o, 1, 1, st.has_r, 1, 1,
       1, 1, 1, st.has_r, 1, 1, 1, st.has_r, st.has_o)
  ok = ok_ref[pl.program_id(2)] != 0
  du, db, dn, dr, d_o, _, _ = block_adjoint(
      st, L.u_of(st, u_ref[...]), ds_ref[...], g_ref[...], b_ref[...], n_ref[...], r_ref[...] if st.has_r else None,
      o_ref[...] if st.has_o else None, lam_ref[...], tb_ref[...], wb_ref[...],
      gm_ref[...] if st.has_r else None)

  @pl.when(ok)
  def _():
    du_ref[...] = du
    db_ref[...] = db
    dn_ref[...] = dn
    if st.has_r:
      dr_ref[...] = dr
  if st.has_o:
    do_ref[...] = jnp.where(ok, d_o, 0.0)


def _blocks(st, u, n, beta, r, o, ds, g_ds, tabs, lam_blocks, ok, grads):
  """The per-token gradients of every block that `_kernel` ran as a chain (ok), in parallel, grid (B, G, NB),
  from each block's λ_L; the other rows of du, dβ, dn, dr are the sequential kernel's (the four arrays are
  updated in place). Returns (du, dβ, dn, dr, per-block ∂d_init [B, NB, G, K] or None)."""
  b, g, k = st.batch, st.heads, st.key_dim
  nb = st.num_blocks
  spec = L.block_specs(st)
  rows, scal, square, vec_l, vec_k = (spec[x] for x in ("rows", "scal", "square", "vec", "vec_k"))
  du, dbeta, dn, dr = grads
  has = lambda x: x is not None
  args = [u, ds, g_ds, beta, n] + ([r] if st.has_r else []) + ([o] if st.has_o else []) + list(tabs) + \
      [lam_blocks, ok] + [x for x in (du, dbeta, dn, dr) if has(x)]
  in_specs = [rows, rows, rows, scal, scal] + ([scal] if st.has_r else []) + \
      ([spec["param"]] if st.has_o else []) + [square, vec_l] + ([square] if st.has_r else []) + \
      [vec_k, spec["flags"]] + [rows, scal, scal] + ([scal] if st.has_r else [])
  n_grads = 3 + st.has_r
  first = len(args) - n_grads
  out_specs = [rows, scal, scal] + ([scal] if st.has_r else []) + ([vec_k] if st.has_o else [])
  out_shape = [jax.ShapeDtypeStruct(x.shape, F32) for x in (du, dbeta, dn, dr) if has(x)] + \
      ([jax.ShapeDtypeStruct((b, nb, g, k), F32)] if st.has_o else [])
  outs = list(pallas_call(
      functools.partial(_blocks_kernel, st), grid=(b, g, nb), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, interpret=st.interpret, num_warps=st.config.warps_solve, num_stages=1,
      name="osdn_d_pass_bwd_blocks", input_output_aliases={first + i: i for i in range(n_grads)})(*args))
  du, dbeta, dn = outs[:3]
  dr = outs[3] if st.has_r else None
  return du, dbeta, dn, dr, (outs[-1] if st.has_o else None)
