"""The MQAR grid's training step: wall ms per cell-step and, on a GPU, device ms per kernel per cell-step.

One group of the grid (`experiments.grid.Group`: the cells of one (variant, L, kv) side by side, the trainer's
step under `jax.vmap`, `--chunk` steps per jitted scan) at the grid protocol's model, batch and dtype. The cells
share seed 0 and spread over learning rates. Their rows are drawn from `--rows` distinct rows (the step does not
depend on how many there are; the grid's 20,000 take minutes to generate). Per variant: the compile (the first
call), then `--reps` timed calls of `--chunk` steps (the median), and with `--profile` the device time per kernel
of `--chunk` steps (`benchmarks.trace`; empty on a CPU), each divided by cells × steps. Rows are appended to
`--out` as they are measured.

  python -m benchmarks.grid_step --variants=dn,pdn,osdn --length=1024 --kv=64 --cells=4 --profile
  python -m benchmarks.grid_step --variants=dn --dtype=bfloat16 --cells=1,2,4,8
  JAX_PLATFORMS=cpu python -m benchmarks.grid_step --variants=dn --length=32 --kv=4 --vocab_size=128 \\
      --batch_size=4 --cells=2 --chunk=2 --reps=1 --size=tiny --implementation=xla
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks import trace
from experiments import common
from experiments.grid import Cell, Group, Protocol


@dataclasses.dataclass(frozen=True)
class Settings:
  """What one measurement runs: `--FIELD` on the command line."""
  length: int = 1024
  kv: int = 64
  chunk: int = 50
  reps: int = 3
  rows: int = 512
  batch_size: int = Protocol.batch_size
  vocab_size: int = Protocol.vocab_size
  size: str = Protocol.size
  dtype: str = Protocol.dtype
  implementation: str = Protocol.implementation
  profile: bool = False
  top: int = 15


def measure(s: Settings, variant: str, cells: int) -> tuple[dict, list[str]]:
  """One row (ms per cell-step: wall, and device with `profile`) and the profile's lines."""
  protocol = Protocol(steps=s.chunk * (s.reps + 2), batch_size=s.batch_size, vocab_size=s.vocab_size, size=s.size,
                      train_examples=s.rows, test_examples=1, dtype=s.dtype, implementation=s.implementation,
                      eval_every=s.chunk)
  lrs = [1e-3 * 10 ** (i / max(cells - 1, 1)) for i in range(cells)]
  group = Group(protocol, [Cell(variant, s.length, s.kv, lr, 0) for lr in lrs], chunk_steps=s.chunk)
  states, tokens, labels, orders, lr = group.start()
  calls = iter(range(s.reps + 2))

  def run():
    nonlocal states
    i = next(calls, s.reps + 1)     # past the drawn rows: the last chunk's again (the cost does not depend on them)
    states, loss = group.chunk(states, lr, tokens, labels, jnp.asarray(orders[i * s.chunk:(i + 1) * s.chunk]))
    return loss

  t0 = time.perf_counter()
  jax.block_until_ready(run())
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(s.reps):
    t0 = time.perf_counter()
    jax.block_until_ready(run())
    times.append(time.perf_counter() - t0)
  per = cells * s.chunk
  row = dict(dataclasses.asdict(s), variant=variant, cells=cells, device=str(jax.devices()[0].device_kind),
             jax=jax.__version__, compile_s=compile_s, ms_per_cell_step=1e3 * statistics.median(times) / per)
  lines = []
  if s.profile:
    kernels = trace.by_kernel(trace.per_call(run, calls=1))
    row["device_ms_per_cell_step"] = sum(kernels.values()) / per
    row["kernels_ms_per_cell_step"] = {name: ms / per for name, ms in kernels.items()}
    lines = [f"  {ms / per:8.4f} ms  {name[:100]}" for name, ms in list(kernels.items())[:s.top]]
  return row, lines


def append(path: str, row: dict) -> None:
  """Adds row to the JSON list in path (rewritten whole, then renamed: a kill leaves the earlier rows)."""
  rows = json.load(open(path)) if os.path.exists(path) else []
  with open(path + ".tmp", "w") as f:
    json.dump(rows + [row], f, indent=1)
  os.replace(path + ".tmp", path)


def define_flags():
  flags.DEFINE_list("variants", ["dn"], "variants (`experiments.common`), one group each")
  flags.DEFINE_list("cells", ["4"], "cells side by side in one program, one measurement each")
  flags.DEFINE_string("out", "", "JSON file the rows are appended to")
  for field in dataclasses.fields(Settings):
    define = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer, str: flags.DEFINE_string}[type(field.default)]
    define(field.name, field.default, f"Settings.{field.name}")


def main(argv):
  del argv
  f = flags.FLAGS
  s = Settings(**{field.name: getattr(f, field.name) for field in dataclasses.fields(Settings)})
  common.check_variants(f.variants)
  common.check_implementation(s.implementation)
  print(f"{'variant':<14}{'cells':>6}{'compile s':>11}{'ms/cell-step':>14}{'device ms':>11}")
  for variant in f.variants:
    for cells in (int(c) for c in f.cells):
      row, lines = measure(s, variant, cells)
      if f.out:
        append(f.out, row)
      device = row.get("device_ms_per_cell_step")
      print(f"{variant:<14}{cells:>6}{row['compile_s']:>11.1f}{row['ms_per_cell_step']:>14.3f}"
            f"{'—' if device is None else f'{device:.3f}':>11}")
      for line in lines:
        print(line)


if __name__ == "__main__":
  define_flags()
  app.run(main)
