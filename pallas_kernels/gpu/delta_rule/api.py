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
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels import wrapper_math as wm
from pallas_kernels.arrays import check_segment_ids, scale_parts
from pallas_kernels.gpu.common import MAX_DIM, default_interpret, padded_dim
from pallas_kernels.gpu.delta_rule import backward, chunk_cumsum, forward, heuristics
from pallas_kernels.gpu.delta_rule.config import DEFAULT, Config
from pallas_kernels.gpu.delta_rule.layout import Static
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


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size", "forward_chunk", "config", "interpret",
                                             "low_precision", "num_segments"))
def _delta_rule(q, k, v, beta, k_write, log_decay, initial_state, scale_arr, segment_ids, *, scale, chunk_size,
                forward_chunk, config, interpret, low_precision, num_segments):
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
              same_keys=kw is None, config=config, interpret=interpret,
              low_precision=low_precision and dtype == jnp.bfloat16, segments=n_seg,
              grad_dtype=jnp.dtype(dtype).name, forward_chunk=forward_chunk)
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
