"""A TPU cost model on paper: chips, per-chunk models of the Pallas TPU kernels, an HLO counter and a roofline.

Everything here is arithmetic; nothing compiles or runs (`benchmarks/tpu_plan.py` compiles for TPU and builds the
report; docs/tpu_cost_model.md is the method).

* `CHIPS`: the vendor's published per-chip numbers (bf16 peak, HBM bandwidth and size) and the core / MXU / VMEM
  geometry of JAX's `pltpu.get_tpu_info_for_chip` table.
* Per-chunk models, one function per kernel, each returning a `Step` (one grid step): every dot with its shape and
  MXU passes (a bf16 × bf16 dot is one pass; an fp32 dot at `Precision.HIGHEST` six), the transcendentals, the HBM
  bytes streamed per step and per program, and the VMEM of the double-buffered blocks and scratch.
  `delta_rule_fwd` is the forward kernel (`pallas_kernels/tpu/delta_rule/kernel.py`); `delta_rule_bwd` the backward
  kernel (`backward.py`: a forward-like recompute and the gradient dots, one reverse pass over the chunks reading the
  state that the forward stored at each chunk's start); `decayed_sum_step` both kernels of
  `pallas_kernels/tpu/decayed_sum.py`.
* `hlo_ops(text)`: the top-level ops of a compiled program (`compiled.as_text()`) with their dots, exps and HBM
  bytes, each op weighted by how often it runs (while loops by their trip counts; XLA's own `cost_analysis()`
  counts a loop body once).
* `kernel_time`, `ops_time`: the roofline, max(MXU time, HBM time) per grid step of a kernel and per XLA op,
  summed; `utilisation`: the useful flops at the chip's peak over that time.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re

from osdn_jax.train import hlo

KIB, MIB = 2**10, 2**20
HIGHEST_PASSES = 6          # an fp32 dot at Precision.HIGHEST: six bf16 passes on the MXU (HIGH: three)
SUBLANES = 8


# ---------------------------------------------------------------------------------------------------------
# Chips
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU chip. bf16_flops and hbm_bw: per chip (all of its TensorCores); vmem_bytes: per TensorCore."""
  name: str
  topology: str            # a one-chip topology for `osdn_jax.train.aot.topology_devices`
  bf16_flops: float        # peak bf16 FLOP/s
  hbm_bw: float            # HBM bytes/s
  hbm_gb: float            # HBM capacity (GB, as published)
  cores: int               # TensorCores per device (v5p: a megacore of two)
  mxu: int                 # MXU side (systolic array of mxu × mxu)
  mxus: int                # MXUs per TensorCore
  vmem_bytes: int          # VMEM per TensorCore
  spec_url: str


# Published per-chip numbers: cloud.google.com/tpu/docs/{v5e,v5p,v6e} ("key specifications"). Cores, MXUs and VMEM:
# JAX's TPU table (`pltpu.get_tpu_info_for_chip`, docs.jax.dev "TPU Hardware Reference"); the VMEM sizes are also
# what libtpu's compiler reports as the memory an over-sized scratch would exceed (`tpu_plan.vmem_capacity`).
CHIPS = {
    "v5e": Chip("v5e", "v5e:1x1", 197e12, 819e9, 16, 1, 128, 4, 128 * MIB, "https://cloud.google.com/tpu/docs/v5e"),
    "v5p": Chip("v5p", "v5p:1x1x1", 459e12, 2765e9, 95, 2, 128, 4, 64 * MIB, "https://cloud.google.com/tpu/docs/v5p"),
    "v6e": Chip("v6e", "v6e:1x1", 918e12, 1640e9, 32, 1, 256, 2, 128 * MIB, "https://cloud.google.com/tpu/docs/v6e"),
}


def jax_tpu_info(chip: Chip) -> dict | None:
  """JAX's table entry for the chip (per TensorCore), or None where this JAX has no such table."""
  try:
    from jax.experimental.pallas import tpu as pltpu
    info = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(chip.name), chip.cores)
  except (AttributeError, ValueError, ImportError):
    return None
  return {"vmem_bytes": info.vmem_capacity_bytes, "mxu": info.mxu_column_size, "mxus": info.num_mxus,
          "cores": info.num_cores, "hbm_bw_per_core": info.mem_bw_bytes_per_second,
          "bf16_flops_per_core": info.bf16_ops_per_second}


# ---------------------------------------------------------------------------------------------------------
# Dots
# ---------------------------------------------------------------------------------------------------------
def _up(x: int, m: int) -> int:
  return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class Dot:
  """`count` products [m, k] × [k, n] on the MXU, each of `passes` bf16 passes."""
  name: str
  m: int
  k: int
  n: int
  passes: int = 1
  count: float = 1

  @property
  def flops(self) -> float:
    """The product's own flops, 2·m·k·n per product."""
    return 2.0 * self.m * self.k * self.n * self.count

  @property
  def pass_flops(self) -> float:
    """flops × passes: what the MXU does when every pass is counted."""
    return self.flops * self.passes

  def padded_flops(self, mxu: int) -> float:
    """pass_flops with the stationary operand padded to whole mxu × mxu tiles and the streamed rows to sublanes:
    an operand [k, n] held in the array and m rows streamed through it, or the transpose, whichever is cheaper."""
    one = min(_up(self.m, SUBLANES) * _up(self.k, mxu) * _up(self.n, mxu),
              _up(self.n, SUBLANES) * _up(self.k, mxu) * _up(self.m, mxu))
    return 2.0 * one * self.count * self.passes


# ---------------------------------------------------------------------------------------------------------
# Per-step models of the kernels
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Step:
  """One grid step of a kernel (one chunk of one program) and what a program adds once.

  hbm_step: bytes moved per step (blocks whose index changes every step); hbm_program: per program (blocks
  whose index is the same for all of its steps, e.g. S0 and S_T); vmem_blocks: the double-buffered input and
  output blocks; vmem_scratch: the scratch buffers."""
  kernel: str
  chunk: int
  dots: list
  exps: float
  hbm_step: float
  hbm_program: float
  vmem_blocks: int
  vmem_scratch: int
  notes: str = ""
  call: str | None = None        # the pallas_call's name (its custom call in the HLO); None for a modelled kernel

  def flops(self, passes=None) -> float:
    """Σ flops of the dots of `passes` passes (None: all of them)."""
    return sum(d.flops for d in self.dots if passes is None or d.passes == passes)

  @property
  def pass_flops(self) -> float:
    return sum(d.pass_flops for d in self.dots)

  def padded_flops(self, mxu: int) -> float:
    return sum(d.padded_flops(mxu) for d in self.dots)

  @property
  def vmem(self) -> int:
    return self.vmem_blocks + self.vmem_scratch

  def summary(self, chips=("v5p", "v6e")) -> dict:
    out = {"kernel": self.kernel, "chunk": self.chunk, "flops_bf16": self.flops(1),
           "flops_fp32_highest": self.flops(HIGHEST_PASSES), "pass_flops": self.pass_flops,
           "transcendentals": self.exps, "hbm_bytes_step": self.hbm_step, "hbm_bytes_program": self.hbm_program,
           "vmem_blocks": self.vmem_blocks, "vmem_scratch": self.vmem_scratch, "vmem": self.vmem,
           "dots": [dataclasses.asdict(d) for d in self.dots], "notes": self.notes}
    for name in chips:
      out[f"padded_pass_flops_{name}"] = self.padded_flops(CHIPS[name].mxu)
    return out


def _tile_bytes(rows: int, cols: int, itemsize: int) -> int:
  """VMEM bytes of a [rows, cols] block: whole (8·(4 / itemsize), 128) tiles."""
  return _up(rows, SUBLANES * max(1, 4 // itemsize)) * _up(cols, 128) * itemsize


def _inverse_dots(c: int, passes: int) -> list[Dot]:
  """`unit_lower_inverse`: log2(C) − 1 levels of two [C, C] × [C, C] dots (the first level needs none)."""
  levels = max(c.bit_length() - 2, 0)
  return [Dot("T = (I + A)^-1: X (A_b X)", c, c, c, passes, 2 * levels)] if levels else []


def _channel_score_parts(c: int, kd: int, sub: int, passes: int, what: str) -> tuple[list[Dot], float]:
  """The dots and exps of one `channel_scores` call (strict for A, causal for the output scores): the pairwise
  band of the s×s diagonal sub-blocks on the VPU/EUP, the reference-row factors of the others as dots."""
  s = min(sub, c)
  offsets = s - 1 if what == "A" else s
  exps = offsets * c * kd
  dots = []
  if c > s:
    exps += (c // s - 1) * (s + c) * kd
    dots.append(Dot(f"{what}: reference-row dots", s, kd, c, passes, c // s - 1))
  return dots, exps


def delta_rule_fwd(chunk: int = 64, key_dim: int = 128, value_dim: int = 128, *, decay: str = "scalar",
                   write_keys: bool = False, initial_state: bool = False, itemsize: int = 2, sub: int = 16,
                   save_states: bool = False, t_passes: int = HIGHEST_PASSES) -> Step:
  """One grid step of `delta_rule_fwd_tpu` (bf16 inputs with `Config.bf16_matmuls`, or fp32 inputs: itemsize 4,
  every dot at HIGHEST). One V block (BV = V). write_keys: k_write given (one more [C, K] block); save_states: the
  forward of the modelled backward, which also writes the fp32 state entering each chunk ([K, V] per step).
  t_passes: the passes of the dots that build T (6: HIGHEST; 3: HIGH; 1: bf16)."""
  c, kd, vd = chunk, key_dim, value_dim
  lo = 1 if itemsize == 2 else HIGHEST_PASSES          # the other dots: bf16 operands, or fp32 at HIGHEST
  dots = []
  if decay == "channel":
    dots.append(Dot("G = tril(1) · log-decays", c, c, kd, HIGHEST_PASSES))
    a_dots, a_exps = _channel_score_parts(c, kd, sub, t_passes, "A")
    s_dots, s_exps = _channel_score_parts(c, kd, sub, lo, "scores")
    dots += a_dots + s_dots
    exps = a_exps + s_exps + 2 * c * kd + kd        # e^G, e^{G_C − G} and the e^{G_C} column
  else:
    dots += [Dot("A: K K~^T", c, kd, c, lo), Dot("scores: Q K~^T", c, kd, c, lo)]
    exps = 2 * c * c + 3 * c + 1 if decay == "scalar" else 0
  dots += _inverse_dots(c, t_passes)
  dots += [Dot("W = T diag(b e^G) K", c, c, kd, lo), Dot("U = T diag(b) V", c, c, vd, lo),
           Dot("W S", c, kd, vd, lo), Dot("Q S", c, kd, vd, lo), Dot("scores V_new", c, c, vd, lo),
           Dot("S += K~^T V_new", kd, c, vd, lo)]
  blocks_in = [(c, kd, itemsize)] * (3 if write_keys else 2) + [(c, vd, itemsize)]
  blocks_in.append((2 if decay == "scalar" else 1, c, 4))                 # β (and G) rows
  if decay == "channel":
    blocks_in.append((c, kd, 4))                                         # log-decays (fp32)
  state = kd * vd * 4
  blocks_out = [(c, vd, itemsize)]
  hbm_step = sum(r * w * b for r, w, b in blocks_in + blocks_out)
  if save_states:
    hbm_step += state
    blocks_out.append((kd, vd, 4))
  vmem_blocks = 2 * (sum(_tile_bytes(*b) for b in blocks_in + blocks_out) + state * (1 + initial_state))
  scratch = state + (c * kd * 4 if decay == "channel" else 0)
  return Step(f"delta_rule fwd ({decay})", c, dots, exps, hbm_step, state * (1 + initial_state), vmem_blocks,
              scratch, "forward kernel" + (", storing the state entering each chunk" if save_states else ""),
              None if save_states else "delta_rule_fwd_tpu")


def delta_rule_bwd(chunk: int = 64, key_dim: int = 128, value_dim: int = 128, *, decay: str = "scalar",
                   write_keys: bool = False, initial_state: bool = False, itemsize: int = 2, sub: int = 16,
                   t_passes: int = HIGHEST_PASSES) -> Step:
  """One grid step of the modelled backward kernel: chunks in reverse, dS carried in VMEM, the state S entering the
  chunk read from HBM (stored by the forward, fp32 [K, V]). Recompute A, T, W, U, V_new and the scores; then

    dQ  = dO Sᵀ e^G + (dO V_newᵀ ⊙ Γ') K̃            dV_new = scoresᵀ dO + K̃ dS
    dS ← Qᵀ dO − Wᵀ dV_new + e^{G_C} dS              dK̃    = V_new dSᵀ + dscoresᵀ Q + dAᵀ K
    dW  = −dV_new Sᵀ,  dU = dV_new                    dT     = dU (βV)ᵀ + dW (β e^G K)ᵀ
    dV  = β Tᵀ dU,     dK = Tᵀ dW β e^G + dA K̃       dA     = −Tᵀ dT Tᵀ

  (dβ and dg are row sums on the VPU). Per-channel decay: both score matrices' reference-row dots are
  differentiated (two dots per forward dot), the band's exps recomputed and used again, and dG summed back
  through a reverse cumsum (one more triangular dot)."""
  c, kd, vd = chunk, key_dim, value_dim
  lo = 1 if itemsize == 2 else HIGHEST_PASSES
  fwd = delta_rule_fwd(c, kd, vd, decay=decay, write_keys=write_keys, itemsize=itemsize, sub=sub,
                       t_passes=t_passes)
  keep = ("A:", "scores:", "G =", "T =", "W =", "U =", "W S")
  dots = [d for d in fwd.dots if d.name.startswith(keep)]                 # the recompute
  dots += [Dot("dO S^T", c, vd, kd, lo), Dot("dO V_new^T", c, vd, c, lo), Dot("dscores K~", c, c, kd, lo),
           Dot("scores^T dO", c, c, vd, lo), Dot("K~ dS", c, kd, vd, lo), Dot("Q^T dO", kd, c, vd, lo),
           Dot("W^T dV_new", kd, c, vd, lo), Dot("V_new dS^T", c, vd, kd, lo), Dot("dscores^T Q", c, c, kd, lo),
           Dot("dV_new S^T", c, vd, kd, lo), Dot("dU (bV)^T", c, vd, c, t_passes),
           Dot("T^T dU", c, c, vd, lo), Dot("dW (bK)^T", c, kd, c, t_passes), Dot("T^T dW", c, c, kd, lo),
           Dot("dA = -T^T dT T^T", c, c, c, t_passes, 2), Dot("dA K~", c, c, kd, t_passes),
           Dot("dA^T K", c, c, kd, t_passes)]
  exps = fwd.exps
  if decay == "channel":
    s = min(sub, c)
    if c > s:
      for what, p in (("A", t_passes), ("scores", lo)):
        dots += [Dot(f"d{what}: reference rows, d(rows)", s, c, kd, p, c // s - 1),
                 Dot(f"d{what}: reference rows, d(columns)", c, s, kd, p, c // s - 1)]
    dots.append(Dot("dG: reverse cumsum", c, c, kd, HIGHEST_PASSES))
    exps = 2 * fwd.exps
  state = kd * vd * 4
  keys = 3 if write_keys else 2
  blocks_in = [(c, kd, itemsize)] * keys + [(c, vd, itemsize)] * 2 + [(2 if decay == "scalar" else 1, c, 4),
                                                                       (kd, vd, 4)]
  blocks_out = [(c, kd, itemsize)] * keys + [(c, vd, itemsize), (2 if decay == "scalar" else 1, c, 4)]
  if decay == "channel":
    blocks_in.append((c, kd, 4))
    blocks_out.append((c, kd, 4))                                        # dg per channel (fp32)
  hbm_step = sum(r * w * b for r, w, b in blocks_in + blocks_out)
  vmem_blocks = 2 * (sum(_tile_bytes(*b) for b in blocks_in + blocks_out) + state * (2 + initial_state))
  scratch = state + (c * kd * 4 if decay == "channel" else 0)
  return Step(f"delta_rule bwd ({decay}), model", c, dots, exps, hbm_step, state * (2 + initial_state),
              vmem_blocks, scratch, "modelled backward: reads the state stored by the forward at each chunk")


def decayed_sum_step(chunk: int = 128, width: int = 128, block_h: int = 8, heads: int = 16, *, itemsize: int = 2,
                     reverse: bool = False) -> Step:
  """One grid step of `decayed_sum` (reverse: `decayed_sum_reverse`, the adjoint): block_h heads of a
  [C, Hb, W] block, per head one [C, C] × [C, W] dot at HIGHEST, Γ's exps, the decay column; the gates as a
  [C, H] column block (all heads) and an [Hb, C] row block; β rows ("square", forward only)."""
  c, w, hb = chunk, width, block_h
  dots = [Dot("A = (Gamma b) x + e^G A_prev", c, c, w, HIGHEST_PASSES, hb)]
  exps = hb * (c * c + c + (1 if reverse else 0))
  x_in = (c * hb, w, 4 if reverse else itemsize)                         # x (bf16) or dA (fp32)
  blocks_in = [x_in, (c, heads, 4), (hb, c, 4)] + ([] if reverse else [(hb, c, 4)])
  blocks_out = [(c * hb, w, 4)]
  carry = hb * SUBLANES * w * 4                                          # [Hb, 1, W] blocks: 1 → 8 sublanes
  hbm_step = sum(r * cc * b for r, cc, b in blocks_in + blocks_out)
  vmem_blocks = 2 * (sum(_tile_bytes(*b) for b in blocks_in + blocks_out) + 2 * carry)
  name = "decayed_sum_reverse" if reverse else "decayed_sum"
  return Step(name, c, dots, exps, hbm_step, 2 * hb * w * 4, vmem_blocks, carry, call=name)


# ---------------------------------------------------------------------------------------------------------
# Launches and the roofline
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Launch:
  """A kernel launch: `steps` grid steps of `step`, `programs` = the product of the parallel grid axes."""
  step: Step
  steps: int
  programs: int

  @property
  def hbm_bytes(self) -> float:
    return self.steps * self.step.hbm_step + self.programs * self.step.hbm_program


def _core_share(chip: Chip, programs: int) -> float:
  """The fraction of the chip's MXU rate that a grid of `programs` parallel programs gets: one core per program
  at most, and the busiest core sets the time (ceil(P / cores) programs of P / cores on average)."""
  if programs < 1:
    return 1.0
  used = min(chip.cores, programs)
  return (used / chip.cores) * (programs / used) / math.ceil(programs / used)


def kernel_time(launch: Launch, chip: Chip) -> dict:
  """Expected seconds of one launch: per grid step max(MXU time, HBM time), the MXU time with HIGHEST dots as
  six passes and the operands padded to whole MXU tiles; steps of one core run one after another."""
  rate = chip.bf16_flops * _core_share(chip, launch.programs)
  step = launch.step
  mxu_step = step.padded_flops(chip.mxu) / rate
  hbm_step = (step.hbm_step + step.hbm_program * launch.programs / launch.steps) / chip.hbm_bw
  return {"useful_flops": launch.steps * step.flops(), "pass_flops": launch.steps * step.pass_flops,
          "mxu_s_unpadded": launch.steps * step.pass_flops / rate, "mxu_s": launch.steps * mxu_step,
          "hbm_bytes": launch.hbm_bytes, "hbm_s": launch.hbm_bytes / chip.hbm_bw,
          "time_s": launch.steps * max(mxu_step, hbm_step),
          "time_unpadded_s": launch.steps * max(step.pass_flops / rate, hbm_step),
          "transcendentals": launch.steps * step.exps, "core_share": _core_share(chip, launch.programs)}


def ops_time(ops: list, chip: Chip) -> dict:
  """Expected seconds of XLA ops (`hlo_ops`): per op max(MXU time, HBM time) × its runs, summed (XLA runs ops one
  after another, each split over the cores of a megacore)."""
  total = {"useful_flops": 0.0, "pass_flops": 0.0, "mxu_s_unpadded": 0.0, "mxu_s": 0.0, "hbm_bytes": 0.0,
           "hbm_s": 0.0, "time_s": 0.0, "time_unpadded_s": 0.0, "transcendentals": 0.0, "vpu_flops": 0.0}
  for op in ops:
    mxu = sum(d.padded_flops(chip.mxu) for d in op.dots) / chip.bf16_flops
    hbm = op.bytes / chip.hbm_bw
    total["useful_flops"] += op.runs * sum(d.flops for d in op.dots)
    total["pass_flops"] += op.runs * sum(d.pass_flops for d in op.dots)
    total["mxu_s_unpadded"] += op.runs * sum(d.pass_flops for d in op.dots) / chip.bf16_flops
    total["mxu_s"] += op.runs * mxu
    total["hbm_bytes"] += op.runs * op.bytes
    total["hbm_s"] += op.runs * hbm
    total["time_s"] += op.runs * max(mxu, hbm)
    total["time_unpadded_s"] += op.runs * max(sum(d.pass_flops for d in op.dots) / chip.bf16_flops, hbm)
    total["transcendentals"] += op.runs * op.exps
    total["vpu_flops"] += op.runs * op.vpu
  return total


def combine(*parts: dict) -> dict:
  """Sums of the time records of `kernel_time` / `ops_time`."""
  keys = ("useful_flops", "pass_flops", "mxu_s_unpadded", "mxu_s", "hbm_bytes", "hbm_s", "time_s",
          "time_unpadded_s", "transcendentals", "vpu_flops")
  return {k: sum(p.get(k, 0.0) for p in parts) for k in keys}


def utilisation(record: dict, chip: Chip) -> float:
  """Expected MXU utilisation: the useful flops' time at the chip's bf16 peak over the expected time."""
  return record["useful_flops"] / chip.bf16_flops / record["time_s"] if record["time_s"] else 0.0


# ---------------------------------------------------------------------------------------------------------
# HLO: the top-level ops of a compiled program with their dots, exps and bytes
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class HloOp:
  """One top-level op (not inside a fusion): runs per program run, its dots, exps and HBM bytes per run."""
  name: str
  op: str
  runs: int
  dots: list
  exps: float
  bytes: float
  vpu: float = 0.0                  # elementwise and reduction flops (one per element, as XLA counts them)
  custom: dict | None = None        # a Pallas kernel's cost estimate, for a tpu_custom_call


_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "call", "conditional",
         "after-all", "partition-id", "replica-id", "copy-start", "slice-done", "opt-barrier", "add-dependency"}
_PRECISION_PASSES = {"highest": HIGHEST_PASSES, "high": 3}
_SLICING = ("dynamic-slice", "slice", "gather")
_TRANSCENDENTAL = {"exponential", "log", "tanh", "logistic", "sqrt", "rsqrt", "power", "exponential-minus-one",
                   "log-plus-one", "sine", "cosine", "cbrt"}
_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "select", "compare", "and", "or",
                "not", "xor", "negate", "abs", "sign", "floor", "ceil", "round-nearest-even", "clamp", "convert",
                "remainder", "is-finite"}


def _elements(type_text: str) -> int:
  shape = _shape(type_text)
  return math.prod(shape[1]) if shape else 0


def _vector_work(op: str, type_text: str, rest: str, types: dict) -> tuple[float, float]:
  """(transcendentals, other elementwise flops) of one instruction: one per result element, and one per input
  element for a reduce."""
  if op in _TRANSCENDENTAL:
    return _elements(type_text), 0.0
  if op in _ELEMENTWISE:
    return 0.0, _elements(type_text)
  if op in ("reduce", "reduce-window"):
    args = hlo.operands(rest)
    return 0.0, _elements(types.get(args[0], "")) if args else 0.0
  return 0.0, 0.0


def _shape(type_text: str) -> tuple[str, tuple[int, ...]] | None:
  m = hlo.ARRAY.search(type_text)
  if not m:
    return None
  return m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)


_TYPED = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[([0-9,]*)\](\{[^}]*\})?")


def _physical(dtype: str, dims: tuple, layout: str | None) -> int:
  """Bytes of one array as TPU lays it out: the first tile T(a, b) of its layout pads its two most minor dims (a
  sub-tile (p, 1) packs p rows per word, e.g. bf16 T(8,128)(2,1): 16 × 128); 0 for an array in VMEM (S(1))."""
  bits = hlo.dtype_bits(dtype)
  if layout and "S(1)" in layout:
    return 0
  shape = list(dims)
  m = re.match(r"\{([\d,]*):?(T\([\d,]+\)(?:\([\d,]+\))*)?", layout or "")
  if m and m.group(2) and shape:
    order = [int(d) for d in m.group(1).split(",") if d] or list(range(len(shape)))[::-1]
    tiles = [[int(x) for x in t.split(",")] for t in re.findall(r"\(([\d,]+)\)", m.group(2))]
    first = tiles[0]
    if len(tiles) > 1 and len(tiles[1]) == 2 and tiles[1][1] == 1:
      first = [first[0] * tiles[1][0]] + first[1:]
    for axis, size in zip(order, reversed(first)):
      shape[axis] = _up(shape[axis], size)
  return math.prod(shape) * bits // 8


def _nbytes(type_text: str) -> int:
  """HBM bytes of the arrays of an HLO type (one array or a tuple), tiled as laid out."""
  return sum(_physical(t, tuple(int(d) for d in dims.split(",") if d), lay) for t, dims, lay in
             _TYPED.findall(type_text))


def _passes(rest: str) -> int:
  m = re.search(r"operand_precision=\{(\w+)", rest)
  return _PRECISION_PASSES.get(m.group(1), 1) if m else 1


def _conv_dot(name: str, types: dict, type_text: str, rest: str) -> Dot | None:
  """A convolution that is a (batched) matmul: spatial dims of size-1 taps (base-dilated windows) are batch
  dims, b rows, f the contraction (lhs) and the result's columns."""
  labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", rest)
  operands = hlo.operands(rest)
  out = _shape(type_text)
  if not labels or len(operands) < 2 or operands[0] not in types or out is None:
    return None
  lhs = _shape(types[operands[0]])
  lhs_l, _, out_l = labels.groups()
  groups = re.search(r"feature_group_count=(\d+)", rest)
  k = lhs[1][lhs_l.index("f")] // (int(groups.group(1)) if groups else 1)
  m, n = out[1][out_l.index("b")], out[1][out_l.index("f")]
  batch = math.prod(s for s, lab in zip(out[1], out_l) if lab not in "bf")
  taps = 1
  window = re.search(r"window=\{size=([\dx]+)(?:[^}]*lhs_dilate=([\dx]+))?", rest)
  if window:
    sizes = [int(s) for s in window.group(1).split("x")]
    dil = [int(s) for s in window.group(2).split("x")] if window.group(2) else [1] * len(sizes)
    taps = math.prod(-(-s // d) for s, d in zip(sizes, dil))
  return Dot(name, m, k, n, _passes(rest), batch * taps)


def _dot(name: str, types: dict, type_text: str, rest: str) -> Dot | None:
  operands = hlo.operands(rest)
  if len(operands) < 2 or operands[0] not in types or operands[1] not in types:
    return None
  lhs, rhs = _shape(types[operands[0]])[1], _shape(types[operands[1]])[1]
  dims = {key: [int(d) for d in re.search(rf"{key}=\{{([\d,]*)\}}", rest).group(1).split(",") if d]
          if re.search(rf"{key}=\{{", rest) else []
          for key in ("lhs_batch_dims", "lhs_contracting_dims", "rhs_batch_dims", "rhs_contracting_dims")}
  batch = math.prod(lhs[d] for d in dims["lhs_batch_dims"])
  k = math.prod(lhs[d] for d in dims["lhs_contracting_dims"])
  m = math.prod(s for i, s in enumerate(lhs) if i not in dims["lhs_batch_dims"] + dims["lhs_contracting_dims"])
  n = math.prod(s for i, s in enumerate(rhs) if i not in dims["rhs_batch_dims"] + dims["rhs_contracting_dims"])
  return Dot(name, m, k, n, _passes(rest), batch)


def _inside(comps: dict, comp: str, seen=None) -> tuple[list, float, float]:
  """(dots, transcendentals, other elementwise flops) of a fusion body and the computations it calls."""
  seen = set() if seen is None else seen
  if comp in seen or comp not in comps:
    return [], 0.0, 0.0
  seen.add(comp)
  types = {n: t for n, t, _, _ in comps[comp]}
  dots, exps, vpu = [], 0.0, 0.0
  for name, type_text, op, rest in comps[comp]:
    if op in ("convolution", "dot"):
      d = (_conv_dot if op == "convolution" else _dot)(name, types, type_text, rest)
      dots += [d] if d else []
    e, v = _vector_work(op, type_text, rest, types)
    exps, vpu = exps + e, vpu + v
    for callee in re.findall(r"\bcalls=%([\w.\-]+)", rest):
      more, e, v = _inside(comps, callee, seen)
      dots, exps, vpu = dots + more, exps + e, vpu + v
  return dots, exps, vpu


def _table(comps: dict, body: str) -> tuple[dict, dict, dict]:
  """({name: (type, op, rest)}, {parameter index: name}, {name: [names of its users]}) of a computation."""
  table, params, users = {}, {}, {}
  for name, t, op, rest in comps.get(body, []):
    table[name] = (t, op, rest)
    if op == "parameter":
      params[int(re.match(r"(\d+)", rest).group(1))] = name
    for src in hlo.operands(rest):
      users.setdefault(src, []).append(name)
  return table, params, users


def _read(comps: dict, body: str, value: str, depth: int = 0) -> float | None:
  """The bytes of `value` (an instruction of `body`) that its users read when each of them only slices it (through
  bitcasts, nested fusions and in-place updates, which read nothing of it); None when some user reads it all."""
  table, params, users = _table(comps, body)
  total = 0.0
  for user in users.get(value, []):
    t, op, rest = table[user]
    args = hlo.operands(rest)
    if op in _SLICING and args[:1] == [value]:
      total += _nbytes(t)
    elif op == "dynamic-update-slice" and args[:1] == [value]:
      continue
    elif op == "bitcast" and depth < 8:
      inner = _read(comps, body, user, depth + 1)
      if inner is None:
        return None
      total += inner
    elif op == "fusion" and depth < 8:
      nested = re.search(r"\bcalls=%([\w.\-]+)", rest).group(1)
      for i in (i for i, a in enumerate(args) if a == value):
        inner = _read(comps, nested, _table(comps, nested)[1].get(i), depth + 1)
        if inner is None:
          return None
        total += inner
    else:
      return None
  return total


def _fusion_bytes(comps: dict, roots: dict, body: str, types: dict, operands: list, type_text: str) -> float:
  """HBM bytes of a fusion: its operands and result, except an operand the body only slices (the slices' bytes)
  and a result that updates an operand in place (the update's bytes, the operand not read)."""
  table, params, _ = _table(comps, body)
  root = roots.get(body)
  results = hlo.operands(table[root][2]) if root in table and table[root][1] == "tuple" else [root]
  total = _nbytes(type_text)
  for r in results:
    if r in table and table[r][1] == "dynamic-update-slice":
      args = hlo.operands(table[r][2])
      if len(args) > 1 and args[1] in table:
        total += _nbytes(table[args[1]][0]) - _nbytes(table[r][0])
  for i, operand in enumerate(operands):
    full = _nbytes(types.get(operand, ""))
    part = _read(comps, body, params.get(i))
    total += full if part is None else min(part, full)
  return total


def _custom_estimate(rest: str) -> dict | None:
  m = re.search(r'cost_estimate\\?"?:\{([^}]*)\}', rest)
  if not m:
    return None
  pairs = re.findall(r'\\?"(\w+)\\?":\\?"?(\d+)', m.group(1))
  return {k: int(v) for k, v in pairs}


def _top_level(comps: dict, entry: str) -> set:
  """The computations whose instructions are ops of their own: the entry, while bodies and conditions, called
  and branch computations (not fusion bodies, reducers or other to_apply computations)."""
  inner = set()
  for instrs in comps.values():
    for _, _, op, rest in instrs:
      if op == "fusion" or "to_apply=" in rest:
        inner.update(re.findall(r"\b(?:calls|to_apply)=%([\w.\-]+)", rest))
  return {c for c in comps if c not in inner} | {entry}


def hlo_ops(text: str, *, loops: bool = True, vmem: bool = False) -> list[HloOp]:
  """The top-level ops of a compiled HLO module. loops: weight an op by its runs (while bodies × trip count);
  False: once per reachable op, as XLA's cost analysis counts a loop body. vmem: count the arrays that the
  compiler keeps in VMEM (S(1) layouts) as memory traffic too, as XLA's cost analysis does (else only HBM)."""
  comps, roots, entry = hlo.parse(text if not vmem else text.replace("S(1)", ""))
  runs, _ = hlo.runs(comps, entry)
  ops = []
  for comp in _top_level(comps, entry):
    if not runs.get(comp):
      continue
    types = {n: t for n, t, _, _ in comps[comp]}
    for name, type_text, op, rest in comps[comp]:
      if op in _FREE:
        continue
      operands = hlo.operands(rest)
      dots, custom = [], None
      exps, vpu = _vector_work(op, type_text, rest, types)
      if op == "fusion":
        body = re.search(r"\bcalls=%([\w.\-]+)", rest).group(1)
        dots, exps, vpu = _inside(comps, body)
        nbytes = _fusion_bytes(comps, roots, body, types, operands, type_text)
      elif op == "custom-call" and "AllocateBuffer" in rest:
        nbytes = 0
      elif op == "custom-call" and "tpu_custom_call" in rest:
        custom = _custom_estimate(rest) or {}
        nbytes = custom.get("bytes_accessed", 0)
      elif op in ("dynamic-slice", "slice"):
        nbytes = 2 * _nbytes(type_text)
      elif op == "slice-start":             # ((operand), slice, context): the slice read, and written unless to VMEM
        dtype, dims, layout = _TYPED.findall(type_text)[1]
        shape = tuple(int(d) for d in dims.split(",") if d)
        nbytes = _physical(dtype, shape, (layout or "").replace("S(1)", "")) + _physical(dtype, shape, layout)
      elif op == "dynamic-update-slice":
        nbytes = 2 * _nbytes(types.get(operands[1], "")) if len(operands) > 1 else 0
      elif op == "copy-done":
        nbytes = 2 * _nbytes(type_text.split(",")[0] if type_text.startswith("(") else type_text)
      else:
        if op == "convolution":
          dots = [d for d in [_conv_dot(name, types, type_text, rest)] if d]
        elif op == "dot":
          dots = [d for d in [_dot(name, types, type_text, rest)] if d]
        nbytes = _nbytes(type_text) + sum(_nbytes(types.get(o, "")) for o in operands)
      ops.append(HloOp(name, op, runs[comp] if loops else 1, dots, exps, nbytes, vpu, custom))
  return ops


def hlo_totals(ops: list) -> dict:
  """Σ over ops (× runs) of flops (bf16 and HIGHEST), MXU pass flops, exps and bytes, and the while-loop ops."""
  out = {"flops": 0.0, "flops_highest": 0.0, "pass_flops": 0.0, "vpu_flops": 0.0, "transcendentals": 0.0,
         "bytes": 0.0, "kernel_flops": 0.0, "ops": len(ops), "ops_in_loops": sum(op.runs > 1 for op in ops)}
  for op in ops:
    for d in op.dots:
      out["flops"] += op.runs * d.flops
      out["pass_flops"] += op.runs * d.pass_flops
      out["flops_highest"] += op.runs * d.flops * (d.passes == HIGHEST_PASSES)
    out["transcendentals"] += op.runs * op.exps
    out["vpu_flops"] += op.runs * op.vpu
    out["bytes"] += op.runs * op.bytes
    out["kernel_flops"] += op.runs * (op.custom or {}).get("flops", 0)
  return out


def scoped_vmem(text: str) -> dict:
  """{custom call name: the scoped VMEM bytes its Mosaic kernel reserves} from a compiled HLO module."""
  out = {}
  for line in text.splitlines():
    if 'custom_call_target="tpu_custom_call"' in line:
      name = re.match(r"\s*(?:ROOT )?%?([^\s=]+)", line).group(1)
      sizes = re.findall(r'used_scoped_memory_configs\\?"?:\[\{[^]]*?\\?"size\\?"?:\\?"(\d+)', line)
      out[name] = int(sizes[0]) if sizes else None
  return out


def dumps(x) -> str:
  return json.dumps(x, indent=1, default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o) else str(o))
