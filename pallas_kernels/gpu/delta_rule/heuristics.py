"""How the delta-rule kernels are launched for a request: every rule that turns a `Config` and a problem into
a chunk, a block width, a flag or a warp count, and the measured defaults those rules read (the largest chunks by
decay, dtype and K are the config's own, `Chunks.tuned`).

The numbers were measured on one NVIDIA H200 (docs/benchmarks.md, "Why the launch defaults are what they are"); a field set in the `Config`
overrides its rule. None of these choices changes the function computed, only its rounding and speed.
"""
from __future__ import annotations

from pallas_kernels.gpu.delta_rule.config import Config

CHANNEL_CHUNK = 16      # per-channel decay at every other key
SERIAL_CHUNK = 32       # per-channel decay when the state passes run few programs: fewer, longer chunks
FORWARD_CHUNK = 64      # per-channel decay, a forward that is not differentiated (unpacked)
STATE_PROGRAMS = 128    # below this many state-pass programs, their serial chunk loop is the critical path
STATE_TILE = 128 * 64   # the state passes' [K, BV] fp32 state tile holds at most this many elements
MIN_BLOCK = 16          # Triton dots need every dim ≥ 16


def serial(lanes: int, vdim: int) -> bool:
  """Whether the state passes run fewer than STATE_PROGRAMS programs even at BV = 16 (`lanes` rows of batch or
  packed segments × value heads, padded width `vdim`; 0: unknown, False)."""
  return bool(lanes and vdim and lanes * (vdim // MIN_BLOCK) < STATE_PROGRAMS)


def chunk(config: Config, decay: str, requested: int, *, dtype: str = "", kdim: int = 0, lanes: int = 0,
          vdim: int = 0) -> int:
  """The chunk the kernels run at under autodiff (never above `requested`, never below `Chunks.sub`)."""
  c = config.chunks
  if decay != "channel":
    cap = c.online if c.online is not None else dict(c.tuned).get((decay, dtype, kdim))
  elif serial(lanes, vdim):
    cap = c.channel_serial if c.channel_serial is not None else SERIAL_CHUNK
  else:
    cap = c.channel if c.channel is not None else dict(c.tuned).get((decay, dtype, kdim), CHANNEL_CHUNK)
  return requested if cap is None else min(requested, max(cap, c.sub))


def forward_chunk(config: Config, decay: str, requested: int, chunk: int, packed: bool) -> int:
  """The chunk of an undifferentiated per-channel forward (unpacked) when wider than `chunk`, the one `chunk`
  picked, and never above `requested`; else 0 (the forward runs at `chunk`)."""
  fwd = config.chunks.channel_forward
  wide = min(requested, FORWARD_CHUNK if fwd is None else fwd)
  return wide if (decay == "channel" and not packed and wide > chunk) else 0


def state_block_v(config: Config, vdim: int, kdim: int = 0, lanes: int = 0) -> int:
  """BV of the state passes: `State.block_v` clamped to V, the [K, BV] state tile kept ≤ STATE_TILE elements,
  then halved (to MIN_BLOCK at least) while lanes · V / BV < STATE_PROGRAMS."""
  bv = min(config.state.block_v, vdim)
  bv = max(min(bv, STATE_TILE // kdim), MIN_BLOCK) if kdim else bv
  while lanes and bv > MIN_BLOCK and lanes * (vdim // bv) < STATE_PROGRAMS:
    bv //= 2
  return bv


def predecay(config: Config, decay: str, lanes: int, vdim: int) -> bool:
  """Per-channel decay: whether the state passes read pre-decayed tiles. Default: where they run few programs."""
  if decay != "channel":
    return False
  p = config.state.predecay
  return serial(lanes, vdim) if p is None else bool(p)


def fuse_inter(config: Config, *, kdim: int, state_itemsize: int, chunk: int, programs: int) -> bool:
  """Whether the forward state pass forms the inter-chunk output. Default: where the chunk states [NC·K, V] in
  the state dtype would outweigh the fp32 output [T, V] and the pass runs at least STATE_PROGRAMS programs
  (with fewer, the extra dot lengthens the serial loop that bounds the forward)."""
  f = config.state.fuse_inter
  if f is None:
    return kdim * state_itemsize > 4 * chunk and programs >= STATE_PROGRAMS
  return bool(f)


def stages(config: Config, kdim: int, vdim: int, bf16_matmuls: bool) -> int:
  """Triton num_stages: 1 when K or V > 128 or the intermediates are fp32 (pipelined buffers would exceed an
  H200's 232 KB of shared memory), else `Config.stages`."""
  return 1 if max(kdim, vdim) > 128 or not bf16_matmuls else config.stages


def prep_warps(config: Config, decay: str, bf16_matmuls: bool, source: str) -> int:
  """num_warps of prep / inverse / wu; source "gram" | "a" (T from `scores`' A) | "t" (T given)."""
  p = config.prep
  if not bf16_matmuls:
    return p.warps_fp32
  if decay != "channel":
    return p.warps
  return p.warps_given_a if source == "a" else p.warps_channel


def grad_block_v(config: Config, vdim: int, bf16_matmuls: bool) -> int:
  """V step of `grads_state` and `grads_intra`, clamped to V (fp32 tiles spill at the bf16 width)."""
  g = config.grads
  return min(g.block_v if bf16_matmuls else g.block_v_fp32, vdim)
