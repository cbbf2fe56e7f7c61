"""Training throughput and memory: the trainer itself (`python -m osdn_jax.train`), one run per model × remat
policy, each in its own process (so each peak is its own).

Per run: `--steps` steps of the named config at `--rows_per_device` rows × seq_len tokens per device (the batch
grows with the devices: data parallelism), logged every `--log_every` steps; tokens/s is the median over the
log windows after the first (which holds the compile), divided by the device count; data wait is the median
share of a window the loop spent waiting for the next host batch (`data_wait` in metrics.jsonl); peak memory
is the allocator's peak on device 0 (`peak_bytes_in_use`). Every row is appended to --out as it is measured. Prints one
table: tokens/s per device, its ratio to the first model's, step time, data wait, peak GB.

  python -m benchmarks.train_speed --models=gdn-340m,pgdn-340m,kda-340m,pkda-340m,osdn-340m,osdn-apf-340m
  python -m benchmarks.train_speed --models=gdn-340m --remat=full,dots,solve,dots_solve --steps=40
  JAX_PLATFORMS=cpu python -m benchmarks.train_speed --config=tiny --models=gdn-tiny --steps=20 --log_every=5
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
from absl import app, flags

_CONFIG = flags.DEFINE_string("config", "340m", "the named training config")
_MODELS = flags.DEFINE_list("models", ["gdn-340m", "pgdn-340m"], "model names (`models.config`)")
_REMAT = flags.DEFINE_list("remat", [""], "remat policies to try ('' = the config's)")
_STEPS = flags.DEFINE_integer("steps", 60, "steps per run")
_LOG_EVERY = flags.DEFINE_integer("log_every", 10, "steps per timing window")
_ROWS = flags.DEFINE_integer("rows_per_device", 0, "rows per device per step (0: the config's batch_size)")
_EXTRA = flags.DEFINE_multi_string("set", [], "extra overrides, e.g. --set=config.data.source=random")
_OUT = flags.DEFINE_string("out", "", "JSON file the rows are appended to")


def _run(model: str, remat: str, devices: int) -> dict:
  with tempfile.TemporaryDirectory() as workdir:
    args = [sys.executable, "-m", "osdn_jax.train", f"--config={_CONFIG.value}", f"--workdir={workdir}",
            f"--config.model={model}", f"--config.steps={_STEPS.value}", f"--config.log_every={_LOG_EVERY.value}",
            "--config.checkpoint_every=0", "--config.progress=false", "--config.optimizer.warmup_steps=1"]
    if _ROWS.value:
      args.append(f"--config.batch_size={_ROWS.value * devices}")
    if remat:
      args.append(f"--config.remat={remat}")
    args += [f"--{s}" for s in _EXTRA.value]
    t0 = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True)
    row = {"model": model, "remat": remat or "(config)", "devices": devices, "wall_s": time.perf_counter() - t0}
    if proc.returncode:
      tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
      return dict(row, error=" | ".join(tail)[-400:])
    logged = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    config = json.load(open(os.path.join(workdir, "config.json")))
  steady = [r["tokens_per_s"] for r in logged[1:]] or [logged[-1]["tokens_per_s"]]
  return dict(row, rows=config["batch_size"], seq_len=config["seq_len"],
              tokens_per_s_per_device=statistics.median(steady) / devices,
              step_time_s=statistics.median(r["step_time_s"] for r in logged[1:] or logged),
              data_wait=statistics.median(r["data_wait"] for r in logged[1:] or logged),
              peak_memory_gb=logged[-1].get("peak_memory_gb"), final_loss=logged[-1]["loss"])


def _table(rows: list[dict]) -> str:
  ok = [r for r in rows if "error" not in r]
  base = ok[0]["tokens_per_s_per_device"] if ok else None
  out = [f"{'model':<18}{'remat':<12}{'devices':>8}{'rows×T':>12}{'tok/s/dev':>12}{'÷ first':>9}"
         f"{'step s':>9}{'data wait':>11}{'peak GB':>9}"]
  for r in rows:
    if "error" in r:
      out.append(f"{r['model']:<18}{r['remat']:<12}{r['devices']:>8}  failed: {r['error']}")
      continue
    peak = "—" if r["peak_memory_gb"] is None else f"{r['peak_memory_gb']:.1f}"
    out.append(f"{r['model']:<18}{r['remat']:<12}{r['devices']:>8}{r['rows']:>6}×{r['seq_len']:<5}"
               f"{r['tokens_per_s_per_device']:>12,.0f}{r['tokens_per_s_per_device'] / base:>9.2f}"
               f"{r['step_time_s']:>9.3f}{100 * r['data_wait']:>10.2f}%{peak:>9}")
  return "\n".join(out)


def main(argv):
  del argv
  devices = jax.device_count()
  rows = []
  for model in _MODELS.value:
    for remat in _REMAT.value:
      rows.append(_run(model, remat, devices))
      print(json.dumps(rows[-1]), flush=True)
      if _OUT.value:
        previous = json.load(open(_OUT.value)) if os.path.exists(_OUT.value) else []
        with open(_OUT.value + ".tmp", "w") as f:
          json.dump(previous + [rows[-1]], f, indent=1)
        os.replace(_OUT.value + ".tmp", _OUT.value)
  print(_table(rows))


if __name__ == "__main__":
  app.run(main)
