"""Diagnostics of the solves: residual contraction (ρ_t, q_geo), recall on stored pairs, per-step spectra and
state norms, and how often OSDN's d-pass clip acts."""
from osdn_jax.diagnostics.clip import clip_activity, clip_fractions, clip_trajectory, d_pass_inputs
from osdn_jax.diagnostics.recall import recall_residual
from osdn_jax.diagnostics.residual import q_geo, rho_closed_form, rho_measured
from osdn_jax.diagnostics.spectrum import state_norms, step_eigenvalues, write_eigenvalue

__all__ = ["clip_activity", "clip_fractions", "clip_trajectory", "d_pass_inputs", "q_geo", "recall_residual",
           "rho_closed_form", "rho_measured", "state_norms", "step_eigenvalues", "write_eigenvalue"]
