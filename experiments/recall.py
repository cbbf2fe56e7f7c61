"""JRT-style recall: MQAR read once against the same examples with the kv block written twice before the
queries (`MQARSource(context_reads=2)`, after "Just read twice"), so every key recurs, which is where OSDN
claims its gain. Per variant and cell: accuracy once and twice, the best over learning rates, and the gain.

  python -m experiments.recall                    # the default grid (a GPU)
  python -m experiments.recall --smoke            # CI size
  python -m experiments.recall --config.variants=dn,osdn,osdn-apf,dn-fixed-d --config.lengths=512 --config.kv=64,128
  python -m experiments.recall --merge=a/recall.json,b/recall.json    # one report from parts run in parallel

Takes experiments.mqar's settings (`mqar.Sweep`, `--config.FIELD=VALUE`; `reads` is set by the comparison). Writes
OUT/recall.json, OUT/recall.md and OUT/recall.png (accuracy once and twice per variant); each run's work directory
stays under OUT/runs/recall/.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from absl import flags

from experiments import common, config, mqar
from osdn_jax import cli

FLAGS = flags.FLAGS


def compare(once: list[dict], twice: list[dict], sweep: mqar.Sweep) -> list[dict]:
  """Per (variant, L, kv): the best accuracy over learning rates read once and read twice."""
  best1, best2 = mqar.best_over_lrs(once), mqar.best_over_lrs(twice)
  return [dict(variant=v, length=length, kv=kv, once=best1[(v, length, kv)]["accuracy"],
               twice=best2[(v, length, kv)]["accuracy"], lr_once=best1[(v, length, kv)]["lr"],
               lr_twice=best2[(v, length, kv)]["lr"],
               q_geo_once=common.geometric_mean(best1[(v, length, kv)]["q_geo"]),
               q_geo_twice=common.geometric_mean(best2[(v, length, kv)]["q_geo"]))
          for v in sweep.variants for length, kv in sweep.cells()]


def table(rows: list[dict], sweep: mqar.Sweep) -> str:
  header = ["variant", "L", "kv", "once (%)", "twice (%)", "gain (points)", "q_geo once", "q_geo twice"]
  body = [[r["variant"], r["length"], r["kv"], f"{100 * r['once']:.1f}", f"{100 * r['twice']:.1f}",
           f"{100 * (r['twice'] - r['once']):+.1f}", r["q_geo_once"], r["q_geo_twice"]] for r in rows]
  lrs = ", ".join(f"{lr:g}" for lr in sweep.lrs)
  note = (f"\nMQAR accuracy on {sweep.test_examples} test rows, the kv block read once or twice (rows 2·kv longer), "
          f"best over learning rates {{{lrs}}}; {sweep.steps} steps of {sweep.batch_size} rows, model size "
          f"`{sweep.size}`, vocabulary {sweep.vocab_size}, seed {sweep.seed}.\n")
  return common.markdown_table(header, body) + note


def plot(rows: list[dict], sweep: mqar.Sweep):
  cells = sweep.cells()
  fig, axes = common.figure(1, len(cells), width=max(4.0, 0.6 * len(sweep.variants)), height=3.2)
  for ax, (length, kv) in zip(axes[0], cells):
    sel = [r for r in rows if (r["length"], r["kv"]) == (length, kv)]
    x = np.arange(len(sel))
    ax.bar(x - 0.2, [100 * r["once"] for r in sel], 0.4, label="read once")
    ax.bar(x + 0.2, [100 * r["twice"] for r in sel], 0.4, label="read twice")
    ax.set_xticks(x, [r["variant"] for r in sel], rotation=60, ha="right", fontsize=8)
    ax.set_ylim(0, 100)
    ax.set_title(f"L={length}, kv={kv}", fontsize=9)
    ax.set_ylabel("accuracy (%)")
  axes[0][0].legend(fontsize=8)
  fig.tight_layout()
  return fig


def main(argv):
  del argv
  provenance = None
  if FLAGS.merge:
    payloads = common.read_results(FLAGS.merge)
    once, _ = mqar.merged([dict(p, runs=[]) for p in payloads])
    rows = [r for p in payloads for r in p["rows"]]
    provenance = payloads[0]
  else:
    once = mqar.sweep_from_flags(reads=1)
    twice = dataclasses.replace(once, reads=2)
    rows = compare(mqar.sweep_runs(once, FLAGS.out, name="recall"),
                   mqar.sweep_runs(twice, FLAGS.out, name="recall"), once)
  text = table(rows, once)
  command = ("python -m experiments.recall --smoke" if FLAGS.smoke else
             common.command("recall", once, skip=("reads",)))
  paths = common.write_results(FLAGS.out, "recall", {"sweep": dataclasses.asdict(once), "rows": rows}, text,
                               plot(rows, once), command=command, provenance=provenance)
  print(text)
  print("wrote", ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
  mqar.define_flags(mqar.Sweep(lengths=(256,), kv=(16, 32, 64)))
  cli.run(main, flags_parser=config.parse_flags)
