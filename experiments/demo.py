"""The main job on a small default (`make demo`, a CPU, about ten minutes): a small MQAR comparison of DN, PDN,
OSDN, OSDN-APF, the `dn-fixed-d` control, GDN and PGDN.

Each variant is trained once with the trainer (`experiments.mqar`'s sweep at a CPU size: the `mqar` model,
d_model 128 and 2 layers, on vocabulary 128, 300 steps of 32 rows of L = 32 tokens with 4 key-value pairs; at this
size every variant is past the learning cusp, which DN crosses near step 100) and scored at kv ∈ {2, 4, 8} (8:
twice the pairs it was trained on); the table gives the accuracy, q_geo and the recall residual, and the heat-maps
go to OUT/demo.png.

  python -m experiments.demo [--steps=300 --out=results]
"""
from __future__ import annotations

from absl import flags

from experiments import mqar
from osdn_jax import cli, plugins

VARIANTS = ("dn", "pdn", "osdn", "osdn-apf", "dn-fixed-d", "gdn", "pgdn")
_STEPS = flags.DEFINE_integer("steps", 300, "optimiser steps per variant")
_VARIANTS = flags.DEFINE_list("variants", list(VARIANTS), "registry points (name[:option=value,...])")
_OUT = flags.DEFINE_string("out", "results", "output directory")
_SMOKE = flags.DEFINE_bool("smoke", False, "the CI size: one variant, a few steps")
plugins.define_imports_flag()


def sweep(variants=VARIANTS, steps: int = 300) -> mqar.Sweep:
  return mqar.Sweep(variants=tuple(variants), lengths=(32,), kv=(2, 4, 8), train_kv=4, lrs=(3e-3,), steps=steps,
                    batch_size=32, size="mqar", vocab_size=128, train_examples=20_000, test_examples=256,
                    implementation="xla")


def main(argv):
  del argv
  s = sweep(_VARIANTS.value, _STEPS.value)
  if _SMOKE.value:
    s = mqar.Sweep(**dict(mqar.SMOKE, kv=(2, 4), train_kv=4))
  results = mqar.sweep_runs(s, _OUT.value, name="demo")
  text, paths = mqar.report(s, results, _OUT.value, name="demo")
  print(text)
  print("wrote", ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
  cli.run(main)
