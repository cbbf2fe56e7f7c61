"""The kernels: the forward and the reverse token loop over chunks, and the token's math shared with XLA.

Layout: u, ds, ∂L/∂ds and μ stay [B, T, G, K]; a block is [C, Hb, K] (C tokens, Hb heads, all K channels), so
token t of a block, `ref[t]`, is one [Hb, K] tile row (one vreg for Hb = 8, K = 128) and d of the block's heads one
[Hb, K] value; no relayout copy is made around the kernels. The per-token scalars a, c, r are head-major
[B, G, Tp] (Tp: T padded to whole chunks, zeros past T), blocks [Hb, C]; token t's column [Hb, 1] is a masked lane
sum (`common.take`). Grid (B, G/Hb, Tp/C): the chunk axis innermost and "arbitrary", d (λ) carried across it in a
VMEM scratch, the others "parallel". Inside a chunk a while_loop over groups of `unroll` tokens; the last chunk
runs only its T − (NC − 1) C tokens (a static count), so rows past T are neither read nor written.

Backward: chunks visited last to first by the index maps, tokens in reverse; d̄_{t+1} recomputed from the saved
d_t by the forward's own code (so the clip's derivative sees the forward's values), then
    μ_t = clip'(d̄_{t+1}) ⊙ λ_{t+1},   λ_t = ∂L/∂ds_t + ρ_t μ_t − c_t ⟨μ_t, u_t⟩ u_t   (ρ_t = 1 or r_t, λ = 0 past T)
with clip' as `jnp.clip` differentiates (1 inside, 0 outside, ½ at a bound). Only μ is stored.

Block form (`Config(form="blocks")`, unpacked): the same grid, refs and carry. Each chunk's ⌊n / L⌋ whole blocks of
L tokens go through a while_loop over blocks (reversed in the backward); per block every head group (8 heads, or
all Hb) is solved at once (`blocks.forward_block` / `backward_block`), and where every group's check passes the
block's rows are stored and the carry moves on to the block's other end; else the token loop above runs the block
(`_fallback`), so a block where the clip acts (or a tie with a bound, or a non-finite value) comes out as the token
form writes it. The n mod L tokens after the last whole block run token by token.

Packed: codes [C'] per chunk in SMEM (C' = C rounded up to 128), the segment at a segment's first token, −1
elsewhere. There the forward copies d1[segment]'s rows of the block's heads from HBM into a VMEM scratch
(`pltpu.sync_copy`; d1 [N, G, K] stays in HBM, so N is unbounded) and restarts from them; the backward zeroes λ
after such a token (the segment's first d does not depend on the previous token).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import osdn_math as om
from pallas_kernels.tpu import common
from pallas_kernels.tpu.common import F32, SQUEEZED as _SQ
from pallas_kernels.tpu.osdn import blocks
from pallas_kernels.tpu.osdn.config import Static


# One token, shared by the kernels ([Hb, K] with [Hb, 1] scalars) and XLA ([..., G, K] with [..., G, 1]).
def pre_clip(st: Static, d, u, a, c, r, o):
  """d̄_{t+1} with coef_t = a_t − c_t s_t (a = α, c: `osdn_math.write_coef`, `erase_coef`, formed in XLA)."""
  s = jnp.sum(d * u, axis=-1, keepdims=True)
  return om.unclipped(d, u, a - c * s, r, o, st.mode)


def _tokens(st: Static, body, carry, start, n: int, reverse: bool):
  """carry ← body(t, carry) over the n tokens start … start + n − 1 (in reverse with `reverse`); n static, start None
  (0) or an int32 (static or traced)."""
  if n == 0:
    return carry
  # A while_loop over groups of `unroll` tokens with an int32 counter (a static-length fori_loop is a scan, whose
  # counter is int64 under x64, which Mosaic rejects); the n mod unroll tokens left run on their own.
  k = min(st.unroll, n)
  groups = n // k
  at = (lambda i: i) if start is None else (lambda i: start + i)
  order = (lambda i: at(np.int32(n - 1) - i)) if reverse else at

  def group(state):
    i, x = state
    for j in range(k):
      x = body(order(i * np.int32(k) + np.int32(j)), x)
    return i + np.int32(1), x
  _, carry = lax.while_loop(lambda state: state[0] < np.int32(groups), group, (np.int32(0), carry))
  for j in range(groups * k, n):
    carry = body(order(np.int32(j)), carry)
  return carry


def _blocks(st: Static, block, carry, count: int, reverse: bool):
  """carry ← block(t0, carry) over the chunk's first `count` blocks of L tokens (t0 = 0, L, …; in reverse with
  `reverse`), a while_loop with an int32 counter."""
  if count == 0:
    return carry
  L = np.int32(st.block_t)
  order = (lambda i: np.int32(count - 1) - i) if reverse else (lambda i: i)

  def step(state):
    i, x = state
    return i + np.int32(1), block(order(i) * L, x)
  return lax.while_loop(lambda state: state[0] < np.int32(count), step, (np.int32(0), carry))[1]


def _token_loop(st: Static, body, carry, reverse: bool, block=None):
  """carry ← body(t, carry) over the chunk's tokens (t = 0 … n − 1, or n − 1 … 0), n = C except in the last chunk
  when T is not a multiple of C (a static count either way). With `block` (the block form), its ⌊n / L⌋ whole
  blocks of L tokens run as block(t0, carry) and only the n mod L tokens after them token by token."""
  last = st.length - (st.num_chunks - 1) * st.chunk

  def run(n):
    count = n // st.block_t if block is not None else 0
    start = np.int32(count * st.block_t) if count else None
    tail = lambda x: _tokens(st, body, x, start, n - count * st.block_t, reverse)
    whole = lambda x: _blocks(st, block, x, count, reverse)
    return whole(tail(carry)) if reverse else tail(whole(carry))
  if last == st.chunk:
    return run(st.chunk)
  chunk = st.num_chunks - 1 - pl.program_id(2) if reverse else pl.program_id(2)
  return lax.cond(chunk == st.num_chunks - 1, lambda: run(last), lambda: run(st.chunk))


def _refs(st: Static, refs, backward: bool):
  it = iter(refs)
  names = ["u"] + (["ds", "g"] if backward else []) + ["a", "c"]
  names += (["r"] if st.mode != "none" else []) + (["o"] if st.mode == "init" else [])
  names += (["codes"] if st.segments else []) + ([] if backward else ["d1"])
  named = {name: next(it) for name in names}
  named["out"], named["carry"] = next(it), next(it)
  named["restart"] = next(it) if st.segments and not backward else None
  return named


def _columns(st: Static, x, t):
  """Token t's a, c, r as [Hb, 1] columns of the chunk's head-major blocks."""
  col = lambda name: common.take(x[name], t, 1)
  return col("a"), col("c"), col("r") if st.mode != "none" else None


def _forward_kernel(st: Static, *refs):
  """u [C, Hb, K]; a, c, [r] [Hb, C]; [o [Hb, K]]; [codes [C] (SMEM)]; d1 [Hb, K] (unpacked) or [N, G, K] (HBM)
  → ds [C, Hb, K]; scratch: d [Hb, K], [restart [Hb, K]]."""
  x = _refs(st, refs, backward=False)
  scalars = {name: x[name][...] for name in ("a", "c", "r") if name in x}
  o = x["o"][...] if st.mode == "init" else None
  h0 = pl.program_id(1) * st.block_h

  @pl.when(pl.program_id(2) == 0)
  def _():
    x["carry"][...] = jnp.zeros(x["carry"].shape, F32) if st.segments else x["d1"][...]

  def body(t, d):
    if st.segments:
      code = x["codes"][t]

      @pl.when(code >= 0)
      def _():
        pltpu.sync_copy(x["d1"].at[code, pl.ds(h0, st.block_h), :], x["restart"])
      d = jnp.where(jnp.full(d.shape, code, jnp.int32) >= 0, x["restart"][...], d)
    x["out"][t] = d
    a, c, r = _columns(st, scalars, t)
    return om.clip(pre_clip(st, d, x["u"][t], a, c, r, o), st.d_min, st.d_max)

  block = functools.partial(_forward_block, st, x, scalars, o, body) if st.form == "blocks" else None
  x["carry"][...] = _token_loop(st, body, x["carry"][...], reverse=False, block=block)


def _backward_kernel(st: Static, *refs):
  """u, ds, ∂L/∂ds [C, Hb, K]; a, c, [r] [Hb, C]; [o [Hb, K]]; [codes [C] (SMEM)] → μ [C, Hb, K]; scratch:
  λ [Hb, K]."""
  x = _refs(st, refs, backward=True)
  scalars = {name: x[name][...] for name in ("a", "c", "r") if name in x}
  o = x["o"][...] if st.mode == "init" else None

  @pl.when(pl.program_id(2) == 0)
  def _():
    x["carry"][...] = jnp.zeros(x["carry"].shape, F32)

  def body(t, lam):
    u = x["u"][t]
    a, c, r = _columns(st, scalars, t)
    m = om.clip_grad(pre_clip(st, x["ds"][t], u, a, c, r, o), st.d_min, st.d_max)
    mu = lam if m is None else m * lam
    x["out"][t] = mu
    p = jnp.sum(mu * u, axis=-1, keepdims=True)
    lam = x["g"][t] + (mu if r is None else r * mu) - (c * p) * u
    if st.segments:      # a segment's first d is d1[segment], not the previous token's output
      lam = jnp.where(jnp.full(lam.shape, x["codes"][t], jnp.int32) >= 0, 0.0, lam)
    return lam

  block = functools.partial(_backward_block, st, x, scalars, o, body) if st.form == "blocks" else None
  x["carry"][...] = _token_loop(st, body, x["carry"][...], reverse=True, block=block)


# The block form: per head group, `blocks.forward_block` / `backward_block`, or the token loop where a check fails.
def _groups(st: Static):
  """(first head, heads) of every head group of the head block: 8 heads where Hb is a multiple of 8, else all Hb."""
  hg = 8 if st.block_h % 8 == 0 else st.block_h
  return [(h, hg) for h in range(0, st.block_h, hg)]


def _rows_at(ref, t0, L: int, h: int, hg: int):
  """ref[t0 : t0 + L, h : h + hg] of a [C, Hb, K] block as [L·hg, K] (row t·hg + h')."""
  rows = ref[pl.ds(t0, L)] if hg == ref.shape[1] else ref[pl.ds(t0, L), pl.ds(h, hg), :]
  return rows.reshape(L * hg, rows.shape[-1])


def _store_rows(ref, t0, L: int, h: int, hg: int, rows):
  rows = rows.reshape(L, hg, rows.shape[-1])
  if hg == ref.shape[1]:
    ref[pl.ds(t0, L)] = rows
  else:
    ref[pl.ds(t0, L), pl.ds(h, hg), :] = rows


def _group_columns(st: Static, scalars, heads: slice, t0):
  """The block's a, c, r (None without a retention) of the heads as [L·hg, 1] columns."""
  col = lambda name: blocks.columns(scalars[name][heads], t0, st.block_t)
  return col("a"), col("c"), col("r") if st.mode != "none" else None


def _block_step(st: Static, solve, store, body, t0, carry, reverse: bool):
  """Tokens t0 … t0 + L − 1 of every head of the block: solve(heads, carry[heads]) → (rows, next carry, bad) per
  head group; where no group is bad, store(h, hg, rows) each and carry on, else the token loop (body) runs the
  block, so a block that clips (or holds a tie or a fault) comes out exactly as the token loop writes it."""
  parts = [(h, hg) + solve(slice(h, h + hg), carry[h:h + hg]) for h, hg in _groups(st)]
  bad = functools.reduce(jnp.maximum, [part[4] for part in parts])

  def accept():
    for h, hg, rows, _, _ in parts:
      store(h, hg, rows)
    return parts[0][3] if len(parts) == 1 else jnp.concatenate([part[3] for part in parts], axis=0)
  return lax.cond(jnp.max(bad) == 0.0, accept, lambda: _fallback(st, body, carry, t0, reverse))


def _fallback(st: Static, body, carry, t0, reverse: bool):
  """A block that failed its check, token by token (the token form's own loop)."""
  return _tokens(st, body, carry, t0, st.block_t, reverse)


def _forward_block(st: Static, x, scalars, o, body, t0, d):
  L = st.block_t

  def solve(heads, d):
    a, c, r = _group_columns(st, scalars, heads, t0)
    u = _rows_at(x["u"], t0, L, heads.start, heads.stop - heads.start)
    return blocks.forward_block(st, u, a, c, r, None if o is None else o[heads], d)
  store = lambda h, hg, rows: _store_rows(x["out"], t0, L, h, hg, rows)
  return _block_step(st, solve, store, body, t0, d, reverse=False)


def _backward_block(st: Static, x, scalars, o, body, t0, lam):
  L = st.block_t

  def solve(heads, lam):
    a, c, r = _group_columns(st, scalars, heads, t0)
    u, ds, g = (_rows_at(x[name], t0, L, heads.start, heads.stop - heads.start) for name in ("u", "ds", "g"))
    return blocks.backward_block(st, u, ds, g, a, c, r, None if o is None else o[heads], lam)
  store = lambda h, hg, rows: _store_rows(x["out"], t0, L, h, hg, rows)
  return _block_step(st, solve, store, body, t0, lam, reverse=True)


def call(st: Static, backward: bool, u, rows, o, codes, d1=None, ds=None, g=None):
  """The pallas_call. u (and ds, g) [B, T, G, K]; rows: a, c, [r] head-major [B, G, Tp]; o None or [G, K]; codes
  None or [B · NC · C'] int32 (C' = C rounded up to 128); d1 [B, G, K] or [N, G, K] (forward) → ds (forward) or
  μ (backward) [B, T, G, K]."""
  b, t, g_, kd = u.shape
  c, hb, nc = st.chunk, st.block_h, st.num_chunks
  at = (lambda j: nc - 1 - j) if backward else (lambda j: j)
  spec = lambda block, index, **kw: pl.BlockSpec(block, lambda *grid: common.block_index(*index(*grid)), **kw)
  tiles = spec((_SQ, c, hb, kd), lambda i, h, j: (i, at(j), h, 0))
  row = spec((_SQ, hb, c), lambda i, h, j: (i, h, at(j)))
  in_specs = [tiles] * (3 if backward else 1) + [row] * len(rows)
  args = [u] + ([ds, g] if backward else []) + list(rows)
  if o is not None:
    in_specs.append(spec((hb, kd), lambda i, h, j: (h, 0)))
    args.append(o)
  if codes is not None:
    lanes = codes.shape[0] // (b * nc)
    in_specs.append(spec((lanes,), lambda i, h, j: (i * nc + at(j),), memory_space=pltpu.SMEM))
    args.append(codes)
  scratch = [pltpu.VMEM((hb, kd), F32)]
  if not backward:
    if codes is None:
      in_specs.append(spec((_SQ, hb, kd), lambda i, h, j: (i, h, 0)))
    else:
      in_specs.append(pl.BlockSpec(memory_space=pltpu.HBM))
      scratch.append(pltpu.VMEM((hb, kd), F32))
    args.append(d1)
  elems = b * st.tp * g_ * kd
  cost = pl.CostEstimate(flops=int(elems * (14 if backward else 8) + _block_flops(st, backward, b)), transcendentals=0,
                         bytes_accessed=int(4 * elems * (4 if backward else 2)))
  kernel = _backward_kernel if backward else _forward_kernel
  return common.pallas_call(
      functools.partial(kernel, st), grid=(b, g_ // hb, nc), in_specs=in_specs, out_specs=tiles,
      out_shape=jax.ShapeDtypeStruct(u.shape, F32), scratch_shapes=scratch,
      dimension_semantics=("parallel", "parallel", "arbitrary"), interpret=st.interpret,
      name="osdn_d_pass_bwd" if backward else "osdn_d_pass_fwd", cost_estimate=cost)(*args)


def _block_flops(st: Static, backward: bool, batch: int) -> int:
  """The block form's dot flops (0 for the token form): per head group and block of N = L·hg rows, the [N, N] × [N, K]
  products (U Uᵀ, W and the rows; the backward's U Gᵀ too) and the [N, N] × [N, N] ones (log2(L) − 1 levels of two
  in the inverse, and Γ's masked sums with a retention)."""
  if st.form != "blocks":
    return 0
  hg = _groups(st)[0][1]
  n = st.block_t * hg
  square = 2 * (int(np.log2(st.block_t)) - 1) + (st.mode != "none")
  per_block = 2 * n * n * ((4 if backward else 3) * st.key_dim + square * n)
  return batch * (st.heads // hg) * (st.length // st.block_t) * per_block


def head_major(st: Static, *xs):
  """[B, T, G] arrays → head-major [B, G, Tp], zeros past T (Nones dropped)."""
  return [jnp.swapaxes(common.pad_axis(x, 1, st.tp), 1, 2) for x in xs if x is not None]
