"""What every TPU kernel family shares: the launch (`pallas_call` with Mosaic compiler parameters, or TPU interpret
mode on a CPU), the TPU generation a program is built for, padding and the in-kernel helpers that Mosaic lowers.

Mosaic's rules that every kernel here keeps: the last two dims of a block are multiples of (8, 128) or the array's
full dims; no cumsum inside a kernel (in-chunk cumsums are computed by XLA before the launch); dots accumulate in
fp32; a state carried across grid steps lives in a VMEM scratch, with the carrying axis innermost and "arbitrary"
(sequential on one core), every other axis "parallel".
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from pallas_kernels import arrays
from pallas_kernels.arrays import pad_axis  # noqa: F401  (re-exported for the kernels' wrappers)

F32 = jnp.float32
LANES = 128                                   # the minor dim of a vreg
SQUEEZED = getattr(pl, "squeezed", None)      # a squeezed block dim (None in older JAX)
# JAX ≤ 0.4.3x called the class TPUCompilerParams.
_COMPILER_PARAMS = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
# TPU interpret mode (a simulated TPU: VMEM, DMAs, semaphores, race detection); older JAX has only the generic
# interpreter (`interpret=True`).
_INTERPRET_PARAMS = getattr(pltpu, "InterpretParams", None)

# device_kind → generation: "TPU v5 lite" is a v5e, "TPU v5" / "TPU v5p" a v5p, "TPU v6 lite" a v6e.
_GENERATIONS = (("v6 lite", "v6e"), ("v6e", "v6e"), ("v5 lite", "v5e"), ("v5e", "v5e"), ("v5p", "v5p"),
                ("v5", "v5p"), ("v4", "v4"))


def generation(device_kind: str | None = None) -> str | None:
  """"v4" | "v5e" | "v5p" | "v6e" for a TPU `device_kind` (default: the first device's, on a TPU backend), else
  None."""
  if device_kind is None:
    if jax.default_backend() != "tpu":
      return None
    device_kind = jax.devices()[0].device_kind
  kind = device_kind.lower()
  return next((gen for key, gen in _GENERATIONS if key in kind), None)


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def default_interpret(interpret):
  """None: interpret on a CPU backend, compile otherwise. Returns False, or what `pl.pallas_call(interpret=...)`
  takes to interpret: `pltpu.InterpretParams(detect_races=True)` where this JAX has TPU interpret mode, else True.
  An `InterpretParams` passes through."""
  interpret = arrays.default_interpret(interpret)
  if interpret is True:
    return interpret_params(detect_races=True)
  return interpret or False


def interpret_mode(interpret: bool):
  """The `interpret` argument of `pallas_call` for a bool: False compiles with Mosaic; True runs TPU interpret mode
  with race detection (`interpret_params`)."""
  return interpret_params(detect_races=True) if interpret else False


def interpret_params(*, detect_races: bool = True, num_cores: int = 1):
  """TPU interpret mode with the race detector (and `num_cores` simulated TensorCores sharing the "parallel"
  grid axes), or True where this JAX has no TPU interpret mode."""
  if _INTERPRET_PARAMS is None:
    return True
  fields = {f.name for f in dataclasses.fields(_INTERPRET_PARAMS)}
  kwargs = {"detect_races": detect_races}
  for name in ("num_cores_or_threads", "num_cores_per_device"):     # the field's name in newer / older JAX
    if name in fields:
      kwargs[name] = num_cores
      break
  return _INTERPRET_PARAMS(**kwargs)


def block_index(*index):
  """An index map's result as int32 scalars: Mosaic rejects the int64 constants that a literal 0 becomes with
  `jax_enable_x64` on."""
  return tuple(jnp.asarray(i, jnp.int32) for i in index)


def pallas_call(kernel, *, grid, in_specs, out_specs, out_shape, scratch_shapes=(), dimension_semantics,
                interpret, name: str, cost_estimate=None, vmem_limit_bytes: int | None = None):
  """`pl.pallas_call` compiled by Mosaic (`interpret` False: `pltpu.CompilerParams` with the grid's dimension
  semantics) or run by the interpreter (`interpret` as `default_interpret` returns)."""
  if len(dimension_semantics) != len(grid):
    raise ValueError(f"{name}: {len(dimension_semantics)} dimension semantics for a grid of {len(grid)} axes")
  params = _COMPILER_PARAMS(dimension_semantics=tuple(dimension_semantics), vmem_limit_bytes=vmem_limit_bytes)
  grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=0, grid=grid, in_specs=in_specs,
                                           out_specs=out_specs, scratch_shapes=list(scratch_shapes))
  return pl.pallas_call(kernel, grid_spec=grid_spec, out_shape=out_shape, interpret=interpret,
                        compiler_params=params, cost_estimate=cost_estimate, name=name)


# ---------------------------------------------------------------------------------------------------------
# In-kernel helpers: iota masks, masked reductions and fp32 dots (what Mosaic lowers without relayouts).
# ---------------------------------------------------------------------------------------------------------
def iota(shape, dim):
  return lax.broadcasted_iota(jnp.int32, shape, dim)


def dot(a, b):
  """a @ b for 2-D fp32 values, full fp32 precision and fp32 accumulation."""
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=(lax.Precision.HIGHEST, lax.Precision.HIGHEST),
                         preferred_element_type=F32)


def masked_exp(diff, mask):
  """exp(diff) where mask else 0, masked before exp (no inf, no 0·inf in gradients)."""
  return jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)


def take(x, index, axis: int):
  """x's row (axis 0) or column (axis 1) `index` (static or traced) as a [1, n] or [n, 1] value: a masked sum,
  which needs no dynamic slice of a vector."""
  return jnp.sum(jnp.where(iota(x.shape, axis) == index, x, 0.0), axis=axis, keepdims=True)
