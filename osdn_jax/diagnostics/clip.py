"""How often OSDN's box clip acts: the d-pass run token by token, each update compared with the bounds before the
clip is applied.

Without the clip the d-recurrence is affine in d (`dgps.precond.osdn_d_pass`),

    d̄_{t+1} = keep_t + (a_t − c_t ⟨d_t, u_t⟩) u_t,   a = ηβ/‖k‖², c = ηβ²/‖k‖²,
    d_{t+1} = clip(d̄_{t+1}, d_min, d_max),

so a chunk-parallel d-pass is exact on every chunk in which no update leaves [d_min, d_max]; a chunk holding one
must be redone serially. Token t's update (d̄_{t+1}) counts in token t's chunk. Shapes as `osdn_d_pass`, unpacked:
u [B, T, G, K], n, beta, retention [B, T, G], d1 [B, G, K], d_init broadcastable to [G, K].
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from osdn_jax.dgps import checks, precond, registry


def d_pass_inputs(point, k, beta, features=None) -> tuple[dict, dict]:
  """The d-pass of OSDN point `point` (a `dgps.Point` with precond "osdn" or "osdn-apf") from d_init, built as its
  write key builds it, on its prepared keys k [B, T, H, K] (normalised, as `Point.prepare` returns them), gains
  beta [B, T, G] and precond features ({"r": [B, T, HV]} for APF): ({u, n, beta, retention, d1, d_init},
  {eta, d_min, d_max, apf_anchor}), the arguments of `clip_trajectory` and `clip_activity` (retention None: r ≡ 1)."""
  if not registry.has_osdn_pass(point):
    raise ValueError(f"d_pass_inputs: point {point.name!r} has no OSDN d-pass (precond "
                     f"{point.axis_name('precond')!r})")
  o = point.opts
  retention = registry.osdn_retention(features or {})
  _, beta, u, n, r, d_init, d1 = precond.osdn_inputs(k, beta, retention, o["d_init"], None)
  arrays = dict(u=u, n=n, beta=beta, retention=r, d1=d1, d_init=d_init)
  return arrays, dict(eta=o["eta"], d_min=o["d_min"], d_max=o["d_max"], apf_anchor=o["apf_anchor"])


def clip_trajectory(u, n, beta, retention, d1, d_init, *, eta, d_min, d_max, apf_anchor):
  """The clipped d-pass and where its clip acted.

  Returns (ds [B, T, G, K] the d token t writes with, d_{T+1} [B, G, K], below and above [B, T, G, K] bool:
  token t's update d̄_{t+1} < d_min, > d_max). A bound of None never acts. ds and d_{T+1} are those of
  `osdn_d_pass(implementation="reference")`.
  """
  checks.apf_anchor_option("clip_trajectory", apf_anchor)
  checks.d_pass("clip_trajectory", eta=eta, d_min=d_min, d_max=d_max)
  outside = lambda bar, bound, side: jnp.zeros(bar.shape, bool) if bound is None else side(bar, bound)

  def body(d, x):
    u_t, n_t, b_t, r_t = x
    bar = precond.osdn_update(d, u_t, n_t, b_t, r_t, d_init, eta=eta, d_min=None, d_max=None, apf_anchor=apf_anchor)
    below, above = outside(bar, d_min, jnp.less), outside(bar, d_max, jnp.greater)
    return precond.bound(bar, d_min, d_max), (d, below, above)

  time_major = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)
  d_last, out = lax.scan(body, d1, tuple(map(time_major, (u, n, beta, retention))))
  ds, below, above = (jnp.moveaxis(x, 0, 1) for x in out)
  return ds, d_last, below, above


def _chunk_any(hit, size: int):
  """hit [B, T, G] bool → [B, ⌈T/size⌉, G]: whether each chunk of `size` tokens (the last one possibly short)
  holds a hit."""
  b, t, g = hit.shape
  pad = -t % size
  hit = jnp.pad(hit, ((0, 0), (0, pad), (0, 0)))
  return jnp.any(hit.reshape(b, (t + pad) // size, size, g), axis=2)


def clip_fractions(ds, below, above, *, d_min, d_max, chunk_sizes=(16, 64, 128)) -> dict:
  """Per head, from `clip_trajectory`'s ds, below, above [B, T, G, K]: the fractions (each [G], over rows, tokens
  and channels) of updates clipped "below" and "above" (and "entries", either), of "tokens" with a clipped
  channel, of "chunks" of C tokens holding a clipped update ({C: [G]}, over rows and chunks), and of d entries at
  each bound ("d_at_min", "d_at_max"; 0 for a bound of None)."""
  for c in chunk_sizes:
    checks.positive_int("clip_fractions", "chunk_sizes", c)
  clipped = below | above
  tokens = jnp.any(clipped, axis=-1)                                      # [B, T, G]
  at = lambda bound: jnp.zeros(ds.shape, bool) if bound is None else ds == bound
  per_head = lambda x: jnp.mean(x, axis=tuple(i for i in range(x.ndim) if i != 2), dtype=jnp.float32)
  return dict(below=per_head(below), above=per_head(above), entries=per_head(clipped), tokens=per_head(tokens),
              chunks={c: per_head(_chunk_any(tokens, c)) for c in chunk_sizes},
              d_at_min=per_head(at(d_min)), d_at_max=per_head(at(d_max)))


def clip_activity(u, n, beta, retention, d1, d_init, *, eta, d_min, d_max, apf_anchor, chunk_sizes=(16, 64, 128)):
  """How often the d-pass's clip acts, per head: `clip_fractions` of `clip_trajectory` (jit-able with the options
  and chunk_sizes static)."""
  ds, _, below, above = clip_trajectory(u, n, beta, retention, d1, d_init, eta=eta, d_min=d_min, d_max=d_max,
                                        apf_anchor=apf_anchor)
  return clip_fractions(ds, below, above, d_min=d_min, d_max=d_max, chunk_sizes=chunk_sizes)
