"""The static description of one d-pass call and the BlockSpecs of its kernels.

Grid (B, G) for the sequential kernels: one program per (batch, head) over the whole sequence; grid (B, G, NB)
for the per-block kernels (tables, the backward's block gradients), one program per block of L = `solve_t`;
grid (B, G, NS) for the chains run per segment of `Config.spans` blocks (`spans.py`).
"""
from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

from pallas_kernels.gpu.chunk_math import F32, iota
from pallas_kernels.gpu.common import SQUEEZED as _SQ
from pallas_kernels.gpu.osdn.config import Config


@dataclasses.dataclass(frozen=True)
class Static:
  """Everything static about one d-pass call (hashable: the custom_vjp's non-differentiable argument)."""
  batch: int
  length: int              # T (not padded)
  heads: int               # G
  key_dim: int             # padded K
  eta: float
  d_min: float | None
  d_max: float | None
  mode: str                # "none" (r ≡ 1) | "zero" | "init"
  config: Config
  interpret: bool
  segments: int = 0        # packed: N (per-token codes reset d; d1 and d_{T+1} are per segment); 0: not
  channels: int = 0        # K before padding (0: key_dim); padded channels (u = 0, d = 0) skip the checks
  squared: bool = False    # the u arrays hold the keys k (any float dtype) and u = k ⊙ k is formed on load (`u_of`)

  @property
  def has_r(self) -> bool:
    return self.mode != "none"

  @property
  def has_o(self) -> bool:
    return self.mode == "init"

  def real(self, shape):
    """[.., K] mask of the channels that are not padding (None: no padding)."""
    if not self.channels or self.channels == self.key_dim:
      return None
    return iota(shape, len(shape) - 1) < self.channels

  @property
  def solve_t(self) -> int:
    c = self.config
    return {"none": c.solve_t, "zero": c.solve_t_apf, "init": c.solve_t_init}[self.mode]

  @property
  def blocked(self) -> bool:
    """The kernels run block solves (a block size for this mode, not packed, at least one whole block); the
    backward is then split into a λ chain and a parallel kernel over the blocks."""
    return bool(self.solve_t) and not self.segments and self.length >= self.solve_t

  @property
  def num_blocks(self) -> int:
    return self.length // self.solve_t

  @property
  def warps(self) -> int:
    return self.config.warps(self.key_dim, self.blocked)

  @property
  def chain_spans(self) -> int:
    """NS, the spans of `Config.spans` blocks (the last one ragged) that the forward's chain runs in
    parallel (`spans.py`); 0: the chain runs whole (segments 0, no chain, not blocked (so also packed), or
    a single span)."""
    per = self.config.spans
    if not (per and self.config.chain and self.blocked):
      return 0
    ns = -(-self.num_blocks // per)
    return ns if ns > 1 else 0


def u_of(st, x):
  """u = k ⊙ k in fp32 from what the u arrays hold: the keys k when `st.squared` (formed where loaded, so u is
  never stored and k is read in its own dtype), else u itself."""
  if st.squared:
    x = x.astype(F32)
    return x * x
  return x


# BlockSpecs over the grid (b, g): whole sequences of one (batch, head).
def rows(st):      # [B, T, G, K] → [T, K]
  return pl.BlockSpec((_SQ, st.length, _SQ, st.key_dim), lambda b, g: (b, 0, g, 0))


def scalars(st):   # [B, T, G] → [T]
  return pl.BlockSpec((_SQ, st.length, _SQ), lambda b, g: (b, 0, g))


def head_vec(st):  # [B, G, K] → [K]; packed: [N, G, K] → [N, K] (every segment's row, read by index)
  if st.segments:
    return pl.BlockSpec((st.segments, _SQ, st.key_dim), lambda b, g: (0, g, 0))
  return pl.BlockSpec((_SQ, _SQ, st.key_dim), lambda b, g: (b, g, 0))


def batch_vec(st):  # [B, G, K] → [K], also when packed
  return pl.BlockSpec((_SQ, _SQ, st.key_dim), lambda b, g: (b, g, 0))


def codes(st):     # [B, T] int32 → [T]: segment << 2 | last token of it << 1 | first token of it
  return pl.BlockSpec((_SQ, st.length), lambda b, g: (b, 0))


def decode(code):
  """(segment, first, last) of one per-token code."""
  return code >> 2, (code & 1) == 1, (code & 2) == 2


def param_vec(st):  # [G, K] → [K]
  return pl.BlockSpec((_SQ, st.key_dim), lambda b, g: (g, 0))


def table_specs(st):  # [B, NB, G, L, L] → [NB, L, L] and [B, NB, G, L] → [NB, L]: (t, w[, Γ])
  nb, L = st.num_blocks, st.solve_t
  square = pl.BlockSpec((_SQ, nb, _SQ, L, L), lambda b, g: (b, 0, g, 0, 0))
  return [square, pl.BlockSpec((_SQ, nb, _SQ, L), lambda b, g: (b, 0, g, 0))] + ([square] if st.has_r else [])


def per_block(st, k: int = 0):
  """[B, NB, G] → [NB] (k = 0) or [B, NB, G, K] → [NB, K] for the (b, g) programs: one entry per block."""
  nb = st.num_blocks
  if k:
    return pl.BlockSpec((_SQ, nb, _SQ, k), lambda b, g: (b, 0, g, 0))
  return pl.BlockSpec((_SQ, nb, _SQ), lambda b, g: (b, 0, g))


def over_spans(spec):
  """A BlockSpec of the grid (b, g) for the grid (b, g, j) over chain spans: every j maps to the same block."""
  index = spec.index_map
  return pl.BlockSpec(spec.block_shape, lambda b, g, j: index(b, g))


def span_specs(st):
  """BlockSpecs of one chain span for a grid (b, g, j) over (B, G, NS) (`spans.py`): a dense map
  [B, NS, G, K, K] → [K, K] and a per-span vector [B, NS, G, K] → [K]."""
  k = st.key_dim
  return dict(square=pl.BlockSpec((_SQ, _SQ, _SQ, k, k), lambda b, g, j: (b, j, g, 0, 0)),
              vec=pl.BlockSpec((_SQ, _SQ, _SQ, k), lambda b, g, j: (b, j, g, 0)))


def block_specs(st):
  """BlockSpecs of one block of L tokens for a grid (b, g, i) over (B, G, NB): rows of [B, T, G, K] → [L, K],
  scalars [B, T, G] → [L], tables [B, NB, G, L, L] → [L, L] and [B, NB, G, L] → [L], per-block vectors
  [B, NB, G, K] → [K], per-head parameters [G, K] → [K]."""
  L, k = st.solve_t, st.key_dim
  return dict(rows=pl.BlockSpec((_SQ, L, _SQ, k), lambda b, g, i: (b, i, g, 0)),
              scal=pl.BlockSpec((_SQ, L, _SQ), lambda b, g, i: (b, i, g)),
              square=pl.BlockSpec((_SQ, _SQ, _SQ, L, L), lambda b, g, i: (b, i, g, 0, 0)),
              vec=pl.BlockSpec((_SQ, _SQ, _SQ, L), lambda b, g, i: (b, i, g, 0)),
              vec_k=pl.BlockSpec((_SQ, _SQ, _SQ, k), lambda b, g, i: (b, i, g, 0)),
              param=pl.BlockSpec((_SQ, k), lambda b, g, i: (g, 0)),
              flags=pl.BlockSpec((_SQ, st.num_blocks, _SQ), lambda b, g, i: (b, 0, g)))
