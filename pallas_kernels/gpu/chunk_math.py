"""In-kernel building blocks (Triton-lowerable register math) shared by every kernel: `dot`, `iota`,
`accumulate`, `masked_exp`, `take_col`, `row_scale`, `last_row`. The chunk math of the kernels (decayed pair products,
T = (I + A)⁻¹) is in `intra.py`.

Everything here uses only iota masks, `jnp.where`, reductions, elementwise math and 2-D dots with every dim
≥ 16 and fp32 accumulation (the Triton lowering has no slice or in-place update of register values).
"""
from __future__ import annotations

import contextlib

import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
BF16 = jnp.bfloat16
_HI = lax.Precision.HIGHEST


def iota(shape, dim):
  return lax.broadcasted_iota(jnp.int32, shape, dim)


# How fp32 dots run: "ieee" (HIGHEST: IEEE fp32 in Triton, on the FMA units), "tf32x3" (three TF32
# tensor-core products with the split a = a_tf32 + a_small, about fp32 accuracy) or "tf32" (one TF32 product:
# operands rounded to 10-bit mantissas, as FLA's Triton dots; only for bf16 inputs by default). Set per kernel
# body by `config.pallas_call`.
_FP32_DOTS = {"ieee": (_HI, _HI), "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
              "tf32": lax.DotAlgorithmPreset.TF32_TF32_F32}
_fp32_dots = ["ieee"]


@contextlib.contextmanager
def fp32_dots(mode: str):
  """Within the block, `dot` of fp32 operands runs as `mode` ("ieee" | "tf32x3" | "tf32")."""
  if mode not in _FP32_DOTS:
    raise ValueError(f"fp32_dots={mode!r} must be one of {sorted(_FP32_DOTS)}")
  _fp32_dots.append(mode)
  try:
    yield
  finally:
    _fp32_dots.pop()


def dot(a, b, *, ta: bool = False, tb: bool = False):
  """a @ b (aᵀ / bᵀ when ta / tb) with fp32 accumulation.

  Two bf16 operands multiply in bf16 (products are exact in fp32); anything else runs in fp32 as the
  enclosing `fp32_dots` says (IEEE by default).
  """
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  if a.dtype == BF16 and b.dtype == BF16:
    return lax.dot_general(a, b, dims, precision=(_HI, _HI), preferred_element_type=F32)
  a, b = a.astype(F32), b.astype(F32)
  return lax.dot_general(a, b, dims, precision=_FP32_DOTS[_fp32_dots[-1]], preferred_element_type=F32)


def accumulate(acc, x):
  """acc + x, or x when acc is None (the first term of a sum built in a Python loop)."""
  return x if acc is None else acc + x


def masked_exp(diff, mask):
  """exp(diff) where mask else 0, masked before exp (no inf, no 0·inf in gradients)."""
  return jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)


def take_col(x, j):
  return jnp.sum(jnp.where(iota(x.shape, 1) == j, x, 0.0), axis=1)


def last_row(x):
  """The last row of a [s] (→ scalar) or [s, K] (→ [K]) register value."""
  return jnp.sum(jnp.where(iota(x.shape, 0) == x.shape[0] - 1, x, 0.0), axis=0)


def row_scale(x, f):
  """x [s, K] times a per-row ([s]) or per-element ([s, K]) factor; f None means 1."""
  if f is None:
    return x
  return x * (f[:, None] if f.ndim == 1 else f)
