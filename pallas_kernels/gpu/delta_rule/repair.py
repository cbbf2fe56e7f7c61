"""`repair`: the output rows of a fault's chunk before the fault, recomputed token by token. Grid: the state
passes' (B, HV, V/BV), packed (N lanes, HV, V/BV).

A NaN or inf at token t of a sequence reaches the rows of t's chunk before t in the chunk-parallel kernels (a zero
weight times a NaN in the chunk's dots), where the contract (docs/faults.md) keeps them. Each program first reads
its block of the final state S_T [K, BV]: where it is finite, no value entering the state was non-finite and the
program ends there; that read is all the launch costs on finite inputs. Otherwise it looks for the first token t*
whose k, k̃, β, G or v (its V block) is non-finite, takes the state entering t*'s chunk (the stored S_in, or
replayed from S0 through the stored V_new of the earlier chunks where the state pass formed the inter-chunk output
instead) and runs the chunk's tokens before t* through the token-serial recurrence of the contract

    S' = D_j S,   S = S' + β_j k̃_j (v_j − S'ᵀk_j)ᵀ,   o_j = scale · Sᵀq_j

overwriting their rows of o (aliased in and out). The state is held transposed, [BV, K], so that every token is
elementwise products and row sums.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gpu.chunk_math import F32, dot, iota, row_scale
from pallas_kernels.gpu.common import pallas_call, split_refs
from pallas_kernels.gpu.delta_rule import factors
from pallas_kernels.gpu.delta_rule import layout as L


def _bad(x):
  """1 where x is NaN or ±inf, else 0 (int32)."""
  return jnp.where(jnp.abs(x.astype(F32)) < jnp.inf, 0, 1).astype(jnp.int32)


def _rows_bad(x):
  """[C] int32: 1 for the rows of x [C, n] holding a non-finite entry."""
  return jnp.max(_bad(x), axis=1)


def _kernel(st, stored, *refs):
  packed, has_g = st.segments > 0, st.decay != "none"
  q_ref, k_ref, kw_ref, v_ref, b_ref, g_ref, mid_ref, info_ref, s0_ref, st_ref, _, o_ref = split_refs(
      refs, 1, 1, 1, 1, 1, has_g, 1, packed, 1, 1, 1, 1)
  c_len, kd = st.chunk, st.key_dim
  if packed:
    first, end = L.lane_bounds(st, info_ref)
    rows = pl.ds(pl.multiple_of(pl.program_id(0) * kd, kd), kd)
  else:
    first, end = jnp.int32(0), jnp.int32(st.num_chunks)
    rows = pl.ds(0, kd)

  @pl.when(jnp.max(_rows_bad(st_ref[rows, :])) > 0)      # finite S_T: nothing entering the state was bad
  def _():
    def first_bad_row(c):                                    # C where the chunk's state inputs are finite
      tok = pl.ds(pl.multiple_of(c * c_len, c_len), c_len)
      bad = jnp.maximum(jnp.maximum(_rows_bad(k_ref[tok, :]), _rows_bad(kw_ref[tok, :])), _rows_bad(v_ref[tok, :]))
      bad = jnp.maximum(bad, _bad(b_ref[tok]))
      if st.decay == "scalar":
        bad = jnp.maximum(bad, _bad(g_ref[tok]))
      elif has_g:
        bad = jnp.maximum(bad, _rows_bad(g_ref[tok, :]))
      return jnp.min(jnp.where(bad > 0, iota((c_len,), 0), c_len))

    def scan(carry):
      c, _ = carry
      t = first_bad_row(c)
      return jnp.where(t < c_len, c, c + 1), t

    c, t = lax.while_loop(lambda carry: (carry[0] < end) & (carry[1] == c_len), scan, (first, jnp.int32(c_len)))

    @pl.when((t > 0) & (t < c_len))
    def _():
      t0 = c * c_len
      if stored:
        S = mid_ref[pl.ds(pl.multiple_of(c * kd, kd), kd), :].astype(F32)
      else:
        S = lax.fori_loop(first, c, functools.partial(_replay, st, kw_ref, g_ref, mid_ref),
                          s0_ref[rows, :].astype(F32))
      lax.fori_loop(0, t, functools.partial(_token, st, t0, q_ref, k_ref, kw_ref, v_ref, b_ref, g_ref, o_ref), S.T)


def _replay(st, kw_ref, g_ref, vn_ref, c, S):
  """The state pass's step over chunk c from the stored V_new: S ← e^{G_C} S + (K̃ ⊙ e^{G_C − G})ᵀ V_new."""
  t0 = pl.multiple_of(c * st.chunk, st.chunk)
  tok = pl.ds(t0, st.chunk)
  kw, vs = kw_ref[tok, :], vn_ref[tok, :].astype(F32)
  if st.decay != "none":
    to_end, gamma = factors.to_end(st, factors.chunk_rows(st, g_ref, t0))
    if st.decay == "scalar":
      vs = row_scale(vs, to_end)
    else:
      kw = row_scale(kw.astype(F32), to_end)
    S = S * gamma
  return S + dot(st.lo(kw), st.lo(vs), ta=True)


def _token(st, t0, q_ref, k_ref, kw_ref, v_ref, b_ref, g_ref, o_ref, j, ST):
  """One token j of the chunk starting at t0 on the transposed state ST [BV, K]; writes o_j."""
  r = t0 + j
  row = pl.ds(r, 1)
  if st.decay != "none":                 # G is cumulative within the chunk: g_j = G_j − G_{j−1}, g_0 = G_0
    prev = jnp.maximum(r - 1, t0)
    if st.decay == "scalar":
      g = g_ref[r] - jnp.where(j > 0, g_ref[prev], 0.0)
    else:
      g = g_ref[row, :].astype(F32) - jnp.where(j > 0, g_ref[pl.ds(prev, 1), :].astype(F32), 0.0)
    ST = ST * jnp.exp(g)
  k, kw, q = (ref[row, :].astype(F32) for ref in (k_ref, kw_ref, q_ref))
  v = jnp.sum(v_ref[row, :].astype(F32), axis=0)                     # [BV]
  resid = b_ref[r] * (v - jnp.sum(ST * k, axis=1))
  ST = ST + resid[:, None] * kw
  o_ref[row, :] = (st.scale * jnp.sum(ST * q, axis=1))[None, :].astype(o_ref.dtype)
  return ST


def repair(st: L.Static, q, k, kw, v, beta, G, S0, info, mid, S_T, o, *, stored: bool):
  """→ o with the rows of each sequence's first faulty chunk before its fault recomputed (o is aliased: on finite
  inputs nothing is written). mid: the state pass's S_in [B, HV, NC·K, V] when stored, else its V_new
  [B, HV, T, V]; S0, S_T and info as `state_fwd.state_pass`; the other inputs as the forward kernels take
  them."""
  bv = st.state_block_v
  grid, w = L.state_pass_grid(st)
  key = L.tokens(st, st.key_dim, w, st.key_head, whole=True)
  in_specs = [key, key, L.tokens(st, st.key_dim, w, st.kw_head, whole=True),
              L.tokens(st, bv, w, whole=True, split=True), L.vector(st, w, whole=True)]
  args = [q, k, kw, v, beta]
  if st.decay != "none":
    in_specs.append(L.decay_spec(st, w, whole=True))
    args.append(G)
  in_specs.append(L.states(st, bv, w, whole=True) if stored else L.head_major(st, bv, w, whole=True, split=True))
  args.append(mid)
  if st.segments:
    in_specs.append(L.chunk_info(st))
    args.append(info)
  o_spec = L.tokens(st, bv, w, whole=True, split=True)
  in_specs += [L.state(st, bv, w), L.state(st, bv, w), o_spec]
  args += [S0, S_T, o]
  return pallas_call(functools.partial(_kernel, st, stored), grid=grid, in_specs=in_specs, out_specs=o_spec,
                     out_shape=jax.ShapeDtypeStruct(o.shape, o.dtype), interpret=st.interpret,
                     num_warps=st.config.repair.warps, num_stages=1, fp32_dots=st.fp32_dots, name="delta_rule_repair",
                     input_output_aliases={len(args) - 1: 0})(*args)
