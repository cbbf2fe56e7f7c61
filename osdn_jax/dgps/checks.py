"""Range checks of the DGPS axes' options and of the sizes a point runs at.

Every check raises a `ValueError` naming its owner (a function or a point), the option and the allowed range, e.g.
"osdn_write_key: `d_min` (2.0) must be ≤ `d_max` (1.0)". Python numbers, numpy values and concrete arrays are
checked; traced values (an option passed through `jax.jit` as an argument) are unknown while tracing and pass.

The ranges (docs/design.md §1.4):
  PDN     x ≥ 1 (M ∈ (1/x, x)), eps > 0 (log(A + ε) at A = 0), center_init finite
  ATQ     lam > 0 (q / (A + λ) with A ≥ 0); exact lam > 0 (G_0 = λI)
  OSDN    eta ≥ 0, d_min ≤ d_max (either None: unbounded), d_init finite (in [d_min, d_max] for a point),
          guard None or > 0, apf_anchor "zero" | "init", apf_bias None or finite
  fixed   d_init > 0 (d = exp(log_d)), guard None or > 0
  MesaNet 0 < lam_min < lam_init, cg_steps an int ≥ 1, cg_tol ≥ 0
"""
from __future__ import annotations

import numbers

import jax
import numpy as np

ANCHORS = ("zero", "init")


def _fmt(x) -> str:
  return repr(x.item() if isinstance(x, np.ndarray) and x.ndim == 0 else x)


def values(owner: str, name: str, value, *, what: str = "a number") -> np.ndarray | None:
  """value as a float64 array; None when traced. ValueError unless value is real numbers (bools and strings are
  not: a flag or a number given as a string is a mistake)."""
  if isinstance(value, jax.core.Tracer):
    return None
  if isinstance(value, (bool, np.bool_, str, bytes)) or value is None:
    raise ValueError(f"{owner}: `{name}` must be {what}, got {value!r}")
  try:
    arr = np.asarray(value)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None
  except (TypeError, ValueError):
    raise ValueError(f"{owner}: `{name}` must be {what}, got {value!r}") from None
  if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
    raise ValueError(f"{owner}: `{name}` must be {what}, got {value!r}")
  return arr.astype(np.float64)


def _describe(low, high, low_open, optional) -> str:
  bounds = []
  if low is not None:
    bounds.append(f"{'>' if low_open else '≥'} {low:g}")
  if high is not None:
    bounds.append(f"≤ {high:g}")
  text = "a finite number" + (" " + " and ".join(bounds) if bounds else "")
  return ("None or " + text) if optional else text


def number(owner: str, name: str, value, *, low=None, high=None, low_open: bool = False, optional: bool = False,
           scalar: bool = True) -> float | None:
  """Checks a real option: finite and in [low, high] ((low, high] with low_open); None passes when optional.

  scalar=False accepts an array (every entry checked). Returns the value as a float (None when None, traced or
  an array)."""
  what = _describe(low, high, low_open, optional)
  if value is None and optional:
    return None
  arr = values(owner, name, value, what=what)
  if arr is None:
    return None
  if scalar and arr.ndim:
    raise ValueError(f"{owner}: `{name}` must be {what}, got an array of shape {arr.shape}")
  bad = ~np.isfinite(arr)
  if low is not None:
    bad |= (arr <= low) if low_open else (arr < low)
  if high is not None:
    bad |= arr > high
  if np.any(bad):
    got = _fmt(value) if arr.ndim == 0 else f"{_fmt(arr[bad].flat[0])} (in an array of shape {arr.shape})"
    raise ValueError(f"{owner}: `{name}` must be {what}, got {got}")
  return float(arr) if arr.ndim == 0 else None


def ordered(owner: str, lo_name: str, lo, hi_name: str, hi) -> None:
  """`lo` ≤ `hi` when both are known numbers."""
  if isinstance(lo, numbers.Real) and isinstance(hi, numbers.Real) and lo > hi:
    raise ValueError(f"{owner}: `{lo_name}` ({lo!r}) must be ≤ `{hi_name}` ({hi!r})")


def positive_int(owner: str, name: str, value, *, minimum: int = 1) -> None:
  if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)) or value < minimum:
    raise ValueError(f"{owner}: `{name}` must be an int ≥ {minimum}, got {value!r}")


def apf_anchor_option(owner: str, value, name: str = "apf_anchor") -> None:
  if not isinstance(value, str) or value not in ANCHORS:
    raise ValueError(f"{owner}: `{name}` must be 'zero' or 'init', got {value!r}")


# ---------------------------------------------------------------------------------------------------------
# One check per preconditioner's options.
# ---------------------------------------------------------------------------------------------------------
def pdn(owner: str, *, x, eps, center_init=0.0) -> None:
  number(owner, "x", x, low=1.0)
  number(owner, "eps", eps, low=0.0, low_open=True)
  number(owner, "center_init", center_init)


def lam(owner: str, value) -> None:
  number(owner, "lam", value, low=0.0, low_open=True)


def guard_option(owner: str, value, name: str = "guard") -> None:
  """The guard γ: None (off) or > 0."""
  number(owner, name, value, low=0.0, low_open=True, optional=True)


def d_pass(owner: str, *, eta, d_min, d_max) -> tuple[float | None, float | None]:
  """The d-pass's η and bounds: η ≥ 0, each bound None (unbounded) or finite, d_min ≤ d_max. Returns the bounds
  as floats (None when unbounded or traced)."""
  number(owner, "eta", eta, low=0.0)
  lo = number(owner, "d_min", d_min, optional=True)
  hi = number(owner, "d_max", d_max, optional=True)
  ordered(owner, "d_min", lo, "d_max", hi)
  return lo, hi


def osdn(owner: str, *, eta, d_init, d_min, d_max, guard, apf_anchor, apf_bias=None,
         d_init_in_bounds: bool = True) -> None:
  """OSDN's options. d_init_in_bounds: d_init must also lie in [d_min, d_max] (a point's options; the functions
  take any d_init, as they take any initial state, and clip from the second token on)."""
  apf_anchor_option(owner, apf_anchor)
  lo, hi = d_pass(owner, eta=eta, d_min=d_min, d_max=d_max)
  number(owner, "d_init", d_init, scalar=False)
  guard_option(owner, guard)
  number(owner, "apf_bias", apf_bias, optional=True)
  arr = values(owner, "d_init", d_init) if d_init_in_bounds else None
  if arr is not None and ((lo is not None and np.any(arr < lo)) or (hi is not None and np.any(arr > hi))):
    interval = f"[{'-inf' if lo is None else f'{lo:g}'}, {'inf' if hi is None else f'{hi:g}'}]"
    raise ValueError(f"{owner}: `d_init` ({_fmt(d_init)}) must lie in [`d_min`, `d_max`] = {interval}")


def fixed(owner: str, *, d_init, guard) -> None:
  number(owner, "d_init", d_init, low=0.0, low_open=True, scalar=False)
  guard_option(owner, guard)


def mesa(owner: str, *, lam_min, lam_init, cg_steps, cg_tol) -> None:
  """MesaNet's options: 0 < lam_min < lam_init (λ = softplus(raw) + lam_min starts at lam_init), cg_steps an
  int ≥ 1, cg_tol ≥ 0 (a static number: it decides when a token stops iterating)."""
  lo = number(owner, "lam_min", lam_min, low=0.0, low_open=True)
  init = number(owner, "lam_init", lam_init, low=0.0, low_open=True)
  if lo is not None and init is not None and init <= lo:
    raise ValueError(f"{owner}: `lam_init` ({_fmt(lam_init)}) must be > `lam_min` ({_fmt(lam_min)})")
  positive_int(owner, "cg_steps", cg_steps)
  if number(owner, "cg_tol", cg_tol, low=0.0) is None:
    raise ValueError(f"{owner}: `cg_tol` must be a number (static: it decides when a token stops), got {cg_tol!r}")


def dims(owner: str, **sizes) -> None:
  for name, value in sizes.items():
    positive_int(owner, name, value)


def option_mapping(owner: str, options) -> dict:
  """`options` (a mapping, or (name, value) pairs) as a dict of option names to values; ValueError otherwise."""
  try:
    out = dict(options)
  except (TypeError, ValueError):
    out = None
  if out is None or not all(isinstance(k, str) for k in out):
    raise ValueError(f"{owner}: `point_options` must be a mapping or (name, value) pairs of option names and "
                     f"values, got {options!r}")
  return out
