"""The comparator can fail: plausible bugs in a solve are each caught by the tolerances the suite uses."""
import jax.numpy as jnp
import pytest

from osdn_jax.ops import chunked, naive
from osdn_jax.testing import close, random_problem, vjp_all

TOL = (1e-5, 1e-6)


def _run(impl, arrays, **kw):
  def fn(q, k, v, beta, k_write, log_decay, initial_state):
    return impl.delta_rule(q, k, v, beta, k_write=k_write, log_decay=log_decay, initial_state=initial_state,
                           **kw)
  return vjp_all(fn, arrays)


def _all_close(got, want):
  return all(close(got[n], want[n], *TOL) for n in want)


@pytest.fixture(params=["scalar", "channel"])
def problem(request):
  return random_problem(11, T=50, decay=request.param, k_write="key")


def test_correct_solve_passes(problem):
  a = problem.arrays(jnp.float32)
  assert _all_close(_run(chunked, a, chunk_size=16), _run(naive, problem.arrays(jnp.float64, jnp.float64,
                                                                                jnp.float64)))


def test_swapped_read_and_write_keys_are_caught(problem):
  a = problem.arrays(jnp.float32)
  swapped = dict(a, k=a["k_write"], k_write=a["k"])
  got = _run(chunked, swapped, chunk_size=16)
  want = _run(naive, a)
  assert not close(got["o"], want["o"], *TOL)
  assert not close(got["S"], want["S"], *TOL)


def test_exclusive_cumsum_is_caught(problem, monkeypatch):
  exclusive = lambda g: jnp.cumsum(jnp.maximum(g, chunked.LOG_DECAY_FLOOR), axis=-2) - g
  monkeypatch.setattr(chunked, "decay_cumsum", exclusive)
  chunked._solve.clear_cache()
  try:
    a = problem.arrays(jnp.float32)
    got = _run(chunked, a, chunk_size=16)
  finally:
    chunked._solve.clear_cache()
  want = _run(naive, a)
  assert not close(got["o"], want["o"], *TOL)
  assert not close(got["log_decay"], want["log_decay"], *TOL)


def test_decay_after_the_write_is_caught(problem, monkeypatch):
  # The oracle's body is decay_state(S, g) followed by online_write: swap the order by making the first a
  # no-op and decaying inside the write, after it.
  decay, write = naive.decay_state, naive.online_write
  pending = {}

  def hold_decay(S, g):
    pending["g"] = g
    return S

  def write_then_decay(S, k, k_write, v, beta):
    return decay(write(S, k, k_write, v, beta), pending["g"])

  a = problem.arrays(jnp.float32)
  got = _run(chunked, a, chunk_size=16)
  monkeypatch.setattr(naive, "decay_state", hold_decay)
  monkeypatch.setattr(naive, "online_write", write_then_decay)
  naive._serial.clear_cache()
  try:
    mutant = _run(naive, a)
  finally:
    naive._serial.clear_cache()
  assert not close(got["o"], mutant["o"], *TOL)
  assert not close(got["S"], mutant["S"], *TOL)
