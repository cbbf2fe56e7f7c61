"""The Pallas GPU delta rule: padding, the in-chunk decay cumsum, one `jax.custom_vjp` around the kernels.

`delta_rule` computes `osdn_jax.ops.delta_rule` (the contract; `osdn_jax.ops.chunked.delta_rule` has this
signature). In the wrapper (plain JAX, differentiated by autodiff; what the TPU wrapper does alike is
`pallas_kernels.wrapper_math`'s): T is zero-padded to a multiple of the chunk (β = 0, g = 0: the padded tokens
leave the state untouched), K and V to a power of two ≥ 16, log_decay is clamped at −30 and cumsummed within each
chunk (so the kernels' dG becomes d log_decay through a reverse cumsum; per channel both in the `chunk_cumsum`
kernels), β is laid out head-major.
Inside the custom_vjp (the kernels): forward = prep → state_pass → output; backward = W, U from T →
state_pass → dv_local → state_bwd → grads. The forward saves its inputs and T = (I + A)⁻¹ (fp32
[B, HV, T, C]: the one costly intermediate); W, U, the chunk states and V_new are recomputed.

`pdn_delta_rule` is PDN's write key followed by this solve in one custom_vjp: `precond_key`'s chunk summaries and
carries give the second moment entering every chunk, prep forms the key from it (`prep.PdnKey`) and stores it
for the state pass and the output; the backward is this solve's, then `precond_key`'s from the key's cotangent.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels import wrapper_math as wm
from pallas_kernels.arrays import check_precond_key, check_segment_ids, pad_axis, scale_parts
from pallas_kernels.gpu import precond_key
from pallas_kernels.gpu.common import MAX_DIM, default_interpret, padded_dim
from pallas_kernels.gpu.delta_rule import backward, chunk_cumsum, forward, heuristics
from pallas_kernels.gpu.delta_rule.config import DEFAULT, Config
from pallas_kernels.gpu.delta_rule.layout import Static
from pallas_kernels.gpu.delta_rule.prep import PdnKey
from pallas_kernels.spec import CHUNK_SIZES, LOG_DECAY_FLOOR, Spec


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _solve(st: Static, q, k, kw, v, beta, G, g, S0, info):
  """g: the padded per-channel log-decays when st.forward_chunk (else None). A forward that is not
  differentiated cumsums them within chunks of st.forward_chunk here and runs at that chunk; under autodiff g is
  unused and its cotangent a symbolic zero (computed outside, the wide cumsum's backward kernel would run on
  materialised zeros)."""
  if g is not None:
    G = chunk_cumsum.chunk_cumsum(g, st.forward_chunk, LOG_DECAY_FLOOR, interpret=st.interpret)
    st = dataclasses.replace(st, chunk=st.forward_chunk, forward_chunk=0)
  return forward.forward(st, q, k, k if kw is None else kw, v, beta, G, S0, info)


def _solve_fwd(st, q, k, kw, v, beta, G, g, S0, info):
  del g
  o, S_T, T = forward.forward(st, q, k, k if kw is None else kw, v, beta, G, S0, info, emit_t=True)
  # Named for rematerialisation policies: saving T (and the inputs) spares the backward a rerun of the prep.
  T = checkpoint_name(T, "delta_rule_T")
  return (o, S_T), (q, k, kw, v, beta, G, S0, info, T)


def _solve_bwd(st, res, cts):
  q, k, kw, v, beta, G, S0, info, T = res
  do, dS_T = cts
  dq, dk, dkw, dv, dbeta, dG, dS0 = backward.backward(
      st, (q, k, k if kw is None else kw, v, beta, G, S0, info, T), do, dS_T)
  dq, dk = wm.group_sum(dq, st.heads).astype(q.dtype), wm.group_sum(dk, st.heads).astype(k.dtype)
  if kw is not None:
    dkw = wm.group_sum(dkw, kw.shape[2]).astype(kw.dtype)
  return dq, dk, dkw, dv.astype(v.dtype), dbeta, dG, None, dS0, None


_solve.defvjp(_solve_fwd, _solve_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _pdn_solve(st: Static, kst: precond_key.Static, q, k, v, beta, G, S0, bp, gp, A0, center):
  """(o, S_T, A_T) of PDN's key (moment gates bp, gp [B, T, H] fp32, A0 [B, H, K], center [H]) and the solve;
  every array padded as `_solve`'s."""
  return _pdn_forward(st, kst, q, k, v, beta, G, S0, bp, gp, A0, center, emit_t=False)[0]


def _pdn_forward(st, kst, q, k, v, beta, G, S0, bp, gp, A0, center, emit_t):
  A_in, A_T, bp_heads, gp_heads = precond_key.pdn_moments(k, bp, gp, A0, center, kst)
  b, h, tp = gp_heads.shape
  Gp = jnp.cumsum(gp_heads.reshape(b, h, tp // st.chunk, st.chunk), axis=-1).reshape(b, h, tp)
  key = PdnKey(A_in[:, ::st.chunk // kst.config.chunk], bp_heads, Gp,
               jnp.broadcast_to(center[:, None], (h, st.key_dim)), kst.x, kst.eps)
  o, S_T, *T, kw = forward.forward(st, q, k, None, v, beta, G, S0, emit_t=emit_t, key=key)
  return (o, S_T, A_T), (kw, A_in, *T)


def _pdn_solve_fwd(st, kst, q, k, v, beta, G, S0, bp, gp, A0, center):
  out, (kw, A_in, T) = _pdn_forward(st, kst, q, k, v, beta, G, S0, bp, gp, A0, center, emit_t=True)
  # Named as `_solve_fwd`'s T and as the separate key's residuals (`precond.pdn_write_key`).
  kw, A_in = checkpoint_name(kw, "precond_pass"), checkpoint_name(A_in, "precond_pass")
  return out, (q, k, kw, v, beta, G, S0, checkpoint_name(T, "delta_rule_T"), bp, gp, A0, center, A_in)


def _pdn_solve_bwd(st, kst, res, cts):
  q, k, kw, v, beta, G, S0, T, bp, gp, A0, center, A_in = res
  do, dS_T, dA_T = cts
  dq, dk, dkw, dv, dbeta, dG, dS0 = backward.backward(st, (q, k, kw, v, beta, G, S0, None, T), do, dS_T)
  dk_key, dbp, dgp, dA0, dc = precond_key.pdn_backward(kst, k, bp, gp, A0, center, A_in, dkw, dA_T)
  dk = (dk.astype(jnp.float32) + dk_key.astype(jnp.float32)).astype(k.dtype)
  return dq.astype(q.dtype), dk, dv.astype(v.dtype), dbeta, dG, dS0, dbp, dgp, dA0, dc


_pdn_solve.defvjp(_pdn_solve_fwd, _pdn_solve_bwd)


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size", "forward_chunk", "config", "interpret",
                                             "low_precision", "num_segments", "key_static"))
def _delta_rule(q, k, v, beta, k_write, log_decay, initial_state, scale_arr, segment_ids, key_inputs=None, *,
                scale, chunk_size, forward_chunk, config, interpret, low_precision, num_segments, key_static=None):
  """key_static (`precond_key.Static`) with key_inputs (βᴾ, log-decayᴾ, center, A0ᴾ): PDN's key formed in the
  solve (`_pdn_solve`, unpacked, decay none or scalar); then also returns A_T."""
  b, t, h, kd = q.shape
  hv, vd = v.shape[2:]
  dtype = q.dtype
  n_seg = num_segments if segment_ids is not None else 0
  if n_seg:                               # one chunk-aligned row (pallas_kernels/packed.py)
    row, (q, k, v, beta, k_write, log_decay) = wm.to_row(segment_ids, n_seg, chunk_size, q, k, v, beta, k_write,
                                                         log_decay)
    tp, info = row.length, row.info
  else:
    tp, info = wm.padded_length(t, max(chunk_size, forward_chunk)), None
  kp, vp = padded_dim(kd), padded_dim(vd)
  q, scale = wm.fold_scale(q, scale, scale_arr)
  q, k, v = wm.pad_tokens(q, tp, kp), wm.pad_tokens(k, tp, kp), wm.pad_tokens(v, tp, vp)
  kw = None if k_write is None else wm.pad_tokens(k_write, tp, kp, dtype)
  beta = wm.head_major(beta, tp)                                                    # [B, HV, T]
  g_wide = None
  if log_decay is None:
    decay, G = "none", None
  elif log_decay.ndim == 3:
    decay, G = "scalar", wm.scalar_decay(log_decay, tp, chunk_size)                 # [B, HV, T]
  else:                                   # [B, T, HV, K]: the floor and the cumsum in one Pallas pass
    g = wm.channel_log_decay(log_decay, tp, kp)
    decay, G = "channel", chunk_cumsum.chunk_cumsum(g, chunk_size, LOG_DECAY_FLOOR, interpret=interpret)
    g_wide = g if forward_chunk else None
  if initial_state is None:
    S0 = jnp.zeros((n_seg or b, hv, kp, vp), jnp.float32)
  else:
    S0 = wm.pad_state(initial_state, kp, vp)
  S0_in = S0
  if n_seg:                               # [N, HV, K, V] → [1, HV, N·K, V] (segments without tokens: zeros)
    S0_in = jnp.where(row.present[:, None, None, None], S0, 0.0)
    S0_in = jnp.swapaxes(S0_in, 0, 1).reshape(1, hv, n_seg * kp, vp)
  st = Static(batch=q.shape[0], length=tp, heads=h, value_heads=hv, kw_heads=h if kw is None else kw.shape[2],
              key_dim=kp, value_dim=vp, chunk=chunk_size, decay=decay, scale=float(scale),
              same_keys=kw is None and key_static is None, config=config, interpret=interpret,
              low_precision=low_precision and dtype == jnp.bfloat16, segments=n_seg,
              grad_dtype=jnp.dtype(dtype).name, forward_chunk=forward_chunk)
  if key_static is not None:
    bp, gp, center, A0p = key_inputs
    bp = pad_axis(bp.astype(jnp.float32), 1, tp)
    gp = pad_axis(jnp.maximum(gp.astype(jnp.float32), LOG_DECAY_FLOOR), 1, tp)
    A0p = jnp.zeros((b, h, kp), jnp.float32) if A0p is None else pad_axis(A0p.astype(jnp.float32), 2, kp)
    center = jnp.broadcast_to(jnp.asarray(center, jnp.float32), (h,))
    o, S, A_T = _pdn_solve(st, key_static, q, k, v, beta, G, S0_in, bp, gp, A0p, center)
    return o[:, :t, :, :vd], S[:, :, :kd, :vd], A_T[..., :kd]
  o, S = _solve(st, q, k, kw, v, beta, G, g_wide, S0_in, info)
  if not n_seg:
    return o[:, :t, :, :vd], S[:, :, :kd, :vd]
  o, S = wm.from_row(row, o, jnp.swapaxes(S.reshape(hv, n_seg, kp, vp), 0, 1), b, t)
  return o[..., :vd], S[:, :, :kd, :vd]


def delta_rule(q, k, v, beta, *, k_write=None, log_decay=None, initial_state=None, scale=None, chunk_size=64,
               segment_ids=None, num_segments=None, config: Config = DEFAULT, interpret: bool | None = None,
               bf16_matmuls: bool = True):
  """Chunkwise online solve with Pallas kernels (Triton on GPU, interpret mode on CPU).

  Shapes as `osdn_jax.ops.chunked.delta_rule`: q, k [B, T, H, K]; v [B, T, HV, V]; beta [B, T, HV];
  k_write [B, T, H or HV, K] (cast to q.dtype); log_decay None, [B, T, HV] or [B, T, HV, K];
  initial_state [B, HV, K, V]. Returns (o [B, T, HV, V] in q.dtype, final state [B, HV, K, V] fp32).
  Packed (`pallas_kernels/packed.py`): `segment_ids` [B, T] are segment numbers 0..N−1 in row-major order
  (`osdn_jax.ops.packing.segment_index`), `num_segments` N is static, and initial_state and the final states
  are [N, HV, K, V].
  `config` sets the launch parameters; `heuristics.chunk` may run a smaller chunk than `chunk_size` (rounding
  only), and an undifferentiated per-channel forward a wider one (`heuristics.forward_chunk`). `interpret`
  defaults to True on a CPU backend. With bf16 inputs and `bf16_matmuls` (the default), every dot except those
  that build T = (I + A)⁻¹ and dA takes bf16 operands (fp32 accumulation, fp32 state) and the intermediates are
  stored in bf16, as in FLA; fp32 inputs run every dot in fp32. fp32 dots run as `Dots` says when compiled and
  in IEEE fp32 in interpret mode.
  """
  where = "delta_rule (pallas gpu)"
  config.check(chunk_size)
  rows = q.shape[0]
  if segment_ids is not None:
    check_segment_ids(where, segment_ids, q.shape[:2], num_segments)
    rows = int(num_segments)
  wm.check_solve(where, q, k, v, beta, k_write, log_decay, initial_state, rows)
  if max(q.shape[-1], v.shape[-1]) > MAX_DIM:
    raise ValueError(f"{where}: K and V must be ≤ {MAX_DIM}")
  decay = "none" if log_decay is None else ("channel" if jnp.ndim(log_decay) == 4 else "scalar")
  chunk = heuristics.chunk(config, decay, chunk_size, dtype=jnp.dtype(q.dtype).name, kdim=padded_dim(q.shape[-1]),
                           lanes=rows * v.shape[2], vdim=padded_dim(v.shape[-1]))
  forward_chunk = heuristics.forward_chunk(config, decay, chunk_size, chunk, segment_ids is not None)
  static_scale, scale_arr = scale_parts(scale, q.shape[-1])
  return _delta_rule(q, k, v, beta, k_write, log_decay, initial_state, scale_arr, segment_ids,
                     scale=static_scale, chunk_size=chunk, forward_chunk=forward_chunk, config=config,
                     interpret=default_interpret(interpret), low_precision=bf16_matmuls,
                     num_segments=int(num_segments) if segment_ids is not None else None)


def pdn_delta_rule(q, k, v, beta, beta_p, log_decay_p, center, *, x=1.5, eps=1e-6, log_decay=None,
                   initial_state=None, initial_moment=None, scale=None, chunk_size=64, config: Config = DEFAULT,
                   key_config: precond_key.Config | None = None, interpret: bool | None = None,
                   bf16_matmuls: bool = True):
  """`delta_rule(q, k, v, beta, k_write=k̃, ...)` with PDN's write key k̃ = `precond_key.precond_key(k, beta_p,
  log_decay_p, transform="pdn", center=center, x=x, eps=eps, initial_state=initial_moment)` formed inside the
  solve's prep instead of a pass of its own. Returns (o [B, T, H, V] in q.dtype, S_T [B, H, K, V] fp32, A_T
  [B, H, K] fp32).

  Shapes as `delta_rule` without packing, with as many value heads as key heads; log_decay None or [B, T, H]
  (per-channel decay: compose the two ops); beta_p, log_decay_p [B, T, H]; center scalar or [H]; initial_moment
  [B, H, K]; x, eps static; ValueError naming the argument on any other shape. key_config: `precond_key.Config`
  of the moment's passes (its chunk is capped at the solve's). Differentiable w.r.t. every array argument.
  """
  where = "pdn_delta_rule (pallas gpu)"
  check_precond_key(where, k, beta_p, log_decay_p, "pdn", None, center, x, eps, 1.0, initial_moment,
                    names=("beta_p", "log_decay_p", "initial_moment"))
  b, t, h, kd = k.shape
  if q.shape != k.shape:
    raise ValueError(f"{where}: `q` must be [B, T, H, K] = {k.shape}, got {q.shape}")
  if v.ndim != 4 or v.shape[:3] != (b, t, h):
    raise ValueError(f"{where}: `v` must be [B, T, H, V] with (B, T, H) = {(b, t, h)}, got {v.shape}")
  for name, a in (("beta", beta), ("log_decay", log_decay)):
    if a is not None and jnp.shape(a) != (b, t, h):
      raise ValueError(f"{where}: `{name}` must be [B, T, H] = {(b, t, h)}, got shape {jnp.shape(a)}")
  if initial_state is not None and initial_state.shape != (b, h, kd, v.shape[3]):
    raise ValueError(f"{where}: `initial_state` must be [B, H, K, V] = {(b, h, kd, v.shape[3])}, got "
                     f"{initial_state.shape}")
  config.check(chunk_size)
  if jnp.dtype(q.dtype) not in wm.SUPPORTED_DTYPES:
    raise ValueError(f"{where}: dtype {jnp.dtype(q.dtype).name} not supported (bfloat16, float32)")
  if max(q.shape[-1], v.shape[-1]) > MAX_DIM:
    raise ValueError(f"{where}: K and V must be ≤ {MAX_DIM}")
  decay = "none" if log_decay is None else "scalar"
  chunk = heuristics.chunk(config, decay, chunk_size, dtype=jnp.dtype(q.dtype).name, kdim=padded_dim(q.shape[-1]),
                           lanes=q.shape[0] * v.shape[2], vdim=padded_dim(v.shape[-1]))
  interpret = default_interpret(interpret)
  key_config = key_config or (precond_key.INTERPRET if interpret else precond_key.DEFAULT)
  key_config = key_config.override(chunk=min(key_config.chunk, chunk))
  static_scale, scale_arr = scale_parts(scale, q.shape[-1])
  return _delta_rule(q, k, v, beta, None, log_decay, initial_state, scale_arr, None,
                     (beta_p, log_decay_p, center, initial_moment), scale=static_scale, chunk_size=chunk,
                     forward_chunk=0, config=config, interpret=interpret, low_precision=bf16_matmuls,
                     num_segments=None, key_static=precond_key.pdn_static(x, eps, key_config, interpret))


def supports(spec: Spec) -> bool:
  """Compiled on "gpu"; the same kernels in interpret mode on "cpu"; bf16/fp32, K, V ≤ 256, whole sequences
  (not one-token steps); packed only with a static number of segments."""
  return (spec.platform in ("gpu", "cpu")
          and spec.dtype in ("bfloat16", "float32")
          and spec.chunk_size in CHUNK_SIZES
          and spec.length is not None
          and 1 <= spec.key_dim <= MAX_DIM and 1 <= spec.value_dim <= MAX_DIM
          and (not spec.packed or spec.num_segments is not None))


def linear_attention(q, k, v, *, beta=None, log_decay=None, initial_state=None, scale=None, chunk_size=64,
                     segment_ids=None, num_segments=None, config: Config = DEFAULT,
                     interpret: bool | None = None, bf16_matmuls: bool = True):
  """The offline solve S_t = D_t S_{t-1} + β_t k_t v_tᵀ with these kernels: it is the online solve with a zero
  erase key and k as the write key (A = 0, T = I, W = 0, V_new = βV), so `delta_rule(q, 0, v, β,
  k_write=k)` computes it exactly (the kernels' work on the zero Gram is spent for nothing). Signature and
  results of `osdn_jax.ops.chunked.linear_attention` (β default 1; `wrapper_math.linear_attention`)."""
  return wm.linear_attention(delta_rule, q, k, v, beta=beta, log_decay=log_decay, initial_state=initial_state,
                             scale=scale, chunk_size=chunk_size, segment_ids=segment_ids,
                             num_segments=num_segments, config=config, interpret=interpret,
                             bf16_matmuls=bf16_matmuls)
