"""The delta rule's wrapper, written once for every kernel backend: checks, padding, packing, the interpret
default, the `jax.custom_vjp` and the residual name for rematerialisation.

A backend (`Backend`: `pallas_kernels.gpu.delta_rule`, `pallas_kernels.tpu.delta_rule`) supplies what is its own:
its `Static` (the description of one launch, this module's `Static` with the backend's derived launch properties),
its padded widths, a `Config` and `default_config(spec, device_kind)` read from its tuning table, `supports(spec)`,
the chunk it runs at, the per-channel decay's preparation, the state's layout, and the forward and backward kernels;
its `delta_rule` and `linear_attention` are this module's with its `Backend`.

The pipeline (plain JAX around the kernels, differentiated by autodiff): packed sequences into one chunk-aligned row
(`wrapper_math.to_row`) → a traced scale folded into q → T zero-padded to a multiple of the chunk (β = 0, g = 0:
padded tokens leave the state unchanged), K and V to the backend's widths → β head-major, the scalar decay clamped
and cumsummed within chunks (per channel: the backend's `channel_decay`) → the initial state padded
(`state_in`) → the custom_vjp around the backend's kernels (`shells.kernels`, as every op's) → the final states
(`state_out`) and the rows back.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from pallas_kernels import shells
from pallas_kernels import wrapper_math as wm
from pallas_kernels.arrays import check_segment_ids, default_interpret, device_kind, scale_parts

RESIDUAL_NAME = "delta_rule_T"    # the forward's saved intermediate, for rematerialisation policies


@dataclasses.dataclass(frozen=True)
class Static:
  """Everything static about one call (hashable: the custom_vjp's non-differentiable argument). A backend
  subclasses it with the launch properties it derives from these fields and its `config`."""
  batch: int
  length: int          # padded T, a multiple of chunk
  heads: int           # H (q, k)
  value_heads: int     # HV
  kw_heads: int        # heads of k_write (H or HV; H when k_write is k)
  key_dim: int         # padded K
  value_dim: int       # padded V
  chunk: int
  decay: str           # "none" | "scalar" | "channel"
  scale: float
  same_keys: bool      # k_write is k (the kernels read k twice; dk_write is added to dk)
  config: Any          # the backend's Config
  interpret: bool
  bf16_matmuls: bool = False    # bf16 inputs with bf16 operands (fp32 accumulation) for the dots that do not
                                # build T = (I + A)⁻¹, and bf16 intermediates where the backend stores them
  segments: int = 0             # packed: N segments laid out chunk-aligned in one row (batch 1); 0: not packed
  grad_dtype: str = "float32"   # dtype of q, k, v
  forward_chunk: int = 0        # the chunk of a forward that is not differentiated (0: the same as chunk)


@dataclasses.dataclass(frozen=True)
class Backend:
  """What a backend supplies to the shell (functions of its own module; hashable, a static jit argument).

  name: "pallas gpu", in messages. static: its `Static` subclass. padded_dim(d): K or V after padding.
  default_config(spec, device_kind): its tuning table's entry. check(where, config, q, v, chunk_size): its own
  ValueErrors. plan(config, decay, chunk_size, *, dtype, key_dim, value_dim, lanes, packed) → (chunk,
  forward_chunk). bf16_allowed(config): whether its config lets bf16 inputs take bf16 dots.
  channel_decay(g, chunk, forward_chunk, interpret) → (G, g or None): per-channel log-decays [B, T, HV, K]
  (padded) as the kernels read them, and what an undifferentiated wider forward reads. state_in(st, S0, present):
  the padded initial state (or None) as the kernels take it; state_out(st, S): their final state → [rows, HV, K, V]
  (padded). forward(st, q, k, kw, v, beta, G, g, S0, info) → (o, S_T); forward_saving(st, ...) → (o, S_T, saved);
  backward(st, (q, k, kw, v, beta, G, S0, info), saved, (do, dS_T)) → (dq, dk, dkw, dv, dbeta, dG, dS0), dq, dk,
  dkw per value head (optionally with axes between heads and K, summed here). name_residual: the saved
  intermediate gets `RESIDUAL_NAME`."""
  name: str
  static: type
  padded_dim: Callable[[int], int]
  default_config: Callable[..., Any]
  check: Callable[..., None]
  plan: Callable[..., tuple[int, int]]
  bf16_allowed: Callable[[Any], bool]
  channel_decay: Callable[..., tuple[Any, Any]]
  state_in: Callable[..., Any]
  state_out: Callable[..., Any]
  forward: Callable[..., tuple]
  forward_saving: Callable[..., tuple]
  backward: Callable[..., tuple]
  name_residual: bool = True


def check_solve(where: str, q, k, v, beta, k_write, log_decay, initial_state, rows: int):
  """ValueError naming the argument unless q is bf16 or fp32 and the shapes are the solve's: q, k [B, T, H, K];
  v [B, T, HV, V] with H dividing HV; beta [B, T, HV]; k_write None or [B, T, H or HV, K]; log_decay None,
  [B, T, HV] or [B, T, HV, K]; initial_state None or [rows, HV, K, V] (rows: B, or N when packed)."""
  if jnp.dtype(q.dtype) not in wm.SUPPORTED_DTYPES:
    raise ValueError(f"{where}: dtype {jnp.dtype(q.dtype).name} not supported (bfloat16, float32)")
  if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:2] != q.shape[:2]:
    raise ValueError(f"{where}: q, k must be [B, T, H, K] and v [B, T, HV, V] with one B, T; got q {q.shape}, "
                     f"k {k.shape}, v {v.shape}")
  b, t, h, kd = q.shape
  hv, vd = v.shape[2:]
  if hv % h:
    raise ValueError(f"{where}: value heads HV = {hv} must be a multiple of the key heads H = {h}")
  if beta.shape != (b, t, hv):
    raise ValueError(f"{where}: `beta` must be [B, T, HV] = {(b, t, hv)}, got {beta.shape}")
  if k_write is not None and (k_write.ndim != 4 or k_write.shape[:2] != (b, t) or k_write.shape[2] not in (h, hv)
                              or k_write.shape[3] != kd):
    raise ValueError(f"{where}: `k_write` must be [B, T, H or HV, K], got {k_write.shape}")
  if log_decay is not None and log_decay.shape not in ((b, t, hv), (b, t, hv, kd)):
    raise ValueError(f"{where}: `log_decay` must be [B, T, HV] = {(b, t, hv)} or [B, T, HV, K] = {(b, t, hv, kd)}, "
                     f"got {log_decay.shape}")
  if initial_state is not None and initial_state.shape != (rows, hv, kd, vd):
    raise ValueError(f"{where}: `initial_state` must be [B (N when packed), HV, K, V] = {(rows, hv, kd, vd)}, got "
                     f"{initial_state.shape}")


@dataclasses.dataclass(frozen=True)
class _Kernels:
  """A backend's kernels in the form `shells.kernels` differentiates. inputs: (q, k, kw, v, beta, G, g, S0, info);
  `g`, the padded per-channel log-decays of an undifferentiated wider forward (else None), is read by `forward`
  only: under autodiff it is unused, its cotangent a symbolic zero, and it is not saved (`kept`)."""
  backend: Backend

  def forward(self, st: Static, inputs):
    return self.backend.forward(st, *inputs)

  def forward_saving(self, st: Static, inputs):
    q, k, kw, v, beta, G, _, S0, info = inputs
    o, S_T, saved = self.backend.forward_saving(st, q, k, kw, v, beta, G, None, S0, info)
    return (o, S_T), saved

  def kept(self, inputs):
    return inputs[:6] + (None,) + inputs[7:]

  def backward(self, st: Static, inputs, saved, cts):
    q, k, kw, v, beta, G, _, S0, info = inputs
    dq, dk, dkw, dv, dbeta, dG, dS0 = self.backend.backward(st, (q, k, kw, v, beta, G, S0, info), saved, cts)
    dq, dk = wm.group_sum(dq, st.heads).astype(q.dtype), wm.group_sum(dk, st.heads).astype(k.dtype)
    if kw is not None:
      dkw = wm.group_sum(dkw, kw.shape[2]).astype(kw.dtype)
    return dq, dk, dkw, dv.astype(v.dtype), dbeta, dG, None, None if S0 is None else dS0, None


def _solve(backend: Backend, st: Static, *inputs):
  """(o, S_T) of the backend's kernels, differentiated by its backward (`shells.kernels`), the forward's saved
  intermediate named `RESIDUAL_NAME` where the backend names it."""
  return shells.kernels(_Kernels(backend), st, RESIDUAL_NAME if backend.name_residual else None, inputs)


@functools.partial(jax.jit, static_argnames=("backend", "scale", "chunk_size", "forward_chunk", "config",
                                             "interpret", "bf16_matmuls", "num_segments"))
def _delta_rule(q, k, v, beta, k_write, log_decay, initial_state, scale_arr, segment_ids, *, backend, scale,
                chunk_size, forward_chunk, config, interpret, bf16_matmuls, num_segments):
  b, t, h, kd = q.shape
  hv, vd = v.shape[2:]
  dtype = q.dtype
  n_seg = num_segments if segment_ids is not None else 0
  row = present = info = None
  if n_seg:                               # one chunk-aligned row (pallas_kernels/packed.py)
    row, (q, k, v, beta, k_write, log_decay) = wm.to_row(segment_ids, n_seg, chunk_size, q, k, v, beta, k_write,
                                                         log_decay)
    tp, info, present = row.length, row.info, row.present
  else:
    tp = wm.padded_length(t, max(chunk_size, forward_chunk))
  kp, vp = backend.padded_dim(kd), backend.padded_dim(vd)
  q, scale = wm.fold_scale(q, scale, scale_arr)
  q, k, v = (wm.pad_tokens(x, tp, width, dtype) for x, width in ((q, kp), (k, kp), (v, vp)))
  kw = None if k_write is None else wm.pad_tokens(k_write, tp, kp, dtype)
  g_wide = None
  if log_decay is None:
    decay, G = "none", None
  elif log_decay.ndim == 3:
    decay, G = "scalar", wm.scalar_decay(log_decay, tp, chunk_size)                 # [B, HV, T]
  else:                                   # [B, T, HV, K]
    decay = "channel"
    G, g_wide = backend.channel_decay(wm.channel_log_decay(log_decay, tp, kp), chunk_size, forward_chunk,
                                      interpret)
  st = backend.static(batch=q.shape[0], length=tp, heads=h, value_heads=hv,
                      kw_heads=h if kw is None else kw.shape[2], key_dim=kp, value_dim=vp, chunk=chunk_size,
                      decay=decay, scale=float(scale), same_keys=kw is None, config=config, interpret=interpret,
                      bf16_matmuls=bf16_matmuls and dtype == jnp.bfloat16, segments=n_seg,
                      grad_dtype=jnp.dtype(dtype).name, forward_chunk=forward_chunk)
  S0 = None if initial_state is None else wm.pad_state(initial_state, kp, vp)
  o, S = _solve(backend, st, q, k, kw, v, wm.head_major(beta, tp), G, g_wide, backend.state_in(st, S0, present),
                info)
  S = backend.state_out(st, S)
  if not n_seg:
    return o[:, :t, :, :vd], S[:, :, :kd, :vd]
  o, S = wm.from_row(row, o, S, b, t)
  return o[..., :vd], S[:, :, :kd, :vd]


def delta_rule(backend: Backend, q, k, v, beta, *, k_write=None, log_decay=None, initial_state=None, scale=None,
               chunk_size=64, segment_ids=None, num_segments=None, config=None, interpret: bool | None = None,
               bf16_matmuls: bool = True):
  """The chunkwise online solve with `backend`'s kernels: the signature and results of
  `osdn_jax.ops.chunked.delta_rule` (the backends' `delta_rule` documents the options)."""
  where = f"delta_rule ({backend.name})"
  interpret = bool(default_interpret(interpret))
  config = backend.default_config(None, device_kind(interpret)) if config is None else config
  backend.check(where, config, q, v, chunk_size)
  rows = q.shape[0]
  if segment_ids is not None:
    check_segment_ids(where, segment_ids, q.shape[:2], num_segments)
    rows = int(num_segments)
  check_solve(where, q, k, v, beta, k_write, log_decay, initial_state, rows)
  decay = "none" if log_decay is None else ("channel" if jnp.ndim(log_decay) == 4 else "scalar")
  chunk, forward_chunk = backend.plan(config, decay, chunk_size, dtype=jnp.dtype(q.dtype).name,
                                      key_dim=backend.padded_dim(q.shape[-1]),
                                      value_dim=backend.padded_dim(v.shape[-1]), lanes=rows * v.shape[2],
                                      packed=segment_ids is not None)
  static_scale, scale_arr = scale_parts(scale, q.shape[-1])
  return _delta_rule(q, k, v, beta, k_write, log_decay, initial_state, scale_arr, segment_ids, backend=backend,
                     scale=static_scale, chunk_size=chunk, forward_chunk=forward_chunk, config=config,
                     interpret=interpret, bf16_matmuls=bool(bf16_matmuls) and backend.bf16_allowed(config),
                     num_segments=int(num_segments) if segment_ids is not None else None)


def linear_attention(backend: Backend, q, k, v, *, beta=None, **options):
  """The offline solve through `backend`'s delta rule (`wrapper_math.linear_attention`): the signature and results
  of `osdn_jax.ops.chunked.linear_attention` (β default 1)."""
  return wm.linear_attention(functools.partial(delta_rule, backend), q, k, v, beta=beta, **options)
