"""The Pallas TPU delta rule: checks, padding, the in-chunk decay cumsum, one `jax.custom_vjp` around the kernels.

`delta_rule` computes `osdn_jax.ops.delta_rule` (the contract) for every decay (none, scalar, per channel), with
write keys, grouped value heads and an initial state, forward and backward; `linear_attention` is the offline
solve through the same kernels. The forward under autodiff also saves the state entering every chunk (fp32
[B, HV, NC, K, V]), which the backward kernel reads. In XLA around the kernels (what the GPU wrapper does alike
is `pallas_kernels.wrapper_math`'s): T is zero-padded to a multiple of the chunk (β = 0, g = 0: padded tokens leave
the state unchanged), K and V to `layout.padded_dim`; log-decays are clamped at LOG_DECAY_FLOOR and cumsummed
within each chunk (per value head here, β and G laid out head-major [B, HV, T] fp32; per channel in the kernel,
which reads the log-decays as they come, [B, T, HV, K]).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import wrapper_math as wm
from pallas_kernels.arrays import check_segment_ids, scale_parts
from pallas_kernels.spec import CHUNK_SIZES, LOG_DECAY_FLOOR, Spec
from pallas_kernels.tpu.delta_rule.backward import backward_call
from pallas_kernels.tpu.delta_rule.config import Config, config_for
from pallas_kernels.tpu.delta_rule.kernel import forward_call
from pallas_kernels.tpu.delta_rule.layout import Layout, padded_dim


def _use_head_major(config: Config, key_dim: int, value_dim: int) -> bool:
  if config.layout != "auto":
    return config.layout == "head_major"
  return key_dim % 128 != 0 or value_dim % 128 != 0


@dataclasses.dataclass(frozen=True)
class _Static:
  """What the custom_vjp's kernels take besides arrays."""
  layout: Layout
  scale: float
  low: bool
  interpret: bool
  sub: int
  vmem_limit_bytes: int | None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _solve(st: _Static, q, k, kw, v, beta, G, S0, codes):
  """The kernels on prepared arrays (`forward_call`'s; codes None unless packed): → (o, S_T)."""
  return tuple(forward_call(st.layout, q, k, kw, v, beta, G, S0, codes, scale=st.scale, low=st.low,
                            interpret=st.interpret, sub=st.sub, vmem_limit_bytes=st.vmem_limit_bytes))


def _solve_fwd(st, q, k, kw, v, beta, G, S0, codes):
  o, S_T, states = forward_call(st.layout, q, k, kw, v, beta, G, S0, codes, scale=st.scale, low=st.low,
                                interpret=st.interpret, sub=st.sub, vmem_limit_bytes=st.vmem_limit_bytes,
                                save_states=True)
  return (o, S_T), (q, k, kw, v, beta, G, S0, codes, states)


def _solve_bwd(st, res, cts):
  q, k, kw, v, beta, G, S0, codes, states = res
  do, dS_T = cts
  lay = st.layout
  dq, dk, dkw, dv, dgates, dld, dS0 = backward_call(
      lay, q, k, kw, v, beta, G, states, do, dS_T, codes, scale=st.scale, low=st.low, interpret=st.interpret,
      sub=st.sub, vmem_limit_bytes=st.vmem_limit_bytes, grad_dtype=_grad_dtype(lay, q.dtype, kw),
      segments=dS_T.shape[0])
  # dq, dk, dkw: [B, T, HV, NV, K] partials per value head and V block
  dq, dk = wm.group_sum(dq, lay.heads).astype(q.dtype), wm.group_sum(dk, lay.heads).astype(k.dtype)
  if kw is not None:
    dkw = wm.group_sum(dkw, lay.kw_heads).astype(kw.dtype)
  dbeta = dgates[:, :, 0]
  if G is None:
    dG = None
  elif G.ndim == 3:
    dG = dgates[:, :, 1]
  else:                                        # the kernel clamps the log-decays: no gradient below the floor
    dG = jnp.where(G >= LOG_DECAY_FLOOR, dld.sum(axis=3), 0.0).astype(G.dtype)
  return dq, dk, dkw, dv.astype(v.dtype), dbeta, dG, None if S0 is None else dS0, None


_solve.defvjp(_solve_fwd, _solve_bwd)


def _grad_dtype(lay: Layout, dtype, kw):
  """The partials' dtype: the inputs' own where nothing is summed (one V block, one value head per key head),
  else fp32 for the sums."""
  one = lay.num_v == 1 and lay.value_heads == lay.heads and (kw is None or lay.kw_heads == lay.value_heads)
  return dtype if one else jnp.float32


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size", "config", "interpret", "low_precision",
                                             "num_segments"))
def _delta_rule(q, k, v, beta, k_write, log_decay, initial_state, scale_arr, segment_ids, *, scale, chunk_size,
                config, interpret, low_precision, num_segments):
  b, t, h, kd = q.shape
  hv, vd = v.shape[2:]
  dtype = q.dtype
  n_seg = num_segments if segment_ids is not None else 0
  codes = None
  if n_seg:                                  # one chunk-aligned row (pallas_kernels/packed.py)
    row, (q, k, v, beta, k_write, log_decay) = wm.to_row(segment_ids, n_seg, chunk_size, q, k, v, beta, k_write,
                                                         log_decay)
    tp = row.length
    codes = row.info[:tp // chunk_size]
    if initial_state is None:
      initial_state = jnp.zeros((n_seg, hv, kd, vd), jnp.float32)
  else:
    tp = wm.padded_length(t, chunk_size)
  kp, vp = padded_dim(kd), padded_dim(vd)
  q, scale = wm.fold_scale(q, scale, scale_arr)
  q, k, v = (wm.pad_tokens(x, tp, width, dtype) for x, width in ((q, kp), (k, kp), (v, vp)))
  kw = None if k_write is None else wm.pad_tokens(k_write, tp, kp, dtype)
  G = None
  if log_decay is not None and log_decay.ndim == 3:
    G = wm.scalar_decay(log_decay, tp, chunk_size)                                 # [B, HV, T]
  elif log_decay is not None:                # per channel: clamped and cumsummed in the kernel
    G = wm.channel_log_decay(log_decay, tp, kp)                                     # [B, T, HV, K]
  S0 = None if initial_state is None else wm.pad_state(initial_state, kp, vp)
  lay = Layout(batch=q.shape[0], length=tp, heads=h, kw_heads=h if kw is None else kw.shape[2], value_heads=hv,
               key_dim=kp, value_dim=vp, block_v=config.value_block(vp), chunk=chunk_size,
               head_major=_use_head_major(config, kp, vp), packed=bool(n_seg))
  low = low_precision and config.bf16_matmuls and dtype == jnp.bfloat16
  st = _Static(layout=lay, scale=scale, low=low, interpret=interpret, sub=config.sub,
               vmem_limit_bytes=config.vmem_limit_bytes)
  o, S = _solve(st, q, k, kw, v, wm.head_major(beta, tp), G, S0, codes)
  if n_seg:
    o, S = wm.from_row(row, o, S, b, t)
    return o[..., :vd], S[:, :, :kd, :vd]
  return o[:, :t, :, :vd], S[:, :, :kd, :vd]


def delta_rule(q, k, v, beta, *, k_write=None, log_decay=None, initial_state=None, scale=None, chunk_size=64,
               segment_ids=None, num_segments=None, config: Config | None = None, interpret: bool | None = None,
               bf16_matmuls: bool = True):
  """The chunkwise online solve as two Mosaic kernels (forward; backward in one `jax.custom_vjp`): the signature
  and results of `osdn_jax.ops.chunked.delta_rule`.

  q, k [B, T, H, K]; v [B, T, HV, V] (HV a multiple of H: value head i reads key head i // (HV / H));
  beta [B, T, HV]; k_write None (k) or [B, T, H or HV, K]; log_decay None, [B, T, HV] (one per value head) or
  [B, T, HV, K] (one per key channel), natural logs ≤ 0; initial_state None (zeros) or [B, HV, K, V];
  scale None (K ** −0.5), a number or a traced scalar. q, k, k_write, v in bf16 or fp32 (cast to q.dtype).
  Returns (o [B, T, HV, V] in q.dtype, S_T [B, HV, K, V] fp32), differentiable w.r.t. every array.
  Packed (`pallas_kernels/packed.py`): `segment_ids` [B, T] are segment numbers 0..N−1 in row-major order
  (`osdn_jax.ops.packing.segment_index`), `num_segments` N is static, and initial_state and the final states
  are [N, HV, K, V]; the segments are laid out chunk-aligned in one row, whose chunks one program per value head
  runs in order. `interpret` None: TPU interpret mode on a CPU backend, compiled otherwise; `config` sets block
  sizes and precision (None: `config_for()`, this backend's TPU generation; `bf16_matmuls` False overrides
  `config.bf16_matmuls`).
  """
  where = "delta_rule (pallas tpu)"
  if chunk_size not in CHUNK_SIZES:
    raise ValueError(f"{where}: `chunk_size` must be one of {CHUNK_SIZES}, got {chunk_size!r}")
  rows = q.shape[0]
  if segment_ids is not None:
    check_segment_ids(where, segment_ids, q.shape[:2], num_segments)
    rows = int(num_segments)
  wm.check_solve(where, q, k, v, beta, k_write, log_decay, initial_state, rows)
  static_scale, scale_arr = scale_parts(scale, q.shape[-1])
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  config = config or config_for()
  return _delta_rule(q, k, v, beta, k_write, log_decay, initial_state, scale_arr, segment_ids,
                     scale=static_scale, chunk_size=chunk_size, config=config, interpret=bool(interpret),
                     low_precision=bool(bf16_matmuls),
                     num_segments=int(num_segments) if segment_ids is not None else None)


def linear_attention(q, k, v, *, beta=None, log_decay=None, initial_state=None, scale=None, chunk_size=64,
                     segment_ids=None, num_segments=None, config: Config | None = None, interpret: bool | None = None,
                     bf16_matmuls: bool = True):
  """The offline solve S_t = D_t S_{t−1} + β_t k_t v_tᵀ through the same kernels: the online solve with a zero
  erase key and k as the write key (A = 0, T = I, W = 0, V_new = β V). Signature and results of
  `osdn_jax.ops.chunked.linear_attention` (β default 1; `wrapper_math.linear_attention`)."""
  return wm.linear_attention(delta_rule, q, k, v, beta=beta, log_decay=log_decay, initial_state=initial_state,
                             scale=scale, chunk_size=chunk_size, segment_ids=segment_ids,
                             num_segments=num_segments, config=config, interpret=interpret,
                             bf16_matmuls=bf16_matmuls)


def forward(q, k, v, beta, *, k_write=None, log_decay=None, initial_state=None, scale=None, chunk_size=64,
            segment_ids=None, num_segments=None, interpret=False, config: Config | None = None):
  """`delta_rule` with `interpret` False by default (compiled by Mosaic: a TPU, or ahead of time)."""
  return delta_rule(q, k, v, beta, k_write=k_write, log_decay=log_decay, initial_state=initial_state,
                    scale=scale, chunk_size=chunk_size, segment_ids=segment_ids, num_segments=num_segments,
                    config=config, interpret=interpret)


def supports(spec: Spec) -> bool:
  """Compiled on "tpu" (a CPU backend reaches these kernels explicitly, in interpret mode); bf16/fp32; any K, V
  (padded); whole sequences (not one-token steps); packed only with a static number of segments."""
  return (spec.platform == "tpu"
          and spec.dtype in ("bfloat16", "float32")
          and spec.chunk_size in CHUNK_SIZES
          and spec.length is not None
          and spec.key_dim >= 1 and spec.value_dim >= 1
          and (not spec.packed or spec.num_segments is not None))
