"""Block-size and chunk variants of the Pallas GPU delta rule, measured in one process (bf16 inputs; e2e also fp32).

  e2e:    `pallas_kernels.gpu.delta_rule.delta_rule` end to end (the wrapper's padding and cumsum included),
          forward and forward+backward, per decay and `BlockSizes` variant: ms and the compiled temp + output MB.
  chunks: the per-channel forward kernels alone on a given G at each chunk (`delta_rule_fwd.forward`, and
          `scores` where the chunk runs it), per variant: what the chunk of `chunk_channel_forward` buys.

Variants are `+`-joined BlockSizes overrides, "default" for none:

  python -m experiments.compare_blocks e2e --shapes main,long --decays channel,none \\
      --variants default,fp32_dots_bf16=tf32x3
  python -m experiments.compare_blocks chunks --shapes main,long --chunks 16,32,64 --variants default,warps_scores=4

On CPU the kernels run in interpret mode (times meaningless; a smoke test): --shapes tiny.
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from experiments.check_pallas_gpu import make_inputs, timing_fns, to_device
from experiments.profile_pallas import make_inputs as kernel_inputs, make_static, parse_blocks
from experiments.timing import jax_ms
from pallas_kernels.gpu import delta_rule_fwd as fwd

SHAPES = {"main": (4, 4096, 16, 128), "long": (1, 32768, 8, 128), "tiny": (1, 128, 2, 32),
          # (B, T, H, K = V) beside the benchmark's two: head widths 64 and 256, and a single row of 16 heads
          "k64": (4, 4096, 16, 64), "k256": (2, 4096, 16, 256), "row16": (1, 16384, 16, 128)}


def blocks_of(variant: str):
  """"default" or "name=value+name=value" → BlockSizes (`profile_pallas.parse_blocks`)."""
  return parse_blocks(variant, sep="+")


def _mb(fn, *args):
  m = fn.lower(*args).compile().memory_analysis()
  return (m.temp_size_in_bytes + m.output_size_in_bytes) / 1e6


def e2e(shape_name, decay, variant, record, modes=("fwd", "fwdbwd"), dtype=jnp.bfloat16):
  x = to_device(make_inputs(SHAPES[shape_name], decay, seed=2), dtype)
  x.pop("initial_state")
  fwd_fn, fwdbwd_fn = timing_fns("pallas", blocks_of(variant), 64)     # loss: sum(o) + sum(S)
  for mode, fn in (("fwd", fwd_fn), ("fwdbwd", fwdbwd_fn)):
    if mode not in modes:
      continue
    jax.block_until_ready(fn(x))
    record(dict(shape=shape_name, decay=decay, dtype=jnp.dtype(dtype).name, variant=variant, mode=mode,
                ms=jax_ms(fn, x), mb=_mb(fn, x)))


def chunks(shape_name, chunk, variant, record):
  b, t, h, d = SHAPES[shape_name]
  x = kernel_inputs(b, t, h, d, "channel", chunk)
  st = make_static(b, t, h, d, "channel", chunk, blocks_of(variant))
  tag = dict(shape=shape_name, chunk=chunk, variant=variant)
  if st.scores_first:
    f = jax.jit(lambda *a: fwd.scores(st, *a, tiles=fwd.scores_tiles(st)))
    record(dict(tag, kernel="scores", ms=jax_ms(f, x["q"], x["k"], x["k"], x["beta"], x["G"])))
  inputs = (x["q"], x["k"], x["k"], x["v"], x["beta"], x["G"], x["S0"])
  for label, emit_t in (("whole forward", False), ("whole forward emitting T", True)):
    f = jax.jit(lambda *r, emit_t=emit_t: fwd.forward(st, *r, emit_t=emit_t))
    jax.block_until_ready(f(*inputs))
    record(dict(tag, kernel=label, ms=jax_ms(f, *inputs)))


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("what", choices=("e2e", "chunks"))
  ap.add_argument("--shapes", default="main")
  ap.add_argument("--decays", default="channel", help="e2e: none, scalar, channel")
  ap.add_argument("--chunks", default="32,64", help="chunks: the per-channel chunks")
  ap.add_argument("--variants", default="default")
  ap.add_argument("--modes", default="fwd,fwdbwd", help="e2e: fwd and/or fwdbwd")
  ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="e2e: of q, k, v")
  ap.add_argument("--out", default="results/compare_blocks.json")
  a = ap.parse_args()
  split = lambda s: [v for v in s.split(",") if v]
  rows = []

  def record(row):
    rows.append(row)
    print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
      json.dump(rows, f, indent=1)

  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
  for s in split(a.shapes):
    for v in split(a.variants):
      if a.what == "e2e":
        for d in split(a.decays):
          e2e(s, d, v, record, split(a.modes), jnp.bfloat16 if a.dtype == "bf16" else jnp.float32)
      else:
        for c in map(int, split(a.chunks)):
          chunks(s, c, v, record)


if __name__ == "__main__":
  main()
