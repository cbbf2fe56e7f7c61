"""The tables of OSDN's d-pass block solves (see `blocks.block_solve`, `blocks.block_adjoint`): per block of
L = `solve_t` tokens of one (batch, head), everything that depends on the inputs only.

With u_t = k_t ⊙ k_t, n_t, β_t of the block, a_t the retention (1 without APF), α = η β / n, c = η β² / n,
Γ_tj = [t > j] Π_{j<i<t} a_i, M = Γ ⊙ U Uᵀ (strictly lower), P_t = Π_{i<t} a_i, Q_t = Π_{t<i<L} a_i:
    forward:  tf = (I + M diag(c))⁻¹ diag(P),   wf = (I + M diag(c))⁻¹ (M α + U o)      (o = d_init or 0)
    backward: tb = (I + Mᵀ diag(c))⁻¹ diag(Q),  wb = (I + Mᵀ diag(c))⁻¹ (Γᵀ ⊙ U Gᵀ) 1   (G: ∂ds of the block)
and Γ itself (only with a retention). (I + Mᵀ diag(c)) = (I + diag(c) M)ᵀ, so both inverses are unit lower
triangular inverses (I + A)⁻¹ with A = M diag(c) or diag(c) M.

`reference` is the plain-JAX oracle (batched triangular solves over all blocks). `forward` / `backward` are
one Pallas kernel, grid (B, G, NB), one program per block: U Uᵀ as [16, 16] sub-block dots summed over a loop
on K (`_row_products`), (I + A)⁻¹ by 16×16 forward substitution and block merge (`intra.inverse_rows`: no
triangular solve inside kernels), products of retentions as exp of masked sums of log a (never differences of
cumulative sums, which lose the small products next to a zero retention).

Under differentiation the forward can also form the backward's inverse from the same Gram blocks (`forward(...,
differentiated=True)` with `Config.share_inverse`); the backward then only forms its right-hand side
(`_rhs_kernel`). `Config.tables="auto"` runs the kernel for a forward alone and the reference under
differentiation, where XLA's batched triangular solves (cuBLAS on a GPU) beat the kernel's second inverse.

Shapes: u, g_ds [B, T, G, K] (K padded), n, beta, r [B, T, G], o [G, K]; only the first NB·L tokens are used
(NB = T // L); tables [B, NB, G, L, L] and [B, NB, G, L]. fp32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import osdn_math as om
from pallas_kernels.gpu.chunk_math import F32, dot, iota, masked_exp
from pallas_kernels.gpu.common import pallas_call
from pallas_kernels.gpu.intra import inverse_rows
from pallas_kernels.gpu.osdn.layout import block_specs, u_of

SUB = 16                                 # rows of the sub-blocks of the in-kernel inverse


def log_retention(r):
  """log r, clamped at log 1e-30: a zero retention forgets to e^{−69} of d instead of 0."""
  return jnp.log(jnp.maximum(r, 1e-30))


# ---------------------------------------------------------------------------------------------------------
# Reference: plain JAX, every block at once.
# ---------------------------------------------------------------------------------------------------------
def blocks_view(st, x):
  """[B, T, G, ...] → [B, NB, G, L, ...]: the first NB·L tokens as blocks of L = solve_t."""
  L = st.solve_t
  nb = st.length // L
  x = x[:, :nb * L].reshape((x.shape[0], nb, L) + x.shape[2:])
  return jnp.moveaxis(x, 2, 3)


def reference(st, u, n, beta, r, o):
  """(tf, wf, tb, (I + Mᵀ diag(c))⁻¹, Γ) for every block ([B, NB, G, L, L] and wf [B, NB, G, L]); r None: a ≡ 1
  (Γ is then the strict causal mask), o None: 0."""
  hi = lax.Precision.HIGHEST
  U = blocks_view(st, u_of(st, u))
  b, nn = blocks_view(st, beta), blocks_view(st, n)
  L = U.shape[-2]
  ar = jnp.arange(L)
  strict = ar[:, None] > ar[None, :]
  if r is None:
    gamma, P, Q = jnp.where(strict, 1.0, 0.0).astype(F32), None, None
  else:
    la = log_retention(blocks_view(st, r))
    window = (ar[None, :, None] < ar[:, None, None]) & (ar[:, None, None] > ar[None, None, :]) & \
        (ar[None, None, :] > ar[None, :, None])                     # [t, j, i]: j < i < t
    gamma = jnp.where(strict, jnp.exp(jnp.einsum("tji,...i->...tj", window.astype(F32), la, precision=hi)), 0.0)
    P = jnp.exp(jnp.einsum("ti,...i->...t", (ar[None, :] < ar[:, None]).astype(F32), la, precision=hi))
    Q = jnp.exp(jnp.einsum("ti,...i->...t", (ar[None, :] > ar[:, None]).astype(F32), la, precision=hi))
  alpha, c = om.write_coef(st.eta, b, nn), om.erase_coef(st.eta, b, nn)
  M = gamma * jnp.einsum("...tk,...jk->...tj", U, U, precision=hi)
  eye = jnp.eye(L, dtype=F32)
  inv_f = lax.linalg.triangular_solve(eye + M * c[..., None, :], jnp.broadcast_to(eye, M.shape), left_side=True,
                                      lower=True, unit_diagonal=True)
  inv_b = lax.linalg.triangular_solve(eye + jnp.swapaxes(M, -1, -2) * c[..., None, :],
                                      jnp.broadcast_to(eye, M.shape), left_side=True, lower=False,
                                      unit_diagonal=True)
  rhs = jnp.einsum("...tj,...j->...t", M, alpha, precision=hi)
  if o is not None:
    rhs = rhs + jnp.einsum("bngtk,gk->bngt", U, o, precision=hi)
  wf = jnp.einsum("...tj,...j->...t", inv_f, rhs, precision=hi)
  tf = inv_f if P is None else inv_f * P[..., None, :]
  tb = inv_b if Q is None else inv_b * Q[..., None, :]
  return tf, wf, tb, inv_b, gamma


def adjoint_rhs_reference(st, u, g_ds, inv_b, gamma):
  """wb [B, NB, G, L] = (I + Mᵀ diag(c))⁻¹ (Γᵀ ⊙ U Gᵀ) 1."""
  hi = lax.Precision.HIGHEST
  ug = jnp.einsum("...tk,...jk->...tj", blocks_view(st, u_of(st, u)), blocks_view(st, g_ds), precision=hi)
  return jnp.einsum("...tj,...j->...t", inv_b, jnp.sum(jnp.swapaxes(gamma, -1, -2) * ug, axis=-1), precision=hi)


# ---------------------------------------------------------------------------------------------------------
# Kernel: one block of L tokens per program, as SUB-row sub-blocks (register values are never sliced).
# ---------------------------------------------------------------------------------------------------------
def _gamma_block(la, a: int, m: int, s: int):
  """Γ_tj [s, s] for t in sub-block a, j in sub-block m (a ≥ m); la [L] = log a of the block, None: a ≡ 1."""
  mask = (a * s + iota((s, s), 0)) > (m * s + iota((s, s), 1))
  if la is None:
    return jnp.where(mask, 1.0, 0.0).astype(F32)
  L = la.shape[0]
  t, j, i = a * s + iota((s, s, L), 0), m * s + iota((s, s, L), 1), iota((s, s, L), 2)
  return masked_exp(jnp.sum(jnp.where((j < i) & (i < t), la[None, None, :], 0.0), axis=2), mask)


def prefix_products(la, a: int, s: int, before: bool):
  """[s] for the rows t of sub-block a (rows a·s …): Π_{i<t} a_i (before) or Π_{t<i} a_i (else), i < L, from
  la [L] = log a (exp of masked sums: never a difference of cumulative sums, which would lose the small
  products next to a zero retention)."""
  L = la.shape[0]
  t, i = a * s + iota((s, L), 0), iota((s, L), 1)
  return jnp.exp(jnp.sum(jnp.where(i < t if before else i > t, la[None, :], 0.0), axis=1))


def _place(x, a: int, length: int):
  """[length] with x [s] at positions a·s … (zeros elsewhere): a register "concatenation" by masked sums."""
  s = x.shape[0]
  return jnp.sum(jnp.where(iota((s, length), 1) == iota((s, length), 0) + a * s, x[:, None], 0.0), axis=0)


KC = 16                                  # columns per step of the K loop of `_row_products`


def _row_products(pairs, s: int, kdim: int, keys=None):
  """[Σ_c x[a·s + i, c] y[m·s + j, c]]_ij [s, s] for each (x_ref, a, y_ref, m) in pairs (a list in their
  order): one fori_loop over K in chunks of KC columns, so only [s, KC] tiles are live. (A dot over all K at
  once makes Triton's FMA dot hold whole K-rows per thread, which spills registers at K = 128.) keys: the ref
  whose tiles are keys, squared on load (`layout.u_of`), or None."""
  chunks = max(kdim // KC, 1)
  width = kdim // chunks

  def step(j, acc):
    cols = pl.ds(pl.multiple_of(j * width, width), width)
    tiles = {}

    def tile(ref, a):
      if (id(ref), a) not in tiles:
        x = ref[pl.ds(a * s, s), cols].astype(F32)
        tiles[id(ref), a] = x * x if ref is keys else x
      return tiles[id(ref), a]
    return tuple(x + dot(tile(xr, a), tile(yr, m), tb=True) for x, (xr, a, yr, m) in zip(acc, pairs))
  zeros = tuple(jnp.zeros((s, s), F32) for _ in pairs)
  return list(lax.fori_loop(0, chunks, step, zeros))


def _tables_kernel(st, backward: bool, shared: bool, *refs):
  """One block's (tf, wf[, ib][, Γ]) (forward; ib with `shared`) or (tb, wb[, Γ]) (backward)."""
  has_o = st.has_o and not backward
  n_in = 3 + st.has_r + has_o + backward
  u_ref, b_ref, n_ref = refs[:3]
  rest = list(refs[3:n_in])
  r_ref = rest.pop(0) if st.has_r else None
  o_ref = rest.pop(0) if has_o else None
  g_ref = rest.pop(0) if backward else None
  t_ref, w_ref, *outs = refs[n_in:]
  ib_ref = outs.pop(0) if shared else None
  gm = outs
  L, s = st.solve_t, SUB
  nsub = L // s
  rows = lambda a: pl.ds(a * s, s)
  b = [b_ref[rows(a)] for a in range(nsub)]
  n = [n_ref[rows(a)] for a in range(nsub)]
  c = [om.erase_coef(st.eta, bb, nn) for bb, nn in zip(b, n)]
  la = log_retention(r_ref[...]) if st.has_r else None
  gamma = {(a, m): _gamma_block(la, a, m, s) for a in range(nsub) for m in range(a + 1)}
  pairs = list(gamma)                                                # (a, m), m ≤ a
  # The backward's ⟨u_t, g_j⟩ blocks (g rows m ≥ u rows a) share the K loop (one pass over u).
  prods = _row_products([(u_ref, a, u_ref, m) for a, m in pairs] +
                        ([(g_ref, a, u_ref, m) for a, m in pairs] if backward else []), s, st.key_dim,
                        u_ref if st.squared else None)
  M = {am: x * gamma[am] for am, x in zip(pairs, prods)}
  gu = dict(zip(pairs, prods[len(pairs):]))                           # gu[m, a] = G_m U_aᵀ, m ≥ a
  A = {(a, m): (c[a][:, None] * x if backward else x * c[m][None, :]) for (a, m), x in M.items()}
  X = inverse_rows(A, nsub, s)                                        # block rows [s, L] of (I + A)⁻¹
  if gm:
    for a in range(nsub):
      for m in range(nsub):
        gm[0][rows(a), rows(m)] = gamma[a, m] if m <= a else jnp.zeros((s, s), F32)
  if not backward:
    P = None if la is None else sum(_place(prefix_products(la, a, s, True), a, L) for a in range(nsub))
    rhs = []
    for a in range(nsub):
      x = sum(jnp.sum(M[a, m] * om.write_coef(st.eta, b[m], n[m])[None, :], axis=1) for m in range(a + 1))
      if has_o:
        x = x + jnp.sum(u_of(st, u_ref[rows(a), :]) * o_ref[...][None, :], axis=1)
      rhs.append(x)
    rhs = sum(_place(x, a, L) for a, x in enumerate(rhs))
    for a in range(nsub):
      t_ref[rows(a), :] = X[a] if P is None else X[a] * P[None, :]
      w_ref[rows(a)] = jnp.sum(X[a] * rhs[None, :], axis=1)
    if ib_ref is not None:             # the backward's inverse from the same Gram blocks
      Xb = inverse_rows({(a, m): c[a][:, None] * x for (a, m), x in M.items()}, nsub, s)
      for a in range(nsub):
        ib_ref[:, rows(a)] = Xb[a].T
  else:          # (I + Mᵀ diag(c))⁻¹ = Xᵀ: its column block a is X[a]ᵀ
    w_ref[...] = _adjoint_columns([x.T for x in X], gamma, gu, la, s, t_ref)


def _adjoint_columns(xt, gamma, gu, la, s, t_ref):
  """wb [L] = Σ_a xt[a] y_a, y_t = Σ_{j>t} Γ_jt ⟨u_t, g_j⟩ (gu[m, a] = G_m U_aᵀ, m ≥ a), from the column
  blocks xt[a] [L, s] of (I + Mᵀ diag(c))⁻¹; writes tb's column blocks xt[a] diag(Q) to t_ref unless None."""
  wb = 0.0
  for a in range(len(xt)):
    y = sum(jnp.sum(gamma[m, a] * gu[m, a], axis=0) for m in range(a, len(xt)))
    wb = wb + jnp.sum(xt[a] * y[None, :], axis=1)
    if t_ref is not None:
      t_ref[:, pl.ds(a * s, s)] = xt[a] if la is None else xt[a] * prefix_products(la, a, s, False)[None, :]
  return wb


def _rhs_kernel(st, *refs):
  """One block's wb (and tb = ib diag(Q) with a retention; without one tb is ib) from the stored inverse ib:
  the backward table kernel without the Gram blocks ⟨u, u⟩ and the inverse."""
  u_ref, g_ref = refs[:2]
  rest = list(refs[2:])
  r_ref = rest.pop(0) if st.has_r else None
  ib_ref, w_ref, *tb = rest
  L, s = st.solve_t, SUB
  nsub = L // s
  rows = lambda a: pl.ds(a * s, s)
  la = log_retention(r_ref[...]) if st.has_r else None
  pairs = [(a, m) for a in range(nsub) for m in range(a + 1)]
  gamma = {(a, m): _gamma_block(la, a, m, s) for a, m in pairs}
  gu = dict(zip(pairs, _row_products([(g_ref, a, u_ref, m) for a, m in pairs], s, st.key_dim,
                                     u_ref if st.squared else None)))                   # G_a U_mᵀ
  xt = [ib_ref[:, rows(a)] for a in range(nsub)]                   # [L, s]: the column blocks of ib
  w_ref[...] = _adjoint_columns(xt, gamma, gu, la, s, tb[0] if tb else None)


def _shapes(st):
  b, g, L = st.batch, st.heads, st.solve_t
  nb = st.length // L
  return (b, g, nb), *(jax.ShapeDtypeStruct(x, F32) for x in ((b, nb, g, L, L), (b, nb, g, L)))


def _call(st, backward: bool, shared: bool, u, n, beta, r, extra):
  grid, sq, v = _shapes(st)
  spec = block_specs(st)
  rows, scal, square, vec = spec["rows"], spec["scal"], spec["square"], spec["vec"]
  args = [u, beta, n] + ([r] if st.has_r else []) + ([extra] if extra is not None else [])
  in_specs = [rows, scal, scal] + ([scal] if st.has_r else [])
  if extra is not None:
    in_specs.append(rows if backward else spec["param"])
  n_sq = 1 + shared + st.has_r
  return pallas_call(
      functools.partial(_tables_kernel, st, backward, shared), grid=grid, in_specs=in_specs,
      out_specs=[square, vec] + [square] * (n_sq - 1), out_shape=[sq, v] + [sq] * (n_sq - 1),
      interpret=st.interpret, num_warps=st.config.warps_tables, num_stages=1, fp32_dots=st.config.dots_tables,
      name="osdn_d_pass_bwd_tables" if backward else "osdn_d_pass_fwd_tables")(*args)


def _rhs_call(st, u, r, g_ds, inv_b):
  grid, sq, v = _shapes(st)
  spec = block_specs(st)
  rows, scal, square, vec = spec["rows"], spec["scal"], spec["square"], spec["vec"]
  outs = pallas_call(
      functools.partial(_rhs_kernel, st), grid=grid,
      in_specs=[rows, rows] + ([scal] if st.has_r else []) + [square],
      out_specs=[vec] + ([square] if st.has_r else []), out_shape=[v] + ([sq] if st.has_r else []),
      interpret=st.interpret, num_warps=st.config.warps_tables, num_stages=1, fp32_dots=st.config.dots_tables,
      name="osdn_d_pass_bwd_rhs")(*([u, g_ds] + ([r] if st.has_r else []) + [inv_b]))
  return (outs[1] if st.has_r else inv_b), outs[0]


def implementation(st, differentiated: bool) -> str:
  """"kernel" or "xla": `Config.tables`; "auto" is the kernel for a forward alone and the reference under
  differentiation (one jit then shares the Gram blocks between the forward's and the backward's inverse, and
  batched triangular solves beat the kernel's forward substitution there)."""
  if st.config.tables == "auto":
    return "xla" if differentiated else "kernel"
  return st.config.tables


def forward(st, u, n, beta, r, o, differentiated: bool = False):
  """(tf, wf, Γ or None, saved) of every block (see the module docstring); o [G, K] for anchor "init", else None.
  differentiated: the custom_vjp's forward rule; then with `Config.share_inverse` saved holds what
  `backward` reuses, (tb or None, ib, Γ or None): ib [B, NB, G, L, L] = (I + Mᵀ diag(c))⁻¹ from the same Gram
  blocks (the kernel's saved tuple is (None, ib, None): its backward forms tb itself); else saved is None."""
  o = o if st.has_o else None
  share = differentiated and st.config.share_inverse
  if implementation(st, differentiated) == "xla":
    tf, wf, tb, inv_b, gamma = reference(st, u, n, beta, r, o)
    return tf, wf, (gamma if st.has_r else None), ((tb, inv_b, gamma) if share else None)
  tf, wf, *rest = _call(st, False, share, u, n, beta, r, o)
  ib = rest.pop(0) if share else None
  return tf, wf, (rest[0] if rest else None), ((None, ib, None) if share else None)


def backward(st, u, n, beta, r, g_ds, saved=None, gamma=None):
  """(tb, wb, Γ or None) of every block; g_ds [B, T, G, K] the cotangent of ds. With the forward's `saved`
  (and its Γ) only the right-hand side wb is formed (the kernel: `_rhs_kernel`)."""
  if saved is not None:
    tb, inv_b, gamma_ref = saved
    if tb is None:
      tb, wb = _rhs_call(st, u, r, g_ds, inv_b)
    else:
      wb = adjoint_rhs_reference(st, u, g_ds, inv_b, gamma_ref)
    return tb, wb, gamma
  if implementation(st, True) == "xla":
    _, _, tb, inv_b, gamma = reference(st, u, n, beta, r, None)
    return tb, adjoint_rhs_reference(st, u, g_ds, inv_b, gamma), (gamma if st.has_r else None)
  tb, wb, *gm = _call(st, True, False, u, n, beta, r, g_ds)
  return tb, wb, (gm[0] if gm else None)
