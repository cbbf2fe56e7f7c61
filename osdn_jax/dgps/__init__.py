"""The DGPS design space: Decay × Gain × Preconditioner × Solve, as small pure functions and a registry.

    from osdn_jax import dgps
    point = dgps.get("osdn-apf-gdn")          # a named point (docs/design.md §1's table)
    point = dgps.compose(decay="scalar", precond="pdn", x=2.0)   # or any combination
"""
from osdn_jax.dgps import decay, gain, precond, solve
from osdn_jax.dgps.registry import POINTS, Dims, Feature, Point, compose, get, names, register

__all__ = ["POINTS", "Dims", "Feature", "Point", "compose", "decay", "gain", "get", "names", "precond", "register",
           "solve"]
