"""In-kernel building blocks shared by the forward and backward kernels (Triton-lowerable register math).

A chunk of C tokens is handled as n = C / s sub-blocks of s rows (s = 16 by default): every C×C quantity
(the Gram A, T = (I + A)⁻¹, the intra-chunk scores and their gradients) is a dict of s×s register blocks
{(a, b): block} for b ≤ a, and every C×K quantity a list of n s×K blocks. Sub-blocks are read from refs at
static offsets, so no value is ever sliced or updated in place (the Triton lowering has no slice of values).
Everything here uses only iota masks, `jnp.where`, reductions, elementwise math and 2-D dots with every dim
≥ 16 and fp32 accumulation.

Decayed pair products (DESIGN.md §2): P_ij = Σ_c x_ic y_jc e^{G_ic − G_jc} for j ≤ i, with G the
inclusive in-chunk cumsum of the log-decay (non-increasing). Scalar decay: a masked s×s factor e^{G_i − G_j},
formed from a difference masked before exp. Per-channel decay: off-diagonal sub-blocks (a > b) through the
reference row r = a·s − 1 (both factors e^{G_a − G_r} and e^{G_r − G_b} are ≤ 1); diagonal sub-blocks
pairwise, one column j at a time with the exponent masked before exp.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
BF16 = jnp.bfloat16
_HI = lax.Precision.HIGHEST


def iota(shape, dim):
  return lax.broadcasted_iota(jnp.int32, shape, dim)


def dot(a, b, *, ta: bool = False, tb: bool = False):
  """a @ b (aᵀ / bᵀ when ta / tb) with fp32 accumulation.

  Two bf16 operands multiply in bf16 (products are exact in fp32); anything else runs in fp32 at HIGHEST
  precision (IEEE fp32 in Triton, not TF32).
  """
  if not (a.dtype == BF16 and b.dtype == BF16):
    a, b = a.astype(F32), b.astype(F32)
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=(_HI, _HI), preferred_element_type=F32)


def masked_exp(diff, mask):
  """exp(diff) where mask else 0, masked before exp (no inf, no 0·inf in gradients)."""
  return jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)


def take_row(x, i):
  """Row i (static or traced) of a 2-D register value, as a 1-D value."""
  return jnp.sum(jnp.where(iota(x.shape, 0) == i, x, 0.0), axis=0)


def take_col(x, j):
  return jnp.sum(jnp.where(iota(x.shape, 1) == j, x, 0.0), axis=1)


def last_row(x):
  """The last row of a [s] (→ scalar) or [s, K] (→ [K]) register value."""
  return jnp.sum(jnp.where(iota(x.shape, 0) == x.shape[0] - 1, x, 0.0), axis=0)


def sub_rows(ref, a, s):
  """Rows a·s … a·s + s − 1 of a block ref (static a)."""
  return ref[a * s:(a + 1) * s] if len(ref.shape) == 1 else ref[a * s:(a + 1) * s, :]


def row_scale(x, f):
  """x [s, K] times a per-row ([s]) or per-element ([s, K]) factor; f None means 1."""
  if f is None:
    return x
  return x * (f[:, None] if f.ndim == 1 else f)


# ---------------------------------------------------------------------------------------------------------
# (I + A)⁻¹ for the strictly lower block-triangular A given as s×s blocks.
# ---------------------------------------------------------------------------------------------------------
def invert_unit_lower(lower):
  """(I + L)⁻¹ of a strictly lower s×s register block, by forward substitution one row at a time.

  Row i of X = (I + L)⁻¹ is e_i − Σ_{j<i} L_ij X_j; rows ≥ i of X are still identity rows and meet zeros
  of L.
  """
  s = lower.shape[0]
  rows, cols = iota((s, s), 0), iota((s, s), 1)

  def body(i, x):
    l_i = take_row(lower, i)                                             # [s], zero from column i on
    new = jnp.where(iota((s,), 0) == i, 1.0, 0.0) - jnp.sum(l_i[:, None] * x, axis=0)
    return jnp.where(rows == i, new[None, :], x)

  return lax.fori_loop(1, s, body, jnp.where(rows == cols, 1.0, 0.0).astype(F32))


def invert_blocks(A, n):
  """T = (I + A)⁻¹ for A = {(a, b): s×s} (b ≤ a; diagonal blocks strictly lower) → {(a, b): s×s}.

  Diagonal blocks by forward substitution, then the block merge T_ab = −X_a Σ_{b≤m<a} A_am T_mb.
  """
  T = {}
  for a in range(n):
    x = invert_unit_lower(A[a, a])
    T[a, a] = x
    for b in range(a):
      acc = dot(A[a, b], T[b, b])
      for m in range(b + 1, a):
        acc = acc + dot(A[a, m], T[m, b])
      T[a, b] = -dot(x, acc)
  return T


# ---------------------------------------------------------------------------------------------------------
# Decay of one chunk, as per-sub-block values.
# ---------------------------------------------------------------------------------------------------------
class ChunkDecay:
  """The inclusive in-chunk log-decay cumsum G of one chunk, split into n sub-blocks.

  kind "none": no decay; "scalar": G blocks [s]; "channel": G blocks [s, K] (fp32).
  """

  def __init__(self, kind: str, g_ref, s: int, n: int):
    self.kind, self.s, self.n = kind, s, n
    self.G = None if kind == "none" else [sub_rows(g_ref, a, s).astype(F32) for a in range(n)]

  def rows(self, a):
    """e^{G_a}: [s] or [s, K] (None without decay)."""
    return None if self.G is None else jnp.exp(self.G[a])

  def last(self):
    """G at the chunk's last row: scalar or [K]."""
    return last_row(self.G[self.n - 1])

  def to_end(self, a):
    """e^{G_C − G_a}: [s] or [s, K] (None without decay)."""
    if self.G is None:
      return None
    gl = self.last()
    return jnp.exp(gl - self.G[a]) if self.kind == "scalar" else jnp.exp(gl[None, :] - self.G[a])

  def ref(self, a):
    """The reference row of per-channel sub-block a > 0: G at row a·s − 1, [K]."""
    return last_row(self.G[a - 1])


# ---------------------------------------------------------------------------------------------------------
# Decayed pair products between sub-blocks, and their gradients.
# ---------------------------------------------------------------------------------------------------------
def _diag_mask(s, strict):
  rows, cols = iota((s, s), 0), iota((s, s), 1)
  return rows > cols if strict else rows >= cols


class Pairs:
  """P_ij = Σ_c x_ic y_jc e^{G_ic − G_jc} (j ≤ i, or j < i when strict) between sub-blocks of a chunk.

  `mm` is the operand dtype of the dots whose operands carry a decay factor or a gradient weight (bf16 in the
  low-precision mode); `scores(..., exact=True)` keeps them fp32 (the Gram that builds T). Products of raw
  inputs are exact in either dtype.
  """

  def __init__(self, decay: ChunkDecay, mm=F32):
    self.d, self.mm = decay, mm
    self.s, self.n = decay.s, decay.n

  def _lo(self, x):
    return x.astype(self.mm)

  def _gamma(self, a, b, strict=False):
    """Scalar / no decay: the s×s factor (mask and e^{G_i − G_j}) of block (a, b); None when all ones."""
    d, s = self.d, self.s
    if a == b:
      mask = _diag_mask(s, strict)
      if d.kind == "none":
        return jnp.where(mask, 1.0, 0.0).astype(F32)
      return masked_exp(d.G[a][:, None] - d.G[a][None, :], mask)
    if d.kind == "none":
      return None
    return jnp.exp(d.G[a][:, None] - d.G[b][None, :])        # b < a: exponent ≤ 0

  def _offdiag_factors(self, a, b):
    """Per channel, a > b: (e^{G_a − G_r}, e^{G_r − G_b}) with r = a·s − 1, both ≤ 1."""
    r = self.d.ref(a)[None, :]
    return jnp.exp(self.d.G[a] - r), jnp.exp(r - self.d.G[b])

  def scores(self, x, y, a, b, strict=False, exact=False):
    """P_ab [s, s] for x, y lists of [s, K] sub-blocks (raw inputs multiply in their own dtype)."""
    if self.d.kind != "channel":
      p = dot(x[a], y[b], tb=True)
      g = self._gamma(a, b, strict)
      return p if g is None else p * g
    if a > b:
      fa, fb = self._offdiag_factors(a, b)
      lo = (lambda z: z) if exact else self._lo
      return dot(lo(x[a].astype(F32) * fa), lo(y[b].astype(F32) * fb), tb=True)
    return self._diag_scores(x[a].astype(F32), y[a].astype(F32), self.d.G[a], strict)

  def _diag_scores(self, x, y, G, strict):
    s = self.s
    rk, cols = iota(x.shape, 0), iota((s, s), 1)

    def body(j, p):
      keep = rk > j if strict else rk >= j
      e = masked_exp(G - take_row(G, j)[None, :], keep)                 # e^{G_i − G_j}, i ≥ j (or >)
      col = jnp.sum(x * take_row(y, j)[None, :] * e, axis=1)
      return jnp.where(cols == j, col[:, None], p)

    return lax.fori_loop(0, s, body, jnp.zeros((s, s), F32))

  def grads(self, dx_ws, y, dy_terms):
    """Gradients of Σ_ab ⟨w_ab, P_ab⟩ through the pair products.

    dx_ws: list of weight dicts {(a, b): [s, s]} (b ≤ a), all contracted with the same y: returns, per dict,
      dx_a = Σ_{b≤a} Σ_j w_ij y_jc e^{G_ic − G_jc} as a list of [s, K] blocks.
    dy_terms: list of (weights, x) pairs: returns dy_b = Σ_terms Σ_{a≥b} Σ_i w_ij x_ic e^{G_ic − G_jc}.
    Diagonal weights must already carry their triangular mask where it matters (the diagonal e^{G_i − G_j}
    is taken for i ≥ j).
    """
    n, d = self.n, self.d
    y = [v.astype(F32) for v in y]
    dy_terms = [(ws, [v.astype(F32) for v in xs]) for ws, xs in dy_terms]
    dxs = [[None] * n for _ in dx_ws]
    dy = [None] * n
    add = lambda acc, v: v if acc is None else acc + v
    for a in range(n):
      if d.kind == "channel":
        parts = self._diag_grads(d.G[a], y[a], [ws[a, a] for ws in dx_ws],
                                 [(ws[a, a], xs[a]) for ws, xs in dy_terms])
        for m, part in enumerate(parts[0]):
          dxs[m][a] = part
        dy[a] = add(dy[a], parts[1])
        for b in range(a):
          fa, fb = self._offdiag_factors(a, b)
          yb = self._lo(y[b] * fb)
          for m, ws in enumerate(dx_ws):
            dxs[m][a] = dxs[m][a] + dot(self._lo(ws[a, b]), yb) * fa
          t = None
          for ws, xs in dy_terms:
            t = add(t, dot(self._lo(ws[a, b]), self._lo(xs[a] * fa), ta=True))
          dy[b] = add(dy[b], t * fb)
      else:
        for b in range(a + 1):
          g = self._gamma(a, b)
          ws_g = [self._lo(ws[a, b] if g is None else ws[a, b] * g) for ws in dx_ws]
          for m, w in enumerate(ws_g):
            dxs[m][a] = add(dxs[m][a], dot(w, self._lo(y[b])))
          for ws, xs in dy_terms:
            w = self._lo(ws[a, b] if g is None else ws[a, b] * g)
            dy[b] = add(dy[b], dot(w, self._lo(xs[a]), ta=True))
    return dxs, dy

  def _diag_grads(self, G, y, dx_ws, dy_terms):
    s = self.s
    rk, cols = iota(y.shape, 0), iota((s, s), 1)
    kdim = y.shape[1]

    def body(j, carry):
      dxs, dy = carry
      e = masked_exp(G - take_row(G, j)[None, :], rk >= j)              # e^{G_i − G_j}, i ≥ j
      t = take_row(y, j)[None, :] * e
      dxs = tuple(acc + take_col(w, j)[:, None] * t for acc, w in zip(dxs, dx_ws))
      row = None
      for w, x in dy_terms:
        r = jnp.sum(take_col(w, j)[:, None] * x * e, axis=0)
        row = r if row is None else row + r
      dy = jnp.where(rk == j, row[None, :], dy)
      return dxs, dy

    zeros = jnp.zeros((s, kdim), F32)
    dxs, dy = lax.fori_loop(0, s, body, (tuple(zeros for _ in dx_ws), zeros))
    return list(dxs), dy
