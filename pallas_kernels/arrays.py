"""Array helpers and input checks every kernel backend's wrappers share (plain JAX, outside the kernels)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.spec import LOG_DECAY_FLOOR


def default_interpret(interpret):
  """`interpret` None: True on a CPU backend (the kernels then run in Pallas' interpreter), else False; any other
  value as given (each backend's `common.default_interpret` turns it into what its `pallas_call` takes)."""
  return jax.default_backend() == "cpu" if interpret is None else interpret


def device_kind(interpret) -> str:
  """The device kind a backend's tuning table is read at: "interpret" in interpret mode (`interpret` as
  `default_interpret` returns it), else the first device's `device_kind` ("NVIDIA H200", "TPU v6 lite", ...)."""
  return "interpret" if interpret else jax.devices()[0].device_kind


def tuning_entry(table: dict, device_kind: str | None, default):
  """A tuning table's entry for `device_kind`: the first whose key it contains (case-insensitive), else `default`."""
  kind = (device_kind or "").lower()
  return next((entry for key, entry in table.items() if key.lower() in kind), default)


def pad_axis(x, axis: int, size: int):
  """x zero-padded at the end of `axis` to `size`."""
  if x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad)


def scale_parts(scale, key_dim: int):
  """(python float, None) for a concrete scale (default key_dim ** −0.5); (None, fp32 array) for a traced one."""
  if scale is None:
    return key_dim ** -0.5, None
  try:
    return float(scale), None
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None, jnp.asarray(scale, jnp.float32)


def moment_inputs(where: str, x, log_decay, beta, initial_state):
  """The second moment's inputs as every backend's kernels take them: (beta fp32 or None, log_decay fp32 clamped at
  LOG_DECAY_FLOOR, A0 fp32 [B, H, K], zeros when not given), after the checks: x [B, T, H, K]; log_decay [B, T, H];
  beta None or [B, T, H]; initial_state None or [B, H, K] (ValueError naming the argument)."""
  if x.ndim != 4:
    raise ValueError(f"{where}: `x` must be [B, T, H, K], got shape {x.shape}")
  b, t, h, k = x.shape
  for name, a in (("log_decay", log_decay), ("beta", beta)):
    if (a is not None or name == "log_decay") and jnp.shape(a) != (b, t, h):
      raise ValueError(f"{where}: `{name}` must be [B, T, H] = {(b, t, h)}, got {jnp.shape(a)}")
  if initial_state is not None and initial_state.shape != (b, h, k):
    raise ValueError(f"{where}: `initial_state` must be [B, H, K] = {(b, h, k)}, got {initial_state.shape}")
  f32 = lambda a: None if a is None else jnp.asarray(a, jnp.float32)
  A0 = jnp.zeros((b, h, k), jnp.float32) if initial_state is None else f32(initial_state)
  return f32(beta), jnp.maximum(f32(log_decay), LOG_DECAY_FLOOR), A0


def check_segment_ids(where: str, segment_ids, shape, num_segments):
  """ValueError naming the argument unless `segment_ids` is an integer array of `shape` ([B, T]) and the static
  number of segments N is given."""
  if jnp.shape(segment_ids) != tuple(shape) or not jnp.issubdtype(jnp.result_type(segment_ids), jnp.integer):
    raise ValueError(f"{where}: `segment_ids` must be an integer array [B, T] = {tuple(shape)}, got "
                     f"{jnp.result_type(segment_ids)} {jnp.shape(segment_ids)}")
  if not num_segments:
    raise ValueError(f"{where}: with `segment_ids`, `num_segments` (N, static) must be given")


def static_number(where: str, name: str, x):
  """x as a Python float (None stays None); ValueError naming `name` when x is traced or not a number."""
  if x is None:
    return None
  try:
    return float(x)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise ValueError(f"{where}: `{name}` must be a static number, got {x!r}") from e
