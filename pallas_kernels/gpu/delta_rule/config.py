"""Launch parameters of the delta-rule kernels, one small frozen dataclass per kernel family.

They change speed, not the function (up to fp32 summation order and the chunk's rounding; `Repair.enabled`
changes it on non-finite inputs only). A field left None is decided by `heuristics.py` from the request and the
config's measured defaults (`Chunks.tuned`). `TUNING` holds the configs by device kind, `default_config` reads it.
`Config.override` takes "family.field=value" strings (the benchmark runner's variants).
"""
from __future__ import annotations

import dataclasses

from pallas_kernels.arrays import tuning_entry
from pallas_kernels.gpu import common
from pallas_kernels.gpu.common import MAX_DIM
from pallas_kernels.spec import CHUNK_SIZES, is_pow2

FP32_DOTS = ("ieee", "tf32x3", "tf32")


def _check(obj, pow2=(), in_range=(), choices=()):
  """ValueError naming `Family.field` for a field that is not a power of two, out of [lo, hi] or not a choice."""
  name = type(obj).__name__
  for f in pow2:
    if not is_pow2(getattr(obj, f)):
      raise ValueError(f"{name}.{f}={getattr(obj, f)!r} must be a power of two")
  for f, lo, hi in in_range:
    if not lo <= getattr(obj, f) <= hi:
      raise ValueError(f"{name}.{f}={getattr(obj, f)!r} must be in [{lo}, {hi}]")
  for f, allowed in choices:
    if getattr(obj, f) not in allowed:
      raise ValueError(f"{name}.{f}={getattr(obj, f)!r} must be one of {allowed}")


# The largest chunk under autodiff measured on one H200, by (decay, input dtype, padded K); a missing key means the
# requested chunk (decay none / scalar) or `heuristics.CHANNEL_CHUNK`. fp32 prep tiles at chunk 64 cost more than
# four chunks of 16 at K ≥ 128; per-channel decay keeps every sub-block's factors live, which only bf16 at K = 128
# affords at 32.
H200_CHUNKS = ((("none", "float32", 128), 16), (("none", "float32", 256), 16),
               (("scalar", "float32", 128), 16), (("scalar", "float32", 256), 16),
               (("channel", "bfloat16", 128), 32))


@dataclasses.dataclass(frozen=True)
class Chunks:
  """The chunk the kernels run at (`heuristics.chunk`, `heuristics.forward_chunk`); None: `tuned`."""
  sub: int = 16                         # rows of the substitution and per-channel sub-blocks (16 or 32)
  online: int | None = None             # decay none / scalar: the largest chunk
  channel: int | None = None            # per-channel decay under autodiff: the largest chunk (16 or 32)
  channel_serial: int | None = None     # the same when the state passes run few programs (`heuristics.serial`)
  channel_forward: int | None = None    # per-channel, undifferentiated and unpacked: the chunk (0: as under autodiff)
  tuned: tuple = H200_CHUNKS            # ((decay, dtype, padded K), largest chunk) pairs, the measured defaults

  def __post_init__(self):
    _check(self, choices=[("sub", (16, 32)), ("online", (None, *CHUNK_SIZES)), ("channel", (None, 16, 32)),
                          ("channel_serial", (None, *CHUNK_SIZES)), ("channel_forward", (None, 0, *CHUNK_SIZES))])


@dataclasses.dataclass(frozen=True)
class Prep:
  """`prep`, `inverse` and the backward's `wu`: T = (I + A)⁻¹ and W, U per chunk, grid (B, HV, NC)."""
  warps: int = 2                        # num_warps, decay none / scalar, bf16 intermediates
  warps_channel: int = 2                # num_warps, per-channel decay, T from the Gram blocks
  warps_given_a: int = 2                # num_warps, per-channel decay, T from `scores`' A
  warps_fp32: int = 8                   # num_warps with fp32 intermediates, every decay (≥ 4: Triton miscompiles 2)

  def __post_init__(self):
    _check(self, pow2=("warps", "warps_channel", "warps_given_a", "warps_fp32"))
    if self.warps_fp32 < 4:
      raise ValueError(f"Prep.warps_fp32={self.warps_fp32} must be ≥ 4 (at 2, Triton computed wrong W, U in the "
                       "fp32 prep at K = 128)")


@dataclasses.dataclass(frozen=True)
class Scores:
  """`scores`: per-channel decay's Gram and output scores per chunk of two sub-blocks or more."""
  warps: int = 2                        # num_warps
  block_k: int = 32                     # K columns per step of its loop
  tiles: bool = True                    # also store K⊙e^G, Q⊙e^G, K̃⊙e^{G_C−G}, G_C for prep, output, state pass

  def __post_init__(self):
    _check(self, pow2=("warps", "block_k"), in_range=[("block_k", 16, 64)])


@dataclasses.dataclass(frozen=True)
class State:
  """The sequential state passes (forward `state_fwd`, reverse `state_bwd`), grid (B, HV, V/BV)."""
  block_v: int = 64                     # V columns per program before `heuristics.state_block_v`'s caps
  warps: int = 4                        # num_warps
  predecay: bool | None = None          # per-channel: read K̃⊙e^{G_C−G}, Q⊙e^G from `decayed_tiles`
  fuse_inter: bool | None = None        # the forward pass also forms (Q⊙e^G) S_in instead of storing S_in

  def __post_init__(self):
    _check(self, pow2=("block_v", "warps"), in_range=[("block_v", 16, MAX_DIM)],
           choices=[("predecay", (None, True, False)), ("fuse_inter", (None, True, False))])


@dataclasses.dataclass(frozen=True)
class Output:
  """The chunk-parallel `output`, `dv_local` and `decayed_tiles` kernels."""
  block_v: int = 128                    # V columns per program of `output` and `dv_local`
  warps: int = 4                        # num_warps

  def __post_init__(self):
    _check(self, pow2=("block_v", "warps"), in_range=[("block_v", 16, MAX_DIM)])


@dataclasses.dataclass(frozen=True)
class Repair:
  """`repair`: the rows of a fault's chunk before the fault (the function differs only on non-finite inputs)."""
  enabled: bool = True                  # False: those rows stay non-finite (benchmarks of the launch's cost)
  warps: int = 4                        # num_warps

  def __post_init__(self):
    _check(self, pow2=("warps",), choices=[("enabled", (True, False))])


@dataclasses.dataclass(frozen=True)
class Grads:
  """The gradient kernels `grads_state`, `grads_intra`, `grads_finish` (decay none / scalar), `grads_pairs`."""
  block_v: int = 128                    # V step of `grads_state` and `grads_intra`, bf16 intermediates
  block_v_fp32: int = 32                # the same with fp32 intermediates
  block_k: int = 64                     # K columns per program of `grads_state`, `grads_finish`, `grads_pairs`
  block_k_pairs: int = 64               # K step inside `grads_pairs`
  warps_state: int = 4                  # num_warps of `grads_state`
  warps_intra: int = 8                  # num_warps of `grads_intra`
  warps_finish: int = 4                 # num_warps of `grads_finish`
  warps_pairs: int = 4                  # num_warps of `grads_pairs`

  def __post_init__(self):
    _check(self, pow2=("block_v", "block_v_fp32", "block_k", "block_k_pairs", "warps_state", "warps_intra",
                       "warps_finish", "warps_pairs"),
           in_range=[("block_v", 16, MAX_DIM), ("block_v_fp32", 16, MAX_DIM), ("block_k", 16, MAX_DIM),
                     ("block_k_pairs", 16, 64)])


@dataclasses.dataclass(frozen=True)
class Diagonal:
  """Per-channel decay's s×s diagonal sub-blocks in `prep`, `output` and `dv_local` (`intra.Channel`)."""
  block_k: int = 16                     # K step of the pairwise [s, s, kc] tensors
  factor: bool = True                   # factor a block through its middle row where the decays allow

  def __post_init__(self):
    _check(self, pow2=("block_k",), in_range=[("block_k", 16, 64)])


@dataclasses.dataclass(frozen=True)
class Dots:
  """How the kernels' fp32 dots run when compiled ("ieee", "tf32x3", "tf32"); interpret mode is always IEEE."""
  fp32: str = "tf32x3"                  # with fp32 inputs (or bf16 inputs without `Config.bf16_matmuls`)
  bf16: str = "tf32"                    # with bf16 inputs: the dots that build T = (I + A)⁻¹ and dA

  def __post_init__(self):
    _check(self, choices=[("fp32", FP32_DOTS), ("bf16", FP32_DOTS)])


@dataclasses.dataclass(frozen=True)
class Config:
  """Every launch parameter of the delta-rule kernels, by kernel family."""
  chunks: Chunks = Chunks()
  prep: Prep = Prep()
  scores: Scores = Scores()
  state: State = State()
  output: Output = Output()
  repair: Repair = Repair()
  grads: Grads = Grads()
  diagonal: Diagonal = Diagonal()
  dots: Dots = Dots()
  stages: int = 3                       # Triton num_stages where `heuristics.stages` allows pipelining
  bf16_matmuls: bool = True             # bf16 inputs: bf16 operands for the dots that do not build T or dA

  def __post_init__(self):
    if not isinstance(self.stages, int) or self.stages < 1:
      raise ValueError(f"Config.stages={self.stages!r} must be an int ≥ 1")

  def check(self, chunk: int) -> None:
    """ValueError unless `chunk` is a supported chunk size that the sub-block rows divide."""
    if chunk not in CHUNK_SIZES:
      raise ValueError(f"chunk_size={chunk} must be one of {CHUNK_SIZES}")
    if chunk % self.chunks.sub:
      raise ValueError(f"Chunks.sub={self.chunks.sub} must divide chunk_size={chunk}")

  def override(self, *assignments: str, **values) -> "Config":
    """A copy with fields replaced: "family.field=value" strings and/or keyword arguments family__field
    (`common.override`). Invalid values raise the family's ValueError."""
    return common.override(self, *assignments, **values)


DEFAULT = Config()

# By device kind (a substring of `jax.Device.device_kind`; "interpret": Pallas interpret mode). Measured on an H200
# (docs/benchmarks.md); other GPUs take its entry until measured.
TUNING = {"H200": DEFAULT, "interpret": DEFAULT}


def default_config(spec=None, device_kind: str | None = None) -> Config:
  """The tuning table's config for `device_kind` (the first entry whose key it contains), else DEFAULT. Every
  entry holds for every request (`spec`, unused here): the rules that depend on it are `heuristics`'."""
  del spec
  return tuning_entry(TUNING, device_kind, DEFAULT)
