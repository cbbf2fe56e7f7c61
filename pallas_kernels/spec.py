"""The contract the library and the kernels share: the kernel request `Spec` and the constants of the math.

Standard library only, so that `osdn_jax.ops` can build a request without importing any kernel. A backend
registers, per op, a function and a predicate `supports(spec) -> bool` (`pallas_kernels.register`); the library
asks `pallas_kernels.lookup(spec)` for the first kernel that supports the request.
"""
from __future__ import annotations

import dataclasses
from typing import Any

OPS = ("delta_rule", "linear_attention", "osdn_d_pass", "osdn_guard", "decayed_sum", "precond_key")
DECAYS = ("none", "scalar", "channel")
CHUNK_SIZES = (16, 32, 64, 128)      # chunk sizes every implementation of the solves accepts
LOG_DECAY_FLOOR = -30.0              # log-decays are clamped here (e^−30 ≈ 1e−13): lower values only cost precision


def is_pow2(x) -> bool:
  """Whether x is an int (not a bool) and a power of two."""
  return isinstance(x, int) and not isinstance(x, bool) and x > 0 and x & (x - 1) == 0


def next_pow2(x: int, floor: int = 16) -> int:
  """The power of two ≥ max(x, floor)."""
  p = floor
  while p < x:
    p *= 2
  return p


@dataclasses.dataclass(frozen=True)
class Spec:
  """One kernel request: what a kernel's `supports` decides on (static shapes, dtypes and options only).

  op: one of OPS. platform: whose kernels are asked for, "gpu", "cpu" or "tpu": `jax.default_backend()`, or the
  platform an explicit `implementation` names ("pallas-gpu", "pallas-tpu"; `osdn_jax.ops.dispatch`). dtype: the
  inputs' dtype name ("bfloat16", "float32", ...). key_dim, value_dim: K and V (value_dim 0 where the op has none).
  batch, length, heads, value_heads: B, T, H, HV (length None for one-token steps). decay: "none" | "scalar" |
  "channel". chunk_size: the requested chunk (0 where the op has none). packed: `segment_ids` were given;
  num_segments: N when static (B when unpacked), else None. static_params: the op's scalar options (e.g. PDN's
  x, OSDN's η and bounds) are Python numbers, not traced values. config: None (each kernel's `default_config`) or
  one backend's launch parameters (its `Config`, hashable), handed to the kernel that supports the request; a
  kernel supports a request only with its own backend's config or none.
  """
  op: str
  platform: str
  dtype: str
  key_dim: int
  value_dim: int = 0
  batch: int = 0
  length: int | None = None
  heads: int = 0
  value_heads: int = 0
  decay: str = "none"
  chunk_size: int = 0
  packed: bool = False
  num_segments: int | None = None
  static_params: bool = True
  config: Any = None

  def __post_init__(self):
    if self.op not in OPS:
      raise ValueError(f"Spec: `op` must be one of {OPS}, got {self.op!r}")
    if self.decay not in DECAYS:
      raise ValueError(f"Spec: `decay` must be one of {DECAYS}, got {self.decay!r}")

  def config_of(self, config_type: type) -> bool:
    """Whether the request's config is None or a `config_type` (a kernel supports only its own backend's)."""
    return self.config is None or isinstance(self.config, config_type)

  @property
  def groups(self) -> int:
    """HV / H: value heads per key head (GVA)."""
    return self.value_heads // self.heads
