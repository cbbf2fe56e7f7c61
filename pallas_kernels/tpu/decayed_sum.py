"""The decayed running sum of the PDN / ATQ preconditioners as one Pallas TPU (Mosaic) kernel.

    A_t = e^{g_t} A_{t-1} + b_t,   b_t = β_t x_t ⊙ x_t ("square": the second moment of the keys) or x_t,

per (batch, head) with a scalar log-decay g_t per head and any number of channels K. `decayed_sum` has the
signature and results of `pallas_kernels.gpu.decayed_sum.decayed_sum` (the contract:
`osdn_jax.dgps.precond.second_moment`, i.e. `osdn_jax.ops.scan.affine_scan(e^g, b, initial=A0)`) for unpacked
sequences.

Layout: x and A stay [B, T, H, K] (on a TPU the minor two dims (H, K) are the tiled ones, so this block
[C, Hb, W] is whole tiles and no relayout copy is made); the kernel reads head i of the block as x[:, i, :]. The
gates come as in-chunk cumsums G in two layouts, [B, T, H] (a column per head) and [B, H, T] (a row per head), so
the decay factor needs no in-kernel transpose.

Kernel, grid (B, H/Hb, K/W, T/C), the chunk axis innermost and sequential ("arbitrary"), the state [Hb, 1, W] (fp32)
in a VMEM scratch carried across it. Per chunk of C tokens and per head:
    A_chunk = (Γ ⊙ β_row) b + e^{G} A_prev,   Γ_ij = [i ≥ j] e^{G_i − G_j},   b = x ⊙ x or x,
Γ's exponent masked before exp (every factor ≤ 1): one [C, C] × [C, W] dot. The chunk's last row is the carry. T
need not be a multiple of C: the last block's rows past T are zeroed in the kernel and G is zero-padded there, so
those rows repeat A_T (and are not written back).

Backward (`jax.custom_vjp`): the adjoint λ_t = dA_t + e^{g_{t+1}} λ_{t+1}, λ_{T+1} = dA_T, runs through the same
kernel in reverse (`reverse=True`: chunks visited last to first by the index maps,
    λ_chunk = Γ' dA + e^{G_last − G} carry,   Γ'_ij = [j ≥ i] e^{G_j − G_i},
carry = e^{g} λ of the chunk's first token), so no flipped copy of dA or λ is made and the final carry is
dA0 = e^{g_1} λ_1. Then, in XLA, db = λ,
dg_t = Σ_K λ_t ⊙ (A_t − b_t), and for "square" dx = 2 β x ⊙ λ, dβ = Σ_K x² ⊙ λ.

The forward confines faults as the token-serial recurrence does, without help from the caller (`confines_faults`,
unpacked): a non-finite b_t (a NaN or inf in x_t, or x_t² overflowing) or a faulty β_t or g_t (non-finite β, g NaN
or +inf) makes the channel's A from t on and A_T NaN (every channel for β_t and g_t), the rows before t as in the
clean run: the faulty terms enter the dot as 0, and a per-channel flag in a second VMEM scratch, carried across
chunks, marks the rows from the first fault on.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.arrays import moment_inputs
from pallas_kernels.spec import Spec
from pallas_kernels.tpu import common
from pallas_kernels.tpu.common import F32, LANES, SQUEEZED as _SQ


@dataclasses.dataclass(frozen=True)
class Config:
  """Block sizes. chunk: tokens per grid step and per [C, C] × [C, W] dot, a multiple of 128 (it is the lane dim of
  the head-major gate block); a sequence of at most `chunk` tokens runs as one chunk of T rounded up to 8.
  block_k: lanes per program for K a multiple of it, a multiple of 128 (else 128 lanes for K a multiple of 128,
  else all K). block_h: heads per program for H a multiple of it, a multiple of 8 (else all H)."""
  chunk: int = 128
  block_k: int = 128
  block_h: int = 8

  def __post_init__(self):
    for name, unit in (("chunk", LANES), ("block_k", LANES), ("block_h", 8)):
      value = getattr(self, name)
      if not (isinstance(value, int) and not isinstance(value, bool) and value > 0 and value % unit == 0):
        raise ValueError(f"decayed_sum (pallas tpu): `{name}` must be a positive multiple of {unit}, got {value!r}")


# The dot costs 2·C flops per element of A at fp32 precision (six bf16 MXU passes) against ~6 bytes of HBM traffic
# per element (bf16 x in, fp32 A out): C = 128 keeps v5e and v5p (≈ 240 and 166 bf16 flops per HBM byte) near
# their balance point; v6e (≈ 560) takes C = 256, halving the grid steps.
TUNING = {"v4": Config(chunk=128), "v5e": Config(chunk=128), "v5p": Config(chunk=128), "v6e": Config(chunk=256)}


def default_config(spec=None, device_kind: str | None = None) -> Config:
  """The block sizes for a TPU `device_kind` (default: this backend's first device; `Config()` off TPU); every
  entry holds for every request (`spec`, unused here)."""
  del spec
  return TUNING.get(common.generation(device_kind), Config())


@dataclasses.dataclass(frozen=True)
class Layout:
  """How [B, T, H, K] is cut into blocks [C, Hb, W]: chunk C tokens (the gates padded to tp = a multiple of C),
  block_h Hb heads, width W channels."""
  chunk: int
  block_h: int
  width: int
  tp: int


def layout(t: int, h: int, k: int, config: Config) -> Layout:
  chunk = config.chunk if t > config.chunk else common.round_up(t, 8)
  block_h = config.block_h if h % config.block_h == 0 else h
  width = config.block_k if k % config.block_k == 0 else (LANES if k % LANES == 0 else k)
  return Layout(chunk=chunk, block_h=block_h, width=width, tp=common.round_up(t, chunk))


def _kernel(square: bool, reverse: bool, t: int, lay: Layout, *refs):
  """One chunk of one block. x (or dA) [C, Hb, W]; β [Hb, C] (square); G [C, H] and [Hb, C]; A0 [Hb, 1, W] →
  A (or λ) [C, Hb, W] and, written at the last step, the final carry [Hb, 1, W]; scratch: the carry [Hb, 1, W]
  and, forward, the dead channels [Hb, 1, W]."""
  if square:
    x_ref, beta_ref, gcol_ref, grow_ref, a0_ref, a_ref, last_ref, carry_ref, *dead = refs
  else:
    (x_ref, gcol_ref, grow_ref, a0_ref, a_ref, last_ref, carry_ref, *dead), beta_ref = refs, None
  dead_ref = dead[0] if dead else None
  head0, step = pl.program_id(1) * lay.block_h, pl.program_id(3)
  c = lay.chunk
  chunk = lay.tp // c - 1 - step if reverse else step

  @pl.when(step == 0)
  def _():
    carry_ref[...] = a0_ref[...]
    if dead_ref is not None:
      dead_ref[...] = jnp.zeros(dead_ref.shape, F32)

  rows, cols = common.iota((c, c), 0), common.iota((c, c), 1)
  mask = rows <= cols if reverse else rows >= cols
  # The last chunk may hold fewer than C tokens: its block rows past T are unspecified (may be NaN) and are zeroed
  # before the dot (their gates are the zero padding of G).
  valid = common.iota((c, 1), 0) < t - chunk * c
  first_col, last_col = common.iota((1, c), 1) == 0, common.iota((1, c), 1) == c - 1
  gcol = gcol_ref[...]
  finite = lambda v: jnp.abs(v) < jnp.inf
  for i in range(lay.block_h):
    b = jnp.where(valid, x_ref[:, i, :].astype(F32), 0.0)         # [C, W]
    if square:
      b = b * b
    g_col = common.take(gcol, head0 + i, 1)                         # [C, 1]
    g_row = grow_ref[i:i + 1, :]                                    # [1, C]
    beta_row = None if beta_ref is None else beta_ref[i:i + 1, :]   # [1, C]
    if dead_ref is not None:
      # Forward: a fault (b_t non-finite; β_t non-finite; g_t NaN or +inf, which the in-chunk cumsum G carries to
      # the rows after it) enters the dot as 0, and its channel is dead from t on (NaN in A and A_T), carried
      # across chunks in dead_ref. A faulty β_t is zeroed where it weights Γ's column t, which reaches every row.
      bad = ~finite(b) | ~finite(g_col)
      if beta_row is not None:
        bad_beta = (~finite(beta_row)).astype(F32)                                       # [1, C]
        beta_row = jnp.where(bad_beta > 0.0, 0.0, beta_row)
        bad = bad | (jnp.sum(jnp.where(rows == cols, bad_beta, 0.0), axis=1, keepdims=True) > 0.0)   # [C, 1]
      b = jnp.where(bad, 0.0, b)
      row = common.iota(b.shape, 0).astype(F32)
      first = jnp.min(jnp.where(bad, row, float(c)), axis=0, keepdims=True)           # [1, W]
      dead_rows = (row >= first) | (dead_ref[i] > 0.0)
    if reverse:
      gamma = common.masked_exp(g_row - g_col, mask)
      g_last = jnp.sum(jnp.where(last_col, g_row, 0.0), axis=1, keepdims=True)        # [1, 1]
      decay = jnp.exp(g_last - g_col)                                                  # [C, 1], ≤ 1
    else:
      gamma = common.masked_exp(g_col - g_row, mask)
      decay = jnp.exp(g_col)
    if square:
      gamma = gamma * beta_row
    a_chunk = common.dot(gamma, b) + decay * carry_ref[i]
    # The carry, taken from one aligned tile of 8 rows: the chunk's last row of A (forward); e^{g} λ of the
    # chunk's first token (reverse).
    if reverse:
      a_ref[:, i, :] = a_chunk
      g_first = jnp.sum(jnp.where(first_col, g_row, 0.0), axis=1, keepdims=True)
      carry_ref[i] = jnp.exp(g_first) * common.take(a_chunk[0:8], 0, 0)
    else:
      a_ref[:, i, :] = jnp.where(dead_rows, jnp.nan, a_chunk)
      carry_ref[i] = common.take(a_chunk[c - 8:c], 7, 0)
      dead_ref[i] = common.take(dead_rows.astype(F32)[c - 8:c], 7, 0)

  @pl.when(step == pl.num_programs(3) - 1)
  def _():
    if dead_ref is None:
      last_ref[...] = carry_ref[...]
    else:
      last_ref[...] = jnp.where(dead_ref[...] > 0.0, jnp.nan, carry_ref[...])


def _call(x, beta, G, A0, *, lay: Layout, reverse: bool, interpret):
  """x [B, T, H, K]; beta None or [B, H, Tp]; G [B, Tp, H] in-chunk cumsums (zero past T); A0 [B, H, 1, K] fp32 →
  (A [B, T, H, K] fp32, final carry [B, H, 1, K] fp32)."""
  b, t, h, k = x.shape
  c, hb, w = lay.chunk, lay.block_h, lay.width
  nc = lay.tp // c
  at = (lambda s: nc - 1 - s) if reverse else (lambda s: s)
  spec = lambda block, index: pl.BlockSpec(block, lambda *grid: common.block_index(*index(*grid)))
  tiles = spec((_SQ, c, hb, w), lambda i, j, l, s: (i, at(s), j, l))
  col = spec((_SQ, c, h), lambda i, j, l, s: (i, at(s), 0))
  row = spec((_SQ, hb, c), lambda i, j, l, s: (i, j, at(s)))
  state = spec((_SQ, hb, 1, w), lambda i, j, l, s: (i, j, 0, l))
  square = beta is not None
  in_specs = [tiles] + ([row] if square else []) + [col, row, state]
  args = [x] + ([beta] if square else []) + [G, jnp.swapaxes(G, 1, 2), A0]
  cost = pl.CostEstimate(flops=int(b * lay.tp * h * k * (2 * c + 4)), transcendentals=int(b * h * lay.tp * (c + 1)),
                         bytes_accessed=int(x.size * x.dtype.itemsize + 4 * x.size + 4 * b * lay.tp * h * 4))
  return common.pallas_call(
      functools.partial(_kernel, square, reverse, t, lay), grid=(b, h // hb, k // w, nc), in_specs=in_specs,
      out_specs=[tiles, state],
      out_shape=[jax.ShapeDtypeStruct((b, t, h, k), F32), jax.ShapeDtypeStruct((b, h, 1, k), F32)],
      scratch_shapes=[pltpu.VMEM((hb, 1, w), F32)] * (1 if reverse else 2),
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"), interpret=interpret,
      name="decayed_sum_reverse" if reverse else "decayed_sum", cost_estimate=cost)(*args)


def scan(x, beta, g, A0, *, config: Config, reverse: bool = False, interpret):
  """Forms the in-chunk cumsums and the head-major gates (padded to whole chunks) and runs the kernel. x [B, T, H, K]
  (read as is); beta None or [B, T, H]; g [B, T, H]; A0 [B, H, K] fp32 → (A [B, T, H, K], final carry [B, H, K]),
  fp32."""
  b, t, h, k = x.shape
  lay = layout(t, h, k, config)
  G = common.pad_axis(g, 1, lay.tp)
  G = jnp.cumsum(G.reshape(b, lay.tp // lay.chunk, lay.chunk, h), axis=2).reshape(b, lay.tp, h)
  if beta is not None:
    beta = jnp.swapaxes(common.pad_axis(beta, 1, lay.tp), 1, 2)
  A, last = _call(x, beta, G, A0[:, :, None, :], lay=lay, reverse=reverse, interpret=interpret)
  return A, last[:, :, 0, :]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _decayed_sum(x, beta, g, A0, config, interpret):
  return scan(x, beta, g, A0, config=config, interpret=interpret)


def _fwd(x, beta, g, A0, config, interpret):
  A, A_T = scan(x, beta, g, A0, config=config, interpret=interpret)
  return (A, A_T), (x, beta, g, A)


def backward(x, beta, g, A, dA, dA_T, *, config: Config, interpret):
  """The cotangents (dx, dβ or None, dg, dA0) of `scan`'s inputs from those of (A, A_T): the adjoint through the
  kernel in reverse, the rest in XLA (module docstring)."""
  lam, dA0 = scan(dA.astype(F32), None, g, dA_T.astype(F32), config=config, reverse=True, interpret=interpret)
  xf = x.astype(F32)
  b = xf if beta is None else beta[..., None] * xf * xf
  dg = jnp.sum(lam * (A - b), axis=-1)
  if beta is None:
    return lam.astype(x.dtype), None, dg, dA0
  return (2.0 * beta[..., None] * xf * lam).astype(x.dtype), jnp.sum(xf * xf * lam, axis=-1), dg, dA0


def _bwd(config, interpret, res, cts):
  return backward(*res, *cts, config=config, interpret=interpret)


_decayed_sum.defvjp(_fwd, _bwd)


def decayed_sum(x, log_decay, *, beta=None, initial_state=None, interpret=None, config: Config | None = None):
  """All A_t of A_t = e^{g_t} A_{t-1} + b_t with b_t = β_t x_t ⊙ x_t (beta given) or x_t, and A_T.

  x [B, T, H, K] (fp32 or bf16, read as is); log_decay g and beta [B, T, H]; initial_state A0 [B, H, K]
  (default 0). Computes in fp32; log_decay is clamped at −30 like every log-decay of the solves. Returns
  (A [B, T, H, K], A_T [B, H, K]), fp32. Differentiable w.r.t. x, log_decay, beta and initial_state.
  interpret: None (interpret on a CPU backend), a bool, or a `pltpu.InterpretParams` (`common.default_interpret`).
  config: block sizes (default `default_config()`, this backend's TPU generation).
  """
  beta, g, A0 = moment_inputs("decayed_sum (pallas tpu)", x, log_decay, beta, initial_state)
  if min(x.shape) < 1:
    raise ValueError(f"decayed_sum (pallas tpu): every dim of `x` must be ≥ 1, got shape {x.shape}")
  return _decayed_sum(x, beta, g, A0, config or default_config(), common.default_interpret(interpret))


decayed_sum.confines_faults = True   # unpacked: NaN where the token-serial recurrence has it (module docstring)


def supports(spec: Spec) -> bool:
  """Compiled on "tpu"; fp32 or bf16 inputs (computed in fp32); unpacked."""
  return (spec.platform == "tpu" and spec.dtype in ("float32", "bfloat16") and not spec.packed
          and spec.config_of(Config))

