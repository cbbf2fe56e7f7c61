"""One timing method for every implementation: back-to-back calls, one synchronisation at the end.

`pipelined_ms(call, sync)` runs `call()` `n` times without waiting, then `sync()`, and returns the median over
`reps` of (elapsed / n) in ms, after `warmup` untimed calls. Host dispatch overlaps device work, so for calls
that keep the device busy longer than their dispatch takes this is device time per call; a per-call
synchronisation would add the launch latency of every call to every measurement. JAX and torch/FLA are timed
the same way (JAX: `sync` blocks on the last result; torch: `torch.cuda.synchronize`).
"""
from __future__ import annotations

import time

import numpy as np


def pipelined_ms(call, sync, *, n: int = 20, reps: int = 7, warmup: int = 2) -> float:
  """Median over `reps` of the per-call ms of `n` back-to-back calls, after `warmup` synchronised calls."""
  for _ in range(warmup):
    sync(call())
  per_call = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = None
    for _ in range(n):
      out = call()
    sync(out)
    per_call.append((time.perf_counter() - t0) / n)
  return 1e3 * float(np.median(per_call))


def jax_ms(fn, *args, **kw) -> float:
  """`pipelined_ms` of fn(*args), synchronised with `jax.block_until_ready` on the last result."""
  import jax
  return pipelined_ms(lambda: fn(*args), jax.block_until_ready, **kw)


def torch_ms(fn, **kw) -> float:
  """`pipelined_ms` of fn(), synchronised with `torch.cuda.synchronize`."""
  import torch
  return pipelined_ms(fn, lambda _: torch.cuda.synchronize(), **kw)


def compiled_bytes(fn, *args) -> int | None:
  """Temp + output bytes of the compiled `fn` (a `jax.jit` function, given its arguments, or an already
  compiled executable); None where memory_analysis is not available on this backend or JAX version."""
  try:
    compiled = fn.lower(*args).compile() if hasattr(fn, "lower") else fn
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.output_size_in_bytes)
  except Exception:  # noqa: BLE001 — not every backend reports memory
    return None
