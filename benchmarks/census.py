"""A static census of the Pallas kernels a JAX function launches: per program, the dots (shapes, dtypes,
counts, multiply-adds), the exps, the reductions and the peak size of the live register values.

Nothing runs: the function is traced (`jax.make_jaxpr`), every `pallas_call` in the trace is found and its
kernel jaxpr is walked, loops multiplied by their trip counts. The peak live size is a proxy for register
pressure: the largest total size (bytes) of the non-ref values alive at once in program order, loop bodies
counted on top of what is alive around the loop (the compiler may reorder, rematerialise or spill).

  census(fn, *args) → [KernelCensus]; print(format_census(...)).
"""
from __future__ import annotations

import collections
import dataclasses
import math

import jax
import numpy as np
from jax._src import core as jax_core   # Jaxpr, ClosedJaxpr, Var, DropVar (not all public)

_DOT = "dot_general"
_REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin")


@dataclasses.dataclass
class KernelCensus:
  """What one program of one pallas_call does (loops unrolled by trip count)."""
  name: str
  grid: tuple
  dots: collections.Counter            # (m, k, n, lhs dtype, rhs dtype) → count per program
  macs: float = 0.0                    # multiply-adds per program, all dots
  macs_f32: float = 0.0                # of which in fp32 (CUDA cores in Triton: IEEE, not TF32)
  exps: float = 0.0                    # exp elements per program
  reductions: float = 0.0              # reduction ops per program (each over a whole value)
  peak_live_bytes: int = 0             # largest live register footprint (see module docstring)
  largest_value: tuple = ()            # the shape of the largest single value

  @property
  def programs(self) -> int:
    return int(math.prod(self.grid))


def _is_ref(aval) -> bool:
  return type(aval).__name__ in ("AbstractRef", "TransformedRef") or hasattr(aval, "inner_aval")


def _nbytes(aval) -> int:
  if _is_ref(aval) or not hasattr(aval, "shape"):
    return 0
  return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def _sub_jaxprs(eqn):
  """(jaxpr, multiplier) pairs of an equation's bodies (a scan's body runs `length` times)."""
  p = eqn.params
  name = eqn.primitive.name
  if name == "scan":
    return [(p["jaxpr"].jaxpr, p["length"])]
  if name == "while":
    return [(p["body_jaxpr"].jaxpr, _while_trips(eqn)), (p["cond_jaxpr"].jaxpr, _while_trips(eqn))]
  if name == "cond":
    return [(b.jaxpr, 1) for b in p["branches"]]
  out = []
  for v in p.values():
    if isinstance(v, jax_core.ClosedJaxpr):
      out.append((v.jaxpr, 1))
    elif isinstance(v, jax_core.Jaxpr):
      out.append((v, 1))
  return out


def _while_trips(eqn) -> int:
  """A while loop's trip count is not static: counted once (fori_loops with static bounds are scans)."""
  del eqn
  return 1


class _Walker:
  def __init__(self, c: KernelCensus):
    self.c = c

  def walk(self, jaxpr, mult: float) -> int:
    """Counts the ops of `jaxpr` (× mult) and returns its peak live bytes."""
    last_use = {}
    for i, eqn in enumerate(jaxpr.eqns):
      for v in eqn.invars:
        if isinstance(v, jax_core.Var):
          last_use[v] = i
    for v in jaxpr.outvars:
      if isinstance(v, jax_core.Var):
        last_use[v] = len(jaxpr.eqns)
    live = {v: _nbytes(v.aval) for v in jaxpr.invars if v in last_use}
    peak = sum(live.values())
    for i, eqn in enumerate(jaxpr.eqns):
      self._count(eqn, mult)
      inner = 0
      for sub, m in _sub_jaxprs(eqn):
        inner = max(inner, self.walk(sub, mult * m))
      outs = {v: _nbytes(v.aval) for v in eqn.outvars if not isinstance(v, jax_core.DropVar)}
      for v in outs:
        self._largest(v.aval)
      peak = max(peak, sum(live.values()) + max(inner, sum(outs.values())))
      for v in list(live):
        if last_use.get(v, -1) <= i:
          del live[v]
      for v, n in outs.items():
        if last_use.get(v, -1) > i:
          live[v] = n
    return peak

  def _largest(self, aval):
    if not _is_ref(aval) and hasattr(aval, "shape"):
      if math.prod(aval.shape) > math.prod(self.c.largest_value or (0,)):
        self.c.largest_value = tuple(aval.shape)

  def _count(self, eqn, mult):
    name = eqn.primitive.name
    if name == _DOT:
      a, b = (v.aval for v in eqn.invars)
      ((ca,), (cb,)), _ = eqn.params["dimension_numbers"]
      m, k = a.shape[1 - ca], a.shape[ca]
      n = b.shape[1 - cb]
      key = (m, k, n, np.dtype(a.dtype).name, np.dtype(b.dtype).name)
      self.c.dots[key] += mult
      self.c.macs += mult * m * k * n
      if "float32" in key[3:]:
        self.c.macs_f32 += mult * m * k * n
    elif name == "exp":
      self.c.exps += mult * math.prod(eqn.outvars[0].aval.shape)
    elif name in _REDUCTIONS:
      self.c.reductions += mult


def _find_pallas_calls(jaxpr, out):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      out.append(eqn)
    else:
      for sub, _ in _sub_jaxprs(eqn):
        _find_pallas_calls(sub, out)
  return out


def census(fn, *args) -> list[KernelCensus]:
  """The census of every pallas_call that `fn(*args)` launches, in launch order."""
  closed = jax.make_jaxpr(fn)(*args)
  result = []
  for eqn in _find_pallas_calls(closed.jaxpr, []):
    name = eqn.params.get("name") or getattr(eqn.params.get("name_and_src_info"), "name", "?")
    c = KernelCensus(name=str(name), grid=tuple(eqn.params["grid_mapping"].grid), dots=collections.Counter())
    c.peak_live_bytes = _Walker(c).walk(eqn.params["jaxpr"], 1)
    result.append(c)
  return result


def format_census(rows: list[KernelCensus]) -> str:
  """A table: per kernel, programs, per-program dots / MACs / exps / reductions / peak live KiB."""
  lines = [f"{'kernel':28s} {'programs':>8s} {'dots':>5s} {'MMAC':>7s} {'f32 MMAC':>8s} {'kexp':>7s} "
           f"{'reduce':>6s} {'live KiB':>8s} {'GMAC all':>8s}  dot shapes (m×k×n dtypes: count)"]
  for c in rows:
    shapes = ", ".join(f"{m}×{k}×{n} {da[:4]}/{db[:4]}: {cnt:g}" for (m, k, n, da, db), cnt in
                       sorted(c.dots.items(), key=lambda kv: -kv[0][0] * kv[0][1] * kv[0][2] * kv[1]))
    lines.append(f"{c.name:28s} {c.programs:8d} {sum(c.dots.values()):5g} {c.macs / 1e6:7.3f} "
                 f"{c.macs_f32 / 1e6:8.3f} {c.exps / 1e3:7.1f} {c.reductions:6g} "
                 f"{c.peak_live_bytes / 1024:8.1f} {c.macs * c.programs / 1e9:8.2f}  {shapes}")
  return "\n".join(lines)
