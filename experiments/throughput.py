"""Throughput of the solves on one GPU: ours (xla, pallas; naive at small T) and FLA in the same process.

Times forward and forward+backward (gradients of every input) of each op at the benchmark shapes of
BENCHMARKS.md, bf16 inputs: q, k L2-normalised, β = σ(N(0,1)), decays logσ(N(0,1) + 4), PDN gates
βᴾ = σ(N), gᴾ = logσ(N + 4), centre −0.2. Before timing, each implementation's output is compared with FLA's
(when `fla` imports) and with our XLA path. Prints a table of ms and ratios; writes JSON after every
measurement (merged into --out), so a killed run keeps what it measured. FLA autotunes for minutes per new
shape: time a few ops per call.

  python -m experiments.throughput --shapes main --ops dn,gdn --impls xla,pallas --out results/throughput.json

Every implementation is timed the same way (`experiments.timing`: back-to-back calls, one synchronisation,
median per-call time); FLA is also timed with `triton.testing.do_bench` (do_bench_ms in the JSON) as a check.
Peak memory: FLA's torch.cuda.max_memory_allocated over one call beyond what was allocated before it; ours,
the compiled function's temp + output bytes.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.timing import jax_ms, torch_ms
from osdn_jax import ops
from osdn_jax.dgps import precond

SHAPES = {"main": (4, 4096, 16, 128), "long": (1, 32768, 8, 128), "small": (2, 512, 4, 64)}
OPS = ("dn", "gdn", "kda", "pdn", "pgdn", "pkda", "osdn", "osdn-apf")
DECAY = {"dn": "none", "gdn": "scalar", "kda": "channel", "pdn": "none", "pgdn": "scalar", "pkda": "channel",
         "osdn": "none", "osdn-apf": "none"}
FLA_OP = {"dn": "chunk_delta_rule", "gdn": "chunk_gated_delta_rule", "kda": "chunk_kda",
          "pdn": "chunk_precond_gated_delta_rule (g = 0)", "pgdn": "chunk_precond_gated_delta_rule",
          "pkda": "chunk_precond_kda"}

_SHAPES = flags.DEFINE_list("shapes", ["main"], f"of {list(SHAPES)}")
_OPS = flags.DEFINE_list("ops", list(OPS), "ops to time")
_IMPLS = flags.DEFINE_list("impls", ["xla", "pallas"], "our implementations (naive only at T ≤ 4096)")
_MODES = flags.DEFINE_list("modes", ["fwd", "fwdbwd"], "fwd and/or fwdbwd")
_FLA = flags.DEFINE_bool("fla", True, "also time FLA when it imports")
_OUT = flags.DEFINE_string("out", "results/throughput.json", "JSON results (merged)")
_CALLS = flags.DEFINE_integer("calls", 20, "back-to-back calls per timed repetition (experiments.timing)")


def _inputs(op, shape, seed=0):
  """Host (numpy fp32) inputs of one op; the same values go to JAX and to torch."""
  b, t, h, d = shape
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  sig = lambda x: 1 / (1 + np.exp(-x))
  logsig = lambda x: -np.logaddexp(0, -x)
  x = dict(q=unit(rng.normal(size=(b, t, h, d))), k=unit(rng.normal(size=(b, t, h, d))),
           v=rng.normal(size=(b, t, h, d)), beta=sig(rng.normal(size=(b, t, h))))
  if DECAY[op] == "scalar":
    x["g"] = logsig(rng.normal(size=(b, t, h)) + 4)
  if DECAY[op] == "channel":
    x["g"] = logsig(rng.normal(size=(b, t, h, d)) + 4)
  if op in ("pdn", "pgdn", "pkda"):
    x["beta_p"] = sig(rng.normal(size=(b, t, h)))
    x["g_p"] = logsig(rng.normal(size=(b, t, h)) + 4)
  if op == "osdn-apf":
    x["r"] = sig(rng.normal(size=(b, t, h)) + 8)
  return {n: a.astype(np.float32) for n, a in x.items()}


def _ours(op, impl):
  """f(inputs) → o for one op, the preconditioner's first pass included."""
  center = -0.2

  def f(x):
    k_write = None
    if op in ("pdn", "pgdn", "pkda"):
      k_write, _ = precond.pdn_write_key(x["k"], x["beta_p"], x["g_p"], jnp.full((x["k"].shape[2],), center))
    elif op.startswith("osdn"):
      k_write, _ = precond.osdn_write_key(x["k"], x["beta"], retention=x.get("r"))
    o, _ = ops.delta_rule(x["q"], x["k"], x["v"], x["beta"], k_write=k_write, log_decay=x.get("g"),
                          implementation=impl)
    return o
  return f


def _jax_inputs(x, dtype=jnp.bfloat16):
  """q, k, v in `dtype` (bf16, the benchmark's), everything else fp32."""
  wide = ("q", "k", "v")
  return {n: jnp.asarray(a, dtype if n in wide else jnp.float32) for n, a in x.items()}


def _jax_fn(op, impl, mode, do):
  f = _ours(op, impl)
  if mode == "fwd":
    return jax.jit(f)
  loss = lambda x: jnp.sum(f(x).astype(jnp.float32) * do)
  return jax.jit(jax.grad(loss))


def _jax_memory(fn, *args):
  try:
    m = fn.lower(*args).compile().memory_analysis()
    return int(m.temp_size_in_bytes + m.output_size_in_bytes)
  except Exception:  # memory_analysis is not available on every backend/version
    return None


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


# ---------------------------------------------------------------------------------------------------------
# FLA (torch), only when it imports.
# ---------------------------------------------------------------------------------------------------------
def _fla():
  if not _FLA.value:
    return None
  try:
    import torch  # noqa: F401
    import fla.ops  # noqa: F401
    return True
  except Exception as e:  # FLA is a benchmark-only, optional comparison
    print(f"FLA unavailable: {type(e).__name__}: {e}", flush=True)
    return None


def _fla_call(op, x, requires_grad):
  import torch
  from fla.ops.delta_rule import chunk_delta_rule
  from fla.ops.gated_delta_rule import chunk_gated_delta_rule
  from fla.ops.kda import chunk_kda
  from fla.ops.precond_gated_delta_rule import chunk_precond_gated_delta_rule
  from fla.ops.precond_kda import chunk_precond_kda
  dev = "cuda"
  t = {n: torch.tensor(a, device=dev, dtype=torch.bfloat16 if n in ("q", "k", "v") else torch.float32)
       .requires_grad_(requires_grad) for n, a in x.items()}
  h = x["q"].shape[2]
  center = torch.full((h,), -0.2, device=dev)

  def run():
    if op == "dn":
      return chunk_delta_rule(t["q"], t["k"], t["v"], t["beta"])[0]
    if op == "gdn":
      return chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"])[0]
    if op == "kda":
      return chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"])[0]
    if op in ("pdn", "pgdn"):
      g = t["g"] if op == "pgdn" else torch.zeros_like(t["beta"])
      return chunk_precond_gated_delta_rule(t["q"], t["k"], t["v"], t["g_p"], g, t["beta_p"], t["beta"],
                                            log_atk_scale=center)[0]
    if op == "pkda":
      return chunk_precond_kda(t["q"], t["k"], t["v"], t["g"], t["g_p"], t["beta_p"], t["beta"],
                               log_atk_scale=center)[0]
    raise KeyError(op)
  return run, t


def _fla_time(op, x, mode, do):
  import torch
  import triton
  run, t = _fla_call(op, x, requires_grad=mode == "fwdbwd")
  do_t = torch.tensor(do, device="cuda", dtype=torch.bfloat16)
  if mode == "fwd":
    fn = run
  else:
    def fn():
      run().backward(do_t)
  torch.cuda.synchronize()
  fn()
  torch.cuda.synchronize()
  base = torch.cuda.memory_allocated()
  torch.cuda.reset_peak_memory_stats()
  fn()
  torch.cuda.synchronize()
  peak = torch.cuda.max_memory_allocated() - base
  ms = torch_ms(fn, n=_CALLS.value)
  bench = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
  out = run().detach().float().cpu().numpy() if mode == "fwd" else None
  return ms, peak, out, bench


# ---------------------------------------------------------------------------------------------------------
def _save(results):
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  merged = {}
  if os.path.exists(_OUT.value):
    with open(_OUT.value) as fh:
      merged = json.load(fh)
  merged.update(results)
  with open(_OUT.value, "w") as fh:
    json.dump(merged, fh, indent=1, sort_keys=True)


def main(argv):
  del argv
  fla = _fla()
  dev = jax.devices()[0]
  print(f"jax {jax.__version__} on {dev.device_kind}; fla {'yes' if fla else 'no'}", flush=True)
  results, rows = {}, []
  for shape_name in _SHAPES.value:
    shape = SHAPES[shape_name]
    for op in _OPS.value:
      x = _inputs(op, shape)
      do = np.random.default_rng(1).normal(size=shape).astype(np.float32)
      xj, doj = _jax_inputs(x), jnp.asarray(do)
      ref_fla = None
      for mode in _MODES.value:
        key = lambda impl: f"{shape_name}/{op}/{mode}/{impl}"
        if fla and op in FLA_OP:
          try:
            ms, mem, out, bench = _fla_time(op, x, mode, do)
            ref_fla = out if out is not None else ref_fla
            results[key("fla")] = dict(ms=ms, peak_bytes=mem, do_bench_ms=bench)
          except Exception as e:  # e.g. FLA refusing GDN/PGDN backward on Hopper (FLA #640)
            results[key("fla")] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
          print(key("fla"), results[key("fla")], flush=True)
          _save(results)
        for impl in _IMPLS.value:
          if impl == "naive" and shape[1] > 4096:
            continue
          try:
            fn = _jax_fn(op, impl, mode, doj)
            entry = dict(ms=jax_ms(fn, xj, n=_CALLS.value), temp_bytes=_jax_memory(fn, xj))
            if mode == "fwd":
              o = np.asarray(fn(xj), np.float32)
              if ref_fla is not None:
                entry["rel_err_vs_fla"] = _rel(o, ref_fla)
          except Exception as e:
            entry = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
          results[key(impl)] = entry
          print(key(impl), entry, flush=True)
          _save(results)
      rows.append((shape_name, op))
  _table(results, rows)


def _table(results, rows):
  impls = _IMPLS.value + (["fla"] if _FLA.value else [])
  print("\nms (median); ratio = ours / FLA (< 1: faster than FLA); err = rel RMS of our fwd output vs FLA's")
  for mode in _MODES.value:
    print(f"\n[{mode}] " + " ".join(f"{i:>10}" for i in impls) + "  " +
          " ".join(f"{i + '/fla':>10}" for i in _IMPLS.value) + "  err(pallas)")
    for shape_name, op in rows:
      get = lambda i: results.get(f"{shape_name}/{op}/{mode}/{i}", {})
      ms = [get(i).get("ms") for i in impls]
      fla_ms = get("fla").get("ms")
      cells = " ".join(f"{m:10.3f}" if m else f"{'–':>10}" for m in ms)
      ratios = " ".join(f"{get(i)['ms'] / fla_ms:10.2f}" if fla_ms and get(i).get("ms") else f"{'–':>10}"
                        for i in _IMPLS.value)
      err = get("pallas").get("rel_err_vs_fla")
      print(f"{shape_name}/{op:<9} {cells}  {ratios}  {err if err is None else f'{err:.1e}'}")


if __name__ == "__main__":
  app.run(main)
