"""The conformance base of OSDN's d-pass: what every implementation of `osdn_jax.dgps.precond.osdn_d_pass` must
compute (tests/kernels/test_conformance_precond.py runs it on every backend through `implementation=`).

`CASES` combine the features on small shapes: a retention with either anchor, both bounds acting, packed rows;
`oracle` is the token-serial d-pass in fp64 and in fp32 (the kernels' contract), and `compare` checks ds, d_{T+1} and
the gradient of every input (`osdn_jax.testing.vjp_all`) against both (`assert_close_to_oracles`: where d̄ lies
within fp32 rounding of a bound, fp32 and fp64 may clip it differently and their gradients differ by that entry).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from osdn_jax.dgps import precond
from osdn_jax.testing import assert_close_to_oracles, random_d_pass_inputs
from tests.kernels.conformance import jit_vjp_all

OUTPUTS = ("ds", "d_last")
TOL = 2e-5                    # relative RMS, fp32 against fp64 along a clipped serial recurrence of a few dozen tokens

# name: (B, T, G, K, retention, anchor, η, d_min, d_max, packed rows: segment lengths per row, or None).
CASES = {
    "apf_init-clip": (2, 37, 2, 20, True, "init", 12.0, 0.2, 1.6, None),
    "r1-packed-clip": (2, 37, 2, 16, False, "zero", 8.0, 0.0, 2.0, ((5, 1, 31), (20, 17))),
}


def problem(case: str) -> tuple[dict, dict]:
  """(arrays, options) of `CASES[case]`: u = k ⊙ k and n of unit normal keys (not spiky ones: a channel with u ≈ 0
  leaves a clipped d on its bound in fp32 but not in fp64), beta (σ(z + ½), never 0), retention or None, d1
  ([N, G, K] packed), d_init; the options η, bounds, anchor and the raw segment ids (None unpacked)."""
  b, t, g, k, learned_r, anchor, eta, lo, hi, rows = CASES[case]
  ids = None
  if rows is not None:
    ids = jnp.asarray(np.stack([np.repeat(np.arange(len(r)), r) for r in rows]), jnp.int32)
  count = sum(map(len, rows)) if rows is not None else 0
  a = random_d_pass_inputs(t + k, B=b, T=t, G=g, K=k, segments=count)
  rng = np.random.default_rng(t * k)
  keys = rng.normal(size=(b, t, g, k))
  u = jnp.asarray((keys / np.linalg.norm(keys, axis=-1, keepdims=True)) ** 2, jnp.float32)
  beta = jnp.asarray(1 / (1 + np.exp(-rng.normal(size=(b, t, g)) - 0.5)), jnp.float32)
  arrays = dict(u=u, n=jnp.maximum(jnp.sum(u, -1), 1e-12), beta=beta, retention=a["r"] if learned_r else None,
                d1=a["d1"], d_init=a["d0"])
  return arrays, dict(eta=eta, d_min=lo, d_max=hi, apf_anchor=anchor, segment_ids=ids)


def through_precond(implementation: str, **options):
  """`precond.osdn_d_pass` with `implementation`, every array by name (as `vjp_all` calls it)."""
  def call(u, n, beta, retention, d1, d_init):
    return precond.osdn_d_pass(u, n, beta, retention, d1, d_init, implementation=implementation, **options)
  return call


def oracle(case: str) -> tuple[dict, dict]:
  """The token-serial results and gradients on the case's inputs, (fp64, fp32)."""
  arrays, options = problem(case)
  f64 = {n: None if x is None else jnp.asarray(x, jnp.float64) for n, x in arrays.items()}
  fn = through_precond("reference", **options)
  return jit_vjp_all(fn, f64, OUTPUTS), jit_vjp_all(fn, arrays, OUTPUTS)


def compare(implementation: str, case: str, *, want: tuple[dict, dict] | None = None) -> dict:
  """ds, d_{T+1} and every input's gradient by `implementation` against the oracles (`want`, when computed
  already; the module docstring's criterion), fp32 results; returns the errors against fp64."""
  arrays, options = problem(case)
  got = jit_vjp_all(through_precond(implementation, **options), arrays, OUTPUTS)
  want64, want32 = oracle(case) if want is None else want
  return assert_close_to_oracles(got, want64, want32, TOL)
