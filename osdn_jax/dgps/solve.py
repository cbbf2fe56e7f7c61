"""The S axis: the online solve (delta rule) and the offline solve (linear attention), one signature.

`solve(kind, q, k, v, beta, k_write=None, q_tilde=None, log_decay=None, ...)`: the online solve writes with
k_write (default k); the offline one reads with q_tilde (default q) and takes β as an optional gain. A q_tilde on
the HV value heads (MesaNet's, one per value head's state) reads with the keys repeated to those heads.
"""
from __future__ import annotations

from osdn_jax import ops
from osdn_jax.ops import common as heads
from osdn_jax.ops import context as context_ops

KINDS = ("online", "offline")


def _read_heads(q, k, q_tilde, axis: int = 2):
  """(the read query, the keys on its heads): q_tilde (default q), and k repeated to q_tilde's heads when those are
  the value heads (value head i reads key head i // g)."""
  if q_tilde is None:
    return q, k
  return q_tilde, heads.expand_heads(k, q_tilde.shape[axis], axis=axis)


def solve(kind, q, k, v, beta=None, *, k_write=None, q_tilde=None, log_decay=None, initial_state=None,
          output_final_state=False, scale=None, chunk_size=64, segment_ids=None, implementation="auto",
          context=None):
  """context: None, or the mesh axis that splits T (inside `jax.shard_map`; `osdn_jax.ops.context`)."""
  common = dict(log_decay=log_decay, initial_state=initial_state, output_final_state=output_final_state,
                scale=scale, chunk_size=chunk_size, segment_ids=segment_ids, implementation=implementation)
  lib = ops if context is None else context_ops
  if context is not None:
    common["axis_name"] = context
  if kind == "online":
    return lib.delta_rule(q, k, v, beta, k_write=k_write, **common)
  if kind == "offline":
    q, k = _read_heads(q, k, q_tilde)
    return lib.linear_attention(q, k, v, beta=beta, **common)
  raise ValueError(f"solve: `kind` must be one of {KINDS}, got {kind!r}")


def step(kind, q, k, v, beta, state, *, k_write=None, q_tilde=None, log_decay=None, scale=None):
  """One token of the solve for decoding; shapes of `ops.delta_rule_step`."""
  if kind == "online":
    return ops.delta_rule_step(q, k, v, beta, state, k_write=k_write, log_decay=log_decay, scale=scale)
  if kind == "offline":
    q, k = _read_heads(q, k, q_tilde, axis=1)
    return ops.linear_attention_step(q, k, v, state, beta=beta, log_decay=log_decay, scale=scale)
  raise ValueError(f"solve: `kind` must be one of {KINDS}, got {kind!r}")
