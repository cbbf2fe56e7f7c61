"""The TPU path planned on paper: per-chunk costs of the Pallas TPU kernels and the expected time of each row
against the XLA path's, on one chip of v5p and v6e, backed by libtpu's compiler run ahead of time on this host.

    python -m benchmarks.tpu_plan --out=docs/results/tpu-plan.json          # + docs/results/tpu-plan.md
    python -m benchmarks.tpu_plan --shapes=main --chips=v5p --nocompile    # the analytic model only, seconds
    python -m benchmarks.tpu_plan --shapes=1x512x2x128 --ops=gdn           # one small shape, printed

A row is (op, implementation, mode, decay, the function-building callable, the analytic kernels). For every row,
benchmark shape and chip: the program is compiled for one chip (`osdn_jax.train.aot.topology_devices`; bf16 q, k,
v, fp32 gates) and its HLO read (`tpu_cost.hlo_ops`: XLA's ops with loops counted by trip count); a Pallas
kernel's custom call is replaced by its analytic model (`tpu_cost.delta_rule_fwd`, ...); the expected time is
`tpu_cost.ops_time` of the XLA ops plus `tpu_cost.kernel_time` of the kernels. A model row (the delta rule's
forward and backward as modelled on paper) takes its forward program's XLA ops twice and the modelled kernels; a
row without a model (the TPU delta rule's forward and backward kernels as written) takes their traced dots.
The report also holds XLA's own `cost_analysis()` and `memory_analysis()` and each kernel's scoped VMEM and cost
estimate as compiled. docs/tpu_cost_model.md is the method and the tables.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import pathlib
import re
import time
from typing import Callable

import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks import tpu_cost as tc
from benchmarks.registry import parse_shape

F32, BF16 = jnp.float32, jnp.bfloat16



# ---------------------------------------------------------------------------------------------------------
# Rows: what is compiled and which kernels model its custom calls
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
  """One row at one shape on one chip: (B, T, H, K) with H = HV and K = V, the delta rule's chunk, the chip."""
  B: int
  T: int
  H: int
  K: int
  chunk: int
  chip: tc.Chip


@dataclasses.dataclass(frozen=True)
class Row:
  """op, implementation, mode ("fwd" or "fwd+bwd"), decay; build(case, sharding) → (fn, abstract args) to compile
  (None: nothing); kernels(case) → [tc.Launch] modelling the program's Pallas custom calls (None: their traced
  dots, `census_launches`); glue: how many times the compiled program's XLA ops count; modelled: a modelled kernel
  that the program does not contain."""
  op: str
  impl: str
  mode: str
  decay: str
  build: Callable | None
  kernels: Callable | None = None
  glue: float = 1.0
  modelled: bool = False

  @property
  def name(self) -> str:
    return f"{self.op} {self.impl} {self.mode}" + (" (model)" if self.modelled else "")


def _arrays(case: Case, sharding, decay: str, *, flat: bool = False):
  """q, k, v bf16 ([B, T, H·K] with flat: a projection's layout), β fp32 [B, T, H], log-decays fp32 (none,
  [B, T, H] or [B, T, H, K], flat like q)."""
  b, t, h, kd = case.B, case.T, case.H, case.K
  sd = lambda *shape, dtype=F32: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  wide = (b, t, h * kd) if flat else (b, t, h, kd)
  g = {"none": None, "scalar": sd(b, t, h), "channel": sd(*wide)}[decay]
  return sd(*wide, dtype=BF16), sd(*wide, dtype=BF16), sd(*wide, dtype=BF16), sd(b, t, h), g


def _value_and_grad(fn, args):
  """value_and_grad of Σ fn(args)[0] (fp32) w.r.t. every argument that is not None."""
  where = [i for i, a in enumerate(args) if a is not None]

  def loss(*xs):
    full = list(args)
    for i, x in zip(where, xs):
      full[i] = x
    return jnp.sum(fn(*full)[0].astype(F32))
  return jax.value_and_grad(loss, argnums=tuple(range(len(where)))), [args[i] for i in where]


def _xla_solve(case: Case, sharding, decay: str, grad: bool):
  from osdn_jax import ops

  def fn(q, k, v, beta, g):
    return ops.delta_rule(q, k, v, beta, log_decay=g, chunk_size=case.chunk, implementation="xla")
  args = _arrays(case, sharding, decay)
  return _value_and_grad(fn, args) if grad else (fn, list(args))


def _pallas_fwd(case: Case, sharding, decay: str):
  """The TPU forward kernel on [B, T, H·D] inputs (a projection's layout: no relayout copies), o as [B, T, H·V]."""
  from pallas_kernels.tpu import delta_rule as tdr
  b, t, h, kd = case.B, case.T, case.H, case.K

  def fn(q, k, v, beta, g):
    q, k, v = (x.reshape(b, t, h, kd) for x in (q, k, v))
    g = g.reshape(b, t, h, kd) if decay == "channel" else g
    o, S = tdr.forward(q, k, v, beta, log_decay=g, chunk_size=case.chunk, interpret=False,
                       config=tdr.default_config(None, case.chip.name))
    return o.reshape(b, t, -1), S
  return fn, list(_arrays(case, sharding, decay, flat=True))


def _pallas_grad(case: Case, sharding, decay: str):
  """value_and_grad of the TPU delta rule (its forward and backward kernels) with the chip's launch parameters."""
  from pallas_kernels.tpu import delta_rule as tdr

  def fn(q, k, v, beta, g):
    return tdr.delta_rule(q, k, v, beta, log_decay=g, chunk_size=case.chunk, interpret=False,
                          config=tdr.default_config(None, case.chip.name))
  return _value_and_grad(fn, _arrays(case, sharding, decay))


def _second_moment(case: Case, sharding, impl: str):
  """value_and_grad of the PDN/ATQ second moment A (bf16 keys, fp32 β and log-decays): the XLA path
  (`precond.second_moment`, an associative scan) or the TPU kernel with the chip's block sizes."""
  from osdn_jax.dgps import precond
  from pallas_kernels.tpu import decayed_sum as ds
  config = ds.default_config(None, case.chip.name)

  def fn(k, beta, g):
    if impl == "xla":
      return precond.second_moment(k, beta, g, implementation="xla")
    return ds.decayed_sum(k, g, beta=beta, interpret=False, config=config)
  _, k, _, beta, g = _arrays(case, sharding, "scalar")
  return _value_and_grad(fn, [k, beta, g])


def _fwd_kernels(case: Case, decay: str, *, save_states: bool = False, t_passes: int = tc.HIGHEST_PASSES):
  """The forward kernel's launch: grid (B, HV, 1, T / C), B·HV parallel programs."""
  step = tc.delta_rule_fwd(case.chunk, case.K, case.K, decay=decay, save_states=save_states, t_passes=t_passes)
  programs = case.B * case.H
  return [tc.Launch(step, programs * -(-case.T // case.chunk), programs)]


def _modelled_kernels(case: Case, decay: str, *, t_passes: int = tc.HIGHEST_PASSES):
  """The modelled training pair: the forward storing each chunk's entering state, then the backward kernel."""
  fwd = _fwd_kernels(case, decay, save_states=True, t_passes=t_passes)[0]
  step = tc.delta_rule_bwd(case.chunk, case.K, case.K, decay=decay, t_passes=t_passes)
  return [fwd, tc.Launch(step, fwd.steps, fwd.programs)]


def _decayed_sum_kernels(case: Case):
  """`decayed_sum` and `decayed_sum_reverse` with the chip's block sizes: grid (B, H / Hb, K / W, T / C)."""
  from pallas_kernels.tpu import decayed_sum as ds
  lay = ds.layout(case.T, case.H, case.K, ds.default_config(None, case.chip.name))
  programs = case.B * (case.H // lay.block_h) * (case.K // lay.width)
  steps = programs * lay.tp // lay.chunk
  return [tc.Launch(tc.decayed_sum_step(lay.chunk, lay.width, lay.block_h, case.H, reverse=r), steps, programs)
          for r in (False, True)]


def _delta_rule_rows(op: str, decay: str) -> tuple:
  rows = (Row(op, "pallas", "fwd", decay, functools.partial(_pallas_fwd, decay=decay),
              functools.partial(_fwd_kernels, decay=decay)),
          Row(op, "pallas", "fwd+bwd", decay, functools.partial(_pallas_fwd, decay=decay),
              functools.partial(_modelled_kernels, decay=decay), glue=2.0, modelled=True),
          Row(op, "pallas", "fwd+bwd", decay, functools.partial(_pallas_grad, decay=decay)))   # traced kernels
  if decay != "none":
    rows += (Row(op, "xla", "fwd", decay, functools.partial(_xla_solve, decay=decay, grad=False)),
             Row(op, "xla", "fwd+bwd", decay, functools.partial(_xla_solve, decay=decay, grad=True)))
  return rows


def rows() -> tuple:
  """Every row of the report, one line per kernel or path (a new kernel, e.g. the TPU OSDN d-pass, is one more
  Row)."""
  return (*_delta_rule_rows("dn", "none"), *_delta_rule_rows("gdn", "scalar"), *_delta_rule_rows("kda", "channel"),
          Row("second moment", "xla", "fwd+bwd", "scalar", functools.partial(_second_moment, impl="xla")),
          Row("second moment", "pallas", "fwd+bwd", "scalar", functools.partial(_second_moment, impl="pallas"),
              _decayed_sum_kernels))


# ---------------------------------------------------------------------------------------------------------
# Compiling ahead of time
# ---------------------------------------------------------------------------------------------------------
@functools.cache
def _device(topology: str):
  from osdn_jax.train import aot
  return aot.topology_devices(topology)[0]


_COMPILED: dict = {}


def compile_row(row: Row, case: Case) -> dict | None:
  """The compiled program of a row (cached by its build callable and case): its HLO ops, XLA's cost and memory
  analyses and its Pallas kernels' scoped VMEM and cost estimates. None for a row without a build."""
  if row.build is None:
    return None
  build = row.build
  key = (getattr(build, "func", build), tuple(sorted(getattr(build, "keywords", {}).items())), case)
  if key in _COMPILED:
    return _COMPILED[key]
  device = _device(case.chip.topology)
  sharding = jax.sharding.SingleDeviceSharding(device)
  fn, args = row.build(case, sharding)
  t0 = time.perf_counter()
  with jax.default_device(device):         # Pallas' lowering asks the default device for the chip
    compiled = jax.jit(fn).lower(*args).compile()
  seconds = time.perf_counter() - t0
  text = compiled.as_text()
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  m = compiled.memory_analysis()
  ops = tc.hlo_ops(text)
  out = {"compile_s": round(seconds, 2),
         "memory": {n: getattr(m, f"{n}_size_in_bytes") for n in ("argument", "output", "temp", "generated_code")},
         "cost_analysis": {k: ca.get(k) for k in ("flops", "transcendentals", "bytes accessed", "optimal_seconds")},
         "hlo_once": tc.hlo_totals(tc.hlo_ops(text, loops=False, vmem=True)), "hlo": tc.hlo_totals(ops),
         "kernels": {op.name: {"cost_estimate": op.custom} for op in ops if op.custom is not None},
         "ops": ops}
  for name, vmem in tc.scoped_vmem(text).items():
    out["kernels"].setdefault(name, {})["scoped_vmem"] = vmem
  out["census"] = census_launches(fn, args, out["kernels"])
  _COMPILED[key] = out
  return out


def _is_call(call: str | None, name: str) -> bool:
  """Whether the HLO custom call `name` is the pallas_call `call`: its name, decorated by the transformations
  that made it ("jvp_decayed_sum_.1", "transpose_jvp_decayed_sum_reverse__.1")."""
  return bool(call) and re.search(rf"(?:^|_){re.escape(call)}_*(?:\.\d+)?$", name) is not None


def census_launches(fn, args, kernels: dict) -> list:
  """Every Pallas kernel that `fn` launches, modelled from its traced dots (`benchmarks.census`: shapes and
  dtypes per grid step; an fp32 dot counts as HIGHEST, as every fp32 dot of the TPU kernels is) and the compiled
  custom call's byte estimate: [tc.Launch], in launch order. The grid's last axis is the sequential one."""
  from benchmarks import census
  launches, used = [], set()
  for c in census.census(fn, *args):
    name = next((n for n in sorted(kernels) if n not in used and _is_call(c.name, n)), None)
    used.add(name)
    info = kernels.get(name, {})
    steps = max(c.programs, 1)
    dots = [tc.Dot(f"{m}x{k}x{n} {da}/{db}", m, k, n, tc.HIGHEST_PASSES if "float32" in (da, db) else 1, cnt)
            for (m, k, n, da, db), cnt in c.dots.items()]
    nbytes = (info.get("cost_estimate") or {}).get("bytes_accessed", 0)
    step = tc.Step(c.name, 0, dots, c.exps, nbytes / steps, 0.0, info.get("scoped_vmem") or 0, 0,
                   "traced dots (census)", c.name)
    launches.append(tc.Launch(step, steps, max(steps // c.grid[-1], 1)))
  return launches


def vmem_capacity(chip: tc.Chip) -> int | None:
  """The VMEM per TensorCore that libtpu's compiler reports, from the error of a kernel whose scratch is too large
  (its message names the memory's size); None where the message does not say."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu
  device = _device(chip.topology)

  def kernel(x_ref, o_ref, s_ref):
    s_ref[0:8, :] = x_ref[...]
    o_ref[...] = s_ref[0:8, :]
  spec = pl.BlockSpec((8, 128), lambda: (0, 0))
  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), F32), in_specs=[spec], out_specs=spec,
                        scratch_shapes=[pltpu.VMEM((2**19, 128), F32)])            # 256 MiB
  try:
    with jax.default_device(device):
      jax.jit(call).lower(jax.ShapeDtypeStruct((8, 128), F32, sharding=jax.sharding.SingleDeviceSharding(device)))\
          .compile()
  except Exception as e:  # noqa: BLE001 — the compiler's message is the measurement
    m = re.search(r"would exceed memory \(size=(\d+)\)", str(e))
    return int(m.group(1)) if m else None
  return None


# ---------------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------------
def plan_row(row: Row, case: Case, compiled: dict | None) -> dict:
  """Expected time of one row on one chip: the XLA ops of its compiled program (× row.glue) by the per-op
  roofline, plus its kernels (the row's model, else their traced dots)."""
  parts, kernels = [], []
  if compiled is not None:
    xla_ops = [op for op in compiled["ops"] if op.custom is None]
    glue = tc.ops_time(xla_ops, case.chip)
    parts.append({k: v * row.glue for k, v in glue.items()})
  launches = row.kernels(case) if row.kernels is not None else (compiled or {}).get("census", [])
  for launch in launches:
    parts.append(tc.kernel_time(launch, case.chip))
    kernels.append({"kernel": launch.step.kernel, "call": launch.step.call, "chunk": launch.step.chunk,
                    "steps": launch.steps, "programs": launch.programs, "vmem_blocks": launch.step.vmem_blocks,
                    "vmem_scratch": launch.step.vmem_scratch,
                    "from": "model" if row.kernels is not None else "traced dots", **parts[-1]})
  total = tc.combine(*parts)
  total["mxu_utilisation"] = tc.utilisation(total, case.chip)
  total["bound"] = "MXU" if total["mxu_s"] >= total["hbm_s"] else "HBM"
  total["kernels"] = kernels
  if parts and compiled is not None:
    total["xla_ops"] = parts[0]
  return total


def run_rows(shapes, chips, chunk: int, compile_programs: bool, ops=(), log=print) -> list[dict]:
  """The records of every row (of `ops`, default all) at every shape on every chip."""
  out = []
  for shape in shapes:
    b, t, h, kd = parse_shape(shape)
    for chip_name in chips:
      case = Case(b, t, h, kd, chunk, tc.CHIPS[chip_name])
      for row in rows():
        if ops and row.op not in ops:
          continue
        compiled = compile_row(row, case) if compile_programs else None
        if compiled is None and row.kernels is None:
          continue
        record = {"op": row.op, "impl": row.impl, "mode": row.mode, "decay": row.decay, "modelled": row.modelled,
                  "row": row.name, "shape": shape, "B": b, "T": t, "H": h, "K": kd, "chunk": chunk, "chip": chip_name,
                  "expected": plan_row(row, case, compiled)}
        if compiled is not None:
          record["compiled"] = {k: v for k, v in compiled.items() if k not in ("ops", "census")}
          record["compiled"]["census"] = [{"kernel": x.step.kernel, "steps": x.steps, "programs": x.programs,
                                           "flops_per_step": x.step.flops(), "pass_flops_per_step": x.step.pass_flops,
                                           "exps_per_step": x.step.exps} for x in compiled["census"]]
        out.append(record)
        e = record["expected"]
        log(f"{shape} {chip_name} {row.name} {row.decay}: {e['time_s'] * 1e3:.3f} ms ({e['bound']}-bound, MXU "
            f"{e['mxu_utilisation']:.1%})" + (f", compiled in {compiled['compile_s']} s" if compiled else ""))
  return out


def per_chunk_models(chunks=(64, 128), key_dim: int = 128) -> list[dict]:
  """The per-step models of every kernel at each chunk (decayed_sum at its own chunks: 128 and 256)."""
  out = []
  for c in chunks:
    for decay in ("none", "scalar", "channel"):
      out.append(tc.delta_rule_fwd(c, key_dim, key_dim, decay=decay).summary())
      out.append(tc.delta_rule_fwd(c, key_dim, key_dim, decay=decay, save_states=True).summary())
      out.append(tc.delta_rule_bwd(c, key_dim, key_dim, decay=decay).summary())
  for c in (128, 256):
    for reverse in (False, True):
      out.append(tc.decayed_sum_step(c, key_dim, 8, 16, reverse=reverse).summary())
  return out


def sensitivity(shapes, chips, chunks=(64, 128), passes=(6, 3, 1)) -> list[dict]:
  """The modelled kernels of gdn and kda (forward, and the modelled forward + backward) at each chunk and number of
  MXU passes for the dots that build T (6: HIGHEST, 3: HIGH, 1: bf16)."""
  out = []
  for shape in shapes:
    b, t, h, kd = parse_shape(shape)
    for chip_name in chips:
      for decay in ("scalar", "channel"):
        for c in chunks:
          for p in passes:
            case = Case(b, t, h, kd, c, tc.CHIPS[chip_name])
            for mode, launches in (("fwd", _fwd_kernels(case, decay, t_passes=p)),
                                   ("fwd+bwd", _modelled_kernels(case, decay, t_passes=p))):
              total = tc.combine(*(tc.kernel_time(x, case.chip) for x in launches))
              out.append({"shape": shape, "chip": chip_name, "decay": decay, "chunk": c, "t_passes": p,
                          "mode": mode, "time_s": total["time_s"], "mxu_s": total["mxu_s"], "hbm_s": total["hbm_s"],
                          "mxu_utilisation": tc.utilisation(total, case.chip)})
  return out


# ---------------------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------------------
def _ms(x: float | None) -> str:
  return "–" if x is None else f"{x * 1e3:.3f}"


def _md_chips(report: dict) -> str:
  lines = ["| chip | bf16 peak TFLOP/s | HBM GB/s | HBM GB | TensorCores | MXU | VMEM / core (table) | VMEM / core "
           "(compiler) |", "|---|---|---|---|---|---|---|---|"]
  for name, c in report["chips"].items():
    compiler = c.get("vmem_compiler")
    lines.append(f"| {name} | {c['bf16_flops'] / 1e12:.0f} | {c['hbm_bw'] / 1e9:.0f} | {c['hbm_gb']:g} | "
                 f"{c['cores']} | {c['mxus']} × {c['mxu']}² | {c['vmem_bytes'] // tc.MIB} MiB | "
                 f"{'–' if compiler is None else f'{compiler // tc.MIB} MiB'} |")
  return "\n".join(lines)


def _md_chunks(report: dict) -> str:
  lines = ["| kernel | C | bf16 MFLOP | HIGHEST MFLOP | MXU pass MFLOP | padded v5p | padded v6e | exp k | "
           "HBM KiB / step | HBM KiB / program | VMEM KiB (blocks + scratch) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for m in report["per_chunk"]:
    name = m["kernel"] + (" + states" if "storing" in m["notes"] else "")
    lines.append(f"| {name} | {m['chunk']} | {m['flops_bf16'] / 1e6:.2f} | {m['flops_fp32_highest'] / 1e6:.2f} | "
                 f"{m['pass_flops'] / 1e6:.1f} | {m['padded_pass_flops_v5p'] / 1e6:.1f} | "
                 f"{m['padded_pass_flops_v6e'] / 1e6:.1f} | {m['transcendentals'] / 1e3:.1f} | "
                 f"{m['hbm_bytes_step'] / 1024:.1f} | {m['hbm_bytes_program'] / 1024:.0f} | "
                 f"{m['vmem_blocks'] / 1024:.0f} + {m['vmem_scratch'] / 1024:.0f} |")
  return "\n".join(lines)


def _pairs(records: list[dict]) -> dict:
  """{(shape, op, mode, decay, chip): {"pallas": record, "pallas model": record, "xla": record}}."""
  out = {}
  for r in records:
    key = (r["shape"], r["op"], r["mode"], r["decay"], r["chip"])
    out.setdefault(key, {})[r["impl"] + (" model" if r["modelled"] else "")] = r
  return out


def _md_shape(report: dict, shape: str) -> str:
  """Per (op, mode, decay, chip): expected ms of the Pallas and XLA rows with the MXU operands padded to whole
  tiles and without, the ratios, the Pallas row's bound and both MXU utilisations."""
  lines = ["| op | mode | decay | chip | Pallas ms | XLA ms | XLA ÷ Pallas | Pallas ms, no tile padding | XLA ms, no "
           "tile padding | XLA ÷ Pallas, no padding | Pallas bound | Pallas MXU util | XLA MXU util |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for (s, op, mode, decay, chip), p in _pairs([r for r in report["rows"] if r["shape"] == shape]).items():
    xe = p["xla"]["expected"] if "xla" in p else None
    for variant in [v for v in ("pallas", "pallas model") if v in p] or [None]:
      pe = p[variant]["expected"] if variant else None
      get = lambda e, k: None if e is None else e[k]
      ratio = lambda k: f"{xe[k] / pe[k]:.2f}" if pe and xe else "–"
      tag = " (model)" if variant == "pallas model" else ""
      util = lambda e: "–" if e is None else f"{e['mxu_utilisation']:.1%}"
      lines.append(f"| {op} | {mode} | {decay} | {chip} | {_ms(get(pe, 'time_s'))}{tag} | {_ms(get(xe, 'time_s'))} | "
                   f"{ratio('time_s')} | {_ms(get(pe, 'time_unpadded_s'))} | {_ms(get(xe, 'time_unpadded_s'))} | "
                   f"{ratio('time_unpadded_s')} | {get(pe, 'bound') or '–'} | {util(pe)} | {util(xe)} |")
  return "\n".join(lines)


def _md_detail(report: dict, shape: str) -> str:
  lines = ["| row | decay | chip | useful GFLOP | MXU pass GFLOP | HBM GB | MXU ms (padded) | HBM ms | expected ms | "
           "exp G | XLA-op elementwise GFLOP | XLA cost_analysis GFLOP / GB (loops once) | HLO count, loops once | "
           "temp MB |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in report["rows"]:
    if r["shape"] != shape:
      continue
    e, c = r["expected"], r.get("compiled")
    ca = once = temp = "–"
    if c:
      a, o = c["cost_analysis"], c["hlo_once"]
      ca = f"{(a['flops'] or 0) / 1e9:.1f} / {(a['bytes accessed'] or 0) / 1e9:.2f}"
      once = f"{(o['flops'] + o['vpu_flops'] + o['kernel_flops']) / 1e9:.1f} / {o['bytes'] / 1e9:.2f}"
      temp = f"{c['memory']['temp'] / 1e6:.0f}"
    lines.append(f"| {r['row']} | {r['decay']} | {r['chip']} | {e['useful_flops'] / 1e9:.1f} | "
                 f"{e['pass_flops'] / 1e9:.1f} | {e['hbm_bytes'] / 1e9:.2f} | {_ms(e['mxu_s'])} | {_ms(e['hbm_s'])} | "
                 f"{_ms(e['time_s'])} | {e['transcendentals'] / 1e9:.2f} | {e['vpu_flops'] / 1e9:.1f} | {ca} | "
                 f"{once} | {temp} |")
  return "\n".join(lines)


def _compiled_kernel(compiled: dict, call: str | None) -> dict:
  """The compiled program's record of the custom call of the pallas_call named `call`."""
  for name, info in compiled["kernels"].items():
    if _is_call(call, name):
      return info
  return {}


def _md_vmem(report: dict) -> str:
  lines = ["| kernel | row | shape | chip | C | VMEM model KiB (blocks + scratch) | compiled scoped VMEM KiB | "
           "cost estimate GFLOP | model GFLOP |", "|---|---|---|---|---|---|---|---|---|"]
  for r in report["rows"]:
    c = r.get("compiled")
    if not c or r["impl"] != "pallas" or r["modelled"] or r["shape"] != report["config"]["shapes"][0]:
      continue
    for k in r["expected"]["kernels"]:
      info = _compiled_kernel(c, k["call"])
      vmem, est = info.get("scoped_vmem"), (info.get("cost_estimate") or {}).get("flops")
      vmem = "–" if vmem is None else f"{vmem / 1024:.0f}"
      est = "–" if est is None else f"{est / 1e9:.1f}"
      model = (f"{k['vmem_blocks'] / 1024:.0f} + {k['vmem_scratch'] / 1024:.0f}" if k["from"] == "model"
               else "– (traced)")
      lines.append(f"| {k['kernel']} | {r['row']} | {r['shape']} | {r['chip']} | {k['chunk'] or r['chunk']} | "
                   f"{model} | {vmem} | {est} | {k['useful_flops'] / 1e9:.1f} |")
  return "\n".join(lines)


def _md_sensitivity(report: dict) -> str:
  chips = report["config"]["chips"]
  lines = ["| shape | decay | mode | C | T passes | " + " | ".join(f"{c} ms (MXU util)" for c in chips) + " |",
           "|---|---|---|---|---|" + "---|" * len(chips)]
  groups = {}
  for s in report["sensitivity"]:
    groups.setdefault((s["shape"], s["decay"], s["mode"], s["chunk"], s["t_passes"]), {})[s["chip"]] = s
  for (shape, decay, mode, c, p), by_chip in groups.items():
    cells = [f"{_ms(by_chip[ch]['time_s'])} ({by_chip[ch]['mxu_utilisation']:.1%})" if ch in by_chip else "–"
             for ch in chips]
    lines.append(f"| {shape} | {decay} | {mode} | {c} | {p} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def markdown(report: dict) -> str:
  cfg = report["config"]
  parts = ["## Chips", _md_chips(report), "## Per chunk (one grid step; K = V = 128, bf16 inputs)",
           _md_chunks(report)]
  for shape in cfg["shapes"]:
    b, t, h, kd = parse_shape(shape)
    cmd = (f"python -m benchmarks.tpu_plan --shapes={shape} --chips={','.join(cfg['chips'])} "
           f"--chunk={cfg['chunk']}")
    parts += [f"## {shape}: B={b} T={t} H=HV={h} K=V={kd}, bf16, chunk {cfg['chunk']}", f"`{cmd}`",
              _md_shape(report, shape), f"### {shape}: detail", _md_detail(report, shape)]
  if any(r.get("compiled") for r in report["rows"]):
    parts += [f"## Kernels as compiled ({cfg['shapes'][0]}; per step, so the same at every shape)", _md_vmem(report)]
  parts += ["## Chunk and the passes that build T (modelled kernels only)", _md_sensitivity(report)]
  return "\n\n".join(parts) + "\n"


def build_report(shapes, chips, chunk: int, compile_programs: bool, ops=(), log=print) -> dict:
  """The whole report: chips, per-chunk models, every row's record, the chunk / precision sensitivity."""
  chip_info = {}
  for name in chips:
    chip = tc.CHIPS[name]
    chip_info[name] = {**dataclasses.asdict(chip), "jax_table": tc.jax_tpu_info(chip),
                       "vmem_compiler": vmem_capacity(chip) if compile_programs else None}
  rows_out = run_rows(shapes, chips, chunk, compile_programs, ops, log)
  versions = {}
  for p in ("jax", "jaxlib", "libtpu"):
    try:
      versions[p] = importlib.metadata.version(p)
    except importlib.metadata.PackageNotFoundError:
      versions[p] = None
  return {"config": {"shapes": list(shapes), "chips": list(chips), "chunk": chunk, "compiled": compile_programs,
                     "ops": list(ops), "highest_passes": tc.HIGHEST_PASSES},
          "versions": versions, "chips": chip_info, "per_chunk": per_chunk_models(),
          "rows": rows_out, "sensitivity": sensitivity(shapes, chips)}


def main() -> None:
  # Flags are defined here, not at import, so that other benchmark modules with flags of the same names can be
  # imported into one process with this one (the tests do).
  shapes = flags.DEFINE_list("shapes", ["main", "long"], "benchmark shapes: names of benchmarks.registry.SHAPES or "
                             "BxTxHxK (H = HV, K = V)")
  ops = flags.DEFINE_list("ops", [], "only the rows of these ops (dn, gdn, kda, second moment); default all")
  chips = flags.DEFINE_list("chips", ["v5p", "v6e"], f"chips, of {list(tc.CHIPS)}")
  chunk = flags.DEFINE_integer("chunk", 64, "the delta rule's chunk (the XLA path's and the Pallas kernels')")
  compile_ = flags.DEFINE_bool("compile", True, "compile every row for TPU (libtpu); --nocompile: the model only")
  out = flags.DEFINE_string("out", "", "where to write the JSON report (and the tables beside it, .md); '' for none")
  md_path = flags.DEFINE_string("md", "", "the markdown tables (default: --out with .md)")

  def run(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    t0 = time.perf_counter()
    report = build_report(shapes.value, chips.value, chunk.value, compile_.value, tuple(ops.value))
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    md = markdown(report)
    print(md)
    if out.value:
      path = pathlib.Path(out.value)
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(tc.dumps(report) + "\n")
      pathlib.Path(md_path.value or path.with_suffix(".md")).write_text(md)
    print(f"wall {report['wall_s']} s")

  app.run(run)


if __name__ == "__main__":
  main()
