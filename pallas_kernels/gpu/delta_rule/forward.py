"""The forward of the chunkwise online solve (docs/design.md §2), kernel by kernel:

1. `scores` (per-channel decay at chunks of two sub-blocks or more): the Gram A and the intra output scores;
2. `prep`: T = (I + A)⁻¹, W, U per chunk (and T stored under autodiff);
3. `decayed_tiles` (per-channel decay with `State.predecay`): K̃ ⊙ e^{G_C − G} for the state pass;
4. `state_fwd`: the sequential pass over chunks (V_new, S_in, S_T);
5. `output`: O per chunk;
6. `repair`: where a value entering the state was non-finite, the rows of its chunk before it (token by token).
"""
from __future__ import annotations

from pallas_kernels.gpu.delta_rule import layout as L
from pallas_kernels.gpu.delta_rule.decayed_tiles import decayed_tiles
from pallas_kernels.gpu.delta_rule.output import output
from pallas_kernels.gpu.delta_rule.prep import prep
from pallas_kernels.gpu.delta_rule.repair import repair
from pallas_kernels.gpu.delta_rule.scores import scores, takes_tiles
from pallas_kernels.gpu.delta_rule.state_fwd import predecayed, state_pass


def forward(st: L.Static, q, k, kw, v, beta, G, S0, info=None, *, emit_t: bool = False):
  """The whole forward: (o [B, T, HV, V] in q.dtype, S_T [B, HV, K, V] fp32), and T = (I + A)⁻¹
  [B, HV, T, C] fp32 when emit_t (the one residual the backward keeps besides the inputs). Packed: `info`
  and the state layout of `state_pass`."""
  A = P = None
  tiles = takes_tiles(st)
  kd, qd, kwd = k, q, kw
  if tiles:                                      # K ⊙ e^G, Q ⊙ e^G and K̃ ⊙ e^{G_C − G} from `scores`
    A, P, kd, qd, kwd, G_end = scores(st, q, k, kw, beta, G, tiles=True)
  elif st.scores_first:
    A, P = scores(st, q, k, kw, beta, G)
  W, U, *T = prep(st, kd, kw, v, beta, G, emit_t=emit_t, A=A, decayed=tiles)
  inter = st.fuse_inter
  if tiles:
    V_new, S_in, S_T = state_pass(predecayed(st), W, U, kwd, G_end, S0, info, ends=True)
  else:
    kwd = decayed_tiles(st, kw, G) if st.predecay else kw
    V_new, S_in, S_T = state_pass(st, W, U, kwd, G, S0, info, q=q if inter else None)
  o = output(st, qd, kw, G, S_in, V_new, q.dtype, inter=inter, P=P, decayed=tiles)
  if st.config.repair.enabled:
    o = repair(st, q, k, kw, v, beta, G, S0, info, V_new if inter else S_in, S_T, o, stored=not inter)
  return (o, S_T, T[0]) if emit_t else (o, S_T)
