"""Plots of training runs: reads DIR/metrics.jsonl (as `python -m osdn_jax.train --workdir=DIR` writes it) and
draws one PNG: loss (and, dashed, the held-out eval_loss where the run evaluated), learning rate, gradient norm
(log scale) and throughput against the step, and, when the run logged diagnostics, the per-layer q_geo and ‖S‖
against the step (one line per layer, coloured by layer). A line holding an evaluation only adds to no other panel.
Several runs overlay in the same panels, each named by its directory.

  python -m experiments.plot_run DIR                          # writes DIR/run.png
  python -m experiments.plot_run DIR_A DIR_B --out=cmp.png    # overlays several runs; --out is required

A step logged twice (which a resumed run does not leave) counts once, with its last line. The first logged
throughput point of a run also timed the compilation; it is drawn as an open circle.
"""
from __future__ import annotations

import json
import math
import pathlib

from absl import app, flags

from osdn_jax import cli


METRICS = "metrics.jsonl"
SCALARS = (("loss", "loss", "linear"), ("lr", "learning rate", "linear"), ("grad_norm", "gradient norm", "log"),
           ("tokens_per_s", "throughput (tokens/s)", "linear"))
LAYERED = (("q_geo", "q_geo per layer"), ("state_norm", "‖S‖ per layer"))
LINESTYLES = ("-", "--", ":", "-.")


def read_metrics(run_dir) -> list[dict]:
  """The logged rows of a run, by increasing step; for a step logged more than once, its last line.

  Raises FileNotFoundError when `run_dir` has no metrics.jsonl, ValueError when it holds no rows or a line that
  is not a JSON object with an integer `step` (both messages name the file)."""
  path = pathlib.Path(run_dir) / METRICS
  if not path.is_file():
    raise FileNotFoundError(f"no metrics file: {path} does not exist (is {run_dir} a training run directory?)")
  rows = {}
  with path.open() as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}, line {number}: not JSON ({e})") from None
      if not isinstance(row, dict) or not isinstance(row.get("step"), int):
        raise ValueError(f"{path}, line {number}: not a JSON object with an integer 'step'")
      rows[row["step"]] = row
  if not rows:
    raise ValueError(f"empty metrics file: {path} holds no logged steps")
  return [rows[s] for s in sorted(rows)]


def _names(run_dirs) -> list[str]:
  """Each run's directory name; where runs share it, as many trailing path components as tell them apart."""
  parts = [pathlib.Path(d).resolve().parts for d in run_dirs]
  depths = [1] * len(parts)
  while True:
    names = ["/".join(p[-n:]) for p, n in zip(parts, depths)]
    clash = [i for i, name in enumerate(names) if names.count(name) > 1 and depths[i] < len(parts[i])]
    if not clash:
      return names
    for i in clash:
      depths[i] += 1


def _column(rows, key) -> list[float]:
  return [float(r[key]) if r.get(key) is not None else math.nan for r in rows]


def _layers(rows, key):
  """(steps, one list of values per layer) over the rows that logged `key`; shorter lists are padded with NaN."""
  logged = [r for r in rows if isinstance(r.get(key), list)]
  width = max((len(r[key]) for r in logged), default=0)
  steps = [r["step"] for r in logged]
  values = [[float(r[key][i]) if i < len(r[key]) and r[key][i] is not None else math.nan for r in logged]
            for i in range(width)]
  return steps, values


def plot(run_dirs: list[str], out: str) -> str:
  """Draws the runs in `run_dirs` (overlaid) into the PNG `out`; returns the path written."""
  import matplotlib
  from matplotlib import cm, colors
  from matplotlib.figure import Figure   # a bare Figure renders with Agg and needs no display or pyplot state
  from matplotlib.lines import Line2D
  from matplotlib.ticker import MaxNLocator

  if not run_dirs:
    raise ValueError("no run directories to plot")
  runs = [read_metrics(d) for d in run_dirs]
  names = _names(run_dirs)
  layered = [key for key, _ in LAYERED if any(isinstance(r.get(key), list) for rows in runs for r in rows)]
  panels = len(SCALARS) + len(layered)
  nrows = (panels + 1) // 2
  fig = Figure(figsize=(12, 3.6 * nrows), layout="constrained")
  axes = fig.subplots(nrows, 2, squeeze=False).ravel()
  for ax in axes[panels:]:
    ax.set_visible(False)
  run_colors = [f"C{i % 10}" for i in range(len(runs))]
  if len(runs) == 1:
    fig.suptitle(names[0])

  for ax, (key, title, scale) in zip(axes, SCALARS):
    for rows, name, color in zip(runs, names, run_colors):
      if key == "loss" and (held := [r for r in rows if "eval_loss" in r]):
        ax.plot([r["step"] for r in held], _column(held, "eval_loss"), color=color, ls="--", marker="o", ms=3,
                lw=1.0, label=f"{name} (held-out)")
      logged = [r for r in rows if key in r]      # an evaluation's own line holds no training values
      if not logged:
        continue
      steps, values = [r["step"] for r in logged], _column(logged, key)
      ax.plot(steps, values, color=color, label=name, lw=1.2, marker="." if len(steps) < 50 else None)
      if key == "tokens_per_s" and math.isfinite(values[0]):
        ax.plot(steps[:1], values[:1], "o", mfc="none", color=color, ms=7)
    if key == "tokens_per_s":
      title += "  (○ first point includes compilation)"
    ax.set(title=title, xlabel="step", yscale=scale)
    ax.grid(True, alpha=0.3, which="both" if scale == "log" else "major")
    if len(runs) > 1 or key == "loss":
      ax.legend(fontsize="small")

  for ax, key in zip(axes[len(SCALARS):], layered):
    per_run = [_layers(rows, key) for rows in runs]
    width = max(len(values) for _, values in per_run)
    norm = colors.Normalize(vmin=0, vmax=max(width - 1, 1))
    cmap = matplotlib.colormaps["viridis"]
    for (steps, values), style in zip(per_run, LINESTYLES * len(runs)):
      for layer, series in enumerate(values):
        ax.plot(steps, series, color=cmap(norm(layer)), ls=style, lw=1.0, marker="." if len(steps) < 50 else None)
    ax.set(title=dict(LAYERED)[key], xlabel="step")
    ax.grid(True, alpha=0.3)
    if width > 1:
      bar = fig.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, pad=0.01)
      bar.set_label("layer")
      bar.locator = MaxNLocator(integer=True)
      bar.update_ticks()
    if len(runs) > 1:
      handles = [Line2D([], [], color="k", ls=style, label=name) for name, style in zip(names, LINESTYLES * len(runs))]
      ax.legend(handles=handles, fontsize="small")

  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, format="png", dpi=100)
  return str(out)


def main(argv):
  run_dirs = argv[1:]
  if not run_dirs:
    raise app.UsageError("give one or more run directories: python -m experiments.plot_run DIR [DIR ...]")
  out = flags.FLAGS.out
  if out is None:
    if len(run_dirs) > 1:
      raise app.UsageError("several runs need --out=FILE.png")
    out = str(pathlib.Path(run_dirs[0]) / "run.png")
  print(plot(run_dirs, out))


if __name__ == "__main__":
  # Defined here, not at import, so that importing `plot` beside other absl programs defines no flag.
  flags.DEFINE_string("out", None, "the PNG to write (default DIR/run.png for one run; required for several)")
  cli.run(main)
