"""The D axis: log-decays (natural log, ≤ 0) as pure functions of projected inputs, and their initialisers.

* scalar (GDN, Mamba-2): g = −exp(A_log) · softplus(a + dt_bias), a = W_a x [B, T, HV]; A_log, dt_bias [HV].
* channel (KDA, GLA): the same form per key channel, a [B, T, HV, K] (a low-rank projection), A_log [HV],
  dt_bias [HV, K].
* constant (RetNet): a fixed per-head decay log(1 − 2^(−5−h)).
* sigmoid (MesaNet's forget gate): g = log σ(a), a = W_a x + b_a [B, T, HV].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from osdn_jax.dgps import checks


def gate(a, A_log, dt_bias):
  """g = −exp(A_log) · softplus(a + dt_bias). a [B, T, HV] or [B, T, HV, K]; A_log [HV]; dt_bias a's tail."""
  A_log = jnp.asarray(A_log)
  if a.ndim == 4 and A_log.ndim == 1:
    A_log = A_log[:, None]
  return -jnp.exp(A_log) * jax.nn.softplus(a + dt_bias)


def log_sigmoid(a):
  """g = log σ(a) = −softplus(−a), a [B, T, HV]: the decay factor e^g = σ(a) (MesaNet's forget gate)."""
  return jax.nn.log_sigmoid(a)


def retnet(batch: int, length: int, heads: int, dtype=jnp.float32):
  """RetNet's fixed decays log(1 − 2^(−5−h)), h = 0..heads−1, broadcast to [B, T, HV]."""
  g = np.log1p(-np.exp2(-5.0 - np.arange(heads)))
  return jnp.broadcast_to(jnp.asarray(g, dtype), (batch, length, heads))


def _pair(name, value):
  if not isinstance(value, (tuple, list)) or len(value) != 2:
    raise ValueError(f"init_gate: `{name}` must be a pair (lo, hi), got {value!r}")
  return value


def init_gate(key, shape, *, a_range=(1.0, 16.0), dt_range=(1e-3, 0.1), dt_floor=1e-4):
  """Mamba-2-style initial (A_log [shape[0]], dt_bias [shape]): A ~ U(1, 16), dt ~ logU(1e-3, 0.1) floored at
  1e-4, dt_bias = softplus⁻¹(dt) = dt + log(−expm1(−dt)). Each range is (lo, hi) with 0 < lo ≤ hi; dt_floor > 0."""
  for name, (lo, hi) in (("a_range", _pair("a_range", a_range)), ("dt_range", _pair("dt_range", dt_range))):
    checks.ordered("init_gate", f"{name}[0]", checks.number("init_gate", f"{name}[0]", lo, low=0.0, low_open=True),
                   f"{name}[1]", checks.number("init_gate", f"{name}[1]", hi, low=0.0, low_open=True))
  checks.number("init_gate", "dt_floor", dt_floor, low=0.0, low_open=True)
  k_a, k_dt = jax.random.split(key)
  A = jax.random.uniform(k_a, shape[:1], minval=a_range[0], maxval=a_range[1])
  lo, hi = np.log(dt_range[0]), np.log(dt_range[1])
  dt = jnp.maximum(jnp.exp(jax.random.uniform(k_dt, shape, minval=lo, maxval=hi)), dt_floor)
  return {"A_log": jnp.log(A), "dt_bias": dt + jnp.log(-jnp.expm1(-dt))}
