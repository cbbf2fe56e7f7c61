"""One implementation vocabulary for every op that has several, and the one place the library reaches the kernels.

`implementation` (`IMPLEMENTATIONS`; `NAMES` adds the alias):
  "reference"   the token-serial oracle (fp64 under x64; "naive" is accepted as an alias);
  "xla"         the fast pure-JAX form (chunkwise, associative scans);
  "pallas"      this backend's Pallas kernel (`pallas_kernels`): the Triton kernels on a GPU, the Mosaic kernels on
                a TPU, the GPU kernels in Pallas interpret mode on a CPU;
  "pallas-gpu"  the GPU kernel: compiled on a GPU backend, in Pallas interpret mode on any other;
  "pallas-tpu"  the TPU kernel: compiled on a TPU backend, in TPU interpret mode on any other;
  "auto"        pallas on a GPU/TPU backend when a kernel supports the request, else xla (never reference).
"pallas", "pallas-gpu" and "pallas-tpu" raise a ValueError naming the platform when no kernel supports the request.

A request is described by `pallas_kernels.spec.Spec`, built for this backend (`spec`); kernels say what they support
(`supports(spec)`), and a kernel's `supports` admits the platforms it runs on (the GPU kernels "gpu" and "cpu", the
TPU kernels "tpu"). An explicit platform ("pallas-gpu", "pallas-tpu") asks the registry for that platform's kernel;
when the platform is not the backend, the kernel is called with `interpret=True` (every kernel entry point takes
`interpret`; None, their default, interprets on a CPU backend only). The kernels' bodies are the same either way.
A request may carry one backend's launch parameters (`Spec.config`, the ops' `kernel_config`): only that backend's
kernels support it, and the chosen kernel is called with `config=` it (without one, each kernel reads its own
`default_config`). "auto" and "xla" without a supporting kernel run XLA, which takes no config.

The preconditioners' passes (`osdn_jax.dgps.precond`) dispatch here too. One exception to "auto" above: OSDN's
d-pass, when unbounded (d_min and d_max None) and unpacked, takes its exact chunked XLA form on every backend, GPU
and TPU included, before any kernel is asked for; bounded or packed, "auto" asks for the kernel like the solves.
The default OSDN bounds [0, 8] take the kernel. No benchmark measures the unbounded d-pass (docs/benchmarks.md
times the clip [0, 8]), so that preference stands as written until one does.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from pallas_kernels.spec import Spec

IMPLEMENTATIONS = ("auto", "reference", "xla", "pallas", "pallas-gpu", "pallas-tpu")
ALIASES = {"naive": "reference"}
NAMES = IMPLEMENTATIONS + tuple(ALIASES)            # every value `implementation` accepts
PLATFORMS = {"pallas-gpu": "gpu", "pallas-tpu": "tpu"}   # the explicit kernel platforms


def normalize(op: str, implementation: str) -> str:
  """The implementation's canonical name; ValueError naming `implementation` for an unknown one."""
  impl = ALIASES.get(implementation, implementation) if isinstance(implementation, str) else implementation
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"{op}: `implementation` must be one of {IMPLEMENTATIONS} (or 'naive', an alias of "
                     f"'reference'), got {implementation!r}")
  return impl


def is_pallas(implementation: str) -> bool:
  """Whether the canonical `implementation` asks for a kernel outright: "pallas", "pallas-gpu" or "pallas-tpu"."""
  return implementation == "pallas" or implementation in PLATFORMS


def spec(op: str, dtype, *, key_dim: int, **fields) -> Spec:
  """The kernel request for this backend: `Spec(op, platform=jax.default_backend(), dtype=name, ...)`."""
  return Spec(op=op, platform=jax.default_backend(), dtype=jnp.dtype(dtype).name, key_dim=key_dim, **fields)


def check_config(op: str, config) -> None:
  """ValueError naming `kernel_config` unless it is None or a kernel's launch parameters (a frozen dataclass
  instance, as every backend's `Config` is)."""
  params = getattr(config, "__dataclass_params__", None)
  if config is not None and (isinstance(config, type) or params is None or not params.frozen):
    raise ValueError(f"{op}: `kernel_config` must be None or a kernel backend's Config (e.g. "
                     f"pallas_kernels.gpu.delta_rule.Config()), got {config!r}")


def kernel(request: Spec) -> Callable[..., Any] | None:
  """The first registered Pallas kernel that supports the request, or None."""
  import pallas_kernels   # the kernels' backends are imported on the first request only
  return pallas_kernels.lookup(request)


def target(request: Spec, implementation: str) -> Spec:
  """The request the kernels see for the canonical `implementation`: on the platform "pallas-gpu" / "pallas-tpu"
  names, else on the request's own (the backend's)."""
  platform = PLATFORMS.get(implementation, request.platform)
  return request if platform == request.platform else dataclasses.replace(request, platform=platform)


def interpreted(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn` (a kernel entry point) called with `interpret=True`: that kernel on a backend of another platform."""
  return functools.partial(fn, interpret=True)


def choose(request: Spec, implementation: str, *, why: str = "") -> tuple[str, Callable[..., Any] | None]:
  """(kind, kernel): kind "reference", "xla" or "pallas" (then kernel is the Pallas function, in interpret mode
  where its platform is not the request's) for `implementation`. An explicit pallas value without a supporting
  kernel raises a ValueError that describes the request and names the platform (`why`: what else it needs, e.g.
  static constants)."""
  impl = normalize(request.op, implementation)
  if impl in ("reference", "xla"):
    return impl, None
  if impl == "auto" and request.platform not in ("gpu", "tpu"):
    return "xla", None
  wanted = target(request, impl)
  fn = kernel(wanted)
  if fn is not None:
    if request.config is not None:
      fn = functools.partial(fn, config=request.config)
    return "pallas", (fn if wanted.platform == request.platform else interpreted(fn))
  if is_pallas(impl):
    raise _no_kernel(request, wanted, impl, why)
  return "xla", None


def _no_kernel(request: Spec, wanted: Spec, impl: str, why: str) -> ValueError:
  """The error of an explicit pallas value that no kernel of `wanted.platform` supports."""
  fields = [("decay", request.decay), ("K", request.key_dim), ("V", request.value_dim), ("dtype", request.dtype),
            ("chunk_size", request.chunk_size), ("packed", request.packed)]
  if request.config is not None:
    fields.append(("kernel_config", f"{type(request.config).__module__}.{type(request.config).__name__}"))
  detail = ", ".join(f"{k}={v!r}" for k, v in fields)
  where = f"platform {wanted.platform!r}"
  if wanted.platform != request.platform:
    where += f" (in interpret mode on backend {request.platform!r})"
  return ValueError(f"{request.op}: `implementation`={impl!r} has no kernel for {detail} on {where}"
                    f"{'; ' + why if why else ''}; use 'xla' or 'auto'")
