"""osdn-jax: curvature-aware (preconditioned) delta-rule linear attention in JAX."""
__version__ = "0.1.0"
