"""In-kernel math of the default kernels: whole-chunk scores, T = (I + A)⁻¹ as block rows, per-channel
sub-blocks read from refs.

Decay none / scalar: every C×C score matrix is ONE dot ([C, K] × [K, C]) times a masked pairwise factor
Γ_ij = [i ≥ j] e^{G_i − G_j} (exponent masked before exp; [i > j] for the strict Gram).

Per-channel decay (docs/design.md §2), on s×s sub-blocks (s = `Chunks.sub`, n = C / s of them):
* off-diagonal (a > b): factored through the reference row r_a = a·s − 1, both factors ≤ 1:
  P_ab = (x_a ⊙ e^{G_a − r_a}) (y_b ⊙ e^{r_a − G_b})ᵀ; the row factor is computed once per row block a;
* diagonal: factored through the block's middle row m_a, (x_a ⊙ e^{G_a − m_a})(y_a ⊙ e^{m_a − G_a})ᵀ masked,
  when every factor is ≤ e^40 (`Channel.factored_ok`, checked per program at run time: decays down to about
  −5 per token at s = 16); otherwise pairwise, as [s, s, kc] tensors e^{G_ic − G_jc} over K chunks of kc
  columns (exponent masked before exp), reduced over the channel (scores) or over a pair index (gradients).
  Either way no sequential loop over columns, no in-register row extraction.
Rows of refs (the reference row, K chunks) are read from the refs, never sliced out of register values.

T = (I + A)⁻¹ (A strictly lower, given as s×s blocks): the n diagonal blocks are inverted by forward
substitution in ONE loop (n independent chains per step), then T is built as n block rows [s, C]:
  T_a = X_a (E_a − Σ_{m<a} A_am T_m),   X_a = (I + A_aa)⁻¹,  E_a = the rows a·s … of the identity,
so every later product (W = T·(βK e^G), U = T·(βV)) is a [s, C] × [C, ·] dot. Every dot here that builds T
is an fp32 dot (`chunk_math.dot`: as the launch's `fp32_dots` says when compiled, IEEE in interpret mode).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gpu.chunk_math import F32, dot, iota, masked_exp, take_col

ALL = slice(None)
SAFE_EXPONENT = 40.0   # factored diagonal blocks: every factor ≤ e^40, every intermediate far below fp32's max


def causal(c: int, strict: bool):
  """[c, c] mask: row ≥ column (row > column when strict)."""
  rows, cols = iota((c, c), 0), iota((c, c), 1)
  return rows > cols if strict else rows >= cols


def decay_factor(g, c: int, strict: bool):
  """Γ [c, c]: the causal mask (g None: no decay) or [i ≥ j] e^{g_i − g_j} for a scalar-decay chunk g [c]."""
  mask = causal(c, strict)
  if g is None:
    return jnp.where(mask, 1.0, 0.0).astype(F32)
  return masked_exp(g[:, None] - g[None, :], mask)


def full_scores(x, y, g, strict=False):
  """(x yᵀ) ⊙ Γ [C, C] for x, y [C, K] (raw inputs: bf16 × bf16 or fp32, exact products), g as decay_factor."""
  return dot(x, y, tb=True) * decay_factor(g, x.shape[0], strict)


def load(ref, rows, cols=ALL, dtype=F32):
  """ref[rows, cols] (2-D refs) or ref[rows] (1-D refs), cast to dtype."""
  x = ref[rows] if len(ref.shape) == 1 else ref[rows, cols]
  return x if dtype is None else x.astype(dtype)


def block(a, s):
  """The rows of sub-block a as a static slice."""
  return slice(a * s, (a + 1) * s)


# ---------------------------------------------------------------------------------------------------------
# T = (I + A)⁻¹ as block rows.
# ---------------------------------------------------------------------------------------------------------
def invert_diagonal(blocks):
  """[(I + L_a)⁻¹ for each strictly lower s×s block L_a], by forward substitution, all blocks in one loop.

  Step i sets row i of every X_a to e_i − Σ_{j<i} (L_a)_ij (X_a)_j (rows ≥ i are still identity rows and meet
  zeros of L_a) — the same arithmetic per block as one loop per block, with n independent chains per step.
  Row i of L_a is taken as column i of L_aᵀ (transposed once, before the loop), so that it comes out of its
  reduction already laid out along the rows of X_a (no layout conversion inside the loop).
  """
  s = blocks[0].shape[0]
  rows, cols = iota((s, s), 0), iota((s, s), 1)
  uppers = [lower.T for lower in blocks]

  def body(i, xs):
    e_i = jnp.where(iota((s,), 0) == i, 1.0, 0.0)
    out = []
    for upper, x in zip(uppers, xs):
      l_i = take_col(upper, i)                                           # row i of L_a, zero from column i
      new = e_i - jnp.sum(l_i[:, None] * x, axis=0)
      out.append(jnp.where(rows == i, new[None, :], x))
    return tuple(out)

  eye = jnp.where(rows == cols, 1.0, 0.0).astype(F32)
  return list(lax.fori_loop(1, s, body, tuple(eye for _ in blocks)))


def inverse_rows(A, n: int, s: int):
  """T = (I + A)⁻¹ as n block rows [s, C] (C = n·s), for A = {(a, m): s×s} (m ≤ a; diagonal strictly lower).

  T_a = X_a (E_a − Σ_{m<a} A_am T_m): column block b < a of it is −X_a Σ_{b≤m<a} A_am T_mb (the block
  merge), block a is X_a, blocks > a are zero. fp32 dots.
  """
  c = n * s
  X = invert_diagonal([A[a, a] for a in range(n)])
  rows = []
  for a in range(n):
    z = jnp.where(iota((s, c), 1) == iota((s, c), 0) + a * s, 1.0, 0.0).astype(F32)
    for m in range(a):
      z = z - dot(A[a, m], rows[m])
    rows.append(dot(X[a], z))
  return rows


# ---------------------------------------------------------------------------------------------------------
# Per-channel decay: sub-block scores and pair gradients from refs.
# ---------------------------------------------------------------------------------------------------------
def _diag_exp(G, strict: bool):
  """e^{G_ic − G_jc} [s, s, kc] for one diagonal sub-block's G [s, kc], masked (i ≥ j, or i > j) before exp."""
  s, kc = G.shape
  i3, j3 = iota((s, s, kc), 0), iota((s, s, kc), 1)
  mask = i3 > j3 if strict else i3 >= j3
  return masked_exp(G[:, None, :] - G[None, :, :], mask)


class Channel:
  """Per-channel decay of one chunk: G read from `g_ref` [C, K'] (K' the columns this program sees).

  s, n: sub-block rows and count; kc: the K chunk of the pairwise diagonal tensors (divides K'); factor:
  whether diagonal blocks may be factored (`Diagonal.factor`; False: always pairwise).
  """

  def __init__(self, g_ref, s: int, n: int, kc: int, factor: bool = True):
    self.g_ref, self.s, self.n, self.kc, self.factor = g_ref, s, n, kc, factor
    self.kdim = g_ref.shape[-1]

  def G(self, a, cols=ALL):
    return load(self.g_ref, block(a, self.s), cols)

  def ref_row(self, a, cols=ALL):
    """G at row a·s − 1 (the reference of row block a > 0): [K']."""
    return load(self.g_ref, a * self.s - 1, cols)

  def row_factor(self, a, cols=ALL):
    """e^{G_a − r_a} [s, K'] (≤ 1), the row-side factor of every off-diagonal block in row block a."""
    return jnp.exp(self.G(a, cols) - self.ref_row(a, cols)[None, :])

  def col_factor(self, a, b, cols=ALL):
    """e^{r_a − G_b} [s, K'] (≤ 1, b < a), the column-side factor of block (a, b)."""
    return jnp.exp(self.ref_row(a, cols)[None, :] - self.G(b, cols))

  def _chunks(self):
    return self.kdim // self.kc

  def mid_row(self, a, cols=ALL):
    """G at row a·s + s/2 − 1, the reference m_a of the factored diagonal block a: [K']."""
    return load(self.g_ref, a * self.s + self.s // 2 - 1, cols)

  def factored_ok(self, blocks, cols=ALL):
    """Whether every diagonal block a in `blocks` may be factored through m_a: both factors e^{G_i − m_a} and
    e^{m_a − G_j} ≤ e^{SAFE_EXPONENT} on its rows (G falls along the rows, so the first and last rows
    bound them). A traced bool scalar."""
    worst = None
    for a in blocks:
      m = self.mid_row(a, cols)
      first, last = load(self.g_ref, a * self.s, cols), load(self.g_ref, a * self.s + self.s - 1, cols)
      w = jnp.maximum(jnp.max(first - m), jnp.max(m - last))
      worst = w if worst is None else jnp.maximum(worst, w)
    return worst <= SAFE_EXPONENT

  def _factors(self, a, cols=ALL):
    """(e^{G_a − m_a}, e^{m_a − G_a}) [s, K'] of diagonal block a (bounded when `factored_ok`)."""
    d = self.G(a, cols) - self.mid_row(a, cols)[None, :]
    return jnp.exp(d), jnp.exp(-d)

  def diag_scores(self, x_ref, y_ref, strict: bool, mm=None):
    """[Σ_c x_ic y_jc e^{G_ic − G_jc} (j ≤ i, or j < i)] for every diagonal sub-block a: a list of n [s, s].

    When the chunk's decay allows (`factored_ok`), one dot per block, (x ⊙ e^{G − m})(y ⊙ e^{m − G})ᵀ
    masked; else one loop over K chunks of kc columns, every block's [s, s, kc] pairwise tensor per step.
    `mm` as in `scores` (None: fp32 operands).
    """
    s, n, kc = self.s, self.n, self.kc
    lo = (lambda z: z) if mm is None else (lambda z: z.astype(mm))
    mask = causal(s, strict)

    def factored():
      out = []
      for a in range(n):
        fx, fy = self._factors(a)
        p = dot(lo(load(x_ref, block(a, s)) * fx), lo(load(y_ref, block(a, s)) * fy), tb=True)
        out.append(jnp.where(mask, p, 0.0))
      return tuple(out)

    def step(cols, acc):
      out = []
      for a in range(n):
        e = _diag_exp(self.G(a, cols), strict)
        x, y = load(x_ref, block(a, s), cols), load(y_ref, block(a, s), cols)
        out.append(acc[a] + jnp.sum(x[:, None, :] * y[None, :, :] * e, axis=2))
      return tuple(out)

    def pairwise():
      zeros = tuple(jnp.zeros((s, s), F32) for _ in range(n))
      if self._chunks() == 1:
        return step(ALL, zeros)
      body = lambda i, acc: step(pl.ds(pl.multiple_of(i * kc, kc), kc), acc)
      return lax.fori_loop(0, self._chunks(), body, zeros)

    if not self.factor:
      return list(pairwise())
    return list(lax.cond(self.factored_ok(range(n)), factored, pairwise))

  def scores(self, x_ref, y_ref, strict: bool, mm=None):
    """{(a, b): P_ab [s, s]} for b ≤ a (diagonal: `diag_scores`; off-diagonal factored). `mm` None: fp32
    operands (for the Gram that builds T); else the factored operands are cast to mm."""
    s, n = self.s, self.n
    P = dict(((a, a), p) for a, p in enumerate(self.diag_scores(x_ref, y_ref, strict, mm)))
    lo = (lambda z: z) if mm is None else (lambda z: z.astype(mm))
    for a in range(1, n):
      xa = lo(load(x_ref, block(a, s)) * self.row_factor(a))
      for b in range(a):
        P[a, b] = dot(xa, lo(load(y_ref, block(b, s)) * self.col_factor(a, b)), tb=True)
    return P

  def diag_grads(self, a, cols, y, dx_ws, dy_terms):
    """The diagonal block a's share of the pair gradients, for K columns `cols` (one K chunk).

    y [s, kc] (fp32); dx_ws: weights [s, s] → Σ_j w_ij y_jc e_ijc each; dy_terms: (w [s, s], x [s, kc]) →
    Σ_terms Σ_i w_ij x_ic e_ijc, e_ijc = [i ≥ j] e^{G_ic − G_jc}. Factored when the decay allows
    (`factored_ok`): e_ijc = [i ≥ j] e^{G_ic − m_c} e^{m_c − G_jc}, so each sum is one dot of masked weights.
    """

    def factored():
      fx, fy = self._factors(a, cols)
      keep = causal(self.s, strict=False)
      dxs = [fx * dot(jnp.where(keep, w, 0.0), y * fy) for w in dx_ws]
      dy = None
      for w, x in dy_terms:
        t = fy * dot(jnp.where(keep, w, 0.0), x * fx, ta=True)
        dy = t if dy is None else dy + t
      return dxs, dy

    def pairwise():
      e = _diag_exp(self.G(a, cols), strict=False)
      ye = y[None, :, :] * e
      dxs = [jnp.sum(w[:, :, None] * ye, axis=1) for w in dx_ws]
      dy = None
      for w, x in dy_terms:
        t = jnp.sum(w[:, :, None] * x[:, None, :] * e, axis=0)
        dy = t if dy is None else dy + t
      return dxs, dy

    if not self.factor:
      return pairwise()
    return lax.cond(self.factored_ok([a], cols), factored, pairwise)
