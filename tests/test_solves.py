"""Chunked XLA solves against the token-serial oracle: outputs, final states and every input gradient."""
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from osdn_jax.ops import chunked, naive
from osdn_jax.testing import assert_trees_close, random_problem, rel_rms, vjp_all

DECAYS = ("none", "scalar", "channel")
# (T, chunk): every T of the issue and every chunk size at least once, including T < C and T = 1.
LENGTHS = ((1, 16), (63, 32), (64, 64), (100, 128), (300, 16))


def _online(impl, chunk=None):
  def fn(q, k, v, beta, k_write, log_decay, initial_state):
    kw = {} if chunk is None else dict(chunk_size=chunk)
    return impl.delta_rule(q, k, v, beta, k_write=k_write, log_decay=log_decay,
                           initial_state=initial_state, **kw)
  return fn


def _offline(impl, chunk=None):
  def fn(q, k, v, beta, k_write, log_decay, initial_state):
    del k_write
    kw = {} if chunk is None else dict(chunk_size=chunk)
    return impl.linear_attention(q, k, v, beta=beta, log_decay=log_decay, initial_state=initial_state, **kw)
  return fn


def compare(problem, make, chunk, dtype):
  """Chunked in `dtype` against the fp64 oracle on the same (rounded) inputs; returns the errors."""
  got = vjp_all(make(chunked, chunk), problem.arrays(dtype))
  ref = problem.rounded(dtype)
  want = vjp_all(make(naive), ref.arrays(jnp.float64, jnp.float64, jnp.float64))
  want = {n: w for n, w in want.items() if n in got}
  return assert_trees_close(got, want, dtype)


@pytest.mark.parametrize("T,chunk", LENGTHS)
@pytest.mark.parametrize("gva", [False, True], ids=["mha", "gva"])
@pytest.mark.parametrize("k_write", ["same", "asym"])
@pytest.mark.parametrize("decay", DECAYS)
def test_online_fp32(decay, k_write, gva, T, chunk):
  kw_mode = "none" if k_write == "same" else ("value" if gva else "key")
  p = random_problem(T * 7 + chunk, T=T, H=2, HV=4 if gva else 2, decay=decay, k_write=kw_mode)
  compare(p, _online, chunk, jnp.float32)


@pytest.mark.parametrize("T,chunk", LENGTHS)
@pytest.mark.parametrize("gva", [False, True], ids=["mha", "gva"])
@pytest.mark.parametrize("decay", DECAYS)
def test_offline_fp32(decay, gva, T, chunk):
  p = random_problem(T * 11 + chunk, T=T, H=2, HV=4 if gva else 2, decay=decay)
  compare(p, _offline, chunk, jnp.float32)


@pytest.mark.parametrize("gva", [False, True], ids=["mha", "gva"])
@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("solve", ["online", "offline"])
def test_bf16(solve, decay, gva):
  p = random_problem(5, T=100, H=2, HV=4 if gva else 2, decay=decay, k_write="key" if solve == "online" else "none")
  compare(p, _online if solve == "online" else _offline, 32, jnp.bfloat16)


@pytest.mark.parametrize("decay", DECAYS)
def test_fp64_chunked_is_exact(decay):
  """The chunkwise form is algebraically exact: in fp64 it matches the oracle to round-off."""
  p = random_problem(3, T=100, decay=decay, k_write="key")
  a = p.arrays(jnp.float64, jnp.float64, jnp.float64)
  o1, s1 = naive.delta_rule(**a)
  o2, s2 = chunked.delta_rule(**a, chunk_size=64)
  assert rel_rms(o2, o1) < 1e-13 and rel_rms(s2, s1) < 1e-13


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), decay=st.sampled_from(DECAYS), decay_bias=st.floats(-2.0, 8.0),
       spread=st.floats(0.0, 1.0), gain=st.floats(0.0, 1.0))
def test_online_random_gates(seed, decay, decay_bias, spread, gain):
  """Fixed shapes (one compile per decay), random values: strong and weak decays, wide write scalings."""
  p = random_problem(seed, T=70, H=2, HV=4, decay=decay, k_write="value", decay_bias=decay_bias,
                     write_spread=spread)
  p.beta = p.beta * gain
  compare(p, _online, 32, jnp.float32)


@pytest.mark.parametrize("decay", DECAYS)
def test_padding_is_invisible(decay):
  """T = 100 equals the same inputs zero-padded to 128 (β = 0, g = 0 there), sliced."""
  p = random_problem(9, T=100, decay=decay, k_write="key")
  a = p.arrays(jnp.float32)
  o, s = chunked.delta_rule(**a, chunk_size=32)
  pad = lambda x: None if x is None else jnp.pad(x, [(0, 0), (0, 28)] + [(0, 0)] * (x.ndim - 2))
  padded = {n: (pad(x) if n != "initial_state" else x) for n, x in a.items()}
  o2, s2 = chunked.delta_rule(**padded, chunk_size=32)
  np.testing.assert_allclose(np.asarray(o2[:, :100]), np.asarray(o), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(s2), np.asarray(s), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("decay", DECAYS)
def test_states_after_every_token(decay):
  """chunked.delta_rule_states equals the oracle's state after each token."""
  p = random_problem(12, T=45, H=2, HV=4, V=3, decay=decay, k_write="value")
  a = p.arrays(jnp.float64, jnp.float64, jnp.float64)
  emit = lambda S_pre, S, q, k, v, scale: S
  want, want_last = naive.trajectory(emit, a["k"], a["v"], a["beta"], k_write=a["k_write"],
                                     log_decay=a["log_decay"], initial_state=a["initial_state"])
  got, last = chunked.delta_rule_states(a["k"], a["v"], a["beta"], k_write=a["k_write"],
                                        log_decay=a["log_decay"], initial_state=a["initial_state"],
                                        chunk_size=16)
  assert rel_rms(got, want) < 1e-13 and rel_rms(last, want_last) < 1e-13
