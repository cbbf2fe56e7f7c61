"""Block solves of the d-pass: L tokens at once where the clip does not act (checked; else the kernels run the
block token by token), from the tables of `tables.py`.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import osdn_math as om
from pallas_kernels.gpu.chunk_math import dot, iota, last_row
from pallas_kernels.gpu.intra import decay_factor
from pallas_kernels.gpu.osdn import tables


def through(r, L: int):
  """(P, Q) [L] for a block's retentions r [L]: P_t = Π_{i<t} r_i, Q_t = Π_{t<i<L} r_i. Each is exp of a
  masked sum of log r (never a difference of cumulative sums, which would lose the small products next to a
  zero retention)."""
  la = tables.log_retention(r)
  return tables.prefix_products(la, 0, L, True), tables.prefix_products(la, 0, L, False)


def block_solve(st, u, b, n, r, o, d, tf, wf, gamma):
  """L tokens of the forward at once, when the clip does not change any d̄_{t+1} of the block (checked: ok;
  else the block runs token by token).

  Without the clip the block is the rank-one recurrence δ_{t+1} = a_t δ_t + coef_t u_t (δ = d − o, a = r or 1,
  o = d_init for "init", else 0) with coef_t = α_t − c_t s_t, α = η β / n, c = η β² / n, and
  s_t = ⟨d_t, u_t⟩ = ⟨o, u_t⟩ + P_t ⟨δ_0, u_t⟩ + Σ_{j<t} M_tj coef_j (P_t = Π_{i<t} a_i, M = Γ ⊙ U Uᵀ,
  Γ_tj = Π_{j<i<t} a_i): (I + M diag(c)) s = U o + M α + P ⊙ U δ_0. The inverse of that unit lower
  triangular matrix depends on the inputs only, so `tables.forward` forms it for every block in parallel:
  tf = (I + M diag(c))⁻¹ diag(P) and wf = (I + M diag(c))⁻¹ (U o + M α). Here: s = tf U δ_0 + wf and
  D = (d_t)_t = o + P ⊗ δ_0 + (Γ diag(coef)) U, then every d̄_{t+1} = o + a_t (d_t − o) + coef_t u_t is checked
  inside [d_min, d_max] (NaN fails; padded channels are not checked). Returns (D [L, K], d_L [K], ok, smooth):
  smooth when, besides, the clip's derivative is 1 at every d̄_{t+1} (strictly inside the bounds;
  `osdn_math.clip_grad`), which is what the split backward's block path needs (`block_chain`, `_bwd_blocks`).

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
  coef = om.step_coef(st.eta, b, n, s)
  prop = delta0[None, :] if r is None else through(r, L)[0][:, None] * delta0[None, :]
  D = anchor[None, :] + prop + dot(gamma * coef[None, :], u)
  keep = D if r is None else anchor[None, :] + r[:, None] * (D - anchor[None, :])
  d_bar = keep + coef[:, None] * u
  # One reduction for both checks: 2 outside the bounds (or NaN), 1 on a bound, 0 strictly inside.
  code = jnp.where((d_bar > lo) & (d_bar < hi), 0.0, jnp.where((d_bar >= lo) & (d_bar <= hi), 1.0, 2.0))
  real = st.real(code.shape)
  worst = jnp.max(code if real is None else jnp.where(real, code, 0.0))
  return D, om.clip(last_row(d_bar), st.d_min, st.d_max), worst < 2.0, worst < 1.0


def block_end(st, u, b, n, r, tf, wf, o, d):
  """d_L [K], the d entering the next block, from d [K] entering this one, assuming the clip does not act in
  the block (`block_solve` checks that): the dependency chain of `block_solve` alone. With s = tf U δ_0 + wf
  and coef = α − c ⊙ s as there, δ_L = P_L δ_0 + Σ_j Q_j coef_j u_j (P_L = Π_{i<L} a_i, Q_j = Π_{j<i<L} a_i).
  u [L, K], b, n, r [L] (r None: a ≡ 1), tf [L, L], wf [L], o [K] or None."""
  anchor = jnp.zeros_like(d) if o is None else o
  delta0 = d - anchor
  s = jnp.sum(tf * jnp.sum(u * delta0[None, :], axis=1)[None, :], axis=1) + wf
  coef = om.step_coef(st.eta, b, n, s)
  if r is not None:
    L = u.shape[0]
    la = tables.log_retention(r)
    coef = coef * tables.prefix_products(la, 0, L, False)
    delta0 = jnp.exp(jnp.sum(la)) * delta0
  return anchor + delta0 + jnp.sum(coef[:, None] * u, axis=0)


def block_map(st, u, b, n, r, tf, wf, M, m):
  """(M_b M, M_b m + m_b): the block's unclipped map composed after the map (M, m), where δ_L = M_b δ_0 + m_b is
  `block_end` in δ = d − o. With s = tf U δ_0 + wf and coef = α − c ⊙ s as there (α = η β / n, c = η β² / n):
      M_b = P_L I − Uᵀ diag(Q ⊙ c) tf U,      m_b = Uᵀ (Q ⊙ (α − c ⊙ wf))
  (P_L = Π_{i<L} a_i, Q_j = Π_{j<i<L} a_i; a ≡ 1 without a retention). M_b M is three products: Y = U M,
  Z = tf Y, then P_L M − (diag(Q ⊙ c) U)ᵀ Z; M_b m + m_b is `block_end` of m with the anchor 0 (wf holds U o
  already). u [L, K], b, n, r [L] (r None: a ≡ 1), tf [L, L], wf [L], M [K, K], m [K]."""
  return _compose_matrix(st, u, b, n, r, tf, M, False), block_end(st, u, b, n, r, tf, wf, None, m)


def _compose_matrix(st, u, b, n, r, table, X, inclusive):
  """P_L X − Uᵀ diag(Π ⊙ c) table U X, the matrix part of `block_map` (Π = Q, table = tf) and of
  `block_map_adjoint` (Π = P, table = tb, inclusive): three products, Y = U X, Z = table Y, then the update."""
  w = om.erase_coef(st.eta, b, n)
  keep = X
  if r is not None:
    la = tables.log_retention(r)
    w = w * tables.prefix_products(la, 0, u.shape[0], inclusive)
    keep = jnp.exp(jnp.sum(la)) * X
  return keep - dot(w[:, None] * u, dot(table, dot(u, X)), ta=True)


def block_adjoint(st, u, d, g, b, n, r, o, lam, tb, wb, gamma):
  """L tokens of the backward at once, when the clip's derivative is 1 for every channel and token of the
  block (every d̄_{t+1} strictly inside the bounds, padded channels aside: checked, ok; else the block runs
  token by token). The forward saved the d_t, so d̄_{t+1} is known for every token at once.

  Then the adjoint λ_t = a_t λ_{t+1} − c_t p_t u_t + g_t (λ_t the cotangent of d_t, g_t that of output row t,
  p_t = ⟨u_t, λ_{t+1}⟩) is the rank-one recurrence in reverse: (I + Mᵀ diag(c)) p = Q ⊙ U λ_L + (Γᵀ ⊙ U Gᵀ) 1
  (Q_t = Π_{t<i<L} a_i), with tb = (I + Mᵀ diag(c))⁻¹ diag(Q) and wb = (I + Mᵀ diag(c))⁻¹ (Γᵀ ⊙ U Gᵀ) 1 from
  `tables.backward`, and Λ = (λ_{t+1})_t = Q ⊗ λ_L + Γᵀ (G − (c ⊙ p) ⊗ U) is one [L, L] × [L, K]
  product. Returns the kernel's per-token gradients (du [L, K], dβ, dn [L], dr [L] or None), the block's
  share of d_init's gradient ([K] or None), λ_0 [K] and ok.

  u, d, g [L, K] (d: the d_t the forward saved), b, n, r [L] (r None: a ≡ 1), o [K] or None, lam [K] (λ_L),
  tb [L, L], wb [L], gamma [L, L] or None (r None).
  """
  L, K = u.shape
  anchor = jnp.zeros_like(lam) if o is None else o
  s, coef, good = adjoint_check(st, d, u, b, n, r, anchor)
  c = om.erase_coef(st.eta, b, n)
  ok = True if good is None else jnp.sum(jnp.where(good, 0.0, 1.0)) == 0.0
  if r is None:
    gamma = decay_factor(None, L, strict=True)
  p = jnp.sum(tb * jnp.sum(u * lam[None, :], axis=1)[None, :], axis=1) + wb
  cp = c * p
  prop = lam[None, :] if r is None else through(r, L)[1][:, None] * lam[None, :]
  mu = prop + dot(gamma.T, g - cp[:, None] * u)                       # rows λ_{t+1}
  du = coef[:, None] * mu - cp[:, None] * d
  dbeta, dn = om.step_coef_grads(st.eta, b, n, s, coef, p)
  dr = None if r is None else jnp.sum((d - anchor[None, :]) * mu, axis=1)
  d_o = None if not st.has_o else jnp.sum((1.0 - r)[:, None] * mu, axis=0)
  lam_t = (mu if r is None else r[:, None] * mu) - cp[:, None] * u + g
  lam0 = jnp.sum(jnp.where(iota((L, K), 0) == 0, lam_t, 0.0), axis=0)
  return du, dbeta, dn, dr, d_o, lam0, ok


def block_chain(st, u, g, b, n, r, lam, tb, wb, gamma):
  """λ_0 [K] of a block whose clip derivative is 1 throughout, from λ_L (lam): the dependency chain of
  `block_adjoint` alone. Only row 0 of Λ is needed: μ_0 = Q_0 λ_L + Σ_j Γ_j0 (g_j − c_j p_j u_j), then
  λ_0 = a_0 μ_0 − c_0 p_0 u_0 + g_0 (a ≡ 1 without a retention). u, g [L, K], b, n, r [L] (r None: a ≡ 1),
  tb [L, L], wb [L], gamma [L, L] or None."""
  L = u.shape[0]
  first = lambda x: jnp.sum(jnp.where(iota(x.shape, 0) == 0, x, 0.0), axis=0)
  p = jnp.sum(tb * jnp.sum(u * lam[None, :], axis=1)[None, :], axis=1) + wb
  cp = om.erase_coef(st.eta, b, n) * p
  rest = g - cp[:, None] * u
  if r is None:                                    # Γ_j0 = 1 for j > 0: λ_0 = λ_L + Σ_j (g_j − c_j p_j u_j)
    return lam + jnp.sum(rest, axis=0)
  col0 = jnp.sum(jnp.where(iota((L, L), 1) == 0, gamma, 0.0), axis=1)         # Γ_j0 (0 at j = 0)
  mu0 = first(through(r, L)[1]) * lam + jnp.sum(col0[:, None] * rest, axis=0)
  return first(r) * mu0 + first(rest)


def block_map_adjoint(st, u, g, b, n, r, tb, wb, gamma, A, a):
  """(A_b A, A_b a + a_b): the block's map composed after the map (A, a), where λ_0 = A_b λ_L + a_b is
  `block_chain`. With p = tb U λ_L + wb as there, λ_0 = P_L λ_L + Σ_j P_j (g_j − c_j p_j u_j) (P_j = Π_{i<j} a_i,
  so a_0 Q_0 = P_L and a_0 Γ_j0 = P_j), hence
      A_b = P_L I − Uᵀ diag(P ⊙ c) tb U,      a_b = Σ_j P_j (g_j − c_j wb_j u_j)
  (c = η β² / n; a ≡ 1 without a retention). A_b A is three products as in `block_map`; A_b a + a_b is
  `block_chain` of a. u, g [L, K], b, n, r [L] (r None: a ≡ 1), tb [L, L], wb [L], gamma [L, L] or None, A [K, K],
  a [K]."""
  return _compose_matrix(st, u, b, n, r, tb, A, True), block_chain(st, u, g, b, n, r, a, tb, wb, gamma)


def adjoint_check(st, d, u, b, n, r, anchor):
  """(s, coef [...], good [..., K] or None) for rows d, u [..., K] (b, n, r [...]; r None: a ≡ 1; anchor [K]):
  good where the clip's derivative at d̄_{t+1} is 1 or the channel is padding; None without bounds."""
  s = jnp.sum(d * u, axis=-1)
  coef = om.step_coef(st.eta, b, n, s)
  # Anchor "zero" passes a zero anchor: the "init" form is then its d̄ too.
  d_bar = om.unclipped(d, u, coef[..., None], None if r is None else r[..., None], anchor, "init")
  mask = om.clip_grad(d_bar, st.d_min, st.d_max)
  if mask is None:
    return s, coef, None
  real = st.real(mask.shape)
  return s, coef, (mask == 1.0) if real is None else (mask == 1.0) | ~real
