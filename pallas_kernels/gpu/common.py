"""What every GPU kernel family shares: the launch (`pallas_call` with Triton compiler parameters), the
JAX-version guards, padding, and unpacking a kernel's flat list of refs.

Every kernel is launched with `pltriton.CompilerParams` given explicitly: in JAX 0.11 a bare `pallas_call` on
GPU goes to Mosaic GPU, and these kernels are written for the Triton lowering. On a CPU backend the same kernels
run with `interpret=True` (the compiler parameters are then ignored).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.gpu import chunk_math
from pallas_kernels.spec import next_pow2
from pallas_kernels import arrays
from pallas_kernels.arrays import pad_axis  # noqa: F401  (re-exported for the kernels' wrappers)

# JAX ≤ 0.4.3x called the class TritonCompilerParams; 0.10 and 0.11 call it CompilerParams.
_TRITON_PARAMS = getattr(pltriton, "CompilerParams", None) or getattr(pltriton, "TritonCompilerParams")
SQUEEZED = getattr(pl, "squeezed", None)      # a squeezed block dim (None in older JAX)
MAX_DIM = 256                                 # largest K and V (after padding) whose tiles the kernels hold


def padded_dim(d: int) -> int:
  """The power of two ≥ max(d, 16) that K or V is padded to (Triton dots need every dim ≥ 16)."""
  return next_pow2(d, 16)


def default_interpret(interpret: bool | None) -> bool:
  """interpret None: True on a CPU backend (the kernels then run in Pallas' interpreter); else bool(interpret)."""
  return bool(arrays.default_interpret(interpret))


def segment_starts(segments):
  """[B, T] bool: True at every segment's first token, for segment numbers [B, T] (packed sequences: the
  kernels take segment numbers 0..N−1 in row-major order, `osdn_jax.ops.packing.segment_index`)."""
  first = jnp.ones(segments.shape[:1] + (1,), bool)
  return jnp.concatenate([first, segments[:, 1:] != segments[:, :-1]], axis=1)


def split_refs(refs, *counts):
  """A kernel's flat ref list cut into one entry per count: the ref itself for 1, None for 0, a tuple of
  refs for n > 1. Every ref must be used: the counts sum to len(refs)."""
  out, i = [], 0
  for n in counts:
    n = int(n)
    out.append(refs[i] if n == 1 else (None if n == 0 else tuple(refs[i:i + n])))
    i += n
  if i != len(refs):
    raise ValueError(f"split_refs: the counts {counts} take {i} refs of {len(refs)}")
  return out


def pallas_call(kernel, *, grid, in_specs, out_specs, out_shape, interpret: bool, num_warps: int,
                num_stages: int, name: str, fp32_dots: str = "tf32x3", input_output_aliases=None):
  """`pl.pallas_call` for the Triton lowering (explicit compiler params) or the CPU interpreter. The kernel
  body is traced with fp32 dots as `fp32_dots` says when compiled, IEEE (exact fp32) in interpret mode."""

  def body(*refs):
    with chunk_math.fp32_dots("ieee" if interpret else fp32_dots):
      return kernel(*refs)
  params = _TRITON_PARAMS(num_warps=num_warps, num_stages=num_stages)
  return pl.pallas_call(body, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                        interpret=interpret, compiler_params=params, name=name,
                        input_output_aliases=input_output_aliases or {})


def override(config, *assignments: str, **values):
  """A copy of a frozen config dataclass with fields replaced: "field=value" or "family.field=value" strings (a
  family is a nested dataclass field; values parse as int, True / False / None, or stay strings) and/or keyword
  arguments named field or family__field. Unknown fields raise a ValueError naming them; invalid values raise the
  config's own ValueError."""
  changes = {}
  for text in assignments:
    key, sep, raw = text.partition("=")
    if not sep:
      raise ValueError(f"{type(config).__name__}.override: {text!r} is not 'field=value'")
    changes[key.strip()] = _parse(raw.strip())
  changes.update({k.replace("__", "."): v for k, v in values.items()})
  out = config
  for key, value in changes.items():
    family, _, field = key.rpartition(".")
    group = (getattr(out, family) if family in _field_names(out) else None) if family else out
    if field not in _field_names(group):
      raise ValueError(f"{type(config).__name__}.override: unknown field {key!r}")
    group = dataclasses.replace(group, **{field: value})
    out = dataclasses.replace(out, **{family: group}) if family else group
  return out


def _field_names(obj) -> set:
  return {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()


def _parse(raw: str):
  words = {"True": True, "False": False, "None": None}
  if raw in words:
    return words[raw]
  try:
    return int(raw)
  except ValueError:
    return raw
