"""Small language models per variant on the text corpus (`make data`): every variant sees the same tokens in the
same order for the same number of steps (one config); each variant trains once per seed (the seed sets the
initialisation and the data order). Reported are the validation loss and perplexity on the corpus's fixed
validation split (`osdn_jax.data.sources.in_validation`): the trainer's held-out loss at the last step
(`eval_every` = steps, `eval_batches` = validation_batches; `train.loop.eval_batches`), per variant the mean over
the seeds, their spread (largest − smallest) and each seed's value, and the training-loss curves (the mean over
the seeds, their range shaded).

  python -m experiments.lm                        # the default (bytes, the `mqar` size: d_model 128, 2 layers)
  python -m experiments.lm --smoke                # CI size
  python -m experiments.lm --config.variants=dn,pdn,osdn --config.seeds=0,1,2 --config.steps=1000 \
      --config.dtype=bfloat16
  python -m experiments.lm --config.variants=gdn,pgdn,osdn-gdn --config.size=340m --config.tokenizer=bpe \
      --config.vocab_size=32000 --config.dtype=bfloat16

The settings are `LM`'s fields, each `--config.FIELD=VALUE` (`experiments.config`; `--FIELD=VALUE` is the same).

Writes OUT/lm.json (a row per variant and seed), OUT/lm.md and OUT/lm.png (training loss against tokens, one line
per variant); work directories under OUT/runs/lm/. Parts of one comparison run apart (a process per variant or
per seed) are reported together with --merge.
"""
from __future__ import annotations

import dataclasses
import math
import pathlib

import numpy as np

from absl import flags

from experiments import common, config
from experiments.plot_run import read_metrics
from osdn_jax import cli
from osdn_jax.train import get_config

FLAGS = flags.FLAGS


@dataclasses.dataclass
class LM:
  variants: tuple[str, ...] = common.VARIANTS
  size: str = "mqar"
  tokenizer: str = "byte"
  vocab_size: int = 256
  seq_len: int = 512
  batch_size: int = 32
  steps: int = 2000
  lr: float = 3e-3
  dtype: str = "float32"
  validation_batches: int = 16
  seeds: tuple[int, ...] = (0,)
  implementation: str = "auto"

  def __post_init__(self):
    common.check_variants(self.variants)      # an unknown one stops the comparison before anything trains
    common.check_implementation(self.implementation)

  def config(self, variant: str, seed: int | None = None):
    """The trainer's config of one run (seed: default the first of `seeds`)."""
    c = common.variant_config(get_config("tiny"), variant, self.size)
    c.seq_len, c.batch_size, c.steps = self.seq_len, self.batch_size, self.steps
    c.seed = self.seeds[0] if seed is None else seed
    c.dtype, c.implementation = self.dtype, self.implementation
    c.loss_chunk = min(c.loss_chunk, self.seq_len)
    c.progress = False
    c.log_every = max(1, self.steps // 50)
    c.checkpoint_every = self.steps
    c.keep_checkpoints = 1
    c.async_checkpoint = False
    c.diagnostics_every = 0
    c.eval_every, c.eval_batches = self.steps, self.validation_batches   # the held-out loss at the end
    c.optimizer.lr = self.lr
    c.optimizer.warmup_steps = max(1, min(100, self.steps // 10))
    c.data.tokenizer, c.data.vocab_size = self.tokenizer, self.vocab_size
    return c


def run(spec: LM, out_dir) -> list[dict]:
  root = pathlib.Path(out_dir) / "runs" / "lm"
  common.enable_compilation_cache(pathlib.Path(out_dir) / "runs" / ".xla-cache")
  rows = []
  with common.progress(len(spec.variants) * len(spec.seeds), "lm") as bar:
    for v, seed in ((v, seed) for v in spec.variants for seed in spec.seeds):
      bar.set_postfix_str(f"{v} seed {seed}")
      workdir = root / v.replace(":", "_").replace("=", "-").replace(",", "_")     # run_dir: one per seed
      config = spec.config(v, seed)
      common.fit(config, workdir)
      logged = read_metrics(common.run_dir(config, workdir))   # also a finished run's, reused
      val = next((r for r in logged if "eval_loss" in r and r["step"] == config.steps), None)
      if val is None:
        raise RuntimeError(f"lm: {common.run_dir(config, workdir)} logged no held-out loss at step {config.steps}")
      curve = [(r["step"], r["loss"]) for r in logged if "loss" in r]
      rows.append(dict(variant=v, seed=seed, validation_loss=val["eval_loss"],
                       validation_perplexity=val["eval_perplexity"],
                       final_train_loss=curve[-1][1] if curve else None, curve=curve,
                       tokens=config.steps * config.batch_size * config.seq_len))
      bar.update()
  return rows


def by_variant(rows: list[dict], spec: LM) -> list[dict]:
  """Per variant (in spec.variants' order), over its seeds: the mean validation loss, its spread (largest −
  smallest), the perplexity of the mean loss, each seed's loss (seed order), the mean final training loss, and the
  training-loss curve's mean and range at the steps every seed logged."""
  out = []
  for v in spec.variants:
    runs = sorted((r for r in rows if r["variant"] == v), key=lambda r: r["seed"])
    if not runs:
      continue
    losses = np.array([r["validation_loss"] for r in runs], np.float64)
    steps = sorted(set.intersection(*(set(s for s, _ in r["curve"]) for r in runs)))
    curves = np.array([[dict(r["curve"])[s] for s in steps] for r in runs], np.float64).reshape(len(runs), -1)
    finals = [r["final_train_loss"] for r in runs if r["final_train_loss"] is not None]
    out.append(dict(variant=v, seeds=[r["seed"] for r in runs], losses=losses.tolist(),
                    mean=float(losses.mean()), spread=float(losses.max() - losses.min()),
                    perplexity=math.exp(losses.mean()), final_train_loss=float(np.mean(finals)) if finals else None,
                    steps=steps, curve_mean=curves.mean(0).tolist(), curve_low=curves.min(0).tolist(),
                    curve_high=curves.max(0).tolist()))
  return out


def table(rows: list[dict], spec: LM) -> str:
  unit = "byte" if spec.tokenizer == "byte" else "token"
  stats = by_variant(rows, spec)
  seeds = ", ".join(map(str, spec.seeds))
  if len(spec.seeds) > 1:
    header = ["variant", f"validation loss (nats/{unit}), mean", "spread", f"per seed ({seeds})",
              "perplexity of the mean", "final training loss, mean"]
    body = [[r["variant"], f"{r['mean']:.4f}", f"{r['spread']:.4f}", " / ".join(f"{x:.4f}" for x in r["losses"]),
             r["perplexity"], r["final_train_loss"]] for r in stats]
  else:
    header = ["variant", f"validation loss (nats/{unit})", "validation perplexity", "final training loss"]
    body = [[r["variant"], f"{r['mean']:.4f}", r["perplexity"], r["final_train_loss"]] for r in stats]
  note = (f"\nSize `{spec.size}`, {spec.tokenizer} tokenizer (vocabulary {spec.vocab_size}), {spec.steps} steps of "
          f"{spec.batch_size} × {spec.seq_len} tokens ({rows[0]['tokens'] if rows else 0:,} tokens), lr {spec.lr:g}, "
          f"{spec.dtype}, seed{'s' if len(spec.seeds) > 1 else ''} {seeds}; validation: {spec.validation_batches} "
          "batches of the validation split"
          + ("; spread: the largest seed's loss − the smallest's" if len(spec.seeds) > 1 else "") + ".\n")
  return common.markdown_table(header, body) + note


def plot(rows: list[dict], spec: LM):
  fig, axes = common.figure(1, 1, width=6.0, height=4.0)
  ax = axes[0][0]
  for r in by_variant(rows, spec):
    tokens = [s * spec.batch_size * spec.seq_len for s in r["steps"]]
    (line,) = ax.plot(tokens, r["curve_mean"], label=r["variant"], lw=1.2)
    if len(r["seeds"]) > 1:
      ax.fill_between(tokens, r["curve_low"], r["curve_high"], color=line.get_color(), alpha=0.2, lw=0)
  ax.set_xlabel("training tokens")
  ax.set_ylabel("training loss" + (" (mean over seeds, range shaded)" if len(spec.seeds) > 1 else ""))
  ax.set_title("language modelling on the text corpus")
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  return fig


SMOKE = dict(variants=("dn",), size="tiny", seq_len=64, batch_size=2, steps=3, validation_batches=1, seeds=(0, 1),
             implementation="reference")


def main(argv):
  del argv
  f = FLAGS
  spec = LM(**SMOKE) if f.smoke else config.settings(LM)
  provenance = None
  if f.merge:   # parts of one comparison run in parallel (a process per variant or per seed): one report
    spec, rows, provenance = common.merge_parts(f.merge, LM, upgrade=common.seed_to_seeds)
  else:
    rows = run(spec, f.out)
  text = table(rows, spec)
  command = "python -m experiments.lm --smoke" if f.smoke else common.command("lm", spec)
  paths = common.write_results(f.out, "lm", {"spec": dataclasses.asdict(spec), "rows": rows}, text, plot(rows, spec),
                               command=command, provenance=provenance)
  print(text)
  print("wrote", ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
  common.define_flags(LM(), merge="lm.json")
  cli.run(main, flags_parser=config.parse_flags)
