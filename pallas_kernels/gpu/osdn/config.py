"""Launch parameters of the OSDN d-pass kernels (speed only, not the function up to fp32 rounding)."""
from __future__ import annotations

import dataclasses

from pallas_kernels.arrays import tuning_entry
from pallas_kernels.gpu import common
from pallas_kernels.spec import is_pow2

TABLES = ("kernel", "xla", "auto")
DOTS = ("ieee", "tf32x3", "tf32")        # `chunk_math.fp32_dots`: how a compiled kernel's fp32 dots run


@dataclasses.dataclass(frozen=True)
class Config:
  """The sequential kernels (forward, backward) and the block solves' tables."""
  block_t: int = 16               # tokens per iteration of the forward's loop (unrolled: its loads issued first)
  block_t_bwd: int = 8            # the same for the backward (three K-rows per token held: smaller)
  solve_t: int = 32               # tokens per block solve with r ≡ 1 (0: token by token only)
  solve_t_apf: int = 16           # the same with an APF retention, anchor "zero"
  solve_t_init: int = 16          # the same with an APF retention, anchor "init"
  num_warps: int | None = None    # warps of the token-by-token kernels; None: 1 up to K = 128 (one warp's reduction), 2 above
  warps_solve: int = 4            # warps of the kernels when they run block solves ([solve_t, K] tiles)
  warps_tables: int = 4           # warps of the tables' kernel (one program per block)
  tables: str = "auto"            # tables from "kernel", "xla" (batched triangular solves) or "auto" (`tables.implementation`)
  share_inverse: bool = True      # under autodiff the forward's tables also form the backward's inverse
  chain: bool = True              # block solves as a d / λ chain plus parallel kernels; serial again where a clip acts
  spans: int = 0                  # blocks per span of the d / λ chains, the spans run in parallel (0: one chain)
  warps_spans: int = 8            # warps of the span maps' and the across-spans kernels ([K, K] maps)
  dots_tables: str = "ieee"       # fp32 dots of the tables' kernels (Gram blocks U Uᵀ, the backward's G Uᵀ)
  dots_expand: str = "tf32x3"     # fp32 dots of the expansion ((Γ diag(coef)) U per block)
  read_keys: bool = True          # given the keys, the kernels read k and square it on load (else u = k ⊙ k stored)
  fused_guard: bool = True        # the write key guard(d ⊙ k) as one kernel (`guard.py`; False: plain JAX)
  guard_rows: int = 32            # rows (tokens × heads) per program of the guard's kernels
  warps_guard: int = 4            # warps of the guard's kernels

  def __post_init__(self):
    for name in ("block_t", "block_t_bwd", "warps_solve", "warps_tables", "warps_spans", "guard_rows",
                 "warps_guard"):
      if not is_pow2(getattr(self, name)):
        raise ValueError(f"Config.{name}={getattr(self, name)} must be a power of two")
    if self.num_warps is not None and not is_pow2(self.num_warps):
      raise ValueError(f"Config.num_warps={self.num_warps} must be a power of two or None")
    for name in ("solve_t", "solve_t_apf", "solve_t_init"):
      v = getattr(self, name)
      if v and (not is_pow2(v) or v < 16):
        raise ValueError(f"Config.{name}={v} must be 0 or a power of two ≥ 16")
    if not isinstance(self.spans, int) or self.spans < 0:
      raise ValueError(f"Config.spans={self.spans!r} must be an int ≥ 0")
    for name in ("dots_tables", "dots_expand"):
      if getattr(self, name) not in DOTS:
        raise ValueError(f"Config.{name}={getattr(self, name)!r} must be one of {DOTS}")
    if self.tables not in TABLES:
      raise ValueError(f"Config.tables={self.tables!r} must be one of {TABLES}")

  def override(self, *assignments: str, **values) -> "Config":
    """A copy with fields replaced: "field=value" strings and/or keyword arguments (`common.override`)."""
    return common.override(self, *assignments, **values)

  def warps(self, key_dim: int, blocked: bool) -> int:
    """num_warps of the sequential kernels: `warps_solve` with block solves, else `num_warps` or by K."""
    if blocked:
      return self.warps_solve
    return self.num_warps or (1 if key_dim <= 128 else 2)


DEFAULT = Config()
# Interpret mode: unrolling costs compile time only; kernel tables throughout (what the mode is for).
INTERPRET = Config(block_t=4, block_t_bwd=4, solve_t=16, solve_t_apf=16, solve_t_init=16, tables="kernel")

# By device kind (a substring of `jax.Device.device_kind`; "interpret": Pallas interpret mode). DEFAULT was measured
# on an H200 (docs/benchmarks.md); other GPUs take it until measured.
TUNING = {"interpret": INTERPRET, "H200": DEFAULT}


def default_config(spec=None, device_kind: str | None = None) -> Config:
  """The tuning table's config for `device_kind` (the first entry whose key it contains), else DEFAULT. Every
  entry holds for every request (`spec`, unused here)."""
  del spec
  return tuning_entry(TUNING, device_kind, DEFAULT)
