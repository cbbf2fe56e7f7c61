"""Faults stay where they happen (`osdn_jax.ops.faults`, docs/faults.md): a NaN or inf at one token of one input
leaves every output before it, in the other value heads and in every other
sequence (batch row or packed segment) equal to the clean run; from the token on its sequence is non-finite;
the other sequences' input gradients are the clean ones."""
import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from osdn_jax import checking, ops
from osdn_jax.ops import packing
from osdn_jax.testing import examples, random_problem

B, T, H, HV, K, V, C = 2, 37, 1, 2, 16, 16, 16
IDS = np.asarray([[0] * 9 + [1] * 16 + [2] * 12, [5] * 20 + [6] * 17], np.int32)   # segments cross chunks
IMPLEMENTATIONS = ("reference", "xla", "pallas")
# (op, decay, packed, k_write): every decay, packed and not, a write key per value head, the offline solve.
CASES = [("delta_rule", "none", False, "none"), ("delta_rule", "scalar", True, "value"),
         ("delta_rule", "channel", True, "key"), ("delta_rule", "channel", False, "value"),
         ("linear_attention", "scalar", True, "none")]


def _inputs(case, seed):
  op, decay, packed, k_write = case
  p = random_problem(seed, B=B, T=T, H=H, HV=HV, K=K, V=V, decay=decay, k_write=k_write)
  arrays = p.arrays(jnp.float32)
  if packed:
    arrays["initial_state"] = jnp.asarray(np.random.default_rng(seed).normal(size=(5, HV, K, V)) / 4, jnp.float32)
  if op == "linear_attention":
    del arrays["k_write"]
  return arrays


@functools.partial(jax.jit, static_argnames=("op", "packed", "implementation"))
def _solve(arrays, *, op, packed, implementation):
  fn = getattr(ops, op)
  if op == "delta_rule":
    args = (arrays["q"], arrays["k"], arrays["v"], arrays["beta"])
    rest = {n: x for n, x in arrays.items() if n not in ("q", "k", "v", "beta")}
  else:
    args = (arrays["q"], arrays["k"], arrays["v"])
    rest = {n: x for n, x in arrays.items() if n not in ("q", "k", "v")}
  return fn(*args, **rest, output_final_state=True, chunk_size=C, segment_ids=IDS if packed else None,
            implementation=implementation)


def _grads(arrays, ct, **kw):
  out, pull = jax.vjp(lambda a: _solve(a, **kw), arrays)
  return out, pull(ct)[0]


def _segment(packed, b, t):
  """(first, last, number) of the sequence holding token (b, t): N numbering when packed, else the row b."""
  if not packed:
    return 0, T - 1, b
  starts = np.asarray(packing.segment_starts(IDS))
  index = np.asarray(packing.segment_index(IDS))
  first = max(s for s in range(t + 1) if starts[b, s])
  last = next((s - 1 for s in range(t + 1, T) if starts[b, s]), T - 1)
  return first, last, int(index[b, t])


def _fault(data, arrays):
  """Draws (name, (b, t, head), value) and returns the faulty arrays, the token, the value heads reading it."""
  names = sorted(n for n, x in arrays.items() if x is not None and n != "initial_state")
  name = data.draw(st.sampled_from(names), label="input")
  b, t = data.draw(st.integers(0, B - 1), label="row"), data.draw(st.integers(0, T - 1), label="token")
  heads = arrays[name].shape[2]
  head = data.draw(st.integers(0, heads - 1), label="head")
  value = data.draw(st.sampled_from([np.nan, np.inf] + ([] if name == "log_decay" else [-np.inf])), label="value")
  index = (b, t, head) + ((data.draw(st.integers(0, arrays[name].shape[3] - 1), label="channel"),)
                          if arrays[name].ndim == 4 else ())
  faulty = dict(arrays, **{name: arrays[name].at[index].set(value)})
  group = HV // heads
  return name, faulty, (b, t), list(range(head * group, (head + 1) * group))


def _affected(packed, b, t, heads, name):
  """[B, T, HV] bool mask of the outputs the fault makes non-finite; the final-state mask [N or B, HV]."""
  _, last, n = _segment(packed, b, t)
  out = np.zeros((B, T, HV), bool)
  out[b, t:(t + 1 if name == "q" else last + 1), heads] = True
  fin = np.zeros((packing.num_segments(IDS) if packed else B, HV), bool)
  if name != "q":
    fin[n, heads] = True
  return out, fin


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@settings(max_examples=examples(4))
@given(data=st.data())
def test_a_fault_stays_in_its_sequence_from_its_token_on(implementation, case, data):
  packed = case[2]
  arrays = _inputs(case, data.draw(st.integers(0, 2 ** 16), label="seed"))
  name, faulty, (b, t), heads = _fault(data, arrays)
  kw = dict(op=case[0], packed=packed, implementation=implementation)
  o, S = _solve(arrays, **kw)
  fo, fS = _solve(faulty, **kw)
  out, fin = _affected(packed, b, t, heads, name)
  o, S, fo, fS = map(np.asarray, (o, S, fo, fS))
  np.testing.assert_allclose(fo[~out], o[~out], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(fS[~fin], S[~fin], rtol=1e-6, atol=1e-6)
  assert not np.isfinite(fo[out]).all(axis=-1).any(), f"an output after the fault in `{name}` is finite"
  assert not np.isfinite(fS[fin]).all(axis=(-2, -1)).any(), f"a final state after the fault in `{name}` is finite"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", CASES[1:3], ids=lambda c: "-".join(map(str, c)))
@settings(max_examples=examples(2))
@given(data=st.data())
def test_a_fault_leaves_the_other_sequences_gradients_clean(implementation, case, data):
  packed = case[2]
  arrays = _inputs(case, data.draw(st.integers(0, 2 ** 16), label="seed"))
  name, faulty, (b, t), heads = _fault(data, arrays)
  kw = dict(op=case[0], packed=packed, implementation=implementation)
  rng = np.random.default_rng(0)
  o, S = _solve(arrays, **kw)
  ct = (jnp.asarray(rng.normal(size=o.shape), o.dtype), jnp.asarray(rng.normal(size=S.shape), S.dtype))
  _, clean = _grads(arrays, ct, **kw)
  _, got = _grads(faulty, ct, **kw)
  first, last, n = _segment(packed, b, t)
  seq = np.zeros((B, T), bool)
  seq[b, first:last + 1] = True
  for x in clean:
    if clean[x] is None:
      continue
    g, want = np.asarray(got[x]), np.asarray(clean[x])
    if x == "initial_state":
      others = np.arange(g.shape[0]) != n
      np.testing.assert_allclose(g[others], want[others], rtol=1e-5, atol=1e-6, err_msg=x)
      continue
    np.testing.assert_allclose(g[~seq], want[~seq], rtol=1e-5, atol=1e-6, err_msg=x)
  if implementation == "xla":   # the XLA path marks them all; the oracle's dq, dv stay finite
    assert not np.isfinite(np.asarray(got[name])[seq]).all(), f"the poisoned sequence's d{name} is finite"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_nonfinite_initial_state_poisons_its_sequence_only(implementation):
  case = CASES[1]
  arrays = _inputs(case, 3)
  faulty = dict(arrays, initial_state=arrays["initial_state"].at[3, 1, 2, 5].set(np.nan))   # segment 3: row 1
  kw = dict(op=case[0], packed=True, implementation=implementation)
  o, S = map(np.asarray, _solve(arrays, **kw))
  fo, fS = map(np.asarray, _solve(faulty, **kw))
  out = np.zeros((B, T, HV), bool)
  out[1, :20, 1] = True
  fin = np.zeros((5, HV), bool)
  fin[3, 1] = True
  np.testing.assert_allclose(fo[~out], o[~out], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(fS[~fin], S[~fin], rtol=1e-6, atol=1e-6)
  assert not np.isfinite(fo[out]).all(axis=-1).any() and not np.isfinite(fS[fin]).all()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_minus_inf_log_decay_is_a_gate_not_a_fault(implementation):
  """−inf is clamped at the floor like any log-decay below it: the result is finite and equals the floor's."""
  arrays = _inputs(CASES[1], 4)
  kw = dict(op="delta_rule", packed=True, implementation=implementation)
  at_floor = _solve(dict(arrays, log_decay=arrays["log_decay"].at[0, 12, 1].set(-1e4)), **kw)
  at_inf = _solve(dict(arrays, log_decay=arrays["log_decay"].at[0, 12, 1].set(-np.inf)), **kw)
  for x, y in zip(at_inf, at_floor):
    assert np.isfinite(np.asarray(x)).all()
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# Traced segment ids in checked mode; degenerate sizes; option values.
# ---------------------------------------------------------------------------------------------------------
def _small(B=1, T=8, H=1, K=4, V=4, dtype=jnp.float32):
  z = lambda *s: jnp.ones(s, dtype) * 0.1
  return z(B, T, H, K), z(B, T, H, K), z(B, T, H, V), z(B, T, H)


@pytest.mark.parametrize("ids, n, message", [
    ([[0, 0, 1, 1, 2, 2, 3, 3]], 3, "hold 4 segments but `initial_state` is for N = 3"),
    ([[0, 0, 1, 1, 0, 0, 2, 2]], 4, "non-decreasing along T in each row, got a decrease at [0, 4]"),
])
def test_traced_segment_ids_are_checked_in_checked_mode(ids, n, message):
  q, k, v, b = _small()
  s0 = jnp.zeros((n, 1, 4, 4))

  @jax.jit
  def f(ids):
    return ops.delta_rule(q, k, v, b, segment_ids=ids, initial_state=s0, output_final_state=True,
                          implementation="xla")

  f(jnp.asarray(ids, jnp.int32))      # unchecked: runs
  with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
    checking.checked(f)(jnp.asarray(ids, jnp.int32))
  good = [[0, 0, 1, 1, 2, 2, 3, 3]] if n == 4 else [[0, 0, 0, 1, 1, 1, 2, 2]]
  checking.checked(f)(jnp.asarray(good, jnp.int32))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape", [dict(B=0), dict(T=0)], ids=["B=0", "T=0"])
@pytest.mark.parametrize("packed", [False, True])
def test_empty_batches_and_sequences_give_empty_results(implementation, shape, packed):
  q, k, v, b = _small(**shape)
  ids = jnp.zeros(q.shape[:2], jnp.int32) if packed else None
  s0 = None if packed else jnp.ones((q.shape[0], 1, 4, 4))
  for op in ("delta_rule", "linear_attention"):
    args = (q, k, v, b) if op == "delta_rule" else (q, k, v)
    o, S = getattr(ops, op)(*args, initial_state=s0, segment_ids=ids, output_final_state=True,
                            implementation=implementation)
    assert o.shape == v.shape and o.dtype == q.dtype
    assert S.shape == ((0,) if packed else (q.shape[0],)) + (1, 4, 4) and S.dtype == jnp.float32
    if not packed:
      np.testing.assert_array_equal(np.asarray(S), np.asarray(s0))


@pytest.mark.parametrize("change, argument", [
    (dict(K=0), "`q`"), (dict(V=0), "`v`"), (dict(H=0), "`q`"),
])
def test_zero_sized_heads_and_dims_are_named_errors(change, argument):
  q, k, v, b = _small(**change)
  with pytest.raises(ValueError, match=argument):
    ops.delta_rule(q, k, v, b)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(chunk_size=64.0), "`chunk_size`"), (dict(chunk_size=True), "`chunk_size`"),
    (dict(chunk_size=48), "`chunk_size`"), (dict(scale=1j), "`scale`"), (dict(scale=float("nan")), "`scale`"),
    (dict(scale=jnp.ones(2)), "`scale`"), (dict(scale=True), "`scale`"),
])
def test_option_values_are_checked(kwargs, argument):
  q, k, v, b = _small()
  with pytest.raises(ValueError, match=argument):
    ops.delta_rule(q, k, v, b, **kwargs)
  with pytest.raises(ValueError, match=argument):
    ops.linear_attention(q, k, v, **kwargs)


def test_a_traced_scale_is_accepted():
  q, k, v, b = _small()
  o = jax.jit(lambda s: ops.delta_rule(q, k, v, b, scale=s)[0])(jnp.float32(0.5))
  np.testing.assert_allclose(np.asarray(o), np.asarray(ops.delta_rule(q, k, v, b, scale=0.5)[0]), rtol=1e-6)
