"""OSDN's d-pass as a Pallas GPU kernel pair: what this backend supplies to the shell (`pallas_kernels.d_pass_shell`:
the entry point, checks, defaults and custom_vjp; the recurrence in its docstring).

⟨d, u⟩ couples all K channels, so d [K] of one head lives in one program's registers (one warp up to K = 128):
the kernels run one program per (batch, head) over the whole sequence (`forward.py`, `backward.py`). Where the
clip does not act inside a block of L tokens (unpacked), the block is the unclipped rank-one recurrence, whose
L × L unit triangular systems depend on the inputs only: `tables.py` forms their inverses for every block at
once, and the kernels advance one block per step (`blocks.py`). The forward's serial kernel computes only the d
entering each block, and a parallel one forms the blocks' rows and checks the clip; from a (batch, head)'s first
block where the check fails, the sequential kernel takes over, token by token through the blocks where the clip
acts (`forward.py`). Results are those of the token-serial recurrence, up to block rounding, whatever the gates.
The kernels form both results, ds and d_{T+1}: `prepare` pads K (to a power of two ≥ 16; padded channels have
u = 0, never reach ⟨d, u⟩ and are sliced off by `finish`) and builds the packed codes.

Packed sequences: one int32 code per token (segment, first, last): d restarts from d1[segment] at a first token
and the segment's d_{T+1} is stored at its last; in reverse, λ restarts from the segment's d_{T+1} cotangent at a
last token and ∂d1[segment] is stored at a first. Segments never span rows, so the (batch, head) programs write
disjoint rows of the per-segment arrays; rows of segments without tokens are neither read nor written (zeros).

Given the keys (`d_pass(keys=k)`, as `osdn_jax.dgps.precond.osdn_write_key` passes them) and `Config.read_keys`,
the kernels read k in its own dtype and form u = k ⊙ k in fp32 where they load it (`layout.u_of`), so u is never
stored; k's cotangent is 2 k ⊙ ∂u. Under autodiff the forward saves ds, its block flags and tables (and the
smoothed d where it forms one), named for rematerialisation. The write key k̃ = guard(d ⊙ k) is `guard.write_key`,
a kernel of its own (op "osdn_guard"). fp32 throughout.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import d_pass_shell as shell
from pallas_kernels.gpu.common import default_interpret, pad_axis, padded_dim, segment_starts
from pallas_kernels.gpu.osdn import backward as _backward
from pallas_kernels.gpu.osdn import forward as _forward
from pallas_kernels.gpu.osdn.config import Config, default_config
from pallas_kernels.gpu.osdn.layout import Static
from pallas_kernels.gpu.osdn.loops import F32
from pallas_kernels.shells import bind
from pallas_kernels.spec import Spec

MAX_KEY_DIM = 256                        # d [K] stays in registers


def _segment_codes(segments, count: int):
  """[B, T] int32 codes (segment << 2 | last token << 1 | first token; segments past `count` clamped) and
  present [count] bool (the segment has tokens), from segment numbers [B, T]."""
  first = segment_starts(segments)
  last = jnp.concatenate([first[:, 1:], jnp.ones(first.shape[:1] + (1,), bool)], axis=1)
  seg = jnp.minimum(segments.astype(jnp.int32), count - 1)
  present = jnp.zeros((count,), bool).at[seg].set(True)
  return (seg << 2) | (last.astype(jnp.int32) << 1) | first.astype(jnp.int32), present


def _prepare(call: shell.Call, config: Config, interpret: bool, u, keys, n, beta, r, d1, o, segment_ids):
  """K padded; packed: the per-token codes, and d1 zero on the rows of segments without tokens."""
  squared = keys is not None
  kp = padded_dim(call.key_dim)
  st = Static(batch=call.batch, length=call.length, heads=call.heads, key_dim=kp, channels=call.key_dim,
              eta=call.eta, d_min=call.d_min, d_max=call.d_max, mode=call.mode, config=config,
              interpret=interpret, segments=call.segments, squared=squared)
  u, d1 = pad_axis(keys if squared else u, 3, kp), pad_axis(d1, 2, kp)
  o = None if o is None else pad_axis(o, 1, kp)
  codes = present = None
  if call.segments:
    codes, present = _segment_codes(segment_ids, call.segments)
    d1 = jnp.where(present[:, None, None], d1, 0.0)
  return st, (u, n, beta, r, codes, d1, o), present


def _run_forward(st: Static, inputs):
  return tuple(_forward.forward(st, *inputs)[1][:2])


def _forward_saving(st: Static, inputs):
  saved, (ds, d_last, *smooth) = _forward.forward(st, *inputs, differentiated=True)
  return (ds, d_last), (ds, smooth[0] if smooth else None, saved)


def _run_backward(st: Static, inputs, saved, cts):
  u, n, beta, r, codes, _, o = inputs
  ds, smooth, saved = saved
  g_ds, g_last = cts
  du, dn, dbeta, dr, dd1, do = _backward.backward(st, u, n, beta, r, codes, o, ds, smooth, saved, g_ds, g_last)
  if st.squared:                          # u holds the keys k: ∂k = 2 k ⊙ ∂u
    du = (2.0 * u.astype(F32) * du).astype(u.dtype)
  return du, dn, dbeta, dr, None, dd1, do


def _finish(st: Static, inputs, outputs, present):
  ds, d_last = outputs
  if present is not None:
    d_last = jnp.where(present[:, None, None], d_last, 0.0)
  return ds[..., :st.channels], d_last[..., :st.channels]


BACKEND = shell.Backend(
    name="pallas gpu", max_key_dim=MAX_KEY_DIM, default_config=default_config, interpret_mode=default_interpret,
    reads_keys=lambda config: config.read_keys, prepare=_prepare, forward=_run_forward,
    forward_saving=_forward_saving, backward=_run_backward, finish=_finish)

d_pass = bind(shell.d_pass, BACKEND, __name__)


def supports(spec: Spec) -> bool:
  """Compiled on "gpu", interpret mode on "cpu"; fp32 (the d-pass's compute dtype for fp32 and bf16 keys),
  K ≤ 256, packed or not; the clip's bounds and η static numbers; a config, when the request carries one, of this
  family."""
  return (spec.platform in ("gpu", "cpu")
          and spec.dtype == "float32"
          and 1 <= spec.key_dim <= MAX_KEY_DIM
          and spec.static_params
          and spec.config_of(Config))
