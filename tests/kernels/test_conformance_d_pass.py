"""Every implementation of OSDN's d-pass against one base (tests/kernels/conformance_d_pass.py):
`precond.osdn_d_pass` with `implementation` "reference", "xla", "pallas-gpu" and "pallas-tpu" (the kernels in
interpret mode on this CPU backend) on the same cases, ds, d_{T+1} and the gradient of every input against the fp64
token-serial d-pass. A backend added to `conformance_d_pass.BACKENDS` runs all of it. Launch options, block solves,
clip ties and lowering are tested beside each kernel (tests/kernels/gpu/test_osdn.py, tests/kernels/tpu/test_osdn.py).
"""
import functools

import pytest

from tests.kernels.conformance_d_pass import BACKENDS, CASES, compare, oracle


@pytest.fixture(autouse=True)
def _races(request):
  """The TPU kernels run under the race detector (tests/conftest.py: `races`)."""
  if request.node.callspec.params.get("backend") == "pallas-tpu":
    request.getfixturevalue("races")


@functools.lru_cache(maxsize=None)
def _oracle(case: str) -> dict:
  return oracle(case)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_d_pass(case, backend):
  """ds, d_{T+1} and the gradient of every input (u, n, β, retention, d1, d_init) within tolerance of the fp64
  oracle, in fp32."""
  compare(backend, case, want=_oracle(case))
