"""PDN's write key and ATQ's query, fused with their decayed second moment, as chunk-parallel Pallas GPU kernels:
what this backend supplies to the shell (`pallas_kernels.precond_shell`: the recurrence, the entry point, its checks
and custom_vjp; `precond_key` is the shell's bound to `BACKEND`).

The kernels never write A [B, T, H, K]; they take every input and return (y, A_T) themselves. Chunks of C tokens
(`Config.chunk`), G the in-chunk cumsum of g, G_C its total; every kernel but `decayed_sum` has the grid
(B, H, NC, K/BK) and no loop:
  1. `summaries`: s_c = Σ_{j∈c} e^{G_C − G_j} b_j [B, NC, H, K] (weights from XLA, a column sum of a [C, BK] load);
  2. the carries A_end[c] = e^{G_C(c)} A_end[c−1] + s_c (A_end[−1] = A_0), which give A_in[c] (the state
     entering chunk c) and A_T: `decayed_sum` on these NC-long arrays in two levels (`_chunk_scan`): every group
     of `Config.carry_group` chunks from zero in parallel, then the groups' ends in one short serial scan, then
     A_end = local + e^{(cumsum of G_C in the group)} · (the state entering the group), element-wise in XLA;
  3. `apply`: from A_in, the chunk's rows one by one in registers (A ← e^{g_t} A + b_t, y_t = transform(A)).
Backward (residuals: the inputs and A_in [B, NC, H, K], named for rematerialisation). dA_t is the cotangent
reaching A_t through y_t, λ_t the total cotangent of A_t, ν_c that of A_in[c]:
  B1. `carry_grad` recomputes the rows' A_t and dA_t: s'_c = Σ_{t∈c} e^{G_t} dA_t;
  B2. ν_c = s'_c + e^{G_C(c)} ν_{c+1}, ν_NC = dA_T (dA_0 = ν_0): the same two-level scan on the chunk-reversed arrays;
  B3. `grads`: the rows' A_t forward, then in reverse λ_t = dA_t + e^{g_{t+1}} λ_{t+1} (after the last row:
      ν_{c+1}); dk = 2βk ⊙ λ, dβ_t = Σ_K k² ⊙ λ_t, dg_t = e^{g_t} Σ_K λ_t ⊙ A_{t−1}, plus the transform's own
      terms (pdn: dk += dy ⊙ M and the center's dc; atq: dq = dy / (A + λ)). dβ, dg of a split K and dc of
      every program come out as partial sums over an extra axis, summed in XLA.
Faults stay where the token-serial recurrence puts them (`confines_faults`, unpacked): a column sum keeps a
non-finite b_t or w_t in its channel's summary, the carries' `decayed_sum` makes the channel dead from that
chunk on without touching earlier chunks, and the rows of a chunk run one by one from a finite A_in.
Every factor is e^{g}, e^{G} or e^{G_C − G} ≤ 1: nothing to mask, nothing overflows. Every row of a chunk is
loaded before the first store (a load after a store to a ref that may alias it is not issued early).
T is zero-padded to a multiple of C (b = 0, g = 0 leave A unchanged, so A_T is exact), K to a power of two ≥ 16.

The rows run one by one rather than as the dot form A = Γ b + e^{G} A_in: the kernels are memory-bound, and the
fp32 [C, C] dot would cost more than the whole pass (docs/benchmarks.md). Wider chunks hold more rows than the
registers of `grads` do.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import precond_shell as shell
from pallas_kernels.arrays import tuning_entry
from pallas_kernels.gpu import common, decayed_sum
from pallas_kernels.gpu.chunk_math import F32
from pallas_kernels.gpu.common import SQUEEZED as _SQ
from pallas_kernels.gpu.common import default_interpret, pad_axis, padded_dim, pallas_call
from pallas_kernels.shells import bind
from pallas_kernels.spec import Spec, is_pow2
from pallas_kernels.wrapper_math import head_major, pad_tokens, padded_length, pdn_scale, precond_transform


@dataclasses.dataclass(frozen=True)
class Config:
  """Launch parameters (speed only, not numerics up to fp32 summation order); the defaults were measured fastest
  on an H200, interpret mode runs C = 4 (`INTERPRET`: unrolled rows only cost compile time there)."""
  chunk: int = 16                 # tokens per program (C); the recurrence runs row by row over them in registers
  block_k: int = 128              # K columns per program (clamped to the padded K)
  warps: int = 2                  # num_warps of every kernel (no loops: num_stages = 1)
  carry_group: int = 64           # chunks per program of the carries' first level (0: one serial scan over all)

  def __post_init__(self):
    for name in ("chunk", "block_k", "warps"):
      if not is_pow2(getattr(self, name)):
        raise ValueError(f"Config.{name}={getattr(self, name)} must be a power of two")
    if not 4 <= self.chunk <= 64:
      raise ValueError(f"Config.chunk={self.chunk} must be in [4, 64]")
    if not 16 <= self.block_k <= 256:
      raise ValueError(f"Config.block_k={self.block_k} must be in [16, 256]")
    if self.carry_group < 0:
      raise ValueError(f"Config.carry_group={self.carry_group} must be ≥ 0")

  def override(self, *assignments: str, **values) -> "Config":
    """A copy with fields replaced: "field=value" strings and/or keyword arguments (`common.override`)."""
    return common.override(self, *assignments, **values)


DEFAULT = Config()
INTERPRET = Config(chunk=4, carry_group=8)
TUNING = {"interpret": INTERPRET, "H200": DEFAULT}     # by device kind, as `osdn.config.TUNING`


def default_config(spec=None, device_kind: str | None = None) -> Config:
  """The tuning table's config for `device_kind` (the first entry whose key it contains), else DEFAULT."""
  del spec
  return tuning_entry(TUNING, device_kind, DEFAULT)


@dataclasses.dataclass(frozen=True)
class Static:
  """The non-differentiable part of one call (hashable): the transform and its constants, launch config, interpret."""
  transform: str          # "pdn" | "atq"
  x: float
  eps: float
  lam: float
  config: Config
  interpret: bool

  @property
  def pdn(self) -> bool:
    return self.transform == "pdn"


# ---------------------------------------------------------------------------------------------------------
# In-kernel math. Rows of a chunk are [BK] fp32 register values; every row is loaded before the first store (a
# load after a store to a ref that may alias it could not be issued earlier), the recurrence runs row by row.
# ---------------------------------------------------------------------------------------------------------
def _transform(st, A, k, p):
  """y [BK] from A, k and p: the center (pdn) or q (atq)."""
  return precond_transform(st.transform, A, k, p, x=st.x, eps=st.eps, lam=st.lam)


def _transform_vjp(st, A, k, p, dy):
  """(dA, d_in, dc): the cotangent reaching A through y, that of k (pdn) or q (atq) through y directly, and
  pdn's ∂⟨dy, y⟩/∂c (None for atq); all [BK]."""
  if st.pdn:
    M, u = pdn_scale(A, p, st.x, st.eps)
    dz = -math.log(st.x) * (dy * k) * M * u * u           # ∂M/∂z = −log(x) M / (1 + |z|)²
    return dz / (A + st.eps), dy * M, -dz
  r = 1.0 / (A + st.lam)
  return -dy * p * r * r, dy * r, None


class _Rows(NamedTuple):
  """One chunk's rows, loaded: k, p (q rows, or the center repeated), dy (backward) as lists of [BK] fp32; β,
  e^{g} and e^{G} (in-chunk cumsum) as lists of scalars."""
  k: list
  p: list
  dy: list
  beta: list
  decay: list
  decay_cum: list


def _load_rows(st, k_ref, p_ref, beta_ref, g_ref, G_ref=None, dy_ref=None):
  c = k_ref.shape[0]
  f32 = lambda ref, t: ref[t, :].astype(F32)
  p = [p_ref[...]] * c if st.pdn else [f32(p_ref, t) for t in range(c)]
  return _Rows(k=[f32(k_ref, t) for t in range(c)], p=p,
               dy=None if dy_ref is None else [f32(dy_ref, t) for t in range(c)],
               beta=[beta_ref[t] for t in range(c)], decay=[jnp.exp(g_ref[t]) for t in range(c)],
               decay_cum=None if G_ref is None else [jnp.exp(G_ref[t]) for t in range(c)])


def _moments(rows, A_in):
  """[A_t for every row] of A_t = e^{g_t} A_{t−1} + β_t k_t², from A_in [BK]."""
  A, out = A_in, []
  for k, beta, decay in zip(rows.k, rows.beta, rows.decay):
    A = decay * A + beta * k * k
    out.append(A)
  return out


def _summaries_kernel(st, k_ref, w_ref, s_ref):
  k = k_ref[...].astype(F32)
  s_ref[...] = jnp.sum(w_ref[...][:, None] * k * k, axis=0)


def _apply_kernel(st, k_ref, p_ref, beta_ref, g_ref, ain_ref, y_ref):
  rows = _load_rows(st, k_ref, p_ref, beta_ref, g_ref)
  moments = _moments(rows, ain_ref[...])

  def write(finite):
    for t, A in enumerate(moments):
      if not finite:    # ATQ's q / (inf + λ) would be a finite 0; PDN's scale of an infinite A is NaN already
        A = jnp.where(jnp.abs(A) < jnp.inf, A, jnp.nan)
      y_ref[t, :] = _transform(st, A, rows.k[t], rows.p[t]).astype(y_ref.dtype)

  if st.pdn:
    write(True)
  else:
    # A non-finite A_t stays non-finite through the chunk (its decay e^g is positive), so a finite last row in
    # every channel means a clean chunk: the selects are skipped.
    fine = jnp.min(jnp.where(jnp.abs(moments[-1]) < jnp.inf, 1.0, 0.0)) > 0.0
    lax.cond(fine, lambda: write(True), lambda: write(False))


def _carry_grad_kernel(st, k_ref, p_ref, beta_ref, g_ref, G_ref, ain_ref, dy_ref, s_ref):
  rows = _load_rows(st, k_ref, p_ref, beta_ref, g_ref, G_ref, dy_ref)
  s = jnp.zeros_like(rows.k[0])
  for t, A in enumerate(_moments(rows, ain_ref[...])):
    s = s + rows.decay_cum[t] * _transform_vjp(st, A, rows.k[t], rows.p[t], rows.dy[t])[0]
  s_ref[...] = s


def _grads_kernel(st, k_ref, p_ref, beta_ref, g_ref, ain_ref, dy_ref, nu_ref, *out_refs):
  if st.pdn:
    dk_ref, dbeta_ref, dg_ref, dc_ref = out_refs
  else:
    dk_ref, dq_ref, dbeta_ref, dg_ref = out_refs
  rows = _load_rows(st, k_ref, p_ref, beta_ref, g_ref, dy_ref=dy_ref)
  A_in = ain_ref[...]
  As = _moments(rows, A_in)
  carry = nu_ref[...]                                      # e^{g_{t+1}} λ_{t+1}; for the last row ν_{c+1}
  dc = jnp.zeros_like(A_in)
  for t in reversed(range(len(As))):
    k, beta = rows.k[t], rows.beta[t]
    dA, d_in, dc_t = _transform_vjp(st, As[t], k, rows.p[t], rows.dy[t])
    lam = dA + carry
    dk = 2.0 * beta * k * lam
    if st.pdn:
      dk, dc = dk + d_in, dc + dc_t
    else:
      dq_ref[t, :] = d_in.astype(dq_ref.dtype)
    dk_ref[t, :] = dk.astype(dk_ref.dtype)
    dbeta_ref[t] = jnp.sum(k * k * lam)
    # dg_t = Σ λ_t ⊙ e^{g_t} A_{t−1} (= Σ λ_t ⊙ (A_t − b_t) without the cancellation)
    dg_ref[t] = rows.decay[t] * jnp.sum(lam * (As[t - 1] if t else A_in))
    carry = rows.decay[t] * lam
  if st.pdn:
    dc_ref[...] = dc


# ---------------------------------------------------------------------------------------------------------
# Layout and launches.
# ---------------------------------------------------------------------------------------------------------
class _Prep(NamedTuple):
  """The padded, laid-out inputs: k [B, Tp, H, Kp]; p = q [B, Tp, H, Kp] or the center broadcast to [H, Kp];
  head-major [B, H, Tp]: beta, g, G (in-chunk cumsums of g), w = β e^{G_C − G}; G_C [B, NC, H] (chunk totals);
  A0 [B, H, Kp]."""
  k: jax.Array
  p: jax.Array
  beta: jax.Array
  g: jax.Array
  G: jax.Array
  w: jax.Array
  G_C: jax.Array
  A0: jax.Array


def _prepare_arrays(k, q, beta, g, A0, center, st):
  b, t, h, kd = k.shape
  c = st.config.chunk
  tp, kp = padded_length(t, c), padded_dim(kd)
  nc = tp // c
  g, beta = head_major(g, tp), head_major(beta, tp)                                          # [B, H, Tp]
  G = jnp.cumsum(g.reshape(b, h, nc, c), axis=-1)
  w = beta.reshape(b, h, nc, c) * jnp.exp(G[..., -1:] - G)
  p = jnp.broadcast_to(center[:, None], (h, kp)) if st.pdn else pad_tokens(q, tp, kp)
  return _Prep(k=pad_tokens(k, tp, kp), p=p, beta=beta, g=g, G=G.reshape(b, h, tp), w=w.reshape(b, h, tp),
               G_C=jnp.swapaxes(G[..., -1], 1, 2), A0=pad_axis(A0, 2, kp))


def _specs(prep, st):
  """BlockSpecs over the grid (b, h, c, l), and the grid."""
  b, tp, h, kp = prep.k.shape
  c, bk = st.config.chunk, min(st.config.block_k, kp)
  tokens = pl.BlockSpec((_SQ, c, _SQ, bk), lambda i, j, n, l: (i, n, j, l))          # [B, Tp, H, Kp]
  gates = pl.BlockSpec((_SQ, _SQ, c), lambda i, j, n, l: (i, j, n))                  # [B, H, Tp]
  chunks = pl.BlockSpec((_SQ, _SQ, _SQ, bk), lambda i, j, n, l: (i, n, j, l))        # [B, NC, H, Kp]
  head = pl.BlockSpec((_SQ, bk), lambda i, j, n, l: (j, l))                          # [H, Kp]
  parts = pl.BlockSpec((_SQ, _SQ, _SQ, c), lambda i, j, n, l: (l, i, j, n))          # [Kp/BK, B, H, Tp]
  specs = dict(tokens=tokens, gates=gates, chunks=chunks, parts=parts, p=head if st.pdn else tokens)
  return specs, (b, h, tp // c, kp // bk)


def _launch(kernel, prep, st, ins, outs, name):
  """pallas_call of kernel(st, *inputs, *outputs); ins: [(array, spec name)], outs: [(ShapeDtypeStruct, spec
  name)]. The kernels have no loop: num_stages = 1."""
  specs, grid = _specs(prep, st)
  return pallas_call(functools.partial(kernel, st), grid=grid, in_specs=[specs[s] for _, s in ins],
                     out_specs=[specs[s] for _, s in outs], out_shape=[o for o, _ in outs],
                     interpret=st.interpret, num_warps=st.config.warps, num_stages=1, name=name)(
                         *(a for a, _ in ins))


def _chunk_shape(prep):
  b, tp, h, kp = prep.k.shape
  return jax.ShapeDtypeStruct((b, prep.G_C.shape[1], h, kp), F32)


def _summaries(prep, st):
  """s_c = Σ_{j∈c} e^{G_C − G_j} β_j k_j² [B, NC, H, Kp] fp32."""
  return _launch(_summaries_kernel, prep, st, [(prep.k, "tokens"), (prep.w, "gates")],
                 [(_chunk_shape(prep), "chunks")], "precond_key_summaries")[0]


def _chunk_scan(s, G_C, A0, st):
  """(A_end [B, NC, H, Kp], A_T [B, H, Kp]) of A_end[c] = e^{G_C(c)} A_end[c−1] + s_c, A_end[−1] = A0.

  One serial `decayed_sum` over NC entries runs B·H·Kp/32 programs, each NC/64 dependent steps: at B = 1,
  T = 32768 that is 32 programs of 32 steps, 0.08 ms. In two levels instead: each group of n = carry_group
  chunks from zero (B·NG·H·Kp/32 programs, one step each), the groups' ends e_g with the group's total decay in
  a serial scan NG long (the state E_g after group g), and A_end[c] = local[c] + e^{Σ_{c'≤c in g} G_C(c')} E_{g−1}.
  Chunk totals G_C may lie far below the −30 floor of per-token log-decays: `decayed_sum.scan` is unclamped.
  """
  n = st.config.carry_group
  b, nc, h, kp = s.shape
  if not n or nc <= n:
    return decayed_sum.scan(s, None, G_C, A0, interpret=st.interpret)
  ng = -(-nc // n)
  s, G_C = pad_axis(s, 1, ng * n), pad_axis(G_C, 1, ng * n)          # s = 0, G_C = 0: A unchanged, A_T exact
  local, ends = decayed_sum.scan(s.reshape(b * ng, n, h, kp), None, G_C.reshape(b * ng, n, h),
                                 jnp.zeros((b * ng, h, kp), F32), interpret=st.interpret)
  cum = jnp.cumsum(G_C.reshape(b, ng, n, h), axis=2)                                 # [B, NG, n, H]
  E, A_T = decayed_sum.scan(ends.reshape(b, ng, h, kp), None, cum[:, :, -1], A0, interpret=st.interpret)
  entering = jnp.concatenate([A0[:, None], E[:, :-1]], axis=1)                       # [B, NG, H, Kp]
  A_end = local.reshape(b, ng, n, h, kp) + jnp.exp(cum)[..., None] * entering[:, :, None]
  return A_end.reshape(b, ng * n, h, kp)[:, :nc], A_T


def _carries(prep, st):
  """(A_in [B, NC, H, Kp]: the state entering every chunk, A_T [B, H, Kp]) from the chunk summaries."""
  A_end, A_T = _chunk_scan(_summaries(prep, st), prep.G_C, prep.A0, st)
  return jnp.concatenate([prep.A0[:, None], A_end[:, :-1]], axis=1), A_T


def _reverse_carries(s_grad, prep, dA_T, st):
  """ν_c = s'_c + e^{G_C(c)} ν_{c+1}, ν_NC = dA_T, as the forward recurrence on the chunk-reversed arrays.
  Returns (ν_{c+1} for every chunk c [B, NC, H, Kp], ν_0 = dA_0 [B, H, Kp])."""
  nu, nu_0 = _chunk_scan(jnp.flip(s_grad, 1), jnp.flip(prep.G_C, 1), dA_T, st)
  return jnp.concatenate([jnp.flip(nu, 1)[:, 1:], dA_T[:, None]], axis=1), nu_0


def _common(prep):
  return [(prep.k, "tokens"), (prep.p, "p"), (prep.beta, "gates"), (prep.g, "gates")]


def _apply(prep, A_in, st, dtype):
  y = jax.ShapeDtypeStruct(prep.k.shape, dtype)
  return _launch(_apply_kernel, prep, st, _common(prep) + [(A_in, "chunks")], [(y, "tokens")],
                 "precond_key_apply")[0]


def _carry_grad(prep, A_in, dy, st):
  """s'_c = Σ_{t∈c} e^{G_t} dA_t [B, NC, H, Kp]."""
  ins = _common(prep) + [(prep.G, "gates"), (A_in, "chunks"), (dy, "tokens")]
  return _launch(_carry_grad_kernel, prep, st, ins, [(_chunk_shape(prep), "chunks")],
                 "precond_key_carry_grad")[0]


def _grads(prep, A_in, dy, nu_next, st, q_dtype):
  """pdn: (dk, dβ parts, dg parts, dc parts); atq: (dk, dq, dβ parts, dg parts). Parts of dβ, dg:
  [Kp/BK, B, H, Tp]; of dc: [B, NC, H, Kp]."""
  b, tp, h, kp = prep.k.shape
  nk = _specs(prep, st)[1][3]
  part = (jax.ShapeDtypeStruct((nk, b, h, tp), F32), "parts")
  outs = [(jax.ShapeDtypeStruct(prep.k.shape, prep.k.dtype), "tokens")]
  if st.pdn:
    outs += [part, part, (_chunk_shape(prep), "chunks")]
  else:
    outs += [(jax.ShapeDtypeStruct(prep.k.shape, q_dtype), "tokens"), part, part]
  ins = _common(prep) + [(A_in, "chunks"), (dy, "tokens"), (nu_next, "chunks")]
  return _launch(_grads_kernel, prep, st, ins, outs, "precond_key_grads")


# ---------------------------------------------------------------------------------------------------------
# What the shell runs: the kernels' inputs are (k, q, beta, g, A0, center), as the shell forms them.
# ---------------------------------------------------------------------------------------------------------
def _prepare(transform: shell.Transform, config: Config, interpret: bool, k, q, beta, g, A0, center):
  st = Static(transform.name, transform.x, transform.eps, transform.lam, config, interpret)
  return st, (k, q, beta, g, A0, center), None


def _forward_saving(st: Static, inputs):
  """((y, A_T), A_in): the kernels' results and the state entering every chunk."""
  k, q, beta, g, A0, center = inputs
  prep = _prepare_arrays(k, q, beta, g, A0, center, st)
  A_in, A_T = _carries(prep, st)
  y = _apply(prep, A_in, st, k.dtype if st.pdn else q.dtype)
  _, t, _, kd = k.shape
  return (y[:, :t, :, :kd], A_T[..., :kd]), A_in


def _backward(st: Static, inputs, A_in, cts):
  k, q, beta, g, A0, center = inputs
  dy, dA_T = cts
  prep = _prepare_arrays(k, q, beta, g, A0, center, st)
  b, t, h, kd = k.shape
  tp, kp = prep.k.shape[1], prep.k.shape[3]
  dy = pad_tokens(dy, tp, kp)
  nu_next, dA0 = _reverse_carries(_carry_grad(prep, A_in, dy, st), prep, pad_axis(dA_T.astype(F32), 2, kp), st)
  outs = _grads(prep, A_in, dy, nu_next, st, None if st.pdn else q.dtype)
  if st.pdn:
    dk, dbeta, dg, dc = outs
    dq, dc = None, jnp.sum(dc, axis=(0, 1, 3))
  else:
    (dk, dq, dbeta, dg), dc = outs, None
    dq = dq[:, :t, :, :kd]
  time_major = lambda x: jnp.swapaxes(jnp.sum(x, axis=0), 1, 2)[:, :t]
  return dk[:, :t, :, :kd], dq, time_major(dbeta), time_major(dg), dA0[..., :kd], dc


BACKEND = shell.Backend(
    name="pallas gpu", default_config=default_config, interpret_mode=default_interpret, prepare=_prepare,
    forward=lambda st, inputs: _forward_saving(st, inputs)[0], forward_saving=_forward_saving, backward=_backward,
    finish=lambda st, inputs, outputs, aux: outputs)

precond_key = bind(shell.precond_key, BACKEND, __name__)
precond_key.confines_faults = True   # unpacked: NaN where the token-serial recurrence has it (module docstring)


def supports(spec: Spec) -> bool:
  """Compiled on "gpu", interpret mode on "cpu"; fp32 or bf16 inputs (computed in fp32); unpacked; static
  transform constants; a config, when the request carries one, of this family."""
  return (spec.platform in ("gpu", "cpu")
          and spec.dtype in ("float32", "bfloat16")
          and not spec.packed
          and spec.static_params
          and spec.config_of(Config))
