"""The static description of one kernel problem and the BlockSpecs of the arrays the kernels exchange.

Arrays (T padded to a multiple of the chunk C, K and V padded to powers of two ≥ 16):
  token-major (the caller's layout): q, k [B, T, H, K]; k_write [B, T, Hkw, K] (Hkw = H or HV);
    v, o, dO [B, T, HV, V]; per-channel G and dG [B, T, HV, K]; dq, dk, dk_write, dv per value head.
  head-major (kernel intermediates): W [B, HV, T, K]; U, V_new, dV_local, dV_new [B, HV, T, V];
    T = (I + A)⁻¹ [B, HV, T, C] (the rows of each chunk's C×C block); β, scalar G, dβ, dG [B, HV, T].
  states: S_in and dS_out per chunk [B, HV, NC·K, V] (chunk c at rows c·K …); S0, S_T [B, HV, K, V].
  C×C per chunk, head-major [B, HV, T, C]: T = (I + A)⁻¹ and (per-channel backward) dM, dA.
  partial sums over the programs of a split grid axis: [NP, B, HV, T] (summed in XLA).

Grids: chunk-parallel kernels (B, HV, NC), (B, HV, NC, NV) or (B, HV, NC, NK); sequential state passes
(B, HV, NV), packed (N lanes, HV, NV) over the one row (`pallas_kernels/packed.py`).
Value head h reads key head h // (HV / H) and write-key head h // (HV / Hkw).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import delta_rule_shell as shell
from pallas_kernels.gpu.common import SQUEEZED as _SQ
from pallas_kernels.gpu.delta_rule import heuristics


class Static(shell.Static):
  """The shell's description of one call (`pallas_kernels.delta_rule_shell.Static`; `config` a
  `config.Config`) with the launch properties this backend derives from it. `bf16_matmuls` also stores the
  intermediates (W, U, V_new, chunk states, their gradients) in bf16; `grad_dtype`: the backward writes dq, dk,
  dk_write, dv in it where the wrapper does not sum head groups afterwards (no fp32 round trip through HBM);
  `forward_chunk`: `heuristics.forward_chunk`. Packed (`segments` N), the state passes run one lane per segment
  (`chunk_info`)."""

  @property
  def mm(self):
    """The operand dtype of the dots outside the triangular system, and of the stored intermediates."""
    return jnp.bfloat16 if self.bf16_matmuls else jnp.float32

  def lo(self, x):
    return x.astype(self.mm)

  @property
  def fp32_dots(self):
    """How the kernels' fp32 dots run when compiled (`Dots.bf16` for bf16 inputs under `bf16_matmuls`, else
    `Dots.fp32`)."""
    return self.config.dots.bf16 if self.bf16_matmuls else self.config.dots.fp32

  @property
  def dq_dtype(self):
    """dtype of the backward's dq, dk: fp32 under GVA (summed over each key head's group later)."""
    return jnp.dtype(self.grad_dtype) if self.value_heads == self.heads else jnp.dtype(jnp.float32)

  @property
  def dkw_dtype(self):
    """dtype of the backward's dk_write: fp32 when k_write has fewer heads than v (summed later)."""
    return jnp.dtype(self.grad_dtype) if self.value_heads == self.kw_heads else jnp.dtype(jnp.float32)

  @property
  def num_chunks(self) -> int:
    return self.length // self.chunk

  @property
  def sub(self) -> int:
    return self.config.chunks.sub

  @property
  def num_sub(self) -> int:
    return self.chunk // self.sub

  def key_head(self, h):
    return lax.div(h, jnp.asarray(self.value_heads // self.heads, h.dtype))

  def kw_head(self, h):
    return lax.div(h, jnp.asarray(self.value_heads // self.kw_heads, h.dtype))

  @property
  def stages(self) -> int:
    """Triton num_stages of the chunk-parallel kernels (`heuristics.stages`)."""
    return heuristics.stages(self.config, self.key_dim, self.value_dim, self.bf16_matmuls)

  @property
  def state_stages(self) -> int:
    """num_stages of the state passes: `stages`, but 1 when packed (the per-segment initial state, a [K, BV]
    fp32 load inside the chunk loop, would be pipelined too and exceed shared memory)."""
    return 1 if self.segments else self.stages

  @property
  def state_lanes(self) -> int:
    """Independent rows of the sequential state passes: (batch rows or packed segments) × value heads."""
    return (self.segments or self.batch) * self.value_heads

  @property
  def state_block_v(self) -> int:
    """BV of the state passes (`heuristics.state_block_v`)."""
    return heuristics.state_block_v(self.config, self.value_dim, self.key_dim, self.state_lanes)

  @property
  def predecay(self) -> bool:
    """Per-channel decay: the state passes read pre-decayed K̃ (and Q) tiles (`heuristics.predecay`)."""
    return heuristics.predecay(self.config, self.decay, self.state_lanes, self.value_dim)

  @property
  def scores_first(self) -> bool:
    """Per-channel decay at a chunk of two sub-blocks or more: the forward forms the chunk's Gram A and its
    intra output scores in a kernel of their own (`scores`); prep inverts the given A and the output kernel
    reads the scores (neither then holds every sub-block's factored operands)."""
    return self.decay == "channel" and self.num_sub > 1

  @property
  def grad_block_v(self) -> int:
    """V step of `grads_state` and `grads_intra` (`heuristics.grad_block_v`)."""
    return heuristics.grad_block_v(self.config, self.value_dim, self.bf16_matmuls)

  @property
  def fuse_inter(self) -> bool:
    """The forward's state pass also forms the inter-chunk output (`heuristics.fuse_inter`)."""
    programs = self.state_lanes * (self.value_dim // self.state_block_v)
    return heuristics.fuse_inter(self.config, kdim=self.key_dim, state_itemsize=jnp.dtype(self.mm).itemsize,
                                 chunk=self.chunk, programs=programs)

  def k_block(self, width: int) -> int:
    """A K block of `width` columns clamped to the padded K."""
    return min(width, self.key_dim)

  def v_block(self, width: int) -> int:
    """A V block of `width` columns clamped to the padded V."""
    return min(width, self.value_dim)


# BlockSpecs. `where(*grid_indices)` returns (b, h, c, iv): batch, value head, chunk (None: whole sequence)
# and V block (None: whole width); `head` maps the value head to the array's head. Arrays whose last axis is
# V and is split over the grid's V blocks pass split=True (their block width is then the V block).
def _col(iv, split):
  return iv if (split and iv is not None) else 0


def tokens(st: Static, width: int, where, head=None, whole=False, split=False):
  """[B, T, heads, width] token-major: one chunk (or the whole sequence) of one head."""
  rows = st.length if whole else st.chunk
  head = head or (lambda h: h)

  def index(*g):
    b, h, c, iv = where(*g)
    return b, (0 if whole else c), head(h), _col(iv, split)

  return pl.BlockSpec((_SQ, rows, _SQ, width), index)


def head_major(st: Static, width: int, where, whole=False, split=False):
  """[B, HV, T, width] head-major: one chunk (or the whole sequence)."""
  rows = st.length if whole else st.chunk

  def index(*g):
    b, h, c, iv = where(*g)
    return b, h, (0 if whole else c), _col(iv, split)

  return pl.BlockSpec((_SQ, _SQ, rows, width), index)


def vector(st: Static, where, whole=False):
  """[B, HV, T]: one chunk (or the whole sequence) of per-token scalars."""
  rows = st.length if whole else st.chunk

  def index(*g):
    b, h, c, _ = where(*g)
    return b, h, (0 if whole else c)

  return pl.BlockSpec((_SQ, _SQ, rows), index)


def states(st: Static, width: int, where, whole=False):
  """[B, HV, NC·K, V] per-chunk states: chunk c's K×width block (or all chunks), split over V blocks."""
  rows = st.num_chunks * st.key_dim if whole else st.key_dim

  def index(*g):
    b, h, c, iv = where(*g)
    return b, h, (0 if whole else c), _col(iv, True)

  return pl.BlockSpec((_SQ, _SQ, rows, width), index)


def states_k(st: Static, rows: int, where):
  """[B, HV, NC·K, V] per-chunk states: chunk c's K block iv (rows × V, all V) for grids split over K."""
  nk = st.key_dim // rows

  def index(*g):
    b, h, c, ik = where(*g)
    return b, h, c * nk + ik, 0

  return pl.BlockSpec((_SQ, _SQ, rows, st.value_dim), index)


def parts(st: Static, where):
  """[NP, B, HV, T] per-token scalars, one partial sum per program of the grid's last axis (summed in XLA)."""

  def index(*g):
    b, h, c, ip = where(*g)
    return ip, b, h, c

  return pl.BlockSpec((_SQ, _SQ, _SQ, st.chunk), index)


def state(st: Static, width: int, where):
  """[B, HV, K, V]: one head's state, one V block. Packed: [1, HV, N·K, V], every segment's state (segment n
  at rows n·K …)."""

  def index(*g):
    b, h, _, iv = where(*g)
    return b, h, 0, _col(iv, True)

  return pl.BlockSpec((_SQ, _SQ, max(st.segments, 1) * st.key_dim, width), index)


def chunk_info(st: Static):
  """[NC + N + 1] int32 (packed only): per chunk, segment << 2 | (last chunk of it) << 1 | (first chunk of it);
  then the lane bounds (the first chunk of each segment, and NC)."""
  return pl.BlockSpec((st.num_chunks + st.segments + 1,), lambda *g: (0,))


def lane_bounds(st: Static, info_ref):
  """[first, end) chunks of this program's lane (packed state passes; the grid's first axis is the lane)."""
  p = pl.program_id(0)
  return info_ref[st.num_chunks + p], info_ref[st.num_chunks + p + 1]


def decode_chunk_info(code):
  """(segment, first, last) of one `chunk_info` entry (in-kernel scalars)."""
  return code >> 2, (code & 1) == 1, (code & 2) == 2


def decay_spec(st: Static, where, whole=False, width=None):
  """The cumulative log-decay G: scalar [B, HV, T] or per channel [B, T, HV, K] (a K block of `width` columns,
  the grid's last index, when given)."""
  if st.decay == "scalar":
    return vector(st, where, whole)
  if width is not None:
    return tokens(st, width, where, whole=whole, split=True)
  return tokens(st, st.key_dim, where, whole=whole)


def chunk_ends(st: Static, where, whole=False):
  """[B, HV, NC, K] per-channel G at each chunk's last token, G_C: one chunk's row (or every chunk's)."""
  def index(*g):
    b, h, c, _ = where(*g)
    return b, h, (0 if whole else c), 0

  return pl.BlockSpec((_SQ, _SQ, st.num_chunks if whole else _SQ, st.key_dim), index)


# Grid → (b, h, c, iv) for the three grid shapes.
def chunk_grid(b, h, c):
  return b, h, c, None


def chunk_v_grid(b, h, c, iv):
  return b, h, c, iv


def seq_grid(b, h, iv):
  return b, h, None, iv


def lane_grid(lane, h, iv):
  del lane                                  # every lane reads and writes parts of batch row 0
  return 0, h, None, iv


def state_pass_grid(st: Static):
  """(grid, where) of the sequential state passes: (B, HV, V/bv), packed (N lanes, HV, V/bv)."""
  bv = st.state_block_v
  lead = st.segments or st.batch
  return (lead, st.value_heads, st.value_dim // bv), (lane_grid if st.segments else seq_grid)


def state_pass_outputs(st: Static, bv: int, w, inter: bool = False):
  """(out_specs, out_shape) of both sequential state passes: a per-token [B, HV, T, V] array and the per-chunk
  states [B, HV, NC·K, V] in st.mm (inter: instead the inter-chunk output [B, T, HV, V] fp32), and the fp32
  state(s) of `state` ([B, HV, K, V]; packed [1, HV, N·K, V])."""
  hv = (st.batch, st.value_heads)
  specs = [head_major(st, bv, w, whole=True, split=True),
           tokens(st, bv, w, whole=True, split=True) if inter else states(st, bv, w, whole=True),
           state(st, bv, w)]
  middle = (jax.ShapeDtypeStruct((st.batch, st.length, st.value_heads, st.value_dim), jnp.float32) if inter
            else jax.ShapeDtypeStruct((*hv, st.num_chunks * st.key_dim, st.value_dim), st.mm))
  shapes = [jax.ShapeDtypeStruct((*hv, st.length, st.value_dim), st.mm), middle,
            jax.ShapeDtypeStruct((*hv, max(st.segments, 1) * st.key_dim, st.value_dim), jnp.float32)]
  return specs, shapes


def f32(shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


def key_grads(st: Static, n_k: int):
  """Out shapes of the finishing kernels' dq, dk (and dk_write when n_k = 3), [B, T, HV, K]."""
  shape = (st.batch, st.length, st.value_heads, st.key_dim)
  dtypes = [st.dq_dtype, st.dq_dtype, st.dkw_dtype][:n_k]
  return [jax.ShapeDtypeStruct(shape, d) for d in dtypes]


def launch_finish(st: Static, kernel, *, bk: int, in_specs, args, extra_specs, extra_shapes, warps: int, name: str):
  """Runs a finishing gradient kernel, grid (B, HV, NC, K/BK), whose outputs are dq, dk (and dk_write unless
  k_write is k), each a K block of [B, T, HV, K], then `extra_specs` / `extra_shapes`. Returns (dq, dk, dk_write
  or None, *extras)."""
  from pallas_kernels.gpu.common import pallas_call
  n_k = 2 if st.same_keys else 3
  ktok = tokens(st, bk, chunk_v_grid, split=True)
  outs = pallas_call(lambda *refs: kernel(st, *refs), grid=(st.batch, st.value_heads, st.num_chunks, st.key_dim // bk),
                     in_specs=in_specs, out_specs=[ktok] * n_k + list(extra_specs),
                     out_shape=key_grads(st, n_k) + list(extra_shapes), interpret=st.interpret, num_warps=warps,
                     num_stages=st.stages, fp32_dots=st.fp32_dots, name=name)(*args)
  return (outs[0], outs[1], outs[2] if n_k == 3 else None, *outs[n_k:])
