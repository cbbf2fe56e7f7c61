"""The delta-rule conformance base: what every implementation of `osdn_jax.ops.delta_rule` must compute, and the
helpers the kernels' own tests reuse with their launch options. `BACKENDS` and `jit_vjp_all` serve every op's base
(the preconditioners' passes: tests/kernels/conformance_d_pass.py, tests/kernels/conformance_precond.py).

`CASES` are the problems every backend runs (tests/kernels/test_conformance_delta_rule.py, through `ops.delta_rule(...,
implementation=...)`): every decay, odd T over a partial last chunk, grouped value heads, write keys other than
the read keys, a carried initial state, fp32 and bf16. `solve` is an entry point as `vjp_all` calls it,
`jit_vjp_all` runs `vjp_all` as one jitted program, `oracle` is the fp64 token-serial reference and `compare` the
check of outputs, final states and every input gradient against it at docs/design.md §4's tolerances, results in
the contract's dtypes. Each program is finished before the next is dispatched: the TPU interpreter's callbacks run
JAX ops of their own, which can deadlock against ops dispatched eagerly meanwhile on a CPU with few cores.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from osdn_jax import ops
from osdn_jax.ops import chunked, naive
from osdn_jax.testing import assert_trees_close, contract_dtypes, random_problem, vjp_all

DECAYS = ("none", "scalar", "channel")
BACKENDS = ("reference", "xla", "pallas-gpu", "pallas-tpu")

# name: (dtype, chunk, random_problem's dims and options). fp32: value-head write keys with GVA and a state, T = 37
# over chunks of 16; bf16: key-head write keys with GVA, two batch rows, T = 45.
CASES = {
    "fp32": (jnp.float32, 16, dict(B=1, T=37, H=2, HV=4, K=16, V=32, k_write="value", initial_state=True)),
    "bf16": (jnp.bfloat16, 16, dict(B=2, T=45, H=2, HV=4, K=16, V=32, k_write="key", initial_state=True)),
}


def problem(case: str, decay: str):
  """The random problem of `CASES[case]` with `decay` (seeded by the case's shape)."""
  _, _, dims = CASES[case]
  return random_problem(dims["T"] + dims["HV"], decay=decay, **dims)


def solve(fn, **options):
  """fn (a delta-rule entry point: a kernel's, `naive`'s, `chunked`'s, `ops`') as `vjp_all` calls it: every array
  by name, `options` passed on."""
  def call(q, k, v, beta, k_write, log_decay, initial_state):
    return fn(q, k, v, beta, k_write=k_write, log_decay=log_decay, initial_state=initial_state, **options)
  return call


def through_ops(implementation: str, chunk: int = 16, **options):
  """`ops.delta_rule` with `implementation` and the final state, as `solve` gives it."""
  return solve(ops.delta_rule, output_final_state=True, chunk_size=chunk, implementation=implementation,
               **options)


def jit_vjp_all(fn, arrays: dict, outputs: tuple[str, ...] = ("o", "S")) -> dict:
  """`vjp_all(fn, arrays, outputs=outputs)` as one jitted program, finished (every op's base uses it)."""
  return jax.block_until_ready(jax.jit(lambda a: vjp_all(fn, a, outputs=outputs))(arrays))


def oracle(problem, dtype) -> dict:
  """The fp64 token-serial results (`vjp_all`) on the problem's inputs rounded to `dtype`."""
  ref = problem.rounded(dtype) if dtype != jnp.float32 else problem
  return jit_vjp_all(solve(naive.delta_rule), ref.arrays(jnp.float64, jnp.float64, jnp.float64))


def compare(fn, problem, dtype, *, want: dict | None = None, xla_chunk: int | None = None) -> dict:
  """fn's o, S_T and every input gradient on the problem in `dtype` against the oracle (`want`, when computed
  already) at §4's tolerance for `dtype`, in the contract's dtypes; with `xla_chunk`, fp32 results also against
  the chunked XLA path at that chunk. Returns the errors against the oracle."""
  arrays = problem.arrays(dtype)
  got = jit_vjp_all(fn, arrays)
  want = oracle(problem, dtype) if want is None else want
  errors = assert_trees_close(got, {n: w for n, w in want.items() if n in got}, dtype,
                              dtypes=contract_dtypes(arrays))
  if xla_chunk and dtype == jnp.float32:
    assert_trees_close(got, jit_vjp_all(solve(chunked.delta_rule, chunk_size=xla_chunk), arrays), dtype)
  return errors
