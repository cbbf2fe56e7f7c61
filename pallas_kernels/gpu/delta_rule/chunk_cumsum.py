"""The in-chunk cumsum of per-channel log-decays, G = cumsum_chunk(max(g, floor)), as a Pallas kernel pair.

    G[b, t, h, :] = Σ_{s = c·C … t} max(g[b, s, h, :], floor)        (c·C ≤ t < (c + 1)·C)

Forward and backward (a `jax.custom_vjp`) are one memory-bound pass each over [B, T, HV, K], grid
(B, NC, HV, K/BK): the forward reads g in its own dtype and writes G in fp32; the backward writes
dg = (reverse in-chunk cumsum of dG) ⊙ ∂max(g, floor)/∂g in g's dtype. The floor's derivative is JAX's for
`jnp.maximum`: 1 above, 0 below, ½ at the floor.
XLA fuses neither pass with its neighbours (on a GPU its cumsum is a reduce-window, and the reverse pass and the
floor's mask are two more fusions); here each direction is one pass.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gpu.chunk_math import F32
from pallas_kernels.gpu.common import SQUEEZED as _SQ
from pallas_kernels.gpu.common import pallas_call
BLOCK_K = 128          # K columns per program (a [C, 128] fp32 tile)
WARPS = 4


def _spec(chunk, bk):
  return pl.BlockSpec((_SQ, chunk, _SQ, bk), lambda b, c, h, ik: (b, c, h, ik))


def _launch(kernel, name, chunk, out_dtype, interpret, *args):
  b, t, hv, kd = args[0].shape
  bk = min(BLOCK_K, kd)
  return pallas_call(kernel, grid=(b, t // chunk, hv, kd // bk), in_specs=[_spec(chunk, bk)] * len(args),
                     out_specs=_spec(chunk, bk), out_shape=jax.ShapeDtypeStruct(args[0].shape, out_dtype),
                     interpret=interpret, num_warps=WARPS, num_stages=1, name=name)(*args)


def _floor_grad(g, floor):
  return jnp.where(g > floor, 1.0, jnp.where(g == floor, 0.5, 0.0))


def _fwd_kernel(floor, g_ref, G_ref):
  g = g_ref[...].astype(F32)
  G_ref[...] = jnp.cumsum(jnp.where(g < floor, floor, g), axis=0)    # a NaN stays NaN (Triton's max drops it)


def _bwd_kernel(floor, g_ref, dG_ref, dg_ref):
  dG = dG_ref[...].astype(F32)
  # Σ_{s ≥ t} dG_s as the chunk total minus the exclusive prefix (Triton's scan runs forward only).
  rev = jnp.sum(dG, axis=0)[None, :] - jnp.cumsum(dG, axis=0) + dG
  dg_ref[...] = (rev * _floor_grad(g_ref[...].astype(F32), floor)).astype(dg_ref.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _cumsum(g, chunk, floor, interpret):
  return _launch(functools.partial(_fwd_kernel, floor), "chunk_cumsum", chunk, F32, interpret, g)


def _cumsum_fwd(g, chunk, floor, interpret):
  return _cumsum(g, chunk, floor, interpret), g


def _cumsum_bwd(chunk, floor, interpret, g, dG):
  return (_launch(functools.partial(_bwd_kernel, floor), "chunk_cumsum_bwd", chunk, g.dtype, interpret, g, dG),)


_cumsum.defvjp(_cumsum_fwd, _cumsum_bwd)


def chunk_cumsum(g, chunk: int, floor: float, *, interpret: bool):
  """g [B, T, HV, K] (T a multiple of chunk, K a power of two ≥ 16; any float dtype) → G [B, T, HV, K] fp32,
  differentiable in g."""
  b, t, hv, kd = g.shape
  if t % chunk or kd < 16 or kd & (kd - 1):
    raise ValueError(f"chunk_cumsum: g [B, T, HV, K] needs T a multiple of {chunk} and K a power of two ≥ 16, "
                     f"got {g.shape}")
  return _cumsum(g, chunk, float(floor), bool(interpret))
