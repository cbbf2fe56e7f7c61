"""On a GPU: the Pallas delta-rule kernels against the XLA path — accuracy, then speed.

1. Accuracy, per shape × decay: outputs, final state and every input gradient (q, k, v, β, log_decay, S0;
   random cotangents on o and S) of implementation "pallas" against "xla":
   * fp32: both under jax.default_matmul_precision("highest"), pallas vs xla;
   * bf16: pallas-bf16 and xla-bf16, each against xla-fp32-highest on the same bf16-rounded inputs (so the
     pallas error can be read against the error XLA itself makes in bf16).
   Also the pallas forward without autodiff (o, S), which per-channel decay runs at a wider chunk.
   Prints relative RMS errors (rms(x − y) / rms(y)).
2. Speed (bf16 by default): forward and forward+backward (gradients of every input) of pallas vs xla, jitted;
   warm-up, then the median of --runs runs synchronised with jax.block_until_ready; prints a table of ms and
   ratios. --variants also times other Pallas block sizes (see VARIANTS).

Results are printed as they come (flushed) and the JSON file --out is rewritten after every measurement, so
a killed run keeps what it measured. A kernel that fails to compile is recorded as an error, not fatal.

  python -m experiments.check_pallas_gpu --out results/check_pallas_gpu.json 2>&1 | tee results/check_pallas_gpu.log
"""
from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from experiments import timing
from osdn_jax import ops
from osdn_jax.ops import checks
from pallas_kernels.gpu import delta_rule as gpu
from pallas_kernels.gpu.config import BlockSizes

SHAPES = {"main": (4, 4096, 16, 128), "long": (1, 32768, 8, 128), "small": (2, 1024, 4, 64),
          "wide": (2, 2048, 8, 256),   # the largest K = V the kernels take
          "tiny": (1, 100, 2, 16)}   # tiny: a smoke test that also runs on CPU (interpret mode)
DECAYS = ("none", "scalar", "channel")
VARIANTS = {"default": BlockSizes(), "sub32": BlockSizes(sub=32),
            "warps8": BlockSizes(warps_chunk=8, warps_state=8), "bv32": BlockSizes(block_v_state=32),
            "stages3": BlockSizes(stages=3), "tf32": BlockSizes(fp32_dots_bf16="tf32")}
GRAD_NAMES = ("q", "k", "v", "beta", "log_decay", "initial_state")


def _log(*a):
  print(*a, flush=True)


class Results:
  """Everything measured so far, rewritten to `path` after every addition."""

  def __init__(self, path, meta):
    self.path, self.data = path, {"meta": meta, "checks": [], "timings": [], "errors": []}

  def add(self, kind, row):
    self.data[kind].append(row)
    if self.path:
      os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
      tmp = self.path + ".tmp"
      with open(tmp, "w") as f:
        json.dump(self.data, f, indent=1)
      os.replace(tmp, self.path)


def make_inputs(shape, decay, seed=0):
  """Host fp32 inputs: unit q, k; v ~ N(0, 1); β = σ(N); log-decays logσ(N + 4); S0 ~ N(0, 1/K)."""
  b, t, h, d = shape
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  x = dict(q=unit(rng.normal(size=(b, t, h, d))), k=unit(rng.normal(size=(b, t, h, d))),
           v=rng.normal(size=(b, t, h, d)), beta=1 / (1 + np.exp(-rng.normal(size=(b, t, h)))),
           initial_state=rng.normal(size=(b, h, d, d)) / np.sqrt(d))
  if decay != "none":
    x["log_decay"] = -np.logaddexp(0, -(rng.normal(size=(b, t, h) + ((d,) if decay == "channel" else ())) + 4))
  return {n: a.astype(np.float32) for n, a in x.items()}


def to_device(x, dtype):
  """q, k, v in `dtype` (bf16 values rounded once, on the host side of the cast); gates and state fp32."""
  return {n: jnp.asarray(a, dtype if n in ("q", "k", "v") else jnp.float32) for n, a in x.items()}


def solve_fn(impl, blocks=None, chunk=64):
  """x → (o, S) through the public API (xla) or the Pallas GPU kernel directly (pallas, with blocks)."""
  def f(x):
    args = dict(log_decay=x.get("log_decay"), initial_state=x.get("initial_state"))
    if impl == "xla":
      return ops.delta_rule(x["q"], x["k"], x["v"], x["beta"], **args, output_final_state=True, chunk_size=chunk,
                            implementation="xla")
    return gpu.delta_rule(x["q"], x["k"], x["v"], x["beta"], **args, chunk_size=chunk,
                          blocks=blocks or BlockSizes())     # compiled on GPU, interpreted on CPU
  return f


def value_and_grads(f, x, seed=1):
  """(o, S, {name: gradient}) with fixed random cotangents on o and S (bf16 values, the same in any dtype)."""
  (o, S), pull = jax.vjp(f, x)
  rng = np.random.default_rng(seed)
  draw = lambda y: jnp.asarray(jnp.asarray(rng.normal(size=y.shape), jnp.bfloat16), y.dtype)
  ct = (draw(o), draw(S))
  (g,) = pull(ct)
  return o, S, g


def rel_rms(x, y):
  x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
  return float(jnp.sqrt(jnp.mean((x - y) ** 2)) / jnp.maximum(jnp.sqrt(jnp.mean(y ** 2)), 1e-30))


def errors(got, want):
  o, S, g = got
  o2, S2, g2 = want
  out = {"o": rel_rms(o, o2), "S": rel_rms(S, S2)}
  out.update({f"d{n}": rel_rms(g[n], g2[n]) for n in GRAD_NAMES if n in g2})
  return out


def _forward_errors(primal, want):
  """The undifferentiated forward (o, S) — per-channel decay runs it at `chunk_channel_forward` — against the
  reference's o and S."""
  return {"o": rel_rms(primal[0], want[0]), "S": rel_rms(primal[1], want[1])}


def check(res, shape_name, decay, dtypes, chunk, blocks=None):
  shape = SHAPES[shape_name]
  x = make_inputs(shape, decay)
  for dt in dtypes:
    tag = dict(shape=shape_name, decay=decay, dtype=dt, chunk=chunk)
    try:
      if dt == "fp32":
        with jax.default_matmul_precision("highest"):
          xd = to_device(x, jnp.float32)
          want = jax.jit(lambda x: value_and_grads(solve_fn("xla", chunk=chunk), x))(xd)
          got = jax.jit(lambda x: value_and_grads(solve_fn("pallas", blocks, chunk=chunk), x))(xd)
          primal = jax.jit(solve_fn("pallas", blocks, chunk=chunk))(xd)
          row = dict(tag, pallas_vs_xla=errors(got, want), forward_vs_xla=_forward_errors(primal, want))
      else:
        xb = to_device(x, jnp.bfloat16)
        rounded = {n: a.astype(jnp.float32) for n, a in xb.items()}
        with jax.default_matmul_precision("highest"):
          want = jax.jit(lambda x: value_and_grads(solve_fn("xla", chunk=chunk), x))(rounded)
        got = jax.jit(lambda x: value_and_grads(solve_fn("pallas", blocks, chunk=chunk), x))(xb)
        base = jax.jit(lambda x: value_and_grads(solve_fn("xla", chunk=chunk), x))(xb)
        primal = jax.jit(solve_fn("pallas", blocks, chunk=chunk))(xb)
        row = dict(tag, pallas_vs_ref=errors(got, want), forward_vs_ref=_forward_errors(primal, want),
                   xla_vs_ref=errors(base, want))
      res.add("checks", row)
      _log(f"[check] {shape_name:5s} {decay:8s} {dt}: " + "  ".join(
          f"{k}: " + " ".join(f"{n}={e:.1e}" for n, e in v.items()) for k, v in row.items() if isinstance(v, dict)))
    except Exception as e:  # noqa: BLE001 — record and go on
      res.add("errors", dict(tag, stage="check", error=repr(e)[:2000], trace=traceback.format_exc()[-4000:]))
      _log(f"[check] {shape_name} {decay} {dt}: FAILED {e!r}"[:2000])


def _median_ms(fn, x, runs, warmup):
  """Device ms per call, back-to-back calls (`experiments.timing`; a per-call sync adds ~0.1–0.3 ms)."""
  return timing.jax_ms(fn, x, reps=runs, warmup=warmup)


def timing_fns(impl, blocks, chunk):
  f = solve_fn(impl, blocks, chunk)
  fwd = jax.jit(lambda x: f(x)[0])

  def loss(x):
    o, S = f(x)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(S)
  return fwd, jax.jit(jax.grad(loss))


def time_all(res, shape_name, decay, dtypes, variants, chunk, runs, warmup, table):
  shape = SHAPES[shape_name]
  x = make_inputs(shape, decay, seed=2)
  for dt in dtypes:
    xd = to_device(x, jnp.bfloat16 if dt == "bf16" else jnp.float32)
    impls = [("xla", "-", None)] + [("pallas", v, VARIANTS[v]) for v in variants]
    for impl, variant, blocks in impls:
      fwd, fwdbwd = timing_fns(impl, blocks, chunk)
      for mode, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
        tag = dict(shape=shape_name, decay=decay, dtype=dt, impl=impl, variant=variant, mode=mode, chunk=chunk)
        try:
          t0 = time.perf_counter()
          jax.block_until_ready(fn(xd))                        # compile + first run
          compile_s = time.perf_counter() - t0
          ms = _median_ms(fn, xd, runs, warmup)
          res.add("timings", dict(tag, ms=ms, first_call_s=compile_s))
          table[(shape_name, decay, dt, mode, impl, variant)] = ms
          _log(f"[time] {shape_name:5s} {decay:8s} {dt} {mode:6s} {impl:6s} {variant:8s} {ms:9.3f} ms "
               f"(first call {compile_s:.1f} s)")
        except Exception as e:  # noqa: BLE001
          res.add("errors", dict(tag, stage="timing", error=repr(e)[:2000], trace=traceback.format_exc()[-4000:]))
          _log(f"[time] {shape_name} {decay} {dt} {mode} {impl} {variant}: FAILED {e!r}"[:2000])


def print_table(table, variants):
  rows = sorted({k[:4] for k in table})
  head = f"{'shape':6s} {'decay':8s} {'dtype':5s} {'mode':7s} {'xla ms':>9s}" + "".join(
      f" {'pallas/' + v:>16s} {'ratio':>6s}" for v in variants)
  _log("\n" + head)
  for r in rows:
    xla = table.get(r + ("xla", "-"))
    line = f"{r[0]:6s} {r[1]:8s} {r[2]:5s} {r[3]:7s} " + (f"{xla:9.3f}" if xla else f"{'—':>9s}")
    for v in variants:
      p = table.get(r + ("pallas", v))
      line += f" {p:16.3f}" if p else f" {'—':>16s}"
      line += f" {xla / p:6.2f}" if (p and xla) else f" {'—':>6s}"
    _log(line)
  _log("ratio = xla ms / pallas ms (> 1: pallas faster)")


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default="results/check_pallas_gpu.json")
  ap.add_argument("--shapes", default="main,long", help=f"comma list of {list(SHAPES)}")
  ap.add_argument("--decays", default=",".join(DECAYS))
  ap.add_argument("--check-dtypes", default="fp32,bf16")
  ap.add_argument("--time-dtypes", default="bf16")
  ap.add_argument("--variants", default="default", help=f"Pallas block sizes to time, of {list(VARIANTS)}")
  ap.add_argument("--check-variant", default="default", help=f"Pallas block sizes checked, of {list(VARIANTS)}")
  ap.add_argument("--chunk", type=int, default=64)
  ap.add_argument("--runs", type=int, default=20)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--skip-check", action="store_true")
  ap.add_argument("--skip-timing", action="store_true")
  args = ap.parse_args()
  split = lambda s: [x for x in s.split(",") if x]
  shapes, decays, variants = split(args.shapes), split(args.decays), split(args.variants)

  dev = jax.devices()[0]
  meta = dict(jax=jax.__version__, device=str(dev), platform=dev.platform,
              kind=getattr(dev, "device_kind", "?"), chunk=args.chunk, runs=args.runs, shapes=shapes)
  _log(f"jax {jax.__version__} on {meta['kind']} ({dev.platform})")
  res = Results(args.out, meta)
  # Which implementation "auto" picks for the main shape (pallas expected on GPU).
  b, t, h, d = SHAPES[shapes[0]]
  z = np.zeros((b, 8, h, d), np.float32)
  spec = checks.check_solve("delta_rule", z, z, z, beta=np.zeros((b, 8, h), np.float32))
  picked = pallas_kernels.lookup("delta_rule", spec, jnp.bfloat16, args.chunk, jax.default_backend())
  _log(f"auto dispatch on {jax.default_backend()}: {'pallas' if picked is gpu.delta_rule else 'xla'}")

  if not args.skip_check:
    for s in shapes:
      for dc in decays:
        check(res, s, dc, split(args.check_dtypes), args.chunk, VARIANTS[args.check_variant])
  if not args.skip_timing:
    table = {}
    for s in shapes:
      for dc in decays:
        time_all(res, s, dc, split(args.time_dtypes), variants, args.chunk, args.runs, args.warmup, table)
    print_table(table, variants)
  _log(f"results: {args.out}")


if __name__ == "__main__":
  main()
