"""Pallas kernels for the chunkwise solves, reached from `osdn_jax.ops` through `lookup` alone.

A backend module (`pallas_kernels.gpu`, `pallas_kernels.tpu`) registers, per op, a function with the signature
of the chunked XLA path (`osdn_jax.ops.chunked.delta_rule` / `linear_attention`) and a predicate saying which
shapes and dtypes it supports. `lookup` returns that function, or None when no kernel supports the request, in
which case `implementation="auto"` falls back to the XLA path and `implementation="pallas"` raises.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Kernel:
  fn: Callable[..., Any]            # same signature and results as the chunked XLA function of the op
  supports: Callable[..., bool]     # supports(spec, dtype, chunk_size, platform) -> bool


_REGISTRY: dict[str, list[Kernel]] = {}


def register(op: str, kernel: Kernel) -> None:
  _REGISTRY.setdefault(op, []).append(kernel)


def lookup(op: str, spec, dtype, chunk_size: int, platform: str) -> Callable[..., Any] | None:
  """The first registered kernel for `op` ("delta_rule" | "linear_attention") that supports the request."""
  for kernel in _REGISTRY.get(op, ()):
    if kernel.supports(spec, dtype, chunk_size, platform):
      return kernel.fn
  return None
