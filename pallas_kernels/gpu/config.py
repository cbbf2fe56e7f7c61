"""Block sizes and launch parameters of the GPU delta-rule kernels, and the JAX-version guards.

Every kernel is launched through `pl.pallas_call` with `pltriton.CompilerParams` given explicitly: in JAX
0.11 a bare `pallas_call` on GPU goes to Mosaic GPU, and these kernels are written for the Triton lowering. On
a CPU backend the same kernels run with `interpret=True` (the compiler parameters are then ignored).
"""
from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# JAX ≤ 0.4.3x called the class TritonCompilerParams; 0.10 and 0.11 call it CompilerParams.
_TRITON_PARAMS = getattr(pltriton, "CompilerParams", None) or getattr(pltriton, "TritonCompilerParams")

MAX_DIM = 256                 # largest supported K and V (after padding to a power of two)
CHUNK_SIZES = (16, 32, 64, 128)
STATE_TILE = 128 * 64         # largest [K, BV] state tile of the state passes (fp32 registers)
# The state passes' BV shrinks (to 16 at least) until they run at least this many programs: with few (batch,
# head) rows the serial chunk loop of each program is the whole kernel. H200, B=1 T=32768 HV=8 K=V=128
# (profile_pallas --sweep state_pass,state_bwd, one run each): state_fwd 1.214 ms at BV 64 (16 programs),
# 0.932 at 32 (2 warps), 0.794 at 16; state_bwd 1.351 at 64, 1.107 at 32, 0.910 at 16; whole forward /
# backward 1.555 / 3.772 → 1.169 / 2.908 ms at 16.
STATE_PROGRAMS = 128


def _pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


def padded_dim(d: int) -> int:
  """The power of two ≥ max(d, 16) that K or V is padded to (Triton dots need every dim ≥ 16)."""
  p = 16
  while p < d:
    p *= 2
  return p


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes and launch parameters. They change speed, not numerics (up to fp32 summation order).

  sub:          rows of the forward-substitution blocks of (I + A)⁻¹ and of the per-channel sub-blocks
                (pairwise exponents on the diagonal ones); divides the chunk.
  block_v_state: V columns per program of the two sequential state passes (forward and reverse).
  state_k_piece: rows of each piece the forward state pass keeps the [K, BV] state in (0: one tile): W S_in
                is then a sum of independent [C, piece] × [piece, BV] dots, and each piece is updated on its own.
                H200, B=1 T=32768 H=8 K=V=128, DeltaNet state pass (profile_pallas, one run): 0.814 ms as one
                tile, 0.796 at 64, 0.892 at 32: no use; what took it to 0.46 ms was letting K̃ load straight into
                its dot (docs/benchmarks.md, eighth session).
  predecay:     per-channel decay: a chunk-parallel kernel (`delta_rule_fwd.decayed_tiles`) forms K̃ ⊙ e^{G_C − G}
                (and, for the reverse pass, Q ⊙ e^G) in the state dtype, and the sequential state passes load
                those tiles straight into their dots instead of scaling K̃ and Q at every chunk step (the same
                bf16 operands, so the same rounding); this costs [T, K] written and read twice. "auto"
                (`layout.Static.predecay`): when the state passes run few programs (the `chunk_for` serial
                case), where their chunk loop is the critical path. H200, KDA, profile_pallas --runs 10, off →
                on: B=1 T=32768 H=8 K=V=128 (chunk 32), whole forward 3.410 → 3.081 ms, backward 8.069 →
                6.812; B=4 T=4096 H=16 (chunk 16), forward 1.223 → 1.258, backward 4.456 → 4.667. With it the
                reverse pass loads only G's last row per chunk, not the [C, K] tile (B=1 T=32768 H=8, forward+
                backward, `kernel_times`: state_bwd 2.094 → 1.718 ms, all kernels 6.986 → 6.607).
  block_v_out:  V columns per program of the output kernel and of the local-dv kernel.
  block_v_grad: V columns per step of the V loops of the gradient kernels (`grads_state`, `grads_intra`).
  block_v_grad_fp32: the same when the intermediates are fp32. H200, KDA fp32 B=4 T=4096 H=16 K=V=128 (chunk 16),
                forward+backward (`compare_blocks e2e --dtype fp32`, one run): 31.2 ms at 128 (`grads_state` 19.7
                of it), 13.5 at 64, 12.5 at 32.
  block_k_grad: K columns per program of `grads_state`, `grads_finish` (decay none / scalar) and
                `grads_pairs` (per channel).
  block_k_diag: K columns per step of the per-channel diagonal sub-blocks of the score kernels (prep, output,
                dv_local) when they run pairwise, as [sub, sub, block_k_diag] tensors (larger: fewer steps, more
                registers).
  block_k_pairs: the same K step in `grads_pairs`. 64: with factored diagonal blocks (`factor_diag`) the step
                is a few dots; H200, KDA B=4 T=4096 H=16 K=128: grads_pairs 1.17 ms at 64 with 4 warps,
                2.96 ms at 16 with 4 warps, 6.87 ms at 16 with 8 warps.
  block_k_scores: the K step of the per-channel `scores` kernel (its [C, step] operands and its four [C, C]
                accumulators share the registers).
  warps_*:      Triton num_warps of the chunk-parallel forward kernels (chunk), of `prep` (prep; per-channel
                decay: prep_channel, 2: 0.48 ms against 0.79 ms at 4 on the shape above), of the state passes
                (state), of `grads_state` (grad_state), of `grads_intra` (grad), of `grads_pairs` (pairs), of
                `grads_finish` (finish), of the per-channel `scores` kernel (scores; H200, KDA chunk 32, whole
                forward B=4 T=4096 H=16: 1.409 ms at 2, 1.613 at 4) and of `prep` after it (prep_scores: it
                then inverts a given A and forms W, U from `scores`' decayed K; H200, KDA bf16 forward end to
                end at chunk 64, `compare_blocks e2e`, one run: B=4 T=4096 H=16 0.975 ms at 4, 0.955 at 2;
                B=1 T=32768 H=8 1.451 at 4, 1.433 at 2. Before `scores_tiles`, when prep formed K ⊙ e^G
                itself, 4 was faster: 0.349 ms against 0.441 at 2).
  warps_prep_fp32: num_warps of prep, `inverse` and the backward's `wu` (every decay) when the intermediates are
                fp32 (fp32 inputs, or bf16 without `bf16_matmuls`): their fp32 [C, K] tiles spill at 2 warps.
                H200, fp32, B=4 T=4096 H=16 K=V=128 (`kernel_times`, `compare_blocks e2e --dtype fp32`, one run,
                ms): DeltaNet prep 9.19 and wu 6.14 at 2 warps, whole forward 10.52 → 2.71 at 8 (3.35 at 4),
                forward+backward 22.89 → 13.58; GDN forward+backward 17.05 → 11.36. At 2 warps and K = 128 the
                prep that does not store T also computed wrong W, U (relative RMS 0.27 from row 52 of the first
                chunk on; the same kernel storing T, or at 8 warps, agreed exactly): values below 4 are refused.
  stages:       Triton num_stages (software pipelining of the loops); `layout.Static.stages` runs 1 instead
                with fp32 intermediates or K, V > 128 (shared memory).
  chunk_channel_forward: per-channel decay, unpacked: the chunk of a forward that is not differentiated (the
                custom_vjp's primal: inference, evaluation), at most the requested chunk_size; 0: the same chunk
                as under autodiff. The forward with residuals and the backward keep `chunk_for`'s chunk (their
                kernels hold every sub-block at once); at 64 the forward runs `delta_rule_fwd.scores` first and
                its serial state pass takes a quarter of chunk 16's steps. H200, KDA bf16 (`compare_blocks chunks`,
                one run, whole forward): B=4 T=4096 H=16 K=V=128 chunk 16 1.22, 32 1.202, 64 0.993 ms;
                B=1 T=32768 H=8 chunk 32 1.905, 64 1.561 ms.
  split_prep:   the forward forms T = (I + A)⁻¹ in one kernel (`inverse`) and W, U from it in a second (the
                backward's `wu`), instead of one `prep` kernel holding the Gram blocks, T and W, U at once.
                Off: on an H200 (B=4 T=4096 H=16 K=128) the split forward took 0.705 ms against 0.684 ms.
  scores_tiles: per-channel decay with `scores` (a chunk of two sub-blocks or more, not `fuse_inter`): its K
                steps also store the decayed operands K ⊙ e^G, Q ⊙ e^G, K̃ ⊙ e^{G_C − G} [B, HV, T, K] in the
                state dtype and G_C per chunk, which prep, output and the state pass then load straight into
                their dots (G is read once and dies after `scores`; the same roundings, so the same results).
                H200, KDA bf16 forward at chunk 64 (`compare_blocks e2e`, one run, off → on): B=4 T=4096 H=16
                1.072 → 0.964 ms, B=1 T=32768 H=8 1.553 → 1.447 ms (`kernel_times`: scores 0.30 → 0.42, prep
                0.30 → 0.20, state pass 0.22 → 0.15, output 0.15 → 0.10 ms at B=4).
  fuse_inter:   the forward's state pass also forms each chunk's inter-chunk output (Q⊙e^G) S_in, fp32
                [B, T, HV, V], and no longer writes the chunk states [B, HV, NC·K, V]; the output kernel adds
                the intra-chunk part. "auto" (`layout.Static.fuse_inter`): fuse when the chunk states would be
                the larger array (K · size of the state dtype > 4 · chunk) and the state pass runs at least
                STATE_PROGRAMS programs. H200, KDA chunk 16 (profile_pallas, one run each): B=4 T=4096 H=16
                K=V=128, whole forward 1.376 → 1.240 ms, temp 671 → 268 MB; B=1 T=32768 H=8 (64 programs),
                3.251 → 4.987 ms (the extra dot lengthens the serial loop). DeltaNet, chunk 64: 0.541 → 0.560
                ms, 268 MB either way.
  factor_diag:  per-channel decay: the diagonal s×s blocks run as dots of factored operands whenever the
                chunk's decays keep every factor ≤ e^40 (checked per program at run time; `intra.Channel`);
                False: always the pairwise [s, s, kc] tensors.
  fp32_dots:    how the fp32 dots (those that build T = (I + A)⁻¹ and dA = −Tᵀ dT Tᵀ; every dot with fp32
                inputs) run when compiled: "tf32x3" (tensor cores, three TF32 products, about fp32 accuracy)
                or "ieee" (exact fp32 on the FMA units, several times slower). Interpret mode is always IEEE.
  fp32_dots_bf16: the same for bf16 inputs under `bf16_matmuls` (layout.Static.low_precision), whose operands
                already carry 8-bit mantissas: "tf32" (one TF32 product, FLA's precision for these dots),
                "tf32x3" or "ieee". H200, bf16 (`compare_blocks e2e`, one run, tf32x3 → tf32, ms fwd / fwd+bwd):
                B=4 T=4096 H=16 K=V=128 DeltaNet 0.429 → 0.413 / 1.801 → 1.711, KDA 1.314 → 1.221 / 5.114 →
                4.881; B=1 T=32768 H=8 KDA 2.249 → 2.144 / 7.655 → 7.410. Errors against fp32 XLA on the same
                bf16 inputs unchanged to two digits (≤ 5.4e-3, `check_pallas_gpu --check-variant tf32`).
  chunk_channel: the largest chunk the per-channel kernels run at under autodiff: per-channel decay solves
                with chunk min(chunk_size, chunk_channel) (the chunk changes rounding only, not the function).
                At 32 the forward forms the Gram and scores in `scores` first, and the backward stores half
                the chunk states (S_in and dS, [B, HV, NC·K, V]) of chunk 16. "auto": 32 for 16-bit inputs at
                padded K = 128, else 16. H200, KDA forward+backward (`compare_blocks e2e`, bf16, one run, chunk
                16 against 32, ms / MB of temp + outputs): B=4 T=4096 H=16 K=V=128 4.842 / 2031 against 4.607
                / 1511; B=1 T=16384 H=16 K=V=128 7.036 / 2031 against 6.184 / 1511; B=4 T=4096 H=16 K=V=64
                2.292 / 756 against 2.433 / 640; B=2 T=4096 H=16 K=V=256 7.016 / 3096 against 7.934 / 2031.
                fp32 at B=4 T=4096 H=16 K=V=128, before `block_v_grad_fp32`: 30.8 ms at 16, 54.0 at 32. 64 is
                refused: bf16 at that shape asked 238 KB of shared memory (232 KB on an H200).
  chunk_fp32:   decay none / scalar with fp32 inputs at padded K ≥ 128: the largest chunk (64 keeps the
                requested one). The fp32 prep's [C, K] tiles at chunk 64 cost more than the extra chunks of 16.
                H200 DeltaNet (`check_pallas_gpu --time-dtypes fp32 --chunk C`, pallas fwd / fwd+bwd ms, one run
                per chunk, the chunk-64 runs in another call): B=4 T=4096 H=16 K=V=128, chunk 64 2.794 / 13.967,
                32 2.590 / 9.908, 16 2.751 / 9.798; B=2 T=2048 H=8 K=V=256, 4.520 / 9.117, 3.250 / 6.655, 1.563
                / 4.998; GDN at K=V=128 2.922 / 10.992, 2.783 / 11.196, 2.835 / 10.634; at K=V=64 (B=2 T=1024
                H=4) chunk 64 stays fastest (DeltaNet 0.085 / 0.341 against 0.148 / 0.377 at 16).
  chunk_channel_serial: the same when few rows run (`chunk_for`): the state passes' serial chunk loop is
                then the critical path, and fewer chunks shorten it. H200, KDA B=1 T=32768 H=8 K=V=128
                (profile_pallas, one run, before `scores`): chunk 16 → 32, whole forward 3.251 → 3.461 ms,
                whole backward 9.839 → 7.755 ms (state_bwd 4.249 → 2.823); 64: forward+backward 8.657
                against 7.154 at 32 (`compare_blocks e2e`).
  """
  sub: int = 16
  block_v_state: int = 64     # H200 B=4 T=4096 H=16 K=128 (profile_pallas, one run, with warps_prep=2): state_fwd
                              # 0.265 → 0.251 ms at 64 (0.170 with stages=3)
  state_k_piece: int = 0
  predecay: bool | str = "auto"
  block_v_out: int = 128
  block_v_grad: int = 128
  block_v_grad_fp32: int = 32
  block_k_grad: int = 64
  block_k_diag: int = 16
  block_k_pairs: int = 64
  block_k_scores: int = 32
  warps_chunk: int = 4
  warps_prep: int = 2         # same run: prep 0.318 → 0.267 ms (254 registers/thread: 2 programs per SM at 4)
  warps_state: int = 4
  warps_grad_state: int = 4
  warps_grad: int = 8
  warps_prep_channel: int = 2
  warps_pairs: int = 4
  warps_scores: int = 2
  warps_prep_scores: int = 2
  warps_prep_fp32: int = 8
  warps_finish: int = 4
  stages: int = 3             # same run: whole forward 0.667 → 0.531, backward 1.786 → 1.649 ms (with the two above)
  chunk_channel: int | str = "auto"
  chunk_channel_serial: int = 32
  chunk_fp32: int = 16
  chunk_channel_forward: int = 64
  fp32_dots: str = "tf32x3"
  fp32_dots_bf16: str = "tf32"
  split_prep: bool = False
  factor_diag: bool = True
  scores_tiles: bool = True
  fuse_inter: bool | str = "auto"

  _POW2 = ("sub", "block_v_state", "block_v_out", "block_v_grad", "block_v_grad_fp32", "block_k_grad", "block_k_diag",
           "block_k_scores", "block_k_pairs", "warps_chunk", "warps_prep", "warps_state", "warps_grad_state",
           "warps_grad", "warps_finish", "warps_prep_channel", "warps_pairs", "warps_scores", "warps_prep_scores",
           "warps_prep_fp32")

  def __post_init__(self):
    for name in self._POW2:
      value = getattr(self, name)
      if not _pow2(value):
        raise ValueError(f"BlockSizes.{name}={value} must be a power of two")
    if self.warps_prep_fp32 < 4:
      raise ValueError(f"BlockSizes.warps_prep_fp32={self.warps_prep_fp32} must be ≥ 4 (at 2, Triton computed wrong "
                       "W, U in the fp32 prep at K = 128 on an H200)")
    if self.sub not in (16, 32):
      raise ValueError(f"BlockSizes.sub={self.sub} must be 16 or 32 (Triton dots need dims ≥ 16)")
    for name in ("block_v_state", "block_v_out", "block_v_grad", "block_v_grad_fp32", "block_k_grad", "block_k_diag",
                 "block_k_pairs", "block_k_scores"):
      if not 16 <= getattr(self, name) <= MAX_DIM:
        raise ValueError(f"BlockSizes.{name}={getattr(self, name)} must be in [16, {MAX_DIM}]")
    for name in ("block_k_diag", "block_k_pairs", "block_k_scores"):
      if getattr(self, name) > 64:
        raise ValueError(f"BlockSizes.{name}={getattr(self, name)} must be ≤ 64 (registers)")
    if self.chunk_channel not in ("auto", 16, 32):
      raise ValueError(f"BlockSizes.chunk_channel={self.chunk_channel!r} must be 16, 32 or 'auto'")
    if self.chunk_channel_serial not in CHUNK_SIZES:
      raise ValueError(f"BlockSizes.chunk_channel_serial={self.chunk_channel_serial} must be one of {CHUNK_SIZES}")
    if self.chunk_fp32 not in CHUNK_SIZES:
      raise ValueError(f"BlockSizes.chunk_fp32={self.chunk_fp32} must be one of {CHUNK_SIZES}")
    if self.chunk_channel_forward not in (0, *CHUNK_SIZES):
      raise ValueError(f"BlockSizes.chunk_channel_forward={self.chunk_channel_forward} must be 0 or one of "
                       f"{CHUNK_SIZES}")
    if self.fp32_dots not in ("ieee", "tf32x3", "tf32"):
      raise ValueError(f"BlockSizes.fp32_dots={self.fp32_dots!r} must be 'ieee', 'tf32x3' or 'tf32'")
    if self.fp32_dots_bf16 not in ("ieee", "tf32x3", "tf32"):
      raise ValueError(f"BlockSizes.fp32_dots_bf16={self.fp32_dots_bf16!r} must be 'ieee', 'tf32x3' or 'tf32'")
    if self.state_k_piece and not (_pow2(self.state_k_piece) and 16 <= self.state_k_piece <= MAX_DIM):
      raise ValueError(f"BlockSizes.state_k_piece={self.state_k_piece} must be 0 or a power of two in "
                       f"[16, {MAX_DIM}]")
    if self.predecay not in (True, False, "auto"):
      raise ValueError(f"BlockSizes.predecay={self.predecay!r} must be True, False or 'auto'")
    if self.fuse_inter not in (True, False, "auto"):
      raise ValueError(f"BlockSizes.fuse_inter={self.fuse_inter!r} must be True, False or 'auto'")
    if self.stages < 1:
      raise ValueError(f"BlockSizes.stages={self.stages} must be ≥ 1")

  def chunk_for(self, decay: str, chunk: int, lanes: int = 0, vdim: int = 0, kdim: int = 0,
                itemsize: int = 0) -> int:
    """The chunk the kernels run at for a requested `chunk` and decay ("none" | "scalar" | "channel").
    Decay none and scalar run at most at `chunk_fp32` for inputs of `itemsize` 4 bytes at padded K = `kdim`
    ≥ 128, else at `chunk`. Per-channel decay runs at `chunk_channel` ("auto": 32 for inputs of `itemsize` 2
    bytes at padded K = 128, else 16; 0: unknown), or at `chunk_channel_serial` when the state passes would
    run fewer than STATE_PROGRAMS programs even at BV 16 (`lanes` rows of padded width `vdim`; 0: unknown)."""
    if decay != "channel":
      wide = self.chunk_fp32 if (itemsize == 4 and kdim >= 128) else chunk
      return min(chunk, max(wide, self.sub))
    if self.serial(lanes, vdim):
      wide = self.chunk_channel_serial
    elif self.chunk_channel == "auto":
      wide = 32 if (kdim, itemsize) == (128, 2) else 16
    else:
      wide = self.chunk_channel
    return min(chunk, max(wide, self.sub))

  def forward_chunk(self, decay: str, requested: int, chunk: int, packed: bool) -> int:
    """The chunk of an undifferentiated per-channel forward (`chunk_channel_forward`, at most the `requested`
    chunk_size) when it is wider than `chunk`, the one `chunk_for` picked, and the input is not packed; else 0."""
    wide = min(requested, self.chunk_channel_forward)
    return wide if (decay == "channel" and not packed and wide > chunk) else 0

  @staticmethod
  def serial(lanes: int, vdim: int) -> bool:
    """Whether the sequential state passes run fewer than STATE_PROGRAMS programs even at BV 16 (`lanes` rows
    of padded width `vdim`; 0: unknown, False)."""
    return bool(lanes and vdim and lanes * (vdim // 16) < STATE_PROGRAMS)

  def check(self, chunk: int) -> None:
    if chunk not in CHUNK_SIZES:
      raise ValueError(f"chunk_size={chunk} must be one of {CHUNK_SIZES}")
    if chunk % self.sub:
      raise ValueError(f"BlockSizes.sub={self.sub} must divide chunk_size={chunk}")

  def v_block(self, name: str, vdim: int, kdim: int = 0, lanes: int = 0) -> int:
    """The V block of kernel family `name` ("state" | "out" | "grad" | "grad_fp32") for padded V = vdim. The state
    passes' [K, BV] fp32 state tile (padded K = kdim) is kept to ≤ 128 × 64 elements, and with `lanes` (batch
    rows or packed segments × value heads) BV halves, down to 16, while lanes · V / BV < STATE_PROGRAMS."""
    bv = min(getattr(self, f"block_v_{name}"), vdim)
    if name != "state":
      return bv
    bv = max(min(bv, STATE_TILE // kdim), 16) if kdim else bv
    while lanes and bv > 16 and lanes * (vdim // bv) < STATE_PROGRAMS:
      bv //= 2
    return bv

  def k_block(self, name: str, kdim: int) -> int:
    """The K block of kernel family `name` ("grad" | "diag" | "pairs" | "scores") for padded K = kdim."""
    return min(getattr(self, f"block_k_{name}"), kdim)


DEFAULT_BLOCKS = BlockSizes()


def compiler_params(num_warps: int, num_stages: int):
  return _TRITON_PARAMS(num_warps=num_warps, num_stages=num_stages)


def pallas_call(kernel, *, grid, in_specs, out_specs, out_shape, interpret: bool, num_warps: int,
                num_stages: int, name: str, fp32_dots: str = "tf32x3", input_output_aliases=None):
  """`pl.pallas_call` for the Triton lowering (explicit compiler params) or the CPU interpreter. The kernel
  body is traced with fp32 dots as `fp32_dots` says when compiled, IEEE (exact fp32) in interpret mode."""
  from pallas_kernels.gpu import chunk_math

  def body(*refs):
    with chunk_math.fp32_dots("ieee" if interpret else fp32_dots):
      return kernel(*refs)
  return pl.pallas_call(body, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                        interpret=interpret, compiler_params=compiler_params(num_warps, num_stages),
                        name=name, input_output_aliases=input_output_aliases or {})
