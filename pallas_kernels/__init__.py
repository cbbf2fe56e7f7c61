"""Pallas kernels for the chunkwise solves and the preconditioners' first passes.

A backend module (`pallas_kernels.gpu`, `pallas_kernels.tpu`) registers, per op, a function with the signature of
the op's XLA implementation and a predicate `supports(spec)` over the typed request (`pallas_kernels.spec.Spec`).
`lookup(spec)` returns the first registered kernel that supports the request, or None: `implementation="auto"` then
falls back to XLA and "pallas", "pallas-gpu" and "pallas-tpu" raise (`osdn_jax.ops.dispatch`, the one place the
library reaches the kernels, which sets `spec.platform` to the platform an explicit value names, and calls the
kernel with `config=spec.config` when the request carries one backend's launch parameters: a kernel supports only
its own backend's, `spec.config_of(Config)`). Each kernel reads its defaults from its backend's tuning table,
`default_config(spec, device_kind)`. Nothing here imports `osdn_jax`.

The backends are imported lazily, on the first `lookup`: importing this package pulls in nothing beyond the
standard library.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

from pallas_kernels.spec import Spec

_BACKENDS = ("pallas_kernels.gpu", "pallas_kernels.tpu")
_loaded = False


@dataclasses.dataclass(frozen=True)
class Kernel:
  name: str                           # "gpu.delta_rule", for messages
  fn: Callable[..., Any]              # the op's signature and results
  supports: Callable[[Spec], bool]    # whether fn handles the request


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


def kernels(op: str) -> list[Kernel]:
  """Every kernel registered for `op`, in registration order."""
  _load_backends()
  return list(_REGISTRY.get(op, ()))


def lookup(spec: Spec) -> Callable[..., Any] | None:
  """The first registered kernel for `spec.op` that supports the request, or None."""
  for kernel in kernels(spec.op):
    if kernel.supports(spec):
      return kernel.fn
  return None
