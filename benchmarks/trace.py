"""Device time per kernel out of a `jax.profiler` trace: where a forward or forward+backward spends its time.

`per_call(fn, *args)` runs fn `calls` times under `jax.profiler.trace`, reads the Perfetto trace the profiler
writes (CUPTI kernel events on the device's stream lines) and returns, per (device line, kernel), the device µs
per call. Wall-clock timings of sub-millisecond kernels are dominated by launch and synchronisation latency;
these are not. A CPU backend has no device lines: the result is empty.
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import tempfile


def device_events(trace_dir):
  """[(thread name, kernel name, µs)] of the complete events on device (GPU) lines of the newest trace under
  `trace_dir`; FileNotFoundError when there is none."""
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
  """Lines: per (device line, kernel) ms per call and share of its line, largest first (`top` per line).
  events: [(line, kernel, µs)] over `calls` calls."""
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


def per_call(fn, *args, calls: int = 10, folder=None) -> collections.Counter:
  """{(device line, kernel): µs per call} of fn(*args) over `calls` back-to-back calls traced into `folder`
  (default: a temporary folder); two untimed calls first, so compilation is not traced."""
  import jax
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


def by_kernel(times) -> dict:
  """{kernel: ms per call} summed over device lines, largest first, from `per_call`'s result."""
  ms = collections.Counter()
  for (_, name), us in times.items():
    ms[name] += us / 1e3
  return dict(ms.most_common())
