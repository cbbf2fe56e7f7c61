"""OSDN's sequential d-pass as a Pallas GPU kernel pair: the entry point and its `jax.custom_vjp`.

The recurrence (one (batch, head) row; u_t = k_t ⊙ k_t, n_t = max(‖k_t‖², 1e-12), s_t = ⟨d_t, u_t⟩):
    coef_t = η β_t (1 − β_t s_t) / n_t
    d̄_{t+1} = keep_t + coef_t u_t,   keep_t = d_t (r ≡ 1) | r_t d_t (anchor "zero") | o + r_t (d_t − o) ("init")
    d_{t+1} = clip(d̄_{t+1}, d_min, d_max)                                            (o = d_init [G, K])
Token t writes with d_t; the results are ds = (d_1 … d_T) [B, T, G, K] and d_{T+1} [B, G, K]. The contract is
`osdn_jax.dgps.precond.osdn_d_pass(implementation="reference")`, the token-serial `lax.scan`.

⟨d, u⟩ couples all K channels, so d [K] of one head lives in one program's registers (one warp up to K = 128):
the kernels run one program per (batch, head) over the whole sequence (`forward.py`, `backward.py`). Where the
clip does not act inside a block of L tokens (unpacked), the block is the unclipped rank-one recurrence, whose
L × L unit triangular systems depend on the inputs only: `tables.py` forms their inverses for every block at
once, and the kernels advance one block per step (`blocks.py`). The forward's serial kernel computes only the d
entering each block, and a parallel one forms the blocks' rows and checks the clip; from a (batch, head)'s first
block where the check fails, the sequential kernel takes over, token by token through the blocks where the clip
acts (`forward.py`). Results are those of the token-serial recurrence, up to block rounding, whatever the gates.

Packed sequences: one int32 code per token (segment, first, last): d restarts from d1[segment] at a first token
and the segment's d_{T+1} is stored at its last; in reverse, λ restarts from the segment's d_{T+1} cotangent at a
last token and ∂d1[segment] is stored at a first. Segments never span rows, so the (batch, head) programs write
disjoint rows of the per-segment arrays.

Given the keys (`d_pass(keys=k)`, as `osdn_jax.dgps.precond.osdn_write_key` passes them), the kernels read k in
its own dtype and form u = k ⊙ k in fp32 where they load it (`layout.u_of`), so u is never stored; k's cotangent
is 2 k ⊙ ∂u. The write key k̃ = guard(d ⊙ k) is `guard.write_key`, a kernel of its own (op "osdn_guard").
fp32 throughout.
"""
from __future__ import annotations

import functools

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from pallas_kernels.arrays import device_kind
from pallas_kernels.gpu.common import default_interpret, pad_axis, padded_dim, segment_starts
from pallas_kernels.gpu.osdn import backward, forward
from pallas_kernels.gpu.osdn.config import Config, default_config
from pallas_kernels.gpu.osdn.layout import Static
from pallas_kernels.gpu.osdn.loops import F32
from pallas_kernels.osdn_shell import check_d_pass
from pallas_kernels.spec import Spec

MAX_KEY_DIM = 256                        # d [K] stays in registers


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _d_pass(st: Static, u, n, beta, r, codes, d1, o):
  return tuple(forward.forward(st, u, n, beta, r, codes, d1, o)[1][:2])


def _d_pass_fwd(st, u, n, beta, r, codes, d1, o):
  saved, (ds, d_last, *smooth) = forward.forward(st, u, n, beta, r, codes, d1, o, differentiated=True)
  # Named for rematerialisation policies: with these saved, a block's backward does not rerun the kernels.
  saved, ds, smooth = jax.tree.map(lambda x: checkpoint_name(x, "precond_pass"), (saved, ds, smooth))
  return (ds, d_last), (u, n, beta, r, codes, o, ds, smooth[0] if smooth else None, saved)


def _d_pass_bwd(st, res, cts):
  u, n, beta, r, codes, o, ds, smooth, saved = res
  g_ds, g_last = cts
  du, dn, dbeta, dr, dd1, do = backward.backward(st, u, n, beta, r, codes, o, ds, smooth, saved, g_ds, g_last)
  if st.squared:                          # u holds the keys k: ∂k = 2 k ⊙ ∂u
    du = (2.0 * u.astype(F32) * du).astype(u.dtype)
  return du, dn, dbeta, dr, None, dd1, do


_d_pass.defvjp(_d_pass_fwd, _d_pass_bwd)


def _segment_codes(segments, count: int):
  """[B, T] int32 codes (segment << 2 | last token << 1 | first token; segments past `count` clamped) and
  present [count] bool (the segment has tokens), from segment numbers [B, T]."""
  first = segment_starts(segments)
  last = jnp.concatenate([first[:, 1:], jnp.ones(first.shape[:1] + (1,), bool)], axis=1)
  seg = jnp.minimum(segments.astype(jnp.int32), count - 1)
  present = jnp.zeros((count,), bool).at[seg].set(True)
  return (seg << 2) | (last.astype(jnp.int32) << 1) | first.astype(jnp.int32), present


@functools.partial(jax.jit, static_argnames=("eta", "d_min", "d_max", "mode", "config", "interpret"))
def _run(u, n, beta, r, d1, d_init, segment_ids, keys, *, eta, d_min, d_max, mode, config, interpret):
  if keys is not None and not config.read_keys:
    u, keys = jnp.square(jnp.asarray(keys, F32)), None
  squared = keys is not None
  b, t, g, kd = (keys if squared else u).shape
  kp = padded_dim(kd)
  count = d1.shape[0] if segment_ids is not None else 0
  st = Static(batch=b, length=t, heads=g, key_dim=kp, channels=kd, eta=eta, d_min=d_min, d_max=d_max, mode=mode,
              config=config, interpret=interpret, segments=count, squared=squared)
  f32 = lambda x: None if x is None else jnp.asarray(x, F32)
  # Padded channels have u = 0: they never reach ⟨d, u⟩, and their d is sliced off. With keys, the kernels read
  # k in its own dtype and square it where they load it.
  u, d1 = pad_axis(keys if squared else f32(u), 3, kp), pad_axis(f32(d1), 2, kp)
  o = pad_axis(jnp.broadcast_to(f32(d_init), (g, kd)), 1, kp) if mode == "init" else None
  codes, present = None, None
  if count:      # rows of segments without tokens are neither read nor written by the kernels: zeros
    codes, present = _segment_codes(segment_ids, count)
    d1 = jnp.where(present[:, None, None], d1, 0.0)
  ds, d_last = _d_pass(st, u, f32(n), f32(beta), f32(r) if mode != "none" else None, codes, d1, o)
  if count:
    d_last = jnp.where(present[:, None, None], d_last, 0.0)
  return ds[..., :kd], d_last[..., :kd]


def d_pass(u, n, beta, retention, d1, d_init, *, eta, d_min, d_max, apf_anchor, segment_ids=None, keys=None,
           config: Config | None = None, interpret: bool | None = None):
  """OSDN's sequential d-pass with the Pallas kernels (Triton on GPU, interpret mode on CPU).

  The signature and results of `osdn_jax.dgps.precond.osdn_d_pass`:
    u [B, T, G, K] (k ⊙ k), n [B, T, G] (max(‖k‖², 1e-12)), beta [B, T, G], retention None (r ≡ 1) or
    [B, T, G], d1 [B, G, K] (the d of token 1), d_init [G, K] (or broadcastable; used by anchor "init" with
    a retention); eta, d_min, d_max static numbers (bounds None: unbounded); anchor "zero" | "init".
  Returns (ds [B, T, G, K], d_{T+1} [B, G, K]), fp32. Differentiable w.r.t. u, n, beta, retention, d1 and
  d_init (zero gradient through clipped entries). Packed: `segment_ids` [B, T] are segment numbers 0..N−1 in
  row-major order (`osdn_jax.ops.packing.segment_index`), d1 is [N, G, K], d restarts from d1[n] at segment
  n's first token, and the second result is each segment's last d [N, G, K] (zeros for segments without tokens).
  keys: None, or the keys [B, T, G, K] (a float dtype) with u = k ⊙ k in fp32: the kernels then read k and form
  u where they load it (u is never stored, and bf16 keys are read in half the bytes); `u` may be None, and the
  first cotangent is k's.
  `interpret` defaults to True on a CPU backend; `config` to `default_config` (INTERPRET in interpret mode).
  """
  call = check_d_pass("osdn d_pass (pallas gpu)", u, n, beta, retention, d1, d_init, eta=eta, d_min=d_min,
                      d_max=d_max, apf_anchor=apf_anchor, segment_ids=segment_ids, keys=keys,
                      max_key_dim=MAX_KEY_DIM)
  interpret = default_interpret(interpret)
  config = config or default_config(None, device_kind(interpret))
  return _run(None if keys is not None else u, n, beta, retention, d1, jnp.asarray(d_init), segment_ids, keys,
              eta=call.eta, d_min=call.d_min, d_max=call.d_max, mode=call.mode, config=config, interpret=interpret)


def supports(spec: Spec) -> bool:
  """Compiled on "gpu", interpret mode on "cpu"; fp32 (the d-pass's compute dtype for fp32 and bf16 keys),
  K ≤ 256, packed or not; the clip's bounds and η static numbers; a config, when the request carries one, of this
  family."""
  return (spec.platform in ("gpu", "cpu")
          and spec.dtype == "float32"
          and 1 <= spec.key_dim <= MAX_KEY_DIM
          and spec.static_params
          and spec.config_of(Config))
