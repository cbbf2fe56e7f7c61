"""Packed sequences for the GPU kernels: every segment moved to start on a chunk boundary of one row.

With segment numbers [B, T] (n = 0..N−1 in row-major order: `osdn_jax.ops.packing.segment_index` of the
caller's `segment_ids`), segment n's tokens go to positions base_n + 0, 1, … of a
single row of static length L = ⌈(B·T + N·(C − 1)) / C⌉·C, where base_n is a multiple of the chunk C and the
gaps are zero tokens (β = 0, g = 0: they leave the state unchanged). No chunk then holds two segments, so
every chunk-parallel kernel runs unchanged; only the two state passes reset. They read one int32 array
`info` [NC + N + 1]: per chunk, segment << 2 | last chunk of it << 1 | first chunk of it; then the lane bounds,
the first chunk of each segment and NC. The state passes run one program per lane (segment n's chunks and, for
the last lane, the trailing padding chunks), so the segments' serial chunk loops run in parallel, as the
batch rows of an unpacked call do. N must be static. The row holds up to N·(C − 1) padding tokens: cheap when
segments are long against the chunk, up to C times the work when most segments are a few tokens long (use a
smaller chunk_size there).
"""
from __future__ import annotations

import jax.numpy as jnp



def row_length(tokens: int, num_segments: int, chunk: int) -> int:
  """L, the static length of the chunk-aligned row for `tokens` = B·T tokens in at most N segments."""
  return -(-(tokens + num_segments * (chunk - 1)) // chunk) * chunk


def chunk_aligned(segments, num_segments: int, chunk: int):
  """segments [B, T] int segment numbers → (pos [B·T] int32 positions in the row, info [L/C + N + 1] int32 (the
  module docstring), present [N] bool: segment n has tokens)."""
  b, t = segments.shape
  n = num_segments
  seg = jnp.minimum(segments.reshape(-1).astype(jnp.int32), n - 1)          # more than N segments: clamped
  lens = jnp.zeros((n,), jnp.int32).at[seg].add(1)
  chunks = (lens + chunk - 1) // chunk
  end = jnp.cumsum(chunks)                                                  # past each segment's last chunk
  first_tok = jnp.cumsum(lens) - lens
  pos = (end - chunks)[seg] * chunk + jnp.arange(b * t, dtype=jnp.int32) - first_tok[seg]
  c = jnp.arange(row_length(b * t, n, chunk) // chunk, dtype=jnp.int32)
  cseg = jnp.minimum(jnp.searchsorted(end, c, side="right").astype(jnp.int32), n - 1)
  has = chunks[cseg] > 0
  first = has & (c == end[cseg] - chunks[cseg])
  last = has & (c == end[cseg] - 1)
  codes = (cseg << 2) | (last.astype(jnp.int32) << 1) | first.astype(jnp.int32)
  lanes = jnp.append(end - chunks, c.shape[0]).astype(jnp.int32)
  return pos, jnp.concatenate([codes, lanes]), lens > 0


# pos is strictly increasing (segments in row-major order, each at a later chunk), so both moves are told
# their indices are sorted and unique: XLA's GPU scatter then needs no atomics (for bf16 rows a compare-and-swap
# loop per element otherwise), and the gather's transpose (a scatter-add) inherits the same promise.
def to_row(x, pos, length: int):
  """[B, T, ...] → [1, L, ...]: token i of the flattened batch at pos[i], zeros elsewhere."""
  flat = x.reshape((-1,) + x.shape[2:])
  row = jnp.zeros((length,) + x.shape[2:], x.dtype).at[pos].set(flat, mode="drop", indices_are_sorted=True,
                                                                 unique_indices=True)
  return row[None]


def from_row(y, pos, b: int, t: int):
  """[1, L, ...] → [B, T, ...], the inverse gather of `to_row`."""
  return y[0].at[pos].get(mode="fill", fill_value=0, indices_are_sorted=True,
                          unique_indices=True).reshape((b, t) + y.shape[2:])
