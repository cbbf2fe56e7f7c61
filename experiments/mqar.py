"""Multi-query associative recall (MQAR, zoology's generator: `osdn_jax.data.recall`): accuracy per variant over
a grid of sequence lengths L × key-value pairs kv, the best over a sweep of learning rates, with each model's
per-layer q_geo and recall residual.

One model is trained per (variant, L, kv, learning rate) with the trainer (`train.get_config("mqar")`: 2 mixer +
2 MLP layers, d_model 128, vocabulary 8192, AdamW with weight decay 0.1 on a cosine schedule, loss on the scored
positions only) and scored on a test set drawn with another seed: accuracy is the fraction of queries whose
greedy prediction is the queried key's value. With --train_kv=N one model per (variant, L, learning rate) is
trained at N pairs and scored at every kv of the grid instead (a cheaper sweep, e.g. `make demo`'s).

  python -m experiments.mqar                      # the default sweep (a GPU: minutes per run)
  python -m experiments.mqar --smoke              # CI size: two variants, one tiny cell, seconds on a CPU
  python -m experiments.mqar --config.variants=dn,pdn --config.lengths=1024 --config.kv=32,64,128,256 \
      --config.lrs=1e-3,3e-3
  python -m experiments.mqar --merge=a/mqar.json,b/mqar.json   # one report from sweeps run in parallel

The settings are `Sweep`'s fields, each `--config.FIELD=VALUE` (`experiments.config`; `--FIELD=VALUE` is the same).

Writes OUT/mqar.json (every run), OUT/mqar.md (the table) and OUT/mqar.png (the heat-maps), and keeps each run's
work directory under OUT/runs/mqar/ (a rerun resumes finished runs from their checkpoints instead of training).
"""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
from absl import flags

from experiments import common, config
from osdn_jax import cli
from osdn_jax.data import MQARSource
from osdn_jax.train import get_config

FLAGS = flags.FLAGS


@dataclasses.dataclass
class Sweep:
  """What one MQAR sweep trains: variants × lengths × kv × lrs, each run `steps` optimiser steps of
  batch_size rows, scored on test_examples rows; train_kv > 0: variants × lengths × lrs, trained at train_kv
  pairs and scored at every kv."""
  variants: tuple[str, ...] = common.VARIANTS
  lengths: tuple[int, ...] = (256, 512)
  kv: tuple[int, ...] = (16, 32, 64)
  lrs: tuple[float, ...] = (1e-3, 3e-3)
  steps: int = 2000
  batch_size: int = 64
  size: str = "mqar"
  vocab_size: int = 8192
  train_examples: int = 20_000
  test_examples: int = 1000
  reads: int = 1
  order: str = "replacement"
  train_kv: int = 0
  seed: int = 0
  implementation: str = "auto"
  dtype: str = "float32"

  def __post_init__(self):
    check_grid(self.lengths, self.kv, self.train_kv)
    common.check_implementation(self.implementation)
    common.check_variants(self.variants)

  def config(self, variant: str, length: int, kv: int, lr: float):
    """The trainer config of one run. The loss reads max(kv) positions per row in every cell, so the cells of
    one length share one compiled step."""
    c = common.variant_config(get_config("mqar"), variant, self.size)
    c.seq_len = length + 2 * kv * (self.reads - 1)
    c.batch_size = self.batch_size
    c.steps = self.steps
    c.loss_positions = max(self.kv + (self.train_kv,))
    c.loss_chunk = c.loss_positions
    c.seed = self.seed
    c.implementation = self.implementation
    c.dtype = self.dtype
    c.progress = False
    c.log_every = max(1, self.steps // 20)
    c.checkpoint_every = self.steps
    c.keep_checkpoints = 1
    c.async_checkpoint = False
    c.optimizer.lr = lr
    c.optimizer.warmup_steps = min(c.optimizer.warmup_steps, self.steps // 10)
    c.data.vocab_size = self.vocab_size
    c.data.mqar_pairs = kv
    c.data.mqar_reads = self.reads
    c.data.num_records = self.train_examples
    c.data.order = self.order
    return c

  def test_source(self, length: int, kv: int) -> MQARSource:
    return MQARSource(vocab_size=self.vocab_size, length=length, num_pairs=kv, num_records=self.test_examples,
                      seed=self.seed + 1_000_003, context_reads=self.reads)

  def cells(self) -> list[tuple[int, int]]:
    """The (L, kv) test cells: every pair with 4·kv ≤ L."""
    return [(length, kv) for length in self.lengths for kv in self.kv if 4 * kv <= length]

  def runs(self) -> list[tuple[str, int, int, float, tuple[int, ...]]]:
    """(variant, L, training kv, lr, the kv it is scored at) of every model trained."""
    if self.train_kv:
      return [(v, length, self.train_kv, lr, tuple(kv for le, kv in self.cells() if le == length))
              for v in self.variants for length in self.lengths if 4 * self.train_kv <= length for lr in self.lrs]
    return [(v, length, kv, lr, (kv,)) for v in self.variants for length, kv in self.cells() for lr in self.lrs]


def check_grid(lengths, kv, train_kv: int = 0) -> None:
  """ValueError naming the flag unless every kv (and train_kv, when > 0) fits at least one length (4·kv ≤ L: the
  kv block and as many query slots), so that no kv of the grid is dropped without a cell."""
  lengths = tuple(lengths)
  for name, values in (("kv", tuple(kv)), ("train_kv", (train_kv,) if train_kv else ())):
    for n in values:
      if not any(4 * n <= length for length in lengths):
        raise ValueError(f"mqar: `{name}` {n} fits none of `lengths` {lengths}: a cell needs 4·kv ≤ L (the kv "
                         f"block and as many query slots), so L ≥ {4 * n}")


def run_name(variant: str, length: int, kv: int, lr: float, reads: int = 1) -> str:
  v = variant.replace(":", "_").replace("=", "-").replace(",", "_")
  return f"{v}_L{length}_kv{kv}_lr{lr:g}" + (f"_reads{reads}" if reads != 1 else "")


def score(sweep: Sweep, model, length: int, kv: int) -> dict:
  """Accuracy on the (L, kv) test set, and the per-layer q_geo, ‖S‖ and recall residual on the kv block(s) of
  its first 16 rows."""
  source = sweep.test_source(length, kv)
  accuracy = common.recall_accuracy(model, source, num_examples=sweep.test_examples,
                                    batch_size=min(sweep.test_examples, 256))
  rows = [source[i] for i in range(min(16, sweep.test_examples))]
  tokens = np.stack([r["inputs"] for r in rows])
  context = np.zeros(tokens.shape, np.float32)
  context[:, :2 * kv * sweep.reads] = 1.0
  diag = common.layer_diagnostics(model, tokens, context)
  return dict(accuracy=accuracy, q_geo=diag["q_geo"], recall_residual=diag["recall_residual"],
              state_norm=diag["state_norm"])


def run_one(sweep: Sweep, variant: str, length: int, train_kv: int, lr: float, test_kv, workdir) -> list[dict]:
  """Trains one model (or resumes it from its workdir) and scores it at each kv of test_kv (`score`)."""
  config = sweep.config(variant, length, train_kv, lr)
  model = common.fit(config, workdir).model
  loss = common.last_logged(common.run_dir(config, workdir), "loss")
  return [dict(variant=variant, length=length, kv=kv, train_kv=train_kv, lr=lr, reads=sweep.reads,
               final_loss=loss, steps=config.steps, batch_size=config.batch_size, **score(sweep, model, length, kv))
          for kv in test_kv]


def sweep_runs(sweep: Sweep, out_dir, name: str = "mqar", cache=True) -> list[dict]:
  """Every run of the sweep (each trained, or resumed from OUT/runs/NAME/...), in order, with a progress bar."""
  runs = sweep.runs()
  root = pathlib.Path(out_dir) / "runs" / name
  results = []
  if cache:
    common.enable_compilation_cache(pathlib.Path(out_dir) / "runs" / ".xla-cache")
  with common.progress(len(runs), name) as bar:
    for variant, length, kv, lr, test_kv in runs:
      bar.set_postfix_str(f"{variant} L={length} kv={kv} lr={lr:g}")
      results += run_one(sweep, variant, length, kv, lr, test_kv,
                         root / run_name(variant, length, kv, lr, sweep.reads))
      bar.update()
  return results


def best_over_lrs(results: list[dict]) -> dict[tuple, dict]:
  """{(variant, L, kv): the run with the highest accuracy over learning rates (ties: the lower loss)}."""
  best = {}
  for r in results:
    key = (r["variant"], r["length"], r["kv"])
    if key not in best or (r["accuracy"], -r["final_loss"]) > (best[key]["accuracy"], -best[key]["final_loss"]):
      best[key] = r
  return best


def table(sweep: Sweep, best: dict) -> str:
  """Accuracy (%) per variant and cell, then the model's q_geo and recall residual (geometric means over the
  layers, averaged over the cells)."""
  cells = sweep.cells()
  header = ["variant"] + [f"L={length} kv={kv}" for length, kv in cells] + ["q_geo", "recall residual"]
  rows = []
  for v in sweep.variants:
    runs = [best[(v, length, kv)] for length, kv in cells]
    rows.append([v] + [f"{100 * r['accuracy']:.1f}" for r in runs]
                + [float(np.mean([common.geometric_mean(r["q_geo"]) for r in runs])),
                   float(np.mean([common.geometric_mean(r["recall_residual"]) for r in runs]))])
  lrs = ", ".join(f"{lr:g}" for lr in sweep.lrs)
  trained = f"trained at kv = {sweep.train_kv}" if sweep.train_kv else "one model per cell"
  note = (f"\nAccuracy (%) on {sweep.test_examples} test rows, best over learning rates {{{lrs}}}; {trained}, "
          f"{sweep.steps} steps of {sweep.batch_size} rows, model size `{sweep.size}`, vocabulary "
          f"{sweep.vocab_size}, seed {sweep.seed}. q_geo and the recall residual (on the kv block): geometric mean "
          "over layers, mean over cells.\n")
  return common.markdown_table(header, rows) + note


def heatmaps(sweep: Sweep, best: dict):
  """One accuracy heat-map over (L, kv) per variant."""
  n = len(sweep.variants)
  cols = min(n, 4)
  fig, axes = common.figure((n + cols - 1) // cols, cols, width=3.2, height=2.6)
  for ax in axes.flat[n:]:
    ax.axis("off")
  for ax, v in zip(axes.flat, sweep.variants):
    grid = np.full((len(sweep.lengths), len(sweep.kv)), np.nan)
    for i, length in enumerate(sweep.lengths):
      for j, kv in enumerate(sweep.kv):
        if (v, length, kv) in best:
          grid[i, j] = 100 * best[(v, length, kv)]["accuracy"]
    ax.imshow(grid, vmin=0, vmax=100, cmap="viridis", aspect="auto")
    for (i, j), a in np.ndenumerate(grid):
      if np.isfinite(a):
        ax.text(j, i, f"{a:.0f}", ha="center", va="center", color="w" if a < 60 else "k", fontsize=8)
    ax.set_title(v, fontsize=9)
    ax.set_xticks(range(len(sweep.kv)), [str(k) for k in sweep.kv])
    ax.set_yticks(range(len(sweep.lengths)), [str(length) for length in sweep.lengths])
    ax.set_xlabel("kv pairs")
    ax.set_ylabel("L")
  fig.suptitle("MQAR accuracy (%)")
  fig.tight_layout()
  return fig


def report(sweep: Sweep, results: list[dict], out_dir, name: str = "mqar", *, command=None, provenance=None):
  best = best_over_lrs(results)
  text = table(sweep, best)
  paths = common.write_results(out_dir, name, {"sweep": dataclasses.asdict(sweep), "runs": results,
                                               "best": [best[k] for k in sorted(best)]},
                               text, heatmaps(sweep, best), command=command, provenance=provenance)
  return text, paths


# The CI size: one variant, one small cell, the token-serial path (the quickest to compile). The other experiments'
# smoke sizes train this same model where they train on MQAR, so a shared compilation cache compiles it once.
SMOKE = dict(variants=("dn",), lengths=(32,), kv=(4,), lrs=(3e-3,), steps=4, batch_size=4, size="tiny",
             vocab_size=64, train_examples=64, test_examples=8, implementation="reference")


def define_flags(defaults: Sweep):
  """The program's flags (`common.define_flags`): `defaults`'s fields are its --config.FIELD settings."""
  common.define_flags(defaults, merge="mqar.json")


def sweep_from_flags(**fixed) -> Sweep:
  """The sweep the flags describe (`fixed`: fields set whatever the flags say); `cli.UsageError` naming the field
  for a value it cannot take (before any work)."""
  if FLAGS.smoke:
    return Sweep(**dict(SMOKE, **fixed))
  sweep = config.settings(Sweep)
  with cli.usage():
    return dataclasses.replace(sweep, **fixed) if fixed else sweep


def merged(payloads: list[dict]) -> tuple[Sweep, list[dict]]:
  """One sweep and its runs from the payloads of several mqar.json files (parts of one sweep run in parallel,
  e.g. one process per variant): the grid is the union of theirs, the other settings the first one's."""
  sweeps = [p["sweep"] for p in payloads]
  fields = {k: tuple(v) if isinstance(v, list) else v for k, v in sweeps[0].items()}
  for axis in ("variants", "lengths", "kv", "lrs"):
    fields[axis] = common.union(s[axis] for s in sweeps)
  return Sweep(**fields), [r for p in payloads for r in p["runs"]]


def main(argv):
  del argv
  provenance = None
  if FLAGS.merge:
    payloads = common.read_results(FLAGS.merge)
    sweep, results = merged(payloads)
    provenance = payloads[0]
  else:
    sweep = sweep_from_flags()
    results = sweep_runs(sweep, FLAGS.out)
  command = "python -m experiments.mqar --smoke" if FLAGS.smoke else common.command("mqar", sweep, skip=("reads",))
  text, paths = report(sweep, results, FLAGS.out, command=command, provenance=provenance)
  print(text)
  print("wrote", ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
  define_flags(Sweep())
  cli.run(main, flags_parser=config.parse_flags)
