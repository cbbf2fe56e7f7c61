"""The entry point `d_pass`, its `jax.custom_vjp` and the XLA around the kernels.

XLA forms a_t = η β_t / n_t and c_t = η β_t² / n_t (β and n are differentiated through them by autodiff). The
custom_vjp covers ds only; d_{T+1} (each segment's last d, packed) is one more step from the last token's d in XLA
(`kernel.pre_clip`), so the kernels carry no final state and its cotangent reaches the backward kernel through
∂L/∂ds. From the backward kernel's μ (and s_t = ⟨d_t, u_t⟩, p_t = ⟨μ_t, u_t⟩), elementwise in XLA:
    ∂u_t = (a_t − c_t s_t) μ_t − c_t p_t d_t,   ∂a_t = p_t,   ∂c_t = −s_t p_t,
    ∂r_t = ⟨μ_t, d_t⟩ ("zero") | ⟨μ_t, d_t − o⟩ ("init"),   ∂o = Σ_{b,t} (1 − r_t) μ_t,
    ∂d1 = λ at the first token: λ_1 (unpacked), or λ summed per segment over first tokens (packed),
with λ_t = ∂L/∂ds_t + ρ_t μ_t − c_t p_t u_t.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import osdn_math as om
from pallas_kernels.arrays import device_kind
from pallas_kernels.osdn_shell import check_d_pass
from pallas_kernels.spec import Spec
from pallas_kernels.tpu import common
from pallas_kernels.tpu.common import F32, LANES
from pallas_kernels.tpu.osdn.config import MAX_KEY_DIM, NAME, Config, Static, default_config, static
from pallas_kernels.tpu.osdn.kernel import call, head_major, pre_clip


def _forward(st: Static, u, a, c, r, o, d1, codes):
  return call(st, False, u, head_major(st, a, c, r), o, codes, d1=d1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ds(st: Static, u, a, c, r, o, d1, codes, starts):
  """All d_t [B, T, G, K]: d1 at the first token (unpacked) or d1[segment] at every segment's first token (packed:
  codes as the kernels read them, starts [B, T] the same per token with N where no segment starts), the clipped
  recurrence in between."""
  return _forward(st, u, a, c, r, o, d1, codes)


def _ds_fwd(st, u, a, c, r, o, d1, codes, starts):
  ds = _forward(st, u, a, c, r, o, d1, codes)
  return ds, (u, a, c, r, o, codes, starts, ds)


def _ds_bwd(st, res, g):
  u, a, c, r, o, codes, starts, ds = res
  g = g.astype(F32)
  mu = call(st, True, u, head_major(st, a, c, r), o, codes, ds=ds, g=g)
  s, p = jnp.sum(ds * u, axis=-1), jnp.sum(mu * u, axis=-1)                              # [B, T, G]
  du = (a - c * s)[..., None] * mu - (c * p)[..., None] * ds
  dr = do = None
  if st.mode != "none":
    dr = jnp.sum(mu * (ds if st.mode == "zero" else ds - o), axis=-1)
  if st.mode == "init":
    do = jnp.sum((1.0 - r)[..., None] * mu, axis=(0, 1))
  keep = mu if r is None else r[..., None] * mu
  lam = g + keep - (c * p)[..., None] * u            # λ_t, for ∂d1 at the first tokens
  if codes is None:
    dd1 = lam[:, 0]
  else:
    dd1 = jax.ops.segment_sum(lam.reshape((-1,) + lam.shape[2:]), starts.reshape(-1), num_segments=st.segments)
  return du, p, -s * p, dr, do, dd1, None, None


_ds.defvjp(_ds_fwd, _ds_bwd)


def _codes(st: Static, segments, count: int):
  """The restart codes as the kernels read them, [B · NC · C'] int32 (C' = C rounded up to 128: SMEM blocks [C'])
  holding the segment (clamped to N − 1) at a segment's first token and −1 elsewhere (past T too); the same [B, T]
  with N for −1 (∂d1's segments); the flat position [N] of every segment's last token and present [N] (the segment
  has tokens)."""
  b, t = segments.shape
  segments = segments.astype(jnp.int32)
  first = jnp.concatenate([jnp.ones((b, 1), bool), segments[:, 1:] != segments[:, :-1]], axis=1)
  last = jnp.concatenate([first[:, 1:], jnp.ones((b, 1), bool)], axis=1)
  codes = jnp.where(first, jnp.minimum(segments, count - 1), -1)
  starts = jnp.where(first, codes, count)
  codes = jnp.pad(codes, ((0, 0), (0, st.tp - t)), constant_values=-1).reshape(b * st.num_chunks, st.chunk)
  codes = jnp.pad(codes, ((0, 0), (0, common.round_up(st.chunk, LANES) - st.chunk)), constant_values=-1)
  where = jnp.where(last, segments, count).reshape(-1)
  pos = jnp.zeros((count,), jnp.int32).at[where].set(jnp.arange(b * t, dtype=jnp.int32), mode="drop")
  present = jnp.zeros((count,), bool).at[where].set(True, mode="drop")
  return codes.reshape(-1), starts, pos, present


@functools.partial(jax.jit, static_argnames=("st",))
def _run(u, n, beta, r, d1, d_init, segment_ids, *, st: Static):
  f32 = lambda x: None if x is None else jnp.asarray(x, F32)
  u, n, beta, r, d1 = f32(u), f32(n), f32(beta), f32(r), f32(d1)
  a, c = om.write_coef(st.eta, beta, n), om.erase_coef(st.eta, beta, n)
  r = r if st.mode != "none" else None
  o = jnp.broadcast_to(f32(d_init), (st.heads, st.key_dim)) if st.mode == "init" else None
  if st.segments:
    codes, starts, pos, present = _codes(st, segment_ids, st.segments)
  else:
    codes = starts = None
  ds = _ds(st, u, a, c, r, o, d1, codes, starts)
  if st.segments:        # each segment's last d: one step from its last token
    take = lambda x: None if x is None else x.reshape((-1,) + x.shape[2:])[pos]
    d, uu, aa, cc, rr = (take(x) for x in (ds, u, a, c, r))
  else:
    d, uu, aa, cc, rr = (None if x is None else x[:, -1] for x in (ds, u, a, c, r))
  col = lambda x: None if x is None else x[..., None]
  d_last = om.clip(pre_clip(st, d, uu, col(aa), col(cc), col(rr), o), st.d_min, st.d_max)
  if st.segments:
    d_last = jnp.where(present[:, None, None], d_last, 0.0)
  return ds, d_last


def d_pass(u, n, beta, retention, d1, d_init, *, eta, d_min, d_max, apf_anchor, segment_ids=None, keys=None,
           config: Config | None = None, interpret=None):
  """OSDN's sequential d-pass with the Pallas TPU kernels (Mosaic on a TPU, TPU interpret mode on a CPU).

  The signature and results of `osdn_jax.dgps.precond.osdn_d_pass`:
    u [B, T, G, K] (k ⊙ k), n [B, T, G] (max(‖k‖², 1e-12)), beta [B, T, G], retention None (r ≡ 1) or
    [B, T, G], d1 [B, G, K] (the d of token 1), d_init [G, K] (or broadcastable; used by anchor "init" with
    a retention); eta, d_min, d_max static numbers (bounds None: unbounded); anchor "zero" | "init".
  Returns (ds [B, T, G, K], d_{T+1} [B, G, K]), fp32. Differentiable w.r.t. u, n, beta, retention, d1 and
  d_init (zero gradient through clipped entries, ½ at a bound). Packed: `segment_ids` [B, T] are segment numbers
  0..N−1 in row-major order (`osdn_jax.ops.packing.segment_index`), d1 is [N, G, K], d restarts from d1[n] at
  segment n's first token, and the second result is each segment's last d [N, G, K] (zeros for segments without
  tokens). interpret: None (interpret on a CPU backend), a bool or a `pltpu.InterpretParams`; config:
  `default_config`.
  keys: None or the keys k with u = k ⊙ k; this kernel reads u, which is formed from them (fp32) where u is None.
  """
  call = check_d_pass(NAME, u, n, beta, retention, d1, d_init, eta=eta, d_min=d_min, d_max=d_max,
                      apf_anchor=apf_anchor, segment_ids=segment_ids, keys=keys, max_key_dim=MAX_KEY_DIM)
  if u is None:
    u = jnp.square(jnp.asarray(keys, jnp.float32))
  interpret = common.default_interpret(interpret)
  config = config or default_config(None, device_kind(interpret))
  st = static(call.length, call.heads, call.key_dim, eta=call.eta, d_min=call.d_min, d_max=call.d_max,
              mode=call.mode, segments=call.segments, config=config, interpret=interpret)
  return _run(u, n, beta, retention, d1, jnp.asarray(d_init), segment_ids, st=st)


def supports(spec: Spec) -> bool:
  """Compiled on "tpu"; fp32 (the d-pass's compute dtype); K ≤ 256; packed or not; η and the bounds static
  numbers."""
  return (spec.platform == "tpu" and spec.dtype == "float32" and 1 <= spec.key_dim <= MAX_KEY_DIM
          and spec.static_params and spec.config_of(Config))
