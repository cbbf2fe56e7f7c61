"""Every implementation of the online solve against one base (tests/kernels/conformance.py): `ops.delta_rule` with
`implementation` "reference", "xla", "pallas-gpu" and "pallas-tpu" (the kernels in interpret mode on this CPU
backend) on the same problems, outputs, final states and the gradient of every input against the fp64 oracle;
chaining through the final state and a traced scale. A backend added to `conformance.BACKENDS` runs all of it.
Launch options, kernel internals and the other features (packing, extreme gates, layouts) are tested beside each
kernel (tests/kernels/gpu/test_delta_rule.py, tests/kernels/tpu/test_delta_rule.py).

Interpret mode is slow: small shapes, each case combining several features; each case's oracle is computed once
for every backend.
"""
import contextlib
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from tests.kernels.conformance import BACKENDS, CASES, DECAYS, compare, oracle, problem, through_ops
from osdn_jax import ops
from osdn_jax.ops import naive
from osdn_jax.testing import assert_trees_close, random_problem

F32 = jnp.float32


@pytest.fixture(autouse=True)
def _checked(request):
  """Poisoned output buffers (an unwritten block shows as NaN) and, for the TPU kernels, the race detector's
  verdict (tests/conftest.py: `races`)."""
  if request.node.callspec.params.get("backend") == "pallas-tpu":
    request.getfixturevalue("races")
  poison = getattr(pl, "enable_poison_buffers", None)
  with (poison(True) if poison is not None else contextlib.nullcontext()):
    yield


@functools.lru_cache(maxsize=None)
def _oracle(case: str, decay: str) -> dict:
  return oracle(problem(case, decay), CASES[case][0])


# `make test`: every backend on fp32 with every decay and on bf16 with the per-channel decay (the bf16 contract's
# hardest case); the slow step runs bf16 with the other decays too.
QUICK_BF16_DECAYS = ("channel",)


@pytest.mark.parametrize("case,decay,backend", [
    pytest.param(case, decay, backend,
                 marks=[] if case != "bf16" or decay in QUICK_BF16_DECAYS else [pytest.mark.slow])
    for case in CASES for decay in DECAYS for backend in BACKENDS])
def test_delta_rule(case, decay, backend):
  """o, S_T and the gradient of every input (q, k, v, β, k_write, log_decay, initial_state) within §4's
  tolerance of the fp64 oracle, in the contract's dtypes."""
  dtype, chunk, _ = CASES[case]
  compare(through_ops(backend, chunk), problem(case, decay), dtype, want=_oracle(case, decay))


@pytest.mark.parametrize("backend", BACKENDS)
def test_chaining_and_traced_scale(backend):
  """A traced scale gives what the same static scale gives, and two halves chained through the final state give
  one run: both against the fp64 oracle at that scale (forward; scalar decay, key-head write keys, T = 48 in
  halves of 24 over chunks of 16)."""
  p = random_problem(11, B=1, T=48, H=2, HV=2, K=16, V=16, decay="scalar", k_write="key")
  a = p.arrays(F32)

  def fn(a, scale, initial_state):
    return ops.delta_rule(a["q"], a["k"], a["v"], a["beta"], k_write=a["k_write"], log_decay=a["log_decay"],
                          initial_state=initial_state, scale=scale, output_final_state=True, chunk_size=16,
                          implementation=backend)

  def program(a, scale):
    half = lambda sl: {n: x[:, sl] for n, x in a.items() if n != "initial_state"}
    o, S = fn(a, scale, a["initial_state"])
    o1, S1 = fn(half(slice(0, 24)), 0.3, a["initial_state"])
    o2, S2 = fn(half(slice(24, 48)), 0.3, S1)
    return {"o": o, "S": S}, {"o": jnp.concatenate([o1, o2], axis=1), "S": S2}

  traced, chained = jax.block_until_ready(jax.jit(program)(a, F32(0.3)))
  o, S = naive.delta_rule(**p.arrays(jnp.float64, jnp.float64, jnp.float64), scale=0.3)
  assert_trees_close(traced, {"o": o, "S": S}, F32)
  assert_trees_close(chained, {"o": o, "S": S}, F32)
