"""The MQAR oracle: the simplest independent training loop over the public model API, to reproduce a cell of the
trainer's experiments (`experiments.mqar`, `experiments.grid`) with nothing of the trainer in it.

It builds the model with `osdn_jax.models.build`, draws rows from zoology's generator (`osdn_jax.data.MQARSource`),
picks each step's training rows with its own sampler (`--order=replacement`, the default: every row drawn
independently; `--order=epoch`: a new permutation every epoch; 20,000 rows by default), and trains with plain
optax AdamW (weight decay 0.1 on every parameter, a 10 % linear warm-up then cosine to 0, no clipping) on the full logits' cross-entropy at the labelled
positions. Accuracy is measured on test rows drawn with another seed, as the experiments draw them. `--reads=2`
trains and tests on the read-twice rows (the kv block written twice before the queries), as `grid --reads=2` does.
`--optimizer=trainer` trains with the grid's optimiser instead (the trainer's `mqar` config: weight decay on the
matrices, b2 0.95, clip 1.0, a warm-up of min(50, steps/10)), everything else as before, to tell the optimisers'
effect from the rest of the two paths.

  python -m experiments.mqar_oracle --variant=dn --length=256 --kv=64 --lr=3e-3 --steps=1500

Its result also holds `by_age`: the mean training loss of the rows drawn between two curve points, by the steps
since each row was last drawn, which shows how much of the loss is memory of recently seen rows.
`--recurrence` prints how the rows of an order recur (`recurrence`) and trains nothing.

`--follow=N` checks the grid's training path step by step instead: the first N steps of a grid cell (its rows in
its order, `experiments.grid`) run through the grid's vmapped trainer step and through this loop's step, with one
optimiser in both (`--optimizer=oracle`: this loop's AdamW; `trainer`: the trainer's config), and the two losses are
compared step by step. Two paths that compute the same thing agree to rounding until chaos amplifies it.

  python -m experiments.mqar_oracle --variant=dn --length=256 --kv=64 --lr=3e-3 --steps=1500 --follow=300
"""
from __future__ import annotations

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags
from flax import nnx

from experiments import common, config
from osdn_jax import cli, models, plugins
from osdn_jax.data.recall import IGNORE, MQARSource


def rows(source: MQARSource, indices) -> tuple[np.ndarray, np.ndarray]:
  records = [source[int(i)] for i in indices]
  return np.stack([r["inputs"] for r in records]), np.stack([r["labels"] for r in records])


def optimizer(lr, steps: int) -> optax.GradientTransformation:
  """AdamW with weight decay 0.1 on every parameter, a 10 % linear warm-up from 0, then cosine to 0."""
  return optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 10), steps, 0.0), weight_decay=0.1)


def trainer_optimizer(variant, length, kv, lr, steps: int) -> optax.GradientTransformation:
  """The optimiser the grid trains a cell with (the trainer's `mqar` config: `osdn_jax.train.optim.make_at`)."""
  from experiments import grid
  from osdn_jax.train import optim
  config = grid.Protocol(steps=steps).sweep(variant, length, kv).config(variant, length, kv, lr)
  return optim.make_at(config.optimizer, steps, lr)


def loss(graph, params, x, y):
  """(mean cross-entropy of the full logits at the labelled positions of tokens x [B, L] (labels y, IGNORE
  elsewhere), each row's own mean [B])."""
  logits = nnx.merge(graph, params)(x)
  scored = y != IGNORE
  logp = jax.nn.log_softmax(logits)
  nll = -jnp.take_along_axis(logp, jnp.where(scored, y, 0)[..., None], -1)[..., 0]
  per_row = jnp.sum(nll * scored, -1) / jnp.maximum(jnp.sum(scored, -1), 1)
  return jnp.sum(nll * scored) / jnp.sum(scored), per_row


def make_step(graph, tx):
  """(params, opt_state, x, y) → (params, opt_state, loss, per-row loss [B]), jitted."""
  @jax.jit
  def step(params, opt_state, x, y):
    (value, per_row), grads = jax.value_and_grad(lambda p: loss(graph, p, x, y), has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value, per_row
  return step


ORDERS = ("replacement", "epoch")


def draw(order: str, seed: int, rows: int, steps: int, batch: int) -> np.ndarray:
  """int [steps, batch]: the training rows of each step. "replacement": every row drawn uniformly and independently
  (a row recurs at any distance); "epoch": the rows of a new random permutation every epoch, one after another
  (a batch may span two epochs)."""
  rng = np.random.default_rng(seed)
  if order == "replacement":
    return np.stack([rng.integers(0, rows, batch) for _ in range(steps)])
  if order == "epoch":
    stream = np.concatenate([rng.permutation(rows) for _ in range(-(-steps * batch // rows))])
    return stream[:steps * batch].reshape(steps, batch)
  raise ValueError(f"draw: `order` must be one of {ORDERS}, got {order!r}")


# Ages of a drawn row: steps since that row was last drawn (0: never before). Upper bounds of the buckets.
AGES = (("first", 0), ("1-10", 10), ("11-100", 100), ("101-1000", 1000), (">1000", None))


def age_bucket(age: int) -> int:
  """The index in AGES of a row drawn `age` steps after its last draw (0: its first draw)."""
  if age == 0:
    return 0
  for i, (_, top) in enumerate(AGES[1:], 1):
    if top is None or age <= top:
      return i
  raise AssertionError(age)


def recurrence(order: np.ndarray, windows=(1, 10, 100, 1000)) -> dict:
  """How the rows of an order [steps, batch] recur: {"within_w": fraction of draws whose row was drawn in the w
  steps before (w in windows), "draws_per_row": (min, median, max) over the rows drawn, "never_drawn": rows of
  0 … max index never drawn, "duplicate_in_batch": fraction of draws repeating a row of the same step}."""
  last, ages, dup = {}, [], 0
  for s, rows in enumerate(order, 1):
    seen = set()
    for r in rows.tolist():
      dup += r in seen
      seen.add(r)
      ages.append(s - last[r] if r in last else 0)
    for r in rows.tolist():
      last[r] = s
  ages = np.asarray(ages)
  counts = np.bincount(order.ravel())
  return dict(within_w={str(w): float(np.mean((ages > 0) & (ages <= w))) for w in windows},
              draws_per_row=(int(counts.min()), float(np.median(counts)), int(counts.max())),
              never_drawn=int(np.sum(counts == 0)), duplicate_in_batch=dup / order.size)


def build(variant, vocab_size, size, implementation, dtype, seed):
  model = models.build(f"{variant}-{size}", vocab_size=vocab_size, implementation=implementation,
                       dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed))
  return nnx.split(model, nnx.Param)


@dataclasses.dataclass(frozen=True)
class Oracle:
  """One run's settings, `--config.FIELD` on the command line (`experiments.config`): the cell (variant, L, kv,
  learning rate, seed), the protocol (steps of batch_size rows in `order` from train_examples distinct rows,
  vocabulary, model size, test rows, implementation, dtype, reads), the learning curve's points (evals), the
  optimiser ("oracle": `optimizer`; "trainer": the grid's, `trainer_optimizer`). follow > 0: compare this many
  steps of the grid's path with this loop's (`follow`, the module docstring), its rows drawn by `workers`
  processes."""
  variant: str = "dn"
  length: int = 256
  kv: int = 64
  lr: float = 3e-3
  steps: int = 1500
  batch_size: int = 64
  seed: int = 0
  vocab_size: int = 8192
  size: str = "mqar"
  train_examples: int = 20_000
  test_examples: int = 1000
  implementation: str = "auto"
  dtype: str = "float32"
  reads: int = 1
  evals: int = 5
  optimizer: str = "oracle"
  order: str = "replacement"
  follow: int = 0
  workers: int = 0

  def __post_init__(self):
    if self.optimizer not in ("oracle", "trainer"):
      raise ValueError(f"mqar_oracle: `optimizer` must be 'oracle' or 'trainer', got {self.optimizer!r}")
    if self.order not in ORDERS:
      raise ValueError(f"mqar_oracle: `order` must be one of {ORDERS}, got {self.order!r}")
    common.check_implementation(self.implementation)

  def protocol(self):
    """The grid's protocol of these settings (`experiments.grid.Protocol`, one curve point at the end)."""
    from experiments import grid
    return grid.Protocol(steps=self.steps, batch_size=self.batch_size, vocab_size=self.vocab_size, size=self.size,
                         train_examples=self.train_examples, test_examples=self.test_examples, dtype=self.dtype,
                         implementation=self.implementation, eval_every=self.steps, reads=self.reads,
                         order=self.order)


def train(spec: Oracle | None = None, log=print, **fields) -> dict:
  """Trains one model (`spec`, default `Oracle()`, with `fields` replaced); returns {"accuracy", "curve": [(step,
  loss, accuracy)], "by_age", "steps_per_s"}. reads: times the kv block is written before the queries (2: the
  read-twice rows, L + 2·kv tokens). optimizer: "oracle" (`optimizer`) or "trainer" (the optimiser of the grid's
  cell config, `trainer_optimizer`), everything else this loop's own. order: the training rows' order (`draw`).
  by_age: per curve point, the mean training loss of the rows drawn since the last point by their age (`AGES`:
  steps since the row was last drawn) and their count, {bucket: (mean loss, draws)}."""
  spec = dataclasses.replace(spec or Oracle(), **fields)
  variant, length, kv, lr, steps, seed = spec.variant, spec.length, spec.kv, spec.lr, spec.steps, spec.seed
  batch_size, train_examples, test_examples = spec.batch_size, spec.train_examples, spec.test_examples
  vocab_size, reads, order, evals = spec.vocab_size, spec.reads, spec.order, spec.evals
  graph, params = build(variant, vocab_size, spec.size, spec.implementation, spec.dtype, seed)
  tx = optimizer(lr, steps) if spec.optimizer == "oracle" else trainer_optimizer(variant, length, kv, lr, steps)
  opt_state = tx.init(params)
  step = make_step(graph, tx)

  @jax.jit
  def correct(params, x, y):
    predicted = jnp.argmax(nnx.merge(graph, params)(x), -1)
    scored = y != IGNORE
    return jnp.sum((predicted == y) & scored), jnp.sum(scored)

  train_rows = MQARSource(vocab_size=vocab_size, length=length, num_pairs=kv, num_records=train_examples, seed=seed,
                          context_reads=reads)
  test_rows = MQARSource(vocab_size=vocab_size, length=length, num_pairs=kv, num_records=test_examples,
                         seed=seed + 1_000_003, context_reads=reads)
  train_x, train_y = rows(train_rows, range(train_examples))
  test_x, test_y = rows(test_rows, range(test_examples))

  def accuracy(params):
    hits = total = 0
    for i in range(0, test_examples, 250):
      c, t = correct(params, test_x[i:i + 250], test_y[i:i + 250])
      hits, total = hits + int(c), total + int(t)
    return hits / total

  order_rows = draw(order, seed, train_examples, steps, batch_size)
  last_drawn = np.zeros(train_examples, np.int64)   # the step of each row's last draw (0: never)
  sums, counts = np.zeros(len(AGES)), np.zeros(len(AGES), np.int64)
  curve, by_age, start = [], [], time.perf_counter()
  every = max(1, steps // evals)
  for s in range(1, steps + 1):
    picked = order_rows[s - 1]
    params, opt_state, value, per_row = step(params, opt_state, train_x[picked], train_y[picked])
    buckets = [age_bucket(s - last_drawn[r] if last_drawn[r] else 0) for r in picked]
    np.add.at(sums, buckets, np.asarray(per_row, np.float64))
    np.add.at(counts, buckets, 1)
    last_drawn[picked] = s
    if s % every == 0 or s == steps:
      curve.append((s, float(value), accuracy(params)))
      by_age.append(dict(step=s, **{name: (float(sums[i] / counts[i]) if counts[i] else None, int(counts[i]))
                                    for i, (name, _) in enumerate(AGES)}))
      sums[:], counts[:] = 0, 0
      log(f"step {s}: loss {curve[-1][1]:.3f}, accuracy {100 * curve[-1][2]:.1f}%")
  return dict(accuracy=curve[-1][2], curve=curve, by_age=by_age, order=order, train_examples=train_examples,
              steps_per_s=steps / (time.perf_counter() - start))


def follow(protocol, cell, steps: int, optimizer_name: str = "oracle", workers: int = 0) -> dict:
  """The first `steps` losses of a grid cell (`experiments.grid.Cell` at `grid.Protocol` protocol) through the grid's
  vmapped trainer step and through `make_step`, on the same rows in the same order, with one optimiser in both
  ("oracle": `optimizer`; "trainer": the trainer config's). Returns {"grid", "oracle": [steps] losses,
  "max_rel_diff" over the first 10, 100 and all steps}."""
  from experiments import grid
  if optimizer_name not in ("oracle", "trainer"):
    raise ValueError(f"follow: `optimizer_name` must be 'oracle' or 'trainer', got {optimizer_name!r}")
  unit = optimizer(1.0, protocol.steps)   # AdamW's update is linear in its learning rate
  make = (lambda lr: optax.chain(unit, optax.scale(lr))) if optimizer_name == "oracle" else None
  group = grid.Group(protocol, [cell], chunk_steps=steps, workers=workers, optimizer=make)
  # This loop's copy of the trainer's optimiser is `trainer_optimizer`, the one `train` uses, not the grid's object.
  tx = (trainer_optimizer(cell.variant, cell.length, cell.kv, cell.lr, protocol.steps) if make is None
        else optimizer(cell.lr, protocol.steps))
  on_grid = group.losses(steps)[:, 0]
  graph, params = build(cell.variant, protocol.vocab_size, protocol.size, protocol.implementation, protocol.dtype,
                        cell.seed)
  step, opt_state = make_step(graph, tx), tx.init(params)
  inputs, labels = group.data[cell.seed][0]
  order = grid.row_order(protocol.order, cell.seed, protocol.train_examples, protocol.steps, protocol.batch_size)
  plain = []
  for s in range(steps):
    params, opt_state, value, _ = step(params, opt_state, inputs[order[s]], labels[order[s]])
    plain.append(float(value))
  plain = np.asarray(plain)
  rel = np.abs(on_grid - plain) / np.maximum(np.abs(plain), 1e-30)
  return dict(grid=on_grid.tolist(), oracle=plain.tolist(),
              max_rel_diff={str(n): float(rel[:n].max()) for n in (10, 100, steps) if n <= steps})


def define_flags():
  """The program's flags: --recurrence, and `Oracle`'s fields as --config.FIELD (`experiments.config`)."""
  plugins.define_imports_flag()
  flags.DEFINE_bool("recurrence", False, "print how the rows of the order recur (`recurrence`), training nothing")
  config.define(Oracle())


def main(argv):
  del argv
  spec = config.settings(Oracle)
  if flags.FLAGS.recurrence:
    print(json.dumps(recurrence(draw(spec.order, spec.seed, spec.train_examples, spec.steps, spec.batch_size))))
    return
  if spec.follow:
    from experiments import grid
    result = follow(spec.protocol(), grid.Cell(spec.variant, spec.length, spec.kv, spec.lr, spec.seed), spec.follow,
                    spec.optimizer, workers=spec.workers)
    at = sorted({n for n in (1, 2, 5, 10, 20, 50, 100, 200, 300, 500, 1000) if n <= spec.follow} | {spec.follow})
    print(json.dumps(dict(steps=at, grid=[result["grid"][n - 1] for n in at],
                          oracle=[result["oracle"][n - 1] for n in at], max_rel_diff=result["max_rel_diff"])))
    return
  print(json.dumps(train(spec)))


if __name__ == "__main__":
  define_flags()
  cli.run(main, flags_parser=config.parse_flags)
