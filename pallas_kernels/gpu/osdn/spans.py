"""The d-pass chains over spans of S = `Config.spans` blocks: the forward's d and the backward's λ at
the spans' ends, so that the chains (`forward._chain_kernel`, `backward._span_kernel`) run the NS spans
of a (batch, head) in parallel, grid (B, G, NS).

Without the clip, block i maps δ = d − o affinely, δ_out = M_i δ_in + m_i (`blocks.block_map`; o = d_init for
anchor "init", else 0), and where the clip's derivative is 1 throughout, λ too: λ_0 = A_i λ_L + a_i
(`blocks.block_chain`, `blocks.block_map_adjoint`). Forward, two launches before the chain:
  1. `osdn_d_pass_fwd_maps`, grid (B, G, NS − 1): one program per span composes its S blocks' maps into a
     dense M_span [K, K] and m_span [K] (from I and 0: M ← M_i M, m ← M_i m + m_i). The last span (the ragged
     one, NB − (NS − 1)·S blocks) needs no map.
  2. `osdn_d_pass_fwd_across`, grid (B, G): d ← o + M_span (d − o) + m_span over the spans from d_1, storing
     the d entering each: NS − 1 matrix-vector products, the spans' maps loaded one step early.
The chain then runs each span's blocks from the d entering it, so the serial depth is NS − 1 + S steps
instead of NB. As for the whole chain, the expansion checks every block from the d stored for it, and the
sequential kernel restarts at each (batch, head)'s first failed block: the maps hold up to there, where no
clip has acted yet. The backward, where every block is flagged (`backward._spanned`), likewise:
`osdn_d_pass_bwd_maps` composes spans 1 … NS − 1 in reverse (A ← A_i A; span 0 needs no map),
`osdn_d_pass_bwd_across` runs the tail token by token and then λ across the spans, and the chain each
span from λ at its end. Packed inputs do not run block solves, so this form never applies to them
(`layout.Static.chain_spans`).

Shapes: u, g (∂ds) [B, T, G, K], n, beta, r [B, T, G], d1 [B, G, K], o [G, K], tables [B, NB, G, L, L] and
[B, NB, G, L]; maps [B, NS − 1, G, K, K] and [B, NS − 1, G, K]; d or λ per span [B, NS, G, K]. fp32 (the
maps' dots as the kernels' other fp32 dots: TF32×3 compiled, IEEE in interpret mode).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gpu.chunk_math import iota
from pallas_kernels.gpu.common import SQUEEZED as _SQ
from pallas_kernels.gpu.common import pallas_call, split_refs
from pallas_kernels.gpu.osdn import layout as L
from pallas_kernels.gpu.osdn.blocks import block_map, block_map_adjoint
from pallas_kernels.gpu.osdn.loops import F32, block_loop


def _maps_kernel(st, backward: bool, *refs):
  """One span's composed map (M [K, K], m [K]) over its blocks: the forward's in δ = d − o, over the S blocks
  of span j = program_id(2); the backward's (λ at the span's start from λ at its end), over the blocks of
  span j = program_id(2) + 1 in reverse (the last span's NB − (NS − 1)·S among them)."""
  u_ref, b_ref, n_ref, r_ref, g_ref, t_ref, w_ref, gm_ref, mm_ref, mv_ref = split_refs(
      refs, 1, 1, 1, st.has_r, backward, 1, 1, backward and st.has_r, 1, 1)
  Lb, per, k, nb = st.solve_t, st.config.spans, st.key_dim, st.num_blocks
  first = (pl.program_id(2) + backward) * per

  def fetch(i):
    rows = pl.ds(i * Lb, Lb)
    return (L.u_of(st, u_ref[rows, :]), g_ref[rows, :] if backward else None, b_ref[rows], n_ref[rows],
            r_ref[rows] if st.has_r else None, t_ref[i, :, :], w_ref[i, :],
            gm_ref[i, :, :] if backward and st.has_r else None)

  def block(i, x, c):
    u, g, b, n, r, t, w, gm = x
    if backward:
      return block_map_adjoint(st, u, g, b, n, r, t, w, gm, *c)
    return block_map(st, u, b, n, r, t, w, *c)

  eye = jnp.where(iota((k, k), 0) == iota((k, k), 1), 1.0, 0.0).astype(F32)
  stop = jnp.minimum(first + per, nb) if backward else first + per
  M, m = block_loop(nb, fetch, block, (eye, jnp.zeros((k,), F32)), prefetch=False, reverse=backward,
                    start=first, stop=stop)
  mm_ref[...] = M
  mv_ref[...] = m


def maps(st, backward: bool, u, n, beta, r, g, tabs):
  """The spans' composed maps ([B, NS − 1, G, K, K], [B, NS − 1, G, K]): the forward's of spans
  0 … NS − 2 (tabs = (tf, wf)), the backward's of spans 1 … NS − 1 (g = ∂ds, tabs = (tb, wb[, Γ]))."""
  b, g_, k = st.batch, st.heads, st.key_dim
  ns = st.chain_spans
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, F32)
  seg = L.span_specs(st)
  in_specs = [L.rows(st), L.scalars(st), L.scalars(st)] + ([L.scalars(st)] if st.has_r else []) + \
      ([L.rows(st)] if backward else []) + L.table_specs(st)[:2 + (backward and st.has_r)]
  args = [u, beta, n] + ([r] if st.has_r else []) + ([g] if backward else []) + list(tabs)
  return pallas_call(
      functools.partial(_maps_kernel, st, backward), grid=(b, g_, ns - 1),
      in_specs=[L.over_spans(s) for s in in_specs], out_specs=[seg["square"], seg["vec"]],
      out_shape=[f32(b, ns - 1, g_, k, k), f32(b, ns - 1, g_, k)], interpret=st.interpret,
      num_warps=st.config.warps_spans, num_stages=1,
      name="osdn_d_pass_bwd_maps" if backward else "osdn_d_pass_fwd_maps")(*args)


def across_specs(st):
  """BlockSpecs of the grid (b, g) for the spans' maps ([B, NS − 1, G, K, K] → [NS − 1, K, K] and
  [B, NS − 1, G, K] → [NS − 1, K]) and a vector per span ([B, NS, G, K] → [NS, K])."""
  ns, k = st.chain_spans, st.key_dim
  whole = lambda *shape: pl.BlockSpec((_SQ,) + shape[:1] + (_SQ,) + shape[1:],
                                      lambda b, g: (b, 0, g) + (0,) * (len(shape) - 1))
  return whole(ns - 1, k, k), whole(ns - 1, k), whole(ns, k)


def _across_kernel(st, *refs):
  """The d entering every span ([NS, K]) from d_1, one span's map per step."""
  d1_ref, o_ref, mm_ref, mv_ref, ds_ref = split_refs(refs, 1, st.has_o, 1, 1, 1)
  ns = st.chain_spans
  o = o_ref[...] if st.has_o else None

  def step(j, x, d):
    M, m = x
    ds_ref[j, :] = d
    out = jnp.sum(M * (d if o is None else d - o)[None, :], axis=1) + m
    return out if o is None else o + out

  d = block_loop(ns - 1, lambda j: (mm_ref[j, :, :], mv_ref[j, :]), step, d1_ref[...].astype(F32), prefetch=True)
  ds_ref[ns - 1, :] = d


def entering(st, u, n, beta, r, d1, o, tf, wf):
  """[B, NS, G, K]: the d entering each chain span by the unclipped block recurrence (NS =
  `st.chain_spans` ≥ 2; the maps' kernel, then the pass across spans)."""
  b, g, k = st.batch, st.heads, st.key_dim
  mm_spec, mv_spec, out_spec = across_specs(st)
  return pallas_call(
      functools.partial(_across_kernel, st), grid=(b, g),
      in_specs=[L.head_vec(st)] + ([L.param_vec(st)] if st.has_o else []) + [mm_spec, mv_spec],
      out_specs=out_spec, out_shape=jax.ShapeDtypeStruct((b, st.chain_spans, g, k), F32),
      interpret=st.interpret, num_warps=st.config.warps_spans, num_stages=1, name="osdn_d_pass_fwd_across")(
          *([d1] + ([o] if st.has_o else []) + list(maps(st, False, u, n, beta, r, None, (tf, wf)))))
