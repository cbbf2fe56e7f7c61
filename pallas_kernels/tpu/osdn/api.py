"""OSDN's d-pass as a Pallas TPU (Mosaic) kernel pair: what this backend supplies to the shell
(`pallas_kernels.d_pass_shell`: the entry point, checks, defaults and custom_vjp; the recurrence in its docstring).

`prepare` forms a_t = η β_t / n_t and c_t = η β_t² / n_t in XLA (β and n are differentiated through them by
autodiff) and the packed restart codes; the kernels return ds only, and `finish` forms d_{T+1} (each segment's last
d, packed) one more step from the last token's d in XLA (`kernel.pre_clip`), so the kernels carry no final state and
its cotangent reaches the backward kernel through ∂L/∂ds. Under autodiff ds is saved (named for
rematerialisation). From the backward kernel's μ (and s_t = ⟨d_t, u_t⟩, p_t = ⟨μ_t, u_t⟩), elementwise in XLA:
    ∂u_t = (a_t − c_t s_t) μ_t − c_t p_t d_t,   ∂a_t = p_t,   ∂c_t = −s_t p_t,
    ∂r_t = ⟨μ_t, d_t⟩ ("zero") | ⟨μ_t, d_t − o⟩ ("init"),   ∂o = Σ_{b,t} (1 − r_t) μ_t,
    ∂d1 = λ at the first token: λ_1 (unpacked), or λ summed per segment over first tokens (packed),
with λ_t = ∂L/∂ds_t + ρ_t μ_t − c_t p_t u_t. The kernels read u (given the keys, the shell forms it in fp32).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import d_pass_shell as shell
from pallas_kernels import osdn_math as om
from pallas_kernels.shells import bind
from pallas_kernels.spec import Spec
from pallas_kernels.tpu import common
from pallas_kernels.tpu.common import F32, LANES
from pallas_kernels.tpu.osdn.config import MAX_KEY_DIM, Config, Static, default_config, static
from pallas_kernels.tpu.osdn.kernel import call, head_major, pre_clip


def _run_forward(st: Static, inputs):
  """All d_t [B, T, G, K] of inputs (u, a, c, r, o, d1, codes, starts): d1 at the first token (unpacked) or
  d1[segment] at every segment's first token (packed: codes as the kernels read them, starts [B, T] the same per
  token with N where no segment starts), the clipped recurrence in between."""
  u, a, c, r, o, d1, codes, _ = inputs
  return call(st, False, u, head_major(st, a, c, r), o, codes, d1=d1)


def _forward_saving(st: Static, inputs):
  ds = _run_forward(st, inputs)
  return ds, ds


def _run_backward(st: Static, inputs, ds, g):
  u, a, c, r, o, _, codes, starts = inputs
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


def _prepare(call: shell.Call, config: Config, interpret, u, keys, n, beta, r, d1, o, segment_ids):
  """a_t, c_t in XLA; packed: the restart codes, and (aux) where each segment's last token is and which have
  tokens."""
  del keys                                  # the kernels read u (`reads_keys` False)
  st = static(call.length, call.heads, call.key_dim, eta=call.eta, d_min=call.d_min, d_max=call.d_max,
              mode=call.mode, segments=call.segments, config=config, interpret=interpret)
  a, c = om.write_coef(st.eta, beta, n), om.erase_coef(st.eta, beta, n)
  codes = starts = aux = None
  if st.segments:
    codes, starts, pos, present = _codes(st, segment_ids, st.segments)
    aux = (pos, present)
  return st, (u, a, c, r, o, d1, codes, starts), aux


def _finish(st: Static, inputs, ds, aux):
  """(ds, d_{T+1}): the last d one step from the last token's (each segment's, packed)."""
  u, a, c, r, o, *_ = inputs
  if st.segments:
    pos, present = aux
    take = lambda x: None if x is None else x.reshape((-1,) + x.shape[2:])[pos]
    d, uu, aa, cc, rr = (take(x) for x in (ds, u, a, c, r))
  else:
    d, uu, aa, cc, rr = (None if x is None else x[:, -1] for x in (ds, u, a, c, r))
  col = lambda x: None if x is None else x[..., None]
  d_last = om.clip(pre_clip(st, d, uu, col(aa), col(cc), col(rr), o), st.d_min, st.d_max)
  if st.segments:
    d_last = jnp.where(present[:, None, None], d_last, 0.0)
  return ds, d_last


BACKEND = shell.Backend(
    name="pallas tpu", max_key_dim=MAX_KEY_DIM, default_config=default_config,
    interpret_mode=common.default_interpret, reads_keys=lambda config: False, prepare=_prepare,
    forward=_run_forward, forward_saving=_forward_saving, backward=_run_backward, finish=_finish)

d_pass = bind(shell.d_pass, BACKEND, __name__)


def supports(spec: Spec) -> bool:
  """Compiled on "tpu"; fp32 (the d-pass's compute dtype); K ≤ 256; packed or not; η and the bounds static
  numbers."""
  return (spec.platform == "tpu" and spec.dtype == "float32" and 1 <= spec.key_dim <= MAX_KEY_DIM
          and spec.static_params and spec.config_of(Config))
