"""Every implementation of the preconditioners' passes against their bases (tests/kernels/conformance_precond.py,
tests/kernels/conformance_d_pass.py): "reference", "xla", "pallas-gpu" and "pallas-tpu" (the kernels in interpret
mode on this CPU backend) through `osdn_jax.dgps.precond` on the same cases, both outputs and the gradient of every
input against the fp64 token-serial computation. A backend added to `conformance.BACKENDS` runs all of it. Launch
options, block solves, clip ties, faults and lowering are tested beside each kernel (tests/kernels/gpu/,
tests/kernels/tpu/).
"""
import functools

import pytest

from tests.kernels import conformance_d_pass, conformance_precond
from tests.kernels.conformance import BACKENDS

BASES = {"d_pass": conformance_d_pass, "precond": conformance_precond}
CASES = [(base, case) for base, module in BASES.items() for case in module.CASES]


@pytest.fixture(autouse=True)
def _races(request):
  """The TPU kernels run under the race detector (tests/conftest.py: `races`)."""
  if request.node.callspec.params.get("backend") == "pallas-tpu":
    request.getfixturevalue("races")


@functools.lru_cache(maxsize=None)
def _oracle(base: str, case: str):
  return BASES[base].oracle(case)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("base,case", CASES)
def test_pass(base, case, backend):
  """Both outputs and the gradient of every input within tolerance of the fp64 oracle (and of the fp32 one where
  a clip rounds), in fp32."""
  BASES[base].compare(backend, case, want=_oracle(base, case))
