"""Per-step stability of the online solve: the eigenvalues of one step and the size of the state.

One step maps S'_t ↦ (I − β_t k̃_t k_tᵀ) S'_t after the decay S'_t = D_t S_{t-1}: the write factor has
eigenvalues 1 (K−1 times) and 1 − β_t⟨k_t, k̃_t⟩. The step is non-normal, so a product of steps can expand
even when each step's spectral radius is ≤ 1: `state_norms` measures max ‖S_t‖ through the recurrence.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from osdn_jax.ops import common, naive


def write_eigenvalue(k, beta, k_write=None):
  """The write factor's non-unit eigenvalue 1 − β_t⟨k_t, k̃_t⟩; k [B, T, H, K], beta [B, T, HV] → [B, T, HV]."""
  hv = beta.shape[2]
  k = common.expand_heads(k, hv, axis=2)
  kw = k if k_write is None else common.expand_heads(k_write, hv, axis=2)
  return 1.0 - beta * jnp.sum(k * kw, -1)


def step_eigenvalues(k, beta, k_write=None, log_decay=None):
  """All K eigenvalues of each step's transition (I − β k̃ kᵀ) D_t, numerically ([B, T, HV, K] complex).

  D_t = 1, exp(g) or diag(exp(g)). Uses a dense non-symmetric eigensolver (CPU backend; diagnostics only).
  """
  hv, kd = beta.shape[2], k.shape[-1]
  k = common.expand_heads(k, hv, axis=2)
  kw = k if k_write is None else common.expand_heads(k_write, hv, axis=2)
  m = jnp.eye(kd, dtype=k.dtype) - beta[..., None, None] * kw[..., :, None] * k[..., None, :]
  if log_decay is not None:
    d = jnp.exp(log_decay)
    m = m * (d[..., None, None] if log_decay.ndim == 3 else d[..., None, :])
  return jax.device_get(jnp.linalg.eigvals(jax.device_put(m, jax.devices("cpu")[0])))


def _emit_norms(S_pre, S, q, k, v, scale):
  del S_pre, q, k, v, scale
  return jnp.sqrt(jnp.sum(S * S, axis=(-2, -1))), jnp.linalg.norm(S, ord=2, axis=(-2, -1))


def state_norms(k, v, beta=None, *, k_write=None, log_decay=None, initial_state=None, online=True):
  """(Frobenius ‖S_t‖_F, spectral ‖S_t‖_2) after every token, [B, T, HV] each, through the recurrence."""
  (fro, spec), _ = naive.trajectory(_emit_norms, k, v, beta, k_write=k_write, log_decay=log_decay,
                                    initial_state=initial_state, online=online)
  return fro, spec
