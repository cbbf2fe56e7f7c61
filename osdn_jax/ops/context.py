"""Context parallelism: the T axis of every sequence split over a mesh axis, inside `jax.shard_map`.

Each function here runs inside a `shard_map` whose in_specs split the T axis of the per-token arrays over
`axis_name`: shard i of P holds tokens [i·T/P, (i+1)·T/P) of every row. Initial states are whole on every shard,
and so are the final states that come back.

The solves are affine in their initial state. With a shard's tokens fixed, the state after them is
S_out = M S_in + N, and every output is o_t = o⁰_t + S_inᵀ (M_{≤t}ᵀ scale·q_t), where o⁰ and N are those of a
start from zero and M_{≤t} is the state map up to token t. One local solve gives all of them: the value columns
are widened by K columns that start from the identity and receive zero values, so they carry M_{≤t} (their
read-out is the correction's coefficient and their final value is M), while the value columns start from zero.
The shards' (M, N) are gathered on every shard, each shard composes the maps before its own (P small) to get
S_in, and corrects its outputs with one [K] × [K, V] product per token. Backward is autodiff through the same.

Packed sequences: only the first segment of a row on a shard can continue from the previous shard, so only it
starts from [0 | I]; the row's other segments start from their own initial states with zero identity columns
and need no correction. A row's map is that of its last segment on the shard (M = 0 when that segment starts on
the shard). Segments are numbered as in `packing` over the whole rows.

Preconditioner states: the PDN/ATQ second moment is diagonal-affine in its initial state, so two local passes
give each shard's map and one gather composes them (`carry_diagonal`). OSDN's d is clipped, so not affine: it
passes as a ring (`carry`), P − 1 rounds in which every shard runs its pass from its current guess and hands its
final state to the next; after round r the first r + 1 shards hold their exact initial states.

Faults (docs/faults.md): the maps are composed on finite values with their non-finite heads as a mask beside
them, so a NaN is never multiplied into a segment that does not read it, in values or in gradients.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from osdn_jax.ops import api, checks, common, packing


class Shards(NamedTuple):
  """Where the local tokens sit in the whole rows, for one shard; per-segment arrays are over the local state
  slots (B of them unpacked, N packed: the local solve numbers its segments 0.. in row-major order)."""
  axis: str
  size: int                 # P, static
  index: jax.Array          # this shard's position i
  cont: jax.Array           # [P, B] bool: row b's first segment on shard i continues from shard i − 1
  first: jax.Array          # [P, B] global number of that segment
  slot_global: jax.Array    # [S] global segment number of each local slot (0 for unused slots)
  slot_row: jax.Array       # [S] its row
  slot_first: jax.Array     # [S] bool: the first segment of its row on this shard
  slot_ends: jax.Array      # [S] bool: its segment ends on this shard (False for unused slots)
  row_last: jax.Array       # [B] the slot of the row's last segment on this shard


def axis_size(axis_name: str) -> int:
  """P, the size of a mapped axis, as a Python int."""
  return lax.axis_size(axis_name) if hasattr(lax, "axis_size") else lax.psum(1, axis_name)


def shards(axis_name: str, batch: int, segment_ids=None, num_segments: int | None = None) -> Shards:
  """The layout of this shard's tokens; segment_ids: None or the local [B, T/P] ids; num_segments: N, the
  segments of the whole rows (static), required when packed."""
  p = axis_size(axis_name)
  i = lax.axis_index(axis_name)
  shard = jnp.arange(p)[:, None]
  if segment_ids is None:
    rows = jnp.arange(batch, dtype=jnp.int32)
    return Shards(axis_name, p, i, cont=jnp.broadcast_to(shard > 0, (p, batch)),
                  first=jnp.broadcast_to(rows, (p, batch)), slot_global=rows, slot_row=rows,
                  slot_first=jnp.ones(batch, bool), slot_ends=jnp.broadcast_to(i == p - 1, (batch,)),
                  row_last=rows)
  if num_segments is None:
    raise ValueError("context parallelism with `segment_ids` needs N static: pass `initial_state` [N, ...] "
                     "(zeros are fine)")
  ids = jnp.asarray(segment_ids)
  starts = packing.segment_starts(ids)                               # local: t = 0 always starts
  count = jnp.sum(starts, axis=1, dtype=jnp.int32)                   # [B] local segments per row
  gather = lambda x: lax.all_gather(x, axis_name)                    # [P, ...]
  first_id, last_id, counts = gather(ids[:, 0]), gather(ids[:, -1]), gather(count)
  cont = jnp.concatenate([jnp.zeros((1, batch), bool), first_id[1:] == last_id[:-1]], axis=0)
  new = counts - cont.astype(jnp.int32)                              # [P, B] segments that start on shard i
  per_row = jnp.sum(new, axis=0)
  row_offset = jnp.cumsum(per_row) - per_row                         # [B]
  first = row_offset[None] + jnp.cumsum(new, axis=0) - new - cont.astype(jnp.int32)
  rank = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1             # the local segment's rank in its row
  token_global = first[i][:, None] + rank
  slot = packing.segment_index(ids)
  n = num_segments
  slot_global = jnp.zeros(n, jnp.int32).at[slot].set(token_global, mode="drop")
  row_of_token = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], ids.shape)
  slot_row = jnp.zeros(n, jnp.int32).at[slot].set(row_of_token, mode="drop")
  row_first = jnp.cumsum(count) - count
  row_last = row_first + count - 1
  slot_first = jnp.zeros(n, bool).at[row_first].set(True, mode="drop")
  used = jnp.arange(n) < jnp.sum(count)
  cont_next = jnp.concatenate([cont[1:], jnp.zeros((1, batch), bool)], axis=0)[i]   # [B]
  passes_on = (jnp.arange(n) == row_last[slot_row]) & cont_next[slot_row]
  return Shards(axis_name, p, i, cont, first, slot_global, slot_row, slot_first, used & ~passes_on, row_last)


def slot_states(rows, initial, sh: Shards):
  """The local slots' initial states: a row's first slot takes rows[b] (what enters the shard), every other slot
  its segment's own initial[global n]. rows [B, ...], initial [N_or_B, ...] → [S, ...]."""
  own = initial[sh.slot_global]
  enter = rows[sh.slot_row]
  pick = sh.slot_first.reshape((-1,) + (1,) * (own.ndim - 1))
  return jnp.where(pick, enter, own)


def entering(rows_initial, sh: Shards, i):
  """What enters row b's first segment on shard i when it does not continue: its own initial state."""
  return rows_initial[sh.first[i]]


def whole_finals(local, initial, sh: Shards):
  """Per-segment final states of the whole rows from each shard's local ones [S, ...]: each segment's from the
  shard where it ends (segments that end nowhere, i.e. unused numbers, keep `initial`)."""
  mask = sh.slot_ends.reshape((-1,) + (1,) * (local.ndim - 1))
  ends = jnp.zeros(initial.shape, local.dtype).at[sh.slot_global].add(jnp.where(mask, local, 0))
  hit = jnp.zeros(initial.shape[:1], jnp.int32).at[sh.slot_global].add(sh.slot_ends.astype(jnp.int32))
  ends, hit = lax.psum((ends, hit), sh.axis)
  return jnp.where((hit > 0).reshape((-1,) + (1,) * (local.ndim - 1)), ends, initial.astype(local.dtype))


def carry_diagonal(run: Callable, initial, sh: Shards):
  """Exact initial states for a pass whose final state is diagonal-affine in its initial state (the PDN/ATQ
  second moment: A_T = a ⊙ A_0 + b), from two local passes (from 0 and from 1: b and a + b) and one gather.

  run, initial and the result as in `carry`."""
  rows = lambda value: jnp.full((sh.cont.shape[1],) + initial.shape[1:], value, initial.dtype)
  b = run(slot_states(rows(0), initial, sh))[sh.row_last]
  a = run(slot_states(rows(1), initial, sh))[sh.row_last] - b
  # Composed on finite values with the non-finite entries as a mask (as `_entering_state`): a NaN scale times the
  # zero cotangent of a row that does not continue would be NaN in the earlier shards' gradients.
  bad_map = ~(jnp.isfinite(a) & jnp.isfinite(b))
  scales, offsets, bad_maps = (lax.all_gather(x, sh.axis) for x in (_zeroed(a), _zeroed(b), bad_map))
  state = mine = _zeroed(entering(initial, sh, 0))
  bad = mine_bad = ~jnp.isfinite(entering(initial, sh, 0))
  for i in range(1, sh.size):
    cont = sh.cont[i].reshape((-1,) + (1,) * (state.ndim - 1))
    own = entering(initial, sh, i)
    state = jnp.where(cont, scales[i - 1] * state + offsets[i - 1], _zeroed(own))
    bad = jnp.where(cont, bad | bad_maps[i - 1], ~jnp.isfinite(own))
    mine = jnp.where(sh.index == i, state, mine)
    mine_bad = jnp.where(sh.index == i, bad, mine_bad)
  return slot_states(jnp.where(mine_bad, jnp.asarray(jnp.nan, mine.dtype), mine), initial, sh)


def _zeroed(x):
  return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


def carry(run: Callable, initial, sh: Shards):
  """Exact initial states for a pass that is not affine in its state, by a ring over the shards.

  run(slot_initial [S, ...]) → slot finals [S, ...]: the local pass; initial: [N_or_B, ...] the whole rows'
  initial states. Returns the local slots' initial states [S, ...]."""
  own = entering(initial, sh, sh.index)                               # [B, ...]
  cont = sh.cont[sh.index].reshape((-1,) + (1,) * (own.ndim - 1))

  def round_(_, rows):
    passed = run(slot_states(rows, initial, sh))[sh.row_last]
    passed = lax.ppermute(passed, sh.axis, [(j, j + 1) for j in range(sh.size - 1)])
    return jnp.where(cont, passed, own)

  rows = lax.fori_loop(0, sh.size - 1, round_, own)
  return slot_states(rows, initial, sh)


def _solve(op, q, k, v, beta, *, axis_name, k_write=None, log_decay=None, initial_state=None,
           output_final_state=False, scale=None, chunk_size=64, segment_ids=None, implementation="auto"):
  checks.check_context(f"context.{op}", q, k, v, initial_state=initial_state, segment_ids=segment_ids,
                       output_final_state=output_final_state, scale=scale, chunk_size=chunk_size,
                       implementation=implementation)
  b, _, hv, vd = v.shape
  kd = k.shape[-1]
  ct = common.compute_dtype(q.dtype)
  packed = segment_ids is not None
  n = initial_state.shape[0] if initial_state is not None else (None if packed else b)
  sh = shards(axis_name, b, segment_ids, n)
  initial = (jnp.zeros((n, hv, kd, vd), ct) if initial_state is None else jnp.asarray(initial_state, ct))
  eye = jnp.broadcast_to(jnp.eye(kd, dtype=ct), (n, hv, kd, kd))
  start = jnp.concatenate([slot_states(jnp.zeros((b, hv, kd, vd), ct), initial, sh),
                           slot_states(eye[:1].repeat(b, 0), jnp.zeros_like(eye), sh)], axis=-1)
  wide = jnp.concatenate([v, jnp.zeros(v.shape[:-1] + (kd,), v.dtype)], axis=-1)
  kw = dict(log_decay=log_decay, initial_state=start, output_final_state=True, scale=scale, chunk_size=chunk_size,
            segment_ids=segment_ids, implementation=implementation)
  if op == "delta_rule":
    o_wide, final = api.delta_rule(q, k, wide, beta, k_write=k_write, **kw)
  else:
    o_wide, final = api.linear_attention(q, k, wide, beta=beta, **kw)
  last = final[sh.row_last]                                          # [B, HV, K, V + K]
  maps = lax.all_gather(last[..., vd:], axis_name)                   # M [P, B, HV, K, K]
  offsets = lax.all_gather(last[..., :vd], axis_name)                # N [P, B, HV, K, V]
  mine, poisoned = _entering_state(maps, offsets, initial, sh)
  first = _first_segment(segment_ids, o_wide.shape[:2])[..., None, None]
  coef = _reading(o_wide[..., vd:].astype(ct), first)
  o = o_wide[..., :vd].astype(ct) + jnp.einsum("bthk,bhkv->bthv", coef, mine, precision=lax.Precision.HIGHEST)
  o = jnp.where(first & poisoned[:, None, :, None], jnp.nan, o).astype(q.dtype)
  if not output_final_state:
    return o, None
  slot_first = sh.slot_first[:, None, None, None]
  coef = _reading(final[..., vd:], slot_first)
  local = final[..., :vd] + jnp.einsum("shkj,shjv->shkv", coef, mine[sh.slot_row], precision=lax.Precision.HIGHEST)
  local = jnp.where(slot_first & poisoned[sh.slot_row][..., None, None], jnp.nan, local)
  return o, whole_finals(local, initial, sh)


def _reading(coef, reads):
  """The coefficients of the entering state where `reads` (a row's first segment on the shard) and finite, else 0.

  The other segments' are zero, and a segment poisoned on this shard has NaN ones next to its NaN local values:
  multiplied, a NaN would reach the entering state's gradient (times a zero cotangent) and, through it, the
  earlier segments' inputs. Dropped, the values stay NaN where the local solve put NaN."""
  return jnp.where(reads & jnp.isfinite(coef), coef, jnp.zeros((), coef.dtype))


def _finite(x):
  """(x with its non-finite entries 0, [..., HV] whether a head's [K, V] block held one)."""
  return _zeroed(x), ~jnp.all(jnp.isfinite(x), axis=(-2, -1))


def _entering_state(maps, offsets, initial, sh: Shards):
  """The state entering this shard's rows [B, HV, K, V] and [B, HV] whether it is non-finite.

  The shards' maps are composed on finite values and the non-finite heads carried beside them as a mask: a NaN
  in a map or a state is not multiplied anywhere, so it reaches neither the rows that do not continue (a zero
  weight times a NaN, in values or in the gradient of a `where`) nor the segments that read no entering state."""
  (maps, bad_m), (offsets, bad_n) = _finite(maps), _finite(offsets)
  rows, bad = _finite(entering(initial, sh, 0))
  mine, mine_bad = rows, bad
  for i in range(1, sh.size):                                        # S_in of shard i, for every i; keep ours
    after = jnp.einsum("bhkj,bhjv->bhkv", maps[i - 1], rows, precision=lax.Precision.HIGHEST) + offsets[i - 1]
    own, own_bad = _finite(entering(initial, sh, i))
    cont = sh.cont[i][:, None]
    bad = jnp.where(cont, bad | bad_m[i - 1] | bad_n[i - 1], own_bad)
    rows = jnp.where(cont[..., None, None], after, own)
    mine = jnp.where(sh.index == i, rows, mine)
    mine_bad = jnp.where(sh.index == i, bad, mine_bad)
  return mine, mine_bad


def _first_segment(segment_ids, shape):
  """[B, T/P] bool: the local tokens of each row's first segment on the shard (those reading the entering state)."""
  if segment_ids is None:
    return jnp.ones(shape, bool)
  return jnp.cumsum(packing.segment_starts(segment_ids), axis=1) == 1


def delta_rule(q, k, v, beta, *, axis_name: str, k_write=None, log_decay=None, initial_state=None,
               output_final_state=False, scale=None, chunk_size=64, segment_ids=None, implementation="auto"):
  """`osdn_jax.ops.delta_rule` over sequences split along T over `axis_name` (call inside `shard_map`).

  Arguments as `ops.delta_rule` with the local tokens ([B, T/P, ...], segment_ids the local [B, T/P] ids of the
  whole rows' segments) and the whole rows' initial_state ([B, ...], or [N, ...] when packed: required then,
  zeros are fine). Returns the local o and the whole rows' final states (the same on every shard)."""
  return _solve("delta_rule", q, k, v, beta, axis_name=axis_name, k_write=k_write, log_decay=log_decay,
                initial_state=initial_state, output_final_state=output_final_state, scale=scale,
                chunk_size=chunk_size, segment_ids=segment_ids, implementation=implementation)


def linear_attention(q, k, v, *, axis_name: str, beta=None, log_decay=None, initial_state=None,
                     output_final_state=False, scale=None, chunk_size=64, segment_ids=None, implementation="auto"):
  """`osdn_jax.ops.linear_attention` over sequences split along T over `axis_name`; as `delta_rule` here."""
  return _solve("linear_attention", q, k, v, beta, axis_name=axis_name, log_decay=log_decay,
                initial_state=initial_state, output_final_state=output_final_state, scale=scale,
                chunk_size=chunk_size, segment_ids=segment_ids, implementation=implementation)
