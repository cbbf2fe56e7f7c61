"""OSDN's guarded write key (op "osdn_guard"), written once for every kernel backend: the entry point and its
checks, the interpret and config defaults, and the differentiation skeleton (`shells.kernels`).

Per row (one token of one head; w = d ⊙ k, u = k ⊙ k, γ the guard):
    s = β ⟨k, w⟩ = β ⟨d, u⟩,   m = min(1, γ / max(s, 1e-12)),   k̃ = m w,
and k̃ = NaN where n (the d-pass's max(‖k‖², 1e-12)) is not finite, as `osdn_jax.dgps.precond.osdn_write_key`
forms it in plain JAX (the contract: `apply_guard` then that select, then the cast to k's dtype).

`write_key(backend, ...)` checks the call, reads the config from the backend's tuning table and runs the backend's
`prepare` (differentiable XLA: its layout) → `shells.kernels` (the custom_vjp around its kernels; intermediates
they save, if any, named `RESIDUAL_NAME`) → its `finish` (differentiable XLA back to [B, T, G, K]). The GPU backend
(`pallas_kernels.gpu.osdn.guard`) views the rows flat and pads them in `prepare` and slices them in `finish`; its
backward reads only the inputs. The TPU backend has no guard kernel: there `osdn_write_key` forms the guard in XLA
(`osdn_jax.ops.dispatch` finds no "osdn_guard" kernel for platform "tpu").
"""
from __future__ import annotations

import dataclasses

from pallas_kernels import shells
from pallas_kernels.arrays import default_interpret, device_kind, static_number

RESIDUAL_NAME = "precond_pass"    # the kernels' saved intermediates, for rematerialisation policies


@dataclasses.dataclass(frozen=True)
class Backend(shells.Backend):
  """`shells.Backend` with, for this op: prepare(guard, config, interpret, ds, k, beta, n) → (st, inputs, aux),
  the arrays as given; finish(st, inputs, outputs, aux) → k̃ [B, T, G, K] in k's dtype."""


def check_write_key(where: str, ds, k, beta, n, guard) -> float:
  """γ as a float; ValueError naming the argument unless ds and k are [B, T, G, K] of one shape, beta and n
  [B, T, G], and the guard a static number."""
  if ds.ndim != 4 or k.shape != ds.shape:
    raise ValueError(f"{where}: `ds` and `k` must be [B, T, G, K] of one shape, got {ds.shape} and {k.shape}")
  for name, x in (("beta", beta), ("n", n)):
    if x.shape != ds.shape[:3]:
      raise ValueError(f"{where}: `{name}` must be [B, T, G] = {ds.shape[:3]}, got {x.shape}")
  guard = static_number(where, "guard", guard)
  if guard is None:
    raise ValueError(f"{where}: `guard` must be a static number, got None")
  return guard


def write_key(backend: Backend, ds, k, beta, n, *, guard, config=None, interpret=None):
  """k̃ [B, T, G, K] in k's dtype: guard(ds ⊙ k), NaN on the rows where n is not finite, with `backend`'s kernels.

  ds [B, T, G, K] fp32 (the d-pass's d of every token), k [B, T, G, K] (the keys on the d-pass's heads, fp32,
  bf16 or fp16), beta and n [B, T, G] fp32 (the gains and the d-pass's max(‖k‖², 1e-12)), guard γ > 0 a static
  number. Differentiable w.r.t. ds, k and beta (n only selects rows: a zero cotangent). The contract is
  `osdn_jax.dgps.precond.osdn_write_key`'s plain-JAX write key. `interpret`: None runs interpret mode on a CPU
  backend (`arrays.default_interpret`); `config`: the backend's d-pass config, whose guard fields it reads (None:
  `default_config`).
  """
  guard = check_write_key(f"osdn write_key ({backend.name})", ds, k, beta, n, guard)
  interpret = backend.interpret_mode(default_interpret(interpret))
  config = backend.default_config(None, device_kind(interpret)) if config is None else config
  st, inputs, aux = backend.prepare(guard, config, interpret, ds, k, beta, n)
  outputs = shells.kernels(backend, st, RESIDUAL_NAME, inputs)
  return backend.finish(st, inputs, outputs, aux)
