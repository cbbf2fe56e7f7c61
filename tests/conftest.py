import gc
import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The suite compiles hundreds of small programs and times none: XLA's CPU backend compiles them about three times
# faster without LLVM's optimisations and the fusion emitters. Set once (in pytest's main process, whose
# environment the xdist workers inherit), only where this XLA accepts the flags (it aborts on unknown ones), and
# never over flags the user set.
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
if "XLA_FLAGS" not in os.environ:
  _probe = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"],
                          env=dict(os.environ, XLA_FLAGS=_FAST_COMPILE), capture_output=True)
  os.environ["XLA_FLAGS"] = _FAST_COMPILE if _probe.returncode == 0 else ""

import jax  # noqa: E402

# fp64 oracles need x64; the library must keep fp32 where it promises fp32 with x64 on, which this also tests.
jax.config.update("jax_enable_x64", True)


import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from osdn_jax.testing import HYPOTHESIS_SCALE, hypothesis_profile  # noqa: E402

# Tracing and lowering make a great many short-lived objects: at CPython's default thresholds the cyclic collector
# took about 6 % of the suite's time, most of it walking the imported libraries' long-lived objects again and again.
# Those are frozen out of collection and the thresholds raised (cycles are still collected, in fewer passes).
gc.collect()
gc.freeze()
gc.set_threshold(10_000, 50, 50)

# Hypothesis profiles, chosen by HYPOTHESIS_PROFILE ("default" when unset; CI's slow step runs "thorough"). Each
# test sets its own count through osdn_jax.testing.examples(base), which scales by the same table; max_examples
# here is for a test that sets none. Examples are drawn afresh every run (derandomize off) and no example database
# is read or written (a clean clone has none, and CI keeps nothing).
for _name, _scale in HYPOTHESIS_SCALE.items():
  settings.register_profile(_name, max_examples=10 * _scale, deadline=None, derandomize=False, database=None)
settings.load_profile(hypothesis_profile())


def pytest_configure(config):
  """Under xdist's `load` distribution (what `-n` does without `--dist`), distribute whole modules instead, and
  the classes of unittest-style modules (`--dist loadscope`): the tests of a module share compiled programs,
  batches computed in one program (osdn_jax.testing.Batches) and the tracing of the code they call; spread over
  two workers, both would pay for them (measured: half again as much CPU time, no shorter wall time)."""
  if getattr(config.option, "dist", "no") == "load":
    config.option.dist = "loadscope"


def _can_lower_triton() -> bool:
  """jaxlib ≤ 0.10.2 lowers Pallas-Triton to IR without a GPU; newer ones compile in the lowering."""
  from jax._src.lib import version as jaxlib_version
  try:
    has_gpu = bool(jax.devices("gpu"))
  except RuntimeError:
    has_gpu = False
  return has_gpu or tuple(jaxlib_version) <= (0, 10, 2)


@pytest.fixture
def triton_lowering(monkeypatch):
  """Makes every GPU kernel's pallas_call print its Triton IR (debug=True) and, where this JAX version exposes
  the private hook, verify each lowered module. Returns the list of verification results. Skips (stating why)
  where this jaxlib cannot lower Triton without a GPU."""
  if not _can_lower_triton():
    pytest.skip("Triton lowering without a GPU needs jaxlib <= 0.10.2")
  from pallas_kernels.gpu import common
  call = common.pl.pallas_call
  monkeypatch.setattr(common.pl, "pallas_call", lambda *a, **kw: call(*a, **dict(kw, debug=True)))
  verified = []
  try:   # private API: not every JAX version exposes it; then the IR is only printed and parsed
    from jax._src.pallas.triton import lowering, pallas_call_registration as registration
    lower_module = lowering.lower_jaxpr_to_triton_module
    registration.lowering   # noqa: B018 (the attribute patched below)
  except (ImportError, AttributeError):
    return verified

  def checked(*a, **kw):
    result = lower_module(*a, **kw)
    verified.append(result.module.operation.verify())
    return result
  monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", checked)
  return verified


@pytest.fixture(autouse=True, scope="module")
def _fresh_compile_caches():
  """Drops JAX's compiled executables after each test module, which bounds what a worker holds: otherwise it
  keeps every interpret-mode kernel it compiled for the whole run, and XLA's CPU compiler has aborted in workers
  that held that much."""
  yield
  jax.clear_caches()


@pytest.fixture(autouse=True)
def _registry_restored():
  """Restores the DGPS registry (points and axis values) after each test, so a test that registers its own
  point or axis value leaves the registry as it found it for the tests that list it."""
  from osdn_jax.dgps import registry
  points, axes = dict(registry.POINTS), {kind: dict(table) for kind, table in registry.AXES.items()}
  yield
  registry.POINTS.clear()
  registry.POINTS.update(points)
  for kind, table in axes.items():
    registry.AXES[kind].clear()
    registry.AXES[kind].update(table)


@pytest.fixture
def races(monkeypatch):
  """Every race-detector state TPU interpret mode makes (one per kernel run) while the test runs; the test fails if
  any found a race. None where this JAX has no TPU interpret mode."""
  try:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    base = ipc.RaceDetectionState
  except (ImportError, AttributeError):
    yield None
    return
  made = []

  class Recorded(base):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      made.append(self)
  monkeypatch.setattr(ipc, "RaceDetectionState", Recorded)
  yield made
  if not made:
    pytest.fail("no kernel ran in TPU interpret mode with the race detector", pytrace=False)
  found = sum(r.races_found for r in made)
  if found:
    pytest.fail(f"TPU interpret mode's race detector reported races in {found} of {len(made)} kernel runs (printed "
                "above as RACE DETECTED)", pytrace=False)
