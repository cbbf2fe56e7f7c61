"""OSDN's guarded write key in one pass, k̃ = guard(d ⊙ k) from the d-pass's ds: forward and backward kernels, and
what this backend supplies to the shell (`pallas_kernels.guard_shell`: the row math, the entry point, its checks and
custom_vjp; `write_key` is the shell's bound to `BACKEND`).

In plain JAX the row sum s = β ⟨k, d ⊙ k⟩ is one fusion and the scaled write another, each reading d (fp32) and k;
here one program reads a block of rows once and writes k̃. The backward kernel reads ∂k̃, d and k once and writes
∂d (fp32), ∂k (in k's dtype) and ∂β (w = d ⊙ k, m the guard's scale):
    ∂m = ⟨∂k̃, w⟩,   ∂s = ∂m · m'(s),   ∂w = m ∂k̃ + ∂s β k,   ∂d = ∂w ⊙ k,   ∂k = ∂w ⊙ d + ∂s β w,   ∂β = ∂s ⟨k, w⟩,
with ∂k̃ zeroed on the NaN rows and m'(s) as `jnp.minimum` / `jnp.maximum` differentiate (½ at a tie). The
products are formed in the order autodiff forms them, so the kernels' gradients are plain JAX's to rounding and
NaN where its are (a key whose square overflows: 0 · 1e20 · 1e20 is 0, 0 · (1e20)² would be NaN).

Layout (`prepare`, undone by `finish`): [B, T, G, K] viewed as rows [N, K] (N = B·T·G, no copy), blocks of
R = `Config.guard_rows` rows (fewer when N is smaller) and all K; N is padded to a multiple of R and K to a power of
two ≥ 16 only where they are not already (a copy then); β and n as [N]. The backward reads the inputs only.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import guard_shell as shell
from pallas_kernels.gpu.common import default_interpret, pad_axis, padded_dim, pallas_call
from pallas_kernels.gpu.osdn.config import Config, default_config
from pallas_kernels.gpu.osdn.loops import F32
from pallas_kernels.shells import bind

_FLOOR = 1e-12                          # the guard's floor on s (`apply_guard`)


def _rows_block(rows: int, most: int) -> int:
  """Rows per program: `most`, or the power of two ≥ rows when there are fewer."""
  r = 1
  while r < min(rows, most):
    r *= 2
  return r


def _scale(guard, b, d, k):
  """(w, ⟨d, u⟩, s, m) of a block: w = d ⊙ k [R, K]; [R] the rest."""
  w = d * k
  t = jnp.sum(w * k, axis=1)
  s = b * t
  return w, t, s, jnp.minimum(1.0, guard / jnp.maximum(s, _FLOOR))


def _forward_kernel(guard, ds_ref, k_ref, b_ref, n_ref, out_ref):
  w, _, _, m = _scale(guard, b_ref[...], ds_ref[...], k_ref[...].astype(F32))
  finite = n_ref[...] < jnp.inf                  # False for NaN and +inf (n ≥ 1e-12 otherwise)
  out_ref[...] = jnp.where(finite[:, None], w * m[:, None], jnp.nan).astype(out_ref.dtype)


def _backward_kernel(guard, g_ref, ds_ref, k_ref, b_ref, n_ref, dd_ref, dk_ref, db_ref):
  d, k, b = ds_ref[...], k_ref[...].astype(F32), b_ref[...]
  finite = n_ref[...] < jnp.inf
  g = jnp.where(finite[:, None], g_ref[...].astype(F32), 0.0)
  w, t, s, m = _scale(guard, b, d, k)
  x = jnp.maximum(s, _FLOOR)
  y = guard / x
  dm_dy = jnp.where(y < 1.0, 1.0, jnp.where(y == 1.0, 0.5, 0.0))
  dx_ds = jnp.where(s > _FLOOR, 1.0, jnp.where(s == _FLOOR, 0.5, 0.0))
  # −((∂y · x⁻²) · γ), autodiff's order: γ / x² alone overflows for a large γ at the floor x = 1e-12
  gs = -((jnp.sum(g * w, axis=1) * dm_dy * (1.0 / (x * x))) * guard) * dx_ds
  gsb = (gs * b)[:, None]
  gw = g * m[:, None] + gsb * k          # ∂w, from k̃ = m w and from s = β ⟨k, w⟩ (products in autodiff's order)
  dd_ref[...] = gw * k
  dk_ref[...] = (gw * d + gsb * w).astype(dk_ref.dtype)
  db_ref[...] = gs * t


def _call(kernel, guard, config, interpret, args, outs, name):
  rows, kp = args[0].shape
  r = _rows_block(rows, config.guard_rows)
  assert rows % r == 0, (rows, r)        # `_prepare` pads the rows
  tile = pl.BlockSpec((r, kp), lambda i: (i, 0))
  vec = pl.BlockSpec((r,), lambda i: (i,))
  specs = [tile if x.ndim == 2 else vec for x in args]
  out_specs = [tile if len(o.shape) == 2 else vec for o in outs]
  return pallas_call(functools.partial(kernel, guard), grid=(rows // r,), in_specs=specs,
                     out_specs=out_specs if len(outs) > 1 else out_specs[0],
                     out_shape=outs if len(outs) > 1 else outs[0], interpret=interpret,
                     num_warps=config.warps_guard, num_stages=1, name=name)(*args)


@dataclasses.dataclass(frozen=True)
class Static:
  """The kernels' static arguments: γ, the d-pass's config (its guard fields), interpret."""
  guard: float
  config: Config
  interpret: bool


def _prepare(guard: float, config: Config, interpret: bool, ds, k, beta, n):
  """Rows [N', Kp] of ds (fp32) and k, and [N'] of β and n (fp32), padded: zero d, k and β, n = 1 (a finite,
  unguarded row)."""
  b, t, g, kd = ds.shape
  kp = padded_dim(kd)
  rows = b * t * g
  r = _rows_block(rows, config.guard_rows)
  rp = -(-rows // r) * r
  flat = lambda x: pad_axis(pad_axis(x.reshape(rows, kd), 1, kp), 0, rp)
  vec = lambda x, fill: jnp.pad(jnp.asarray(x, F32).reshape(rows), (0, rp - rows), constant_values=fill)
  inputs = (flat(jnp.asarray(ds, F32)), flat(k), vec(beta, 0.0), vec(n, 1.0))
  return Static(guard, config, interpret), inputs, ds.shape


def _forward(st: Static, inputs):
  ds, k, beta, n = inputs
  out = jax.ShapeDtypeStruct(k.shape, k.dtype)
  return _call(_forward_kernel, st.guard, st.config, st.interpret, (ds, k, beta, n), [out], "osdn_guard_fwd")


def _forward_saving(st: Static, inputs):
  return _forward(st, inputs), ()


def _backward(st: Static, inputs, saved, g):
  del saved
  ds, k, beta, n = inputs
  outs = [jax.ShapeDtypeStruct(ds.shape, F32), jax.ShapeDtypeStruct(k.shape, k.dtype),
          jax.ShapeDtypeStruct(beta.shape, F32)]
  dd, dk, db = _call(_backward_kernel, st.guard, st.config, st.interpret, (g, ds, k, beta, n), outs,
                     "osdn_guard_bwd")
  return dd, dk, db, jnp.zeros_like(n)


def _finish(st: Static, inputs, y, shape):
  b, t, g, kd = shape
  return y[:b * t * g, :kd].reshape(shape)


BACKEND = shell.Backend(name="pallas gpu", default_config=default_config, interpret_mode=default_interpret,
                        prepare=_prepare, forward=_forward, forward_saving=_forward_saving, backward=_backward,
                        finish=_finish)

write_key = bind(shell.write_key, BACKEND, __name__)


def supports_write_key(spec) -> bool:
  """Compiled on "gpu", interpret mode on "cpu"; keys in fp32, bf16 or fp16 with K ≤ 256; a static guard; and
  `Config.fused_guard` in the request's d-pass config (this family's; None: `default_config`)."""
  if not spec.config_of(Config):
    return False
  config = spec.config or default_config(spec, "interpret" if spec.platform == "cpu" else None)
  return (spec.platform in ("gpu", "cpu") and spec.dtype in ("float32", "bfloat16", "float16")
          and spec.key_dim <= 256 and spec.static_params and config.fused_guard)
