"""The recurrence under `shard_map`: batch rows over the mesh's data axes, heads over its tensor axis, and
positions over its context axis.

The mixer's projections are ordinary sharded matmuls (XLA partitions them from the parameters' shardings); the
solve is a sequential kernel that must see whole heads, so it runs under `jax.shard_map` with every input split
by rows and heads. Along T it either sees whole sequences (nothing communicated) or, when the mesh's context
axis is larger than 1, a slice of every sequence: the point then runs context-parallel (`osdn_jax.ops.context`:
the shards exchange their state maps). The mesh comes from the context (`jax.set_mesh(mesh)` around the jitted
step); without one, or with none of these axis names, the solve runs as it is.

Axis names (the trainer's mesh): "data" and "fsdp" split the batch, "context" the positions, "tensor" the heads.
"""
from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp")
HEAD_AXIS = "tensor"
CONTEXT_AXIS = "context"


def context_mesh():
  """The abstract mesh set by `jax.set_mesh`, if it names any of the batch or head axes; else None."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not set(mesh.axis_names) & set(BATCH_AXES + (HEAD_AXIS, CONTEXT_AXIS)):
    return None
  return mesh


def _axes(mesh):
  batch = tuple(a for a in BATCH_AXES if a in mesh.axis_names) or None
  head = HEAD_AXIS if HEAD_AXIS in mesh.axis_names else None
  return batch, head


def context_axis(mesh) -> str | None:
  """The axis that splits T when it has more than one device, else None."""
  return CONTEXT_AXIS if mesh.shape.get(CONTEXT_AXIS, 1) > 1 else None


def check_divisible(mesh, *, batch: int, heads: int, value_heads: int, length: int | None = None,
                    owner: str = "shard_solve") -> None:
  """ValueError unless the rows split over the batch axes, both head counts over the tensor axis and the
  length over the context axis."""
  batch_axes, head = _axes(mesh)
  parts = mesh.shape.get(CONTEXT_AXIS, 1)
  if length is not None and length % parts:
    raise ValueError(f"{owner}: the sequence length ({length}) must be a multiple of the mesh's context size "
                     f"({parts})")
  rows = math.prod(mesh.shape[a] for a in batch_axes or ())
  split = mesh.shape[head] if head else 1
  if batch % rows:
    raise ValueError(f"{owner}: the batch ({batch}) must be a multiple of the mesh's data × fsdp size ({rows})")
  if heads % split or value_heads % split:
    raise ValueError(f"{owner}: `num_heads` ({heads}) and `num_value_heads` ({value_heads}) must be multiples "
                     f"of the mesh's tensor size ({split})")


def shard_solve(fn, mesh, per_token, per_head, segment_ids=None):
  """fn(per_token, per_head, segment_ids, context) → o [B, T, HV, V], run per shard of rows × positions × heads.

  per_token: a pytree of [B, T, heads, ...] arrays (q, k, v and the point's features); per_head: a pytree of
  [heads, ...] arrays (the point's parameters); segment_ids: None or [B, T]; context: the axis name that splits
  T (`context_axis`), passed on to the point, or None. Value heads must split like key heads (value head i reads
  key head i // g, so contiguous blocks of both stay together).
  """
  batch, head = _axes(mesh)
  ctx = context_axis(mesh)
  token_spec = lambda x: P(batch, ctx, head, *([None] * (x.ndim - 3)))
  head_spec = lambda x: P(head, *([None] * (x.ndim - 1)))
  in_specs = (jax.tree.map(token_spec, per_token), jax.tree.map(head_spec, per_head),
              None if segment_ids is None else P(batch, ctx))
  run = lambda tokens, params, ids: fn(tokens, params, ids, ctx)
  return jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=P(batch, ctx, head, None),
                       check_vma=False)(per_token, per_head, segment_ids)
