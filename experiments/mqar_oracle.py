"""The MQAR oracle: the simplest independent training loop over the public model API, to reproduce a cell of the
trainer's experiments (`experiments.mqar`, `experiments.grid`) with nothing of the trainer in it.

It builds the model with `osdn_jax.models.build`, draws rows from zoology's generator (`osdn_jax.data.MQARSource`,
the training rows sampled with replacement), and trains with plain optax AdamW (weight decay 0.1 on every
parameter, a 10 % linear warm-up then cosine to 0, no clipping) on the full logits' cross-entropy at the labelled
positions. Accuracy is measured on test rows drawn with another seed, as the experiments draw them.

  python -m experiments.mqar_oracle --variant=dn --length=256 --kv=64 --lr=3e-3 --steps=1500
"""
from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

from osdn_jax import models, plugins
from osdn_jax.data.recall import IGNORE, MQARSource


def rows(source: MQARSource, indices) -> tuple[np.ndarray, np.ndarray]:
  records = [source[int(i)] for i in indices]
  return np.stack([r["inputs"] for r in records]), np.stack([r["labels"] for r in records])


def train(variant: str = "dn", length: int = 256, kv: int = 64, lr: float = 3e-3, steps: int = 1500,
          batch_size: int = 64, seed: int = 0, vocab_size: int = 8192, size: str = "mqar",
          train_examples: int = 100_000, test_examples: int = 1000, implementation: str = "auto",
          dtype: str = "float32", evals: int = 5, log=print) -> dict:
  """Trains one model; returns {"accuracy", "curve": [(step, loss, accuracy)], "steps_per_s"}."""
  model = models.build(f"{variant}-{size}", vocab_size=vocab_size, implementation=implementation,
                       dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed))
  graph, params = nnx.split(model, nnx.Param)
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 10), steps, 0.0)
  tx = optax.adamw(schedule, weight_decay=0.1)
  opt_state = tx.init(params)

  def loss_fn(params, x, y):
    logits = nnx.merge(graph, params)(x)
    scored = y != IGNORE
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, jnp.where(scored, y, 0)[..., None], -1)[..., 0]
    return jnp.sum(nll * scored) / jnp.sum(scored)

  @jax.jit
  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  @jax.jit
  def correct(params, x, y):
    predicted = jnp.argmax(nnx.merge(graph, params)(x), -1)
    scored = y != IGNORE
    return jnp.sum((predicted == y) & scored), jnp.sum(scored)

  train_rows = MQARSource(vocab_size=vocab_size, length=length, num_pairs=kv, num_records=train_examples, seed=seed)
  test_rows = MQARSource(vocab_size=vocab_size, length=length, num_pairs=kv, num_records=test_examples,
                         seed=seed + 1_000_003)
  test_x, test_y = rows(test_rows, range(test_examples))

  def accuracy(params):
    hits = total = 0
    for i in range(0, test_examples, 250):
      c, t = correct(params, test_x[i:i + 250], test_y[i:i + 250])
      hits, total = hits + int(c), total + int(t)
    return hits / total

  rng = np.random.default_rng(seed)
  curve, start = [], time.perf_counter()
  every = max(1, steps // evals)
  for s in range(1, steps + 1):
    x, y = rows(train_rows, rng.integers(0, train_examples, batch_size))
    params, opt_state, loss = step(params, opt_state, x, y)
    if s % every == 0 or s == steps:
      curve.append((s, float(loss), accuracy(params)))
      log(f"step {s}: loss {curve[-1][1]:.3f}, accuracy {100 * curve[-1][2]:.1f}%")
  return dict(accuracy=curve[-1][2], curve=curve, steps_per_s=steps / (time.perf_counter() - start))


def define_flags():
  plugins.define_imports_flag()
  flags.DEFINE_string("variant", "dn", "registry point")
  flags.DEFINE_integer("length", 256, "row length L")
  flags.DEFINE_integer("kv", 64, "key-value pairs")
  flags.DEFINE_float("lr", 3e-3, "peak learning rate")
  flags.DEFINE_integer("steps", 1500, "optimiser steps")
  flags.DEFINE_integer("batch_size", 64, "rows per step")
  flags.DEFINE_integer("seed", 0, "initialisation and data seed")
  flags.DEFINE_integer("vocab_size", 8192, "vocabulary")
  flags.DEFINE_string("size", "mqar", "model size")
  flags.DEFINE_integer("train_examples", 100_000, "distinct training rows")
  flags.DEFINE_integer("test_examples", 1000, "test rows")
  flags.DEFINE_string("implementation", "auto", "auto | xla | pallas | reference")
  flags.DEFINE_string("dtype", "float32", "compute dtype")


def main(argv):
  del argv
  f = flags.FLAGS
  result = train(f.variant, f.length, f.kv, f.lr, f.steps, f.batch_size, f.seed,
                 f.vocab_size, f.size, f.train_examples, f.test_examples, implementation=f.implementation,
                 dtype=f.dtype)
  print(json.dumps(result))


if __name__ == "__main__":
  define_flags()
  app.run(main)
