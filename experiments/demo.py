"""The main job on a small default (`make demo`, a CPU, about ten minutes): a small MQAR comparison of DN, PDN,
OSDN, OSDN-APF, the `dn-fixed-d` control, GDN and PGDN.

Each variant is trained once with the trainer (`experiments.mqar`'s sweep at a CPU size: the `mqar` model,
d_model 128 and 2 layers, on vocabulary 128, 300 steps of 32 rows of L = 32 tokens with 4 key-value pairs; at this
size every variant is past the learning cusp, which DN crosses near step 100) and scored at kv ∈ {2, 4, 8} (8:
twice the pairs it was trained on); the table gives the accuracy, q_geo and the recall residual, and the heat-maps
go to OUT/demo.png.

  python -m experiments.demo [--config.steps=300 --out=results]
"""
from __future__ import annotations

import dataclasses

from absl import flags

from experiments import common, config, mqar
from osdn_jax import cli

VARIANTS = ("dn", "pdn", "osdn", "osdn-apf", "dn-fixed-d", "gdn", "pgdn")


@dataclasses.dataclass(frozen=True)
class Demo:
  """The demo's settings, `--config.FIELD` (`experiments.config`): the variants and the optimiser steps of each."""
  variants: tuple[str, ...] = VARIANTS
  steps: int = 300


def sweep(variants=VARIANTS, steps: int = 300) -> mqar.Sweep:
  return mqar.Sweep(variants=tuple(variants), lengths=(32,), kv=(2, 4, 8), train_kv=4, lrs=(3e-3,), steps=steps,
                    batch_size=32, size="mqar", vocab_size=128, train_examples=20_000, test_examples=256,
                    implementation="xla")


def main(argv):
  del argv
  f = flags.FLAGS
  if f.smoke:
    s = mqar.Sweep(**dict(mqar.SMOKE, kv=(2, 4), train_kv=4))
  else:
    spec = config.settings(Demo)
    with cli.usage():
      s = sweep(spec.variants, spec.steps)
  results = mqar.sweep_runs(s, f.out, name="demo")
  text, paths = mqar.report(s, results, f.out, name="demo")
  print(text)
  print("wrote", ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
  common.define_flags(Demo())
  cli.run(main, flags_parser=config.parse_flags)
