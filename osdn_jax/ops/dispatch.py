"""One implementation vocabulary for every op that has several, and the one place the library reaches the kernels.

`implementation`:
  "reference"  the token-serial oracle (fp64 under x64; "naive" is accepted as an alias);
  "xla"        the fast pure-JAX form (chunkwise, associative scans);
  "pallas"     a Pallas kernel (`pallas_kernels`; on a CPU backend in interpret mode); raises if none supports
               the request;
  "auto"       pallas on a GPU/TPU backend when a kernel supports the request, else xla (never reference).
A request is described by `pallas_kernels.spec.Spec`; kernels say what they support (`supports(spec)`).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from pallas_kernels.spec import Spec

IMPLEMENTATIONS = ("auto", "reference", "xla", "pallas")
ALIASES = {"naive": "reference"}


def normalize(op: str, implementation: str) -> str:
  """The implementation's canonical name; ValueError naming `implementation` for an unknown one."""
  impl = ALIASES.get(implementation, implementation)
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"{op}: `implementation` must be one of {IMPLEMENTATIONS} (or 'naive', an alias of "
                     f"'reference'), got {implementation!r}")
  return impl


def spec(op: str, dtype, *, key_dim: int, **fields) -> Spec:
  """The kernel request for this backend: `Spec(op, platform=jax.default_backend(), dtype=name, ...)`."""
  return Spec(op=op, platform=jax.default_backend(), dtype=jnp.dtype(dtype).name, key_dim=key_dim, **fields)


def kernel(request: Spec) -> Callable[..., Any] | None:
  """The first registered Pallas kernel that supports the request, or None."""
  import pallas_kernels   # the kernels' backends are imported on the first request only
  return pallas_kernels.lookup(request)


def choose(request: Spec, implementation: str, *, why: str = "") -> tuple[str, Callable[..., Any] | None]:
  """(kind, kernel): kind "reference", "xla" or "pallas" (then kernel is the Pallas function) for the
  normalized `implementation`. "pallas" without a supporting kernel raises a ValueError that describes the
  request (`why`: what else it needs, e.g. static constants)."""
  impl = normalize(request.op, implementation)
  if impl in ("reference", "xla"):
    return impl, None
  if impl == "auto" and request.platform not in ("gpu", "tpu"):
    return "xla", None
  fn = kernel(request)
  if fn is not None:
    return "pallas", fn
  if impl == "pallas":
    detail = ", ".join(f"{k}={v!r}" for k, v in (("decay", request.decay), ("K", request.key_dim),
                                                   ("V", request.value_dim), ("dtype", request.dtype),
                                                   ("chunk_size", request.chunk_size),
                                                   ("packed", request.packed)))
    raise ValueError(f"{request.op}: `implementation`='pallas' has no kernel for {detail} on backend "
                     f"{request.platform!r}{'; ' + why if why else ''}; use 'xla' or 'auto'")
  return "xla", None
