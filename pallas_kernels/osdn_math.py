"""One token of OSDN's d-pass, as both kernel backends compute it (`gpu/osdn`, `tpu/osdn`; their wrappers too).

    d̄_{t+1} = keep_t + coef_t u_t,   coef_t = η β_t (1 − β_t s_t) / n_t = α_t − c_t s_t,   s_t = ⟨d_t, u_t⟩,
    keep_t = d_t (no retention) | r_t d_t (anchor "zero") | d_init + r_t (d_t − d_init) (anchor "init"),
    d_{t+1} = clip(d̄_{t+1}, d_min, d_max),   α = η β / n,   c = η β² / n,

with u = k ⊙ k, n = ‖k‖² (floored), β the gain, r the retention, η the step size. The contract is
`osdn_jax.dgps.precond.osdn_update` (the library's token-serial reference, which does not import this module).

Plain jnp on whatever the caller holds, so the same code traces in a Pallas kernel body (Triton and Mosaic) and in
XLA: a kernel's register values ([K], or [Hb, K] with [Hb, 1] per-token scalars) or whole arrays. Per-token
scalars (beta, n, s, r, coef) must already broadcast against d and u; eta and the bounds are Python numbers or
None (a bound of None does not act).
"""
from __future__ import annotations

import jax.numpy as jnp


def step_coef(eta, beta, n, s):
  """coef = η β (1 − β s) / n, the weight of u in d̄_{t+1}, for s = ⟨d_t, u_t⟩. beta, n, s: one shape (or
  broadcasting); the result has it."""
  return eta * beta * (1.0 - beta * s) / n


def step_coef_grads(eta, beta, n, s, coef, p):
  """(∂β, ∂n): the cotangents of β and n through coef = `step_coef`(eta, beta, n, s) when coef's is p, i.e.
  p ∂coef/∂β = η p (1 − 2 β s) / n and p ∂coef/∂n = −coef p / n (s held fixed: its own path is the caller's).
  Every argument but eta one shape (or broadcasting); both results have it."""
  return eta * p * (1.0 - 2.0 * beta * s) / n, -coef * p / n


def write_coef(eta, beta, n):
  """α = η β / n, the part of `step_coef` that does not depend on d (coef = α − c s). beta, n: one shape."""
  return eta * beta / n


def erase_coef(eta, beta, n):
  """c = η β² / n, the weight of ⟨d_t, u_t⟩ u_t in d̄_{t+1} (and of ⟨μ_t, u_t⟩ u_t in the adjoint). beta, n: one
  shape."""
  return eta * beta * beta / n


def keep(d, r, d_init, apf_anchor: str):
  """The retained part of d_t: d (r None, no retention), r d (anchor "zero") or d_init + r (d − d_init) ("init").
  d [..., K]; r None or broadcasting against d (e.g. [..., 1]); d_init (anchor "init" only) broadcasting against
  d, else unused."""
  if r is None:
    return d
  if apf_anchor == "zero":
    return r * d
  if apf_anchor == "init":
    return d_init + r * (d - d_init)
  raise ValueError(f"apf_anchor must be 'zero' or 'init', got {apf_anchor!r}")


def unclipped(d, u, coef, r, d_init, apf_anchor: str):
  """d̄_{t+1} = keep(d, r, d_init, apf_anchor) + coef u. d, u [..., K]; coef and r (None: no retention)
  broadcasting against them ([..., 1], or scalars for one row [K])."""
  return keep(d, r, d_init, apf_anchor) + coef * u


def clip(x, d_min, d_max):
  """The box clip of d̄, x [..., K]: max(x, d_min), then min(·, d_max), as `jnp.clip` computes it (values and
  derivative) but without its jit wrapper, which would nest a jit in every kernel body; a bound of None does not
  act (x itself when both are)."""
  if d_min is not None:
    x = jnp.maximum(x, d_min)
  if d_max is not None:
    x = jnp.minimum(x, d_max)
  return x


def clip_grad(x, d_min, d_max):
  """∂clip/∂x at x as `jnp.clip` (jnp.maximum, jnp.minimum) differentiates it: 1 inside, 0 outside, ½ at a bound,
  ¼ where d_min = d_max = x. fp32, x's shape; None when both bounds are None (the derivative is 1)."""
  m = None
  if d_min is not None:
    m = (x > d_min).astype(jnp.float32) + 0.5 * (x == d_min).astype(jnp.float32)
  if d_max is not None:
    hi = (x < d_max).astype(jnp.float32) + 0.5 * (x == d_max).astype(jnp.float32)
    m = hi if m is None else m * hi
  return m
