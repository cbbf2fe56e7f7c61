"""The token loops of the d-pass kernels and one token of the recurrence (`pre_clip`; the math is `osdn_math`'s).

Loads are issued for a whole group of tokens before the group's first step: a load written after the previous
token's stores could not be moved above them (the refs may alias), so a per-token load would put one memory
latency on the dependency chain per token.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels import osdn_math as om

F32 = jnp.float32


def run_tokens(load, step, ts, c, reverse: bool = False):
  """c ← step(t, load(t), c) over the tokens ts (unrolled; in reverse order when reverse), all loads first."""
  ts = list(reversed(ts)) if reverse else list(ts)
  xs = [load(t) for t in ts]
  for t, x in zip(ts, xs):
    c = step(t, x, c)
  return c


def sequential(st, load, step, carry, reverse: bool, block_t: int):
  """Runs carry ← step(t, load(t), carry) for t = 0 … T−1 (or T−1 … 0): a fori_loop over blocks of block_t
  tokens, the last T mod block_t tokens on their own; each block issues every load of its tokens, then runs
  the unrolled steps."""
  nf, rem = divmod(st.length, block_t)
  run = lambda ts, c: run_tokens(load, step, ts, c, reverse)

  def block(i, c):
    return run([i * block_t + j for j in range(block_t)], c)

  tail = lambda c: run([jnp.int32(nf * block_t + j) for j in range(rem)], c)
  zero, count = jnp.int32(0), jnp.int32(nf)
  if reverse:
    c = tail(carry)
    if nf:
      c = lax.fori_loop(zero, count, lambda i, c: block(count - 1 - i, c), c)
    return c
  c = carry
  if nf:
    c = lax.fori_loop(zero, count, block, c)
  return tail(c)


def pre_clip(st, d, u, b, n, r, o):
  """(d̄_{t+1}, coef_t, s_t) for one token (`osdn_math`): d, u, o [K] (o None unless anchor "init"), b, n, r
  scalars (r None: no retention)."""
  s = jnp.sum(d * u)
  coef = om.step_coef(st.eta, b, n, s)
  return om.unclipped(d, u, coef, r, o, st.mode), coef, s


def block_loop(nb: int, fetch, body, carry, *, prefetch: bool, reverse: bool = False, start=None, stop=None):
  """carry ← body(i, fetch(i), carry) over the blocks i = start … stop − 1 (stop − 1 … start when reverse;
  start 0 and stop nb unless given, traced or not, stop ≤ nb). With prefetch, block i's loads (everything but
  the carry, which they do not depend on) are issued one iteration early, during the previous block's math, so
  their memory latency is off the dependency chain; the loop then carries them (twice the registers for the
  block's tiles)."""
  zero = jnp.int32(0) if start is None else start
  count = jnp.int32(nb) if stop is None else stop
  order = (lambda i: zero + count - 1 - i) if reverse else (lambda i: i)
  if not prefetch:
    return lax.fori_loop(zero, count, lambda i, c: body(order(i), fetch(order(i)), c), carry)

  def step(i, c):
    c, x = c
    nxt = fetch(order(jnp.minimum(i + 1, count - 1)))
    return body(order(i), x, c), nxt
  return lax.fori_loop(zero, count, step, (carry, fetch(order(zero))))[0]


def sequential_tokens(st, load, step, start, count: int, block_t: int, c, reverse: bool = False):
  """step over tokens start … start + count − 1 (count static; in reverse order when reverse), in unrolled
  groups of ≤ block_t tokens."""
  groups = [[start + j for j in range(g0, min(count, g0 + block_t))] for g0 in range(0, count, block_t)]
  for ts in (reversed(groups) if reverse else groups):
    c = run_tokens(load, step, ts, c, reverse)
  return c
