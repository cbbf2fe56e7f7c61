"""The MQAR grid as resumable cells, several cells trained side by side in one program.

A cell is one (variant, L, kv, learning rate, seed) at one protocol (steps, rows per step, vocabulary, model size,
training and test rows, dtype, implementation). Its result is one JSON file, `OUT/<name>.json`, holding the cell,
its test accuracy, its learning curve (training loss and test accuracy every `eval_every` steps) and the model's
per-layer q_geo and recall residual. Rerunning a sweep skips every cell whose file exists with the same protocol, so
a grid larger than one run's GPU time fills in over several runs; a group stopped midway resumes from its state
saved under OUT/partial/ at its last curve point (the trainer's checkpoints, `osdn_jax.train.checkpoints`; on the
machine that saved it: the state is not committed). `--report` merges every cell file of OUT into one table per cut
and protocol, one figure of the cuts (grid.png) and the learning curves (curves.png) of the main protocol.

The cells of one (variant, L, kv) — the learning rates and seeds — train together: their parameters and optimiser
states are stacked on a leading cell axis and one jitted `lax.scan` runs `chunk_steps` steps of all of them
(`jax.vmap` over the trainer's own step, `osdn_jax.train.step.make_train_step`, with the trainer's optimiser
`osdn_jax.train.optim.make` at each cell's learning rate and the trainer's loss on the scored positions; groups of
one model and protocol share that program within a process, `_programs`). The training rows live on the device (zoology's generator, `osdn_jax.data.MQARSource`, seeded by the cell's seed as the
trainer seeds it), and each step's rows are drawn from them with replacement (`--order=replacement`, the default) or
in a new permutation every epoch (`--order=epoch`); docs/experiments.md says why the order matters.

  python -m experiments.grid --config.cut=c --config.variants=dn,pdn,gdn,pgdn --config.seeds=0,1   # the missing cells
  python -m experiments.grid --config.variants=dn --config.budget_s=600     # stop starting groups after 10 min
  python -m experiments.grid --report                                       # tables and figure from OUT
  python -m experiments.grid --smoke                                        # the CI size, seconds on a CPU

The settings are `Grid`'s fields (the protocol's, then which cells and how), each `--config.FIELD=VALUE`
(`experiments.config`); the short spelling `--FIELD=VALUE` (`--pairs=1024:32 --steps=1500`) is the same override.

The cuts are the PDN paper's: (a) kv = 64, L ∈ {256, 512, 1024, 2048}; (b) kv : L = 1 : 8; (c) L = 1024,
kv ∈ {32, 64, 128, 256}.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import pathlib
import shutil
import tempfile
import time
from concurrent import futures

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import flags
from flax import nnx

from experiments import common, config, mqar
from osdn_jax import cli, plugins
from osdn_jax.data import MQARSource
from osdn_jax.data.recall import IGNORE
from osdn_jax.train import loop, optim
from osdn_jax.train.checkpoints import DAMAGED, Checkpoints, quiet_checkpoint_logs
from osdn_jax.train.step import graphdef, init_state, make_train_step, scored_positions

CUTS = {
    "a": ((256, 64), (512, 64), (1024, 64), (2048, 64)),
    "b": ((256, 32), (512, 64), (1024, 128), (2048, 256)),
    "c": ((1024, 32), (1024, 64), (1024, 128), (1024, 256)),
}
# The PDN paper's MQAR accuracies (%) for cut (c), kv = 32, 64, 128, 256 at L = 1024.
PAPER_C = {"dn": (99, 99, 85, 46), "pdn": (99, 98, 97, 49), "gdn": (96, 0, 70, 0), "pgdn": (99, 98, 65, 29)}


@dataclasses.dataclass(frozen=True)
class Protocol:
  """What every cell of a sweep shares. A finished cell is reused only when all of it matches. The defaults are the
  MQAR protocol (docs/experiments.md): 3000 steps of 64 rows drawn with replacement from 20,000 distinct rows."""
  steps: int = 3000
  batch_size: int = 64
  vocab_size: int = 8192
  size: str = "mqar"
  train_examples: int = 20_000
  test_examples: int = 1000
  dtype: str = "float32"
  implementation: str = "auto"
  eval_every: int = 500
  reads: int = 1
  order: str = "replacement"

  def __post_init__(self):
    if self.order not in ORDERS:
      raise ValueError(f"Protocol: `order` must be one of {ORDERS}, got {self.order!r}")

  def identity(self) -> dict:
    """The fields a cell's file name hashes: every field, less `order` at "epoch" (a cell file whose protocol has
    no `order` holds an epoch-order cell, and its name is this hash)."""
    fields = dataclasses.asdict(self)
    if fields["order"] == "epoch":
      del fields["order"]
    return fields

  def sweep(self, variant: str, length: int, kv: int) -> mqar.Sweep:
    """The `experiments.mqar` sweep whose trainer config this cell trains (one length, one kv)."""
    return mqar.Sweep(variants=(variant,), lengths=(length,), kv=(kv,), lrs=(1e-3,), steps=self.steps,
                      batch_size=self.batch_size, size=self.size, vocab_size=self.vocab_size,
                      train_examples=self.train_examples, test_examples=self.test_examples,
                      implementation=self.implementation, dtype=self.dtype, reads=self.reads, order=self.order)


@dataclasses.dataclass(frozen=True)
class Cell:
  variant: str
  length: int
  kv: int
  lr: float
  seed: int

  def name(self, protocol: Protocol) -> str:
    """A file name that says the cell and hashes the whole protocol."""
    identity = json.dumps([dataclasses.asdict(self), protocol.identity()], sort_keys=True)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:8]
    return f"{mqar.run_name(self.variant, self.length, self.kv, self.lr, protocol.reads)}_s{self.seed}_{digest}"


def cells_of(variants, pairs, lrs, seeds) -> list[Cell]:
  return [Cell(v, length, kv, float(lr), int(s)) for v in variants for length, kv in pairs for lr in lrs
          for s in seeds]


def done(out, protocol: Protocol, cell: Cell) -> bool:
  path = pathlib.Path(out) / f"{cell.name(protocol)}.json"
  if not path.is_file():
    return False
  saved = _read_cell(path)
  return (saved is not None and saved.get("cell") == dataclasses.asdict(cell)
          and saved.get("protocol") == dataclasses.asdict(protocol))


def _set_aside(path: pathlib.Path, why, log=print) -> pathlib.Path:
  """Renames a damaged file to `<name>.damaged[-n]` beside it (kept for inspection) and says so."""
  target, n = path.with_name(path.name + ".damaged"), 1
  while target.exists():
    target, n = path.with_name(f"{path.name}.damaged-{n}"), n + 1
  path.replace(target)
  log(f"warning: {path} is damaged ({why}); moved to {target.name}")
  return target


def _read_cell(path: pathlib.Path, log=print) -> dict | None:
  """A cell file's result (`_with_order`), or None for a file that is not one (a result file of another kind);
  a file that cannot be read as JSON is damaged: set aside, None."""
  try:
    result = json.loads(path.read_text())
  except (ValueError, UnicodeDecodeError) as e:
    _set_aside(path, e, log)
    return None
  return _with_order(result) if isinstance(result, dict) else None


def _with_order(result: dict) -> dict:
  """A cell file's result with its protocol's `order` filled in ("epoch" where the file's protocol has none)."""
  if isinstance(result.get("protocol"), dict):
    result["protocol"] = {"order": "epoch", **result["protocol"]}
  return result


# --- data -----------------------------------------------------------------------------------------------------------

def _rows(source: MQARSource, start: int, stop: int):
  rows = [source[i] for i in range(start, stop)]
  return np.stack([r["inputs"] for r in rows]), np.stack([r["labels"] for r in rows])


def mqar_rows(source: MQARSource, count: int, workers: int = 0):
  """(inputs, labels) int32 [count, L] of records 0 … count − 1, drawn in `workers` processes (0: here)."""
  if workers <= 1 or count < 4096:
    return _rows(source, 0, count)
  bounds = np.linspace(0, count, workers + 1).astype(int)
  with futures.ProcessPoolExecutor(workers) as pool:
    parts = list(pool.map(_rows, [source] * workers, bounds[:-1], bounds[1:]))
  return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def epoch_order(seed: int, rows: int, steps: int, batch: int) -> np.ndarray:
  """int32 [steps, batch]: the rows of each step, a new permutation of all rows every epoch (batches do not span
  epochs; a last partial batch of an epoch is dropped)."""
  per_epoch = rows // batch
  rng = np.random.default_rng([seed, 0x6D71])
  epochs = -(-steps // per_epoch)
  order = np.concatenate([rng.permutation(rows)[:per_epoch * batch] for _ in range(epochs)])
  return order[:steps * batch].reshape(steps, batch).astype(np.int32)


def replacement_order(seed: int, rows: int, steps: int, batch: int) -> np.ndarray:
  """int32 [steps, batch]: the rows of each step, each drawn uniformly from all rows, independently of every other
  draw (with replacement: a row may recur at any distance, within a batch too)."""
  rng = np.random.default_rng([seed, 0x7277])
  return rng.integers(0, rows, (steps, batch), dtype=np.int64).astype(np.int32)


ORDERS = ("epoch", "replacement")


def row_order(order: str, seed: int, rows: int, steps: int, batch: int) -> np.ndarray:
  """int32 [steps, batch]: the training rows of each step in the named order ("epoch": `epoch_order`,
  "replacement": `replacement_order`)."""
  if order == "epoch":
    return epoch_order(seed, rows, steps, batch)
  if order == "replacement":
    return replacement_order(seed, rows, steps, batch)
  raise ValueError(f"row_order: `order` must be one of {ORDERS}, got {order!r}")


def _batch(tokens, labels, rows):
  """The trainer's batch (`osdn_jax.data.pipeline`) of rows [B] of tokens/labels [N, L]."""
  x, y = tokens[rows].astype(jnp.int32), labels[rows].astype(jnp.int32)
  scored = y != IGNORE
  return {"tokens": x, "targets": jnp.where(scored, y, 0), "segment_ids": jnp.zeros_like(x),
          "loss_mask": scored.astype(jnp.float32)}


# --- training -------------------------------------------------------------------------------------------------------

def _stack(trees):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _unstack(tree, i):
  return jax.tree.map(lambda x: x[i], tree)


def _compile(graph, make, positions: int):
  """The group's jitted programs: chunk (states, lrs, tokens, labels, rows [n, cells, batch]) → (states, losses
  [n, cells]), n steps of every cell (`make(lr)` its optimiser; the states donated); and accuracy (params, tokens,
  labels [cells, N, L]) → (correct, scored) [cells] at the first `positions` scored positions of each row."""

  def cell_step(state, batch, lr):
    step = make_train_step(graph, make(lr), loss_chunk=positions, loss_positions=positions)
    return step(state, batch, segments_per_row=1)   # one sequence per row: the unpacked solves

  def chunk(states, lrs, tokens, labels, order):
    def body(states, rows):
      batch = jax.vmap(_batch)(tokens, labels, rows)
      states, metrics = jax.vmap(cell_step)(states, batch, lrs)
      return states, metrics["loss"]
    return jax.lax.scan(body, states, order)

  def cell_accuracy(params, tokens, labels):
    model = nnx.merge(graph, params)
    batch = _batch(tokens, labels, jnp.arange(tokens.shape[0]))
    at = scored_positions(batch["loss_mask"], positions)
    hidden = jnp.take_along_axis(model.hidden(batch["tokens"]), at[..., None], axis=1)
    logits = jnp.einsum("bpd,vd->bpv", hidden, params["embed"].astype(hidden.dtype))
    target = jnp.take_along_axis(batch["targets"], at, axis=1)
    mask = jnp.take_along_axis(batch["loss_mask"], at, axis=1)
    return jnp.sum((jnp.argmax(logits, -1) == target) * mask), jnp.sum(mask)

  return jax.jit(chunk, donate_argnums=0), jax.jit(jax.vmap(cell_accuracy))


@functools.lru_cache(maxsize=8)
def _programs(graph, optimizer_json: str, steps: int, positions: int):
  """`_compile` with the trainer's optimiser (`optim.make_at` of the config `optimizer_json` over `steps`), shared by
  the groups of one model and protocol in a process (jax.jit compiles each once per shape)."""
  opt = ml_collections.ConfigDict(json.loads(optimizer_json))
  return _compile(graph, lambda lr: optim.make_at(opt, steps, lr), positions)


class Group:
  """The cells of one (variant, L, kv) at one protocol, trained side by side (module docstring)."""

  def __init__(self, protocol: Protocol, cells: list[Cell], *, chunk_steps: int = 250, workers: int = 0,
               optimizer=None):
    """optimizer: lr → optax transformation whose state's structure does not depend on lr (default: the trainer's,
    `optim.make_at` of the cell config's optimizer); a check trains the cells with another one."""
    first = cells[0]
    assert all((c.variant, c.length, c.kv) == (first.variant, first.length, first.kv) for c in cells)
    self.protocol, self.cells = protocol, cells
    sweep = protocol.sweep(first.variant, first.length, first.kv)
    self.config = sweep.config(first.variant, first.length, first.kv, first.lr)
    self.model_cfg = loop.model_config(self.config, protocol.vocab_size)
    self.graph = graphdef(self.model_cfg)
    self.chunk_steps = math.gcd(chunk_steps, protocol.eval_every, protocol.steps)
    opt, steps = self.config.optimizer, protocol.steps
    self.make_optimizer = optimizer or (lambda lr: optim.make_at(opt, steps, lr))
    if optimizer is None:       # the trainer's optimiser: one program per (model, optimiser config, steps, positions)
      self.chunk, self._accuracy = _programs(self.graph, opt.to_json(), steps, self.config.loss_positions)
    else:
      self.chunk, self._accuracy = _compile(self.graph, self.make_optimizer, self.config.loss_positions)
    seeds = sorted({c.seed for c in cells})
    self.data = {}   # seed → ((train inputs, labels), (test inputs, labels)), int32 [rows, L] each
    for s in seeds:
      train = MQARSource(vocab_size=protocol.vocab_size, length=first.length, num_pairs=first.kv,
                         num_records=protocol.train_examples, seed=s, power_a=self.config.data.mqar_power,
                         context_reads=protocol.reads)
      test = MQARSource(vocab_size=protocol.vocab_size, length=first.length, num_pairs=first.kv,
                        num_records=protocol.test_examples, seed=s + 1_000_003, power_a=self.config.data.mqar_power,
                        context_reads=protocol.reads)
      self.data[s] = (mqar_rows(train, protocol.train_examples, workers), mqar_rows(test, protocol.test_examples))
    self.small = np.int16 if protocol.vocab_size < 2**15 else np.int32

  def accuracy(self, states, tests) -> np.ndarray:
    correct = total = 0
    n = tests[0].shape[1]
    piece = min(n, 250)
    for start in range(0, n, piece):
      c, t = self._accuracy(states["params"], tests[0][:, start:start + piece], tests[1][:, start:start + piece])
      correct, total = correct + np.asarray(c), total + np.asarray(t)
    return correct / np.maximum(total, 1)

  def start(self):
    """What training starts from: (stacked initial states, training tokens and labels [cells, rows, L] on the
    device, the rows of every step int32 [steps, cells, batch], the learning rates [cells])."""
    p, cells = self.protocol, self.cells
    tx = self.make_optimizer(1.0)
    states = jax.jit(lambda: _stack([init_state(self.model_cfg, tx, c.seed) for c in cells]))()
    put = lambda arrays: jnp.asarray(np.stack([a.astype(self.small) for a in arrays]))
    tokens = put([self.data[c.seed][0][0] for c in cells])
    labels = put([self.data[c.seed][0][1] for c in cells])
    orders = np.stack([row_order(p.order, c.seed, p.train_examples, p.steps, p.batch_size) for c in cells], axis=1)
    return states, tokens, labels, orders, jnp.asarray([c.lr for c in cells], jnp.float32)

  def losses(self, steps: int) -> np.ndarray:
    """The training loss of each of the first `steps` steps (a multiple of chunk_steps) of every cell, float32
    [steps, cells], from fresh states (no checkpoint, no evaluation)."""
    states, tokens, labels, orders, lrs = self.start()
    out = []
    for step in range(0, steps, self.chunk_steps):
      states, loss = self.chunk(states, lrs, tokens, labels, jnp.asarray(orders[step:step + self.chunk_steps]))
      out.append(np.asarray(loss))
    return np.concatenate(out)

  def run(self, log=print, partial: pathlib.Path | None = None, keep=None) -> list[dict]:
    """Trains the cells; returns one result dict per cell. partial: a directory where the group's state
    (parameters, optimiser state, step and curves) is saved at every point of the learning curve with the trainer's
    checkpoints (`osdn_jax.train.checkpoints`: written whole, checksummed) and resumed from when it is there (a
    stopped run loses at most eval_every steps); removed when the group ends, after `keep(results)` has returned
    (where the caller writes them: a run killed in between leaves the saved state, never neither)."""
    p, cells = self.protocol, self.cells
    states, tokens, labels, orders, lrs = self.start()
    put = lambda arrays: jnp.asarray(np.stack([a.astype(self.small) for a in arrays]))
    tests = (put([self.data[c.seed][1][0] for c in cells]), put([self.data[c.seed][1][1] for c in cells]))
    curves = [[] for _ in cells]
    losses, step, times = [], 0, []
    store = None
    if partial is not None:
      quiet_checkpoint_logs()
      store = Checkpoints(pathlib.Path(partial).absolute(), keep=1, async_save=False)
      _name_cells(store.directory, [c.name(p) for c in cells])
      if (saved := _restore(store, states, log)) is not None:
        states, step, curves = saved
        log(f"  resumed at step {step}")
      if not store.directory.is_dir():    # set aside whole: a new one
        store = Checkpoints(store.directory, keep=1, async_save=False)
    while step < p.steps:
      t0 = time.perf_counter()
      states, loss = self.chunk(states, lrs, tokens, labels, jnp.asarray(orders[step:step + self.chunk_steps]))
      loss = np.asarray(loss)
      times.append(time.perf_counter() - t0)
      losses.append(loss)
      step += self.chunk_steps
      if step % p.eval_every == 0 or step == p.steps:
        window = np.concatenate(losses)[-p.eval_every:]
        acc = self.accuracy(states, tests)
        for i, curve in enumerate(curves):
          curve.append(dict(step=step, loss=float(np.mean(window[:, i])), accuracy=float(acc[i])))
        if store is not None and step < p.steps:
          store.save(step, states, dict(curves=curves))
        log(f"  step {step}: " + ", ".join(f"lr {c.lr:g} s{c.seed} {100 * a:.1f}%" for c, a in zip(cells, acc)))
    # The first chunk of this process includes compilation: the rate is over the others when there are others.
    steady = times[1:] or times
    rate = self.chunk_steps * len(steady) / max(sum(steady), 1e-9)
    results = []
    for i, cell in enumerate(cells):
      params = _unstack(states["params"], i)
      model = nnx.merge(self.graph, params)
      tok, lab = self.data[cell.seed][1]
      rows = min(16, len(tok))
      context = np.zeros(tok[:rows].shape, np.float32)
      context[:, :2 * cell.kv * p.reads] = 1.0    # the kv block, every read of it
      diag = common.layer_diagnostics(model, tok[:rows], context)
      results.append(dict(cell=dataclasses.asdict(cell), protocol=dataclasses.asdict(p),
                          accuracy=curves[i][-1]["accuracy"], final_loss=curves[i][-1]["loss"], curve=curves[i],
                          q_geo=diag["q_geo"], recall_residual=diag["recall_residual"],
                          state_norm=diag["state_norm"], cells_in_program=len(cells),
                          steps_per_s=rate, cell_steps_per_s=rate * len(cells),
                          timed_steps=self.chunk_steps * len(steady)))
    if keep is not None:
      keep(results)
    if store is not None:
      store.close()
      _remove_saved(store.directory)
    return results


# A group's saved states being removed: each renamed to <group>-<name>.removing beside the group's directory (one
# atomic step) and deleted there, so a kill never leaves a half-deleted checkpoint where a run looks for one.
REMOVING = ".removing"
# Beside each group's directory, <group>.cells names its cells (one per line): the group ended once each has its file.
CELLS = ".cells"


def _name_cells(directory: pathlib.Path, names: list[str]) -> None:
  listing = directory.with_name(directory.name + CELLS)
  temporary = listing.with_name(listing.name + ".tmp")
  temporary.write_text("".join(f"{n}\n" for n in names))
  temporary.replace(listing)


def _remove_saved(directory: pathlib.Path) -> None:
  """Removes a group's saved states (`REMOVING`) and the list of its cells, keeping any state set aside as damaged
  (and then the group's directory)."""
  if directory.is_dir():
    for child in list(directory.iterdir()):
      if DAMAGED not in child.name:
        trash = directory.with_name(f"{directory.name}-{child.name}{REMOVING}")
        _delete(trash)
        child.replace(trash)
        _delete(trash)
    if not any(directory.iterdir()):
      directory.rmdir()
  directory.with_name(directory.name + CELLS).unlink(missing_ok=True)


def _delete(path: pathlib.Path) -> None:
  """Deletes a file or a directory tree, if there (another sweep on the same OUT may be deleting it too)."""
  if path.is_dir():
    shutil.rmtree(path, ignore_errors=True)
  else:
    path.unlink(missing_ok=True)


def _clear_ended(out: pathlib.Path) -> None:
  """Deletes under OUT/partial/ what a sweep killed while removing a group's saved state left: the renamed states
  (`REMOVING`), and the saved state of a group whose every cell has a readable file (killed between writing the
  cells and removing the state)."""
  partial = out / "partial"
  for trash in partial.glob(f"*{REMOVING}"):
    _delete(trash)
  for listing in partial.glob(f"*{CELLS}"):
    cells = [out / f"{name}.json" for name in listing.read_text().split()]
    if all(c.is_file() and _read_cell(c) is not None for c in cells):
      _remove_saved(listing.with_suffix(""))


def _restore(store: Checkpoints, like, log=print):
  """(states, step, curves) of the group's newest saved state in `store` that passes its checksums and holds
  states shaped like `like`, or None. A saved state that fails is damaged: moved aside (`Checkpoints.set_aside`)
  with a warning naming it; without an older one the group starts from step 0."""
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
  try:
    restored = store.restore_latest(abstract)
  except RuntimeError as e:     # none can be read into these states: the whole directory is set aside
    store.close()
    _set_aside(store.directory, cli.one_line(e), log)
    log(f"warning: the group's saved state {store.directory} is damaged; it restarts from step 0")
    return None
  for step, why in store.damaged:
    log(f"warning: the group's saved state {store.directory}/{step} is damaged ({why}); moved aside")
  store.set_aside()
  if restored is None:
    return None
  return restored.state, restored.step, restored.data_state["curves"]


def groups(cells: list[Cell]) -> list[list[Cell]]:
  """Cells grouped by (variant, L, kv), in first-seen order."""
  out = {}
  for c in cells:
    out.setdefault((c.variant, c.length, c.kv), []).append(c)
  return list(out.values())


def sweep(protocol: Protocol, cells: list[Cell], out, *, budget_s: float = 0.0, max_cells: int = 0,
          workers: int = 0, log=print) -> list[pathlib.Path]:
  """Trains every cell not yet in OUT, a group at a time, writing each cell's JSON when its group ends and the
  group's state under OUT/partial/ at every point of its learning curve (a stopped sweep resumes there).
  budget_s > 0: no group starts after that many seconds. max_cells > 0: at most that many cells in one program."""
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  _clear_ended(out)
  todo = [c for c in cells if not done(out, protocol, c)]
  log(f"{len(cells) - len(todo)} of {len(cells)} cells done; {len(todo)} to train")
  start, written = time.perf_counter(), []
  for group in groups(todo):
    parts = [group[i:i + max_cells] for i in range(0, len(group), max_cells)] if max_cells else [group]
    for part in parts:
      if budget_s and time.perf_counter() - start > budget_s:
        log("budget spent; stopping")
        return written
      c = part[0]
      log(f"{c.variant} L={c.length} kv={c.kv}: {len(part)} cells")
      prefix = out / "partial" / hashlib.sha256(" ".join(c.name(protocol) for c in part).encode()).hexdigest()[:12]
      where = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, date=time.strftime("%Y-%m-%d"))

      def write(results, part=part):
        for cell, result in zip(part, results):
          path = out / f"{cell.name(protocol)}.json"
          temporary = path.with_suffix(".json.tmp")      # written whole, then renamed: a kill leaves no torn cell
          temporary.write_text(json.dumps(dict(result, **where), indent=1, default=common.jsonable) + "\n")
          temporary.replace(path)
          written.append(path)
      results = Group(protocol, part, workers=workers).run(log=log, partial=prefix, keep=write)
      log(f"  {results[0]['steps_per_s']:.1f} steps/s of {len(part)} cells side by side: "
          f"{results[0]['cell_steps_per_s']:.0f} cell-steps/s (compilation excluded)")
  return written


# --- report ---------------------------------------------------------------------------------------------------------

def read_cells(out, log=print) -> list[dict]:
  """The result of every cell file in OUT (a damaged one is set aside with a warning: `_read_cell`)."""
  payloads = [_read_cell(p, log) for p in sorted(pathlib.Path(out).glob("*.json"))]
  return [r for r in payloads if r is not None and "cell" in r]


def best(results: list[dict]) -> dict:
  """{(variant, L, kv, protocol): the best learning rate's seeds}: per learning rate the mean accuracy over its
  seeds; the best mean wins (ties: the lower mean final loss). Value: dict(lr, mean, values [per seed], runs)."""
  by = {}
  for r in results:
    c = r["cell"]
    key = (c["variant"], c["length"], c["kv"], json.dumps(r["protocol"], sort_keys=True))
    by.setdefault(key, {}).setdefault(c["lr"], []).append(r)
  chosen = {}
  for key, per_lr in by.items():
    def score(lr):
      runs = per_lr[lr]
      return (np.mean([r["accuracy"] for r in runs]), -np.mean([r["final_loss"] for r in runs]))
    lr = max(per_lr, key=score)
    runs = sorted(per_lr[lr], key=lambda r: r["cell"]["seed"])
    chosen[key] = dict(lr=lr, mean=float(np.mean([r["accuracy"] for r in runs])),
                       values=[r["accuracy"] for r in runs], runs=runs, lrs=sorted(per_lr))
  return chosen


def _entry(b) -> str:
  if b is None:
    return "–"
  text = f"{100 * b['mean']:.1f}"
  if len(b["values"]) > 1:
    text += " (" + " / ".join(f"{100 * v:.1f}" for v in b["values"]) + ")"
  return text


def report(out, variants=None, log=print) -> str:
  """Markdown: for every protocol of the cells with reads = 1, one table per cut (best learning rate, mean over
  seeds with each seed's value in brackets; cut (c) with the PDN paper's values beside), the read-twice gains and
  the other cells; OUT/grid.png and OUT/curves.png of the main protocol. The main protocol is the one with the
  most cells among those drawing rows with replacement (else among all); it is reported first."""
  results = read_cells(out, log)
  if not results:
    return "no cells in " + str(out) + "\n"
  protocols = [json.dumps(r["protocol"], sort_keys=True) for r in results]
  once = [k for k in protocols if json.loads(k).get("reads", 1) == 1] or protocols
  ranked = sorted(set(once), key=lambda k: (json.loads(k)["order"] != "replacement", -once.count(k), k))
  variants = variants or common.union([[r["cell"]["variant"] for r in results]])
  chosen_by = {key: {k[:3]: v for k, v in best(results).items() if k[3] == key} for key in ranked}
  sections = [_protocol_section(results, json.loads(key), chosen_by[key], variants) for key in ranked]
  main = ranked[0]
  fig = _figure(chosen_by[main], variants)
  if fig is not None:
    fig.savefig(pathlib.Path(out) / "grid.png", dpi=110, bbox_inches="tight")
  curves = _curves([r for r, key in zip(results, protocols) if key == main], variants)
  curves.savefig(pathlib.Path(out) / "curves.png", dpi=110, bbox_inches="tight")
  return "\n".join(sections)


def describe(p: dict) -> str:
  """One line of a protocol's settings."""
  order = ("drawn with replacement" if p["order"] == "replacement" else "in epoch order (a new permutation every "
           "epoch)")
  return (f"{p['steps']} steps of {p['batch_size']} rows {order} from {p['train_examples']} distinct training rows, "
          f"model size `{p['size']}`, vocabulary {p['vocab_size']}, {p['dtype']}; accuracy (%) on "
          f"{p['test_examples']} test rows")


def _protocol_section(results: list[dict], p: dict, chosen: dict, variants) -> str:
  """The tables of one protocol's cells (`report`)."""
  text = [f"## {describe(p)}\n\nThe best learning rate per cell (by the mean over seeds; each seed's value in "
          "brackets). – : not run yet.\n"]
  for cut, pairs in CUTS.items():
    present = [v for v in variants if any((v, length, kv) in chosen for length, kv in pairs)]
    if not present:
      continue
    header = ["variant"] + [f"L={length} kv={kv}" for length, kv in pairs] + ["learning rates"]
    rows = []
    for v in present:
      row = [v] + [_entry(chosen.get((v, length, kv))) for length, kv in pairs]
      lrs = sorted({lr for length, kv in pairs if (v, length, kv) in chosen for lr in chosen[(v, length, kv)]["lrs"]})
      rows.append(row + [", ".join(f"{lr:g}" for lr in lrs)])
      if cut == "c" and v in PAPER_C:
        rows.append([f"{v} (paper)"] + [str(x) for x in PAPER_C[v]] + [""])
    text.append(f"Cut ({cut}):\n\n" + common.markdown_table(header, rows))
  twice = _read_twice(results, p)
  if twice:
    text.append(twice)
  in_cuts = {pair for pairs in CUTS.values() for pair in pairs}
  others = sorted({k[1:] for k in chosen} - in_cuts)
  if others:
    header = ["variant"] + [f"L={length} kv={kv}" for length, kv in others]
    rows = [[v] + [_entry(chosen.get((v, length, kv))) for length, kv in others] for v in variants
            if any((v,) + pair in chosen for pair in others)]
    text.append("Other cells:\n\n" + common.markdown_table(header, rows))
  return "\n".join(text)


def _read_twice(results: list[dict], main: dict) -> str:
  """A table of the cells run at reads 1 and 2 under the main protocol otherwise: the best learning rate's mean
  at each, and the gain of reading the kv block twice (points)."""
  def key(r, reads):
    return json.dumps(dict(r["protocol"], reads=reads), sort_keys=True)
  chosen = best(results)
  once = {k[:3]: v for k, v in chosen.items() if k[3] == key({"protocol": main}, 1)}
  twice = {k[:3]: v for k, v in chosen.items() if k[3] == key({"protocol": main}, 2)}
  both = [k for k in twice if k in once]
  if not both:
    return ""
  rows = [[v, f"{length}", f"{kv}", _entry(once[(v, length, kv)]), _entry(twice[(v, length, kv)]),
           f"{100 * (twice[(v, length, kv)]['mean'] - once[(v, length, kv)]['mean']):+.1f}"]
          for v, length, kv in sorted(both)]
  return "Read twice (the kv block read once, then twice):\n\n" + common.markdown_table(
      ["variant", "L", "kv", "once", "twice", "gain (points)"], rows)


def _figure(chosen, variants):
  cuts = [(cut, pairs) for cut, pairs in CUTS.items() if any(k[1:] in pairs for k in chosen)]
  if not cuts:
    return None
  fig, axes = common.figure(1, len(cuts), width=3.6, height=3.0)
  for ax, (cut, pairs) in zip(axes[0], cuts):
    x_of = (lambda length, kv: kv) if cut == "c" else (lambda length, kv: length)
    for v in variants:
      pts = [(x_of(length, kv), 100 * chosen[(v, length, kv)]["mean"]) for length, kv in pairs
             if (v, length, kv) in chosen]
      if pts:
        ax.plot(*zip(*pts), marker="o", label=v)
    ax.set_xscale("log", base=2)
    ax.set_ylim(-2, 102)
    ax.set_xlabel("kv pairs" if cut == "c" else "L")
    ax.set_ylabel("accuracy (%)")
    ax.set_title({"a": "(a) kv = 64", "b": "(b) kv : L = 1 : 8", "c": "(c) L = 1024"}[cut])
  axes[0][-1].legend(fontsize=7)
  fig.tight_layout()
  return fig


def _curves(results: list[dict], variants):
  """Test accuracy against step: one panel per (variant, L, kv), a line per learning rate (colour) and seed
  (line style)."""
  keys = sorted({(r["cell"]["variant"], r["cell"]["length"], r["cell"]["kv"]) for r in results},
                key=lambda k: (variants.index(k[0]) if k[0] in variants else len(variants), k[1], k[2]))
  cols = min(4, len(keys))
  fig, axes = common.figure(-(-len(keys) // cols), cols, width=3.2, height=2.6)
  lrs = sorted({r["cell"]["lr"] for r in results})
  for ax, key in zip(axes.ravel(), keys):
    for r in sorted(results, key=lambda r: (r["cell"]["lr"], r["cell"]["seed"])):
      c = r["cell"]
      if (c["variant"], c["length"], c["kv"]) != key:
        continue
      steps = [p["step"] for p in r["curve"]]
      ax.plot(steps, [100 * p["accuracy"] for p in r["curve"]], color=f"C{lrs.index(c['lr'])}",
              linestyle=("-", "--", ":", "-.")[c["seed"] % 4], label=f"lr {c['lr']:g} s{c['seed']}")
    ax.set_title(f"{key[0]} L={key[1]} kv={key[2]}", fontsize=9)
    ax.set_ylim(-2, 102)
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy (%)")
    ax.legend(fontsize=6)
  for ax in axes.ravel()[len(keys):]:
    ax.set_visible(False)
  fig.tight_layout()
  return fig


# --- command line ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Grid(Protocol):
  """A grid run's settings, `--config.FIELD` on its command line (`experiments.config`): the protocol's fields, then
  which cells it trains (every variant × L:kv pair × learning rate × seed) and how. pairs: explicit L:kv cells
  instead of the cuts' (`CUTS`). budget_s > 0: no group starts after that many seconds. max_cells > 0: at most
  that many cells in one program. workers: processes drawing the training rows (0: this one)."""
  variants: tuple[str, ...] = ("dn", "pdn", "gdn", "pgdn")
  cut: tuple[str, ...] = ("c",)
  pairs: tuple[tuple[int, int], ...] = ()
  lrs: tuple[float, ...] = (1e-3, 3e-3, 1e-2)
  seeds: tuple[int, ...] = (0, 1)
  budget_s: float = 0.0
  max_cells: int = 0
  workers: int = 0

  def __post_init__(self):
    super().__post_init__()
    for c in self.cut:
      if c not in CUTS:
        raise ValueError(f"grid: `cut` {c!r} is not one of {', '.join(sorted(CUTS))}")
    for s in self.seeds:
      if s < 0:
        raise ValueError(f"grid: `seeds` {s} is not an int ≥ 0")
    common.check_implementation(self.implementation)
    common.check_variants(self.variants)

  @property
  def protocol(self) -> Protocol:
    return Protocol(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Protocol)})

  def cells(self) -> list[Cell]:
    pairs = self.pairs or tuple(dict.fromkeys(pair for cut in self.cut for pair in CUTS[cut]))
    return cells_of(self.variants, pairs, self.lrs, self.seeds)


SMOKE = Grid(steps=8, batch_size=4, vocab_size=64, size="tiny", train_examples=64, test_examples=8,
             implementation="xla", eval_every=4, variants=("dn",), pairs=((32, 4),), lrs=(3e-3, 1e-2), seeds=(0,))


def define_flags():
  """The grid's own flags (its settings are `Grid`'s, `experiments.config`)."""
  plugins.define_imports_flag()
  flags.DEFINE_bool("report", False, "write the tables and figure of the cells in OUT, training nothing")
  flags.DEFINE_bool("smoke", False, "the CI size (the settings are SMOKE's)")
  flags.DEFINE_string("out", "docs/results/mqar", "the cells' directory (with --smoke: a new temporary one unless "
                      "given)")
  config.define(Grid())


def smoke_out(out: str, explicit: bool) -> str:
  """Where a `--smoke` run writes: `--out` when given, else a new temporary directory (never the committed cells)."""
  return out if explicit else tempfile.mkdtemp(prefix="grid-smoke-")


def main(argv):
  del argv
  f = flags.FLAGS
  out = f.out
  if f.smoke:
    spec = SMOKE
    out = smoke_out(f.out, flags.FLAGS["out"].present)
    print(f"smoke run: cells in {out}")
  else:
    spec = config.settings(Grid)
  if not f.report:
    sweep(spec.protocol, spec.cells(), out, budget_s=spec.budget_s, max_cells=spec.max_cells, workers=spec.workers)
  text = report(out)
  (pathlib.Path(out) / "grid.md").write_text(text)
  print(text)


if __name__ == "__main__":
  define_flags()
  cli.run(main, flags_parser=config.parse_flags)
