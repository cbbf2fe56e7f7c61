"""Residual contraction per variant: after training on MQAR and on text, each layer's q_geo (the geometric mean of
ρ_t = (1 − β_t⟨k_t, k̃_t⟩)², what one write leaves of the residual), the recall residual of the final state on
the pairs it was given (MQAR: the kv block; text: every position) and ‖S_T‖_F, beside the MQAR accuracy.

A lower q_geo is close to built into OSDN (its hypergradient drives ρ_t towards 0), so it is reported next to
what it is meant to buy: the recall residual, the accuracy, and the `dn-fixed-d` control.

  python -m experiments.contraction               # the default (a GPU)
  python -m experiments.contraction --smoke       # CI size
  python -m experiments.contraction --config.variants=dn,osdn --config.mqar.lengths=64 --config.mqar.kv=8 \
      --config.mqar.vocab_size=256 --config.mqar.steps=250

The settings are `Contraction`'s fields, each `--config.FIELD=VALUE` (`experiments.config`): the MQAR training's
under `mqar` (`experiments.mqar.Sweep`: its first length, kv and learning rate), the text training's under `text`
(`experiments.lm.LM`); the variants trained are the top-level `variants` (the sections' own are not read).

Writes OUT/contraction.json, OUT/contraction.md and OUT/contraction.png; work directories under
OUT/runs/contraction/.
"""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
from absl import flags

from experiments import common, config, lm, mqar
from osdn_jax import cli

FLAGS = flags.FLAGS


@dataclasses.dataclass
class Contraction:
  """The variants, each trained on MQAR (`mqar`) and on text (`text`), module docstring."""
  variants: tuple[str, ...] = common.VARIANTS
  mqar: mqar.Sweep = dataclasses.field(default_factory=lambda: mqar.Sweep(lengths=(256,), kv=(32,), lrs=(1e-3,)))
  text: lm.LM = dataclasses.field(default_factory=lm.LM)


def text_diagnostics(result, config, rows: int = 8) -> dict:
  """Per-layer diagnostics on `rows` validation rows (each from the zero state; recall over every position)."""
  return common.layer_diagnostics(result.model, common.validation_tokens(config, rows))


def run(spec: Contraction, out_dir) -> list[dict]:
  sweep = dataclasses.replace(spec.mqar, variants=spec.variants)
  (length, kv), lr = sweep.cells()[0], sweep.lrs[0]
  root = pathlib.Path(out_dir) / "runs" / "contraction"
  common.enable_compilation_cache(pathlib.Path(out_dir) / "runs" / ".xla-cache")
  rows = []
  with common.progress(2 * len(spec.variants), "contraction") as bar:
    for v in spec.variants:
      name = v.replace(":", "_").replace("=", "-").replace(",", "_")
      bar.set_postfix_str(f"{v} mqar")
      recall = mqar.run_one(sweep, v, length, kv, lr, (kv,), root / f"mqar_{name}")[0]
      bar.update()
      bar.set_postfix_str(f"{v} text")
      config = spec.text.config(v)
      text = text_diagnostics(common.fit(config, root / f"text_{name}"), config)
      bar.update()
      rows.append(dict(variant=v, mqar=dict(length=length, kv=kv, lr=lr, accuracy=recall["accuracy"],
                                            q_geo=recall["q_geo"], recall_residual=recall["recall_residual"],
                                            state_norm=recall["state_norm"]),
                       text=text))
  return rows


def table(rows: list[dict], spec: Contraction) -> str:
  fmt = lambda xs: " / ".join(f"{x:.3g}" for x in xs)
  header = ["variant", "MQAR acc (%)", "q_geo per layer (MQAR)", "recall residual (MQAR)", "‖S‖ (MQAR)",
            "q_geo per layer (text)", "recall residual (text)", "‖S‖ (text)"]
  body = [[r["variant"], f"{100 * r['mqar']['accuracy']:.1f}", fmt(r["mqar"]["q_geo"]),
           fmt(r["mqar"]["recall_residual"]), fmt(r["mqar"]["state_norm"]), fmt(r["text"]["q_geo"]),
           fmt(r["text"]["recall_residual"]), fmt(r["text"]["state_norm"])] for r in rows]
  m, t = spec.mqar, spec.text
  cell = rows[0]["mqar"] if rows else {}
  note = (f"\nPer layer (first / second …). MQAR: L = {cell.get('length')}, kv = {cell.get('kv')}, {m.steps} steps of "
          f"{m.batch_size} rows, size `{m.size}`, lr {cell.get('lr')}; recall residual on the kv block of up to 16 "
          f"test rows. Text: {t.steps} steps of {t.batch_size} × {t.seq_len} {t.tokenizer} tokens, size `{t.size}`; "
          "diagnostics on 8 validation rows, recall residual over all positions.\n")
  return common.markdown_table(header, body) + note


def plot(rows: list[dict]):
  fig, axes = common.figure(1, 3, width=4.2, height=3.4)
  x = np.arange(len(rows))
  for ax, key, title in zip(axes[0], ("q_geo", "recall_residual", "state_norm"),
                            ("q_geo (geometric mean over layers)", "recall residual", "‖S_T‖ (mean over layers)")):
    reduce = common.geometric_mean if key != "state_norm" else (lambda xs: float(np.mean(xs)))
    ax.bar(x - 0.2, [reduce(r["mqar"][key]) for r in rows], 0.4, label="MQAR")
    ax.bar(x + 0.2, [reduce(r["text"][key]) for r in rows], 0.4, label="text")
    ax.set_xticks(x, [r["variant"] for r in rows], rotation=60, ha="right", fontsize=8)
    ax.set_title(title, fontsize=9)
    if key != "state_norm":
      ax.set_yscale("log")
  axes[0][0].legend(fontsize=8)
  fig.tight_layout()
  return fig


SMOKE = Contraction(variants=mqar.SMOKE["variants"], mqar=mqar.Sweep(**mqar.SMOKE), text=lm.LM(**lm.SMOKE))


def main(argv):
  del argv
  f = FLAGS
  spec = SMOKE if f.smoke else config.settings(Contraction)
  rows = run(spec, f.out)
  text = table(rows, spec)
  paths = common.write_results(f.out, "contraction", {"spec": dataclasses.asdict(spec), "rows": rows}, text,
                               plot(rows))
  print(text)
  print("wrote", ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
  common.define_flags(Contraction())
  cli.run(main, flags_parser=config.parse_flags)
