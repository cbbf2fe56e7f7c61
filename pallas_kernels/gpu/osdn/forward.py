"""The d-pass forward kernel, grid (B, G): one program per (batch, head) carries d [K] in registers through the
whole sequence, token by token (`loops.sequential`) or a block of `solve_t` tokens per step where the clip does
not act (`blocks.block_solve`, with the block's loads issued during the previous block). It stores the d_t each
token writes with, d_{T+1}, and per block a flag for the split backward: 1 where the clip's derivative is 1
throughout the block. Packed: per-token codes restart d from d1[segment] at a segment's first token and store
its d_{T+1} at its last.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gpu.common import pallas_call, split_refs
from pallas_kernels.gpu.osdn import layout as L
from pallas_kernels.gpu.osdn import tables
from pallas_kernels.gpu.osdn.blocks import block_solve
from pallas_kernels.gpu.osdn.loops import F32, block_loop, clip, pre_clip, sequential, sequential_tokens


def _kernel(st, *refs):
  packed, blocked = st.segments > 0, st.blocked
  u_ref, b_ref, n_ref, r_ref, c_ref, d1_ref, o_ref, tf_ref, wf_ref, gm_ref, ds_ref, dl_ref, sm_ref = split_refs(
      refs, 1, 1, 1, st.has_r, packed, 1, st.has_o, blocked, blocked, blocked and st.has_r, 1, 1, blocked)
  o = o_ref[...] if st.has_o else None

  def load(t):
    code = L.decode(c_ref[t]) if packed else None
    d1 = d1_ref[code[0], :] if packed else None
    return u_ref[t, :], b_ref[t], n_ref[t], r_ref[t] if st.has_r else None, code, d1

  def step(t, x, d):
    u, b, n, r, code, d1 = x
    if packed:                            # a segment's first token starts from its own d1
      seg, first, last = code
      d = jnp.where(first, d1, d)
    d_bar, _, _ = pre_clip(st, d, u, b, n, r, o)
    ds_ref[t, :] = d
    d_next = clip(st, d_bar)
    if packed:
      @pl.when(last)
      def _():                            # a segment's last token leaves its d_{T+1}
        dl_ref[seg, :] = d_next
    return d_next

  bt = st.config.block_t
  d1 = None if packed else d1_ref[...].astype(F32)
  if packed:
    sequential(st, load, step, jnp.zeros((st.key_dim,), F32), False, bt)
  elif blocked:
    Lb = st.solve_t
    nb, rem = divmod(st.length, Lb)

    def fetch(i):
      rows = pl.ds(i * Lb, Lb)
      return (u_ref[rows, :], b_ref[rows], n_ref[rows], r_ref[rows] if st.has_r else None, tf_ref[i, :, :],
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

    d = block_loop(nb, fetch, block, d1, prefetch=True)
    dl_ref[...] = sequential_tokens(st, load, step, nb * Lb, rem, bt, d)
  else:
    dl_ref[...] = sequential(st, load, step, d1, False, bt)


def forward(st, u, n, beta, r, codes, d1, o, differentiated=False):
  """→ ((saved, Γ) of `tables.forward` for the backward, kernel outputs: ds, d_{T+1}[, per-block flags])."""
  packed = st.segments > 0
  tabs, saved = [], (None, None)
  if st.blocked:
    tf, wf, gamma, shared = tables.forward(st, u, n, beta, r, o, differentiated=differentiated)
    tabs = [tf, wf] + ([gamma] if st.has_r else [])
    saved = (shared, gamma) if shared is not None else saved
  args = [u, beta, n] + ([r] if st.has_r else []) + ([codes] if packed else []) + [d1] + \
      ([o] if st.has_o else []) + tabs
  in_specs = [L.rows(st), L.scalars(st), L.scalars(st)] + ([L.scalars(st)] if st.has_r else []) + \
      ([L.codes(st)] if packed else []) + [L.head_vec(st)] + ([L.param_vec(st)] if st.has_o else []) + \
      (L.table_specs(st) if tabs else [])
  b, t, g, k = st.batch, st.length, st.heads, st.key_dim
  return saved, pallas_call(
      functools.partial(_kernel, st), grid=(b, g), in_specs=in_specs,
      out_specs=[L.rows(st), L.head_vec(st)] + ([L.per_block(st)] if st.blocked else []),
      out_shape=[jax.ShapeDtypeStruct((b, t, g, k), F32),
                 jax.ShapeDtypeStruct((st.segments or b, g, k), F32)] +
      ([jax.ShapeDtypeStruct((b, st.num_blocks, g), jnp.int32)] if st.blocked else []),
      interpret=st.interpret, num_warps=st.warps, num_stages=1, name="osdn_d_pass_fwd")(*args)
