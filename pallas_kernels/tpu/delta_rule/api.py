"""The Pallas TPU delta-rule forward: checks, padding, the in-chunk decay cumsum, then the fused kernel.

`forward` computes the forward of `osdn_jax.ops.delta_rule` (the contract) for every decay (none, scalar, per
channel), with write keys, grouped value heads and an initial state. In XLA around the kernel: T is zero-padded
to a multiple of the chunk (β = 0, g = 0: padded tokens leave the state unchanged), K and V to
`layout.padded_dim`; log-decays are clamped at LOG_DECAY_FLOOR and cumsummed within each chunk (per value head
here, β and G laid out head-major [B, HV, T] fp32; per channel in the kernel, which reads the log-decays as they
come, [B, T, HV, K]).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.spec import CHUNK_SIZES, LOG_DECAY_FLOOR
from pallas_kernels.tpu.delta_rule.config import DEFAULT, Config
from pallas_kernels.tpu.delta_rule.kernel import forward_call
from pallas_kernels.tpu.delta_rule.layout import Layout, pad_axis, padded_dim
from pallas_kernels.arrays import scale_parts

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _chunk_cumsum(g, chunk: int):
  """Inclusive cumsum within chunks along axis 1 of g [B, T, HV] (T a multiple of chunk)."""
  b, t = g.shape[:2]
  return jnp.cumsum(g.reshape(b, t // chunk, chunk, *g.shape[2:]), axis=2).reshape(g.shape)


def _use_head_major(config: Config, key_dim: int, value_dim: int) -> bool:
  if config.layout != "auto":
    return config.layout == "head_major"
  return key_dim % 128 != 0 or value_dim % 128 != 0


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size", "config", "interpret"))
def _forward(q, k, v, beta, k_write, log_decay, initial_state, scale_arr, *, scale, chunk_size, config,
             interpret):
  b, t, h, kd = q.shape
  hv, vd = v.shape[2:]
  dtype = q.dtype
  tp = -(-t // chunk_size) * chunk_size
  kp, vp = padded_dim(kd), padded_dim(vd)
  if scale is None:                          # a traced scale: applied to q, the kernel uses scale 1
    q = (q * scale_arr).astype(dtype)
    scale = 1.0

  def tokens(x, width):
    return pad_axis(pad_axis(x.astype(dtype), 1, tp), 3, width)

  q, k, v = tokens(q, kp), tokens(k, kp), tokens(v, vp)
  kw = None if k_write is None else tokens(k_write, kp)
  per_head = lambda x: jnp.swapaxes(pad_axis(x.astype(jnp.float32), 1, tp), 1, 2)        # [B, HV, T]
  G = None
  if log_decay is not None and log_decay.ndim == 3:
    g = pad_axis(jnp.maximum(log_decay.astype(jnp.float32), LOG_DECAY_FLOOR), 1, tp)
    G = jnp.swapaxes(_chunk_cumsum(g, chunk_size), 1, 2)                           # [B, HV, T]
  elif log_decay is not None:                # per channel: clamped and cumsummed in the kernel
    g = log_decay if log_decay.dtype in SUPPORTED_DTYPES else log_decay.astype(jnp.float32)
    G = pad_axis(pad_axis(g, 1, tp), 3, kp)                                         # [B, T, HV, K]
  S0 = None
  if initial_state is not None:
    S0 = pad_axis(pad_axis(initial_state.astype(jnp.float32), 2, kp), 3, vp)
  lay = Layout(batch=b, length=tp, heads=h, kw_heads=h if kw is None else kw.shape[2], value_heads=hv,
               key_dim=kp, value_dim=vp, block_v=config.value_block(vp), chunk=chunk_size,
               head_major=_use_head_major(config, kp, vp))
  low = config.bf16_matmuls and dtype == jnp.bfloat16
  o, S = forward_call(lay, q, k, kw, v, per_head(beta), G, S0, scale=float(scale), low=low,
                      interpret=interpret, sub=config.sub, vmem_limit_bytes=config.vmem_limit_bytes)
  return o[:, :t, :, :vd], S[:, :, :kd, :vd]


def _check(q, k, v, beta, k_write, log_decay, initial_state, chunk_size):
  name = "delta_rule (pallas tpu)"
  if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
    raise ValueError(f"{name}: dtype {jnp.dtype(q.dtype).name} not supported (bfloat16, float32)")
  if chunk_size not in CHUNK_SIZES:
    raise ValueError(f"{name}: `chunk_size` must be one of {CHUNK_SIZES}, got {chunk_size!r}")
  if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:2] != q.shape[:2]:
    raise ValueError(f"{name}: q, k must be [B, T, H, K] and v [B, T, HV, V] with one B, T; got q {q.shape}, "
                     f"k {k.shape}, v {v.shape}")
  b, t, h, kd = q.shape
  hv, vd = v.shape[2:]
  if hv % h:
    raise ValueError(f"{name}: value heads HV = {hv} must be a multiple of the key heads H = {h}")
  if beta.shape != (b, t, hv):
    raise ValueError(f"{name}: `beta` must be [B, T, HV] = {(b, t, hv)}, got {beta.shape}")
  if k_write is not None and (k_write.shape[:2] != (b, t) or k_write.shape[2] not in (h, hv)
                              or k_write.shape[3] != kd):
    raise ValueError(f"{name}: `k_write` must be [B, T, H or HV, K], got {k_write.shape}")
  if log_decay is not None and log_decay.shape not in ((b, t, hv), (b, t, hv, kd)):
    raise ValueError(f"{name}: `log_decay` must be [B, T, HV] = {(b, t, hv)} or [B, T, HV, K] = {(b, t, hv, kd)}, "
                     f"got {log_decay.shape}")
  if initial_state is not None and initial_state.shape != (b, hv, kd, vd):
    raise ValueError(f"{name}: `initial_state` must be [B, HV, K, V] = {(b, hv, kd, vd)}, got "
                     f"{initial_state.shape}")


def forward(q, k, v, beta, *, k_write=None, log_decay=None, initial_state=None, scale=None, chunk_size=64,
            interpret=False, config: Config = DEFAULT):
  """The chunkwise online solve's forward as one Mosaic kernel (TPU; interpret mode anywhere).

  q, k [B, T, H, K]; v [B, T, HV, V] (HV a multiple of H: value head i reads key head i // (HV / H));
  beta [B, T, HV]; k_write None (k) or [B, T, H or HV, K]; log_decay None, [B, T, HV] (one per value head) or
  [B, T, HV, K] (one per key channel), natural logs ≤ 0;
  initial_state None (zeros) or [B, HV, K, V]; scale None (K ** −0.5), a number or a traced scalar.
  q, k, k_write, v in bf16 or fp32 (cast to q.dtype). Returns (o [B, T, HV, V] in q.dtype, S_T [B, HV, K, V]
  fp32). `interpret` runs the kernel in Pallas' TPU interpreter (CPU); `config` sets block sizes and precision.
  Not differentiable (no backward).
  """
  _check(q, k, v, beta, k_write, log_decay, initial_state, chunk_size)
  static_scale, scale_arr = scale_parts(scale, q.shape[-1])
  return _forward(q, k, v, beta, k_write, log_decay, initial_state, scale_arr, scale=static_scale,
                  chunk_size=chunk_size, config=config, interpret=bool(interpret))
