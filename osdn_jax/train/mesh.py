"""The device mesh and where every array lives on it.

Mesh axes (`config.mesh`): "data" (pure data parallelism: parameters replicated), "fsdp" (data parallelism with
parameters, gradients and optimiser state split: each device keeps 1/fsdp of every large matrix and XLA gathers
it for the matmul), "context" (the positions of every row split: context parallelism, parameters replicated; the
recurrence passes its state between the shards, `osdn_jax.ops.context`), "tensor" (heads and the MLP's hidden
units split; the recurrence runs under `shard_map` per head group, `osdn_jax.layers.sharding`). A batch splits
its rows over data × fsdp and its positions over context.

Parameter rules, by the parameter's path (leading layer axis L of the stacked blocks left whole):
  embed, head [vocab, D]                 vocab over tensor, D over fsdp (head: an untied output head)
  q/k/v/g_proj, mlp gate/up [L, D, N]    D over fsdp, N over tensor (N is heads × head size, or MLP units)
  o_proj, mlp down [L, N, D]             N over tensor, D over fsdp
  feature projections [L, D, n]          D over fsdp
  everything else (norms, conv filters, the point's parameters)   replicated
An axis whose size does not divide the dimension leaves that dimension whole.
"""
from __future__ import annotations

import math
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "context", "tensor")
BATCH = ("data", "fsdp")
CONTEXT = "context"

# (pattern on the "/"-joined path, spec of the trailing dims); the first match wins.
RULES = (
    (r"^(embed|head)$", ("tensor", "fsdp")),
    (r"mixer/(q|k|v|g)_proj/kernel$", ("fsdp", "tensor")),
    (r"mlp/(gate|up)_proj/kernel$", ("fsdp", "tensor")),
    (r"mixer/o_proj/kernel$", ("tensor", "fsdp")),
    (r"mlp/down_proj/kernel$", ("tensor", "fsdp")),
    (r"mixer/features/.*/(down|proj)/kernel$", ("fsdp", None)),
)


def axis_sizes(mesh_cfg, num_devices: int) -> dict[str, int]:
  """{"data", "fsdp", "context", "tensor"} sizes (an axis not in mesh_cfg is 1) with a −1 resolved to the rest
  of the devices; ValueError if they do not multiply to num_devices."""
  sizes = {a: mesh_cfg.get(a, 1) for a in AXES}
  known = math.prod(s for s in sizes.values() if s != -1)
  for a, s in sizes.items():
    if s == -1:
      if num_devices % known:
        raise ValueError(f"train config: `mesh.{a}` = -1 but {num_devices} devices do not split over the other "
                         f"axes' {known}")
      sizes[a] = num_devices // known
  if math.prod(sizes.values()) != num_devices:
    raise ValueError(f"train config: `mesh` data × fsdp × context × tensor = {sizes['data']} × {sizes['fsdp']} "
                     f"× {sizes['context']} × {sizes['tensor']} must equal the number of devices ({num_devices})")
  return sizes


def make_mesh(mesh_cfg, devices=None) -> Mesh:
  devices = jax.devices() if devices is None else devices
  sizes = axis_sizes(mesh_cfg, len(devices))
  return Mesh(np.asarray(devices).reshape(tuple(sizes[a] for a in AXES)), AXES)


def _fit(spec, shape, mesh: Mesh) -> P:
  """spec (for the trailing dims) → a PartitionSpec for `shape`, dropping axes that do not divide."""
  spec = (None,) * (len(shape) - len(spec)) + tuple(spec)
  return P(*(a if a is not None and shape[i] % mesh.shape[a] == 0 and mesh.shape[a] > 1 else None
             for i, a in enumerate(spec)))


def param_spec(path: str, shape, mesh: Mesh) -> P:
  for pattern, spec in RULES:
    if re.search(pattern, path) and len(shape) >= len(spec):
      return _fit(spec, shape, mesh)
  return P()


def _path(path) -> str:
  return "/".join(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path)


def param_shardings(params, mesh: Mesh):
  """NamedShardings for a nested dict of parameters (arrays or ShapeDtypeStructs), by `RULES`."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(mesh, param_spec(_path(path), x.shape, mesh)), params)


def like_params(tree, params, param_sh, mesh: Mesh):
  """Shardings for a tree holding parameter-shaped leaves (the optimiser's moments) and scalars: a leaf with a
  parameter's shape at the same relative path takes that parameter's sharding; anything else is replicated."""
  by_path = {}
  for path, sh in jax.tree_util.tree_flatten_with_path(param_sh)[0]:
    by_path[_path(path)] = sh
  shapes = {_path(path): x.shape for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}

  def choose(path, x):
    full = _path(path)
    for key, sh in by_path.items():
      if (full == key or full.endswith("/" + key)) and shapes[key] == x.shape:
        return sh
    return NamedSharding(mesh, P())
  return jax.tree_util.tree_map_with_path(choose, tree)


def check_tensor_axis(model_cfg, mesh: Mesh) -> None:
  """ValueError unless the tensor axis splits the key heads, the value heads and the MLP's hidden units."""
  dims, split = model_cfg.mixer.dims, mesh.shape["tensor"]
  if dims.heads % split or dims.value_heads % split or model_cfg.hidden % split:
    raise ValueError(f"train config: `mesh.tensor` ({split}) must divide the heads ({dims.heads}), the value "
                     f"heads ({dims.value_heads}) and the MLP width ({model_cfg.hidden}) of {model_cfg.name}")


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Rows over data × fsdp, positions over context: for every [rows, T] array of a batch."""
  return NamedSharding(mesh, P(BATCH, CONTEXT if CONTEXT in mesh.axis_names else None))


def check_length(seq_len: int, mesh: Mesh | int) -> None:
  """ValueError unless the context axis splits the sequence length; mesh: a Mesh or the context axis's size."""
  parts = mesh if isinstance(mesh, int) else mesh.shape.get(CONTEXT, 1)
  if seq_len % parts:
    raise ValueError(f"train config: `mesh.context` ({parts}) must divide `seq_len` ({seq_len})")
