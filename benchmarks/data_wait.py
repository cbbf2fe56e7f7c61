"""Does the data pipeline keep a device busy? The trainer's host pattern against a modelled device, no accelerator.

    python -m benchmarks.data_wait --config=340m --step_s=0.315 --prefetch=2,16

The trainer's loop (`osdn_jax.train.loop`) takes a batch, dispatches the step and goes on; it waits for the device
only when it reads a logged step's metrics, every `log_every` steps. So after each log it takes up to `log_every`
batches in a row while the device works through the steps already queued. Here the device is a clock: a step
starts when it is dispatched or when the previous one ends, whichever is later, and lasts --step_s (the real step
time, e.g. from `benchmarks.train_speed`). The pipeline is the config's own (`data.make_pipeline`, its tokenizer
and packing in its prefetch thread). Per prefetch depth, over the windows after the first (which includes the
pipeline's start): "host wait", the share of the time the loop spent in next(pipeline) (what the trainer logs as
`data_wait`), and "device idle", the share in which the modelled device had no step to run (what the wait costs).
"""
from __future__ import annotations

import statistics
import time

from absl import app, flags

from osdn_jax.data import pipeline as pipeline_lib
from osdn_jax.train import configs


def measure(config, prefetch: int, step_s: float, windows: int) -> list[tuple[float, float]]:
  """[(host wait, device idle)] per log window, as shares of the window's time."""
  config.data.prefetch = prefetch
  pipeline = pipeline_lib.make_pipeline(config.data, seq_len=config.seq_len, batch_size=config.batch_size,
                                        seed=config.seed)
  rows, free_at = [], time.perf_counter()
  try:
    for _ in range(windows):
      waited = idle = 0.0
      t0 = time.perf_counter()
      for _ in range(config.log_every):
        t = time.perf_counter()
        next(pipeline)
        now = time.perf_counter()
        waited += now - t
        idle += max(0.0, now - free_at)
        free_at = max(now, free_at) + step_s
      time.sleep(max(0.0, free_at - time.perf_counter()))   # the log reads the last step's metrics
      elapsed = time.perf_counter() - t0
      rows.append((waited / elapsed, idle / elapsed))
  finally:
    pipeline.close()
  return rows


def define_flags() -> None:
  """The command line's flags (defined only when run as a program: the trainer's modules define `--config`)."""
  flags.DEFINE_string("config", "340m", "the named training config whose data, batch and seq_len are used")
  flags.DEFINE_float("step_s", 0.315, "device seconds per step")
  flags.DEFINE_list("prefetch", ["2", "16"], "prefetch depths to compare")
  flags.DEFINE_integer("windows", 6, "log windows per depth (the first is left out of the medians)")


def main(argv):
  del argv
  f = flags.FLAGS
  print(f"config {f.config}, modelled step {f.step_s} s; medians over windows 2–{f.windows}")
  print(f"{'prefetch':>9}{'host wait':>12}{'device idle':>13}")
  for depth in f.prefetch:
    rows = measure(configs.get_config(f.config), int(depth), f.step_s, f.windows)[1:]
    wait, idle = (statistics.median(r[i] for r in rows) for i in (0, 1))
    print(f"{depth:>9}{100 * wait:>11.2f}%{100 * idle:>12.2f}%")


if __name__ == "__main__":
  define_flags()
  app.run(main)
