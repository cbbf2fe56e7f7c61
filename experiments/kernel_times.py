"""Device time per kernel of one op (GPU): where a forward or forward+backward spends its time.

Runs `experiments.throughput`'s op (the preconditioner's first pass included) `--calls` times under
`jax.profiler.trace`, reads the Perfetto trace the profiler writes (CUPTI kernel events on the device's
stream lines) and prints, per kernel name, its device time per call and share, largest first. Wall-clock
timings of sub-millisecond kernels are dominated by launch and synchronisation latency; these are not.

  python3 -m experiments.kernel_times --ops dn,osdn --modes fwd,fwdbwd [--shape 4,4096,16,128] [--out DIR]
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from experiments import throughput


def device_events(trace_dir):
  """[(thread name, kernel name, µs)] of the complete events on device (GPU) lines of the newest trace."""
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True) +
                 glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                 key=os.path.getmtime)
  if not paths:
    raise FileNotFoundError(f"no trace under {trace_dir}")
  with gzip.open(paths[-1], "rt") as f:
    events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  procs, threads = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      procs[e["pid"]] = e["args"]["name"]
    if e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[(e["pid"], e["tid"])] = e["args"]["name"]
  return [(threads.get((e["pid"], e["tid"]), str(e["tid"])), e["name"], float(e["dur"]))
          for e in events if e.get("ph") == "X" and "GPU" in procs.get(e["pid"], "") and "dur" in e]


def table(events, calls: int, top: int):
  """Lines: per (device line, kernel) µs per call, share of its line, largest first."""
  by_line = collections.defaultdict(collections.Counter)
  for line, name, dur in events:
    by_line[line][name] += dur / calls
  out = []
  for line, kernels in sorted(by_line.items()):
    total = sum(kernels.values())
    out.append(f"  [{line}] total {total / 1e3:.3f} ms per call")
    for name, us in kernels.most_common(top):
      out.append(f"    {us / 1e3:8.3f} ms {100 * us / total:5.1f}%  {name[:110]}")
  return out


def per_call(fn, *args, calls: int = 10, folder=None):
  """{(device line, kernel): µs per call} of fn(*args) (already compiled or not: two untimed calls first)."""
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  folder = folder or tempfile.mkdtemp()
  with jax.profiler.trace(folder, create_perfetto_trace=True):
    out = None
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
  times = collections.Counter()
  for line, name, dur in device_events(folder):
    times[line, name] += dur / calls
  return times


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--ops", default="dn,osdn")
  ap.add_argument("--modes", default="fwd,fwdbwd")
  ap.add_argument("--impl", default="pallas")
  ap.add_argument("--shape", default="4,4096,16,128", help="B,T,H,K (K = V)")
  ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="of q, k, v")
  ap.add_argument("--calls", type=int, default=10)
  ap.add_argument("--top", type=int, default=12)
  ap.add_argument("--out", default=None, help="keep the traces here (default: a temporary folder)")
  a = ap.parse_args()
  shape = tuple(map(int, a.shape.split(",")))
  root = a.out or tempfile.mkdtemp()
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; shape {shape}; {a.dtype}; {a.calls} calls",
        flush=True)
  dtype = jnp.bfloat16 if a.dtype == "bf16" else jnp.float32
  for op in a.ops.split(","):
    x = throughput._jax_inputs(throughput._inputs(op, shape), dtype)
    do = jnp.asarray(np.random.default_rng(1).normal(size=shape), jnp.float32)
    for mode in a.modes.split(","):
      fn = throughput._jax_fn(op, a.impl, mode, do)
      print(f"{op} {mode} ({a.impl}):", flush=True)
      try:
        times = per_call(fn, x, calls=a.calls, folder=os.path.join(root, f"{op}-{mode}"))
        print("\n".join(table([(line, name, us) for (line, name), us in times.items()], 1, a.top)), flush=True)
      except (FileNotFoundError, KeyError, ValueError) as e:
        print(f"  no device events: {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
  main()
