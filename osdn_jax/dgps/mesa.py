"""MesaNet's preconditioner on the query: the ridge-regression read of the offline solve.

Per batch row and value head, with the solve's own gain β_t and scalar log-decay g_t (von Oswald et al., 2025,
"MesaNet: Sequence Modeling by Locally Optimal Test-Time Training"):

    H_t = e^{g_t} H_{t-1} + β_t k_t k_tᵀ          H_0 = 0 or the carried state    [K, K], symmetric, ≥ 0
    q̃_t = (H_t + Λ)⁻¹ q_t                         Λ = diag(λ), λ > 0 per value head and key channel

The offline solve then reads o_t = S_tᵀ(scale · q̃_t) with S_t = e^{g_t} S_{t-1} + β_t k_t v_tᵀ, the minimiser of
the decayed, gained squared error Σ_i (decay) β_i ‖Wᵀk_i − v_i‖² + ‖Λ^{1/2} W‖² applied to q_t.

The system (H_t + Λ) x = q_t is solved by conjugate gradients (CG), `cg_steps` iterations from the Jacobi start
x_0 = q_t / (diag(H_t) + λ); a token stops iterating once its residual satisfies ‖r‖ ≤ cg_tol · ‖q_t‖ and keeps its
iterate (the loop has a static length, and nothing divides by a vanished residual or curvature). The solve is
differentiated implicitly (`jax.lax.custom_linear_solve`): the backward solves (H_t + Λ) y = ∂q̃_t by the same CG,
and the gradient reaching H_t, k, β, g, Λ and H_0 is that of the exact inverse at the returned iterate
(∂H_t = −y xᵀ, ∂Λ = −y ⊙ x, ∂q_t = y). It therefore equals the exact solve's gradient to the CG's accuracy, and
every implementation here (the token-serial CG and the chunked CG) shares it.

Implementations (`implementation`, `osdn_jax.ops.dispatch` names; no Pallas kernel exists, so "auto" runs XLA and
the pallas values raise):
  "reference"  token-serial `lax.scan` carrying H_t; solver "cg" (the same CG per token) or "exact"
               (`jnp.linalg.solve`, for tests, meant for fp64);
  "xla"/"auto" chunkwise: the H states entering each chunk of C tokens by a scan over chunks, then CG for all tokens
               at once, H_t p_t = e^{G_t} H_in p_t + Σ_{j≤t} e^{G_t − G_j} β_j k_j ⟨k_j, p_t⟩ by matmuls within the
               chunk (G the inclusive cumulative log-decay of the chunk, masked to the causal pairs before exp).

Shapes: q, k [B, T, H, K] (expanded to the HV heads of the gates); beta None (β = 1) or [B, T, HV]; log_decay
None or [B, T, HV] (a per-channel decay leaves H_t unsymmetric and is refused); lam [HV, K] (or broadcastable),
positive; initial_state None or [B, HV, K, K]; segment_ids None or [B, T] (packed rows: states [N, HV, K, K] per
segment, `mesa_query`). Returns (q̃ [B, T, HV, K] in q.dtype, H_T [B, HV, K, K] ([N, HV, K, K] packed) in the
compute dtype: fp32, fp64 for fp64 inputs). Log-decays are floored at −30 (docs/design.md §2).
"""
from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from osdn_jax.dgps import checks
from osdn_jax.ops import checks as ops_checks
from osdn_jax.ops import common, dispatch, faults, packing

_HI = lax.Precision.HIGHEST
SOLVERS = ("cg", "exact")
CG_STEPS = 30          # MesaNet's (and FLA's) training and decoding default
CG_TOL = 1e-6          # relative residual at which a token stops iterating (docs/design.md §1.4)
CHUNK = 64


def _dot(a, b):
  return jnp.sum(a * b, axis=-1, keepdims=True)


def cg(matvec, b, x0, *, steps: int, tol: float):
  """Conjugate gradients for independent symmetric positive definite systems, one per leading index of b [..., K]
  (every inner product runs over the last axis only). A system stops once ‖r‖² ≤ tol² ‖b‖² (or its curvature
  pᵀAp vanishes) and keeps its iterate; `steps` iterations always run. Returns x [..., K]."""
  r = b - matvec(x0)
  stop = (tol * tol) * _dot(b, b)
  tiny = jnp.finfo(b.dtype).tiny

  def body(_, carry):
    x, r, p, delta = carry
    Ap = matvec(p)
    pAp = _dot(p, Ap)
    live = (delta > stop) & (pAp > tiny)
    alpha = jnp.where(live, delta / jnp.where(live, pAp, 1.0), 0.0)
    x = x + alpha * p
    r = r - alpha * Ap
    new = _dot(r, r)
    beta = jnp.where(live, new / jnp.where(live, delta, 1.0), 0.0)
    return x, r, jnp.where(live, r + beta * p, p), jnp.where(live, new, delta)

  x, *_ = lax.fori_loop(0, steps, body, (x0, r, r, _dot(r, r)))
  return x


def _implicit_cg(matvec, b, inv_diag, steps: int, tol: float):
  """x ≈ A⁻¹ b by `cg` from the Jacobi start b ⊙ inv_diag, differentiated as the exact inverse (A symmetric)."""
  solve = lambda mv, rhs: cg(mv, rhs, rhs * inv_diag, steps=steps, tol=tol)
  return lax.custom_linear_solve(matvec, b, solve, symmetric=True)


def _matvec(H, x):
  """H x over the last two axes of H [..., K, K] and the last of x [..., K] (the orientation every path uses)."""
  return jnp.einsum("...ij,...j->...i", H, x, precision=_HI)


class _Packing(NamedTuple):
  """Packed rows: starts, index [B, T] (`packing.segment_starts`, `packing.segment_index`) and N (None: unknown,
  traced ids without an initial state; then no final states)."""
  starts: Any
  index: Any
  n: int | None


def _reference(q, k, beta, g, lam, H0, *, solver: str, steps: int, tol: float, packed: _Packing | None = None):
  """Token-serial: q, k [B, T, HV, K], beta, g [B, T, HV], lam [HV, K], H0 [B, HV, K, K] ([N, ...] packed, or None:
  zeros) in the compute dtype. Returns (q̃, H_T [B, ...], or each segment's last H [N, ...], or None)."""
  b, t, hv, kd = q.shape
  eye = jnp.eye(kd, dtype=q.dtype)

  def token(carry, xs):
    H, finals = carry
    q_t, k_t, b_t, g_t, start, idx = xs
    if packed is not None:   # a segment's first token starts from its own initial state
      fresh = jnp.zeros_like(H) if H0 is None else H0[idx]
      H = jnp.where(start[:, None, None, None], fresh, H)
    H = jnp.exp(g_t)[..., None, None] * H + b_t[..., None, None] * k_t[..., :, None] * k_t[..., None, :]
    if solver == "exact":
      x = jnp.linalg.solve(H + lam[..., :, None] * eye, q_t[..., None])[..., 0]
    else:
      inv_diag = 1.0 / (jnp.diagonal(H, axis1=-2, axis2=-1) + lam)
      x = _implicit_cg(lambda p: _matvec(H, p) + lam * p, q_t, inv_diag, steps, tol)
    if finals is not None:   # every token overwrites its segment's slot: the last one stays
      finals = finals.at[idx].set(H)
    return (H, finals), x

  move = lambda a: jnp.moveaxis(a, 1, 0)
  if packed is None:
    H_init, finals = (jnp.zeros((b, hv, kd, kd), q.dtype) if H0 is None else H0), None
    starts = index = jnp.zeros((b, t), jnp.int32)
  else:
    H_init = jnp.zeros((b, hv, kd, kd), q.dtype)
    finals = None if packed.n is None else jnp.zeros((packed.n, hv, kd, kd), q.dtype)
    starts, index = packed.starts, packed.index
  (H_T, finals), xs = lax.scan(token, (H_init, finals),
                               (move(q), move(k), move(beta), move(g), move(starts), move(index)))
  return jnp.moveaxis(xs, 0, 1), (H_T if packed is None else finals)


def _chunked(q, k, beta, g, lam, H0, *, steps: int, tol: float, chunk: int, packed: _Packing | None = None):
  """Chunkwise: q, k [B, T, HV, K], beta, g [B, T, HV], lam [HV, K], H0 [B, HV, K, K] or None (zeros) in the compute
  dtype. Packed (no initial state): the pairs of two segments and the carried state of another segment are masked
  out; each segment's last H comes from the per-token H_t at its last token (when N is known).
  Returns (q̃, H_T [B, ...] or [N, ...] packed, or None)."""
  b, t, hv, kd = q.shape
  c = min(chunk, t)
  n = -(-t // c)
  pad = n * c - t
  seg = None if packed is None else packed.index
  if pad:   # zero tokens: β = 0 and g = 0 leave H unchanged, q = 0 gives q̃ = 0
    widen = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
    q, k, beta, g = map(widen, (q, k, beta, g))
    seg = None if seg is None else jnp.pad(seg, [(0, 0), (0, pad)], mode="edge")
  # [B, N, HV, C, (K)]: the chunk's tokens along C.
  split = lambda a: jnp.moveaxis(a.reshape((b, n, c) + a.shape[2:]), 2, 3)
  Q, Kc, Bc, Gc = split(q), split(k), split(beta), split(g)
  G = jnp.cumsum(Gc, axis=-1)                                           # inclusive, per chunk
  causal = jnp.tril(jnp.ones((c, c), bool))
  into = jnp.exp(G)                                                     # e^{G_t}: the entering state's weight
  w_out = jnp.exp(G[..., -1:] - G) * Bc                                 # token j's weight in the leaving state
  keep = jnp.ones((b, n, 1), G.dtype)                                   # the leaving state keeps the entering one
  if seg is not None:
    s = seg.reshape(b, n, 1, c)                                         # [B, N, 1, C]: broadcast over heads
    causal = causal & (s[..., :, None] == s[..., None, :])
    entering = jnp.concatenate([seg[:, :1], seg[:, c - 1:-1:c]], axis=1).reshape(b, n, 1, 1)
    into = jnp.where(s == entering, into, 0.0)
    w_out = jnp.where(s == s[..., -1:], w_out, 0.0)
    keep = (s[..., -1] == entering[..., 0]).astype(G.dtype)
  diff = jnp.where(causal, G[..., :, None] - G[..., None, :], 0.0)
  L = jnp.where(causal, jnp.exp(diff), 0.0) * Bc[..., None, :]           # [B, N, HV, C(t), C(j)]
  dH = jnp.einsum("bnhc,bnhci,bnhcj->bnhij", w_out, Kc, Kc, precision=_HI)
  a = jnp.exp(G[..., -1]) * keep                                        # [B, N, HV]

  def across(H, xs):
    a_n, dH_n = xs
    return a_n[..., None, None] * H + dH_n, H

  H_start = jnp.zeros((b, hv, kd, kd), q.dtype) if H0 is None else H0
  H_T, H_in = lax.scan(across, H_start, (jnp.moveaxis(a, 1, 0), jnp.moveaxis(dH, 1, 0)))
  H_in = jnp.moveaxis(H_in, 0, 1)                                       # [B, N, HV, K, K] entering each chunk
  lam_c = lam[:, None, :]                                               # [HV, 1, K]

  def matvec(P):                                                        # P [B, N, HV, C, K]: H_t p_t + λ ⊙ p_t
    carried = into[..., None] * jnp.einsum("bnhij,bnhcj->bnhci", H_in, P, precision=_HI)
    scores = jnp.einsum("bnhtk,bnhjk->bnhtj", P, Kc, precision=_HI) * L
    return carried + jnp.einsum("bnhtj,bnhjk->bnhtk", scores, Kc, precision=_HI) + lam_c * P

  diag_in = jnp.diagonal(H_in, axis1=-2, axis2=-1)[..., None, :]        # [B, N, HV, 1, K]
  diag = into[..., None] * diag_in + jnp.einsum("bnhtj,bnhjk->bnhtk", L, Kc * Kc, precision=_HI)
  X = _implicit_cg(matvec, Q, 1.0 / (diag + lam_c), steps, tol)
  x = jnp.moveaxis(X, 3, 2).reshape(b, n * c, hv, kd)[:, :t]
  if packed is None:
    return x, H_T
  if packed.n is None:
    return x, None
  # Each segment's last H: H_t = e^{G_t} H_in + Σ_j L_tj k_j k_jᵀ at the segment's last token.
  H_t = (into[..., None, None] * H_in[:, :, :, None]
         + jnp.einsum("bnhtj,bnhji,bnhjk->bnhtik", L, Kc, Kc, precision=_HI))
  H_t = jnp.moveaxis(H_t, 3, 2).reshape(b, n * c, hv, kd, kd)[:, :t]
  last = jnp.concatenate([packed.starts[:, 1:], jnp.ones((b, 1), bool)], axis=1)
  finals = jnp.zeros((packed.n, hv, kd, kd), q.dtype)
  return x, finals.at[packed.index.reshape(-1)].add(
      jnp.where(last.reshape(-1)[:, None, None, None], H_t.reshape(b * t, hv, kd, kd), 0.0))


def _fail(name: str, expected: str, got) -> ValueError:
  return ValueError(f"mesa_query: `{name}` must be {expected}, got {got}")


def _check(q, k, beta, log_decay, lam, initial_state, cg_steps, cg_tol, solver, chunk_size, segment_ids):
  """ValueErrors naming the argument; returns (HV, N: the rows of the states — B, or the segments when packed,
  None when traced ids leave it unknown)."""
  for name, x in (("q", q), ("k", k)):
    if np.ndim(x) != 4:
      raise _fail(name, "an array [B, T, H, K]", f"shape {np.shape(x)}")
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      raise _fail(name, "a floating array (bf16, fp16, fp32 or fp64)", f"dtype {jnp.result_type(x)}")
  if np.shape(k) != np.shape(q):
    raise _fail("k", f"of q's shape [B, T, H, K] = {np.shape(q)}", f"shape {np.shape(k)}")
  b, t, h, kd = np.shape(q)
  gate = beta if beta is not None else log_decay
  hv = h if gate is None else (np.shape(gate)[2] if np.ndim(gate) >= 3 else -1)
  if hv <= 0 or hv % h:
    raise _fail("beta" if beta is not None else "log_decay",
                f"[B, T, HV] = ({b}, {t}, HV) with HV a multiple of H = {h}", f"shape {np.shape(gate)}")
  for name, x in (("beta", beta), ("log_decay", log_decay)):
    if x is None:
      continue
    if tuple(np.shape(x)) == (b, t, hv, kd) and name == "log_decay":
      raise _fail(name, f"a scalar decay per value head [B, T, HV] = {(b, t, hv)} (a per-channel decay makes "
                  "H_t unsymmetric, which CG cannot solve)", f"shape {np.shape(x)}")
    if tuple(np.shape(x)) != (b, t, hv):
      raise _fail(name, f"of shape [B, T, HV] = {(b, t, hv)}", f"shape {np.shape(x)}")
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      raise _fail(name, "a floating array", f"dtype {jnp.result_type(x)}")
  if lam is None or not jnp.issubdtype(jnp.result_type(lam), jnp.floating):
    raise _fail("lam", f"a floating array broadcastable to [HV, K] = {(hv, kd)}", repr(lam))
  try:
    np.broadcast_shapes(np.shape(lam), (hv, kd))
    ok = len(np.shape(lam)) <= 2 and np.broadcast_shapes(np.shape(lam), (hv, kd)) == (hv, kd)
  except ValueError:
    ok = False
  if not ok:
    raise _fail("lam", f"broadcastable to [HV, K] = {(hv, kd)}", f"shape {np.shape(lam)}")
  checks.number("mesa_query", "lam", lam, low=0.0, low_open=True, scalar=False)
  rows = ops_checks._check_segments("mesa_query", segment_ids, initial_state, False, b, t)
  if initial_state is not None:
    lead = "B" if segment_ids is None else "N"
    if tuple(np.shape(initial_state)) != (rows, hv, kd, kd):
      raise _fail("initial_state", f"of shape [{lead}, HV, K, K] = {(rows, hv, kd, kd)}",
                  f"shape {np.shape(initial_state)}")
    if not jnp.issubdtype(jnp.result_type(initial_state), jnp.floating):
      raise _fail("initial_state", "a floating array", f"dtype {jnp.result_type(initial_state)}")
  checks.positive_int("mesa_query", "cg_steps", cg_steps)
  checks.number("mesa_query", "cg_tol", cg_tol, low=0.0)
  if not isinstance(cg_tol, numbers.Real):
    raise _fail("cg_tol", "a Python or numpy number (static: it sets when a token stops)", repr(cg_tol))
  if solver not in SOLVERS:
    raise _fail("solver", f"one of {SOLVERS}", repr(solver))
  checks.positive_int("mesa_query", "chunk_size", chunk_size)
  return hv, rows


def mesa_query(q, k, beta=None, log_decay=None, *, lam, initial_state=None, cg_steps: int = CG_STEPS,
               cg_tol: float = CG_TOL, solver: str = "cg", chunk_size: int = CHUNK, segment_ids=None,
               implementation: str = "auto"):
  """q̃_t = (H_t + Λ)⁻¹ q_t (the module docstring's shapes and implementations). Returns (q̃, H_T).

  solver "exact" (a dense solve per token) only with implementation "reference". segment_ids [B, T] (packed rows,
  `osdn_jax.ops.packing`): every segment starts from its own initial state (initial_state [N, HV, K, K], zeros by
  default) and H_T is each segment's last H [N, HV, K, K] (None when N is unknown: traced ids, no initial state).
  The chunked form takes packed rows without initial states (a training step's); with them, use "reference"."""
  impl = dispatch.normalize("mesa_query", implementation)
  hv, rows = _check(q, k, beta, log_decay, lam, initial_state, cg_steps, cg_tol, solver, chunk_size, segment_ids)
  if segment_ids is not None and initial_state is not None and impl != "reference":
    raise ValueError("mesa_query: packed rows (`segment_ids`) with an `initial_state` run only with implementation "
                     f"'reference', got {impl!r}")
  if dispatch.is_pallas(impl):
    raise ValueError(f"mesa_query: `implementation`={impl!r} has no kernel (MesaNet's pass runs in XLA); use "
                     "'xla' or 'auto'")
  if solver == "exact" and impl != "reference":
    raise ValueError(f"mesa_query: `solver`='exact' runs only with implementation 'reference', got {impl!r}")
  ct = common.compute_dtype(jnp.result_type(q, k))
  b, t, h, kd = q.shape
  cast = lambda x: jnp.asarray(x, ct)
  arrays = dict(q=cast(q), k=cast(k), beta=jnp.ones((b, t, hv), ct) if beta is None else cast(beta),
                log_decay=None if log_decay is None else jnp.maximum(cast(log_decay), common.LOG_DECAY_FLOOR),
                initial_state=None if initial_state is None else cast(initial_state))
  lam = jnp.broadcast_to(cast(lam), (hv, kd))
  packed = None if segment_ids is None else _Packing(packing.segment_starts(segment_ids),
                                                     packing.segment_index(segment_ids), rows)

  def run(a, segment_ids=None):
    qe, ke = (common.expand_heads(a[n], hv, 2) for n in ("q", "k"))
    g = jnp.zeros((b, t, hv), ct) if a["log_decay"] is None else a["log_decay"]
    if impl == "reference":
      return _reference(qe, ke, a["beta"], g, lam, a["initial_state"], solver=solver, steps=cg_steps,
                        tol=float(cg_tol), packed=packed)
    return _chunked(qe, ke, a["beta"], g, lam, a["initial_state"], steps=cg_steps, tol=float(cg_tol),
                    chunk=chunk_size, packed=packed)

  if impl == "reference":
    x, H_T = run(arrays)
  else:   # a chunk's tokens meet in matmuls: non-finite inputs are zeroed and NaN put where the oracle has it
    x, H_T = faults.careful(run, dict(arrays, v=jnp.zeros((b, t, hv, 1), ct)), segment_ids)
  return x.astype(q.dtype), H_T


def lam_from_param(raw, lam_min: float):
  """Λ's diagonal from its unconstrained parameter: softplus(raw) + lam_min (> lam_min > 0)."""
  return jax.nn.softplus(raw) + lam_min


def lam_param_init(shape, lam_init: float, lam_min: float):
  """The parameter that gives λ = lam_init: softplus⁻¹(lam_init − lam_min), fp32 of `shape`."""
  gap = lam_init - lam_min
  return jnp.full(shape, gap + math.log(-math.expm1(-gap)), jnp.float32)
