"""`decayed_tiles`: per-channel decay's pre-decayed operands for the state passes (`State.predecay`).
Grid (B, HV, NC).

K̃ ⊙ e^{G_C − G} (and Q ⊙ e^G) [B, HV, T, K] in the state dtype, formed once per chunk instead of at every step of
the serial chunk loops, which then load them straight into their dots. Rounded as the loops would round them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gpu.chunk_math import last_row, row_scale
from pallas_kernels.gpu.common import pallas_call, split_refs
from pallas_kernels.gpu.delta_rule import layout as L
from pallas_kernels.gpu.intra import ALL, load


def _kernel(st, *refs):
  kw_ref, g_ref, q_ref, k_decayed_ref, q_decayed_ref = split_refs(refs, 1, 1, len(refs) == 5, 1, len(refs) == 5)
  G = load(g_ref, ALL)
  k_decayed_ref[...] = row_scale(load(kw_ref, ALL), jnp.exp(last_row(G)[None, :] - G)).astype(k_decayed_ref.dtype)
  if q_ref is not None:
    q_decayed_ref[...] = row_scale(load(q_ref, ALL), jnp.exp(G)).astype(q_decayed_ref.dtype)


def decayed_tiles(st: L.Static, kw, G, q=None):
  """Per-channel decay, `Static.predecay`: K̃ ⊙ e^{G_C − G} (and with q also Q ⊙ e^G) [B, HV, T, K] in st.mm,
  the operands the state passes would otherwise form from K̃ (Q) and G at every chunk step. Rounded as there."""
  w = L.chunk_grid
  in_specs = [L.tokens(st, st.key_dim, w, st.kw_head), L.decay_spec(st, w)]
  args = [kw, G]
  if q is not None:
    in_specs.append(L.tokens(st, st.key_dim, w, st.key_head))
    args.append(q)
  n = 1 + (q is not None)
  shape = jax.ShapeDtypeStruct((st.batch, st.value_heads, st.length, st.key_dim), st.mm)
  out = pallas_call(lambda *refs: _kernel(st, *refs), grid=(st.batch, st.value_heads, st.num_chunks),
                    in_specs=in_specs, out_specs=[L.head_major(st, st.key_dim, w)] * n, out_shape=[shape] * n,
                    interpret=st.interpret, num_warps=st.config.output.warps, num_stages=st.stages,
                    fp32_dots=st.fp32_dots, name="delta_rule_decayed_tiles")(*args)
  return tuple(out) if q is not None else out[0]
