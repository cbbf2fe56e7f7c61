"""Up-front validation of the public ops' arguments.

Every check runs on static shapes and dtypes, before anything is traced, and raises a `ValueError` that names
the argument and the shape or dtype it should have. The result is the request `Spec` (`pallas_kernels.spec`)
that the dispatch hands to the kernels and the implementations read the decay type and head grouping from.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from osdn_jax import checking
from osdn_jax.ops import dispatch, packing
from osdn_jax.ops.common import CHUNK_SIZES
from osdn_jax.ops.dispatch import Spec

_FLOAT_INPUTS = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)


def _shape(x) -> tuple[int, ...]:
  return tuple(np.shape(x))


def _fail(op: str, name: str, expected: str, got) -> ValueError:
  return ValueError(f"{op}: `{name}` must be {expected}, got {got}")


def _check_float(op: str, name: str, x, *, allowed=_FLOAT_INPUTS) -> None:
  if not hasattr(x, "dtype"):   # a list or a Python number: its dtype would be a guess
    raise _fail(op, name, "an array (jax.Array or numpy.ndarray)", type(x).__name__)
  dtype = jnp.result_type(x)
  if not any(dtype == jnp.dtype(a) for a in allowed):
    names = ", ".join(jnp.dtype(a).name for a in allowed)
    raise _fail(op, name, f"a floating array ({names})", f"dtype {dtype}")


def _check_shape(op: str, name: str, x, expected: tuple[int, ...], layout: str) -> None:
  if x is None:
    raise _fail(op, name, f"an array of shape {layout} = {tuple(expected)}", "None")
  if _shape(x) != tuple(expected):
    raise _fail(op, name, f"of shape {layout} = {tuple(expected)}", f"shape {_shape(x)}")


def _decay_kind(op: str, log_decay, b, t, hv, kd) -> str:
  if log_decay is None:
    return "none"
  lead = (b, hv) if t is None else (b, t, hv)
  lay = "[B, HV]" if t is None else "[B, T, HV]"
  lay_c = "[B, HV, K]" if t is None else "[B, T, HV, K]"
  shape = _shape(log_decay)
  _check_float(op, "log_decay", log_decay)
  if shape == lead:
    return "scalar"
  if shape == lead + (kd,):
    return "channel"
  raise _fail(op, "log_decay", f"of shape {lay} = {lead} (scalar decay) or {lay_c} = {lead + (kd,)} "
              "(per-channel decay)", f"shape {shape}")


def _check_common(op, q, k, v, scale, chunk_size, implementation, step: bool, output_final_state=False):
  qs = _shape(q)
  rank = 3 if step else 4
  layout = "[B, H, K]" if step else "[B, T, H, K]"
  if len(qs) != rank:
    raise _fail(op, "q", f"a rank-{rank} array {layout}", f"shape {qs}")
  _check_float(op, "q", q)
  _check_shape(op, "k", k, qs, layout)
  _check_float(op, "k", k)
  if jnp.result_type(k) != jnp.result_type(q):
    raise _fail(op, "k", f"of q's dtype {jnp.result_type(q)}", f"dtype {jnp.result_type(k)}")
  vs = _shape(v)
  vlay = "[B, HV, V]" if step else "[B, T, HV, V]"
  lead = qs[:-2]
  h, kd = qs[-2:]
  if h == 0 or kd == 0:
    raise _fail(op, "q", f"of shape {layout} with H ≥ 1 and K ≥ 1", f"shape {qs}")
  if len(vs) != rank or vs[:-2] != lead or vs[-2] % h != 0 or vs[-2] == 0 or vs[-1] == 0:
    raise _fail(op, "v", f"of shape {vlay} with {lead} leading, HV a multiple of H = {h} and V ≥ 1",
                f"shape {vs}")
  _check_float(op, "v", v)
  if jnp.result_type(v) != jnp.result_type(q):
    raise _fail(op, "v", f"of q's dtype {jnp.result_type(q)}", f"dtype {jnp.result_type(v)}")
  _check_scale(op, scale)
  _check_bool(op, "output_final_state", output_final_state)
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size not in CHUNK_SIZES:
    raise _fail(op, "chunk_size", f"an int, one of {CHUNK_SIZES}", repr(chunk_size))
  dispatch.normalize(op, implementation)
  return qs, vs


def _check_scale(op, scale) -> None:
  """scale: None or a real scalar (a Python number or a 0-d real array), finite where its value is known."""
  if scale is None:
    return
  if isinstance(scale, (bool, str, bytes)) or _shape(scale) != ():
    raise _fail(op, "scale", "a real scalar or None", f"{scale!r}")
  try:
    dtype = jnp.result_type(scale)
  except TypeError:
    raise _fail(op, "scale", "a real scalar or None", f"{scale!r}") from None
  if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
    raise _fail(op, "scale", "a real scalar or None", f"{scale!r} of dtype {dtype}")
  value = checking.concrete(scale)
  if value is not None and not np.isfinite(value):
    raise _fail(op, "scale", "finite", repr(float(value)))


def _check_bool(op: str, name: str, value) -> None:
  """A flag: a Python or numpy bool (a string such as "no" would read as true)."""
  if not isinstance(value, (bool, np.bool_)):
    raise _fail(op, name, "a bool", repr(value))


def _check_state(op, name, state, b, hv, kd, vd, lead_name="B"):
  if state is None:
    return
  _check_shape(op, name, state, (b, hv, kd, vd), f"[{lead_name}, HV, K, V]")
  _check_float(op, name, state, allowed=(jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16))


def _check_segments(op, segment_ids, initial_state, output_final_state, b, t) -> int | None:
  """Validates `segment_ids` [B, T]; returns N (B when unpacked; None when traced ids leave it unknown)."""
  if segment_ids is None:
    return b
  if _shape(segment_ids) != (b, t):
    raise _fail(op, "segment_ids", f"of shape [B, T] = {(b, t)}", f"shape {_shape(segment_ids)}")
  if not jnp.issubdtype(jnp.result_type(segment_ids), jnp.integer):
    raise _fail(op, "segment_ids", "an integer array", f"dtype {jnp.result_type(segment_ids)}")
  ids = checking.concrete(segment_ids)
  if ids is not None:
    _check_id_range(op, ids)
    if t > 1 and np.any(ids[:, 1:] < ids[:, :-1]):
      row, col = np.argwhere(ids[:, 1:] < ids[:, :-1])[0]
      raise _fail(op, "segment_ids", "non-decreasing along T in each row",
                  f"a decrease at [{row}, {col + 1}] ({ids[row, col]} → {ids[row, col + 1]})")
    return packing.num_segments(ids)
  n = _shape(initial_state)[0] if initial_state is not None and np.ndim(initial_state) >= 1 else None
  _require_segments(op, segment_ids, n)
  if n is not None:
    return n
  if output_final_state:
    raise ValueError(f"{op}: with traced `segment_ids` the number of segments N is unknown; pass "
                     "`initial_state` of shape [N, HV, K, V] (zeros are fine) so that N is static")
  return None


def _check_id_range(op, ids: np.ndarray) -> None:
  """Concrete ids must keep their values in the dtype JAX casts them to (int32 with jax_enable_x64 off): a
  truncated id could merge two segments."""
  cast = jax.dtypes.canonicalize_dtype(ids.dtype)
  if cast == ids.dtype or not ids.size:
    return
  info = np.iinfo(cast)
  bad = (ids < info.min) | (ids > info.max)
  if np.any(bad):
    at = tuple(int(i) for i in np.argwhere(bad)[0])
    raise _fail(op, "segment_ids", f"ids in [{info.min}, {info.max}] (JAX casts {ids.dtype.name} to "
                f"{cast.name} with jax_enable_x64 off)", f"{ids[at]} at {list(at)}")


def _require_segments(op, segment_ids, n) -> None:
  """Checked mode (`osdn_jax.checking`) for traced ids: non-decreasing rows and, when N is given, N segments."""
  ids = jnp.asarray(segment_ids)
  if ids.shape[1] > 1:
    down = ids[:, 1:] < ids[:, :-1]
    first = jnp.argmax(down.reshape(-1))
    row, col = first // (ids.shape[1] - 1), first % (ids.shape[1] - 1) + 1
    checking.require(~jnp.any(down), f"{op}: `segment_ids` must be non-decreasing along T in each row, got a "
                     "decrease at [{}, {}]", row, col)
  if n is not None:
    count = jnp.sum(packing.segment_starts(ids)) if ids.size else jnp.int32(0)
    checking.require(count == n, f"{op}: `segment_ids` hold {{}} segments but `initial_state` is for N = {n} "
                     "(its leading axis)", count)


def check_solve(op: str, q, k, v, *, beta=None, beta_required=True, k_write=None, log_decay=None,
                initial_state=None, scale=None, chunk_size=64, segment_ids=None, output_final_state=False,
                implementation="auto", kernel_config=None) -> Spec:
  """Validates the arguments of `delta_rule` / `linear_attention`; returns their `Spec` (carrying
  `kernel_config`).

  With `segment_ids`, Spec.num_segments is N: counted from concrete ids (and then initial_state must be
  [N, HV, K, V]), else initial_state.shape[0], else None (allowed only without output_final_state).
  """
  qs, vs = _check_common(op, q, k, v, scale, chunk_size, implementation, step=False,
                         output_final_state=output_final_state)
  b, t, h, kd = qs
  hv, vd = vs[2], vs[3]
  if beta is None:
    if beta_required:
      raise _fail(op, "beta", f"an array of shape [B, T, HV] = {(b, t, hv)}", "None")
  else:
    _check_shape(op, "beta", beta, (b, t, hv), "[B, T, HV]")
    _check_float(op, "beta", beta)
  if k_write is not None:
    if _shape(k_write) not in ((b, t, h, kd), (b, t, hv, kd)):
      raise _fail(op, "k_write", f"of shape [B, T, H, K] = {(b, t, h, kd)} or [B, T, HV, K] = "
                  f"{(b, t, hv, kd)}", f"shape {_shape(k_write)}")
    _check_float(op, "k_write", k_write)
  decay = _decay_kind(op, log_decay, b, t, hv, kd)
  n = _check_segments(op, segment_ids, initial_state, output_final_state, b, t)
  _check_state(op, "initial_state", initial_state, n, hv, kd, vd, "B" if segment_ids is None else "N")
  dispatch.check_config(op, kernel_config)
  return dispatch.spec(op, jnp.result_type(q), key_dim=kd, value_dim=vd, batch=b, length=t, heads=h,
                       value_heads=hv, decay=decay, chunk_size=chunk_size, packed=segment_ids is not None,
                       num_segments=n, config=kernel_config)


def check_context(op: str, q, k, v, *, initial_state=None, segment_ids=None, output_final_state=False, scale=None,
                  chunk_size=64, implementation="auto") -> None:
  """Validates what the context-parallel solves (`ops.context`) read before their local solve: the local tokens
  q, k [B, T/P, H, K], v [B, T/P, HV, V], and the whole rows' initial_state [B, HV, K, V] ([N, HV, K, V] when
  packed; N is then its leading axis). The local solve checks the rest."""
  qs, vs = _check_common(op, q, k, v, scale, chunk_size, implementation, step=False,
                         output_final_state=output_final_state)
  b, kd, hv, vd = qs[0], qs[3], vs[2], vs[3]
  if segment_ids is None:
    _check_state(op, "initial_state", initial_state, b, hv, kd, vd)
  elif initial_state is not None:
    n = _shape(initial_state)[0] if np.ndim(initial_state) >= 1 else None
    _check_state(op, "initial_state", initial_state, n, hv, kd, vd, "N")


def check_step(op: str, q, k, v, state, *, beta=None, beta_required=True, k_write=None, log_decay=None,
               scale=None) -> Spec:
  """Validates the arguments of the one-token steps (decoding); returns their `Spec`."""
  qs, vs = _check_common(op, q, k, v, scale, 64, "auto", step=True)
  b, h, kd = qs
  hv, vd = vs[1], vs[2]
  if beta is None:
    if beta_required:
      raise _fail(op, "beta", f"an array of shape [B, HV] = {(b, hv)}", "None")
  else:
    _check_shape(op, "beta", beta, (b, hv), "[B, HV]")
    _check_float(op, "beta", beta)
  if k_write is not None:
    if _shape(k_write) not in ((b, h, kd), (b, hv, kd)):
      raise _fail(op, "k_write", f"of shape [B, H, K] = {(b, h, kd)} or [B, HV, K] = {(b, hv, kd)}",
                  f"shape {_shape(k_write)}")
    _check_float(op, "k_write", k_write)
  decay = _decay_kind(op, log_decay, b, None, hv, kd)
  if state is None:
    raise _fail(op, "state", f"an array of shape [B, HV, K, V] = {(b, hv, kd, vd)}", "None")
  _check_state(op, "state", state, b, hv, kd, vd)
  return dispatch.spec(op.removesuffix("_step"), jnp.result_type(q), key_dim=kd, value_dim=vd, batch=b,
                       length=None, heads=h, value_heads=hv, decay=decay, num_segments=b)
