"""Decay factors of one chunk inside a kernel, for every decay type (`Static.decay`).

G is the inclusive in-chunk cumsum of the log-decays: [C] (scalar) or [C, K] (per channel); G_C its last row.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gpu.chunk_math import F32, last_row


def chunk_rows(st, g_ref, t0, cols=None):
  """G of the chunk starting at token t0 from a whole-sequence ref: [C] or [C, K] (per channel: the K columns
  `cols`, a `pl.ds`, or all); None without decay."""
  if st.decay == "none":
    return None
  if st.decay == "scalar":
    return g_ref[pl.ds(t0, st.chunk)].astype(F32)
  return g_ref[pl.ds(t0, st.chunk), slice(None) if cols is None else cols].astype(F32)


def to_end(st, G):
  """(e^{G_C − G} as a row factor, e^{G_C} as a factor on the state's rows) for a chunk's G."""
  gl = last_row(G)
  if st.decay == "scalar":
    return jnp.exp(gl - G), jnp.exp(gl)
  return jnp.exp(gl[None, :] - G), jnp.exp(gl)[:, None]


def rows(g):
  """e^G as a row factor: [C] (scalar), [C, K] (per channel) or None (no decay)."""
  return None if g is None else jnp.exp(g)
