"""OSDN's sequential d-pass (DESIGN.md §1, "OSDN online hypergradient") as a Pallas GPU kernel pair.

The recurrence (one (batch, head) row; u_t = k_t ⊙ k_t, n_t = max(‖k_t‖², 1e-12), s_t = ⟨d_t, u_t⟩):
    coef_t = η β_t (1 − β_t s_t) / n_t
    d̄_{t+1} = keep_t + coef_t u_t,   keep_t = d_t (r ≡ 1) | r_t d_t (anchor "zero") | o + r_t (d_t − o) ("init")
    d_{t+1} = clip(d̄_{t+1}, d_min, d_max)                                            (o = d_init [G, K])
Token t writes with d_t; the results are ds = (d_1 … d_T) [B, T, G, K] and d_{T+1} [B, G, K].

Forward kernel, grid (B, G), one program per (batch, head): ⟨d, u⟩ couples all K channels, so d [K] of one head
lives in one program's registers (one warp up to K = 128). A `fori_loop` over blocks of `block_t` tokens whose
body is unrolled and issues all the block's loads (independent of d) before its first step, so one memory
latency is paid per block, not per token; the T mod block_t tokens left over are unrolled after the loop, so
T needs no padding and no token past T is ever processed (d_{T+1} is exact for both anchors). Per token: one
row load of u, scalar loads of β, n, r, one K-reduction, a row store of d_t.

Backward kernel, same grid, the adjoint in reverse token order. With λ the cotangent of d_{t+1} (d_{T+1}'s
cotangent to start), m_t the clip's derivative at d̄_{t+1} (1 inside, 0 outside, ½ at a bound, exactly as
`jnp.clip`'s), μ = m_t ⊙ λ, p = ⟨u_t, μ⟩ and c_t = η β_t² / n_t (= −∂coef/∂s):
    ∂u_t = coef_t μ − c_t p d_t      ∂β_t = η p (1 − 2 β_t s_t) / n_t      ∂n_t = −coef_t p / n_t
    ∂r_t = ⟨d_t − o, μ⟩ (o = 0 for "zero")      ∂o += (1 − r_t) μ ("init")
    λ ← r_t μ − c_t p u_t + ∂ds_t                 (∂d_1 = λ after token 1)
The forward saves d_t (its output ds), so s_t and d̄_{t+1} are recomputed per token off the dependency chain;
the chain itself is one K-reduction per token.

Block solves (unpacked; `DPassBlocks.solve_t*` tokens per block, per mode): where the clip does not act inside
a block, the block is the unclipped rank-one recurrence, and its L × L unit triangular systems depend on the
inputs only. `osdn_tables` forms their inverses for every block at once (a parallel kernel, one program per
block; Γ of the retentions as masked sums of log r); the kernels then run one block per step with two reductions
over K, one [L, L] × [L, K] product and a check (`_block_solve`: every d̄_{t+1} inside the bounds;
`_block_adjoint`: the clip's derivative 1 throughout). A block that fails its check runs token by token as
above (`lax.cond`), so results are those of the token-serial recurrence, with block rounding, whatever the
gates. Split backward (`DPassBlocks.split_bwd`, the default): the forward also flags each block whose clip
derivative is 1 throughout (every d̄_{t+1} strictly inside the bounds); the backward's sequential kernel then
carries only λ through those blocks (`_block_chain`: one [L] solve and two sums per block) and stores the λ
entering each, and a parallel kernel over all blocks (`_bwd_blocks`) forms their per-token gradients.

Packed sequences: one int32 code per token (segment, first, last): d restarts from d1[segment] at a first
token and d_{T+1} of the segment is stored at its last; in reverse, λ restarts from the segment's d_{T+1}
cotangent at a last token and ∂d1[segment] is stored at a first. Segments never span rows, so the (batch, head)
programs write disjoint rows of the per-segment arrays.

`d_pass` is the entry point (padding K to a power of two ≥ 16, one `jax.custom_vjp` around the two kernels);
the guard and d ⊙ k stay in plain JAX in `osdn_jax.dgps.precond`. fp32 throughout. Registered with
`pallas_kernels.lookup` as "osdn_d_pass" (see `supports`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from osdn_jax.ops import packing
from pallas_kernels.gpu.chunk_math import dot, iota, last_row
from pallas_kernels.gpu.config import padded_dim, pallas_call
from pallas_kernels.gpu.intra import decay_factor
from pallas_kernels.gpu import osdn_tables

F32 = jnp.float32
MAX_KEY_DIM = 256                        # d [K] stays in registers
_SQ = getattr(pl, "squeezed", None)      # a squeezed block dim (None in older JAX)


def _pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class DPassBlocks:
  """Launch parameters of the d-pass kernels (speed only, not numerics).

  block_t:    tokens per iteration of the forward's sequential loop (the loop body is unrolled over them and
              issues all their loads first: registers grow with it).
  block_t_bwd: the same for the backward (three K-rows per token are held: smaller).
  solve_t:    tokens per block solve (`_block_solve`, `_block_adjoint`) with r ≡ 1; 0: token by token only.
  solve_t_apf: the same with an APF retention r, anchor "zero".
  solve_t_init: the same with an APF retention r, anchor "init".
  num_warps:  Triton warps per program; None: 1 for K ≤ 128 (the K-reductions stay within a warp), else 2.
  warps_solve: Triton warps of both kernels when they run block solves ([solve_t, K] tiles).
  warps_tables: Triton warps of the block solves' table kernels (`osdn_tables`, one program per block).
  prefetch, prefetch_bwd: the forward's (backward's) block-solve loop loads block i + 1 while block i
              computes (`_block_loop`).
  tables:     how the block solves' tables are formed: "kernel" (`osdn_tables`' Pallas kernel), "xla" (its
              plain-JAX reference: batched triangular solves) or "auto": the kernel for a forward alone, the
              reference under differentiation (`osdn_tables.implementation`).
  tables_dots: how the table kernel's fp32 dots run: "ieee" or "tf32x3" (`chunk_math.fp32_dots`; rounding only).
  share_inverse: under differentiation the forward's tables include the backward's inverse, formed from the
              same Gram blocks and kept as a residual [B, NB, G, L, L]; the backward then forms only its
              right-hand side.
  split_bwd:  the backward's sequential kernel carries only λ through the blocks whose clip derivative is 1
              (`_block_chain`; the forward kernel flags those blocks) and a parallel kernel (`_bwd_blocks`) forms
              their per-token gradients from the λ it stored; else one kernel does both (`_block_adjoint`).
  num_stages: Triton num_stages.
  """
  block_t: int = 16       # H200, B=4 T=4096 G=16 K=128 (profile_osdn): 16/8 ran fwd 1.16 ms, fwd+bwd 3.00 ms;
  block_t_bwd: int = 8     # 32/16 1.48 / 3.89; 64/32 1.48 / 4.13
  # H200, B=4 T=4096 G=16 K=128 (profile_osdn --trace, fwd / fwd+bwd ms, each group one run, K-looped table
  # kernel, split backward): r ≡ 1 L = 32 0.690 / 1.957; "zero" L = 16 0.780 / 2.327, L = 32 0.960 / 2.704;
  # "init" token by token 0.946 / 2.586, L = 16 0.806 / 2.412, L = 32 1.115 / 2.898. (Earlier, synchronised
  # per call, plain-JAX tables: r ≡ 1 token by token 1.469 / 3.130, L = 32 1.177 / 2.569.)
  solve_t: int = 32
  solve_t_apf: int = 16
  solve_t_init: int = 16
  num_warps: int | None = None
  warps_solve: int = 4
  warps_tables: int = 4
  prefetch: bool = True     # H200 (kernel_times, B=4 T=4096 G=16 K=128, L=32, across runs): forward 0.475 → 0.360;
  prefetch_bwd: bool = False  # backward kernel 1.009 → 1.112 ms (more registers: three [L, K] tiles per block)
  # H200, B=4 T=4096 G=16 K=128 (profile_osdn --trace, fwd / fwd+bwd ms, each a separate run): r ≡ 1 kernel
  # (share_inverse) 0.715 / 1.670, xla 0.799 / 1.609, auto 0.710 / 1.596; "zero" 0.844 / 2.056, 0.862 / 1.860,
  # 0.832 / 1.835; "init" 0.855 / 2.130, 0.886 / 1.917, 0.844 / 1.886.
  tables: str = "auto"
  split_bwd: bool = True   # H200 (profile_osdn --trace, r ≡ 1, L = 32, one run): fwd+bwd 2.687 → 2.350 ms
  tables_dots: str = "ieee"  # "tf32x3" (K-looped table kernel, one run): forward 0.690 → 0.755, fwd+bwd 1.957 → 2.041
  share_inverse: bool = True  # H200 (profile_osdn --trace), kernel tables, fwd+bwd: r ≡ 1 1.704 → 1.670,
                              # "zero" 2.108 → 2.056, "init" 2.166 → 2.130 ms
  num_stages: int = 1

  def __post_init__(self):
    for name in ("block_t", "block_t_bwd"):
      if not _pow2(getattr(self, name)):
        raise ValueError(f"DPassBlocks.{name}={getattr(self, name)} must be a power of two")
    for name in ("solve_t", "solve_t_apf", "solve_t_init"):
      v = getattr(self, name)
      if v and (not _pow2(v) or v < 16):
        raise ValueError(f"DPassBlocks.{name}={v} must be 0 or a power of two ≥ 16")
    for name in ("num_warps", "warps_solve", "warps_tables"):
      if getattr(self, name) is not None and not _pow2(getattr(self, name)):
        raise ValueError(f"DPassBlocks.{name}={getattr(self, name)} must be a power of two")
    if self.tables not in ("kernel", "xla", "auto"):
      raise ValueError(f"DPassBlocks.tables={self.tables!r} must be 'kernel', 'xla' or 'auto'")
    if self.tables_dots not in ("ieee", "tf32x3"):
      raise ValueError(f"DPassBlocks.tables_dots={self.tables_dots!r} must be 'ieee' or 'tf32x3'")
    if self.num_stages < 1:
      raise ValueError(f"DPassBlocks.num_stages={self.num_stages} must be ≥ 1")

  def warps(self, key_dim: int) -> int:
    return self.num_warps or (1 if key_dim <= 128 else 2)

  def solve_warps(self, key_dim: int, blocked: bool) -> int:
    return self.warps_solve if blocked else self.warps(key_dim)


DEFAULT_BLOCKS = DPassBlocks()
# Interpret mode: unrolling costs compile time only; kernel tables throughout (what the mode is for, and no CPU
# batched trsm: jaxlib 0.10.2's deadlocked on 2-core machines when two ran at once).
INTERPRET_BLOCKS = DPassBlocks(block_t=4, block_t_bwd=4, solve_t=16, solve_t_apf=16, solve_t_init=16,
                               prefetch_bwd=True, split_bwd=True, tables="kernel")


@dataclasses.dataclass(frozen=True)
class Static:
  """Everything static about one d-pass call (hashable: the custom_vjp's non-differentiable argument)."""
  batch: int
  length: int              # T (not padded)
  heads: int               # G
  key_dim: int             # padded K
  eta: float
  d_min: float | None
  d_max: float | None
  mode: str                # "none" (r ≡ 1) | "zero" | "init"
  blocks: DPassBlocks
  interpret: bool
  segments: int = 0        # packed: N (per-token codes reset d; d1 and d_{T+1} are per segment); 0: not
  channels: int = 0        # K before padding (0: key_dim); padded channels (u = 0, d = 0) skip the checks

  @property
  def has_r(self) -> bool:
    return self.mode != "none"

  @property
  def has_o(self) -> bool:
    return self.mode == "init"

  def real(self, shape):
    """[.., K] mask of the channels that are not padding (None: no padding)."""
    if not self.channels or self.channels == self.key_dim:
      return None
    return iota(shape, len(shape) - 1) < self.channels

  @property
  def solve_t(self) -> int:
    return {"none": self.blocks.solve_t, "zero": self.blocks.solve_t_apf, "init": self.blocks.solve_t_init}[self.mode]


# BlockSpecs over the grid (b, g): whole sequences of one (batch, head).
def _rows(st):     # [B, T, G, K] → [T, K]
  return pl.BlockSpec((_SQ, st.length, _SQ, st.key_dim), lambda b, g: (b, 0, g, 0))


def _scalars(st):  # [B, T, G] → [T]
  return pl.BlockSpec((_SQ, st.length, _SQ), lambda b, g: (b, 0, g))


def _head_vec(st):  # [B, G, K] → [K]; packed: [N, G, K] → [N, K] (every segment's row, read by index)
  if st.segments:
    return pl.BlockSpec((st.segments, _SQ, st.key_dim), lambda b, g: (0, g, 0))
  return pl.BlockSpec((_SQ, _SQ, st.key_dim), lambda b, g: (b, g, 0))


def _batch_vec(st):  # [B, G, K] → [K], also when packed
  return pl.BlockSpec((_SQ, _SQ, st.key_dim), lambda b, g: (b, g, 0))


def _codes(st):    # [B, T] int32 → [T]: segment << 2 | last token of it << 1 | first token of it
  return pl.BlockSpec((_SQ, st.length), lambda b, g: (b, 0))


def _decode(code):
  return code >> 2, (code & 1) == 1, (code & 2) == 2


def _param_vec(st):  # [G, K] → [K]
  return pl.BlockSpec((_SQ, st.key_dim), lambda b, g: (g, 0))


def _split(refs, *present):
  """Splits a flat ref list into one entry per flag (None where the flag is False)."""
  out, i = [], 0
  for p in present:
    out.append(refs[i] if p else None)
    i += int(p)
  assert i == len(refs)
  return out


def _run_tokens(load, step, ts, c, reverse: bool = False):
  """c ← step(t, load(t), c) over the tokens ts (unrolled; in reverse order when reverse), all loads first."""
  ts = list(reversed(ts)) if reverse else list(ts)
  xs = [load(t) for t in ts]
  for t, x in zip(ts, xs):
    c = step(t, x, c)
  return c


def _sequential(st, load, step, carry, reverse: bool, block_t: int):
  """Runs carry ← step(t, load(t), carry) for t = 0 … T−1 (or T−1 … 0): a fori_loop over blocks of block_t
  tokens, the last T mod block_t tokens on their own. Each block first issues every load of its tokens, then
  runs the unrolled steps: loads written after the previous token's stores could not be moved above them
  (the refs may alias), so a per-token load would put one memory latency on the dependency chain per token."""
  nf, rem = divmod(st.length, block_t)
  run = lambda ts, c: _run_tokens(load, step, ts, c, reverse)

  def block(i, c):
    return run([i * block_t + j for j in range(block_t)], c)

  tail = lambda c: run([jnp.int32(nf * block_t + j) for j in range(rem)], c)
  zero, count = jnp.int32(0), jnp.int32(nf)
  if reverse:
    c = tail(carry)
    if nf:
      c = lax.fori_loop(zero, count, lambda i, c: block(count - 1 - i, c), c)
    return c
  c = carry
  if nf:
    c = lax.fori_loop(zero, count, block, c)
  return tail(c)


def _pre_clip(st, d, u, b, n, r, o):
  """(d̄_{t+1}, coef_t, s_t) for one token, as `precond._osdn_update` computes them."""
  s = jnp.sum(d * u)
  coef = st.eta * b * (1.0 - b * s) / n
  if st.mode == "none":
    keep = d
  elif st.mode == "zero":
    keep = r * d
  else:
    keep = o + r * (d - o)
  return keep + coef * u, coef, s


def _clip(st, x):
  if st.d_min is not None:
    x = jnp.maximum(x, st.d_min)
  if st.d_max is not None:
    x = jnp.minimum(x, st.d_max)
  return x


def _clip_grad(st, x):
  """∂clip/∂x as `jnp.clip` defines it (1 inside, 0 outside, ½ at a bound; ¼ at d_min = d_max); None: 1."""
  m = None
  if st.d_min is not None:
    m = (x > st.d_min).astype(F32) + 0.5 * (x == st.d_min).astype(F32)
  if st.d_max is not None:
    m_hi = (x < st.d_max).astype(F32) + 0.5 * (x == st.d_max).astype(F32)
    m = m_hi if m is None else m * m_hi
  return m


def _blocked(st) -> bool:
  """The kernels run block solves (a block size for this mode, not packed, at least one whole block)."""
  return bool(st.solve_t) and not st.segments and st.length >= st.solve_t


def _split_bwd(st) -> bool:
  return _blocked(st) and st.blocks.split_bwd


def _block_loop(nb: int, fetch, body, carry, *, prefetch: bool, reverse: bool = False):
  """carry ← body(i, fetch(i), carry) over the blocks i = 0 … nb − 1 (nb − 1 … 0 when reverse). With
  prefetch, block i's loads (everything but the carry, which they do not depend on) are issued
  one iteration early, during the previous block's math, so their memory latency is off the dependency chain;
  the loop then carries them (twice the registers for the block's tiles)."""
  order = (lambda i: nb - 1 - i) if reverse else (lambda i: i)
  zero, count = jnp.int32(0), jnp.int32(nb)
  if not prefetch:
    return lax.fori_loop(zero, count, lambda i, c: body(order(i), fetch(order(i)), c), carry)

  def step(i, c):
    c, x = c
    nxt = fetch(order(jnp.minimum(i + 1, nb - 1)))
    return body(order(i), x, c), nxt
  return lax.fori_loop(zero, count, step, (carry, fetch(order(zero))))[0]


def _sequential_tokens(st, load, step, start, count: int, block_t: int, c, reverse: bool = False):
  """step over tokens start … start + count − 1 (count static; in reverse order when reverse), in unrolled
  groups of ≤ block_t tokens."""
  groups = [[start + j for j in range(g0, min(count, g0 + block_t))] for g0 in range(0, count, block_t)]
  for ts in (reversed(groups) if reverse else groups):
    c = _run_tokens(load, step, ts, c, reverse)
  return c


def _through(r, L: int):
  """(P, Q) [L] for a block's retentions r [L]: P_t = Π_{i<t} r_i, Q_t = Π_{t<i<L} r_i. Each is exp of a
  masked sum of log r (never a difference of cumulative sums, which would lose the small products next to a
  zero retention)."""
  la = osdn_tables.log_retention(r)
  return osdn_tables.prefix_products(la, 0, L, True), osdn_tables.prefix_products(la, 0, L, False)


def _block_solve(st, u, b, n, r, o, d, tf, wf, gamma):
  """L tokens of the forward at once, when the clip does not change any d̄_{t+1} of the block (checked: ok;
  else the block runs token by token).

  Without the clip the block is the rank-one recurrence δ_{t+1} = a_t δ_t + coef_t u_t (δ = d − o, a = r or 1,
  o = d_init for "init", else 0) with coef_t = α_t − c_t s_t, α = η β / n, c = η β² / n, and
  s_t = ⟨d_t, u_t⟩ = ⟨o, u_t⟩ + P_t ⟨δ_0, u_t⟩ + Σ_{j<t} M_tj coef_j (P_t = Π_{i<t} a_i, M = Γ ⊙ U Uᵀ,
  Γ_tj = Π_{j<i<t} a_i): (I + M diag(c)) s = U o + M α + P ⊙ U δ_0. The inverse of that unit lower
  triangular matrix depends on the inputs only, so `osdn_tables.forward` forms it for every block in parallel:
  tf = (I + M diag(c))⁻¹ diag(P) and wf = (I + M diag(c))⁻¹ (U o + M α). Here: s = tf U δ_0 + wf and
  D = (d_t)_t = o + P ⊗ δ_0 + (Γ diag(coef)) U, then every d̄_{t+1} = o + a_t (d_t − o) + coef_t u_t is checked
  inside [d_min, d_max] (NaN fails; padded channels are not checked). Returns (D [L, K], d_L [K], ok, smooth):
  smooth when, besides, the clip's derivative is 1 at every d̄_{t+1} (strictly inside the bounds; `_clip_grad`),
  which is what the split backward's block path needs (`_block_chain`, `_bwd_blocks`).

  u [L, K], b, n, r [L] (r None: a ≡ 1), o [K] or None, d [K], tf [L, L], wf [L], gamma [L, L] or None (r None).
  """
  L, K = u.shape
  lo = -jnp.inf if st.d_min is None else st.d_min
  hi = jnp.inf if st.d_max is None else st.d_max
  anchor = jnp.zeros_like(d) if o is None else o
  delta0 = d - anchor
  if r is None:
    gamma = decay_factor(None, L, strict=True)
  s = jnp.sum(tf * jnp.sum(u * delta0[None, :], axis=1)[None, :], axis=1) + wf
  coef = st.eta * b * (1.0 - b * s) / n
  prop = delta0[None, :] if r is None else _through(r, L)[0][:, None] * delta0[None, :]
  D = anchor[None, :] + prop + dot(gamma * coef[None, :], u)
  keep = D if r is None else anchor[None, :] + r[:, None] * (D - anchor[None, :])
  d_bar = keep + coef[:, None] * u
  # One reduction for both checks: 2 outside the bounds (or NaN), 1 on a bound, 0 strictly inside.
  code = jnp.where((d_bar > lo) & (d_bar < hi), 0.0, jnp.where((d_bar >= lo) & (d_bar <= hi), 1.0, 2.0))
  real = st.real(code.shape)
  worst = jnp.max(code if real is None else jnp.where(real, code, 0.0))
  return D, _clip(st, last_row(d_bar)), worst < 2.0, worst < 1.0


def _block_adjoint(st, u, d, g, b, n, r, o, lam, tb, wb, gamma):
  """L tokens of the backward at once, when the clip's derivative is 1 for every channel and token of the
  block (every d̄_{t+1} strictly inside the bounds, padded channels aside: checked, ok; else the block runs
  token by token). The forward saved the d_t, so d̄_{t+1} is known for every token at once.

  Then the adjoint λ_t = a_t λ_{t+1} − c_t p_t u_t + g_t (λ_t the cotangent of d_t, g_t that of output row t,
  p_t = ⟨u_t, λ_{t+1}⟩) is the rank-one recurrence in reverse: (I + Mᵀ diag(c)) p = Q ⊙ U λ_L + (Γᵀ ⊙ U Gᵀ) 1
  (Q_t = Π_{t<i<L} a_i), with tb = (I + Mᵀ diag(c))⁻¹ diag(Q) and wb = (I + Mᵀ diag(c))⁻¹ (Γᵀ ⊙ U Gᵀ) 1 from
  `osdn_tables.backward`, and Λ = (λ_{t+1})_t = Q ⊗ λ_L + Γᵀ (G − (c ⊙ p) ⊗ U) is one [L, L] × [L, K]
  product. Returns the kernel's per-token gradients (du [L, K], dβ, dn [L], dr [L] or None), the block's
  share of d_init's gradient ([K] or None), λ_0 [K] and ok.

  u, d, g [L, K] (d: the d_t the forward saved), b, n, r [L] (r None: a ≡ 1), o [K] or None, lam [K] (λ_L),
  tb [L, L], wb [L], gamma [L, L] or None (r None).
  """
  L, K = u.shape
  anchor = jnp.zeros_like(lam) if o is None else o
  s, coef, good = _adjoint_check(st, d, u, b, n, r, anchor)
  c = st.eta * b * b / n
  ok = True if good is None else jnp.sum(jnp.where(good, 0.0, 1.0)) == 0.0
  if r is None:
    gamma = decay_factor(None, L, strict=True)
  p = jnp.sum(tb * jnp.sum(u * lam[None, :], axis=1)[None, :], axis=1) + wb
  cp = c * p
  prop = lam[None, :] if r is None else _through(r, L)[1][:, None] * lam[None, :]
  mu = prop + dot(gamma.T, g - cp[:, None] * u)                       # rows λ_{t+1}
  du = coef[:, None] * mu - cp[:, None] * d
  dbeta = st.eta * p * (1.0 - 2.0 * b * s) / n
  dn = -coef * p / n
  dr = None if r is None else jnp.sum((d - anchor[None, :]) * mu, axis=1)
  d_o = None if not st.has_o else jnp.sum((1.0 - r)[:, None] * mu, axis=0)
  lam_t = (mu if r is None else r[:, None] * mu) - cp[:, None] * u + g
  lam0 = jnp.sum(jnp.where(iota((L, K), 0) == 0, lam_t, 0.0), axis=0)
  return du, dbeta, dn, dr, d_o, lam0, ok


def _block_chain(st, u, g, b, n, r, lam, tb, wb, gamma):
  """λ_0 [K] of a block whose clip derivative is 1 throughout, from λ_L (lam): the dependency chain of
  `_block_adjoint` alone. Only row 0 of Λ is needed: μ_0 = Q_0 λ_L + Σ_j Γ_j0 (g_j − c_j p_j u_j), then
  λ_0 = a_0 μ_0 − c_0 p_0 u_0 + g_0 (a ≡ 1 without a retention). u, g [L, K], b, n, r [L] (r None: a ≡ 1),
  tb [L, L], wb [L], gamma [L, L] or None."""
  L = u.shape[0]
  first = lambda x: jnp.sum(jnp.where(iota(x.shape, 0) == 0, x, 0.0), axis=0)
  p = jnp.sum(tb * jnp.sum(u * lam[None, :], axis=1)[None, :], axis=1) + wb
  cp = st.eta * b * b / n * p
  rest = g - cp[:, None] * u
  if r is None:                                    # Γ_j0 = 1 for j > 0: λ_0 = λ_L + Σ_j (g_j − c_j p_j u_j)
    return lam + jnp.sum(rest, axis=0)
  col0 = jnp.sum(jnp.where(iota((L, L), 1) == 0, gamma, 0.0), axis=1)         # Γ_j0 (0 at j = 0)
  mu0 = first(_through(r, L)[1]) * lam + jnp.sum(col0[:, None] * rest, axis=0)
  return first(r) * mu0 + first(rest)


def _adjoint_check(st, d, u, b, n, r, anchor):
  """(s, coef [...], good [..., K] or None) for rows d, u [..., K] (b, n, r [...]; r None: a ≡ 1; anchor [K]):
  good where the clip's derivative at d̄_{t+1} is 1 or the channel is padding; None without bounds."""
  s = jnp.sum(d * u, axis=-1)
  coef = st.eta * b * (1.0 - b * s) / n
  keep = d if r is None else anchor + r[..., None] * (d - anchor)
  mask = _clip_grad(st, keep + coef[..., None] * u)
  if mask is None:
    return s, coef, None
  real = st.real(mask.shape)
  return s, coef, (mask == 1.0) if real is None else (mask == 1.0) | ~real


# ---------------------------------------------------------------------------------------------------------
# Forward: ds [B, T, G, K] (the d each token writes with), d_{T+1} [B, G, K].
# ---------------------------------------------------------------------------------------------------------
def _fwd_kernel(st, *refs):
  packed, blocked = st.segments > 0, _blocked(st)
  u_ref, b_ref, n_ref, r_ref, c_ref, d1_ref, o_ref, tf_ref, wf_ref, gm_ref, ds_ref, dl_ref, sm_ref = _split(
      refs, True, True, True, st.has_r, packed, True, st.has_o, blocked, blocked, blocked and st.has_r, True, True,
      _split_bwd(st))
  o = o_ref[...] if st.has_o else None

  def load(t):
    code = _decode(c_ref[t]) if packed else None
    d1 = d1_ref[code[0], :] if packed else None
    return u_ref[t, :], b_ref[t], n_ref[t], r_ref[t] if st.has_r else None, code, d1

  def step(t, x, d):
    u, b, n, r, code, d1 = x
    if packed:                            # a segment's first token starts from its own d1
      seg, first, last = code
      d = jnp.where(first, d1, d)
    d_bar, _, _ = _pre_clip(st, d, u, b, n, r, o)
    ds_ref[t, :] = d
    d_next = _clip(st, d_bar)
    if packed:
      @pl.when(last)
      def _():                            # a segment's last token leaves its d_{T+1}
        dl_ref[seg, :] = d_next
    return d_next

  bt = st.blocks.block_t
  d1 = None if packed else d1_ref[...].astype(F32)
  if packed:
    _sequential(st, load, step, jnp.zeros((st.key_dim,), F32), False, bt)
  elif blocked:
    L = st.solve_t
    nb, rem = divmod(st.length, L)

    def fetch(i):
      rows = pl.ds(i * L, L)
      return (u_ref[rows, :], b_ref[rows], n_ref[rows], r_ref[rows] if st.has_r else None, tf_ref[i, :, :],
              wf_ref[i, :], gm_ref[i, :, :] if st.has_r else None)

    def block(i, x, d):
      u, b, n, r, tf, wf, gm = x
      D, d_next, ok, smooth = _block_solve(st, u, b, n, r, o, d, tf, wf, gm)

      def accept():
        ds_ref[pl.ds(i * L, L), :] = D
        if sm_ref is not None:
          sm_ref[i] = smooth.astype(jnp.int32)
        return d_next

      def serial():                       # the split backward runs such a block token by token too
        if sm_ref is not None:
          sm_ref[i] = jnp.int32(0)
        return _sequential_tokens(st, load, step, i * L, L, bt, d)
      return lax.cond(ok, accept, serial)

    d = _block_loop(nb, fetch, block, d1, prefetch=st.blocks.prefetch)
    dl_ref[...] = _sequential_tokens(st, load, step, nb * L, rem, bt, d)
  else:
    dl_ref[...] = _sequential(st, load, step, d1, False, bt)


def _table_specs(st):  # [B, NB, G, L, L] → [NB, L, L] and [B, NB, G, L] → [NB, L]: (t, w[, Γ])
  nb, L = st.length // st.solve_t, st.solve_t
  square = pl.BlockSpec((_SQ, nb, _SQ, L, L), lambda b, g: (b, 0, g, 0, 0))
  return [square, pl.BlockSpec((_SQ, nb, _SQ, L), lambda b, g: (b, 0, g, 0))] + ([square] if st.has_r else [])


def _forward(st, u, n, beta, r, codes, d1, o, differentiated=False):
  """→ ((saved, Γ) of `osdn_tables.forward` for the backward, kernel outputs: ds, d_{T+1}[, per-block flags])."""
  packed = st.segments > 0
  tables, saved = [], (None, None)
  if _blocked(st):
    tf, wf, gamma, shared = osdn_tables.forward(st, u, n, beta, r, o, differentiated=differentiated)
    tables = [tf, wf] + ([gamma] if st.has_r else [])
    saved = (shared, gamma) if shared is not None else saved
  args = [u, beta, n] + ([r] if st.has_r else []) + ([codes] if packed else []) + [d1] + \
      ([o] if st.has_o else []) + tables
  in_specs = [_rows(st), _scalars(st), _scalars(st)] + ([_scalars(st)] if st.has_r else []) + \
      ([_codes(st)] if packed else []) + [_head_vec(st)] + ([_param_vec(st)] if st.has_o else []) + \
      (_table_specs(st) if tables else [])
  b, t, g, k = st.batch, st.length, st.heads, st.key_dim
  split = _split_bwd(st)
  return saved, pallas_call(
      functools.partial(_fwd_kernel, st), grid=(b, g), in_specs=in_specs,
      out_specs=[_rows(st), _head_vec(st)] + ([_per_block(st)] if split else []),
      out_shape=[jax.ShapeDtypeStruct((b, t, g, k), F32),
                 jax.ShapeDtypeStruct((st.segments or b, g, k), F32)] +
      ([jax.ShapeDtypeStruct((b, t // st.solve_t, g), jnp.int32)] if split else []),
      interpret=st.interpret, num_warps=st.blocks.solve_warps(k, _blocked(st)), num_stages=st.blocks.num_stages,
      name="osdn_d_pass_fwd")(*args)


# ---------------------------------------------------------------------------------------------------------
# Backward: the adjoint pass in reverse token order.
# ---------------------------------------------------------------------------------------------------------
def _bwd_kernel(st, *refs):
  packed, blocked = st.segments > 0, _blocked(st)
  split = _split_bwd(st)
  (u_ref, b_ref, n_ref, r_ref, c_ref, o_ref, ds_ref, gds_ref, gl_ref, tb_ref, wb_ref, gm_ref, ok_ref,
   du_ref, db_ref, dn_ref, dr_ref, dd1_ref, do_ref, lam_ref) = _split(
       refs, True, True, True, st.has_r, packed, st.has_o, True, True, True, blocked, blocked,
       blocked and st.has_r, split, True, True, True, st.has_r, True, st.has_o, split)
  o = o_ref[...] if st.has_o else None

  def load(t):
    code = _decode(c_ref[t]) if packed else None
    g_last = gl_ref[code[0], :] if packed else None
    return (u_ref[t, :], ds_ref[t, :], gds_ref[t, :], b_ref[t], n_ref[t], r_ref[t] if st.has_r else None,
            code, g_last)

  def step(t, x, carry):
    lam, acc_o = carry
    u, d, g_d, b, n, r, code, g_last = x
    if packed:                            # d_{t+1} of a segment's last token is that segment's d_{T+1}
      seg, first, last = code
      lam = jnp.where(last, g_last, lam)
    d_bar, coef, s = _pre_clip(st, d, u, b, n, r, o)
    m = _clip_grad(st, d_bar)
    mu = lam if m is None else m * lam
    p = jnp.sum(u * mu)
    c = st.eta * b * b / n
    du_ref[t, :] = coef * mu - (c * p) * d
    db_ref[t] = st.eta * p * (1.0 - 2.0 * b * s) / n
    dn_ref[t] = -coef * p / n
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

  lam0 = jnp.zeros((st.key_dim,), F32) if packed else gl_ref[...].astype(F32)
  bt = st.blocks.block_t_bwd
  if blocked:
    L = st.solve_t
    nb, rem = divmod(st.length, L)

    def fetch(blk):
      rows = pl.ds(blk * L, L)
      return (u_ref[rows, :], None if split else ds_ref[rows, :], gds_ref[rows, :], b_ref[rows], n_ref[rows],
              r_ref[rows] if st.has_r else None, tb_ref[blk, :, :], wb_ref[blk, :],
              gm_ref[blk, :, :] if st.has_r else None)

    def block(blk, x, carry):
      u, d, g, b, n, r, tb, wb, gm = x
      serial = lambda: _sequential_tokens(st, load, step, blk * L, L, bt, carry, reverse=True)
      if split:                           # λ only; `_bwd_blocks` forms the block's gradients from λ_L
        def chain():
          lam_ref[blk, :] = carry[0]
          return _block_chain(st, u, g, b, n, r, carry[0], tb, wb, gm), carry[1]
        return lax.cond(ok_ref[blk] != 0, chain, serial)
      du, db, dn, dr, d_o, lam_prev, ok = _block_adjoint(st, u, d, g, b, n, r, o, carry[0], tb, wb, gm)
      rows = pl.ds(blk * L, L)

      def accept():
        du_ref[rows, :] = du
        db_ref[rows] = db
        dn_ref[rows] = dn
        if st.has_r:
          dr_ref[rows] = dr
        return lam_prev, carry[1] + d_o if st.has_o else carry[1]
      return lax.cond(ok, accept, serial)

    carry = _sequential_tokens(st, load, step, nb * L, rem, bt, (lam0, jnp.zeros_like(lam0)), reverse=True)
    lam, acc_o = _block_loop(nb, fetch, block, carry, prefetch=st.blocks.prefetch_bwd, reverse=True)
  else:
    lam, acc_o = _sequential(st, load, step, (lam0, jnp.zeros_like(lam0)), True, bt)
  if not packed:
    dd1_ref[...] = lam
  if st.has_o:
    do_ref[...] = acc_o


def _backward(st, u, n, beta, r, codes, o, ds, smooth, saved, g_ds, g_last):
  """smooth [B, NB, G] int32 (split backward only, else None): the forward's per-block flag, 1 where the clip's
  derivative is 1 throughout the block (`_block_solve`); those blocks run as a λ chain here. saved: the
  forward's (saved, Γ) (`_forward`)."""
  packed, split = st.segments > 0, _split_bwd(st)
  tables, ok = [], smooth
  if _blocked(st):
    tb, wb, gamma = osdn_tables.backward(st, u, n, beta, r, g_ds, *saved)
    tables = [tb, wb] + ([gamma] if st.has_r else [])
  args = [u, beta, n] + ([r] if st.has_r else []) + ([codes] if packed else []) + \
      ([o] if st.has_o else []) + [ds, g_ds, g_last] + tables + ([ok] if split else [])
  in_specs = [_rows(st), _scalars(st), _scalars(st)] + ([_scalars(st)] if st.has_r else []) + \
      ([_codes(st)] if packed else []) + ([_param_vec(st)] if st.has_o else []) + \
      [_rows(st), _rows(st), _head_vec(st)] + (_table_specs(st) if tables else []) + \
      ([_per_block(st)] if split else [])
  b, t, g, k = st.batch, st.length, st.heads, st.key_dim
  nb = st.length // st.solve_t if split else 0
  rows, scal, vec = (jax.ShapeDtypeStruct(s, F32) for s in ((b, t, g, k), (b, t, g), (st.segments or b, g, k)))
  # dO per (batch, head) program: [B, G, K] even when packed (summed over B by the caller).
  out_specs = [_rows(st), _scalars(st), _scalars(st)] + ([_scalars(st)] if st.has_r else []) + \
      [_head_vec(st)] + ([_batch_vec(st)] if st.has_o else []) + ([_per_block(st, k)] if split else [])
  out_shape = [rows, scal, scal] + ([scal] if st.has_r else []) + [vec] + \
      ([jax.ShapeDtypeStruct((b, g, k), F32)] if st.has_o else []) + \
      ([jax.ShapeDtypeStruct((b, nb, g, k), F32)] if split else [])
  outs = pallas_call(
      functools.partial(_bwd_kernel, st), grid=(b, g), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, interpret=st.interpret, num_warps=st.blocks.solve_warps(k, _blocked(st)),
      num_stages=st.blocks.num_stages, name="osdn_d_pass_bwd")(*args)
  du, dbeta, dn, dr, dd1, do = _split_outs(st, outs[:len(outs) - split])
  if split:
    du, dbeta, dn, dr, do_blocks = _bwd_blocks(st, u, n, beta, r, o, ds, g_ds, tables, outs[-1], ok,
                                               (du, dbeta, dn, dr))
    if st.has_o:
      do = do + jnp.sum(do_blocks, axis=1)
  return du, dn, dbeta, dr, dd1, None if do is None else jnp.sum(do, axis=0)


def _per_block(st, k: int = 0):
  """[B, NB, G] → [NB] (k = 0) or [B, NB, G, K] → [NB, K] for the (b, g) programs: one entry per block."""
  nb = st.length // st.solve_t
  if k:
    return pl.BlockSpec((_SQ, nb, _SQ, k), lambda b, g: (b, 0, g, 0))
  return pl.BlockSpec((_SQ, nb, _SQ), lambda b, g: (b, 0, g))


def _bwd_blocks_kernel(st, *refs):
  (u_ref, ds_ref, g_ref, b_ref, n_ref, r_ref, o_ref, tb_ref, wb_ref, gm_ref, lam_ref, ok_ref,
   _du, _db, _dn, _dr, du_ref, db_ref, dn_ref, dr_ref, do_ref) = _split(
       refs, True, True, True, True, True, st.has_r, st.has_o, True, True, st.has_r, True, True,
       True, True, True, st.has_r, True, True, True, st.has_r, st.has_o)
  ok = ok_ref[pl.program_id(2)] != 0
  du, db, dn, dr, d_o, _, _ = _block_adjoint(
      st, u_ref[...], ds_ref[...], g_ref[...], b_ref[...], n_ref[...], r_ref[...] if st.has_r else None,
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


def _bwd_blocks(st, u, n, beta, r, o, ds, g_ds, tables, lam_blocks, ok, grads):
  """The per-token gradients of every block that `_bwd_kernel` ran as a chain (ok), in parallel, grid
  (B, G, NB), from each block's λ_L; the other rows of du, dβ, dn, dr are the sequential kernel's (the four
  arrays are updated in place). Returns (du, dβ, dn, dr, per-block ∂d_init [B, NB, G, K] or None)."""
  b, g, k = st.batch, st.heads, st.key_dim
  nb = st.length // st.solve_t
  spec = osdn_tables.block_specs(st)
  rows, scal, square, vec_l, vec_k = (spec[x] for x in ("rows", "scal", "square", "vec", "vec_k"))
  du, dbeta, dn, dr = grads
  has = lambda x: x is not None
  args = [u, ds, g_ds, beta, n] + ([r] if st.has_r else []) + ([o] if st.has_o else []) + list(tables) + \
      [lam_blocks, ok] + [x for x in (du, dbeta, dn, dr) if has(x)]
  in_specs = [rows, rows, rows, scal, scal] + ([scal] if st.has_r else []) + \
      ([spec["param"]] if st.has_o else []) + \
      [square, vec_l] + ([square] if st.has_r else []) + \
      [vec_k, pl.BlockSpec((_SQ, nb, _SQ), lambda b, g, i: (b, 0, g))] + \
      [rows, scal, scal] + ([scal] if st.has_r else [])
  n_grads = 3 + st.has_r
  first = len(args) - n_grads
  out_specs = [rows, scal, scal] + ([scal] if st.has_r else []) + ([vec_k] if st.has_o else [])
  out_shape = [jax.ShapeDtypeStruct(x.shape, F32) for x in (du, dbeta, dn, dr) if has(x)] + \
      ([jax.ShapeDtypeStruct((b, nb, g, k), F32)] if st.has_o else [])
  outs = pallas_call(
      functools.partial(_bwd_blocks_kernel, st), grid=(b, g, nb), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, interpret=st.interpret, num_warps=st.blocks.warps_solve,
      num_stages=st.blocks.num_stages, name="osdn_d_pass_bwd_blocks",
      input_output_aliases={first + i: i for i in range(n_grads)})(*args)
  outs = list(outs)
  du, dbeta, dn = outs[:3]
  dr = outs[3] if st.has_r else None
  return du, dbeta, dn, dr, (outs[-1] if st.has_o else None)


def _split_outs(st, outs):
  outs = list(outs)
  du, dbeta, dn = outs[:3]
  rest = outs[3:]
  dr = rest.pop(0) if st.has_r else None
  dd1 = rest.pop(0)
  do = rest.pop(0) if st.has_o else None
  return du, dbeta, dn, dr, dd1, do


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _d_pass(st: Static, u, n, beta, r, codes, d1, o):
  return tuple(_forward(st, u, n, beta, r, codes, d1, o)[1][:2])


def _d_pass_fwd(st, u, n, beta, r, codes, d1, o):
  saved, (ds, d_last, *smooth) = _forward(st, u, n, beta, r, codes, d1, o, differentiated=True)
  return (ds, d_last), (u, n, beta, r, codes, o, ds, smooth[0] if smooth else None, saved)


def _d_pass_bwd(st, res, cts):
  u, n, beta, r, codes, o, ds, smooth, saved = res
  g_ds, g_last = cts
  du, dn, dbeta, dr, dd1, do = _backward(st, u, n, beta, r, codes, o, ds, smooth, saved, g_ds, g_last)
  return du, dn, dbeta, dr, None, dd1, do


_d_pass.defvjp(_d_pass_fwd, _d_pass_bwd)


# ---------------------------------------------------------------------------------------------------------
# Entry point.
# ---------------------------------------------------------------------------------------------------------
def _pad_last(x, size):
  return x if x.shape[-1] == size else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def _segment_codes(segment_ids, count: int):
  """[B, T] int32 codes (segment << 2 | last token << 1 | first token; segments past `count` clamped) and
  present [count] bool (the segment has tokens)."""
  first = packing.segment_starts(segment_ids)
  last = jnp.concatenate([first[:, 1:], jnp.ones(first.shape[:1] + (1,), bool)], axis=1)
  seg = jnp.minimum(packing.segment_index(segment_ids), count - 1)
  present = jnp.zeros((count,), bool).at[seg].set(True)
  return (seg << 2) | (last.astype(jnp.int32) << 1) | first.astype(jnp.int32), present


@functools.partial(jax.jit, static_argnames=("eta", "d_min", "d_max", "mode", "blocks", "interpret"))
def _run(u, n, beta, r, d1, d_init, segment_ids, *, eta, d_min, d_max, mode, blocks, interpret):
  b, t, g, kd = u.shape
  kp = padded_dim(kd)
  count = d1.shape[0] if segment_ids is not None else 0
  st = Static(batch=b, length=t, heads=g, key_dim=kp, channels=kd, eta=eta, d_min=d_min, d_max=d_max, mode=mode,
              blocks=blocks, interpret=interpret, segments=count)
  f32 = lambda x: None if x is None else jnp.asarray(x, F32)
  # Padded channels have u = 0: they never reach ⟨d, u⟩, and their d is sliced off.
  u, d1 = _pad_last(f32(u), kp), _pad_last(f32(d1), kp)
  o = _pad_last(jnp.broadcast_to(f32(d_init), (g, kd)), kp) if mode == "init" else None
  codes, present = None, None
  if count:      # rows of segments without tokens are neither read nor written by the kernels: zeros
    codes, present = _segment_codes(segment_ids, count)
    d1 = jnp.where(present[:, None, None], d1, 0.0)
  ds, d_last = _d_pass(st, u, f32(n), f32(beta), f32(r) if mode != "none" else None, codes, d1, o)
  if count:
    d_last = jnp.where(present[:, None, None], d_last, 0.0)
  return ds[..., :kd], d_last[..., :kd]


def _static_bound(name, x):
  if x is None:
    return None
  try:
    return float(x)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise ValueError(f"osdn d_pass (pallas gpu): `{name}` must be a static number, got {x!r}") from e


def d_pass(u, n, beta, retention, d1, d_init, *, eta, d_min, d_max, anchor, segment_ids=None,
           blocks: DPassBlocks | None = None, interpret: bool | None = None):
  """OSDN's sequential d-pass with the Pallas kernels (Triton on GPU, interpret mode on CPU).

  The signature and results of the unpacked `osdn_jax.dgps.precond._osdn_serial`:
    u [B, T, G, K] (k ⊙ k), n [B, T, G] (max(‖k‖², 1e-12)), beta [B, T, G], retention None (r ≡ 1) or
    [B, T, G], d1 [B, G, K] (the d of token 1), d_init [G, K] (or broadcastable; used by anchor "init" with
    a retention); eta, d_min, d_max static numbers (bounds None: unbounded); anchor "zero" | "init".
  Returns (ds [B, T, G, K], d_{T+1} [B, G, K]), fp32. Differentiable w.r.t. u, n, beta, retention, d1 and
  d_init (zero gradient through clipped entries). Packed (`segment_ids` [B, T], as the packed `_osdn_serial`):
  d1 is [N, G, K], d restarts from d1[n] at segment n's first token, and the second result is each segment's
  last d [N, G, K] (zeros for segments without tokens). `interpret` defaults to True on a CPU backend; `blocks`
  to DEFAULT_BLOCKS compiled and INTERPRET_BLOCKS in interpret mode.
  """
  if u.ndim != 4:
    raise ValueError(f"osdn d_pass (pallas gpu): `u` must be [B, T, G, K], got shape {u.shape}")
  b, t, g, kd = u.shape
  if t < 1:
    raise ValueError(f"osdn d_pass (pallas gpu): `u` needs T ≥ 1 tokens, got shape {u.shape}")
  if kd > MAX_KEY_DIM:
    raise ValueError(f"osdn d_pass (pallas gpu): K = {kd} must be ≤ {MAX_KEY_DIM}")
  for name, x in (("n", n), ("beta", beta), ("retention", retention)):
    if x is not None and x.shape != (b, t, g):
      raise ValueError(f"osdn d_pass (pallas gpu): `{name}` must be [B, T, G] = {(b, t, g)}, got {x.shape}")
  if segment_ids is None and d1.shape != (b, g, kd):
    raise ValueError(f"osdn d_pass (pallas gpu): `d1` must be [B, G, K] = {(b, g, kd)}, got {d1.shape}")
  if segment_ids is not None:
    if segment_ids.shape != (b, t):
      raise ValueError(f"osdn d_pass (pallas gpu): `segment_ids` must be [B, T] = {(b, t)}, got "
                       f"{segment_ids.shape}")
    if d1.ndim != 3 or d1.shape[1:] != (g, kd) or d1.shape[0] < 1:
      raise ValueError(f"osdn d_pass (pallas gpu): packed, `d1` must be [N, G, K] with G, K = {(g, kd)}, got "
                       f"{d1.shape}")
  if anchor not in ("zero", "init"):
    raise ValueError(f"osdn d_pass (pallas gpu): `anchor` must be 'zero' or 'init', got {anchor!r}")
  eta = _static_bound("eta", eta)
  d_min, d_max = _static_bound("d_min", d_min), _static_bound("d_max", d_max)
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  if blocks is None:
    blocks = INTERPRET_BLOCKS if interpret else DEFAULT_BLOCKS
  mode = "none" if retention is None else anchor
  return _run(u, n, beta, retention, d1, jnp.asarray(d_init), segment_ids, eta=eta, d_min=d_min, d_max=d_max,
              mode=mode, blocks=blocks, interpret=bool(interpret))


def supports(spec, dtype, chunk_size: int, platform: str) -> bool:
  """Compiled on "gpu", interpret mode on "cpu"; fp32 (the d-pass's compute dtype for fp32 and bf16 keys),
  K ≤ 256 (spec: anything with a `key_dim`, or None), packed or not; chunk_size is ignored."""
  key_dim = getattr(spec, "key_dim", None)
  return (platform in ("gpu", "cpu")
          and jnp.dtype(dtype) == jnp.dtype(F32)
          and (key_dim is None or 1 <= key_dim <= MAX_KEY_DIM))
