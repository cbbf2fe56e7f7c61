"""What the ops' shells share. The `jax.custom_vjp` around a backend's kernels with their saved intermediates named
for rematerialisation serves every op (`delta_rule_shell`, `d_pass_shell`, `guard_shell`, `precond_shell`); the
preconditioners' passes also share the `Backend` record's common fields and `bind`, which makes a shell's entry
point a backend's own function.

The differentiation skeleton of every such op is
    differentiable XLA before the kernels (the backend's `prepare`) → `kernels` (this module's custom_vjp around
    the backend's `forward`, `forward_saving` and `backward`) → differentiable XLA after them (its `finish`),
with the backend's functions of these signatures (`inputs`: a tuple of arrays or None, the kernels' arguments):
    forward(st, inputs) → outputs;   forward_saving(st, inputs) → (outputs, saved);
    backward(st, inputs, saved, cotangents of outputs) → a cotangent (or None) per entry of inputs.
The custom_vjp saves the inputs and `saved` (what the backward reads beside them), `saved` named `residual_name`
(None: not named). A backend whose forward reads inputs its backward does not may define kept(inputs) → the
inputs with None in their place: only those are saved.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

import jax
from jax.ad_checkpoint import checkpoint_name


@dataclasses.dataclass(frozen=True)
class Backend:
  """What a backend supplies to an op's shell (functions of its own module; hashable: a static argument).

  name: "pallas gpu", in messages. default_config(spec, device_kind): its tuning table's entry.
  interpret_mode(interpret): what its `pallas_call` takes for `arrays.default_interpret`'s value.
  prepare(...) → (st, inputs, aux): st hashable (the kernels' static description), inputs the kernels' arguments
  (a tuple), aux what `finish` reads beside them (the arguments per op: its shell's `Backend`). forward,
  forward_saving, backward: the kernels (this module's docstring). finish(st, inputs, outputs, aux): the op's
  results."""
  name: str
  default_config: Callable[..., Any]
  interpret_mode: Callable[[Any], Any]
  prepare: Callable[..., tuple]
  forward: Callable[..., Any]
  forward_saving: Callable[..., tuple]
  backward: Callable[..., tuple]
  finish: Callable[..., Any]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def kernels(backend, st, residual_name: str | None, inputs: tuple):
  """backend.forward(st, inputs), differentiated by backend.backward (`st` hashable: everything static)."""
  return backend.forward(st, inputs)


def _kernels_fwd(backend, st, residual_name, inputs):
  outputs, saved = backend.forward_saving(st, inputs)
  if residual_name:
    # Named for rematerialisation policies: saved, they spare the backward a rerun of the forward's kernels.
    saved = jax.tree.map(lambda x: checkpoint_name(x, residual_name), saved)
  kept = getattr(backend, "kept", None)
  return outputs, (inputs if kept is None else kept(inputs), saved)


def _kernels_bwd(backend, st, residual_name, res, cts):
  del residual_name
  inputs, saved = res
  return (tuple(backend.backward(st, inputs, saved, cts)),)


kernels.defvjp(_kernels_fwd, _kernels_bwd)


def bind(entry: Callable[..., Any], backend, module: str) -> Callable[..., Any]:
  """entry(backend, ...) as a function of the rest: a backend's entry point, with the shell's name, docstring and
  signature (less `backend`), belonging to the backend's `module` (as dispatch and messages report it)."""
  @functools.wraps(entry)
  def bound(*args, **kwargs):
    return entry(backend, *args, **kwargs)
  signature = inspect.signature(entry)
  bound.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])
  bound.__module__ = module
  del bound.__wrapped__
  return bound
