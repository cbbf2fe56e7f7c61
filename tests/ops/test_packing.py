"""Packed sequences (`segment_ids`): every segment equals running it on its own, values and all gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osdn_jax import ops
from osdn_jax.ops import naive, packing
from osdn_jax.testing import assert_trees_close, close, contract_dtypes, random_problem, vjp_all

T, H, HV, K, V = 100, 1, 2, 16, 32
# Row 0: starts on chunk edges (16, 32, 48, 64), at the last token of a chunk (31), just after an edge, and a
# length-1 segment at the very end. Row 1: random lengths with a forced run of length-1 segments.
ROW0 = [16, 1, 14, 1, 16, 1, 15, 1, 34, 1]


def _row1(seed=7):
  """Random lengths summing to T, starting with two segments of length 1."""
  cuts = np.sort(np.random.default_rng(seed).choice(np.arange(3, T), size=8, replace=False))
  return list(np.diff(np.concatenate([[0, 1, 2], cuts, [T]])))


def segment_ids(rows):
  """Ids with gaps and an offset (only boundaries matter): [len(rows), T] int32."""
  return np.stack([10 + 3 * np.repeat(np.arange(len(r)), r) for r in rows]).astype(np.int32)


IDS = segment_ids([ROW0, _row1()])
N = packing.num_segments(IDS)


class Layout:
  """Maps between the packed layout [B, T, ...] and one row per segment [N, L, ...] (zero padded)."""

  def __init__(self, ids):
    starts = np.asarray(packing.segment_starts(ids))
    self.segments = []
    for b in range(ids.shape[0]):
      s = list(np.flatnonzero(starts[b])) + [ids.shape[1]]
      self.segments += [(b, s[i], s[i + 1] - s[i]) for i in range(len(s) - 1)]
    length = max(l for _, _, l in self.segments)
    t = np.arange(length)
    self.row = np.array([[b] * length for b, _, _ in self.segments])
    self.time = np.array([np.minimum(s + t, s + l - 1) for _, s, l in self.segments])
    self.valid = np.array([t < l for _, _, l in self.segments])
    self.n = np.asarray(packing.segment_index(ids))
    self.pos = np.arange(ids.shape[1])[None] - np.array([s for _, s, _ in self.segments])[self.n]

  def unpack(self, x):
    if x is None:
      return None
    valid = self.valid.reshape(self.valid.shape + (1,) * (x.ndim - 2))
    return jnp.where(valid, x[self.row, self.time], 0)   # zero padding: β = 0, g = 0 leave the state as is

  def pack(self, y):
    return y[self.n, self.pos]


LAYOUT = Layout(IDS)


def _packed(solve, impl, chunk, ids=IDS):
  def fn(q, k, v, beta, k_write, log_decay, initial_state):
    kw = dict(log_decay=log_decay, initial_state=initial_state, output_final_state=True, chunk_size=chunk or 64,
              segment_ids=ids, implementation=impl)
    if solve == "online":
      return ops.delta_rule(q, k, v, beta, k_write=k_write, **kw)
    return ops.linear_attention(q, k, v, beta=beta, **kw)
  return fn


def _alone(solve, layout=LAYOUT):
  """The reference: every segment in its own row of an unpacked fp64 oracle run, mapped back."""
  def fn(q, k, v, beta, k_write, log_decay, initial_state):
    q, k, v, beta, k_write, log_decay = map(layout.unpack, (q, k, v, beta, k_write, log_decay))
    if solve == "online":
      o, S = naive.delta_rule(q, k, v, beta, k_write=k_write, log_decay=log_decay, initial_state=initial_state)
    else:
      o, S = naive.linear_attention(q, k, v, beta=beta, log_decay=log_decay, initial_state=initial_state)
    return layout.pack(o), S
  return fn


def _problem(seed, decay, solve, with_initial, ids=IDS):
  p = random_problem(seed, B=ids.shape[0], T=ids.shape[1], H=H, HV=HV, K=K, V=V, decay=decay,
                     k_write="key" if solve == "online" else "none", initial_state=False)
  n = packing.num_segments(ids)
  if with_initial:
    p.initial_state = np.random.default_rng(seed + 1).normal(size=(n, HV, K, V)) / np.sqrt(K)
  return p


def compare(p, solve, impl, chunk, want=None):
  """The packed solve against the reference (results in the contract's dtypes); returns (errors, the reference's
  results for reuse)."""
  arrays = p.arrays(jnp.float32)
  got = vjp_all(_packed(solve, impl, chunk), arrays)
  if want is None:
    want = vjp_all(_alone(solve), p.arrays(jnp.float64, jnp.float64, jnp.float64))
  errors = assert_trees_close(got, {n: w for n, w in want.items() if n in got}, jnp.float32,
                              dtypes=contract_dtypes(arrays))
  return errors, want


# Chunk 16 for scalar decay, 32 (two per-channel sub-blocks: the reference-point factoring) otherwise.
CHUNK = {"none": 32, "scalar": 16, "channel": 32}


def check_no_gradient_crosses(fn, arrays, m, nonzero=True):
  """Pulls a cotangent that is nonzero only on segment m (its outputs and final state) back through fn:
  the gradient w.r.t. every input of every other segment is exactly zero (and, if `nonzero`, not w.r.t.
  segment m's inputs)."""
  names = [n for n, x in arrays.items() if x is not None]
  (o, S), pull = jax.vjp(lambda *xs: fn(**dict(arrays, **dict(zip(names, xs)))), *(arrays[n] for n in names))
  mask = LAYOUT.n == m
  rng = np.random.default_rng(m)
  ct_o = jnp.where(mask[..., None, None], jnp.asarray(rng.normal(size=o.shape), o.dtype), 0.0)
  ct_S = jnp.zeros_like(S).at[m].set(jnp.asarray(rng.normal(size=S.shape[1:]), S.dtype))
  for name, g in zip(names, pull((ct_o, ct_S))):
    g = np.asarray(g)
    inside = (np.arange(N) == m) if name == "initial_state" else mask
    assert np.all(g[~inside] == 0.0), f"{name}: gradient crosses a segment boundary"
    assert not nonzero or np.any(g[inside] != 0.0), name


CASES = [(solve, decay, "S0") for solve in ("online", "offline") for decay in ("none", "scalar", "channel")]
CASES += [("online", "channel", "zeros"), ("offline", "scalar", "zeros")]
# `make test`: every solve, decay and initial state once; the slow step: every case.
_COVERING = {("online", "none", "S0"), ("offline", "scalar", "S0"), ("online", "channel", "zeros")}


@pytest.mark.parametrize("solve,decay,initial", [
    pytest.param(*c, id="-".join(c), marks=[] if c in _COVERING else [pytest.mark.slow]) for c in CASES])
def test_packed_equals_each_segment_alone(solve, decay, initial):
  """xla and naive: outputs, final states and all gradients; and for xla no gradient crosses a boundary
  (row 0's segment [65, 99) crosses the chunk edge at 96; row 1's second segment has length 1)."""
  p = _problem(3, decay, solve, initial == "S0")
  _, want = compare(p, solve, "xla", CHUNK[decay])
  compare(p, solve, "naive", None, want)
  fn = _packed(solve, "xla", CHUNK[decay])
  check_no_gradient_crosses(fn, p.arrays(jnp.float32), int(LAYOUT.n[0, 65]))
  check_no_gradient_crosses(fn, p.arrays(jnp.float32), int(LAYOUT.n[1, 1]), nonzero=False)


def test_segment_helpers_and_cu_seqlens_round_trip():
  ids = np.array([[4, 4, 4, 9, 9, 11, 12, 12]])
  np.testing.assert_array_equal(packing.segment_index(ids), [[0, 0, 0, 1, 1, 2, 3, 3]])
  assert packing.num_segments(ids) == 4 and packing.num_segments(IDS) == N
  cu = ops.cu_seqlens_from_segment_ids(ids)
  np.testing.assert_array_equal(cu, [0, 3, 5, 6, 8])
  back = ops.segment_ids_from_cu_seqlens(cu)
  assert back.dtype == jnp.int32 and back.shape == (1, 8)
  np.testing.assert_array_equal(packing.segment_index(back), packing.segment_index(ids))
  np.testing.assert_array_equal(ops.cu_seqlens_from_segment_ids(back), cu)
  # Traced cu_seqlens with a static total length; the tail after cu[-1] becomes its own segment.
  ids2 = jax.jit(lambda c: ops.segment_ids_from_cu_seqlens(c, total_length=10))(jnp.asarray(cu))
  np.testing.assert_array_equal(ids2[0], [0, 0, 0, 1, 1, 2, 3, 3, 4, 4])


def test_jit_with_traced_segment_ids():
  p = _problem(6, "scalar", "online", True)
  a = p.arrays(jnp.float32)
  q, k, v, beta = (a.pop(n) for n in ("q", "k", "v", "beta"))
  s0 = a.pop("initial_state")
  run = lambda ids, impl, **kw: ops.delta_rule(q, k, v, beta, **a, segment_ids=ids, chunk_size=16,
                                               implementation=impl, **kw)
  # Traced ids with N from initial_state.
  o, S = run(IDS, "naive", initial_state=s0, output_final_state=True)
  oj, Sj = jax.jit(lambda ids, s0: run(ids, "xla", initial_state=s0, output_final_state=True))(IDS, s0)
  assert close(oj, o, 1e-5, 1e-6) and close(Sj, S, 1e-5, 1e-6)
  # Traced ids without final states or initial states: N is not needed.
  o0, _ = run(IDS, "naive")
  for impl in ("xla", "naive"):
    oj0, Sj0 = jax.jit(lambda ids: run(ids, impl))(IDS)
    assert Sj0 is None and close(oj0, o0, 1e-5, 1e-6)
  with pytest.raises(ValueError, match="`initial_state`"):
    jax.jit(lambda ids: run(ids, "xla", output_final_state=True))(IDS)


def _args():
  z = lambda *s: np.zeros(s, np.float32)
  return z(2, 8, 2, 16), z(2, 8, 2, 16), z(2, 8, 2, 32), z(2, 8, 2)


BAD_IDS = {
    "shape": np.zeros((2, 9), np.int32),
    "rank": np.zeros((16,), np.int32),
    "dtype": np.zeros((2, 8), np.float32),
    "decreasing": np.array([[0, 0, 1, 1, 2, 2, 3, 3], [0, 1, 2, 3, 2, 4, 5, 6]], np.int32),
}


@pytest.mark.parametrize("case", list(BAD_IDS))
@pytest.mark.parametrize("solve", ["online", "offline"])
def test_invalid_segment_ids(solve, case):
  q, k, v, beta = _args()
  with pytest.raises(ValueError, match="`segment_ids`"):
    if solve == "online":
      ops.delta_rule(q, k, v, beta, segment_ids=BAD_IDS[case])
    else:
      ops.linear_attention(q, k, v, segment_ids=BAD_IDS[case])


def test_packed_initial_state_and_implementation_are_checked():
  q, k, v, beta = _args()
  ids = np.array([[0, 0, 1, 1, 1, 2, 2, 2]] * 2, np.int32)              # N = 6
  with pytest.raises(ValueError, match=r"`initial_state`.*\(6, 2, 16, 32\)"):
    ops.delta_rule(q, k, v, beta, segment_ids=ids, initial_state=np.zeros((2, 2, 16, 32), np.float32))
  # The kernels need N static: traced ids without initial_state are refused by "pallas" (auto: xla).
  with pytest.raises(ValueError, match="`segment_ids`.*`initial_state`"):
    jax.jit(lambda ids: ops.delta_rule(q, k, v, beta, segment_ids=ids, implementation="pallas"))(ids)
  o, _ = jax.jit(lambda ids: ops.delta_rule(q, k, v, beta, segment_ids=ids, implementation="auto"))(ids)
  assert o.shape == (2, 8, 2, 32)


# The Pallas GPU kernels (interpret mode on CPU) lay the segments out chunk-aligned
# (pallas_kernels/packed.py).
@pytest.mark.parametrize("decay", [pytest.param("none", marks=pytest.mark.slow),
                                   pytest.param("scalar", marks=pytest.mark.slow), "channel"])
def test_pallas_packed_equals_each_segment_alone(decay):
  """Values and all gradients against the fp64 segment-alone reference, per-segment initial states, value-head
  write keys (asymmetric) with GVA; no gradient crosses a boundary."""
  p = random_problem(11, B=IDS.shape[0], T=T, H=H, HV=HV, K=K, V=V, decay=decay, k_write="value",
                     initial_state=False)
  p.initial_state = np.random.default_rng(12).normal(size=(N, HV, K, V)) / np.sqrt(K)
  compare(p, "online", "pallas", 16)
  if decay == "scalar":       # the offline solve goes through the same kernels (zero erase key)
    compare(_problem(15, decay, "offline", True), "offline", "pallas", 16)
  fn = _packed("online", "pallas", 16)
  check_no_gradient_crosses(fn, p.arrays(jnp.float32), int(LAYOUT.n[0, 65]))
  check_no_gradient_crosses(fn, p.arrays(jnp.float32), int(LAYOUT.n[1, 1]), nonzero=False)


def test_packed_row_lanes_partition_the_chunks():
  """The lanes of the packed state passes: segment n's lane starts at its first chunk, lanes tile [0, NC) in
  order (absent segments: empty lanes; the last lane also takes the trailing padding chunks); token positions
  strictly increase."""
  from pallas_kernels import packed
  ids = segment_ids([[30, 1, 29, 40], [2, 98]])
  n, c = packing.num_segments(ids) + 2, 16
  pos, info, present = packed.chunk_aligned(packing.segment_index(ids), n, c)
  nc = packed.row_length(ids.size, n, c) // c
  codes, lanes = np.asarray(info[:nc]), np.asarray(info[nc:])
  assert lanes.shape == (n + 1,) and lanes[0] == 0 and lanes[-1] == nc and np.all(np.diff(lanes) >= 0)
  first = np.flatnonzero(codes & 1)
  np.testing.assert_array_equal(lanes[:-1][np.asarray(present)], first)
  np.testing.assert_array_equal(codes[first] >> 2, np.flatnonzero(np.asarray(present)))
  assert np.all(np.diff(lanes)[:-1][~np.asarray(present)[:-1]] == 0)
  assert np.all(np.asarray(pos) // c >= lanes[np.asarray(packing.segment_index(ids)).reshape(-1)])
  assert np.all(np.diff(np.asarray(pos)) > 0)      # sorted and unique: what to_row / from_row promise XLA


def test_pallas_packed_traced_ids_and_spare_segments():
  """Under jit with traced ids, N from initial_state, here larger than the segments present: as in xla and
  the oracle, the spare segments' final states are zero (and their initial states get no gradient)."""
  ids = segment_ids([[30, 1, 29, 40], [2, 98]])
  n_true, n = packing.num_segments(ids), packing.num_segments(ids) + 3
  p = random_problem(13, B=2, T=T, H=H, HV=HV, K=K, V=V, decay="scalar", k_write="key", initial_state=False)
  p.initial_state = np.random.default_rng(14).normal(size=(n, HV, K, V)) / np.sqrt(K)
  arrays = p.arrays(jnp.float32)

  def run(impl):
    def fn(q, k, v, beta, k_write, log_decay, initial_state):
      solve = jax.jit(lambda ids, *xs: ops.delta_rule(*xs[:4], k_write=xs[4], log_decay=xs[5],
                                                      initial_state=xs[6], segment_ids=ids, chunk_size=32,
                                                      output_final_state=True, implementation=impl))
      return solve(ids, q, k, v, beta, k_write, log_decay, initial_state)
    return vjp_all(fn, arrays)

  got, want = run("pallas"), run("xla")
  assert_trees_close(got, want, jnp.float32)
  assert np.all(np.asarray(got["S"][n_true:]) == 0.0)
  assert np.all(np.asarray(got["initial_state"][n_true:]) == 0.0)


@pytest.mark.parametrize("solve", ["online", "offline"])
def test_step_rows_are_independent(solve):
  """Rows with different histories (states and gates) stepped together equal each row stepped alone."""
  p = random_problem(8, B=3, T=3, H=H, HV=HV, K=K, V=V, decay="channel", k_write="value")
  a = p.arrays(jnp.float32)
  step = jax.jit(ops.delta_rule_step if solve == "online" else ops.linear_attention_step)

  def steps(rows):
    state = a["initial_state"][rows]
    outs = []
    for t in range(3):
      x = {n: a[n][rows, t] for n in ("q", "k", "v", "beta", "k_write", "log_decay")}
      if solve == "online":
        o, state = step(x["q"], x["k"], x["v"], x["beta"], state, k_write=x["k_write"],
                        log_decay=x["log_decay"])
      else:
        o, state = step(x["q"], x["k"], x["v"], state, beta=x["beta"], log_decay=x["log_decay"])
      outs.append(o)
    return jnp.stack(outs, 1), state

  o, S = steps(np.arange(3))
  for b in range(3):
    ob, Sb = steps(np.array([b]))
    np.testing.assert_allclose(np.asarray(o[b:b + 1]), np.asarray(ob), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(S[b:b + 1]), np.asarray(Sb), rtol=1e-6, atol=1e-7)
