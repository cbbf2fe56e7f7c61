"""What the experiments share: variant names, training a variant with the trainer, scoring recall, writing
results (JSON, a markdown table, a PNG) and the progress bar.

A variant is a registry point's name with optional preconditioner options after a colon, e.g. "pdn",
"osdn-apf:apf_anchor=init", "pdn:x=4.0"; any point `dgps.register` adds joins by its name.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import config
from osdn_jax import data as data_lib
from osdn_jax import dgps, plugins, train
from osdn_jax.data import IGNORE
from osdn_jax.train.checkpoints import quiet_checkpoint_logs
from osdn_jax.train.step import scored_positions

# The points every experiment compares by default: the DeltaNet backbones and their preconditioned forms, OSDN-APF
# with both anchors, and the `dn-fixed-d` control (a learned constant write scale in place of OSDN's online one).
VARIANTS = ("dn", "pdn", "osdn", "osdn-apf", "osdn-apf:apf_anchor=init", "dn-fixed-d", "gdn", "pgdn", "osdn-gdn",
            "kda", "pkda", "osdn-kda")


def parse_variant(spec: str) -> tuple[str, dict]:
  """"name[:option=value,...]" → (registry name, options); values are parsed as JSON where they can be
  (numbers, true/false), else kept as strings. ValueError for an unknown point or option."""
  name, _, rest = spec.partition(":")
  options = {}
  for item in filter(None, rest.split(",")):
    key, eq, value = item.partition("=")
    if not eq:
      raise ValueError(f"variant {spec!r}: options are written option=value, got {item!r}")
    try:
      options[key.strip()] = json.loads(value)
    except json.JSONDecodeError:
      options[key.strip()] = value.strip()
  dgps.get(name, **options)   # raises for an unknown point or option
  return name.lower(), options


def check_variants(variants) -> None:
  """ValueError naming the first variant `parse_variant` refuses: for settings checked before anything trains."""
  for spec in variants:
    parse_variant(spec)


def check_implementation(name: str) -> None:
  """ValueError naming `implementation` unless `name` is one of the ops' implementations (`dispatch.NAMES`)."""
  from osdn_jax.ops import dispatch
  if name not in dispatch.NAMES:
    raise ValueError(f"`implementation` {name!r} is not one of {', '.join(dispatch.NAMES)}")


def variant_config(base, spec: str, size: str):
  """A copy of the trainer config `base` that trains variant `spec` at model size `size`."""
  name, options = parse_variant(spec)
  config = base.copy_and_resolve_references()
  config.model = f"{name}-{size}"
  config.point_options = options
  return config


def config_digest(config) -> str:
  """8 hex digits naming a trainer config: every field (steps, rows, seed, dtype, data, optimiser, ...)."""
  return hashlib.sha256(config.to_json(sort_keys=True).encode()).hexdigest()[:8]


def run_dir(config, workdir) -> pathlib.Path:
  """Where `fit` trains `config` for `workdir`: workdir-<config_digest>, so a finished run is reused (and a stopped
  one resumed) only by the same config; another step count, dtype, seed or data setting trains anew."""
  workdir = pathlib.Path(workdir)
  return workdir.with_name(f"{workdir.name}-{config_digest(config)}")


def fit(config, workdir=None) -> train.TrainResult:
  """Trains `config` with the trainer in `run_dir(config, workdir)`, or in a temporary directory removed
  afterwards."""
  quiet_checkpoint_logs()
  if workdir is not None:
    return train.run(config, run_dir(config, workdir))
  with tempfile.TemporaryDirectory(prefix="osdn-experiment-") as tmp:
    return train.run(config, tmp)


def recall_accuracy(model, source, *, num_examples: int, batch_size: int = 64) -> float:
  """The fraction of scored positions (labels ≠ IGNORE) of records 0 … num_examples − 1 of `source` (a recall
  source: dicts of "inputs" and "labels") whose greedy prediction is the label."""
  correct = total = 0
  graph, state = nnx.split(model)
  for start in range(0, num_examples, batch_size):
    rows = [source[i] for i in range(start, min(start + batch_size, num_examples))]
    tokens = np.stack([r["inputs"] for r in rows])
    labels = np.stack([r["labels"] for r in rows])
    positions = int(np.max(np.sum(labels != IGNORE, axis=1)))
    c, m = _score(graph, state, jnp.asarray(tokens), jnp.asarray(labels), positions)
    correct += int(np.sum(np.asarray(c) & np.asarray(m)))
    total += int(np.sum(np.asarray(m)))
  return correct / max(total, 1)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _score(graph, state, tokens, labels, positions):
  """(correct, scored) [B, positions] at the first `positions` scored positions of each row."""
  model = nnx.merge(graph, state)
  mask = labels != IGNORE
  at = scored_positions(mask, positions)
  hidden = jnp.take_along_axis(model.hidden(tokens), at[..., None], axis=1)
  logits = jnp.einsum("bpd,vd->bpv", hidden, model.embed[...].astype(hidden.dtype))
  return jnp.argmax(logits, -1) == jnp.take_along_axis(labels, at, axis=1), jnp.take_along_axis(mask, at, axis=1)


def validation_tokens(config, rows: int):
  """tokens [rows, config.seq_len] of the text corpus's validation split (one fixed draw) for trainer config
  `config` (its data settings: tokenizer, vocabulary)."""
  pipe = data_lib.make_pipeline(dict(config.data, split="validation", prefetch=0), seq_len=config.seq_len,
                                batch_size=rows, seed=12345)
  try:
    return next(pipe)["tokens"]
  finally:
    pipe.close()


def last_logged(workdir, key: str):
  """The value of `key` in the last row of a run's metrics.jsonl that has it (None if none does)."""
  from experiments.plot_run import read_metrics
  values = [row[key] for row in read_metrics(workdir) if key in row]
  return values[-1] if values else None


def layer_diagnostics(model, tokens, weights=None) -> dict[str, list[float]]:
  """Per-layer q_geo, ‖S_T‖ and recall residual (`LanguageModel.diagnostics`) on tokens [B, T], as lists."""
  graph, state = nnx.split(model)
  out = _diagnostics_jit(graph, state, jnp.asarray(tokens), None if weights is None else jnp.asarray(weights))
  return {k: [float(x) for x in np.asarray(v)] for k, v in out.items()}


@functools.partial(jax.jit, static_argnums=0)
def _diagnostics_jit(graph, state, tokens, weights):
  return nnx.merge(graph, state).diagnostics(tokens, weights)


def geometric_mean(values) -> float:
  values = [v for v in values if v is not None and math.isfinite(v)]
  return float(np.exp(np.mean(np.log(np.maximum(values, 1e-30))))) if values else float("nan")


# --- output --------------------------------------------------------------------------------------------------------

def markdown_table(header: list[str], rows: list[list]) -> str:
  """A GitHub markdown table; floats are printed with 3 significant digits, None as "–"."""
  def cell(x):
    if x is None:
      return "–"
    if isinstance(x, float):
      return "nan" if math.isnan(x) else f"{x:.3g}"
    return str(x)
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
  return "\n".join(lines) + "\n"


def command(name: str, spec, *, skip=()) -> str:
  """The command that reruns an experiment with settings `spec` (its dataclass, whose fields are its
  --config.FIELD overrides, `experiments.config`): every field that differs from the dataclass's default, after
  --imports= the modules this process imported for their points (`osdn_jax.plugins`), if any. skip: fields left
  out (dotted paths for a section's)."""
  parts = ["python -m experiments." + name]
  if plugins.imported():   # the variants may name their points
    parts.append("--imports=" + ",".join(plugins.imported()))
  parts += [o for o in config.overrides(spec) if o.split("=", 1)[0].removeprefix(f"--{config.NAME}.") not in skip]
  return " ".join(parts)


def define_flags(defaults, *, merge: str | None = None) -> None:
  """An experiment's flags: --imports, --smoke (the CI size), --out, --merge (when `merge` names its result file:
  parts of one comparison reported together) and `defaults`'s fields as --config.FIELD (`experiments.config`)."""
  from absl import flags
  plugins.define_imports_flag()
  flags.DEFINE_bool("smoke", False, "the CI size (the settings are the module's SMOKE)")
  flags.DEFINE_string("out", "results", "output directory")
  if merge:
    flags.DEFINE_list("merge", [], f"{merge} files of parts of one comparison: report them together, training "
                      "nothing")
  config.define(defaults)


def write_results(out_dir, name: str, payload: dict, table: str, figure=None, *, command: str | None = None,
                  provenance: dict | None = None) -> dict[str, pathlib.Path]:
  """Writes out_dir/<name>.json (payload, with the command that reruns it, the device, the jax version and the
  date), <name>.md (table) and <name>.png (figure, a matplotlib Figure, if given); returns their paths.
  command: default this process's command line without --out; provenance: device, jax and date when the runs were made
  elsewhere (a report merged from parts)."""
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  where = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, date=time.strftime("%Y-%m-%d"))
  where.update({k: v for k, v in (provenance or {}).items() if k in where})
  if command is None:   # this process's flags, without where it writes
    command = " ".join(["python -m experiments." + name] + [a for a in sys.argv[1:] if not a.startswith("--out")])
  payload = dict(payload, command=command, **where)
  paths = {"json": out / f"{name}.json", "md": out / f"{name}.md"}
  paths["json"].write_text(json.dumps(payload, indent=1, default=jsonable) + "\n")
  paths["md"].write_text(table)
  if figure is not None:
    paths["png"] = out / f"{name}.png"
    figure.savefig(paths["png"], dpi=110, bbox_inches="tight")
  return paths


def read_results(paths) -> list[dict]:
  """The payloads of result files written by `write_results` (e.g. the parts of a sweep run in parallel)."""
  return [json.loads(pathlib.Path(p).read_text()) for p in paths]


def merge_parts(paths, spec_type, upgrade=None):
  """(settings, rows, provenance) of the result files of parts of one comparison (e.g. one process per variant):
  the settings are the first part's (a `spec_type` dataclass; `upgrade` maps the fields a file holds to the
  current ones) with the union of the parts' variants, the rows all parts' rows, the provenance (device, jax,
  date) the first part's. Settings with `seeds`: a row without a seed is its own file's first seed, and the
  merged `seeds` are the rows' seeds."""
  payloads = read_results(paths)
  fields = [{k: tuple(v) if isinstance(v, list) else v for k, v in p["spec"].items()} for p in payloads]
  if upgrade is not None:
    fields = [upgrade(f) for f in fields]
  rows = [r for p in payloads for r in p["rows"]]
  merged = dict(fields[0], variants=union(p["spec"]["variants"] for p in payloads))
  if "seeds" in merged:
    rows = [dict(r, seed=r.get("seed", f["seeds"][0])) for p, f in zip(payloads, fields) for r in p["rows"]]
    merged["seeds"] = tuple(sorted({r["seed"] for r in rows}))
  return spec_type(**merged), rows, payloads[0]


def seed_to_seeds(fields: dict) -> dict:
  """`merge_parts`'s upgrade for the settings of a file written with one `seed`: that seed as `seeds`."""
  if "seed" in fields:
    fields = dict(fields, seeds=(fields.pop("seed"),))
  return fields


def union(lists) -> tuple:
  """The distinct items of several sequences, in first-seen order."""
  return tuple(dict.fromkeys(x for items in lists for x in items))


def jsonable(x):
  """`json.dumps`'s `default` for results holding numpy scalars and arrays (as Python numbers and lists)."""
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  raise TypeError(f"cannot write {type(x).__name__} to JSON")


def figure(rows: int = 1, cols: int = 1, *, width: float = 5.0, height: float = 3.6):
  """(Figure, axes [rows, cols]) made without pyplot, so no backend is switched (notebooks keep theirs)."""
  from matplotlib.figure import Figure
  fig = Figure(figsize=(width * cols, height * rows))
  return fig, fig.subplots(rows, cols, squeeze=False)


def progress(total: int, desc: str):
  """A tqdm bar over the runs of an experiment (to stderr; quiet when OSDN_PROGRESS=0)."""
  from tqdm import tqdm
  return tqdm(total=total, desc=desc, unit="run", disable=os.environ.get("OSDN_PROGRESS") == "0",
              dynamic_ncols=True)


def enable_compilation_cache(directory) -> None:
  """Turns on JAX's persistent compilation cache for the rest of the process, in $OSDN_COMPILATION_CACHE if that
  is set, else in `directory`, unless a cache is already configured: runs that differ only in their data or
  seeds (e.g. the MQAR cells of one length) then compile their step once."""
  if jax.config.jax_compilation_cache_dir:
    return
  directory = os.environ.get("OSDN_COMPILATION_CACHE") or directory
  pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(directory))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
