"""PDN's write key and ATQ's query on TPU: the second-moment kernel (`decayed_sum`), then the transform in XLA.

    A_t = e^{g_t} A_{t−1} + β_t k_t ⊙ k_t                                   (`decayed_sum`, one Mosaic kernel)
    "pdn": y_t = M(A_t) ⊙ k_t,   M = exp(−log(x) z / (1 + |z|)),   z = log(A_t + ε) − c_h
    "atq": y_t = q_t / (A_t + λ)

`precond_key` has the signature and results of `pallas_kernels.gpu.precond_key.precond_key` (the op
"precond_key": `osdn_jax.dgps.precond.pdn_write_key` / `atq_query`, unpacked). Unlike the GPU kernel it stores A
[B, T, H, K] fp32 once: the transform is one elementwise XLA fusion over A and k (or q), and its gradient reaches
the kernel's own backward through autodiff. Faults stay where the token-serial recurrence puts them, as
`decayed_sum` confines them, with NaN wherever A_t is not finite.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.arrays import check_precond_key
from pallas_kernels.spec import Spec
from pallas_kernels.tpu.decayed_sum import Config, decayed_sum
from pallas_kernels.wrapper_math import precond_transform


def precond_key(k, beta, log_decay, *, transform: str, q=None, center=None, x=1.5, eps=1e-6, lam=1.0,
                initial_state=None, config: Config | None = None, interpret=None):
  """PDN's write key M(A_t) ⊙ k_t ("pdn") or ATQ's query q_t / (A_t + λ) ("atq"), and A_T.

  k [B, T, H, K] and q (atq) [B, T, H, K] (fp32 or bf16); beta, log_decay [B, T, H]; center (pdn) scalar or
  [H]; x, eps (pdn) and lam (atq) static numbers; initial_state A_0 [B, H, K] (default 0). Computes in fp32.
  Returns (y [B, T, H, K] in k's (pdn) / q's (atq) dtype, A_T [B, H, K] fp32). Differentiable w.r.t. k, q, beta,
  log_decay, center and initial_state. interpret / config: as `decayed_sum`'s.
  """
  check_precond_key("precond_key (pallas tpu)", k, beta, log_decay, transform, q, center, x, eps, lam,
                    initial_state)
  A, A_T = decayed_sum(k, log_decay, beta=beta, initial_state=initial_state, interpret=interpret, config=config)
  if transform == "atq":                                  # q / (inf + λ) would be a finite 0 (PDN's scale is NaN)
    A = jnp.where(jnp.isfinite(A), A, jnp.nan)
    p, dtype = q.astype(jnp.float32), q.dtype
  else:                                                   # the center per head, against A [B, T, H, K]
    p, dtype = jnp.asarray(center, jnp.float32).reshape(-1)[:, None], k.dtype
  y = precond_transform(transform, A, k.astype(jnp.float32), p, x=x, eps=eps, lam=lam)
  return y.astype(dtype), A_T


precond_key.confines_faults = True   # unpacked: NaN where the token-serial recurrence has it (`decayed_sum`)


def supports(spec: Spec) -> bool:
  """Compiled on "tpu"; fp32 or bf16 inputs (computed in fp32); unpacked; static transform constants."""
  return (spec.platform == "tpu" and spec.dtype in ("float32", "bfloat16") and not spec.packed
          and spec.static_params and spec.config_of(Config))
