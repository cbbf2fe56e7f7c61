"""PDN's write key and ATQ's query (op "precond_key"), written once for every kernel backend: the entry point and its
checks, the interpret and config defaults, and the differentiation skeleton with its residual name for
rematerialisation.

    A_t = e^{g_t} A_{t−1} + b_t,   b_t = β_t k_t ⊙ k_t,   A_0 = initial_state       (per batch, head, channel)
    "pdn": y_t = M(A_t) ⊙ k_t,   M = exp(−log(x) z / (1 + |z|)),   z = log(A_t + ε) − c_h
    "atq": y_t = q_t / (A_t + λ)

The contract is `osdn_jax.dgps.precond.pdn_write_key` / `atq_query` (y, A_T), unpacked. `precond_key(backend, ...)`
checks the call (`check_precond_key`), reads the config from the backend's tuning table, forms the moment's inputs
in XLA (`arrays.moment_inputs`: β fp32, the log-decays clamped at −30, A_0 zeros when not given; the center fp32
[H]), then runs the backend's `prepare` (differentiable XLA before the kernels) → `shells.kernels` (the custom_vjp
around its kernels, their saved intermediates named `RESIDUAL_NAME`) → its `finish` (differentiable XLA after).

The backends split the work differently, and `prepare` / `finish` carry the difference:
  pallas gpu  the kernels fuse the moment with the transform and never store A [B, T, H, K]: `prepare` hands them
              every input, `finish` returns what they return (y, A_T); they save the state entering every chunk;
  pallas tpu  the kernel is the moment alone (`decayed_sum`'s scan), which stores A and saves it; `finish` applies
              the transform to A in XLA, whose gradient reaches the kernel's backward through autodiff.
A backend is one `Backend` record (`pallas_kernels.gpu.precond_key`, `pallas_kernels.tpu.precond_key`) beside its
kernels, its `Config` and tuning table, and its `precond_key` is this module's bound to it (`shells.bind`).
"""
from __future__ import annotations

import dataclasses
import numbers

import jax.numpy as jnp

from pallas_kernels import shells
from pallas_kernels.arrays import default_interpret, device_kind, moment_inputs

TRANSFORMS = ("pdn", "atq")       # the preconditioned keys: PDN's write key, ATQ's query
RESIDUAL_NAME = "precond_pass"    # the kernels' saved intermediates, for rematerialisation policies


@dataclasses.dataclass(frozen=True)
class Transform:
  """The transform and its static constants: name "pdn" | "atq"; x, eps (pdn); lam (atq)."""
  name: str
  x: float
  eps: float
  lam: float


@dataclasses.dataclass(frozen=True)
class Backend(shells.Backend):
  """`shells.Backend` with, for this op: prepare(transform, config, interpret, k, q, beta, g, A0, center) →
  (st, inputs, aux), k [B, T, H, K] as given, q [B, T, H, K] (atq) or None, beta and g [B, T, H] fp32 (g clamped),
  A0 [B, H, K] fp32, center [H] fp32 (pdn) or None; finish(st, inputs, outputs, aux) → (y [B, T, H, K] in k's
  (pdn) / q's (atq) dtype, A_T [B, H, K] fp32)."""


def check_precond_key(where: str, k, beta, log_decay, transform, q, center, x, eps, lam, initial_state):
  """ValueError naming the argument unless the inputs fit `precond_key` (PDN's write key / ATQ's query):
  k [B, T, H, K]; beta, log_decay [B, T, H]; initial_state None or [B, H, K]; q [B, T, H, K] for "atq"; center
  scalar or [H] for "pdn"; x > 0, eps ≥ 0, lam > 0 static numbers."""
  if transform not in TRANSFORMS:
    raise ValueError(f"{where}: `transform` must be one of {TRANSFORMS}, got {transform!r}")
  if k.ndim != 4:
    raise ValueError(f"{where}: `k` must be [B, T, H, K], got shape {k.shape}")
  b, t, h, kd = k.shape
  for name, a in (("beta", beta), ("log_decay", log_decay)):
    if a.shape != (b, t, h):
      raise ValueError(f"{where}: `{name}` must be [B, T, H] = {(b, t, h)}, got {a.shape}")
  if initial_state is not None and initial_state.shape != (b, h, kd):
    raise ValueError(f"{where}: `initial_state` must be [B, H, K] = {(b, h, kd)}, got {initial_state.shape}")
  if transform == "atq" and (q is None or q.shape != k.shape):
    raise ValueError(f"{where}: `q` must be [B, T, H, K] = {k.shape} for 'atq', got "
                     f"{None if q is None else q.shape}")
  if transform == "pdn" and (center is None or jnp.shape(center) not in ((), (h,))):
    raise ValueError(f"{where}: `center` must be a scalar or [H] = {(h,)} for 'pdn', got "
                     f"{None if center is None else jnp.shape(center)}")
  if not all(isinstance(v, numbers.Real) for v in (x, eps, lam)):
    raise ValueError(f"{where}: `x`, `eps` and `lam` must be static numbers, got {x!r}, {eps!r}, {lam!r}")
  if not (x > 0 and eps >= 0 and lam > 0):
    raise ValueError(f"{where}: need x > 0, eps ≥ 0 and lam > 0, got x={x}, eps={eps}, lam={lam}")


def precond_key(backend: Backend, k, beta, log_decay, *, transform: str, q=None, center=None, x=1.5, eps=1e-6,
                lam=1.0, initial_state=None, config=None, interpret=None):
  """PDN's write key M(A_t) ⊙ k_t ("pdn") or ATQ's query q_t / (A_t + λ) ("atq"), and A_T, with `backend`'s
  kernels.

  k [B, T, H, K] and q (atq) [B, T, H, K] (fp32 or bf16, read as is); beta, log_decay [B, T, H]; center (pdn)
  scalar or [H]; x, eps (pdn) and lam (atq) static numbers; initial_state A_0 [B, H, K] (default 0). Computes
  in fp32; log_decay is clamped at −30 like every log-decay of the solves. Returns (y [B, T, H, K] in k's
  (pdn) / q's (atq) dtype, A_T [B, H, K] fp32), as `precond.pdn_write_key` / `precond.atq_query`.
  Differentiable w.r.t. k, q, beta, log_decay, center and initial_state. `interpret`: None runs interpret mode on
  a CPU backend (`arrays.default_interpret`), else a bool (or what the backend's `pallas_call` takes); `config`:
  the backend's launch parameters (None: `default_config`, its tuning table's entry for this device, or for
  interpret mode).
  """
  where = f"precond_key ({backend.name})"
  check_precond_key(where, k, beta, log_decay, transform, q, center, x, eps, lam, initial_state)
  interpret = backend.interpret_mode(default_interpret(interpret))
  config = backend.default_config(None, device_kind(interpret)) if config is None else config
  beta, g, A0 = moment_inputs(where, k, log_decay, beta, initial_state)
  pdn = transform == "pdn"
  center = jnp.broadcast_to(jnp.asarray(center, jnp.float32), (k.shape[2],)) if pdn else None
  st, inputs, aux = backend.prepare(Transform(transform, float(x), float(eps), float(lam)), config, interpret, k,
                                    None if pdn else q, beta, g, A0, center)
  outputs = shells.kernels(backend, st, RESIDUAL_NAME, inputs)
  return backend.finish(st, inputs, outputs, aux)
