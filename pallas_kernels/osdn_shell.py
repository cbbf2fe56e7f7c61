"""OSDN's d-pass: the argument checks every kernel backend's `d_pass` runs, written once.

`check_d_pass` validates a call of the signature of `osdn_jax.dgps.precond.osdn_d_pass` (the kernels' form: segment
numbers, static η and bounds) and returns the call's static description, `Call`; a backend then reads its launch
parameters from its tuning table (`default_config(spec, device_kind)`, `arrays.device_kind`) and runs its kernels.
The interpret default is `arrays.default_interpret`'s.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.arrays import static_number

ANCHORS = ("zero", "init")


@dataclasses.dataclass(frozen=True)
class Call:
  """A checked d-pass call. mode: "none" (no retention, r ≡ 1) | "zero" | "init" (the APF anchor); segments: N
  (0: unpacked); squared: the keys were given (u = k ⊙ k formed from them)."""
  batch: int
  length: int
  heads: int
  key_dim: int
  eta: float
  d_min: float | None
  d_max: float | None
  mode: str
  segments: int
  squared: bool


def check_d_pass(where: str, u, n, beta, retention, d1, d_init, *, eta, d_min, d_max, apf_anchor, segment_ids,
                 keys, max_key_dim: int) -> Call:
  """ValueError naming the argument unless: u [B, T, G, K] (or None with keys, a float [B, T, G, K] array, u = k ⊙ k;
  u given beside keys must have their shape), every dim ≥ 1 and K ≤ max_key_dim; n, beta [B, T, G]; retention None
  or [B, T, G]; d1 [B, G, K], or packed (segment_ids an integer [B, T]) [N, G, K]; d_init broadcastable to [G, K];
  apf_anchor "zero" or "init"; eta a static number, d_min and d_max static numbers or None."""
  if keys is not None:
    if jnp.ndim(keys) != 4 or not jnp.issubdtype(jnp.result_type(keys), jnp.floating):
      raise ValueError(f"{where}: `keys` must be a float [B, T, G, K] array, got {jnp.result_type(keys)} "
                       f"{jnp.shape(keys)}")
    if u is not None and jnp.shape(u) != jnp.shape(keys):
      raise ValueError(f"{where}: `u` must have the keys' shape {jnp.shape(keys)}, got {jnp.shape(u)}")
  elif u is None or jnp.ndim(u) != 4:
    raise ValueError(f"{where}: `u` must be [B, T, G, K], got shape {None if u is None else jnp.shape(u)}")
  b, t, g, kd = jnp.shape(keys if keys is not None else u)
  if min(b, t, g, kd) < 1:
    raise ValueError(f"{where}: every dim of `u` must be ≥ 1 (T ≥ 1 tokens), got shape {(b, t, g, kd)}")
  if kd > max_key_dim:
    raise ValueError(f"{where}: `u` has K = {kd}, which must be ≤ {max_key_dim}")
  for name, x in (("n", n), ("beta", beta), ("retention", retention)):
    if (x is not None or name != "retention") and jnp.shape(x) != (b, t, g):
      raise ValueError(f"{where}: `{name}` must be [B, T, G] = {(b, t, g)}, got {jnp.shape(x)}")
  count = 0
  if segment_ids is None:
    if jnp.shape(d1) != (b, g, kd):
      raise ValueError(f"{where}: `d1` must be [B, G, K] = {(b, g, kd)}, got {jnp.shape(d1)}")
  else:
    if jnp.shape(segment_ids) != (b, t) or not jnp.issubdtype(jnp.result_type(segment_ids), jnp.integer):
      raise ValueError(f"{where}: `segment_ids` must be integer [B, T] = {(b, t)}, got "
                       f"{jnp.result_type(segment_ids)} {jnp.shape(segment_ids)}")
    if jnp.ndim(d1) != 3 or jnp.shape(d1)[1:] != (g, kd) or jnp.shape(d1)[0] < 1:
      raise ValueError(f"{where}: packed, `d1` must be [N, G, K] with G, K = {(g, kd)}, got {jnp.shape(d1)}")
    count = jnp.shape(d1)[0]
  try:
    fits = jnp.broadcast_shapes(jnp.shape(d_init), (g, kd)) == (g, kd)
  except ValueError:
    fits = False
  if not fits:
    raise ValueError(f"{where}: `d_init` must broadcast to [G, K] = {(g, kd)}, got {jnp.shape(d_init)}")
  if apf_anchor not in ANCHORS:
    raise ValueError(f"{where}: `apf_anchor` must be 'zero' or 'init', got {apf_anchor!r}")
  eta = static_number(where, "eta", eta)
  if eta is None:
    raise ValueError(f"{where}: `eta` must be a static number, got None")
  d_min, d_max = static_number(where, "d_min", d_min), static_number(where, "d_max", d_max)
  return Call(batch=b, length=t, heads=g, key_dim=kd, eta=eta, d_min=d_min, d_max=d_max,
              mode="none" if retention is None else apf_anchor, segments=count, squared=keys is not None)
