"""The backward of the chunkwise online solve, kernel by kernel. The forward saved its inputs and T = (I + A)⁻¹;
the backward re-forms W, U from T (`prep` given T: the `wu` launch), reruns `state_fwd` (S_in, V_new; packed
sequences reset as in the forward), then

1. `dv_local`: the chunk-local part of dV_new;
2. `state_bwd`: the reverse pass over chunks (dV_new, dS leaving every chunk, dS0);
3. `grads_state`: the state-side terms of dq, dW, dk̃ and dG;
4. `grads_intra`: dM, dT, dA per chunk, dv and dβ's V part;
5. `grads_finish` (decay none / scalar) or `grads_pairs` (per channel): dq, dk, dk̃, dβ's K part, dG.

Per chunk (S = state entering, dS = gradient of the state leaving):
  dW = −dV_new Sᵀ, dU = dV_new;  dT = dW (β K e^G)ᵀ + dU (β V)ᵀ;  dA = −Tᵀ dT Tᵀ (strictly lower)
  dq = scale (dO Sᵀ) ⊙ e^G + ∂⟨dM, M⟩/∂q,  dM = scale dO V_newᵀ
  dk = β (∂⟨dA, P⟩/∂k + e^G ⊙ Tᵀ dW),  P the decayed Gram without β (A = diag(β) P)
  dk̃ = (V_new dSᵀ) ⊙ e^{G_C − G} + ∂⟨dM, M⟩/∂k̃ + ∂⟨diag(β) dA, P⟩/∂k̃
  dv = β Tᵀ dU,  dβ = rowsum(k ⊙ ∂⟨dA, P⟩/∂(βk)) + rowsum(Tᵀ dW ⊙ K e^G) + rowsum(Tᵀ dU ⊙ V)
  dG = q ⊙ dq + k ⊙ dk − k̃ ⊙ dk̃, plus on the chunk's last row
       Σ_j k̃_j ⊙ dk̃_state_j + e^{G_C} ⊙ rowsum(S ⊙ dS)
(every q and k enters as x ⊙ e^{G_i}, every k̃ as x ⊙ e^{−G_j} or x ⊙ e^{G_C − G_j}). Partial sums over split
grid axes (dβ, scalar dG) come out with a leading axis and are summed in XLA.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.gpu.delta_rule import layout as L
from pallas_kernels.gpu.delta_rule.decayed_tiles import decayed_tiles
from pallas_kernels.gpu.delta_rule.dv_local import dv_local
from pallas_kernels.gpu.delta_rule.grads_finish import grads_finish
from pallas_kernels.gpu.delta_rule.grads_intra import grads_intra
from pallas_kernels.gpu.delta_rule.grads_pairs import grads_pairs
from pallas_kernels.gpu.delta_rule.grads_state import grads_state
from pallas_kernels.gpu.delta_rule.prep import prep
from pallas_kernels.gpu.delta_rule.state_bwd import state_bwd
from pallas_kernels.gpu.delta_rule.state_fwd import state_pass


def backward(st: L.Static, residuals, do, dS_T):
  """From the inputs (q, k, kw, v, beta, G, S0, info; `info` None unless packed) and the forward's
  T = (I + A)⁻¹: re-forms W, U from T, reruns the state pass (S_in, V_new) and returns the cotangents of
  (q, k, kw, v, beta, G, S0), per value head for q, k, kw (the wrapper sums the head groups)."""
  q, k, kw, v, beta, G, S0, info, T = residuals
  W, U = prep(st, k, kw, v, beta, G, T=T)
  kd, qd = decayed_tiles(st, kw, G, q) if st.predecay else (kw, q)
  V_new, S_in, _ = state_pass(st, W, U, kd, G, S0, info)
  dvl = dv_local(st, q, kw, G, do)
  dV_new, dS_out, dS0 = state_bwd(st, W, qd, kd, G, do, dvl, dS_T, info)
  dq_s, dws, dkw_s, dG_s = grads_state(st, q, kw, G, S_in, dS_out, V_new, dV_new, do)
  if st.decay == "scalar":
    dG_s = jnp.sum(dG_s, axis=0)
  dv, dbeta_v, dM, dA = grads_intra(st, k, v, beta, G, T, V_new, dV_new, do, dws)
  if st.decay == "channel":
    dq, dk, dkw, dbeta_k, dG = grads_pairs(st, q, k, kw, beta, G, T, dws, dM, dA, dq_s, dkw_s, dG_s)
  else:
    dq, dk, dkw, dbeta_k, dG_p = grads_finish(st, q, k, kw, beta, G, T, dws, dM, dA, dq_s, dkw_s)
    dG = None if dG_p is None else dG_s + jnp.sum(dG_p, axis=0)
  return dq, dk, dkw, dv, dbeta_v + jnp.sum(dbeta_k, axis=0), dG, dS0
