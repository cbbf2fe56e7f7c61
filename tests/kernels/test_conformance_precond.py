"""Every implementation of the preconditioners' passes against their bases (tests/kernels/conformance_precond.py,
tests/kernels/conformance_d_pass.py): "reference", "xla", "pallas-gpu" and "pallas-tpu" (the kernels in interpret
mode on this CPU backend) through `osdn_jax.dgps.precond` on the same cases, both outputs and the gradient of every
input against the fp64 token-serial computation. A backend added to `conformance.BACKENDS` runs all of it; every
kernel backend names what its kernels save for the backward as the remat policies expect. Launch
options, block solves, clip ties, faults and lowering are tested beside each kernel (tests/kernels/gpu/,
tests/kernels/tpu/).
"""
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
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


def _pass(platform: str, op: str):
  """(fn, args): a loss through `op`'s kernels of `platform` ("gpu", "tpu") on tiny inputs, compiled for that
  platform (interpret=False: traced here, never lowered or run)."""
  rng = np.random.default_rng(0)
  k = jnp.asarray(rng.normal(size=(1, 8, 2, 8)), jnp.float32)
  beta = jnp.asarray(rng.uniform(0.2, 0.8, size=(1, 8, 2)), jnp.float32)
  if op == "osdn_d_pass":
    d_pass = importlib.import_module(f"pallas_kernels.{platform}.osdn").d_pass
    fn = lambda k, beta: jnp.sum(d_pass(k * k, jnp.sum(k * k, -1), beta, None, jnp.ones((1, 2, 8)), 1.0, eta=1.0,
                                        d_min=0.0, d_max=8.0, apf_anchor="zero", interpret=False)[0])
  else:
    precond_key = importlib.import_module(f"pallas_kernels.{platform}.precond_key").precond_key
    fn = lambda k, beta: jnp.sum(precond_key(k, beta, jnp.log(beta), transform="pdn", center=0.1,
                                             interpret=False)[0])
  return fn, (k, beta)


@pytest.mark.parametrize("op", ["osdn_d_pass", "precond_key"])
@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_kernels_name_what_they_save(platform, op, capsys):
  """Every backend's kernels save their intermediates under one name per op, "precond_pass" (the shells'
  RESIDUAL_NAME, which the models' "solve" remat policies keep): a policy that saves that name alone keeps more
  residuals than one that saves nothing, so a rematerialised backward does not rerun the kernels."""
  from pallas_kernels import d_pass_shell, precond_shell
  assert d_pass_shell.RESIDUAL_NAME == precond_shell.RESIDUAL_NAME == "precond_pass"
  fn, args = _pass(platform, op)

  def saved(policy):
    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(fn, policy=policy), *args)
    return capsys.readouterr().out.strip().splitlines()
  named = saved(jax.checkpoint_policies.save_only_these_names("precond_pass"))
  assert len(named) > len(saved(jax.checkpoint_policies.nothing_saveable)), named
