"""Array layouts, padding and BlockSpecs of the TPU delta-rule kernels, and the launch this backend derives from a call.

The grid is (B, HV, V / BV, NC): one program per batch row, value head and block of BV value columns, the chunk
axis innermost (sequential, the state carried in VMEM). Mosaic takes a block whose last two dims are multiples
of (8, 128) or the array's whole dims, so:

* q, k, k_write, v, o and per-channel log-decays ("tokens" layout): [B, T, heads · D], a block being one chunk of
  one head, [C, D] with D a multiple of 128. That is the layout of a projection's output, so inside a model the
  reshape from [B, T, heads, D] costs nothing; an array that arrives tiled over (heads, D) is relaid out by XLA.
  "head_major" layout: [B, heads, T, D] (a transpose in XLA), a block [C, D] for any D.
* β and the scalar decay's in-chunk cumulative log-decay G, [B, HV, T] fp32, enter stacked as rows,
  [B, HV, NC, R, C] with R = 1 (β) or 2 (β, G): a block [R, C] holds the chunk's values along lanes.
* states [B, HV, K, V]: a block [K, BV], the same for every chunk of a program.
* packed sequences: one row (B = 1) of chunk-aligned segments (`pallas_kernels/packed.py`); the per-chunk codes
  (segment << 2 | last chunk << 1 | first chunk) are scalar-prefetched into SMEM, so the index maps of the
  per-segment states [N, HV, K, V] and the kernels read them.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from pallas_kernels import delta_rule_shell as shell

SQUEEZED = getattr(pl, "squeezed", None)     # a squeezed block dim (None in older JAX)
LANES = 128
_0 = np.int32(0)     # block index 0 (a Python 0 would be an int64 index with x64 enabled, which Mosaic rejects)


def padded_dim(d: int) -> int:
  """K or V after padding: the power of two ≥ max(d, 16) up to 128, else the multiple of 128 ≥ d."""
  if d > LANES:
    return -(-d // LANES) * LANES
  p = 16
  while p < d:
    p *= 2
  return p


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static sizes of one launch (padded T, K, V) and the choice of token layout."""
  batch: int
  length: int          # T padded to a multiple of chunk
  heads: int           # H (key heads of q and k)
  kw_heads: int        # heads of k_write (H or HV)
  value_heads: int     # HV
  key_dim: int         # padded K
  value_dim: int       # padded V
  block_v: int
  chunk: int
  head_major: bool
  reverse: bool = False   # the backward's launch: grid step c visits chunk NC − 1 − c
  packed: bool = False    # one chunk-aligned row of segments (pallas_kernels/packed.py); index maps get its codes

  def chunk_of(self, c):
    """The chunk that grid step c visits (last to first when reverse)."""
    return np.int32(self.num_chunks - 1) - c if self.reverse else c

  @property
  def num_chunks(self) -> int:
    return self.length // self.chunk

  @property
  def num_v(self) -> int:
    return self.value_dim // self.block_v

  @property
  def grid(self) -> tuple[int, int, int, int]:
    return (self.batch, self.value_heads, self.num_v, self.num_chunks)

  def head_of(self, heads: int):
    """Value head h → the head of an array with `heads` heads (GVA: h // (HV / heads)). lax.div truncates, which
    is the floor for h ≥ 0; `//` would emit a sign correction whose Mosaic lowering asks the default device for
    its TPU generation (a CPU when compiling ahead of time)."""
    group = np.int32(self.value_heads // heads)
    return (lambda h: h) if group == 1 else (lambda h: lax.div(h, group))

  # Token arrays -------------------------------------------------------------------------------------------
  def tokens_in(self, x):
    """[B, T, heads, D] (T, D padded) → the kernel's view of it."""
    if self.head_major:
      return jnp.swapaxes(x, 1, 2)
    return x.reshape(x.shape[0], x.shape[1], -1)

  def key_spec(self, heads: int):
    """A [C, K] block of q, k or k_write (`heads` heads) at chunk c of value head h."""
    head, kd, at = self.head_of(heads), self.key_dim, self.chunk_of
    if self.head_major:
      return pl.BlockSpec((SQUEEZED, SQUEEZED, self.chunk, kd), lambda b, h, j, c, *_: (b, head(h), at(c), _0))
    return pl.BlockSpec((SQUEEZED, self.chunk, kd), lambda b, h, j, c, *_: (b, at(c), head(h)))

  def value_spec(self):
    """A [C, BV] block of v or o at chunk c, value head h, value block j."""
    bv, nv, at = self.block_v, self.num_v, self.chunk_of
    if self.head_major:
      return pl.BlockSpec((SQUEEZED, SQUEEZED, self.chunk, bv), lambda b, h, j, c, *_: (b, h, at(c), j))
    return pl.BlockSpec((SQUEEZED, self.chunk, bv), lambda b, h, j, c, *_: (b, at(c), h * nv + j))

  def output_shape(self):
    b, t, hv, vd = self.batch, self.length, self.value_heads, self.value_dim
    return (b, hv, t, vd) if self.head_major else (b, t, hv * vd)

  def tokens_out(self, o):
    """The kernel's o → [B, T, HV, V] (padded)."""
    if self.head_major:
      return jnp.swapaxes(o, 1, 2)
    return o.reshape(self.batch, self.length, self.value_heads, self.value_dim)

  # Per-token scalars ------------------------------------------------------------------------------------
  def gates(self, x):
    """[B, HV, R, T] → [B, HV, NC, R, C]."""
    r = x.shape[2]
    x = x.reshape(self.batch, self.value_heads, r, self.num_chunks, self.chunk)
    return jnp.swapaxes(x, 2, 3)

  def gates_spec(self, r: int):
    at = self.chunk_of
    return pl.BlockSpec((SQUEEZED, SQUEEZED, SQUEEZED, r, self.chunk), lambda b, h, j, c, *_: (b, h, at(c), _0, _0))

  # Gradients of the backward: one partial per (value head, V block), summed by the caller ---------------
  def partial_key_shape(self):
    """dq, dk, dk_write (and per-channel d log-decay) partials: a [K] row per token, value head and V block."""
    b, t, n, kd = self.batch, self.length, self.value_heads * self.num_v, self.key_dim
    return (b, n, t, kd) if self.head_major else (b, t, n * kd)

  def partial_key_spec(self):
    nv, kd, at = self.num_v, self.key_dim, self.chunk_of
    if self.head_major:
      return pl.BlockSpec((SQUEEZED, SQUEEZED, self.chunk, kd), lambda b, h, j, c, *_: (b, h * nv + j, at(c), _0))
    return pl.BlockSpec((SQUEEZED, self.chunk, kd), lambda b, h, j, c, *_: (b, at(c), h * nv + j))

  def partial_keys_out(self, x):
    """A partial → [B, T, HV, NV, K] (T and K padded)."""
    if self.head_major:
      x = jnp.swapaxes(x, 1, 2)
    return x.reshape(self.batch, self.length, self.value_heads, self.num_v, self.key_dim)

  def partial_gates_shape(self, r: int):
    return (self.batch, self.value_heads * self.num_v, self.num_chunks, r, self.chunk)

  def partial_gates_spec(self, r: int):
    nv, at = self.num_v, self.chunk_of
    return pl.BlockSpec((SQUEEZED, SQUEEZED, SQUEEZED, r, self.chunk),
                        lambda b, h, j, c, *_: (b, h * nv + j, at(c), _0, _0))

  def partial_gates_out(self, x):
    """[B, HV·NV, NC, R, C] → [B, HV, R, T] summed over V blocks."""
    r = x.shape[3]
    x = x.reshape(self.batch, self.value_heads, self.num_v, self.num_chunks, r, self.chunk).sum(axis=2)
    return jnp.swapaxes(x, 2, 3).reshape(self.batch, self.value_heads, r, self.length)

  # States -----------------------------------------------------------------------------------------------
  def state_spec(self):
    """The [K, BV] block of S0 or S_T of a program: one block for all of its chunks."""
    return pl.BlockSpec((SQUEEZED, SQUEEZED, self.key_dim, self.block_v), lambda b, h, j, c, *_: (b, h, _0, j))

  def segment_state_spec(self):
    """Packed: the [K, BV] block of segment n's initial or final state in [N, HV, K, V], n being the segment of
    the chunk that grid step c visits (its code in the scalar-prefetched `codes`, n = code >> 2)."""
    at = self.chunk_of
    return pl.BlockSpec((SQUEEZED, SQUEEZED, self.key_dim, self.block_v),
                        lambda b, h, j, c, codes: (lax.shift_right_logical(codes[at(c)], np.int32(2)), h, _0, j))

  def chunk_states_spec(self):
    """The [K, BV] block of the state entering chunk c, in [B, HV, NC, K, V] (saved by the forward for the
    backward)."""
    at = self.chunk_of
    return pl.BlockSpec((SQUEEZED, SQUEEZED, SQUEEZED, self.key_dim, self.block_v),
                        lambda b, h, j, c, *_: (b, h, at(c), _0, j))


class Static(shell.Static):
  """The shell's description of one call (`pallas_kernels.delta_rule_shell.Static`; `config` a `config.Config`)
  and the kernels' `layout` of it."""

  @property
  def layout(self) -> Layout:
    c = self.config
    head_major = (c.layout == "head_major" if c.layout != "auto"
                  else self.key_dim % LANES != 0 or self.value_dim % LANES != 0)
    return Layout(batch=self.batch, length=self.length, heads=self.heads, kw_heads=self.kw_heads,
                  value_heads=self.value_heads, key_dim=self.key_dim, value_dim=self.value_dim,
                  block_v=c.value_block(self.value_dim), chunk=self.chunk, head_major=head_major,
                  packed=bool(self.segments))
