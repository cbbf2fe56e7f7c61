"""The block form of the d-pass (`Config(form="blocks")`): L tokens of a head group at once, from dense [N, N]
tables on the MXU, wherever the clip does not act (checked; the kernels run any other block token by token).

Rows: a head group is hg heads of the head block (8 when Hb is a multiple of 8, else all Hb). Its L tokens' rows
of a [C, Hb, K] block, `ref[t0 : t0 + L, h : h + hg]`, reshaped to [N, K] (N = L·hg; a merge of leading dims),
hold token t of head h at row i = t·hg + h. Per-token scalars become [N, 1] columns (`columns`), and where a
table is scaled along its columns, [1, N] rows (`row_of`). Every [N, N] table is zero between rows of different
heads, so a head's [L, L] tables are interleaved with the others' and a product of two tables never mixes heads.

Without the clip the d-pass is a delta rule whose state is one column. With δ = d − o (o = d_init for anchor
"init", else 0), ρ = r (1 without a retention), a = ηβ/n, c = ηβ²/n and, within the block,
    Γ_tj = Π_{j<m<t} ρ_m (t > j, else 0),   P_t = Π_{m<t} ρ_m,   Q_t = Π_{t<m<L} ρ_m,   M = Γ ⊙ U Uᵀ,
the tokens' d_t = o + δ_t, δ_t = P_t δ_0 + Σ_{j<t} Γ_tj coef_j u_j and coef = a − c ⊙ s, s_t = ⟨d_t, u_t⟩, so
z = c ⊙ s solves (I + diag(c) M) z = c ⊙ (U o + M a + P ⊙ U δ_0). With T = (I + diag(c) M)⁻¹ (`unit_inverse`):
    coef = wf − ⟨W_t, δ_0⟩,   wf = a − T (c ⊙ (U o + M a)),   W = T diag(c ⊙ P) U          (`forward_block`)
(T connects rows of one head only, so T (x ⊙ U δ_0) = (T diag(x) U) δ_0 row by row). The adjoint λ_t (the
cotangent of d_t) in reverse, μ_t = λ_{t+1} where the clip's derivative is 1, is the same with Γᵀ:
    μ = Q ⊙ λ_L + Γᵀ (G − q ⊙ U),   q = c ⊙ p = wb + ⟨Wb_t, λ_L⟩   (p_t = ⟨μ_t, u_t⟩),
    Tb = (I + diag(c) (Γᵀ ⊙ U Uᵀ))⁻¹,   wb = Tb (c ⊙ (Γᵀ ⊙ U Gᵀ) 1),   Wb = Tb diag(c ⊙ Q) U      (`backward_block`)
(G: the rows of ∂L/∂ds). Products of retentions are exp of masked sums of log r (`_between`, `_log_sums`), never
differences of cumulative sums, which lose the small products next to a small retention.

Every dot is fp32 at `Precision.HIGHEST` (`common.dot`).
"""
from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import osdn_math as om
from pallas_kernels.tpu import common
from pallas_kernels.tpu.common import F32

_ZERO, _ONE = np.float32(0.0), np.float32(1.0)     # fp32 constants (a Python float is fp64 under x64)


def dot_nt(a, b):
  """a bᵀ [m, n] for a [m, k], b [n, k]: fp32, `Precision.HIGHEST`."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=(lax.Precision.HIGHEST, lax.Precision.HIGHEST),
                         preferred_element_type=F32)


def geometry(hg: int, L: int):
  """Index tables of the [N, N] tables (N = L·hg, row i = t·hg + h): the rows' and columns' tokens ti, tj (int32),
  same (one head), lower (one head, t_i > t_j), upper (one head, t_i < t_j) and eye. The token of index k is
  ⌊(k + ½) / hg⌋ in fp32 (exact for these sizes; no integer division in the kernel)."""
  n = hg * L

  def index(axis):
    k = common.iota((n, n), axis)
    t = jnp.floor((k.astype(F32) + 0.5) * (1.0 / hg)).astype(jnp.int32)
    return t, k - hg * t
  (ti, hi), (tj, hj) = index(0), index(1)
  same = hi == hj
  return types.SimpleNamespace(ti=ti, tj=tj, same=same, lower=same & (ti > tj), upper=same & (ti < tj),
                               eye=same & (ti == tj), length=L)


def columns(x, t0, L: int):
  """x [hg, C] (a head-major block: token τ of head h at [h, τ]) → [L·hg, 1] with x[h, t0 + t] at row t·hg + h;
  t0 an int32 (traced or static). A masked lane sum (no dynamic slice of a vector)."""
  hg, c = x.shape
  pick = common.iota((L, hg, c), 0) + t0 == common.iota((L, hg, c), 2)
  return jnp.sum(jnp.where(pick, x[None], 0.0), axis=2, keepdims=True).reshape(L * hg, 1)


def row_of(col, eye):
  """[N, 1] → [1, N]: the column along lanes (its diagonal matrix summed over sublanes)."""
  return jnp.sum(jnp.where(eye, col, 0.0), axis=0, keepdims=True)


def repeat(v, L: int):
  """[hg, K] → [L·hg, K]: every token's rows hold v (a broadcast along a leading dim, then a merge)."""
  return jnp.broadcast_to(v[None], (L,) + v.shape).reshape((L * v.shape[0], v.shape[1]))


def token_rows(x, L: int, t: int):
  """[L·hg, K] → [hg, K]: the rows of token t (static)."""
  return x.reshape((L, x.shape[0] // L, x.shape[1]))[t]


def _log_sums(lr, mask, eye):
  """[N, 1]: Σ_m lr_m over the m with mask[i, m] (lr [N, 1] the log retentions)."""
  return jnp.sum(jnp.where(mask, row_of(lr, eye), 0.0), axis=1, keepdims=True)


def _between(lr, mask):
  """[N, N]: exp Σ_m lr_m over the m with mask[i, m] and mask[m, j], where mask[i, j], else 0 (mask = lower:
  Γ_ij = Π_{t_j<t_m<t_i} ρ_m; upper: Γᵀ). The masked sums are one dot of a 0/1 table and lr ⊙ that table."""
  m = mask.astype(F32)
  return common.masked_exp(common.dot(m, lr * m), mask)


def retention_tables(geo, r, upper: bool):
  """(Γ or Γᵀ [N, N], P or Q [N, 1] or None) for the retention column r [N, 1] (None: ρ ≡ 1, Γ the 0/1 mask)."""
  mask = geo.upper if upper else geo.lower
  if r is None:
    return mask.astype(F32), None
  lr = jnp.log(r)                           # r = 0: −inf, whose 0 · (−inf) = NaN fails the block's check
  return _between(lr, mask), jnp.exp(_log_sums(lr, mask, geo.eye))


def unit_inverse(a, geo, upper: bool):
  """(I + a)⁻¹ [N, N] for a [N, N] strictly lower (upper: strictly upper) in token order and zero between heads;
  L a power of two. Block inversion from the diagonal up, as `delta_rule.kernel.unit_lower_inverse` does on the
  token bits: X starts as I − a's entries between tokens 2m and 2m + 1 (the inverses of the 2×2 diagonal blocks
  of every head), and each level b turns the inverses of the b×b diagonal blocks into those of the 2b×2b blocks,
  X ← X − X (a_b X), a_b being a masked to the off-diagonal b×b block of every 2b×2b diagonal block (lower left,
  or upper right). log2(L) − 1 levels of two dots."""
  far, near = (geo.tj, geo.ti) if upper else (geo.ti, geo.tj)
  eye = geo.eye.astype(F32)
  x = eye
  b = 1
  while b < geo.length:
    block = geo.same & ((geo.ti ^ geo.tj) < 2 * b) & ((far & b) != 0) & ((near & b) == 0)
    a_b = jnp.where(block, a, 0.0)
    x = eye - a_b if b == 1 else x - common.dot(x, common.dot(a_b, x))
    b *= 2
  return x


def _bad(x):
  """[1, 1] fp32: 1 where x holds a NaN or ±inf, else 0."""
  return jnp.max(jnp.where(jnp.abs(x) < jnp.inf, _ZERO, _ONE), keepdims=True).reshape(1, 1)


def _outside(st, x):
  """[1, 1] fp32: 1 where an entry of x is not strictly inside (d_min, d_max) (a tie with a bound, NaN and ±inf
  included; only finiteness without bounds), else 0."""
  inside = jnp.abs(x) < jnp.inf
  if st.d_min is not None:
    inside = inside & (x > st.d_min)
  if st.d_max is not None:
    inside = inside & (x < st.d_max)
  return jnp.max(jnp.where(inside, _ZERO, _ONE), keepdims=True).reshape(1, 1)


def forward_block(st, u, a, c, r, anchor, d):
  """One head group's block of L = u.shape[0] / hg tokens of the forward from d [hg, K] entering it: (D [N, K] the
  rows d_t, d_L [hg, K] the d entering the next block, bad [1, 1]: 1 unless every input and every d̄_{t+1} is
  finite and every d̄_{t+1} strictly inside (d_min, d_max), where the block's rows and d_L equal the clipped
  recurrence's). u [N, K]; a, c, r [N, 1] (r None: ρ ≡ 1); anchor None (0) or o [hg, K] (anchor "init")."""
  hg = d.shape[0]
  L = u.shape[0] // hg
  geo = geometry(hg, L)
  gamma, P = retention_tables(geo, r, upper=False)
  m = gamma * dot_nt(u, u)
  t = unit_inverse(c * m, geo, upper=False)
  rhs = jnp.sum(m * row_of(a, geo.eye), axis=1, keepdims=True)                          # M a
  o = None if anchor is None else repeat(anchor, L)
  if o is not None:
    rhs = rhs + jnp.sum(u * o, axis=1, keepdims=True)
  wf = a - jnp.sum(t * row_of(c * rhs, geo.eye), axis=1, keepdims=True)
  w = common.dot(t, (c if P is None else c * P) * u)
  # The chain: what depends on d.
  delta = repeat(d if anchor is None else d - anchor, L)
  coef = wf - jnp.sum(w * delta, axis=1, keepdims=True)
  rel = (delta if P is None else P * delta) + common.dot(gamma, coef * u)                # δ_t
  d_bar = (rel if r is None else r * rel) + coef * u
  if o is not None:
    rel, d_bar = o + rel, o + d_bar
  # A non-finite a_t, c_t or r_t makes d̄_{t+1} non-finite too (its coef_t or keep_t is, and 0 · ±inf is NaN).
  return rel, token_rows(d_bar, L, L - 1), jnp.maximum(_outside(st, d_bar), _bad(u))


def backward_block(st, u, ds, g, a, c, r, o, lam):
  """One head group's block of the backward from λ_L [hg, K] (the cotangent of the d entering the next block):
  (μ [N, K] the rows μ_t = λ_{t+1}, λ_0 [hg, K], bad [1, 1]: 1 unless the clip's derivative is 1 at every
  d̄_{t+1} (recomputed from the saved rows ds by `kernel.pre_clip`, as the token loop does) and every input and
  result is finite). u, ds, g [N, K] (g: ∂L/∂ds); a, c, r [N, 1] (r None: ρ ≡ 1); o None or [hg, K]."""
  hg = lam.shape[0]
  L = u.shape[0] // hg
  geo = geometry(hg, L)
  o_rows = None if o is None else repeat(o, L)
  s = jnp.sum(ds * u, axis=-1, keepdims=True)
  d_bar = om.unclipped(ds, u, a - c * s, r, o_rows, st.mode)
  gt, Q = retention_tables(geo, r, upper=True)
  t = unit_inverse(c * (gt * dot_nt(u, u)), geo, upper=True)
  h = jnp.sum(gt * dot_nt(u, g), axis=1, keepdims=True)                               # Σ_{j>t} Γ_jt ⟨u_t, g_j⟩
  wb = jnp.sum(t * row_of(c * h, geo.eye), axis=1, keepdims=True)
  w = common.dot(t, (c if Q is None else c * Q) * u)
  # The chain: what depends on λ_L.
  lam_rows = repeat(lam, L)
  q = wb + jnp.sum(w * lam_rows, axis=1, keepdims=True)                                # c ⊙ p
  mu = (lam_rows if Q is None else Q * lam_rows) + common.dot(gt, g - q * u)
  lam0 = token_rows(g + (mu if r is None else r * mu) - q * u, L, 0)
  bad = jnp.maximum(_outside(st, d_bar), _bad(mu))
  for x in (lam0, g):
    bad = jnp.maximum(bad, _bad(x))
  return mu, lam0, bad
