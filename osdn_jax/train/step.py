"""The training state and one optimiser step (forward, backward, optional gradient accumulation, update), and
the step with its batch checked on the device (`checked_train_step`), and the held-out loss (`make_eval_step`).

state = {"step": int32 (completed steps), "params": the model's parameters (nested dict, fp32),
         "opt_state": the optimiser's, "rng": uint32 [2] (the run's key data, for stochastic layers)}
batch = {"tokens", "targets", "segment_ids": int32 [B, T], "loss_mask": float32 [B, T]}
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import checkify

from osdn_jax import checking
from osdn_jax.models import LanguageModel
from osdn_jax.train.loss import cross_entropy


_norm = optax.tree.norm if hasattr(optax, "tree") and hasattr(optax.tree, "norm") else optax.global_norm


def init_state(model_cfg, tx, seed: int) -> dict:
  """A fresh state: the model initialised from `seed`, the optimiser's state, step 0."""
  model = LanguageModel(model_cfg, rngs=nnx.Rngs(seed))
  params = nnx.state(model, nnx.Param).to_pure_dict()
  return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
          "rng": jax.random.key_data(jax.random.key(seed))}


def graphdef(model_cfg):
  """The model's structure without its arrays (`nnx.merge(graphdef, params)` rebuilds the model)."""
  return nnx.split(nnx.eval_shape(lambda: LanguageModel(model_cfg, rngs=nnx.Rngs(0))))[0]


def segments_bound(segment_ids, minimum: int = 4) -> int:
  """A static bound on the segments per row of concrete segment_ids [B, T]: 1 when every row is one sequence
  (the step then runs unpacked), else the next power of two ≥ the largest count and ≥ `minimum`, so that only
  a few bounds (and compilations) ever occur."""
  ids = np.asarray(segment_ids)
  most = int(1 + np.max(np.sum(ids[:, 1:] != ids[:, :-1], axis=1))) if ids.shape[1] > 1 else 1
  return 1 if most == 1 else max(minimum, 1 << (most - 1).bit_length())


def scored_positions(mask, count: int):
  """The first `count` positions of each row where mask > 0, in order (rows with fewer are filled with
  unscored positions): int32 [B, count] for mask [B, T]."""
  return jnp.argsort(mask <= 0, axis=1, stable=True)[:, :count].astype(jnp.int32)


def loss_sum(graph, params, batch, *, loss_chunk: int, segments_per_row=None, loss_positions: int = 0):
  """Σ over unmasked tokens of −log p(target), fp32, and nothing [B, T, vocab] in memory (`train.loss`).

  loss_positions > 0: the head reads only the first loss_positions scored positions of each row (the recall
  tasks score a few positions per row); scored positions beyond them are dropped."""
  model = nnx.merge(graph, params)
  packed = segments_per_row is None or segments_per_row > 1
  hidden = model.hidden(batch["tokens"], segment_ids=batch["segment_ids"] if packed else None,
                        segments_per_row=segments_per_row if packed else None)
  targets, mask = batch["targets"], batch["loss_mask"]
  if loss_positions:
    at = scored_positions(mask, loss_positions)
    hidden = jnp.take_along_axis(hidden, at[..., None], axis=1)
    targets, mask = jnp.take_along_axis(targets, at, axis=1), jnp.take_along_axis(mask, at, axis=1)
  head = params["head"] if params.get("head") is not None else params["embed"]   # untied: its own head
  return cross_entropy(hidden, head, targets, mask, chunk=loss_chunk)


def make_train_step(graph, tx: optax.GradientTransformation, *, grad_accum: int = 1, loss_chunk: int = 2048,
                    schedule=None, loss_positions: int = 0):
  """step(state, batch, segments_per_row=None) → (state, metrics {loss, grad_norm, lr, tokens}).

  segments_per_row: static (`segments_bound` of the batch's segment_ids; jit it as a static argument).

  The loss is the mean over unmasked tokens of the whole batch (only the first loss_positions of each row when
  loss_positions > 0, `loss_sum`); with grad_accum = n the batch's rows are taken
  as n microbatches (row r in microbatch r mod n, so each stays spread over the data axes) whose summed losses
  and gradients are accumulated in fp32 before the one update.
  """
  def step(state, batch, segments_per_row=None):
    grad_fn = jax.value_and_grad(lambda p, b: loss_sum(graph, p, b, loss_chunk=loss_chunk,
                                                       segments_per_row=segments_per_row,
                                                       loss_positions=loss_positions))
    params = state["params"]
    mask = batch["loss_mask"]
    if loss_positions:
      mask = jnp.take_along_axis(mask, scored_positions(mask, loss_positions), axis=1)
    count = jnp.maximum(jnp.sum(mask), 1.0)
    if grad_accum == 1:
      total, grads = grad_fn(params, batch)
    else:
      split = lambda x: jnp.moveaxis(x.reshape((x.shape[0] // grad_accum, grad_accum) + x.shape[1:]), 1, 0)

      def micro(carry, mb):
        total, grads = carry
        t, g = grad_fn(params, mb)
        return (total + t, jax.tree.map(jnp.add, grads, g)), None

      zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
      (total, grads), _ = jax.lax.scan(micro, (jnp.zeros((), jnp.float32), zeros), jax.tree.map(split, batch))
    grads = jax.tree.map(lambda g: g / count, grads)
    grad_norm = _norm(grads)
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    new = dict(state, step=state["step"] + 1, params=optax.apply_updates(params, updates), opt_state=opt_state)
    metrics = {"loss": total / count, "grad_norm": grad_norm, "tokens": count}
    if schedule is not None:
      metrics["lr"] = schedule(state["step"])
    return new, metrics

  return step


def make_eval_step(graph, *, grad_accum: int = 1, loss_chunk: int = 2048, loss_positions: int = 0):
  """evaluate(params, batch, segments_per_row=None) → (Σ −log p over the scored tokens, scored tokens), both fp32
  scalars: the train step's loss (`loss_sum`, the same scored positions) without a gradient, over the same
  grad_accum microbatches (so an evaluation needs no more memory than a step). segments_per_row: static."""
  def evaluate(params, batch, segments_per_row=None):
    mask = batch["loss_mask"]
    if loss_positions:
      mask = jnp.take_along_axis(mask, scored_positions(mask, loss_positions), axis=1)
    fn = lambda b: loss_sum(graph, params, b, loss_chunk=loss_chunk, segments_per_row=segments_per_row,
                            loss_positions=loss_positions)
    if grad_accum == 1:
      total = fn(batch)
    else:
      split = lambda x: jnp.moveaxis(x.reshape((x.shape[0] // grad_accum, grad_accum) + x.shape[1:]), 1, 0)
      total, _ = jax.lax.scan(lambda t, mb: (t + fn(mb), None), jnp.zeros((), jnp.float32),
                              jax.tree.map(split, batch))
    return total, jnp.sum(mask.astype(jnp.float32))

  return evaluate


def batch_checks(batch, vocab_size: int) -> None:
  """The batch's conditions on traced values, as `checking.require`s (checked mode): tokens and targets in
  [0, vocab_size), segment_ids non-decreasing along each row. Each message names the first bad position."""
  for name in ("tokens", "targets"):
    ids = batch[name]
    bad = (ids < 0) | (ids >= vocab_size)
    row, col = jnp.unravel_index(jnp.argmax(bad.reshape(-1)), ids.shape)
    checking.require(~jnp.any(bad), f"`{name}`[{{}}, {{}}] = {{}} is outside the vocabulary [0, {vocab_size})",
                     row, col, ids[row, col])
  seg = batch["segment_ids"]
  if seg.shape[1] > 1:
    down = seg[:, 1:] < seg[:, :-1]
    row, col = jnp.unravel_index(jnp.argmax(down.reshape(-1)), down.shape)
    checking.require(~jnp.any(down), "`segment_ids` must be non-decreasing along each row, got {} → {} at [{}, {}]",
                     seg[row, col], seg[row, col + 1], row, col + 1)


def checked_train_step(step, vocab_size: int):
  """A train step (`make_train_step`'s) with its batch checked in checked mode (`osdn_jax.checking`):
  (state, batch, segments_per_row=None) → (error, (state, metrics)), error the `checkify.Error` of
  `batch_checks`. Nothing blocks on it: pass it to `checking.throw` once the step's results are fetched anyway.

  The step itself is not checkified: checkify cannot carry an error value into a `shard_map` traced under a
  context mesh (JAX 0.10: "context mesh ... should match the aval mesh" for the error's `broadcast_in_dim`), and
  the trainer's solves run under `shard_map` inside `jax.set_mesh`, after the model's own checks (token ids,
  segment ids). Those checks are no-ops here; `batch_checks` states the same conditions on the step's inputs.
  """
  def run(state, batch, segments_per_row=None):
    new, metrics = step(state, batch, segments_per_row)
    error, _ = checkify.checkify(batch_checks, errors=checking.ERRORS)(batch, vocab_size)
    return error, (new, metrics)

  return run
