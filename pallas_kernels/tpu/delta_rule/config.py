"""Launch parameters of the TPU delta-rule kernels: block sizes and precision as data, per TPU generation."""
from __future__ import annotations

import dataclasses

from pallas_kernels.tpu.common import generation


@dataclasses.dataclass(frozen=True)
class Config:
  """How the kernels are launched; no field changes the function, only rounding, speed and VMEM use.

  block_v: V columns per program (a parallel grid axis of V / block_v programs, each re-forming the chunk's
    T = (I + A)⁻¹ and W); None takes all of V. Must divide the padded V and be a multiple of 128, or V itself.
  bf16_matmuls: with bf16 inputs, the dots that do not build T (W, U, W·S, the output, the state update) take
    bf16 operands with fp32 accumulation; False runs them on fp32 operands at full precision. fp32 inputs always
    run every dot at full fp32 precision.
  layout: how q, k, k_write, v, o (and per-channel log-decays) are cut into blocks. "tokens": [B, T, heads · D],
    a projection's own layout (needs the padded K and V multiples of 128); "head_major": transposed to
    [B, heads, T, D] in XLA (any K, V); "auto": "tokens" where it applies.
  sub: per-channel decay: the rows of the diagonal sub-blocks whose pairs are formed channel by channel (16 or
    32, or 8; the chunk when smaller); the other pairs are factored through a reference row.
  vmem_limit_bytes: Mosaic's scoped VMEM limit (None: the compiler's default).
  """
  block_v: int | None = None
  bf16_matmuls: bool = True
  layout: str = "auto"
  sub: int = 16
  vmem_limit_bytes: int | None = None

  def __post_init__(self):
    if self.layout not in ("auto", "tokens", "head_major"):
      raise ValueError(f"Config: `layout` must be 'auto', 'tokens' or 'head_major', got {self.layout!r}")
    if self.sub not in (8, 16, 32):
      raise ValueError(f"Config: `sub` must be 8, 16 or 32, got {self.sub!r}")
    if self.block_v is not None and (not isinstance(self.block_v, int) or self.block_v < 1):
      raise ValueError(f"Config: `block_v` must be a positive int or None, got {self.block_v!r}")

  def value_block(self, value_dim: int) -> int:
    """The V columns per program for a padded V (ValueError when block_v does not fit the Mosaic tiling)."""
    bv = self.block_v or value_dim
    if value_dim % bv or (bv != value_dim and bv % 128):
      raise ValueError(f"Config: `block_v` {bv} must divide V = {value_dim} and be a multiple of 128 (or V)")
    return bv


DEFAULT = Config()

# Per TPU generation. With K = V = 128 the dots of the chunk fill a 128-wide MXU (v4, v5e, v5p) at sub-blocks of 16
# rows; v6e's MXU is 256 wide, so its per-channel reference-row dots ([s, K] × [K, C]) take 32 rows, half as many
# dots of twice the height (docs/tpu_cost_model.md). Chosen on paper: no TPU has timed them.
TUNING = {"v4": DEFAULT, "v5e": DEFAULT, "v5p": DEFAULT, "v6e": Config(sub=32)}


def default_config(spec=None, device_kind: str | None = None) -> Config:
  """The launch parameters for a TPU `device_kind` or topology name ("TPU v6 lite", "v5p:2x2x1"; default: this
  backend's first device); DEFAULT off TPU. Every entry holds for every request (`spec`, unused here)."""
  del spec
  return TUNING.get(generation(device_kind), DEFAULT)
