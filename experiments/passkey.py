"""Passkey retrieval (S-NIAH-1 style, `osdn_jax.data.PasskeySource`): a byte-level model trained on passkey rows
of one length (needle at a uniformly drawn depth) is asked for the key in haystacks of several lengths, with the
needle at several depths; the score is the exact match of the greedily generated digits (recurrent decoding,
`models.generate`).

  python -m experiments.passkey                   # the default grid (a GPU)
  python -m experiments.passkey --smoke           # CI size
  python -m experiments.passkey --config.variants=dn,pdn,osdn --config.train_length=512 \
      --config.lengths=512,1024,2048
  python -m experiments.passkey --config.variants=gdn,pgdn --config.seeds=0,1,2

The settings are `Passkey`'s fields, each `--config.FIELD=VALUE` (`experiments.config`; `--FIELD=VALUE` is the
same). Each variant trains once per seed (`seeds`: the seed sets the initialisation, the data order and the test
haystacks). Writes OUT/passkey.json (exact match per variant, seed, length and depth), OUT/passkey.md (per variant
and length the mean over depths and seeds; with several seeds, each seed's overall score too) and
OUT/passkey.png (a heat-map of depth × length per variant, the mean over seeds); work directories under
OUT/runs/passkey/.
"""
from __future__ import annotations

import dataclasses
import pathlib

import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import common, config
from osdn_jax import cli, models
from osdn_jax.data import PasskeySource
from osdn_jax.train import get_config

FLAGS = flags.FLAGS


@dataclasses.dataclass
class Passkey:
  variants: tuple[str, ...] = common.VARIANTS
  train_length: int = 512
  lengths: tuple[int, ...] = (512, 1024, 2048)
  depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
  steps: int = 1500
  batch_size: int = 32
  lr: float = 1e-3
  size: str = "mqar"
  digits: int = 5
  test_examples: int = 64
  seeds: tuple[int, ...] = (0,)
  implementation: str = "auto"

  def __post_init__(self):
    """ValueError naming the setting no run could use (before anything trains): a depth outside [0, 1], a length
    too short for the needle, question and answer, an unknown variant."""
    for depth in self.depths:
      if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 1:
        raise ValueError(f"passkey: `depths` must be numbers in [0, 1] (the needle's place in the haystack), got "
                         f"{depth!r}")
    for name, length in [("train_length", self.train_length)] + [("lengths", x) for x in self.lengths]:
      try:
        PasskeySource(length=length, num_records=1, seed=0, digits=self.digits)
      except ValueError as e:
        raise ValueError(f"passkey: `{name}` {length}: {e}") from None
    common.check_variants(self.variants)
    common.check_implementation(self.implementation)

  def config(self, variant: str, seed: int | None = None):
    """The trainer's config of one run (seed: default the first of `seeds`)."""
    c = common.variant_config(get_config("mqar"), variant, self.size)
    c.seq_len = self.train_length
    c.batch_size = self.batch_size
    c.steps = self.steps
    c.loss_positions = c.loss_chunk = self.digits
    c.seed = self.seeds[0] if seed is None else seed
    c.implementation = self.implementation
    c.progress = False
    c.log_every = max(1, self.steps // 20)
    c.checkpoint_every = self.steps
    c.keep_checkpoints = 1
    c.async_checkpoint = False
    c.optimizer.lr = self.lr
    c.optimizer.warmup_steps = min(c.optimizer.warmup_steps, self.steps // 10)
    c.data.source = "passkey"
    c.data.vocab_size = 256
    c.data.passkey_digits = self.digits
    c.data.passkey_depth = -1.0
    return c


def exact_match(model, length: int, depth: float, spec: Passkey, seed: int) -> float:
  """The fraction of test_examples haystacks of `length` bytes, needle at `depth` (drawn with `seed`), whose
  greedily generated digits all equal the key."""
  source = PasskeySource(length=length, num_records=spec.test_examples, seed=seed + 1_000_003, depth=depth,
                         digits=spec.digits)
  prompts = jnp.asarray(np.stack([source.prompt(i) for i in range(len(source))]))
  answers = np.stack([source.answer(i) for i in range(len(source))])
  out, _ = models.generate(model, prompts, spec.digits)
  return float(np.mean(np.all(np.asarray(out) == answers, axis=1)))


def run(spec: Passkey, out_dir) -> list[dict]:
  root = pathlib.Path(out_dir) / "runs" / "passkey"
  common.enable_compilation_cache(pathlib.Path(out_dir) / "runs" / ".xla-cache")
  rows = []
  with common.progress(len(spec.variants) * len(spec.seeds), "passkey") as bar:
    for v, seed in ((v, seed) for v in spec.variants for seed in spec.seeds):
      bar.set_postfix_str(f"{v} seed {seed}")
      config, name = spec.config(v, seed), root / v.replace(":", "_").replace("=", "-").replace(",", "_")
      workdir = common.run_dir(config, name)
      model = common.fit(config, name).model
      loss = common.last_logged(workdir, "loss")
      for length in spec.lengths:
        for depth in spec.depths:
          rows.append(dict(variant=v, seed=seed, length=length, depth=depth,
                           exact_match=exact_match(model, length, depth, spec, seed), final_loss=loss))
      bar.update()
  return rows


def table(rows: list[dict], spec: Passkey) -> str:
  many = len(spec.seeds) > 1
  seeds = ", ".join(map(str, spec.seeds))
  header = ["variant"] + [f"L={length}" for length in spec.lengths] + ["all"] + ([f"all, per seed ({seeds})"]
                                                                                 if many else [])
  body = []
  for v in spec.variants:
    mine = [r for r in rows if r["variant"] == v]
    if not mine:
      continue
    per_length = [np.mean([r["exact_match"] for r in mine if r["length"] == length]) for length in spec.lengths]
    per_seed = [[r["exact_match"] for r in mine if r["seed"] == seed] for seed in spec.seeds]
    body.append([v] + [f"{100 * x:.0f}" for x in per_length] + [f"{100 * np.mean(per_length):.0f}"]
                + ([" / ".join(f"{100 * np.mean(x):.0f}" if x else "–" for x in per_seed)] if many else []))
  depths = ", ".join(f"{d:g}" for d in spec.depths)
  note = (f"\nExact match (%) of the {spec.digits}-digit key over {spec.test_examples} haystacks per cell, averaged "
          f"over needle depths {{{depths}}}{' and the seeds' if many else ''}; trained on {spec.train_length}-byte "
          f"rows for {spec.steps} steps of {spec.batch_size} rows (lr {spec.lr:g}), model size `{spec.size}`, "
          f"seed{'s' if many else ''} {seeds}. Per-depth figures are in passkey.json and the plot.\n")
  return common.markdown_table(header, body) + note


def plot(rows: list[dict], spec: Passkey):
  n = len(spec.variants)
  cols = min(n, 4)
  fig, axes = common.figure((n + cols - 1) // cols, cols, width=3.2, height=2.6)
  for ax in axes.flat[n:]:
    ax.axis("off")
  for ax, v in zip(axes.flat, spec.variants):
    grid = np.array([[100 * np.mean([r["exact_match"] for r in rows if (r["variant"], r["length"], r["depth"]) ==
                                     (v, length, d)]) for length in spec.lengths] for d in spec.depths])
    ax.imshow(grid, vmin=0, vmax=100, cmap="viridis", aspect="auto")
    for (i, j), a in np.ndenumerate(grid):
      ax.text(j, i, f"{a:.0f}", ha="center", va="center", color="w" if a < 60 else "k", fontsize=8)
    ax.set_title(v, fontsize=9)
    ax.set_xticks(range(len(spec.lengths)), [str(x) for x in spec.lengths])
    ax.set_yticks(range(len(spec.depths)), [f"{d:g}" for d in spec.depths])
    ax.set_xlabel("length (bytes)")
    ax.set_ylabel("depth")
  fig.suptitle("passkey exact match (%)")
  fig.tight_layout()
  return fig


SMOKE = dict(variants=("dn",), train_length=200, lengths=(200, 240), depths=(0.0, 1.0), steps=3, batch_size=2,
             size="tiny", test_examples=2, implementation="reference")


def main(argv):
  del argv
  f = FLAGS
  spec = Passkey(**SMOKE) if f.smoke else config.settings(Passkey)
  provenance = None
  if f.merge:   # parts of one comparison run in parallel (a process per variant or per seed): one report
    spec, rows, provenance = common.merge_parts(f.merge, Passkey, upgrade=common.seed_to_seeds)
  else:
    rows = run(spec, f.out)
  text = table(rows, spec)
  command = "python -m experiments.passkey --smoke" if f.smoke else common.command("passkey", spec, skip=("digits",))
  paths = common.write_results(f.out, "passkey", {"spec": dataclasses.asdict(spec), "rows": rows}, text,
                               plot(rows, spec), command=command, provenance=provenance)
  print(text)
  print("wrote", ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
  common.define_flags(Passkey(), merge="passkey.json")
  cli.run(main, flags_parser=config.parse_flags)
