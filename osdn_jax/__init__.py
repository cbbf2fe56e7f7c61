"""osdn-jax: curvature-aware (preconditioned) delta-rule linear attention in JAX.

    import osdn_jax
    o, state = osdn_jax.ops.delta_rule(q, k, v, beta)        # the core solves (jax and numpy only)
    point = osdn_jax.dgps.get("osdn-apf-gdn")                # the design space and its registry
    model = osdn_jax.models.build("pgdn-tiny", rngs=nnx.Rngs(0))

The subpackages and public modules (`__all__`) load on first access (PEP 562), so `import osdn_jax` imports
none of them: `ops`, `dgps` and `diagnostics` pull in only jax and numpy, while `layers`, `models`, `data` and
`train` bring Flax, Grain or Optax with them.
"""
import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

__version__ = "0.1.0"

__all__ = ["checking", "convert", "data", "dgps", "diagnostics", "layers", "models", "ops", "plugins", "testing", "train"]

if _TYPE_CHECKING:   # for type checkers and IDEs; at run time `__getattr__` imports them on first access
  from osdn_jax import (checking, convert, data, dgps, diagnostics, layers, models, ops, plugins,  # noqa: F401
                        testing, train)


def __getattr__(name: str):
  if name in __all__:
    return _importlib.import_module(f"{__name__}.{name}")   # also binds it here, so this runs once per name
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(__all__))
