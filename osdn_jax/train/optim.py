"""The optimiser: AdamW with a warm-up + cosine schedule, global-norm clipping and a weight-decay mask.

    lr(s) = lr · s / warmup                                       s < warmup
          = lr · (r + (1 − r) · ½(1 + cos(π (s − warmup) / (steps − warmup))))   after; r = min_lr_ratio

Weight decay applies to the matrices (Linear kernels, the embedding and an untied head, the short-conv filters) and to
nothing else: not to norm scales, biases, or the point's own parameters (decay gates A_log / dt_bias, the PDN
center, a fixed scale) — those set time scales and offsets, which decay would drag towards zero.
"""
from __future__ import annotations

import types

import jax
import optax

_DECAYED = ("kernel", "embed", "head", "weight")   # Linear kernels, the embedding, an untied head, ShortConv's filter


def schedule(opt, steps: int) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=opt.lr, warmup_steps=opt.warmup_steps, decay_steps=steps,
      end_value=opt.lr * opt.min_lr_ratio)


def decay_mask(params):
  """A pytree of bools like params (a nested dict of arrays, or the `nnx.State` of `nnx.split`, whose leaves sit
  under each variable's `value`): True where weight decay applies."""
  def decayed(path, _):
    while len(path) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey):   # a variable's `value`
      path = path[:-1]
    names = [getattr(p, "key", getattr(p, "name", None)) for p in path]
    return names[-1] in _DECAYED and "point_params" not in names
  return jax.tree_util.tree_map_with_path(decayed, params)


def make(opt, steps: int) -> optax.GradientTransformation:
  """clip(global norm) → AdamW(b1, b2, eps, weight decay on the masked leaves) at `schedule`."""
  return optax.chain(
      optax.clip_by_global_norm(opt.clip),
      optax.adamw(schedule(opt, steps), b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay,
                  mask=decay_mask))


def make_at(opt, steps: int, lr) -> optax.GradientTransformation:
  """`make` with the peak learning rate given apart, as a scalar that may be traced (one per cell of a `jax.vmap`
  over runs): the update of AdamW with decoupled weight decay is linear in its learning rate, so this is `make`'s
  at lr = 1, scaled by lr. Its state has one structure whatever lr."""
  unit = types.SimpleNamespace(lr=1.0, **{name: getattr(opt, name) for name in (
      "warmup_steps", "min_lr_ratio", "b1", "b2", "eps", "weight_decay", "clip")})
  return optax.chain(make(unit, steps), optax.scale(lr))
