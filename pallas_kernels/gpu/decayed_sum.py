"""The decayed running sum of the PDN / ATQ preconditioners as one light Pallas GPU kernel.

    A_t = e^{g_t} A_{t-1} + b_t,   b_t = β_t x_t ⊙ x_t ("square": the second moment of the keys) or x_t,

per (batch, head) with a scalar log-decay g_t per head and any number of channels. `decayed_sum` has the
results of `osdn_jax.ops.scan.affine_scan(e^g, b, initial=A0)` (all A_t and A_T) for unpacked sequences; the
XLA path keeps that `lax.associative_scan`, which on a GPU materialises e^g broadcast to every channel and
makes log T passes over [B, T, H, K].

Kernel, grid (B, H, K/BK): a `fori_loop` over chunks of C tokens with A [BK] (fp32) in registers. Per chunk,
with G the in-chunk cumsum of g (computed outside, head-major):
    A_chunk = Γ b + e^{G} A_prev,   Γ_ij = [i ≥ j] e^{G_i − G_j} (exponent masked before exp, every factor ≤ 1)
one [C, C] × [C, BK] dot; the chunk's last row carries. T is zero-padded to a multiple of C (b = 0, g = 0 leave
A unchanged, so A_T is exact).

Faults stay where the token-serial recurrence puts them, without help from the caller (`confines_faults`): a
non-finite b_t (a NaN or inf in x_t or β_t, or x_t² overflowing) or a log-decay g_t that is NaN or +inf makes the
channel's A from t on and A_T NaN (every channel for g_t), the rows before t as in the clean run. In the kernel
a chunk whose last row is finite in every channel, after no fault, is stored as the dot gives it (a fault anywhere
in the chunk would make that row non-finite); otherwise the chunk is computed again with the faulty b entering
the dot as 0, and a per-channel flag, carried across chunks, marks the rows from the first fault on. The flag cannot tell a sequence's segments apart, so packed callers confine faults themselves.

Backward (`jax.custom_vjp`, no second kernel): the adjoint λ_t = dA_t + e^{g_{t+1}} λ_{t+1}, λ_{T+1} = dA_T, is
the same recurrence in reversed time with the decays shifted by one token, so it is this kernel run on the
flipped cotangents. Then db = λ, dg_t = Σ_K λ_t ⊙ (A_t − b_t), dA0 = e^{g_1} λ_1, and for "square"
dx = 2 β x ⊙ λ, dβ = Σ_K x² ⊙ λ.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.arrays import moment_inputs
from pallas_kernels.gpu.chunk_math import F32, dot, iota, last_row
from pallas_kernels.gpu.common import SQUEEZED as _SQ
from pallas_kernels.gpu.common import default_interpret, pad_axis, padded_dim, pallas_call
from pallas_kernels.gpu.intra import decay_factor
from pallas_kernels.spec import Spec

CHUNK = 64             # tokens per step of the loop (one [C, C] × [C, BK] dot)
BLOCK_K = 32           # channels per program


def _kernel(square, chunk, num_chunks, *refs):
  if square:
    x_ref, beta_ref, g_ref, a0_ref, a_ref, last_ref = refs
  else:
    (x_ref, g_ref, a0_ref, a_ref, last_ref), beta_ref = refs, None

  def body(c, carry):
    A, dead = carry
    rows = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    b = x_ref[rows, :].astype(F32)
    if square:
      b = beta_ref[rows][:, None] * b * b
    G = g_ref[rows]
    Ac = dot(decay_factor(G, chunk, strict=False), b) + jnp.exp(G)[:, None] * A[None, :]
    last = last_row(Ac)

    def clean():
      a_ref[rows, :] = Ac
      return last, dead

    def confined():
      # A fault (b_t non-finite, or G_t: a log-decay NaN or +inf, carried by the in-chunk cumsum) enters the dot
      # as 0 and its channel is dead from t on: a zero weight times a NaN would reach the chunk's earlier rows.
      bad = ~(jnp.abs(b) < jnp.inf) | ~(jnp.abs(G) < jnp.inf)[:, None]
      row = iota(b.shape, 0).astype(F32)
      first = jnp.min(jnp.where(bad, row, float(chunk)), axis=0)
      dead_rows = (row >= first[None, :]) | (dead[None, :] > 0.0)
      Af = dot(decay_factor(G, chunk, strict=False), jnp.where(bad, 0.0, b)) + jnp.exp(G)[:, None] * A[None, :]
      a_ref[rows, :] = jnp.where(dead_rows, jnp.nan, Af)
      return last_row(Af), jnp.maximum(dead, (first < chunk).astype(F32))

    # A fault anywhere in the chunk makes its channel's last row non-finite (the dot multiplies every b_t, and a
    # zero weight times a NaN or inf is NaN; G_t reaches the last row's cumsum), so a finite last row in every
    # channel, with no channel dead before, is a clean chunk: the rows as computed, the selects skipped.
    fine = jnp.min(jnp.where(jnp.abs(last) < jnp.inf, 1.0, 0.0) - dead) > 0.0
    return lax.cond(fine, clean, confined)

  A0 = a0_ref[...].astype(F32)
  A_T, dead = lax.fori_loop(0, num_chunks, body, (A0, jnp.zeros_like(A0)))
  last_ref[...] = jnp.where(dead > 0.0, jnp.nan, A_T)


def _call(x, beta, G, A0, *, chunk, interpret):
  """x [B, T, H, K] (T a multiple of chunk, K of BLOCK_K); beta None or [B, H, T]; G [B, H, T] in-chunk
  cumsums; A0 [B, H, K] → (A [B, T, H, K] fp32, A_T [B, H, K] fp32)."""
  b, t, h, k = x.shape
  bk = min(BLOCK_K, k)
  rows = pl.BlockSpec((_SQ, t, _SQ, bk), lambda i, j, l: (i, 0, j, l))
  vec = pl.BlockSpec((_SQ, _SQ, t), lambda i, j, l: (i, j, 0))
  state = pl.BlockSpec((_SQ, _SQ, bk), lambda i, j, l: (i, j, l))
  square = beta is not None
  in_specs = [rows] + ([vec] if square else []) + [vec, state]
  args = [x] + ([beta] if square else []) + [G, A0]
  return pallas_call(functools.partial(_kernel, square, chunk, t // chunk), grid=(b, h, k // bk),
                     in_specs=in_specs, out_specs=[rows, state],
                     out_shape=[jax.ShapeDtypeStruct((b, t, h, k), F32), jax.ShapeDtypeStruct((b, h, k), F32)],
                     interpret=interpret, num_warps=4, num_stages=1, name="decayed_sum")(*args)


def scan(x, beta, g, A0, *, interpret):
  """Pads T and K, lays out the gates head-major with in-chunk cumsums, runs the kernel, unpads."""
  b, t, h, k = x.shape
  tp, kp = -(-t // CHUNK) * CHUNK, max(padded_dim(k), BLOCK_K)
  x = pad_axis(pad_axis(x, 1, tp), 3, kp)
  G = jnp.swapaxes(pad_axis(g, 1, tp), 1, 2)                                          # [B, H, T]
  G = jnp.cumsum(G.reshape(b, h, tp // CHUNK, CHUNK), axis=-1).reshape(b, h, tp)
  if beta is not None:
    beta = jnp.swapaxes(pad_axis(beta, 1, tp), 1, 2)
  A, A_T = _call(x, beta, G, pad_axis(A0, 2, kp), chunk=CHUNK, interpret=interpret)
  return A[:, :t, :, :k], A_T[..., :k]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _decayed_sum(x, beta, g, A0, interpret):
  return scan(x, beta, g, A0, interpret=interpret)


def _fwd(x, beta, g, A0, interpret):
  A, A_T = scan(x, beta, g, A0, interpret=interpret)
  return (A, A_T), (x, beta, g, A)


def _bwd(interpret, res, cts):
  x, beta, g, A = res
  dA, dA_T = cts
  # λ_t = dA_t + e^{g_{t+1}} λ_{t+1} (λ_{T+1} = dA_T): the forward recurrence in reversed time, decays shifted.
  g_next = jnp.concatenate([g[:, 1:], jnp.zeros_like(g[:, :1])], axis=1)
  lam, lam_1 = scan(jnp.flip(dA, 1), None, jnp.flip(g_next, 1), dA_T, interpret=interpret)
  lam = jnp.flip(lam, 1)
  xf = x.astype(F32)
  b = xf if beta is None else beta[..., None] * xf * xf
  dg = jnp.sum(lam * (A - b), axis=-1)
  dA0 = jnp.exp(g[:, 0])[..., None] * lam_1
  if beta is None:
    return lam.astype(x.dtype), None, dg, dA0
  return ((2.0 * beta[..., None] * xf * lam).astype(x.dtype), jnp.sum(xf * xf * lam, axis=-1), dg, dA0)


_decayed_sum.defvjp(_fwd, _bwd)


def decayed_sum(x, log_decay, *, beta=None, initial_state=None, interpret: bool | None = None):
  """All A_t of A_t = e^{g_t} A_{t-1} + b_t with b_t = β_t x_t ⊙ x_t (beta given) or x_t, and A_T.

  x [B, T, H, K] (fp32 or bf16, read as is); log_decay g and beta [B, T, H]; initial_state A0 [B, H, K]
  (default 0). Computes in fp32;
  log_decay is clamped at −30 like every log-decay of the solves. Returns (A [B, T, H, K], A_T [B, H, K]),
  fp32. Differentiable w.r.t. x, log_decay, beta and initial_state.
  """
  beta, g, A0 = moment_inputs("decayed_sum (pallas gpu)", x, log_decay, beta, initial_state)
  return _decayed_sum(x, beta, g, A0, default_interpret(interpret))


decayed_sum.confines_faults = True   # unpacked: NaN where the token-serial recurrence has it (module docstring)


def supports(spec: Spec) -> bool:
  """Compiled on "gpu", interpret mode on "cpu"; fp32 or bf16 inputs (computed in fp32); unpacked; no config (it
  takes none)."""
  return (spec.platform in ("gpu", "cpu")
          and spec.dtype in ("float32", "bfloat16")
          and not spec.packed
          and spec.config is None)
