"""The D axis: log-decays (natural log, ≤ 0) as pure functions of projected inputs, and their initialisers.

* scalar (GDN, Mamba-2): g = −exp(A_log) · softplus(a + dt_bias), a = W_a x [B, T, HV]; A_log, dt_bias [HV].
* channel (KDA, GLA): the same form per key channel, a [B, T, HV, K] (a low-rank projection), A_log [HV],
  dt_bias [HV, K].
* constant (RetNet): a fixed per-head decay log(1 − 2^(−5−h)).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def gate(a, A_log, dt_bias):
  """g = −exp(A_log) · softplus(a + dt_bias). a [B, T, HV] or [B, T, HV, K]; A_log [HV]; dt_bias a's tail."""
  A_log = jnp.asarray(A_log)
  if a.ndim == 4 and A_log.ndim == 1:
    A_log = A_log[:, None]
  return -jnp.exp(A_log) * jax.nn.softplus(a + dt_bias)


def retnet(batch: int, length: int, heads: int, dtype=jnp.float32):
  """RetNet's fixed decays log(1 − 2^(−5−h)), h = 0..heads−1, broadcast to [B, T, HV]."""
  g = np.log1p(-np.exp2(-5.0 - np.arange(heads)))
  return jnp.broadcast_to(jnp.asarray(g, dtype), (batch, length, heads))


def init_gate(key, shape, *, a_range=(1.0, 16.0), dt_range=(1e-3, 0.1), dt_floor=1e-4):
  """Mamba-2-style initial (A_log [shape[0]], dt_bias [shape]): A ~ U(1, 16), dt ~ logU(1e-3, 0.1) floored at
  1e-4, dt_bias = softplus⁻¹(dt) = dt + log(−expm1(−dt))."""
  k_a, k_dt = jax.random.split(key)
  A = jax.random.uniform(k_a, shape[:1], minval=a_range[0], maxval=a_range[1])
  lo, hi = np.log(dt_range[0]), np.log(dt_range[1])
  dt = jnp.maximum(jnp.exp(jax.random.uniform(k_dt, shape, minval=lo, maxval=hi)), dt_floor)
  return {"A_log": jnp.log(A), "dt_bias": dt + jnp.log(-jnp.expm1(-dt))}
