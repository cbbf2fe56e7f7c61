"""The d-pass forward kernels, grid (B, G) for the serial ones: one program per (batch, head) carries d [K] in
registers through the whole sequence.

Unpacked with block solves (`Config.chain`, the default), three launches: the chain (`_chain_kernel`) advances
one block of L = `solve_t` tokens per step and computes only the d entering the next block, which is all the
dependency chain needs (two matrix-vector products and a weighted row sum, see `blocks.block_end`); the
expansion (`_expand_kernel`, grid (B, G, NB)) forms every block's rows d_t from the d entering it, checks that
the clip acts nowhere in the block (`blocks.block_solve`) and sets the backward's per-block flag. Where a
block fails its check, the unclipped chain of that (batch, head) was wrong from that block on: the sequential
kernel (`_kernel` with restart) takes over there, from the d the chain stored for the block, running each
block as a solve or token by token (`lax.cond` per block, with the block's loads issued during the previous
block); its programs without a failed block end at once. Without `Config.chain` the sequential kernel runs
the whole sequence alone. With `Config.spans` (S blocks per span, at least two spans) the chain runs
grid (B, G, NS), each program one span from the d entering it, which `spans.entering` forms from the
spans' composed block maps. The T mod L tokens after the last block run token by token. Packed: per-token
codes restart d from d1[segment] at a segment's first token and store its d_{T+1} at its last (the sequential
kernel, token by token).

Both paths store the d_t each token writes with, d_{T+1}, and per block a flag for the split backward: 1 where
the clip's derivative is 1 throughout the block.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import osdn_math as om
from pallas_kernels.gpu.common import SQUEEZED, pallas_call, split_refs
from pallas_kernels.gpu.osdn import layout as L
from pallas_kernels.gpu.osdn import spans, tables
from pallas_kernels.gpu.osdn.blocks import block_end, block_solve
from pallas_kernels.gpu.osdn.loops import F32, block_loop, pre_clip, sequential, sequential_tokens


def _kernel(st, restart: bool, *refs):
  """restart: after the chain (blocked, unpacked), from each program's first block that failed its check, with
  the d the chain stored for it; ds, d_{T+1} and the flags come in aliased, and a program without such a block
  leaves them as they are."""
  packed, blocked = st.segments > 0, st.blocked
  (u_ref, b_ref, n_ref, r_ref, c_ref, d1_ref, o_ref, tf_ref, wf_ref, gm_ref, start_ref, db_ref, _ds, _dl, _sm,
   ds_ref, dl_ref, sm_ref) = split_refs(
      refs, 1, 1, 1, st.has_r, packed, 1, st.has_o, blocked, blocked, blocked and st.has_r, restart, restart,
      restart, restart, restart, 1, 1, blocked)
  o = o_ref[...] if st.has_o else None
  load, step = _token_fns(st, u_ref, b_ref, n_ref, r_ref, c_ref, d1_ref, o, ds_ref, dl_ref)
  bt = st.config.block_t
  d1 = None if packed else d1_ref[...].astype(F32)
  if packed:
    sequential(st, load, step, jnp.zeros((st.key_dim,), F32), False, bt)
  elif blocked:
    Lb = st.solve_t
    nb, rem = divmod(st.length, Lb)

    def fetch(i):
      rows = pl.ds(i * Lb, Lb)
      return (L.u_of(st, u_ref[rows, :]), b_ref[rows], n_ref[rows], r_ref[rows] if st.has_r else None, tf_ref[i, :, :],
              wf_ref[i, :], gm_ref[i, :, :] if st.has_r else None)

    def block(i, x, d):
      u, b, n, r, tf, wf, gm = x
      D, d_next, ok, smooth = block_solve(st, u, b, n, r, o, d, tf, wf, gm)

      def accept():
        ds_ref[pl.ds(i * Lb, Lb), :] = D
        sm_ref[i] = smooth.astype(jnp.int32)
        return d_next

      def serial():                       # the backward runs such a block token by token too
        sm_ref[i] = jnp.int32(0)
        return sequential_tokens(st, load, step, i * Lb, Lb, bt, d)
      return lax.cond(ok, accept, serial)

    if restart:
      start = jnp.max(start_ref[...])

      @pl.when(start < nb)
      def _():
        d = block_loop(nb, fetch, block, db_ref[start, :], prefetch=True, start=start)
        dl_ref[...] = sequential_tokens(st, load, step, nb * Lb, rem, bt, d)
    else:
      d = block_loop(nb, fetch, block, d1, prefetch=True)
      dl_ref[...] = sequential_tokens(st, load, step, nb * Lb, rem, bt, d)
  else:
    dl_ref[...] = sequential(st, load, step, d1, False, bt)


def _token_fns(st, u_ref, b_ref, n_ref, r_ref, c_ref, d1_ref, o, ds_ref, dl_ref):
  """(load, step) of the token-by-token recurrence: step stores d_t and returns clip(d̄_{t+1}); packed (c_ref
  not None), a segment's first token starts from its d1 and its last stores its d_{T+1}."""
  packed = c_ref is not None

  def load(t):
    code = L.decode(c_ref[t]) if packed else None
    d1 = d1_ref[code[0], :] if packed else None
    return L.u_of(st, u_ref[t, :]), b_ref[t], n_ref[t], r_ref[t] if st.has_r else None, code, d1

  def step(t, x, d):
    u, b, n, r, code, d1 = x
    if packed:                            # a segment's first token starts from its own d1
      seg, first, last = code
      d = jnp.where(first, d1, d)
    ds_ref[t, :] = d
    d_next = om.clip(pre_clip(st, d, u, b, n, r, o)[0], st.d_min, st.d_max)
    if packed:
      @pl.when(last)
      def _():                            # a segment's last token leaves its d_{T+1}
        dl_ref[seg, :] = d_next
    return d_next
  return load, step


def _chain_kernel(st, *refs):
  """The d entering every block ([NB, K]) by the unclipped block recurrence, then the T mod L tokens after the
  last block token by token (their rows of ds, and d_{T+1}). Over chain spans (`st.chain_spans`, grid
  (B, G, NS)): program j runs the blocks of span j from the d entering it (d1_ref, from
  `spans.entering`), and the last span's program the tokens after the last block."""
  u_ref, b_ref, n_ref, r_ref, d1_ref, o_ref, tf_ref, wf_ref, ds_ref, dl_ref, db_ref = split_refs(
      refs, 1, 1, 1, st.has_r, 1, st.has_o, 1, 1, 1, 1, 1)
  o = o_ref[...] if st.has_o else None
  Lb = st.solve_t
  nb, rem = divmod(st.length, Lb)
  ns = st.chain_spans
  start = stop = None
  if ns:
    j = pl.program_id(2)
    start = j * st.config.spans
    stop = jnp.minimum(start + st.config.spans, nb)

  def fetch(i):
    rows = pl.ds(i * Lb, Lb)
    return (L.u_of(st, u_ref[rows, :]), b_ref[rows], n_ref[rows], r_ref[rows] if st.has_r else None, tf_ref[i, :, :],
            wf_ref[i, :])

  def block(i, x, d):
    db_ref[i, :] = d
    return block_end(st, *x, o, d)

  d = block_loop(nb, fetch, block, d1_ref[...].astype(F32), prefetch=True, start=start, stop=stop)
  load, step = _token_fns(st, u_ref, b_ref, n_ref, r_ref, None, None, o, ds_ref, None)
  if not ns:
    dl_ref[...] = sequential_tokens(st, load, step, nb * Lb, rem, st.config.block_t, d)
    return

  @pl.when(j == ns - 1)
  def _():
    dl_ref[...] = sequential_tokens(st, load, step, nb * Lb, rem, st.config.block_t, d)


def _expand_kernel(st, *refs):
  """One block's rows of ds from the d entering it, its check (ok) and the backward's flag (smooth)."""
  u_ref, b_ref, n_ref, r_ref, o_ref, tf_ref, wf_ref, gm_ref, d_ref, _ds, ds_ref, ok_ref, sm_ref = split_refs(
      refs, 1, 1, 1, st.has_r, st.has_o, 1, 1, st.has_r, 1, 1, 1, 1, 1)
  i = pl.program_id(2)
  D, _, ok, smooth = block_solve(
      st, L.u_of(st, u_ref[...]), b_ref[...], n_ref[...], r_ref[...] if st.has_r else None,
      o_ref[...] if st.has_o else None, d_ref[...], tf_ref[...], wf_ref[...], gm_ref[...] if st.has_r else None)
  ds_ref[...] = D
  ok_ref[i] = ok.astype(jnp.int32)
  sm_ref[i] = smooth.astype(jnp.int32)


def _chained(st, u, n, beta, r, d1, o, tabs):
  """(ds, d_{T+1}, flags, ok [B, NB, G] int32, d entering each block [B, NB, G, K]): the chain, then the
  expansion in place into its ds."""
  b, t, g, k = st.batch, st.length, st.heads, st.key_dim
  nb = st.num_blocks
  tf, wf = tabs[:2]
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, F32)
  in_specs = [L.rows(st), L.scalars(st), L.scalars(st)] + ([L.scalars(st)] if st.has_r else []) + \
      [L.head_vec(st)] + ([L.param_vec(st)] if st.has_o else []) + L.table_specs(st)[:2]
  out_specs = [L.rows(st), L.head_vec(st), L.per_block(st, k)]
  ns, grid = st.chain_spans, (b, g)
  if ns:                       # the chain per segment, from the d entering each (`spans.py`)
    d1 = spans.entering(st, u, n, beta, r, d1, o, tf, wf)
    grid = (b, g, ns)
    in_specs, out_specs = [L.over_spans(s) for s in in_specs], [L.over_spans(s) for s in out_specs]
    in_specs[3 + st.has_r] = L.span_specs(st)["vec"]
  ds, d_last, d_blocks = pallas_call(
      functools.partial(_chain_kernel, st), grid=grid, in_specs=in_specs, out_specs=out_specs,
      out_shape=[f32(b, t, g, k), f32(b, g, k), f32(b, nb, g, k)],
      interpret=st.interpret, num_warps=st.warps, num_stages=1, name="osdn_d_pass_fwd_chain")(
          *([u, beta, n] + ([r] if st.has_r else []) + [d1] + ([o] if st.has_o else []) + [tf, wf]))
  spec = L.block_specs(st)
  args = [u, beta, n] + ([r] if st.has_r else []) + ([o] if st.has_o else []) + list(tabs) + [d_blocks, ds]
  in_specs = [spec["rows"], spec["scal"], spec["scal"]] + ([spec["scal"]] if st.has_r else []) + \
      ([spec["param"]] if st.has_o else []) + [spec["square"], spec["vec"]] + \
      ([spec["square"]] if st.has_r else []) + [spec["vec_k"], spec["rows"]]
  flags = jax.ShapeDtypeStruct((b, nb, g), jnp.int32)
  ds, ok, smooth = pallas_call(
      functools.partial(_expand_kernel, st), grid=(b, g, nb), in_specs=in_specs,
      out_specs=[spec["rows"], spec["flags"], spec["flags"]], out_shape=[f32(b, t, g, k), flags, flags],
      interpret=st.interpret, num_warps=st.config.warps_solve, num_stages=1, name="osdn_d_pass_fwd_expand",
      fp32_dots=st.config.dots_expand,
      input_output_aliases={len(args) - 1: 0})(*args)
  return ds, d_last, smooth, ok, d_blocks


def forward(st, u, n, beta, r, codes, d1, o, differentiated=False):
  """→ ((saved, Γ) of `tables.forward` for the backward, kernel outputs: ds, d_{T+1}[, per-block flags])."""
  tabs, saved = [], (None, None)
  if st.blocked:
    tf, wf, gamma, shared = tables.forward(st, u, n, beta, r, o, differentiated=differentiated)
    tabs = [tf, wf] + ([gamma] if st.has_r else [])
    saved = (shared, gamma) if shared is not None else saved
    if st.config.chain:
      ds, d_last, smooth, ok, d_blocks = _chained(st, u, n, beta, r, d1, o, tabs)
      return saved, _sequential(st, u, n, beta, r, codes, d1, o, tabs,
                                restart=(first_failed(ok), d_blocks, ds, d_last, smooth))
  return saved, _sequential(st, u, n, beta, r, codes, d1, o, tabs)


def first_failed(ok):
  """[B, G, 16] int32: per (batch, head) the first block whose check failed (NB: none), repeated on a last axis
  of 16 for the kernel's load."""
  nb = ok.shape[1]
  first = jnp.min(jnp.where(ok == 0, jnp.arange(nb, dtype=jnp.int32)[None, :, None], nb), axis=1)
  return jnp.broadcast_to(first[..., None], first.shape + (16,)).astype(jnp.int32)


def _sequential(st, u, n, beta, r, codes, d1, o, tabs, restart=None):
  """The sequential kernel's outputs: ds, d_{T+1}[, per-block flags]. restart: (first failed blocks, d entering
  each block, ds, d_{T+1}, flags) of the chain and the expansion, which the kernel updates in place from each
  program's first failed block on."""
  packed = st.segments > 0
  args = [u, beta, n] + ([r] if st.has_r else []) + ([codes] if packed else []) + [d1] + \
      ([o] if st.has_o else []) + tabs + list(restart or ())
  in_specs = [L.rows(st), L.scalars(st), L.scalars(st)] + ([L.scalars(st)] if st.has_r else []) + \
      ([L.codes(st)] if packed else []) + [L.head_vec(st)] + ([L.param_vec(st)] if st.has_o else []) + \
      (L.table_specs(st) if tabs else [])
  out_specs = [L.rows(st), L.head_vec(st)] + ([L.per_block(st)] if st.blocked else [])
  if restart:
    in_specs += [pl.BlockSpec((SQUEEZED, SQUEEZED, 16), lambda b, g: (b, g, 0)), L.per_block(st, st.key_dim)]
    in_specs += out_specs
  b, t, g, k = st.batch, st.length, st.heads, st.key_dim
  return pallas_call(
      functools.partial(_kernel, st, restart is not None), grid=(b, g), in_specs=in_specs, out_specs=out_specs,
      out_shape=[jax.ShapeDtypeStruct((b, t, g, k), F32),
                 jax.ShapeDtypeStruct((st.segments or b, g, k), F32)] +
      ([jax.ShapeDtypeStruct((b, st.num_blocks, g), jnp.int32)] if st.blocked else []),
      interpret=st.interpret, num_warps=st.warps, num_stages=1,
      name="osdn_d_pass_fwd_restart" if restart else "osdn_d_pass_fwd",
      input_output_aliases={len(args) - 3 + i: i for i in range(3)} if restart else None)(*args)
