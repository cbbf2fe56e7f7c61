"""Checked mode: the library's checks on traced values, through `jax.experimental.checkify`.

Concrete arguments are validated eagerly and raise a `ValueError` naming the argument. Under `jax.jit` the
values of traced arguments (token ids, segment ids) are unknown while tracing, so the library states their
conditions with `require`, a `checkify.debug_check`: nothing is checked and nothing costs unless the function
is run in checked mode, `checked(fn)` (or `checkify.checkify(fn, errors=checkify.user_checks)` by hand), which
then raises a `ValueError` with the first failed condition's message after the call.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import checkify

ERRORS = checkify.user_checks      # the error set of checked mode: the library's `require`s (and the user's)


def concrete(x) -> np.ndarray | None:
  """x as a numpy array, or None when it is traced (under jit) and its values are unknown."""
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None


def require(pred, message: str, *fmt_args) -> None:
  """A condition on traced values, checked only in checked mode (`checkify.debug_check`; a no-op otherwise).

  message is a `str.format` template over fmt_args (arrays welcome: e.g. the first bad position)."""
  checkify.debug_check(pred, message, *fmt_args)


def throw(error: checkify.Error) -> None:
  """Raises the checkify error as a `ValueError` (its message) if a check failed; nothing otherwise."""
  try:
    error.throw()
  except checkify.JaxRuntimeError as e:
    raise ValueError(str(e).removesuffix(" (`check` failed)")) from None


def checked(fn: Callable[..., Any], *, jit: bool = False) -> Callable[..., Any]:
  """fn run in checked mode: the same results, and a `ValueError` when a `require` inside fails.

  jit: also compile the checked function (`jax.jit(checkify.checkify(fn))`). Each call waits for the error
  flag, so a loop that must not block per step should keep `checkify.checkify(fn, errors=ERRORS)`'s error
  values and pass them to `throw` later.
  """
  inner = checkify.checkify(fn, errors=ERRORS)
  if jit:
    inner = jax.jit(inner)

  @functools.wraps(fn)
  def run(*args, **kwargs):
    error, out = inner(*args, **kwargs)
    throw(error)
    return out

  return run
