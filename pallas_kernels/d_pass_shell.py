"""OSDN's d-pass (op "osdn_d_pass"), written once for every kernel backend: the entry point and its checks, the
interpret and config defaults, and the differentiation skeleton with its residual name for rematerialisation.

The recurrence (one (batch, head) row; u_t = k_t ⊙ k_t, n_t = max(‖k_t‖², 1e-12), s_t = ⟨d_t, u_t⟩, o = d_init):
    coef_t = η β_t (1 − β_t s_t) / n_t = a_t − c_t s_t,   a_t = η β_t / n_t,   c_t = η β_t² / n_t
    d̄_{t+1} = keep_t + coef_t u_t,   keep_t = d_t (r ≡ 1) | r_t d_t (anchor "zero") | o + r_t (d_t − o) ("init")
    d_{t+1} = clip(d̄_{t+1}, d_min, d_max)
Token t writes with d_t; the results are ds = (d_1 … d_T) [B, T, G, K] and d_{T+1} [B, G, K], fp32. The contract
is `osdn_jax.dgps.precond.osdn_d_pass(implementation="reference")`, the token-serial `lax.scan`.

`d_pass(backend, ...)` checks the call (`check_d_pass`), reads the config from the backend's tuning table
(`default_config(None, device_kind)`) and, under one jit: forms u = k ⊙ k in fp32 from the keys unless the backend
reads them itself (`reads_keys(config)`), casts the gates and d1 to fp32, drops the retention without one
(anchor "none") and broadcasts o to [G, K] for anchor "init"; then the backend's `prepare` (differentiable XLA:
its layout, padding and packed codes) → `shells.kernels` (the custom_vjp around its kernels, their saved
intermediates named `RESIDUAL_NAME`) → its `finish` (differentiable XLA back to (ds, d_{T+1})).

The backends split the work differently, and `prepare` / `finish` carry the difference:
  pallas gpu  the kernels take u (or the keys), n, β, r, d1 and o and form both results: `prepare` pads K and
              builds the packed codes, `finish` slices K (and zeroes the rows of segments without tokens);
  pallas tpu  XLA forms a_t and c_t before the kernels, which return ds only (their backward's elementwise
              remainder in XLA too); `finish` forms d_{T+1} one step from the last token's d (each segment's
              last, packed) in XLA, so its cotangent reaches the kernels through ∂L/∂ds.
A backend is one `Backend` record (`pallas_kernels.gpu.osdn`, `pallas_kernels.tpu.osdn`) beside its kernels, its
`Config` and tuning table, and its `d_pass` is this module's bound to it (`shells.bind`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from pallas_kernels import shells
from pallas_kernels.arrays import default_interpret, device_kind, static_number

ANCHORS = ("zero", "init")
RESIDUAL_NAME = "precond_pass"    # the kernels' saved intermediates, for rematerialisation policies


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


@dataclasses.dataclass(frozen=True)
class Backend(shells.Backend):
  """`shells.Backend` with, for this op: max_key_dim, the largest K its kernels take; reads_keys(config): given the
  keys, its kernels read them and square them where they load them (else the shell forms u);
  prepare(call, config, interpret, u, keys, n, beta, r, d1, o, segment_ids) → (st, inputs, aux), one of u (fp32)
  and keys None, n, beta, d1 fp32, r fp32 or None (anchor "none"), o [G, K] fp32 or None (anchor "init" only),
  segment_ids [B, T] or None; finish(st, inputs, outputs, aux) → (ds [B, T, G, K], d_{T+1} [B or N, G, K])."""
  max_key_dim: int
  reads_keys: Callable[[Any], bool]


@functools.partial(jax.jit, static_argnames=("backend", "call", "config", "interpret"))
def _d_pass(u, n, beta, retention, d1, d_init, segment_ids, keys, *, backend: Backend, call: Call, config,
            interpret):
  if keys is not None and not backend.reads_keys(config):
    u, keys = jnp.square(jnp.asarray(keys, jnp.float32)), None
  f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
  r = f32(retention) if call.mode != "none" else None
  o = jnp.broadcast_to(f32(d_init), (call.heads, call.key_dim)) if call.mode == "init" else None
  st, inputs, aux = backend.prepare(call, config, interpret, f32(u), keys, f32(n), f32(beta), r, f32(d1), o,
                                    segment_ids)
  outputs = shells.kernels(backend, st, RESIDUAL_NAME, inputs)
  return backend.finish(st, inputs, outputs, aux)


def d_pass(backend: Backend, u, n, beta, retention, d1, d_init, *, eta, d_min, d_max, apf_anchor, segment_ids=None,
           keys=None, config=None, interpret=None):
  """OSDN's sequential d-pass with `backend`'s Pallas kernels.

  The signature and results of `osdn_jax.dgps.precond.osdn_d_pass`:
    u [B, T, G, K] (k ⊙ k), n [B, T, G] (max(‖k‖², 1e-12)), beta [B, T, G], retention None (r ≡ 1) or
    [B, T, G], d1 [B, G, K] (the d of token 1), d_init [G, K] (or broadcastable; used by anchor "init" with
    a retention); eta, d_min, d_max static numbers (bounds None: unbounded); anchor "zero" | "init".
  Returns (ds [B, T, G, K], d_{T+1} [B, G, K]), fp32. Differentiable w.r.t. u, n, beta, retention, d1 and
  d_init (zero gradient through clipped entries). Packed: `segment_ids` [B, T] are segment numbers 0..N−1 in
  row-major order (`osdn_jax.ops.packing.segment_index`), d1 is [N, G, K], d restarts from d1[n] at segment
  n's first token, and the second result is each segment's last d [N, G, K] (zeros for segments without tokens).
  keys: None, or the keys [B, T, G, K] (a float dtype) with u = k ⊙ k: `u` is then not read (it may be None) and
  the first cotangent is k's; a backend whose kernels read keys (`Backend.reads_keys`) forms u where it loads k
  (u is never stored, and bf16 keys are read in half the bytes), else u = k ⊙ k is formed in fp32 first.
  `interpret`: None runs interpret mode on a CPU backend (`arrays.default_interpret`), else a bool (or what the
  backend's `pallas_call` takes); `config`: the backend's launch parameters (None: `default_config`, its tuning
  table's entry for this device, or for interpret mode).
  """
  call = check_d_pass(f"osdn d_pass ({backend.name})", u, n, beta, retention, d1, d_init, eta=eta, d_min=d_min,
                      d_max=d_max, apf_anchor=apf_anchor, segment_ids=segment_ids, keys=keys,
                      max_key_dim=backend.max_key_dim)
  interpret = backend.interpret_mode(default_interpret(interpret))
  config = backend.default_config(None, device_kind(interpret)) if config is None else config
  return _d_pass(None if keys is not None else u, n, beta, retention, d1, jnp.asarray(d_init), segment_ids, keys,
                 backend=backend, call=call, config=config, interpret=interpret)
