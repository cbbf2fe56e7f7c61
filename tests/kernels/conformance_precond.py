"""The conformance bases of the preconditioners' passes beside the d-pass (tests/kernels/conformance_d_pass.py): what
every implementation of PDN's write key and ATQ's query (`precond.pdn_write_key`, `precond.atq_query`: the op
"precond_key") and of OSDN's write key (`precond.osdn_write_key`: the d-pass and the guard, the op "osdn_guard")
must compute. tests/kernels/test_conformance_precond.py runs them on every backend (`conformance.BACKENDS`).

`problem` draws one case's arrays; `oracle` is the token-serial computation in fp64 and in fp32, and `compare` checks
both outputs and the gradient of every input against them (`osdn_jax.testing.vjp_all`, `assert_close_to_oracles`:
OSDN's clip can round a value to either side of its bound).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from osdn_jax.dgps import precond
from osdn_jax.testing import assert_close_to_oracles
from tests.kernels.conformance import jit_vjp_all

TOL = 2e-5

# name: (function of the arrays by name, its outputs, B, T, H (and G), K). T over several of every backend's
# chunks with a partial last one; K not a power of two; a carried state.
CASES = {
    "pdn": (lambda k, beta_p, log_decay_p, center, initial_state, implementation: precond.pdn_write_key(
        k, beta_p, log_decay_p, center, x=1.7, initial_state=initial_state, implementation=implementation),
        ("k_write", "A_T"), 2, 45, 2, 20),
    "atq": (lambda q, k, beta_p, log_decay_p, initial_state, implementation: precond.atq_query(
        q, k, beta_p, log_decay_p, lam=0.5, initial_state=initial_state, implementation=implementation),
        ("q_tilde", "A_T"), 2, 45, 2, 20),
    "osdn-apf": (lambda k, beta, retention, initial_state, implementation: precond.osdn_write_key(
        k, beta, retention=retention, eta=4.0, d_min=0.0, d_max=2.0, apf_anchor="init", d_init=1.1,
        initial_state=initial_state, implementation=implementation),
        ("k_write", "d_last"), 2, 37, 2, 20),
}


def problem(case: str) -> dict:
  """The case's fp32 arrays: unit keys (and queries), gains σ(N), log-decays logσ(N + 3), PDN's center per head,
  the carried state (A_0 ≥ 0, or OSDN's d_1 ∈ [0.5, 1.5]) and OSDN's retention σ(N + 4)."""
  _, _, b, t, h, kd = CASES[case]
  rng = np.random.default_rng(t * kd + len(case))
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  sig = lambda x: 1 / (1 + np.exp(-x))
  f = lambda x: jnp.asarray(x, jnp.float32)
  k = f(unit(rng.normal(size=(b, t, h, kd))))
  if case.startswith("osdn"):
    return dict(k=k, beta=f(sig(rng.normal(size=(b, t, h)) + 0.5)), retention=f(sig(rng.normal(size=(b, t, h)) + 4)),
                initial_state=f(0.5 + rng.random(size=(b, h, kd))))
  arrays = dict(k=k, beta_p=f(sig(rng.normal(size=(b, t, h)))),
                log_decay_p=f(-np.logaddexp(0, -rng.normal(size=(b, t, h)) - 3)),
                initial_state=f(rng.random(size=(b, h, kd))))
  if case == "pdn":
    arrays["center"] = f(rng.normal(size=(h,)) * 0.3 - 0.5)
  else:
    arrays["q"] = f(unit(rng.normal(size=(b, t, h, kd))))
  return arrays


def _through(case: str, implementation: str):
  fn = CASES[case][0]
  return lambda **arrays: fn(**arrays, implementation=implementation)


def oracle(case: str) -> tuple[dict, dict]:
  """The token-serial results and gradients on the case's inputs, (fp64, fp32)."""
  arrays, outputs = problem(case), CASES[case][1]
  f64 = {n: jnp.asarray(x, jnp.float64) for n, x in arrays.items()}
  fn = _through(case, "reference")
  return jit_vjp_all(fn, f64, outputs), jit_vjp_all(fn, arrays, outputs)


def compare(implementation: str, case: str, *, want: tuple[dict, dict] | None = None) -> dict:
  """Both outputs and every input's gradient by `implementation` against the oracles (`want`, when computed
  already), fp32 results; returns the errors against fp64."""
  got = jit_vjp_all(_through(case, implementation), problem(case), CASES[case][1])
  want64, want32 = oracle(case) if want is None else want
  return assert_close_to_oracles(got, want64, want32, TOL)
