"""Diagnostics of the online solve: the residual contraction ρ_t and its geometric mean q_geo."""
from osdn_jax.diagnostics.residual import q_geo, rho_closed_form, rho_measured

__all__ = ["q_geo", "rho_closed_form", "rho_measured"]
