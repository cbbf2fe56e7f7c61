"""Packed sequences: the `segment_ids` convention and conversions to and from FLA-style `cu_seqlens`.

`segment_ids` is an int array [B, T], non-decreasing along T in each row. A segment is a maximal run of equal
ids within a row: a new segment starts at t = 0 and wherever the id changes. Segments are numbered
n = 0..N-1 in row-major order of appearance (row 0's segments in order, then row 1's, ...), so the id values
only mark boundaries. Per-segment states (initial and final) are [N, HV, K, V] in that order.

`segment_starts` and `segment_index` trace under `jax.jit`; `num_segments` and `cu_seqlens_from_segment_ids`
need concrete ids (host-side numpy).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def segment_starts(segment_ids):
  """[B, T] bool: True at the first token of every segment (t = 0 and wherever the id changes)."""
  ids = jnp.asarray(segment_ids)
  first = jnp.ones(ids.shape[:1] + (1,), bool)
  return jnp.concatenate([first, ids[:, 1:] != ids[:, :-1]], axis=1)


def segment_index(segment_ids):
  """[B, T] int32: the segment number n of every token, counted in row-major order of appearance."""
  starts = segment_starts(segment_ids)
  return (jnp.cumsum(starts.reshape(-1).astype(jnp.int32)) - 1).reshape(starts.shape)


def _host_starts(segment_ids) -> np.ndarray:
  ids = np.asarray(segment_ids)
  if ids.ndim != 2:
    raise ValueError(f"`segment_ids` must be of shape [B, T], got shape {ids.shape}")
  starts = np.ones(ids.shape, bool)
  starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
  return starts


def num_segments(segment_ids) -> int:
  """N, the number of segments of concrete `segment_ids` [B, T] (host-side)."""
  return int(_host_starts(segment_ids).sum())


def segment_ids_from_cu_seqlens(cu_seqlens, total_length: int | None = None):
  """FLA-style cumulative lengths [0, l0, l0 + l1, ..., T] (one packed row) → segment_ids [1, T] int32.

  Token t gets the number of the segment that holds it. total_length defaults to cu_seqlens[-1] (needs a
  concrete cu_seqlens); tokens at or after cu_seqlens[-1] form one extra trailing segment (padding).
  """
  cu = jnp.asarray(cu_seqlens, jnp.int32)
  if total_length is None:
    total_length = int(np.asarray(cu_seqlens)[-1])
  ids = jnp.searchsorted(cu, jnp.arange(total_length, dtype=jnp.int32), side="right") - 1
  return ids.astype(jnp.int32)[None]


def cu_seqlens_from_segment_ids(segment_ids) -> np.ndarray:
  """segment_ids [1, T] (concrete) → cu_seqlens [N + 1] int32 = [0, l0, l0 + l1, ..., T] (host-side)."""
  starts = _host_starts(segment_ids)
  if starts.shape[0] != 1:
    raise ValueError(f"`segment_ids` must be one packed row [1, T] for cu_seqlens, got shape {starts.shape}")
  return np.append(np.flatnonzero(starts[0]), starts.shape[1]).astype(np.int32)
