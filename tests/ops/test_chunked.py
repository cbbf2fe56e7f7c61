"""Chunked XLA solves against the token-serial oracle: outputs, final states and every input gradient.

The cross products of cases are computed a group at a time (every case of a group, chunked solve and fp64 oracle,
in one jitted program: `osdn_jax.testing.Batches`), each case asserting in its own test item. `make test` runs a
pairwise-covering subset of the fp32 products (every decay with every (T, chunk), and every write-key and head
layout with each of those); the rest are marked slow and run in CI's slow step. Random problems, gates, chaining
and zero padding with gradients: tests/ops/test_properties.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osdn_jax.ops import chunked, naive
from osdn_jax.testing import Batches, assert_trees_close, contract_dtypes, random_problem, rel_rms, vjp_all

DECAYS = ("none", "scalar", "channel")
# (T, chunk): T = 1, T < C, T a multiple of C and T with a tail, and every chunk size at least once.
LENGTHS = ((1, 16), (63, 32), (64, 64), (100, 128), (300, 16))
LAYOUTS = (("same", "mha"), ("same", "gva"), ("asym", "mha"), ("asym", "gva"))   # (write keys, heads)


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


# A case: (solve, dtype name, decay, k_write "same" / "asym", heads "mha" / "gva", T, chunk).
def _problem(case):
  solve, dtype, decay, k_write, heads, t, chunk = case
  gva = heads == "gva"
  if dtype == "bfloat16":
    return random_problem(5, T=100, H=2, HV=4 if gva else 2, decay=decay,
                          k_write="key" if solve == "online" else "none")
  if solve == "online":
    kw_mode = "none" if k_write == "same" else ("value" if gva else "key")
    return random_problem(t * 7 + chunk, T=t, H=2, HV=4 if gva else 2, decay=decay, k_write=kw_mode)
  return random_problem(t * 11 + chunk, T=t, H=2, HV=4 if gva else 2, decay=decay)


def _compute(cases):
  """Chunked (in the case's dtype) and the fp64 oracle (on the same rounded inputs) of every case, in one jitted
  program; per case (got, want, the dtypes the contract fixes)."""
  problems = [_problem(c) for c in cases]
  dtypes = [jnp.dtype(c[1]) for c in cases]
  arrays = [p.arrays(dt) for p, dt in zip(problems, dtypes)]
  refs = [p.rounded(dt).arrays(jnp.float64, jnp.float64, jnp.float64) for p, dt in zip(problems, dtypes)]

  def run(arrays, refs):
    got = [vjp_all((_online if c[0] == "online" else _offline)(chunked, c[-1]), a) for c, a in zip(cases, arrays)]
    want = [vjp_all((_online if c[0] == "online" else _offline)(naive), r) for c, r in zip(cases, refs)]
    return got, want

  got, want = jax.jit(run)(arrays, refs)
  return [(g, {n: w[n] for n in g}, contract_dtypes(a)) for g, w, a in zip(got, want, arrays)]


def _pairwise_online(decay, k_write, heads, t, chunk):
  """15 of the 60 fp32 online cases: every (decay, length) once, the layouts rotating so that every layout meets
  every decay and every length too."""
  return LAYOUTS[(DECAYS.index(decay) + LENGTHS.index((t, chunk))) % 4] == (k_write, heads)


def _pairwise_offline(decay, heads, t, chunk):
  """15 of the 30 fp32 offline cases: every (decay, length) once, MHA and GVA alternating."""
  return ("mha", "gva")[(DECAYS.index(decay) + LENGTHS.index((t, chunk))) % 2] == heads


def _group(case):
  """Cases computed together: one solve, dtype and decay, and one side of `make test`'s subset."""
  solve, dtype, decay, k_write, heads, t, chunk = case
  if dtype == "bfloat16":
    return (solve, dtype)
  covered = (_pairwise_online(decay, k_write, heads, t, chunk) if solve == "online"
             else _pairwise_offline(decay, heads, t, chunk))
  return (solve, dtype, decay, "covering" if covered else "rest")


ONLINE = [("online", "float32", d, kw, h, t, c) for d in DECAYS for kw, h in LAYOUTS for t, c in LENGTHS]
OFFLINE = [("offline", "float32", d, "same", h, t, c) for d in DECAYS for h in ("mha", "gva") for t, c in LENGTHS]
BF16 = [(s, "bfloat16", d, "same", h, 100, 32) for s in ("online", "offline") for d in DECAYS for h in ("mha", "gva")]


def _params(cases, ids):
  """pytest params: the cases outside `make test`'s subset marked slow."""
  return [pytest.param(c, id=ids(c), marks=[pytest.mark.slow] if "rest" in _group(c) else []) for c in cases]


@pytest.fixture(scope="module")
def solved():
  return Batches(ONLINE + OFFLINE + BF16, _group, _compute)


def _check(solved, case):
  got, want, dtypes = solved.get(case)
  assert_trees_close(got, want, jnp.dtype(case[1]), dtypes=dtypes)


@pytest.mark.parametrize("case", _params(ONLINE, lambda c: "-".join(map(str, c[2:]))))
def test_online_fp32(solved, case):
  """The online solve in fp32 against the oracle: outputs, final states and every input gradient."""
  _check(solved, case)


@pytest.mark.parametrize("case", _params(OFFLINE, lambda c: "-".join(map(str, (c[2],) + c[4:]))))
def test_offline_fp32(solved, case):
  """The offline solve (linear attention) in fp32 against the oracle."""
  _check(solved, case)


@pytest.mark.parametrize("case", _params(BF16, lambda c: f"{c[0]}-{c[2]}-{c[4]}"))
def test_bf16(solved, case):
  """Both solves with bf16 inputs (T = 100, chunk 32) against the oracle on the same bf16 values, at the bf16
  tolerances; outputs in bf16, final states in fp32."""
  _check(solved, case)


@pytest.mark.parametrize("decay", DECAYS)
def test_fp64_chunked_is_exact(decay):
  """The chunkwise form is algebraically exact: in fp64 it matches the oracle to round-off."""
  p = random_problem(3, T=100, decay=decay, k_write="key")
  a = p.arrays(jnp.float64, jnp.float64, jnp.float64)
  o1, s1 = naive.delta_rule(**a)
  o2, s2 = chunked.delta_rule(**a, chunk_size=64)
  assert rel_rms(o2, o1) < 1e-13 and rel_rms(s2, s1) < 1e-13


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
