"""The DGPS design space: Decay × Gain × Preconditioner × Solve, as small pure functions and a registry.

    from osdn_jax import dgps
    point = dgps.get("osdn-apf-gdn")          # a named point (docs/design.md §1's table)
    point = dgps.compose(decay="scalar", precond="pdn", x=2.0)   # or any combination
    dgps.register_axis("precond", "mine", dgps.Axis(...))         # a new axis value (dgps.Axis's docstring)
    dgps.check_point(point, dgps.Dims(2, 2, 16, 16))               # chunked, chained, decoded, differentiated
"""
from osdn_jax.dgps import decay, gain, precond, solve
from osdn_jax.dgps.conformance import check_point
from osdn_jax.dgps.registry import (AXES, POINTS, Axis, Context, Dims, Feature, Point, Solve, State, compose, get,
                                    has_mesa_pass, has_osdn_pass, names, register, register_axis)

__all__ = ["AXES", "POINTS", "Axis", "Context", "Dims", "Feature", "Point", "Solve", "State", "check_point", "compose", "decay",
           "gain", "get", "has_mesa_pass", "has_osdn_pass", "names", "precond", "register", "register_axis", "solve"]
