"""Block sizes and launch parameters of the GPU delta-rule kernels, and the JAX-version guards.

Every kernel is launched through `pl.pallas_call` with `pltriton.CompilerParams` given explicitly: in JAX
0.11 a bare `pallas_call` on GPU goes to Mosaic GPU, and these kernels are written for the Triton lowering. On
a CPU backend the same kernels run with `interpret=True` (the compiler parameters are then ignored).
"""
from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# JAX ≤ 0.4.3x called the class TritonCompilerParams; 0.10 and 0.11 call it CompilerParams.
_TRITON_PARAMS = getattr(pltriton, "CompilerParams", None) or getattr(pltriton, "TritonCompilerParams")

MAX_DIM = 256                 # largest supported K and V (after padding to a power of two)
CHUNK_SIZES = (16, 32, 64, 128)


def _pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


def padded_dim(d: int) -> int:
  """The power of two ≥ max(d, 16) that K or V is padded to (Triton dots need every dim ≥ 16)."""
  p = 16
  while p < d:
    p *= 2
  return p


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes and launch parameters. They change speed, not numerics (up to fp32 summation order).

  sub:          rows of the forward-substitution blocks of (I + A)⁻¹ and of the per-channel sub-blocks
                (pairwise exponents on the diagonal ones); divides the chunk.
  block_v_state: V columns per program of the two sequential state passes (forward and reverse).
  block_v_out:  V columns per program of the output kernel and of the local-dv kernel.
  block_v_grad: V columns per step of the V loops of the gradient kernels (`grads_state`, `grads_intra`).
  block_k_grad: K columns per program of `grads_state` and of the per-channel `grads_pairs`, and per step of
                the K loop of `grads_intra` (decay none / scalar).
  block_k_diag: K columns per step of the per-channel diagonal sub-blocks, computed as [sub, sub, block_k_diag]
                pairwise tensors (larger: fewer steps, more registers).
  warps_*:      Triton num_warps of the chunk-parallel forward kernels (chunk), of `prep` (prep), of the state
                passes (state), of `grads_state` (grad_state) and of `grads_intra` / `grads_pairs` (grad).
  stages:       Triton num_stages (software pipelining of the loops).
  """
  sub: int = 16
  block_v_state: int = 64
  block_v_out: int = 128
  block_v_grad: int = 64
  block_k_grad: int = 64
  block_k_diag: int = 16
  warps_chunk: int = 4
  warps_prep: int = 4
  warps_state: int = 4
  warps_grad_state: int = 4
  warps_grad: int = 8
  stages: int = 2

  _POW2 = ("sub", "block_v_state", "block_v_out", "block_v_grad", "block_k_grad", "block_k_diag",
           "warps_chunk", "warps_prep", "warps_state", "warps_grad_state", "warps_grad")

  def __post_init__(self):
    for name in self._POW2:
      value = getattr(self, name)
      if not _pow2(value):
        raise ValueError(f"BlockSizes.{name}={value} must be a power of two")
    if self.sub not in (16, 32):
      raise ValueError(f"BlockSizes.sub={self.sub} must be 16 or 32 (Triton dots need dims ≥ 16)")
    for name in ("block_v_state", "block_v_out", "block_v_grad", "block_k_grad", "block_k_diag"):
      if not 16 <= getattr(self, name) <= MAX_DIM:
        raise ValueError(f"BlockSizes.{name}={getattr(self, name)} must be in [16, {MAX_DIM}]")
    if self.block_k_diag > 64:
      raise ValueError(f"BlockSizes.block_k_diag={self.block_k_diag} must be ≤ 64 (registers)")
    if self.stages < 1:
      raise ValueError(f"BlockSizes.stages={self.stages} must be ≥ 1")

  def check(self, chunk: int) -> None:
    if chunk not in CHUNK_SIZES:
      raise ValueError(f"chunk_size={chunk} must be one of {CHUNK_SIZES}")
    if chunk % self.sub:
      raise ValueError(f"BlockSizes.sub={self.sub} must divide chunk_size={chunk}")

  def v_block(self, name: str, vdim: int) -> int:
    """The V block of kernel family `name` ("state" | "out" | "grad") for padded V = vdim."""
    return min(getattr(self, f"block_v_{name}"), vdim)

  def k_block(self, name: str, kdim: int) -> int:
    """The K block of kernel family `name` ("grad" | "diag") for padded K = kdim."""
    return min(getattr(self, f"block_k_{name}"), kdim)


DEFAULT_BLOCKS = BlockSizes()


def compiler_params(num_warps: int, num_stages: int):
  return _TRITON_PARAMS(num_warps=num_warps, num_stages=num_stages)


def pallas_call(kernel, *, grid, in_specs, out_specs, out_shape, interpret: bool, num_warps: int,
                num_stages: int, name: str):
  """`pl.pallas_call` for the Triton lowering (explicit compiler params) or the CPU interpreter."""
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                        interpret=interpret, compiler_params=compiler_params(num_warps, num_stages),
                        name=name)
