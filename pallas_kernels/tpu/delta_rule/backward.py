"""The fused backward kernel: one chunk per grid step, chunks visited last to first, dS carried in VMEM.

The forward saves the state S entering every chunk; per chunk the backward re-forms the forward's A, T, W, U and
V_new from it (kernel.py's notation) and, with dS' the cotangent of the state leaving the chunk and dO of the
outputs (scale folded into dO), forms

  dV_new = Pᵀ dO + R ⊙ (K̃ dS')            P = (Q K̃ᵀ) ⊙ Γ' (the output scores), R = e^{G_C − G} on the rows
  dS     = e^{G_C} dS' + (e^G ⊙ Q)ᵀ dO − Wᵀ dV_new                     (the cotangent entering the chunk)
  X      = Tᵀ dV_new,  Y = −Tᵀ (dV_new Sᵀ)    dV = β ⊙ X,  dK ← β e^G ⊙ Y,  dβ ← rowsum(X ⊙ V + e^G Y ⊙ K)
  dA     = −strictLower(X V_newᵀ)           since dT Tᵀ = dU Uᵀ + dW Wᵀ = dV_new V_newᵀ
  dQ     = e^G ⊙ (dO Sᵀ) + (dP ⊙ Γ') K̃,   dK̃ = (dP ⊙ Γ')ᵀ Q + (β dA ⊙ Γ)ᵀ K + R ⊙ (V_new dS'ᵀ),  dP = dO V_newᵀ
  dK    += (β dA ⊙ Γ) K̃

and dG, the cotangent of the in-chunk cumulative log-decay, from every factor e^{±G}: a pair factor
e^{G_i − G_j} of a matrix M with cotangent dM adds rowsum(dM ⊙ M) at i and subtracts colsum at j. With per-channel
decay the same terms are channel sums (`channel_rows`, `channel_cols`, the transposes of `channel_scores`), dG is
[C, K] and the kernel returns the cotangent of the log-decays themselves (dG's reverse in-chunk cumsum, as a dot
with the triangular ones). With scalar decay the caller differentiates its cumsum.

Every dot that builds T or dA runs at full fp32 precision; with bf16 inputs and `bf16_matmuls` the others take bf16
operands with fp32 accumulation, as in the forward.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu.delta_rule.kernel import (F32, HIGHEST, chunk_forward, column, dot, grid_spec, iota,
                                                  masked_exp, ones_where, segment_flags)
from pallas_kernels.tpu.common import interpret_mode
from pallas_kernels.tpu.delta_rule.layout import Layout


def _row(col, i, j):
  """[C, 1] → [1, C] (the inverse of `column`)."""
  return jnp.sum(jnp.where(i == j, col, 0.0), axis=0, keepdims=True)


def _diagonal(m, i, j, d: int):
  """The d-th diagonal of m [C, C] as a column: m[r, r − d] at row r (d ≥ 0: below the main diagonal) or
  m[r, r − d] = m[r, r + |d|] (d < 0: above); 0 where it leaves the matrix."""
  return jnp.sum(jnp.where(j == i - d, m, 0.0), axis=1, keepdims=True)


def channel_rows(m, y, g_ref, *, sub: int, mm=F32, precision=HIGHEST):
  """R_ic = Σ_{j ≤ i} m_ij y_jc e^{G_ic − G_jc}: [C, K] fp32 for m [C, C] (zero above the diagonal), y [C, K] and
  per-channel G [C, K] in g_ref (non-increasing along the rows). As `channel_scores`: pairs inside the s×s
  diagonal sub-blocks one diagonal at a time (y, G rolled down d rows, the exponent ≤ 0 masked before exp), rows of
  sub-block a against earlier columns through the reference row r = a·s − 1 (both factors ≤ 1)."""
  c, kd = y.shape
  s = min(sub, c)
  g = g_ref[...]
  i, j = iota(c, 0), iota(c, 1)
  pos = lax.broadcasted_iota(jnp.int32, (c, 1), 0) & (s - 1)
  out = jnp.zeros((c, kd), F32)
  for d in range(s):
    shift = np.int32(d)
    y_d, g_d = (y, g) if d == 0 else (pltpu.roll(y, shift, 0), pltpu.roll(g, shift, 0))   # row i: y, G of i − d
    ok = pos >= d
    out = out + jnp.where(ok, _diagonal(m, i, j, d), 0.0) * y_d * masked_exp(g - g_d, ok)
  if c == s:
    return out
  blocks = [jnp.zeros((s, kd), F32)]
  cols = lax.broadcasted_iota(jnp.int32, (s, c), 1)
  for a in range(1, c // s):
    rows = slice(a * s, (a + 1) * s)
    g_r = g_ref[a * s - 1:a * s, :]                                   # [1, K]
    yc = y * jnp.exp(jnp.minimum(g_r - g, 0.0))                       # rows after r are dropped by the mask
    part = dot(jnp.where(cols < a * s, m[rows, :], 0.0).astype(mm), yc.astype(mm), precision=precision)
    blocks.append(jnp.exp(g[rows, :] - g_r) * part)
  return out + jnp.concatenate(blocks, axis=0)


def channel_cols(mt, x, g_ref, *, sub: int, mm=F32, precision=HIGHEST):
  """L_jc = Σ_{i ≥ j} m_ij x_ic e^{G_ic − G_jc}: [C, K] fp32, given mt = mᵀ [C, C] (zero below the diagonal),
  x [C, K] and G [C, K] in g_ref. Pairs inside the diagonal sub-blocks one diagonal at a time (x, G rolled up
  d rows); rows of sub-block b against later columns of mt through the reference row r = (b + 1)·s − 1, the
  sub-block's last."""
  c, kd = x.shape
  s = min(sub, c)
  g = g_ref[...]
  i, j = iota(c, 0), iota(c, 1)
  pos = lax.broadcasted_iota(jnp.int32, (c, 1), 0) & (s - 1)
  out = jnp.zeros((c, kd), F32)
  for d in range(s):
    shift = np.int32((c - d) % c)
    x_d, g_d = (x, g) if d == 0 else (pltpu.roll(x, shift, 0), pltpu.roll(g, shift, 0))   # row r: x, G of r + d
    ok = pos < s - d
    out = out + jnp.where(ok, _diagonal(mt, i, j, -d), 0.0) * x_d * masked_exp(g_d - g, ok)
  if c == s:
    return out
  blocks = []
  cols = lax.broadcasted_iota(jnp.int32, (s, c), 1)
  for b in range(c // s - 1):
    rows = slice(b * s, (b + 1) * s)
    r = (b + 1) * s - 1
    g_r = g_ref[r:r + 1, :]
    xc = x * jnp.exp(jnp.minimum(g - g_r, 0.0))                       # rows up to r are dropped by the mask
    part = dot(jnp.where(cols > r, mt[rows, :], 0.0).astype(mm), xc.astype(mm), precision=precision)
    blocks.append(jnp.exp(g_r - g[rows, :]) * part)
  blocks.append(jnp.zeros((s, kd), F32))
  return out + jnp.concatenate(blocks, axis=0)


def _kernel(*refs, decay: str, same_keys: bool, has_dst: bool, scale: float, bf16_matmuls: bool, sub: int, num_chunks: int,
            packed: bool):
  """One grid step (b, h, j, c), visiting chunk NC − 1 − c. refs: [packed: the chunk codes (SMEM)]; q, k,
  [k_write], v [C, ·]; the gates [R, C]; [log-decays [C, K]]; the state entering the chunk [K, BV]; dO [C, BV];
  [dS_T [K, BV]]; outputs dq, dk, [dk_write] [C, K] and dv [C, BV] partials, d gates [R, C] (dβ, and dG with
  scalar decay), [d log-decays [C, K]], dS0 [K, BV]; scratch dS [K, BV] fp32, [G [C, K] fp32]. Packed, dS
  restarts from the segment's dS_T at its last chunk and leaves as its dS0 at its first."""
  it = iter(refs)
  codes_ref = next(it) if packed else None
  q_ref, k_ref = next(it), next(it)
  kw_ref = k_ref if same_keys else next(it)
  v_ref, gates_ref = next(it), next(it)
  ld_ref = next(it) if decay == "channel" else None
  s_in_ref, do_ref = next(it), next(it)
  dst_ref = next(it) if has_dst else None
  dq_ref, dk_ref = next(it), next(it)
  dkw_ref = dk_ref if same_keys else next(it)
  dv_ref, dgates_ref = next(it), next(it)
  dld_ref = next(it) if decay == "channel" else None
  ds0_ref, ds_ref = next(it), next(it)
  g_ref = next(it) if decay == "channel" else None
  c = pl.program_id(3)
  chunk = np.int32(num_chunks - 1) - c
  starts, ends = segment_flags(codes_ref, chunk) if packed else (chunk == 0, c == 0)

  @pl.when(c == 0)
  def _():
    ds_ref[...] = jnp.zeros(ds_ref.shape, F32)

  if has_dst:
    @pl.when(ends)
    def _():
      ds_ref[...] = dst_ref[...].astype(F32)

  s, dsp = s_in_ref[...], ds_ref[...]
  do = scale * do_ref[...].astype(F32)
  # The forward's chunk, re-formed from the saved entering state.
  f = chunk_forward(q_ref, k_ref, kw_ref, v_ref, gates_ref, ld_ref, g_ref, s, decay=decay, sub=sub, bf16_matmuls=bf16_matmuls)
  q, k, kw, v, n, i, j = f.q, f.k, f.kw, f.v, f.n, f.i, f.j
  kd = k.shape[1]
  beta_col, eg, g_end, ret, kk, p, t, w_in, w, v_new = (f.beta_col, f.eg, f.g_end, f.ret, f.kk, f.scores, f.t,
                                                         f.w_in, f.w, f.v_new)
  strict, causal = f.strict, f.causal
  lo, prec, mm = f.lo, f.prec, (jnp.bfloat16 if bf16_matmuls else F32)
  a = beta_col * kk
  last = lax.broadcasted_iota(jnp.int32, (1, n), 1) == n - 1

  # Cotangents of V_new and of the state entering the chunk.
  kw_ret = kw.astype(F32) * ret if decay != "none" else kw.astype(F32)
  dv_new = dot(lo(p), lo(do), ta=True, precision=prec) + dot(lo(kw_ret), lo(dsp), precision=prec)
  q_eg = q.astype(F32) * eg if decay != "none" else q
  if decay == "channel":
    e_end = jnp.exp(column(g_end, iota(kd, 0), iota(kd, 1)))        # [K, 1]
    ds_new = e_end * dsp
  elif decay == "scalar":
    ds_new = jnp.exp(g_end) * dsp
  else:
    ds_new = dsp
  ds_new = ds_new + dot(lo(q_eg), lo(do), ta=True, precision=prec) - dot(lo(w), lo(dv_new), ta=True, precision=prec)

  # The solve: U = T diag(β) V, W = T diag(β e^G) K (channel: K ⊙ e^G), A = diag(β) kk.
  x = dot(t, dv_new, ta=True, precision=HIGHEST)                     # Tᵀ dV_new, [C, BV]
  dv = beta_col * x
  y = -dot(t, dot(lo(dv_new), lo(s), tb=True, precision=prec), ta=True, precision=HIGHEST)   # Tᵀ dW, [C, K]
  y_w = jnp.sum(y * w_in.astype(F32), axis=1, keepdims=True)        # rowsum(Y ⊙ W's right factor)
  da = -dot(x, v_new, tb=True, precision=HIGHEST) * ones_where(i > j)
  dbeta = jnp.sum(x * v.astype(F32), axis=1, keepdims=True) + jnp.sum(da * kk, axis=1, keepdims=True)
  dm = beta_col * da                                                 # cotangent of kk's (masked) pair sums

  # Output and state terms.
  dqs = dot(lo(do), lo(s), tb=True, precision=prec)                  # dO Sᵀ, [C, K]
  dvs = dot(lo(v_new), lo(dsp), tb=True, precision=prec)             # V_new dS'ᵀ, [C, K]
  dp = dot(lo(do), lo(v_new), tb=True, precision=prec) * ones_where(i >= j)      # dP, [C, C]

  if decay == "channel":
    dbeta = dbeta + y_w
    dq = eg * dqs + channel_rows(dp, kw.astype(F32), g_ref, sub=sub, mm=mm, precision=prec)
    dkw_p = channel_cols(dp.T, q.astype(F32), g_ref, sub=sub, mm=mm, precision=prec)
    dk_a = channel_rows(dm, kw.astype(F32), g_ref, sub=sub, mm=mm, precision=prec)
    dkw_a = channel_cols(dm.T, k.astype(F32), g_ref, sub=sub, mm=mm, precision=prec)
    dk = beta_col * y * eg + dk_a
    dkw = dkw_p + dkw_a + ret * dvs
    dG = (q_eg * dqs + (dq - eg * dqs) * q.astype(F32) - dkw_p * kw.astype(F32)
          + beta_col * y * w_in + dk_a * k.astype(F32) - dkw_a * kw.astype(F32) - kw_ret * dvs)
    end = lax.broadcasted_iota(jnp.int32, (n, 1), 0) == n - 1
    sd = jnp.sum(s * dsp, axis=1, keepdims=True)                     # [K, 1]
    dG_end = jnp.exp(g_end) * _row(sd, iota(kd, 0), iota(kd, 1)) + jnp.sum(kw_ret * dvs, axis=0, keepdims=True)
    dG = dG + jnp.where(end, dG_end, 0.0)
    dld_ref[...] = dot(ones_where(i >= j), dG, ta=True, precision=HIGHEST).astype(dld_ref.dtype)
    dgates_ref[...] = _row(dbeta, i, j).astype(dgates_ref.dtype)
  else:
    dqk = dp * causal                                                # cotangent of Q K̃ᵀ
    dkk = dm * strict                                                # cotangent of K K̃ᵀ
    dq = dot(lo(dqk), lo(kw), precision=prec)
    dkw = dot(lo(dqk), lo(q), ta=True, precision=prec) + dot(lo(dkk), lo(k), ta=True, precision=prec)
    dk = dot(lo(dkk), lo(kw), precision=prec)
    if decay == "scalar":
      dq = dq + eg * dqs
      dk = dk + (beta_col * eg) * y
      dkw = dkw + ret * dvs
      dbeta = dbeta + eg * y_w
      pair = dp * p + da * a                                         # the pair factors e^{G_i − G_j} of P and A
      z = ret * jnp.sum(kw.astype(F32) * dvs, axis=1, keepdims=True)  # the state's factor e^{G_C − G_i}
      dG_col = (jnp.sum(pair, axis=1, keepdims=True) + eg * jnp.sum(q.astype(F32) * dqs, axis=1, keepdims=True)
                + beta_col * eg * y_w - z)
      dG_row = _row(dG_col, i, j) - jnp.sum(pair, axis=0, keepdims=True)
      dG_last = jnp.sum(z, axis=0, keepdims=True) + jnp.exp(g_end) * jnp.sum(s * dsp, keepdims=True)
      dG_row = dG_row + jnp.where(last, dG_last, 0.0)
      dgates_ref[...] = jnp.concatenate([_row(dbeta, i, j), dG_row], axis=0).astype(dgates_ref.dtype)
    else:
      dq = dq + dqs
      dk = dk + beta_col * y
      dkw = dkw + dvs
      dbeta = dbeta + y_w
      dgates_ref[...] = _row(dbeta, i, j).astype(dgates_ref.dtype)

  dq_ref[...] = dq.astype(dq_ref.dtype)
  if same_keys:
    dk_ref[...] = (dk + dkw).astype(dk_ref.dtype)
  else:
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dkw_ref[...] = dkw.astype(dkw_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)
  ds_ref[...] = ds_new

  @pl.when(starts)
  def _():
    ds0_ref[...] = ds_new


def backward_call(lay: Layout, q, k, kw, v, beta, G, states, do, dS_T, codes=None, *, scale: float, bf16_matmuls: bool,
                  interpret: bool, sub: int = 16, vmem_limit_bytes=None, grad_dtype=F32, segments: int = 0):
  """The pallas_call of the backward on the forward's prepared arrays (as `kernel.forward_call` takes them),
  `states` [B, HV, NC, K, V] fp32 from the forward, do [B, T, HV, V] and dS_T None or [B, HV, K, V].
  `lay` is the forward's layout (reverse is set here). Returns the partials, one per (value head, V block):
  dq, dk, dk_write (None with shared keys) [B, T, HV, NV, K] in grad_dtype; dv [B, T, HV, V] in grad_dtype;
  d gates [B, HV, R, T] fp32 summed over V blocks (dβ, and the cotangent of the scalar decay's G); d log-decays
  [B, T, HV, NV, K] fp32 (per channel, else None); dS0 [B, HV, K, V] fp32. Packed: codes as the forward's,
  dS_T and dS0 [N, HV, K, V] (`segments` = N; rows of segments without tokens unspecified)."""
  lay = dataclasses.replace(lay, reverse=True)
  same_keys = kw is None
  decay = "none" if G is None else ("scalar" if G.ndim == 3 else "channel")
  in_specs = [lay.key_spec(lay.heads), lay.key_spec(lay.heads)]
  args = [lay.tokens_in(q), lay.tokens_in(k)]
  if not same_keys:
    in_specs.append(lay.key_spec(lay.kw_heads))
    args.append(lay.tokens_in(kw))
  gates = jnp.stack([beta, G], axis=2) if decay == "scalar" else beta[:, :, None]
  in_specs += [lay.value_spec(), lay.gates_spec(gates.shape[2])]
  args += [lay.tokens_in(v), lay.gates(gates)]
  if decay == "channel":
    in_specs.append(lay.key_spec(lay.value_heads))
    args.append(lay.tokens_in(G))
  in_specs += [lay.chunk_states_spec(), lay.value_spec()]
  args += [states, lay.tokens_in(do.astype(q.dtype))]
  state_spec = lay.segment_state_spec() if lay.packed else lay.state_spec()
  if dS_T is not None:
    in_specs.append(state_spec)
    args.append(dS_T)
  r = gates.shape[2]
  key_part = jax.ShapeDtypeStruct(lay.partial_key_shape(), grad_dtype)
  out_shape = [key_part, key_part] + ([] if same_keys else [key_part])
  out_shape += [jax.ShapeDtypeStruct(lay.output_shape(), grad_dtype),
                jax.ShapeDtypeStruct(lay.partial_gates_shape(r), F32)]
  out_specs = [lay.partial_key_spec()] * (2 if same_keys else 3) + [lay.value_spec(), lay.partial_gates_spec(r)]
  if decay == "channel":
    out_shape.append(jax.ShapeDtypeStruct(lay.partial_key_shape(), F32))
    out_specs.append(lay.partial_key_spec())
  rows = segments if lay.packed else lay.batch
  out_shape.append(jax.ShapeDtypeStruct((rows, lay.value_heads, lay.key_dim, lay.value_dim), F32))
  out_specs.append(state_spec)
  kernel = functools.partial(_kernel, decay=decay, same_keys=same_keys, has_dst=dS_T is not None, scale=scale,
                             bf16_matmuls=bf16_matmuls, sub=sub, num_chunks=lay.num_chunks, packed=lay.packed)
  out_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in out_shape)
  in_bytes = sum(x.size * x.dtype.itemsize for x in args)
  c, kd, bv = lay.chunk, lay.key_dim, lay.block_v
  steps = lay.batch * lay.value_heads * lay.num_v * lay.num_chunks
  levels = max(c.bit_length() - 2, 0)
  flops = steps * (2 * c * c * (4 * kd + 4 * bv) + 4 * levels * c ** 3 + 2 * c * kd * bv * 9)
  scratch = [pltpu.VMEM((kd, bv), F32)] + ([pltpu.VMEM((c, kd), F32)] if decay == "channel" else [])
  outs = pl.pallas_call(
      kernel, out_shape=out_shape, grid_spec=grid_spec(lay, in_specs, out_specs, scratch),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=vmem_limit_bytes),
      cost_estimate=pl.CostEstimate(flops=int(flops), transcendentals=int(steps * 2 * c * c),
                                    bytes_accessed=int(in_bytes + out_bytes)),
      interpret=interpret_mode(interpret), name="delta_rule_bwd_tpu")(*([codes] if lay.packed else []), *args)
  outs = list(outs)
  dq, dk = lay.partial_keys_out(outs.pop(0)), lay.partial_keys_out(outs.pop(0))
  dkw = None if same_keys else lay.partial_keys_out(outs.pop(0))
  dv = lay.tokens_out(outs.pop(0))
  dgates = lay.partial_gates_out(outs.pop(0))
  dld = lay.partial_keys_out(outs.pop(0)) if decay == "channel" else None
  return dq, dk, dkw, dv, dgates, dld, outs.pop(0)
