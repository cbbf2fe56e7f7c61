"""`state_fwd`: the sequential state pass, grid (B, HV, V/BV); packed (N lanes, HV, V/BV).

A `fori_loop` over chunks with the fp32 state S [K, BV] in registers:
    V_new = U − W S,    S ← e^{G_C} ⊙ S + (K̃ ⊙ e^{G_C − G})ᵀ V_new
It stores the state entering every chunk (S_in), V_new and the final state. With `State.fuse_inter` it stores
the inter-chunk output (Q ⊙ e^G) S_in [B, T, HV, V] fp32 instead of S_in. Packed: a segment's first chunk starts
from its own initial state and its last chunk leaves its final state (`layout.chunk_info`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gpu.chunk_math import F32, dot, row_scale
from pallas_kernels.gpu.common import pallas_call, split_refs
from pallas_kernels.gpu.delta_rule import factors
from pallas_kernels.gpu.delta_rule import layout as L
from pallas_kernels.gpu.intra import load


def _kernel(st, *refs, inter=False, ends=False):
  """ends: g_ref holds G_C per chunk [NC, K] (`scores`' tiles), not G."""
  has_g, packed = st.decay != "none", st.segments > 0
  w_ref, u_ref, kw_ref, g_ref, q_ref, info_ref, s0_ref, vn_ref, sin_ref, st_ref = split_refs(
      refs, 1, 1, 1, has_g, inter, packed, 1, 1, 1, 1)
  c_len, kd = st.chunk, st.key_dim
  ends_only = st.predecay and not inter         # (K̃ pre-decayed: the chunk's last row of G is all it needs)

  def body(c, S):
    t0 = pl.multiple_of(c * c_len, c_len)
    tokens = pl.ds(t0, c_len)
    if packed:                                   # a segment's first chunk starts from its initial state
      seg, first, last = L.decode_chunk_info(info_ref[c])
      row = pl.ds(pl.multiple_of(seg * kd, kd), kd)
      S = jnp.where(first, s0_ref[row, :].astype(F32), S)
    ws = dot(w_ref[tokens, :], st.lo(S))
    vn = u_ref[tokens, :].astype(F32) - ws
    G = factors.chunk_rows(st, g_ref, t0) if has_g and not ends_only else None
    if inter:                                    # the output kernel's (Q⊙e^G) S_in, off the chain of S
      if st.decay == "channel":
        qs = row_scale(q_ref[tokens, :].astype(F32), factors.rows(G))
        sin_ref[tokens, :] = dot(st.lo(qs), st.lo(S))
      else:
        sin_ref[tokens, :] = row_scale(dot(q_ref[tokens, :], st.lo(S)), factors.rows(G))
    else:
      sin_ref[pl.ds(pl.multiple_of(c * kd, kd), kd), :] = S.astype(sin_ref.dtype)
    vn_ref[tokens, :] = vn.astype(vn_ref.dtype)
    kw, vs = kw_ref[tokens, :], vn               # K̃ straight from its load into the dot unless per channel
    if ends_only:                                # (predecay: kw_ref holds K̃ ⊙ e^{G_C − G} already)
      S = S * jnp.exp(load(g_ref, c if ends else t0 + c_len - 1))[:, None]
    elif has_g:
      to_end, gamma = factors.to_end(st, G)
      if st.decay == "scalar":                   # e^{G_C − G} on the rows of V_new, not of K̃
        vs = row_scale(vn, to_end)
      elif not st.predecay:                      # (predecay with inter: kw_ref holds K̃ ⊙ e^{G_C − G} already)
        kw = row_scale(kw.astype(F32), to_end)
      S = S * gamma
    new = S + dot(st.lo(kw), st.lo(vs), ta=True)
    if packed:
      @pl.when(last)
      def _():                                   # a segment's last chunk leaves its final state
        st_ref[row, :] = new
    return new

  if packed:
    lax.fori_loop(*L.lane_bounds(st, info_ref), body, jnp.zeros((kd, s0_ref.shape[-1]), F32))
  else:
    st_ref[:, :] = lax.fori_loop(0, st.num_chunks, body, s0_ref[:, :].astype(F32))


def key_spec(st: L.Static, w, head):
  """A state pass's whole-sequence K̃ or Q: token-major [B, T, heads, K] (value head → `head`), or with
  `Static.predecay` the head-major decayed tile [B, HV, T, K] of `decayed_tiles`."""
  if st.predecay:
    return L.head_major(st, st.key_dim, w, whole=True)
  return L.tokens(st, st.key_dim, w, head, whole=True)


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
  return launch(st, functools.partial(_kernel, inter=inter, ends=ends), in_specs, args, info, S0,
                "delta_rule_state_fwd", inter=inter)


def launch(st, body, in_specs, args, info, state, name, inter=False):
  """Runs a sequential state pass (forward or reverse) over `layout.state_pass_grid`; the inputs given, then
  the packed chunk info (when st.segments) and the state (S0 or dS_T); outputs `layout.state_pass_outputs`."""
  bv = st.state_block_v
  grid, w = L.state_pass_grid(st)
  if st.segments:
    in_specs, args = in_specs + [L.chunk_info(st)], args + [info]
  out_specs, out_shape = L.state_pass_outputs(st, bv, w, inter)
  return pallas_call(lambda *refs: body(st, *refs), grid=grid,
                     in_specs=in_specs + [L.state(st, bv, w)], out_specs=out_specs, out_shape=out_shape,
                     interpret=st.interpret, num_warps=st.config.state.warps, num_stages=st.state_stages,
                     fp32_dots=st.fp32_dots, name=name)(*args, state)


def predecayed(st: L.Static) -> L.Static:
  """st with `predecay` on: the state pass then reads pre-decayed K̃ tiles (here `scores`')."""
  return dataclasses.replace(st, config=st.config.override(state__predecay=True))
