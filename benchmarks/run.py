"""The benchmark-and-check runner: every op of `benchmarks.registry` × shape × mode × implementation × variant.

Per measurement: compile (timed apart), then the per-call ms (`benchmarks.timing`: back-to-back calls, one
synchronisation, median over reps), the compiled temp + output bytes (ours) or the peak allocated bytes (FLA),
and optionally
  --check    accuracy: the outputs (fwd) or every input gradient under fixed random cotangents on every output
             (fwdbwd), against implementation "xla" in fp32 at HIGHEST matmul precision on the same rounded
             inputs, as rms(x − y) / rms(y); FLA's forward output too, and our forward output against FLA's
             (err_vs_fla);
  --profile  device ms per kernel from a `jax.profiler` trace (`benchmarks.trace`; GPU only, empty on CPU).
--census prints the static census (`benchmarks.census`) of the pallas implementation's kernels and exits
(nothing runs). Every row is appended to --out as it is measured (atomic rewrite), so a killed run keeps what it
measured; a failure (a compile error, FLA refusing a backward) is recorded in its row and the run goes on. A row
replaces the row of an earlier run with the same (shape, op, mode, impl, variant, dtype, precision). At the end,
one table per mode: ms per implementation, the ratio to the row's baseline (FLA where measured, else xla), MB,
and the largest relative error. With FLA in the process, set XLA_PYTHON_CLIENT_PREALLOCATE=false (JAX otherwise
takes 75 % of the GPU's memory before torch allocates anything).

  python -m benchmarks.run --shapes=main,long --ops=dn,gdn,kda --impls=xla,pallas       # ours ÷ FLA, bf16
  python -m benchmarks.run --shapes=main --ops=kda --impls=pallas --fla=false \\
      --variants=default,delta_rule:state.block_v=32+grads.warps_intra=4 --profile
  python -m benchmarks.run --ops=d_pass --impls=xla,pallas --variants=default,osdn:solve_t_init=0 --check
  JAX_PLATFORMS=cpu python -m benchmarks.run --shapes=tiny --ops=dn,d_pass --impls=xla,pallas --check \\
      --calls=2 --reps=2 --out=/tmp/b.json                                                  # interpret mode
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import registry, timing, trace
from osdn_jax.testing import rel_rms

MODES = ("fwd", "fwdbwd")
DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}
PRECISIONS = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32")


@dataclasses.dataclass(frozen=True)
class Settings:
  """What one run measures (the flags of `main`)."""
  ops: tuple = registry.END_TO_END
  shapes: tuple = ("main",)
  impls: tuple = ("xla", "pallas")
  modes: tuple = MODES
  dtype: str = "bf16"
  variants: tuple = ("default",)
  check: bool = False
  profile: bool = False
  census: bool = False
  calls: int = 20
  reps: int = 7
  warmup: int = 2
  fla: bool = True
  out: str = "results/benchmarks.json"
  precision: str = "default"
  seed: int = 0
  top: int = 12
  trace_dir: str = ""

  def validate(self):
    """The parsed variants; ValueError naming the first unknown op, shape, implementation, mode, dtype,
    precision or bad variant."""
    for name, values, known in (("op", self.ops, registry.OPS), ("implementation", self.impls, registry.IMPLS),
                                ("mode", self.modes, MODES), ("dtype", (self.dtype,), DTYPES),
                                ("precision", (self.precision,), PRECISIONS)):
      for v in values:
        if v not in known:
          raise ValueError(f"unknown {name} {v!r}: one of {list(known)}")
    for s in self.shapes:
      registry.parse_shape(s)
    return [registry.parse_kernel_variant(v) for v in self.variants]


@dataclasses.dataclass(frozen=True)
class Task:
  """One measurement: an op at a shape, in a mode, by one implementation and variant."""
  shape: str
  dims: tuple
  op: registry.Op
  mode: str
  impl: str
  variant: registry.Variant

  def label(self) -> str:
    return f"{self.shape}/{self.op.name}/{self.mode}/{self.impl}/{self.variant.name}"


def plan(s: Settings, variants, fla_ok: bool) -> list[Task]:
  """The measurements in order: per shape, op and mode, FLA first (its output is what ours are compared with),
  then each implementation; the variants apply to pallas only, and only to ops that call their family."""
  impls = [i for i in s.impls if i != "fla"]
  tasks = []
  for shape in s.shapes:
    dims = registry.parse_shape(shape)
    for name in s.ops:
      op = registry.OPS[name]
      for mode in s.modes:
        if fla_ok and op.fla:
          tasks.append(Task(shape, dims, op, mode, "fla", registry.DEFAULT))
        for impl in impls:
          for v in (variants if impl == "pallas" else [registry.DEFAULT]):
            if op.takes(impl, v) and op.runs_at(impl, dims):
              tasks.append(Task(shape, dims, op, mode, impl, v))
  return tasks


# ---------------------------------------------------------------------------------------------------------
# The functions measured.
# ---------------------------------------------------------------------------------------------------------
def _loss(outs, cts):
  return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(outs, cts) if c is not None)


def fwdbwd_fn(f, diff):
  """(x, cotangents) → {name: gradient} of Σ ⟨output, cotangent⟩ w.r.t. the inputs `diff`."""
  def g(x, cts):
    return jax.grad(lambda d: _loss(f({**x, **d}), cts))({n: x[n] for n in diff})
  return g


def value_and_grads_fn(f, diff):
  """(x, cotangents) → (outputs, {name: gradient}), as `fwdbwd_fn` plus the outputs."""
  def g(x, cts):
    def loss(d):
      outs = f({**x, **d})
      return _loss(outs, cts), outs
    grads, outs = jax.grad(loss, has_aux=True)({n: x[n] for n in diff})
    return outs, grads
  return g


@contextlib.contextmanager
def _trace_folder(root: str, task: Task):
  """A folder for one measurement's profiler trace: under `root` (kept), or a temporary one (deleted)."""
  if root:
    folder = os.path.join(root, task.label().replace("/", "-").replace(":", "-").replace("+", "-"))
    os.makedirs(folder, exist_ok=True)
    yield folder
  else:
    with tempfile.TemporaryDirectory() as folder:
      yield folder


def _precision(name: str):
  return contextlib.nullcontext() if name == "default" else jax.default_matmul_precision(name)


def _host(x):
  return None if x is None else np.asarray(x, np.float32)


class Case:
  """One op at one shape: host inputs, device inputs in the benchmark dtype, the fixed random cotangents of its
  outputs (bf16 values, drawn once, the same for every implementation) and, lazily, the fp32 reference."""

  def __init__(self, op: registry.Op, dims, s: Settings):
    self.op, self.seed = op, s.seed
    self.x = op.inputs(dims, s.seed)
    dt = DTYPES[s.dtype]
    self.xd = {n: jnp.asarray(a, dt if n in op.wide else a.dtype) for n, a in self.x.items()}
    self._cts = self._ref = None
    self.fla_out = None

  def cotangents(self, f=None):
    if self._cts is None:
      shapes = jax.eval_shape(f or self.op.build("xla"), self.xd)
      rng = np.random.default_rng(self.seed + 1)
      self._cts = tuple(None if o is None else jnp.asarray(jnp.asarray(rng.normal(size=o.shape), jnp.bfloat16),
                                                           jnp.float32) for o in shapes)
    return self._cts

  def reference(self):
    """(outputs, {name: gradient}) of "xla" in fp32 at HIGHEST precision on the rounded inputs (host)."""
    if self._ref is None:
      op = self.op
      xr = {n: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for n, a in self.xd.items()}
      with jax.default_matmul_precision("highest"):
        outs, grads = jax.jit(value_and_grads_fn(op.build("xla"), op.diff))(xr, self.cotangents())
      self._ref = (tuple(map(_host, outs)), {n: _host(g) for n, g in grads.items()})
    return self._ref


def _errors(op, mode, result, ref):
  ref_outs, ref_grads = ref
  if mode == "fwd":
    return {n: rel_rms(_host(o), r) for n, o, r in zip(op.outputs, result, ref_outs) if o is not None}
  return {f"d{n}": rel_rms(_host(result[n]), ref_grads[n]) for n in op.diff}


def _check(row, case, mode, result):
  try:
    row["errors"] = _errors(case.op, mode, result, case.reference())
    row["max_err"] = float(np.max(list(row["errors"].values())))
  except Exception as e:  # noqa: BLE001 — the reference failing is recorded, the timing stays
    row["check_error"] = f"{type(e).__name__}: {str(e)[:500]}"


def measure_ours(task: Task, case: Case, s: Settings, row: dict) -> list[str]:
  """Fills `row` for one of our implementations; returns the --profile table's lines."""
  op = task.op
  f = op.build(task.impl, task.variant)
  if task.mode == "fwd":
    fn, args = jax.jit(f), (case.xd,)
  else:
    fn, args = jax.jit(fwdbwd_fn(f, op.diff)), (case.xd, case.cotangents(f))
  with _precision(s.precision):
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
  row["compile_s"] = time.perf_counter() - t0
  result = jax.block_until_ready(compiled(*args))
  row["ms"] = timing.jax_ms(compiled, *args, n=s.calls, reps=s.reps, warmup=s.warmup)
  row["bytes"] = timing.compiled_bytes(compiled)
  if s.check:
    _check(row, case, task.mode, result)
  if task.mode == "fwd" and case.fla_out is not None:
    row["err_vs_fla"] = rel_rms(_host(result[0]), case.fla_out)
  if s.profile:
    with _trace_folder(s.trace_dir, task) as folder:
      times = trace.per_call(compiled, *args, calls=s.calls, folder=folder)
    row["kernels"] = trace.by_kernel(times)
    row["kernel_ms"] = sum(row["kernels"].values())
    return trace.table([(line, name, us) for (line, name), us in times.items()], 1, s.top)
  return []


def measure_fla(task: Task, case: Case, s: Settings, row: dict) -> list[str]:
  """Fills `row` for FLA (`benchmarks.fla`); keeps its forward output for err_vs_fla."""
  from benchmarks import fla
  do = np.asarray(case.cotangents()[0])
  res = fla.measure(task.op.name, case.x, task.mode, do, dtype=s.dtype, calls=s.calls, reps=s.reps,
                    warmup=s.warmup)
  row.update(ms=res["ms"], do_bench_ms=res["do_bench_ms"], bytes=res["peak_bytes"])
  if task.mode == "fwd":
    case.fla_out = res["out"]
    if s.check:
      _check(row, case, "fwd", (res["out"],) + (None,) * (len(task.op.outputs) - 1))
  return []


# ---------------------------------------------------------------------------------------------------------
# Results: the JSON file and the tables.
# ---------------------------------------------------------------------------------------------------------
KEY = ("shape", "op", "mode", "impl", "variant", "dtype", "precision")


class Results:
  """The JSON file {"runs": [meta, ...], "rows": [row, ...]}, rewritten atomically (tmp + os.replace) after
  every row; a row replaces an earlier row with the same KEY. `rows`: this run's."""

  def __init__(self, path: str, meta: dict):
    self.path, self.rows = path, []
    data = {"runs": [], "rows": []}
    if path and os.path.exists(path):
      with open(path) as f:
        data = json.load(f)
      if not (isinstance(data, dict) and isinstance(data.get("runs"), list) and isinstance(data.get("rows"), list)):
        raise ValueError(f"{path} exists and is not a benchmarks.run results file: choose another --out")
    self.data, self.run = data, len(data["runs"])
    data["runs"].append(dict(meta, run=self.run))
    self._save()

  def add(self, row: dict):
    row = dict(row, run=self.run)
    key = tuple(row.get(k) for k in KEY)
    self.data["rows"] = [r for r in self.data["rows"] if tuple(r.get(k) for k in KEY) != key] + [row]
    self.rows.append(row)
    self._save()

  def _save(self):
    if not self.path:
      return
    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.data, f, indent=1)
    os.replace(tmp, self.path)


def summary(row: dict) -> str:
  """One progress line's result."""
  if "error" in row:
    return "FAILED " + row["error"].splitlines()[0][:300]
  parts = [f"{row['ms']:.3f} ms"]
  if row.get("do_bench_ms") is not None:
    parts.append(f"(do_bench {row['do_bench_ms']:.3f} ms)")
  if row.get("bytes") is not None:
    parts.append(f"{row['bytes'] / 1e6:.1f} MB")
  if row.get("compile_s") is not None:
    parts.append(f"compile {row['compile_s']:.1f} s")
  if row.get("errors"):
    parts.append("err " + " ".join(f"{n}={e:.1e}" for n, e in row["errors"].items()))
  if row.get("err_vs_fla") is not None:
    parts.append(f"vs FLA {row['err_vs_fla']:.1e}")
  if row.get("kernel_ms") is not None:
    parts.append(f"kernels {row['kernel_ms']:.3f} ms")
  if row.get("check_error"):
    parts.append("check FAILED " + row["check_error"][:200])
  return "  ".join(parts)


def _label(row, names):
  return row["impl"] if row["variant"] == "default" else f"{row['impl']}/v{names.index(row['variant']) + 1}"


def table(rows: list[dict]) -> str:
  """One table per mode: rows shape/op; ms per implementation (and variant), each ÷ the row's baseline (FLA
  where measured, else xla, else the first measured), MB per implementation, the largest error where checked."""
  names = list(dict.fromkeys(r["variant"] for r in rows if r["variant"] != "default"))
  blocks = ["\n".join(f"v{i + 1} = {n}" for i, n in enumerate(names))] if names else []
  for mode in dict.fromkeys(r["mode"] for r in rows):
    mrows = [r for r in rows if r["mode"] == mode]
    labels = list(dict.fromkeys(_label(r, names) for r in mrows))
    cases = list(dict.fromkeys((r["shape"], r["op"]) for r in mrows))
    cell = {(r["shape"], r["op"], _label(r, names)): r for r in mrows}
    checked = any("max_err" in r for r in mrows)
    ours = [lb for lb in labels if lb != "fla"]
    head = (["shape/op"] + labels + ["base"] + [f"{lb}÷base" for lb in ours] + [f"MB {lb}" for lb in labels] +
            ([f"err {lb}" for lb in labels] if checked else []))
    lines = []
    for shape, op in cases:
      get = lambda lb: cell.get((shape, op, lb), {})
      ms = lambda lb: get(lb).get("ms")
      base = next((lb for lb in ["fla", "xla"] + labels if ms(lb)), "xla")
      fmt_ms = lambda lb: "FAIL" if "error" in get(lb) else (f"{ms(lb):.3f}" if ms(lb) else "–")
      ratio = lambda lb: f"{ms(lb) / ms(base):.2f}" if ms(lb) and ms(base) else "–"
      mb = lambda lb: f"{get(lb)['bytes'] / 1e6:.1f}" if get(lb).get("bytes") is not None else "–"
      err = lambda lb: f"{get(lb)['max_err']:.1e}" if get(lb).get("max_err") is not None else "–"
      lines.append([f"{shape}/{op}"] + [fmt_ms(lb) for lb in labels] + [base] + [ratio(lb) for lb in ours] +
                   [mb(lb) for lb in labels] + ([err(lb) for lb in labels] if checked else []))
    widths = [max(len(str(row[i])) for row in [head] + lines) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    title = (f"[{mode}] ms per call (median); X÷base = X's ms ÷ the baseline's (FLA where measured: ours ÷ FLA, "
             f"else xla, else the first column; < 1 is faster); MB: compiled temp + output (ours), peak allocated (FLA)"
             + ("; err: largest rel RMS vs fp32 xla (HIGHEST)" if checked else ""))
    blocks.append("\n".join([title, fmt(head)] + [fmt(line) for line in lines]))
  return "\n\n".join(blocks)


# ---------------------------------------------------------------------------------------------------------
def _meta(s: Settings, fla_ok: bool, fla_unavailable: str | None) -> dict:
  import jaxlib
  dev = jax.devices()[0]
  meta = dict(started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              jax=jax.__version__, jaxlib=jaxlib.__version__, backend=jax.default_backend(),
              device=getattr(dev, "device_kind", str(dev)), device_count=jax.device_count(),
              flags=dataclasses.asdict(s))
  if fla_unavailable:
    meta["fla_unavailable"] = fla_unavailable
  if fla_ok:
    import fla as fla_package
    import torch
    meta.update(torch=torch.__version__, fla=getattr(fla_package, "__version__", "?"))
  return meta


def benchmark(s: Settings, log=print) -> list[dict]:
  """Runs every measurement of `s` (printing a progress line each, appending rows to s.out), prints the
  tables and returns this run's rows."""
  variants = s.validate()
  fla_ok, reason = False, None
  if (s.fla or "fla" in s.impls) and any(registry.OPS[o].fla for o in s.ops):
    from benchmarks import fla
    reason = fla.unavailable()
    fla_ok = reason is None
    if not fla_ok:
      log(f"FLA unavailable: {reason}")
  tasks = plan(s, variants, fla_ok)
  meta = _meta(s, fla_ok, reason)
  log(f"jax {meta['jax']} on {meta['device']} ({meta['backend']}); {s.dtype}; {len(tasks)} measurements; "
      f"FLA {'yes' if fla_ok else 'no'}")
  results = Results(s.out, meta)
  case, key = None, None
  for i, task in enumerate(tasks, 1):
    if (task.shape, task.op.name) != key:
      key, case = (task.shape, task.op.name), None     # the previous case's arrays go before the next's come
      case = Case(task.op, task.dims, s)
    row = dict(shape=task.shape, dims=list(task.dims), op=task.op.name, mode=task.mode, impl=task.impl,
               variant=task.variant.name, dtype=s.dtype, precision=s.precision)
    lines = []
    try:
      measure = measure_fla if task.impl == "fla" else measure_ours
      lines = measure(task, case, s, row)
    except Exception as e:  # noqa: BLE001 — recorded in the row; the run goes on
      row["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
      row["trace"] = traceback.format_exc()[-4000:]
    results.add(row)
    log(f"[{i}/{len(tasks)}] {task.label()}  {summary(row)}")
    for line in lines:
      log(line)
  log("\n" + table(results.rows))
  if s.out:
    log(f"\nresults: {s.out}")
  return results.rows


def print_census(s: Settings, log=print):
  """The static census of the pallas implementation's kernels, per shape, op, mode and variant (traced only)."""
  from benchmarks.census import census, format_census
  variants = s.validate()
  dt = DTYPES[s.dtype]
  for shape in s.shapes:
    dims = registry.parse_shape(shape)
    for name in s.ops:
      op = registry.OPS[name]
      if "pallas" not in op.impls:
        continue
      x = {n: jax.ShapeDtypeStruct(a.shape, dt if n in op.wide else a.dtype) for n, a in op.inputs(dims).items()}
      for mode in s.modes:
        for v in variants:
          if not op.takes("pallas", v):
            continue
          f = op.build("pallas", v)
          args = (x,)
          if mode == "fwdbwd":
            f = fwdbwd_fn(f, op.diff)
            outs = jax.eval_shape(op.build("pallas", v), x)
            args = (x, tuple(None if o is None else jax.ShapeDtypeStruct(o.shape, jnp.float32) for o in outs))
          with _precision(s.precision):
            rows = census(f, *args)
          log(f"\n{shape}/{name}/{mode}/pallas/{v.name}: {len(rows)} kernel launches")
          log(format_census(rows))


# ---------------------------------------------------------------------------------------------------------
_OPS = flags.DEFINE_list("ops", list(registry.END_TO_END),
                         f"ops: end to end {list(registry.END_TO_END)}, components {list(registry.COMPONENTS)}")
_SHAPES = flags.DEFINE_list("shapes", ["main"], f"B, T, H, K = V: {registry.SHAPES} or BxTxHxK")
_IMPLS = flags.DEFINE_list("impls", ["xla", "pallas"], "of reference (up to T = 4096 for the solves), xla, pallas")
_MODES = flags.DEFINE_list("modes", list(MODES), "fwd and/or fwdbwd (gradients of every input)")
_DTYPE = flags.DEFINE_enum("dtype", "bf16", list(DTYPES), "dtype of the wide inputs (q, k, v, write keys)")
_VARIANTS = flags.DEFINE_list("variants", ["default"], "pallas kernel configs: default or "
                              "<family>:<field=value>+... with family delta_rule, osdn or precond_key")
_CHECK = flags.DEFINE_bool("check", False, "also the relative RMS error vs the fp32 xla baseline at HIGHEST")
_PROFILE = flags.DEFINE_bool("profile", False, "also the device ms per kernel from a profiler trace")
_CENSUS = flags.DEFINE_bool("census", False, "print the static census of the pallas kernels and exit")
_CALLS = flags.DEFINE_integer("calls", 20, "back-to-back calls per timed repetition (and per profile)")
_REPS = flags.DEFINE_integer("reps", 7, "timed repetitions (the median is reported)")
_WARMUP = flags.DEFINE_integer("warmup", 2, "untimed calls before timing")
_FLA = flags.DEFINE_bool("fla", True, "include FLA where it has the op and imports")
_OUT = flags.DEFINE_string("out", "results/benchmarks.json", "JSON results (rows appended; '' for none)")
_PRECISION = flags.DEFINE_enum("precision", "default", list(PRECISIONS), "jax.default_matmul_precision of ours")
_SEED = flags.DEFINE_integer("seed", 0, "seed of the random inputs (cotangents: seed + 1)")
_TOP = flags.DEFINE_integer("top", 12, "--profile: kernels printed per device line")
_TRACE_DIR = flags.DEFINE_string("trace_dir", "", "--profile: keep the traces here (default: temporary, deleted)")


def settings_from_flags() -> Settings:
  return Settings(ops=tuple(_OPS.value), shapes=tuple(_SHAPES.value), impls=tuple(_IMPLS.value),
                  modes=tuple(_MODES.value), dtype=_DTYPE.value, variants=tuple(_VARIANTS.value),
                  check=_CHECK.value, profile=_PROFILE.value, census=_CENSUS.value, calls=_CALLS.value,
                  reps=_REPS.value, warmup=_WARMUP.value, fla=_FLA.value, out=_OUT.value,
                  precision=_PRECISION.value, seed=_SEED.value, top=_TOP.value, trace_dir=_TRACE_DIR.value)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  s = settings_from_flags()
  try:
    s.validate()
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  if s.census:
    print_census(s, log=lambda *a: print(*a, flush=True))
  else:
    benchmark(s, log=lambda *a: print(*a, flush=True))


if __name__ == "__main__":
  app.run(main)
