"""Non-finite inputs stay where the recurrence puts them.

The contract is the token-serial oracle's. A NaN or ±inf at token t of a sequence in an input that enters the
state (k, k_write, v, β, or a log-decay that is NaN or +inf: −inf is clamped at LOG_DECAY_FLOOR and finite)
makes that sequence's outputs from t onward and its final state non-finite, in the value heads that read it; a
non-finite q_t only o_t; a non-finite initial state its whole sequence. Everything before t and every other
sequence (batch row or packed segment) keeps its clean value, and so do their input gradients. Where the oracle
keeps a finer grain the chunked paths may be coarser: a whole value head is NaN where the oracle's NaN can stay
in one value channel (a fault in one entry of v). Within a poisoned sequence the input gradients are the
implementation's: the XLA path makes them all NaN (q's from t onward), the kernels' backward leaves them
non-finite where the fault reaches, as the oracle's are from t onward.

The chunked XLA solve needs help to keep it: a chunk's tokens meet in matmuls, where a zero weight times a NaN
is NaN, so one bad token would reach the chunk's earlier rows and (through masked products) the other packed
sequences of its chunk. `careful` keeps the contract by construction: non-finite inputs are replaced by 0, the
solve runs on finite inputs, and NaN is written where the contract puts it (`Poison`). All of it is element-wise
work that fuses into the solve's own input and output passes, and a min per sequence of where its faults are
(`since_first`, which the preconditioners' chunked passes use too: `dgps.precond`).
The Pallas kernels run without it: each of their programs holds one sequence (a packed segment starts on a chunk
boundary of its own lane), so a fault never reaches another sequence, and they keep the rows of its own chunk
before it themselves (docs/faults.md).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from osdn_jax.ops import packing

# The per-token inputs that enter the state (q is read only); initial_state is per sequence.
STATE_INPUTS = ("k", "k_write", "v", "beta", "log_decay")


def _nonfinite(name: str, x):
  """[B, T, heads] bool: the token's entries of x [B, T, heads, ...] hold a NaN or ±inf (a log-decay: NaN or
  +inf, since −inf is clamped to a finite floor)."""
  bad = jnp.isnan(x) | (x == jnp.inf) if name == "log_decay" else ~jnp.isfinite(x)
  return jnp.any(bad, axis=tuple(range(3, x.ndim)))


def _to_value_heads(mask, value_heads: int):
  """[B, T, H] → [B, T, HV]: value head i reads head i // (HV/H)."""
  return mask if mask.shape[2] == value_heads else jnp.repeat(mask, value_heads // mask.shape[2], axis=2)


def _to_heads(mask, heads: int):
  """[B, T, HV] → [B, T, heads]: a key head is marked where any value head of its group is."""
  if mask.shape[2] == heads:
    return mask
  return jnp.any(mask.reshape(*mask.shape[:2], heads, -1), axis=-1)


class Poison(NamedTuple):
  """Where the contract puts NaN, per value head."""
  output: jax.Array     # [B, T, HV]: o_t is non-finite
  state: jax.Array      # [B, T, HV]: S_t is non-finite (the sequence was poisoned at or before t)
  sequence: jax.Array   # [B, T, HV]: t's sequence is poisoned somewhere (its final state is non-finite)


class Since(NamedTuple):
  """Where each sequence's first fault is, as masks over its tokens ([B, T, ...], the shape of the faults)."""
  at: jax.Array         # at or after the first fault of its sequence
  after: jax.Array      # strictly after it
  poisoned: jax.Array   # its sequence has a fault somewhere


def since_first(bad, segment_ids=None) -> Since:
  """The masks of `Since` for bad [B, T, ...] (each trailing entry on its own) and segment_ids None or [B, T]."""
  b, t = bad.shape[:2]
  tail = (1,) * (bad.ndim - 2)
  # A min over each sequence's tokens (a scatter-min over packed segments), not a running max along T, whose
  # GPU lowering is a reduce-window over the whole sequence (O(T²)).
  if segment_ids is None:
    pos = jnp.arange(t).reshape((1, t) + tail)
    first = jnp.min(jnp.where(bad, pos, t), axis=1, keepdims=True)               # [B, 1, ...]
    return Since(pos >= first, pos > first, jnp.broadcast_to(first < t, bad.shape))
  seg = packing.segment_index(segment_ids)                                       # [B, T]
  pos = (jnp.arange(b, dtype=jnp.int32)[:, None] * t + jnp.arange(t, dtype=jnp.int32)).reshape((b, t) + tail)
  never = b * t
  first = jnp.full((never,) + bad.shape[2:], never, jnp.int32).at[seg].min(jnp.where(bad, pos, never))[seg]
  return Since(pos >= first, pos > first, first < never)


def poison(arrays: dict, segment_ids=None) -> Poison:
  """The contract's NaN positions for the inputs `arrays` (q, k, v [, beta, k_write, log_decay,
  initial_state]: the solves' shapes, None where absent) and segment_ids None or [B, T]."""
  q, v = arrays["q"], arrays["v"]
  b, t, hv = v.shape[:3]
  bad = jnp.zeros((b, t, hv), bool)
  for name in STATE_INPUTS:
    if arrays.get(name) is not None:
      bad = bad | _to_value_heads(_nonfinite(name, arrays[name]), hv)
  since = since_first(bad, segment_ids)
  state, poisoned = since.at, since.poisoned
  s0 = arrays.get("initial_state")
  if s0 is not None:
    s0_bad = ~jnp.all(jnp.isfinite(s0), axis=(2, 3))                            # [N or B, HV]
    s0_bad = s0_bad[:, None] if segment_ids is None else s0_bad[packing.segment_index(segment_ids)]
    state, poisoned = state | s0_bad, poisoned | s0_bad
  sequence = jnp.broadcast_to(poisoned, bad.shape)
  output = state | _to_value_heads(_nonfinite("q", q), hv)
  return Poison(output, state, sequence)


def final_poison(p: Poison, segment_ids, num_segments: int):
  """[N, HV] (packed) or [B, HV]: whether each sequence's final state is non-finite."""
  if segment_ids is None:
    return p.sequence[:, -1]
  n = packing.segment_index(segment_ids)
  return jnp.zeros((num_segments, p.sequence.shape[2]), bool).at[n].max(p.sequence, mode="drop")


@jax.custom_vjp
def _nan_gradient(x, mask):
  """x, whose cotangent is NaN where mask (broadcast against x) is set."""
  return x


def _nan_gradient_fwd(x, mask):
  return x, mask


def _nan_gradient_bwd(mask, ct):
  return jnp.where(mask, jnp.nan, ct).astype(ct.dtype), None


_nan_gradient.defvjp(_nan_gradient_fwd, _nan_gradient_bwd)


def _expand(mask, x):
  """mask [B, T, heads] (or [N, HV]) with trailing axes of size 1 to broadcast against x."""
  return mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim))


def _sanitized(name: str, x, mask):
  """x with non-finite entries replaced by 0 and NaN gradients where mask [B, T, heads] is set."""
  x = _nan_gradient(x, _expand(mask, x))
  bad = jnp.isnan(x) | (x == jnp.inf) if name == "log_decay" else ~jnp.isfinite(x)
  return jnp.where(bad, jnp.zeros((), x.dtype), x)


def careful(solve: Callable[[dict, object], tuple], arrays: dict, segment_ids=None):
  """solve(arrays, segment_ids) → (o [B, T, HV, V], S or None) run on sanitised inputs, with NaN where the
  contract puts it. arrays as `poison` (other entries, e.g. a traced "scale", pass through)."""
  p = poison(arrays, segment_ids)
  hv = arrays["v"].shape[2]
  clean = dict(arrays)
  for name, x in arrays.items():
    if x is None or name not in STATE_INPUTS + ("q", "initial_state"):
      continue
    if name == "initial_state":
      clean[name] = _sanitized(name, x, final_poison(p, segment_ids, x.shape[0]))
      continue
    mask = p.output if name == "q" else p.sequence
    if x.ndim >= 3 and x.shape[2] != hv:
      mask = _to_heads(mask, x.shape[2])
    clean[name] = _sanitized(name, x, mask)
  o, S = solve(clean, segment_ids)
  o = jnp.where(p.output[..., None], jnp.asarray(jnp.nan, o.dtype), o)
  if S is not None:
    n = S.shape[0] if segment_ids is not None else None
    S = jnp.where(final_poison(p, segment_ids, n)[..., None, None], jnp.asarray(jnp.nan, S.dtype), S)
  return o, S
