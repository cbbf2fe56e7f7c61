"""The comparator can fail: plausible bugs in a solve are each caught by the tolerances the suite uses, and
`assert_trees_close`'s chex checks reject what the tolerance alone would not."""
import jax.numpy as jnp
import numpy as np
import pytest

from osdn_jax.ops import chunked, naive
from osdn_jax.testing import assert_trees_close, close, contract_dtypes, random_problem, vjp_all

TOL = (1e-5, 1e-6)


def _run(impl, arrays, **kw):
  def fn(q, k, v, beta, k_write, log_decay, initial_state):
    return impl.delta_rule(q, k, v, beta, k_write=k_write, log_decay=log_decay, initial_state=initial_state,
                           **kw)
  return vjp_all(fn, arrays)


def _all_close(got, want):
  return all(close(got[n], want[n], *TOL) for n in want)


class Case:
  """One problem and the unmutated runs the tests share: the chunked solve and the oracle on its fp32 values."""

  def __init__(self, decay):
    self.problem = random_problem(11, T=50, decay=decay, k_write="key")
    self.a = self.problem.arrays(jnp.float32)
    self.chunked = _run(chunked, self.a, chunk_size=16)
    self.oracle = _run(naive, self.a)


# Module scope: computed once per decay, before any test patches the solves.
@pytest.fixture(scope="module", params=["scalar", "channel"])
def case(request):
  return Case(request.param)


def test_correct_solve_passes(case):
  """The chunked solve passes against the fp64 oracle, and against the oracle on its fp32 values."""
  assert _all_close(case.chunked, _run(naive, case.problem.arrays(jnp.float64, jnp.float64, jnp.float64)))
  assert _all_close(case.chunked, case.oracle)


def test_swapped_read_and_write_keys_are_caught(case):
  """Swapping k and k̃ moves the outputs and the final state outside the tolerance."""
  a = case.a
  got = _run(chunked, dict(a, k=a["k_write"], k_write=a["k"]), chunk_size=16)
  assert not close(got["o"], case.oracle["o"], *TOL)
  assert not close(got["S"], case.oracle["S"], *TOL)


def test_exclusive_cumsum_is_caught(case, monkeypatch):
  """An exclusive in-chunk cumulative log-decay moves the outputs and d log_decay outside the tolerance."""
  exclusive = lambda g: jnp.cumsum(jnp.maximum(g, chunked.LOG_DECAY_FLOOR), axis=-2) - g
  monkeypatch.setattr(chunked, "decay_cumsum", exclusive)
  chunked._solve.clear_cache()
  try:
    got = _run(chunked, case.a, chunk_size=16)
  finally:
    chunked._solve.clear_cache()
  assert not close(got["o"], case.oracle["o"], *TOL)
  assert not close(got["log_decay"], case.oracle["log_decay"], *TOL)


def test_decay_after_the_write_is_caught(case, monkeypatch):
  """An oracle that decays the state after the write instead of before differs from the correct chunked solve
  by more than the tolerance (outputs and final state)."""
  # The oracle's body is decay_state(S, g) followed by online_write: swap the order by making the first a
  # no-op and decaying inside the write, after it.
  decay, write = naive.decay_state, naive.online_write
  pending = {}

  def hold_decay(S, g):
    pending["g"] = g
    return S

  def write_then_decay(S, k, k_write, v, beta):
    return decay(write(S, k, k_write, v, beta), pending["g"])

  monkeypatch.setattr(naive, "decay_state", hold_decay)
  monkeypatch.setattr(naive, "online_write", write_then_decay)
  naive._serial.clear_cache()
  try:
    mutant = _run(naive, case.a)
  finally:
    naive._serial.clear_cache()
  assert not close(case.chunked["o"], mutant["o"], *TOL)
  assert not close(case.chunked["S"], mutant["S"], *TOL)


def test_assert_trees_close_checks_structure_finiteness_and_dtypes():
  """A result equal to its reference passes; a missing name, a wrong shape, a NaN or inf (in the result or the
  reference), a dtype other than the map's, and an error above the tolerance each fail."""
  rng = np.random.default_rng(0)
  want = {"o": rng.normal(size=(2, 3)), "S": rng.normal(size=(4,)), "beta": None}
  good = {n: jnp.asarray(w, jnp.float32) for n, w in want.items() if w is not None}
  dtypes = {"o": jnp.float32, "S": jnp.float32}
  assert set(assert_trees_close(good, want, jnp.float32, dtypes=dtypes)) == {"o", "S"}
  nan = np.array(want["o"])
  nan[0, 0] = np.nan
  bad = [({"o": good["o"]}, want, dtypes),                                  # missing S
         (dict(good, S=good["S"][:3]), want, dtypes),                       # wrong shape
         (dict(good, o=jnp.asarray(nan, jnp.float32)), want, dtypes),       # NaN in the result
         (good, dict(want, S=np.full(4, np.inf)), dtypes),                  # inf in the reference
         (dict(good, o=good["o"].astype(jnp.bfloat16)), want, dtypes),      # o not in the contract's dtype
         (dict(good, S=good["S"] + 1e-3), want, dtypes)]                   # outside the fp32 tolerance
  for got, ref, dt in bad:
    with pytest.raises(AssertionError):
      assert_trees_close(got, ref, jnp.float32, dtypes=dt)


def test_contract_dtypes():
  """o in the inputs' dtype, S fp32 (fp64 for fp64 inputs), every gradient in its input's dtype."""
  p = random_problem(0, T=8, decay="scalar", initial_state=False)
  bf16 = contract_dtypes(p.arrays(jnp.bfloat16))
  assert (bf16["o"], bf16["S"], bf16["q"], bf16["beta"]) == (jnp.bfloat16, jnp.float32, jnp.bfloat16, jnp.float32)
  assert "initial_state" not in bf16 and "k_write" not in bf16
  f64 = contract_dtypes(p.arrays(jnp.float64, jnp.float64, jnp.float64))
  assert f64["o"] == f64["S"] == f64["log_decay"] == jnp.float64
