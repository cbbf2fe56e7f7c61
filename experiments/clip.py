"""How often OSDN's box clip acts, with the gates of trained models. Per OSDN point, trained on MQAR and on text
(the settings of `experiments.contraction`), per layer and per head of the d-pass (the value heads): the fraction of
(token, channel) updates d̄_{t+1} that leave [d_min, d_max] (below and above), of tokens with a clipped channel, and
of chunks of C tokens that hold a clipped update (the chunks a chunk-parallel d-pass would redo serially), beside
the gates that drive the d-pass (β, the APF retention r), the solve's decay α = e^g and where d sits.

Measured on held-out rows (MQAR test rows, text validation rows), each from d_init, on the layer's own solve inputs
(`DGPSMixer.solve_inputs`) through the token-serial d-pass (`diagnostics.clip_trajectory`).

  python -m experiments.clip                 # the default (a GPU)
  python -m experiments.clip --smoke         # CI size
  python -m experiments.clip --config.variants=osdn,osdn-apf:apf_anchor=init --config.chunk_sizes=32,64 \
      --config.mqar.steps=500

The settings are `Clip`'s fields, each `--config.FIELD=VALUE` (`experiments.config`): the MQAR training's under
`mqar` (`experiments.mqar.Sweep`: its first length, kv and learning rate), the text training's under `text`
(`experiments.lm.LM`), e.g. `--config.mqar.dtype=bfloat16 --config.text.dtype=bfloat16`; the variants trained
are the top-level `variants` (the sections' own are not read). `--text_steps=200` is `--config.text.steps=200`.

Writes OUT/clip.json, OUT/clip.md and OUT/clip.png; work directories under OUT/runs/clip/.
"""
from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

from experiments import common, config, lm, mqar
from osdn_jax import cli, dgps, diagnostics

FLAGS = flags.FLAGS

# Every OSDN point of the registry (vanilla and APF, on each backbone).
VARIANTS = tuple(name for name, p in dgps.POINTS.items() if dgps.has_osdn_pass(p))
QUANTILES = (0.01, 0.05, 0.5, 0.95, 0.99)


@dataclasses.dataclass
class Clip:
  """What `experiments.clip` measures (module docstring): the OSDN points `variants`, each trained on MQAR (`mqar`)
  and on text (`text`); the chunk lengths C of the chunk counts; the MQAR test rows and text validation rows
  measured."""
  variants: tuple[str, ...] = VARIANTS
  mqar: mqar.Sweep = dataclasses.field(default_factory=lambda: mqar.Sweep(lengths=(256,), kv=(32,), lrs=(1e-3,)))
  text: lm.LM = dataclasses.field(default_factory=lm.LM)
  chunk_sizes: tuple[int, ...] = (16, 64, 128)
  mqar_rows: int = 64
  text_rows: int = 16


# --- measuring one model --------------------------------------------------------------------------------------------

def _per_head(x, axis: int = 2) -> dict:
  """{"mean": [G], "p1": [G], "p5": …} of x over every axis but the head axis (QUANTILES as percentiles)."""
  x = jnp.moveaxis(x.astype(jnp.float32), axis, 0).reshape(x.shape[axis], -1)
  qs = jnp.quantile(x, jnp.asarray(QUANTILES, jnp.float32), axis=1)
  return dict(mean=jnp.mean(x, axis=1), **{f"p{100 * q:g}": v for q, v in zip(QUANTILES, qs)})


def layer_clip(mixer, x, chunk_sizes) -> dict:
  """The clip statistics and gate summaries of one OSDN mixer on its input x [B, T, D]."""
  prep = mixer.solve_inputs(x)
  arrays, opts = diagnostics.d_pass_inputs(mixer.cfg.point, prep["k"], prep["beta"],
                                           prep["features"].get("precond", {}))
  ds, _, below, above = diagnostics.clip_trajectory(**arrays, **opts)
  out = diagnostics.clip_fractions(ds, below, above, d_min=opts["d_min"], d_max=opts["d_max"],
                                   chunk_sizes=chunk_sizes)
  out.update(beta=_per_head(arrays["beta"]), d=_per_head(ds))
  out["retention"] = None if arrays["retention"] is None else _per_head(arrays["retention"])
  out["decay"] = None if prep["log_decay"] is None else _per_head(jnp.exp(prep["log_decay"]))
  return out


@functools.partial(jax.jit, static_argnums=(0, 3))
def _measure(graph, state, tokens, chunk_sizes):
  return nnx.merge(graph, state).map_mixers(tokens, functools.partial(layer_clip, chunk_sizes=chunk_sizes))


def measure(model, tokens, chunk_sizes) -> list[dict]:
  """Per layer of `model` on tokens [B, T]: `layer_clip`'s statistics as lists over heads."""
  graph, state = nnx.split(model)
  stacked = jax.device_get(_measure(graph, state, jnp.asarray(tokens), tuple(chunk_sizes)))
  layers = stacked["below"].shape[0]
  tolist = lambda tree, i: jax.tree.map(lambda a: np.asarray(a[i]).tolist(), tree)
  out = []
  for i in range(layers):
    row = {k: tolist(v, i) for k, v in stacked.items() if k != "chunks"}
    row["chunks"] = {str(c): tolist(v, i) for c, v in stacked["chunks"].items()}
    out.append(dict(layer=i, **row))
  return out


def check_variant(spec: str) -> None:
  name, options = common.parse_variant(spec)
  if not dgps.has_osdn_pass(dgps.get(name, **options)):
    raise ValueError(f"clip: variant {spec!r} has no OSDN d-pass; the clip exists only for OSDN points")


def run(spec: Clip, out_dir) -> list[dict]:
  for v in spec.variants:
    check_variant(v)
  sweep = dataclasses.replace(spec.mqar, variants=spec.variants)
  (length, kv), lr = sweep.cells()[0], sweep.lrs[0]
  root = pathlib.Path(out_dir) / "runs" / "clip"
  common.enable_compilation_cache(pathlib.Path(out_dir) / "runs" / ".xla-cache")
  rows = []
  with common.progress(2 * len(spec.variants), "clip") as bar:
    for v in spec.variants:
      name = v.replace(":", "_").replace("=", "-").replace(",", "_")
      bar.set_postfix_str(f"{v} mqar")
      config = sweep.config(v, length, kv, lr)
      workdir = common.run_dir(config, root / f"mqar_{name}")
      model = common.fit(config, root / f"mqar_{name}").model
      source = sweep.test_source(length, kv)
      accuracy = common.recall_accuracy(model, source, num_examples=sweep.test_examples,
                                        batch_size=min(sweep.test_examples, 256))
      tokens = np.stack([source[i]["inputs"] for i in range(min(spec.mqar_rows, sweep.test_examples))])
      rows.append(dict(variant=v, data="mqar", length=length, kv=kv, lr=lr, accuracy=accuracy,
                       final_loss=common.last_logged(workdir, "loss"), rows=len(tokens),
                       layers=measure(model, tokens, spec.chunk_sizes)))
      bar.update()
      bar.set_postfix_str(f"{v} text")
      config = spec.text.config(v)
      workdir = common.run_dir(config, root / f"text_{name}")
      model = common.fit(config, root / f"text_{name}").model
      tokens = common.validation_tokens(config, spec.text_rows)
      rows.append(dict(variant=v, data="text", length=config.seq_len, final_loss=common.last_logged(workdir, "loss"),
                       rows=len(tokens), layers=measure(model, tokens, spec.chunk_sizes)))
      bar.update()
  return rows


# --- report ---------------------------------------------------------------------------------------------------------

def _heads(xs, scale: float = 1.0) -> str:
  return " / ".join(f"{scale * x:.3g}" for x in xs)


def _spread(summary, complement: bool = False) -> str:
  """Per head "p50 (p5–p95)" of a `_per_head` summary (of 1 − x when complement, its quantiles reversed)."""
  if summary is None:
    return "–"
  lo, mid, hi = (np.asarray(summary[p]) for p in ("p5", "p50", "p95"))
  if complement:
    lo, mid, hi = 1.0 - hi, 1.0 - mid, 1.0 - lo
  return " / ".join(f"{m:.3g} ({a:.3g}–{b:.3g})" for a, m, b in zip(lo, mid, hi))


def _trained(row) -> str:
  return f"acc {100 * row['accuracy']:.1f}%" if row["data"] == "mqar" else f"loss {row['final_loss']:.3g}"


def table(rows: list[dict], spec: Clip) -> str:
  sizes = spec.chunk_sizes
  header = (["variant", "data", "trained", "layer", "clipped below (%)", "clipped above (%)", "tokens (%)"]
            + [f"chunks C={c} (%)" for c in sizes] + ["d at d_min (%)", "d at d_max (%)"])
  body = [[r["variant"], r["data"], _trained(r), h["layer"], _heads(h["below"], 100), _heads(h["above"], 100),
           _heads(h["tokens"], 100)] + [_heads(h["chunks"][str(c)], 100) for c in sizes]
          + [_heads(h["d_at_min"], 100), _heads(h["d_at_max"], 100)]
          for r in rows for h in r["layers"]]
  gates = ["variant", "data", "layer", "β", "1 − r (APF)", "1 − α (decay)", "d"]
  gate_body = [[r["variant"], r["data"], h["layer"], _spread(h["beta"]), _spread(h["retention"], True),
                _spread(h["decay"], True), _spread(h["d"])] for r in rows for h in r["layers"]]
  m, t = spec.mqar, spec.text
  mq = next((r for r in rows if r["data"] == "mqar"), {})
  note = (f"\nPer head of the d-pass (head 0 / head 1 / …), percentages of: (token, channel) updates d̄ below d_min "
          f"and above d_max; tokens with a clipped channel; chunks of C tokens holding a clipped update. MQAR: "
          f"L = {mq.get('length')}, kv = {mq.get('kv')}, {m.steps} steps of {m.batch_size} rows, size `{m.size}`, "
          f"lr {mq.get('lr')}; measured on {spec.mqar_rows} test rows. Text: {t.steps} steps of {t.batch_size} × "
          f"{t.seq_len} {t.tokenizer} tokens, size `{t.size}`; measured on {spec.text_rows} validation rows. Every "
          "row from d = d_init.\n\nGates, per head: median (5th–95th percentile) over rows, tokens (and channels "
          "for d and a per-channel decay).\n\n")
  return common.markdown_table(header, body) + note + common.markdown_table(gates, gate_body)


def _layer_mean(row, key, sub=None) -> float:
  values = [h[key] if sub is None else h[key][sub] for h in row["layers"]]
  return float(np.mean(values))


def plot(rows: list[dict], spec: Clip):
  variants = list(dict.fromkeys(r["variant"] for r in rows))
  fig, axes = common.figure(2, 2, width=4.6, height=3.2)
  x = np.arange(len(variants))
  for i, data in enumerate(("mqar", "text")):
    by = {r["variant"]: r for r in rows if r["data"] == data}
    get = lambda key, sub=None: np.array([100 * _layer_mean(by[v], key, sub) if v in by else np.nan
                                          for v in variants])
    ax = axes[i][0]
    below, above = get("below"), get("above")
    ax.bar(x, below, 0.6, label="below d_min")
    ax.bar(x, above, 0.6, bottom=below, label="above d_max")
    ax.set_title(f"{data}: updates clipped (%)", fontsize=9)
    ax = axes[i][1]
    groups = [("tokens", None)] + [("chunks", str(c)) for c in spec.chunk_sizes]
    width = 0.8 / len(groups)
    for j, (key, sub) in enumerate(groups):
      ax.bar(x + (j - (len(groups) - 1) / 2) * width, get(key, sub), width,
             label="tokens" if sub is None else f"chunks C={sub}")
    ax.set_title(f"{data}: tokens and chunks holding a clip (%)", fontsize=9)
    for ax in axes[i]:
      ax.set_xticks(x, variants, rotation=45, ha="right", fontsize=8)
      top = ax.dataLim.y1
      ax.set_ylim(0.0, 1.15 * top if np.isfinite(top) and top > 0 else 1.0)    # all zero: an empty axis
  axes[0][0].legend(fontsize=7)
  axes[0][1].legend(fontsize=7)
  fig.suptitle("OSDN d-pass clip activity (mean over layers and heads)", fontsize=10)
  fig.tight_layout()
  return fig


SMOKE = dict(variants=("osdn-apf",), mqar=mqar.Sweep(**dict(mqar.SMOKE, variants=("osdn-apf",))),
             text=lm.LM(**dict(lm.SMOKE, variants=("osdn-apf",))), mqar_rows=4, text_rows=2)


def main(argv):
  del argv
  f = FLAGS
  spec = Clip(**SMOKE) if f.smoke else config.settings(Clip)
  rows = run(spec, f.out)
  text = table(rows, spec)
  paths = common.write_results(f.out, "clip", {"spec": dataclasses.asdict(spec), "rows": rows}, text,
                               plot(rows, spec))
  print(text)
  print("wrote", ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
  common.define_flags(Clip())
  cli.run(main, flags_parser=config.parse_flags)
