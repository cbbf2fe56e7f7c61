"""Pallas kernels for the chunkwise solves, reached from `osdn_jax.ops` through `lookup` alone.

A backend module (`pallas_kernels.gpu`, `pallas_kernels.tpu`) registers, per op, a function with the signature
of the chunked XLA path (`osdn_jax.ops.chunked.delta_rule` / `linear_attention`) and a predicate saying which
shapes and dtypes it supports. `lookup` returns that function, or None when no kernel supports the request, in
which case `implementation="auto"` falls back to the XLA path and `implementation="pallas"` raises.

The backend modules are imported lazily, on the first `lookup`: importing this package (or `osdn_jax.ops`)
pulls in nothing beyond the standard library.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

_BACKENDS = ("pallas_kernels.gpu", "pallas_kernels.tpu")
_loaded = False


@dataclasses.dataclass(frozen=True)
class Kernel:
  fn: Callable[..., Any]            # same signature and results as the chunked XLA function of the op
  supports: Callable[..., bool]     # supports(spec, dtype, chunk_size, platform) -> bool


_REGISTRY: dict[str, list[Kernel]] = {}


def register(op: str, kernel: Kernel) -> None:
  _REGISTRY.setdefault(op, []).append(kernel)


def _load_backends() -> None:
  """Imports every backend module that exists (each registers its kernels on import, once)."""
  global _loaded
  if _loaded:
    return
  for name in _BACKENDS:
    try:
      importlib.import_module(name)
    except ModuleNotFoundError as e:
      if e.name != name:      # the backend exists but one of its own imports is missing: say so
        raise
  _loaded = True


def lookup(op: str, spec, dtype, chunk_size: int, platform: str) -> Callable[..., Any] | None:
  """The first registered kernel for `op` ("delta_rule" | "linear_attention" | "osdn_d_pass" | "decayed_sum" |
  "precond_key") that supports the request."""
  _load_backends()
  for kernel in _REGISTRY.get(op, ()):
    if kernel.supports(spec, dtype, chunk_size, platform):
      return kernel.fn
  return None
