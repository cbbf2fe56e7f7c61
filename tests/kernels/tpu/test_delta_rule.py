"""The Pallas TPU (Mosaic) delta rule, forward and backward: in the TPU interpreter on CPU against the fp64
token-serial oracle and the chunked XLA path (outputs, final states and every input gradient; long and one-chunk
sequences, padded dims, extreme gates, both token layouts, split V, packing; the offline solve through the same
kernels; the cases every backend runs, every decay with odd lengths, asymmetric write keys, grouped value heads
and carried states in fp32 and bf16, are tests/kernels/test_conformance_delta_rule.py's), the matmul-only
(I + A)⁻¹ and the per-channel scores and their transposes, a check that the kernels hold no 64-bit value under x64,
the dispatch registration and, where libtpu is installed, ahead-of-time compilation by the real Mosaic compiler for
TPU v5e, v5p and v6e at the benchmark shapes in bf16 (the memory figures are printed and recorded as test
properties).

Interpret mode is slow: small shapes, and each case combines several features.
"""
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_kernels
from tests.kernels.conformance import compare, jit_vjp_all, solve
from osdn_jax.ops import chunked, naive
from osdn_jax.testing import assert_trees_close, contract_dtypes, random_problem, rel_rms, vjp_all
from pallas_kernels.spec import Spec
from pallas_kernels.tpu import delta_rule as tpu
from pallas_kernels.tpu.delta_rule import Config
from pallas_kernels.tpu.delta_rule.backward import channel_cols, channel_rows
from pallas_kernels.tpu.delta_rule.kernel import channel_scores, unit_lower_inverse
from pallas_kernels.tpu.common import interpret_mode

DECAYS = ("none", "scalar", "channel")


def _compare(problem, dtype, chunk, *, xla=True, config=tpu.DEFAULT):
  """The kernels (interpret mode, `config`) against the fp64 oracle and, where `xla`, the chunked XLA path in fp32
  (`conformance.compare`). Returns the errors against the oracle."""
  return compare(solve(tpu.delta_rule, chunk_size=chunk, interpret=True, config=config), problem, dtype,
                 xla_chunk=chunk if xla else None)


# (T, chunk, H, HV, K, V, k_write, initial state, config): T = 100 at chunk 64 (four per-channel sub-blocks) with
# shared keys and no state; K = V = 128 in the token layout with key-head write keys, GVA and V split over two
# programs (V = 256); T = 5 in one chunk of 64, three value heads per key head, K = 20 and V = 24 (padded to 32).
# `make test`: one decay on each. (Odd T with GVA, asymmetric write keys and a carried state in the head-major
# layout, every decay, fp32 and bf16: tests/kernels/test_conformance_delta_rule.py.)
VARIANTS = {
    "same-keys-100": (100, 64, 2, 2, 16, 16, "none", False, tpu.DEFAULT),
    "tokens-split-v": (45, 16, 1, 2, 128, 256, "key", True, Config(block_v=128)),
    "short-padded": (5, 64, 1, 3, 20, 24, "value", True, tpu.DEFAULT),
}
_COVERING = {("channel", "same-keys-100"), ("scalar", "tokens-split-v"), ("none", "short-padded")}
CASES = [pytest.param(d, v, marks=[] if (d, v) in _COVERING else [pytest.mark.slow])
         for d in DECAYS for v in VARIANTS]


@pytest.mark.parametrize("decay,variant", CASES)
def test_fp32(decay, variant, races):
  t, chunk, h, hv, kd, vd, kw, s0, config = VARIANTS[variant]
  p = random_problem(t + hv, B=1, T=t, H=h, HV=hv, K=kd, V=vd, decay=decay, k_write=kw, initial_state=s0)
  _compare(p, jnp.float32, chunk, config=config)


@pytest.mark.slow
def test_bf16_fp32_matmuls(races):
  """bf16 inputs with every dot in fp32 (`Config.bf16_matmuls` False): the state as accurate as fp32 arithmetic
  allows (the error is o's rounding to bf16)."""
  p = random_problem(5, B=2, T=45, H=1, HV=2, K=16, V=32, decay="scalar", k_write="value")
  errors = _compare(p, jnp.bfloat16, 32, config=Config(bf16_matmuls=False))
  assert errors["S"] < 1e-5, errors


@pytest.mark.parametrize("decay", ["scalar", "channel"])
def test_extreme_gates(decay, races):
  """Log-decays of −1e3 (far below the −30 floor) and 0, β = 0 and 1 runs, a zero key, across chunk
  boundaries: finite, and as the oracle and the XLA path. Per channel the other decays are strong too (about
  −3 per token: e^−48 across a 16-row sub-block), at chunk 64 (pairwise sub-blocks and reference rows)."""
  p = random_problem(11, B=1, T=70, H=1, HV=2, K=16, V=16, decay=decay, k_write="key",
                     decay_bias=-3.0 if decay == "channel" else 3.0)
  p.log_decay[:, 5:9] = -1e3
  p.log_decay[:, 40:50] = 0.0
  p.beta[:, 12:20] = 0.0
  p.beta[:, 20:36] = 1.0
  p.k[:, 40] = 0.0
  _compare(p, jnp.float32, 64 if decay == "channel" else 32)


@pytest.mark.parametrize("c,sub", [(16, 16), (64, 16), (64, 8), (128, 32)])
def test_channel_scores(c, sub):
  """The per-channel scores (pairwise sub-blocks, reference-row factors) against fp64 pairs, strict and
  inclusive, with decays down to the −30 floor per step inside a sub-block."""
  rng = np.random.default_rng(c + sub)
  x, y = rng.normal(size=(c, 16)), rng.normal(size=(c, 16))
  g = -np.abs(rng.normal(size=(c, 16))) * rng.choice([0.0, 1.0, 30.0], size=(c, 16))
  x, y, G = (np.asarray(np.float32(a), np.float64) for a in (x, y, np.cumsum(g, axis=0)))   # the fp32 inputs
  for strict in (True, False):
    mask = np.tril(np.ones((c, c), bool), -1 if strict else 0)
    pair = np.where(mask[..., None], np.exp(np.where(mask[..., None], G[:, None] - G[None], 0.0)), 0.0)
    want = np.einsum("ic,jc,ijc->ij", x, y, pair)
    fn = jax.jit(lambda *a: channel_scores(*a, strict=strict, sub=sub))      # (pltpu.roll has no eager rule)
    got = fn(*(jnp.asarray(a, jnp.float32) for a in (x, y, G)))
    assert rel_rms(got, want) < 1e-6, (strict, rel_rms(got, want))


@pytest.mark.parametrize("c,sub", [(16, 16), (64, 16), (128, 32)])
def test_channel_transposes(c, sub):
  """The backward's per-channel products R = Σ_j m_ij y_j e^{G_i − G_j} (j ≤ i) and L = Σ_i m_ij x_i e^{G_i − G_j}
  (i ≥ j) against fp64 sums, with decays down to the −30 floor per step inside a sub-block."""
  rng = np.random.default_rng(c + sub + 1)
  x, y, m = rng.normal(size=(c, 16)), rng.normal(size=(c, 16)), np.tril(rng.normal(size=(c, c)))
  g = -np.abs(rng.normal(size=(c, 16))) * rng.choice([0.0, 1.0, 30.0], size=(c, 16))
  x, y, m, G = (np.asarray(np.float32(a), np.float64) for a in (x, y, m, np.cumsum(g, axis=0)))
  mask = np.tril(np.ones((c, c), bool))
  pair = np.where(mask[..., None], np.exp(np.where(mask[..., None], G[:, None] - G[None], 0.0)), 0.0)
  want_rows = np.einsum("ij,jc,ijc->ic", m, y, pair)
  want_cols = np.einsum("ij,ic,ijc->jc", m, x, pair)

  def kernel_fn(fn, arg):
    def run(m_, v_, g_):     # the products read G from a ref: a VMEM scratch in a one-program pallas_call
      def body(m_ref, v_ref, g_ref, o_ref):
        o_ref[...] = fn(m_ref[...], v_ref[...], g_ref, sub=sub)
      return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((c, 16), jnp.float32),
                            interpret=interpret_mode(True))(m_, v_, g_)
    return run(*(jnp.asarray(a, jnp.float32) for a in arg))

  got_rows = kernel_fn(channel_rows, (m, y, G))
  got_cols = kernel_fn(channel_cols, (m.T, x, G))
  assert rel_rms(got_rows, want_rows) < 1e-6, rel_rms(got_rows, want_rows)
  assert rel_rms(got_cols, want_cols) < 1e-6, rel_rms(got_cols, want_cols)


def _packed_ids(seed):
  """Segment ids [2, 45] (gaps and offsets; only boundaries matter): row 0 has a segment ending on a chunk edge
  (16), a one-token segment and one across the next edge; row 1 random lengths, a one-token segment first."""
  rng = np.random.default_rng(seed)
  cuts = np.sort(rng.choice(np.arange(2, 45), size=3, replace=False))
  rows = [[16, 1, 13, 15], list(np.diff(np.concatenate([[0, 1], cuts, [45]])))]
  return np.stack([5 + 2 * np.repeat(np.arange(len(r)), r) for r in rows]).astype(np.int32)


@pytest.mark.parametrize("decay", [pytest.param("none", marks=pytest.mark.slow),
                                   pytest.param("scalar", marks=pytest.mark.slow), "channel"])
def test_packed(decay, races):
  """Packed sequences (segment-aligned chunks in one row, per-segment initial and final states) against the fp64
  oracle run per segment: outputs, final states and every gradient; value-head write keys with GVA."""
  from osdn_jax import ops
  from osdn_jax.ops import packing
  seed = {"none": 31, "scalar": 32, "channel": 33}[decay]
  ids = _packed_ids(seed)
  n = packing.num_segments(ids)
  p = random_problem(seed, B=2, T=45, H=1, HV=2, K=16, V=16, decay=decay, k_write="value", initial_state=False)
  p.initial_state = np.random.default_rng(seed).normal(size=(n, 2, 16, 16)) / 4.0
  index = packing.segment_index(ids)
  got = jit_vjp_all(solve(tpu.delta_rule, chunk_size=16, interpret=True, segment_ids=index, num_segments=n),
                    p.arrays(jnp.float32))
  want = jit_vjp_all(solve(ops.delta_rule, segment_ids=ids, output_final_state=True, implementation="reference"),
                     p.arrays(jnp.float64, jnp.float64, jnp.float64))
  assert_trees_close(got, want, jnp.float32, dtypes=contract_dtypes(p.arrays(jnp.float32)))


def test_packed_fault_stays_in_its_segment(races):
  """A NaN key in one packed segment leaves every other segment's outputs, final state and input gradients as in
  the clean run (bit for bit: no chunk holds two segments, and the state restarts at each segment), the faulty
  segment's outputs before the fault too, and its outputs from the fault on are non-finite (docs/faults.md)."""
  from osdn_jax.ops import packing
  ids = _packed_ids(34)
  n = packing.num_segments(ids)
  index = np.asarray(packing.segment_index(ids))
  p = random_problem(34, B=2, T=45, H=1, HV=2, K=16, V=16, decay="scalar", k_write="value", initial_state=False)
  p.initial_state = np.random.default_rng(34).normal(size=(n, 2, 16, 16)) / 4.0
  fn = solve(tpu.delta_rule, chunk_size=16, interpret=True, segment_ids=jnp.asarray(index), num_segments=n)
  clean = vjp_all(fn, p.arrays(jnp.float32))
  b, t = 0, 20                                              # row 0, token 20: segment 2 (tokens 17 … 29)
  p.k[b, t, 0, 3] = np.nan
  got = vjp_all(fn, p.arrays(jnp.float32))
  seg = index[b, t]
  other = index != seg
  for name in ("o", "q", "k", "v", "beta", "k_write", "log_decay"):
    np.testing.assert_array_equal(np.asarray(got[name])[other], np.asarray(clean[name])[other], err_msg=name)
  for name in ("S", "initial_state"):
    keep = np.arange(n) != seg
    np.testing.assert_array_equal(np.asarray(got[name])[keep], np.asarray(clean[name])[keep], err_msg=name)
  assert not np.isfinite(np.asarray(got["o"])[b, t:30]).any()
  np.testing.assert_allclose(np.asarray(got["o"])[b, 17:t], np.asarray(clean["o"])[b, 17:t], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("decay, name, value, t", [
    ("none", "v", np.nan, 37), pytest.param("scalar", "beta", np.inf, 21, marks=pytest.mark.slow),
    ("scalar", "log_decay", np.nan, 40), ("channel", "log_decay", np.nan, 30),
    pytest.param("channel", "k_write", -np.inf, 47, marks=pytest.mark.slow),
    pytest.param("channel", "k", np.nan, 3, marks=pytest.mark.slow)])
def test_rows_before_a_fault_stay_clean(decay, name, value, t, races):
  """A NaN or inf at token t (mid-chunk) leaves every output before t as in the clean run, the other batch row
  and the other value head bit for bit, and makes the outputs of its value heads from t on and their final
  states non-finite; a log-decay of −inf stays a gate."""
  p = random_problem(35, B=2, T=53, H=1, HV=2, K=16, V=16, decay=decay, k_write="value")
  a = p.arrays(jnp.float32)
  fn = jax.jit(lambda a: tpu.delta_rule(**a, chunk_size=16, interpret=True))
  o, S = map(np.asarray, fn(a))
  x = np.asarray(a[name]).copy()
  x[(1, t, 0 if name == "k" else 1) + (3,) * (x.ndim - 3)] = value
  fo, fS = map(np.asarray, fn(dict(a, **{name: jnp.asarray(x)})))
  heads = [0, 1] if name == "k" else [1]
  np.testing.assert_allclose(fo[1, :t], o[1, :t], rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(fo[0], o[0])
  np.testing.assert_array_equal(fS[0], S[0])
  if name != "k":
    np.testing.assert_array_equal(fo[1, :, 0], o[1, :, 0])
  assert not np.isfinite(fo[1, t:][:, heads]).all(axis=-1).any()
  assert not np.isfinite(fS[1, heads]).all(axis=(-2, -1)).any()
  gate = np.asarray(a["log_decay"]).copy() if decay != "none" else None
  if gate is not None:
    gate[(1, t, 1) + (3,) * (gate.ndim - 3)] = -np.inf
    assert np.isfinite(np.asarray(fn(dict(a, log_decay=jnp.asarray(gate)))[0])).all()


def test_layouts_agree():
  """The head-major layout computes what the token layout does (K = V = 128, where both apply), gradients
  included."""
  p = random_problem(12, B=1, T=24, H=1, HV=2, K=128, V=128, decay="scalar", k_write="value")
  a = p.arrays(jnp.float32)
  got = [jit_vjp_all(solve(tpu.delta_rule, chunk_size=16, interpret=True, config=Config(layout=layout)), a)
         for layout in ("tokens", "head_major")]
  for name in got[0]:
    np.testing.assert_allclose(got[0][name], got[1][name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("decay", [pytest.param("none", marks=pytest.mark.slow), "scalar",
                                   pytest.param("channel", marks=pytest.mark.slow)])
def test_linear_attention(decay, races):
  """The offline solve through the same kernels (zero erase key, k as the write key): outputs, states and every
  gradient against the fp64 oracle and the XLA path; β given or not."""
  p = random_problem(21, B=1, T=37, H=1, HV=2, K=16, V=16, decay=decay)
  a = p.arrays(jnp.float32)

  def fn(impl, **kw):
    def call(q, k, v, beta, log_decay, initial_state):
      return impl.linear_attention(q, k, v, beta=beta, log_decay=log_decay, initial_state=initial_state, **kw)
    return call

  arrays = {n: a[n] for n in ("q", "k", "v", "beta", "log_decay", "initial_state")}
  got = jit_vjp_all(fn(tpu, chunk_size=16, interpret=True), arrays)
  ref = p.arrays(jnp.float64, jnp.float64, jnp.float64)
  want = jit_vjp_all(fn(naive), {n: ref[n] for n in arrays})
  assert_trees_close(got, want, jnp.float32)
  assert_trees_close(got, jit_vjp_all(fn(chunked, chunk_size=16), arrays), jnp.float32)
  o, _ = tpu.linear_attention(a["q"], a["k"], a["v"], log_decay=a["log_decay"], chunk_size=16, interpret=True)
  o2, _ = chunked.linear_attention(a["q"], a["k"], a["v"], log_decay=a["log_decay"], chunk_size=16)
  assert rel_rms(o, o2) < 1e-5


def test_registration():
  """Importing the TPU backend registers the solves for a TPU backend only: a CPU request keeps the GPU kernels
  (interpret mode), a TPU request gets these; packed requests only with N static."""
  request = dict(dtype="bfloat16", key_dim=128, value_dim=128, batch=2, length=4096, heads=16, value_heads=16,
                 decay="scalar", chunk_size=64)
  for op in ("delta_rule", "linear_attention"):
    names = [k.name for k in pallas_kernels.kernels(op)]
    assert f"tpu.{op}" in names, names
    assert pallas_kernels.lookup(Spec(op=op, platform="tpu", **request)) in (tpu.delta_rule, tpu.linear_attention)
    cpu = pallas_kernels.lookup(Spec(op=op, platform="cpu", **request))
    assert cpu is not None and cpu not in (tpu.delta_rule, tpu.linear_attention)
  assert tpu.supports(Spec(op="delta_rule", platform="tpu", **request))
  assert tpu.supports(Spec(op="delta_rule", platform="tpu", packed=True, num_segments=3, **request))
  assert not tpu.supports(Spec(op="delta_rule", platform="tpu", packed=True, num_segments=None, **request))
  assert not tpu.supports(Spec(op="delta_rule", platform="gpu", **request))


@pytest.mark.parametrize("c", [16, 32, 64, 128])
def test_unit_lower_inverse(c):
  """(I + A)⁻¹ from matmuls only, against fp64 substitution: random A of unit-norm-key Grams (β ≤ 1) and the
  all-ones strictly lower A of C identical keys at β = 1, whose inverse is I minus the subdiagonal while the
  Neumann terms (−A)^n reach binomial sizes (~1e17 at C = 64): the block recursion never forms them."""
  rng = np.random.default_rng(c)
  k = rng.normal(size=(c, 32))
  k /= np.linalg.norm(k, axis=1, keepdims=True)
  random_a = np.tril(rng.uniform(size=(c, 1)) * (k @ k.T), -1)
  ones_a = np.tril(np.ones((c, c)), -1)
  for a in (random_a, ones_a):
    want = np.linalg.inv(np.eye(c) + a)
    got = np.asarray(unit_lower_inverse(jnp.asarray(a, jnp.float32)), np.float64)
    assert np.array_equal(got, np.tril(got)), "not lower triangular"
    assert rel_rms(got, want) < 1e-6, rel_rms(got, want)
  assert np.allclose(np.asarray(unit_lower_inverse(jnp.asarray(ones_a, jnp.float32))),
                     np.eye(c) - np.eye(c, k=-1), atol=1e-6)


def test_interpret_mode_detects_races():
  """Interpret mode runs the TPU interpreter with race detection where this JAX has it, and neither kernel has a
  race (the state and its cotangent scratch are read and written by one program per (b, h, V block), chunks in
  order)."""
  mode = interpret_mode(True)
  assert interpret_mode(False) is False
  params = getattr(pltpu, "InterpretParams", None)
  if params is None:
    assert mode is True
    return
  assert isinstance(mode, params) and mode.detect_races
  p = random_problem(14, B=2, T=40, H=1, HV=2, K=16, V=16, decay="scalar")
  jax.block_until_ready(vjp_all(solve(tpu.delta_rule, chunk_size=16, interpret=True), p.arrays(jnp.float32)))
  try:   # private: the interpreter's race record
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    races = ipc.races
  except (ImportError, AttributeError):
    return
  assert races is not None and not races.races_found


def test_bad_inputs():
  a = random_problem(15, B=1, T=16, H=2, HV=4, K=16, V=16).arrays(jnp.float32)
  with pytest.raises(ValueError, match="log_decay"):
    solve(tpu.forward, interpret=True)(**dict(a, log_decay=a["log_decay"][..., None, :]))
  with pytest.raises(ValueError, match="chunk_size"):
    solve(tpu.forward, chunk_size=24, interpret=True)(**a)
  with pytest.raises(ValueError, match="dtype"):
    solve(tpu.forward, interpret=True)(**dict(a, q=a["q"].astype(jnp.float16)))
  with pytest.raises(ValueError, match="block_v"):
    solve(tpu.forward, interpret=True, config=Config(block_v=8))(**a)
  with pytest.raises(ValueError, match="layout"):
    Config(layout="rows")
  with pytest.raises(ValueError, match="sub"):
    Config(sub=12)
  assert tpu.default_config(None, "TPU v6 lite") == tpu.default_config(None, "v6e:2x2") == tpu.TUNING["v6e"]
  assert tpu.default_config(None, "TPU v5 lite") == tpu.default_config(None, "v5p:2x2x1") == tpu.DEFAULT
  assert tpu.default_config() == tpu.DEFAULT                                    # this backend is a CPU
  with pytest.raises(ValueError, match="segment_ids"):
    solve(tpu.delta_rule, interpret=True, segment_ids=jnp.zeros((1, 15), jnp.int32), num_segments=1)(**a)
  with pytest.raises(ValueError, match="num_segments"):
    solve(tpu.delta_rule, interpret=True, segment_ids=jnp.zeros((1, 16), jnp.int32))(**a)


def _sub_jaxprs(eqn):
  for v in eqn.params.values():
    for j in (v if isinstance(v, (list, tuple)) else [v]):
      if hasattr(j, "jaxpr") and hasattr(j.jaxpr, "eqns"):
        yield j.jaxpr
      elif hasattr(j, "eqns"):
        yield j


def _dtypes(jaxpr, found):
  """Adds the dtype of every value of jaxpr and its nested jaxprs (literal operands included) to `found`, except
  weakly typed float scalars (the Python numbers of `jnp.where(mask, x, 0.0)` and the like, which take the other
  operand's type)."""
  values = list(jaxpr.invars) + list(jaxpr.constvars)
  values += [v for e in jaxpr.eqns for v in list(e.invars) + list(e.outvars)]
  for v in values:
    aval = getattr(v, "aval", None)
    if not hasattr(aval, "dtype"):
      continue
    if getattr(aval, "weak_type", False) and aval.ndim == 0 and jnp.issubdtype(aval.dtype, jnp.floating):
      continue
    found.add(jnp.dtype(aval.dtype))
  for eqn in jaxpr.eqns:
    for sub in _sub_jaxprs(eqn):
      _dtypes(sub, found)


def _kernel_dtypes(fn, *args):
  """The dtypes of every value in the kernel bodies and of the block indices of the pallas_calls in fn's jaxpr,
  and the number of pallas_calls."""
  found = set()
  calls = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        calls.append(eqn)
        _dtypes(eqn.params["jaxpr"], found)
        for bm in eqn.params["grid_mapping"].block_mappings:   # block indices, literals included
          found.update(jnp.dtype(v.aval.dtype) for v in bm.index_map_jaxpr.jaxpr.outvars)
      for sub in _sub_jaxprs(eqn):
        walk(sub)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found, len(calls)


@pytest.mark.parametrize("decay,k_write", [("scalar", "value"), ("none", "none"), ("channel", "key")])
def test_kernel_is_32_bit_under_x64(decay, k_write):
  """With x64 enabled (as here), nothing in the kernel or its index maps is 64-bit: Mosaic rejects i64 block
  indices and aborts the process on a 64-bit vector, which interpret mode would run without complaint."""
  p = random_problem(16, B=1, T=20, H=1, HV=2, K=16, V=16, decay=decay, k_write=k_write)
  a = p.arrays(jnp.float32)
  call = solve(tpu.delta_rule, chunk_size=16, interpret=True)
  dtypes, calls = _kernel_dtypes(lambda q: vjp_all(call, dict(a, q=q)), a["q"])
  assert calls == 2, calls                       # the forward and the backward kernel
  assert dtypes and all(d.itemsize <= 4 for d in dtypes), dtypes


# ---------------------------------------------------------------------------------------------------------
# Ahead-of-time compilation for TPU (libtpu's compile-only devices; the real Mosaic compiler).
# ---------------------------------------------------------------------------------------------------------
_NO_LIBTPU = importlib.util.find_spec("libtpu") is None
_SKIP_AOT = pytest.mark.skipif(_NO_LIBTPU, reason="libtpu is not installed (the `tpu-aot` extra): no TPU compiler "
                                                  "on this host")
TOPOLOGIES = ("v5e:2x2", "v5p:2x2x1", "v6e:2x2")
LARGE = dict(B=4, T=4096, H=16, HV=16, K=128, V=128)      # the two benchmark shapes (docs/benchmarks.md)
LONG = dict(B=1, T=32768, H=8, HV=8, K=128, V=128)


def _aot_memory(topology: str, *, B, T, H, HV, K, V, dtype=jnp.bfloat16, chunk=64, decay="scalar", k_write="key",
                initial_state=True, projected=True, config=tpu.DEFAULT, grad=False) -> dict:
  """Compiles the forward (or, with grad, the value and every input gradient of a loss on o and S_T) for one chip
  of `topology` and returns `compiled.memory_analysis()` in bytes, and the kernels' scoped VMEM.
  k_write: "none", "key" (H heads) or "value" (HV heads). projected: q, k, k_write, v and per-channel log-decays
  come as [B, T, heads·D] (as a projection makes them; the token layout is then a free reshape) and o leaves as
  [B, T, HV·V]; else as [B, T, heads, D]."""
  from osdn_jax.train import aot
  sharding = jax.sharding.SingleDeviceSharding(aot.topology_devices(topology)[0])
  kw_heads = {"none": 0, "key": H, "value": HV}[k_write]

  def spec(heads, d, dt=dtype):
    return jax.ShapeDtypeStruct((B, T, heads * d) if projected else (B, T, heads, d), dt, sharding=sharding)

  def forward(q, k, v, beta, kw, log_decay, s0):
    if projected:
      q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, HV, V)
      kw = None if kw is None else kw.reshape(B, T, kw_heads, K)
      log_decay = log_decay.reshape(B, T, HV, -1) if decay == "channel" else log_decay
    o, S = tpu.forward(q, k, v, beta, k_write=kw, log_decay=log_decay, initial_state=s0, chunk_size=chunk,
                       config=config)
    return (o.reshape(B, T, -1) if projected else o), S

  def loss(*args):
    o, S = forward(*args)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(S)

  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)
  channel = f32(B, T, HV * K) if projected else f32(B, T, HV, K)
  log_decay = {"none": None, "scalar": f32(B, T, HV), "channel": channel}[decay]
  args = (spec(H, K), spec(H, K), spec(HV, V), f32(B, T, HV), spec(kw_heads, K) if kw_heads else None, log_decay,
          f32(B, HV, K, V) if initial_state else None)
  fn = jax.value_and_grad(loss, argnums=tuple(i for i, a in enumerate(args) if a is not None)) if grad else forward
  compiled = jax.jit(fn).lower(*args).compile()
  m = compiled.memory_analysis()
  out = {n: getattr(m, f"{n}_size_in_bytes") for n in ("argument", "output", "temp", "generated_code")}
  out["kernel_vmem"] = _kernel_vmem(compiled.as_text())
  return out


def _kernel_vmem(hlo: str):
  """The scoped VMEM each compiled kernel reserves (its custom call's backend config), in program order: a tuple,
  None where the HLO does not say."""
  sizes = []
  for line in hlo.splitlines():
    if 'custom_call_target="tpu_custom_call"' in line:
      found = re.findall(r'"used_scoped_memory_configs":\[\{[^]]*"size":"(\d+)"', line)
      sizes.append(int(found[0]) if found else None)
  return tuple(sizes) or None


# `make test`: every chip once and both decays (scalar on v5e and v5p, per-channel on v6e); the slow step: the rest.
_FORWARD_QUICK = {("v5e:2x2", "scalar"), ("v5p:2x2x1", "scalar"), ("v6e:2x2", "channel")}
_FORWARD_CASES = [pytest.param(topology, decay, marks=[] if (topology, decay) in _FORWARD_QUICK
                               else [pytest.mark.slow])
                  for decay in ("scalar", "channel", "none") for topology in TOPOLOGIES]


@_SKIP_AOT
@pytest.mark.parametrize("topology,decay", _FORWARD_CASES)
def test_aot_compiles_for_tpu(topology, decay, record_property):
  """Mosaic compiles the bf16 forward kernel (key-head write keys, an initial state) for one chip of each topology
  at B=4 T=4096 H=16 K=V=128. Fed [B, T, H·D] arrays, the program's memory is the inputs, o and S_T: its
  temporaries are only β and scalar G laid out for the kernel (where XLA keeps them in HBM: v5p; none on v5e and
  v6e), below a quarter of one input's size (per-channel log-decays go into the kernel as they come)."""
  memory = _aot_memory(topology, decay=decay, **LARGE)
  record_property("memory", memory)
  print(f"{topology} decay {decay}, [B, T, H·D] inputs: {memory}")
  b, t, h, kd, vd = (LARGE[n] for n in "BTHKV")
  assert memory["temp"] <= b * t * h * kd * 2 // 4, memory
  assert 0 <= memory["output"] - (b * t * h * vd * 2 + b * h * kd * vd * 4) <= 4096, memory   # (+ tuple table)


# `make test`: scalar decay on v5p and per-channel decay on v6e at the first shape (v5e's gradient programs:
# test_aot_variants); the slow step: the rest.
_GRAD_QUICK = {("v5p:2x2x1", "scalar", "large"), ("v6e:2x2", "channel", "large")}
_GRAD_CASES = [pytest.param(topology, decay, shape, marks=[] if (topology, decay, shape) in _GRAD_QUICK
                            else [pytest.mark.slow])
               for topology in TOPOLOGIES for decay in ("scalar", "channel", "none") for shape in ("large", "long")]


@_SKIP_AOT
@pytest.mark.parametrize("topology,decay,shape", _GRAD_CASES)
def test_aot_gradient_compiles_for_tpu(topology, decay, shape, record_property):
  """Mosaic compiles the forward and the backward kernel (every input's gradient) for one chip of each topology
  at both benchmark shapes, bf16. Beyond the gradients themselves (the outputs: one per input), the program's
  memory is the state entering every chunk that the forward saves for the backward (fp32 [B, H, T/C, K, V]) and a
  few token arrays of XLA's (o, its cotangent, the gates laid out for the kernels)."""
  dims = LARGE if shape == "large" else LONG
  memory = _aot_memory(topology, decay=decay, grad=True, config=tpu.default_config(None, topology), **dims)
  record_property("memory", memory)
  print(f"{topology} decay {decay} {shape}, value and gradients: {memory}")
  b, t, h, kd, vd = (dims[n] for n in "BTHKV")
  states = b * h * (t // 64) * kd * vd * 4
  token = b * t * h * kd * 2
  assert states <= memory["temp"] <= states + 5 * token, memory
  assert memory["output"] >= memory["argument"], memory                     # every input's gradient


@_SKIP_AOT
def test_aot_head_inputs(record_property):
  """Fed [B, T, H, D] arrays (tiled over their last two dims, H and D), XLA relayouts q, k, k_write and v into the
  token layout and o back: temporaries of a few input sizes (v5e)."""
  memory = _aot_memory("v5e:2x2", projected=False, **LARGE)
  record_property("memory", memory)
  print(f"v5e:2x2 decay scalar, [B, T, H, D] inputs: {memory}")
  b, t, h, kd = (LARGE[n] for n in "BTHK")
  assert 0 < memory["temp"] <= 4 * b * t * h * kd * 2, memory


# (decay, dtype, chunk, K, V, k_write, config) at B=2 T=1000 (padded) H=2 HV=4 (GVA): what `make test` compiles
# covers both layouts, both dtypes, the smallest and largest chunk and each decay; the slow step compiles every
# chunk in both dtypes with scalar and per-channel decay, and the other options.
AOT_VARIANTS = {
    "scalar-bf16-c16-head-major": ("scalar", jnp.bfloat16, 16, 64, 32, "key", tpu.DEFAULT),
    "channel-fp32-c128": ("channel", jnp.float32, 128, 128, 128, "value", tpu.DEFAULT),
    "none-same-keys": ("none", jnp.bfloat16, 64, 128, 128, "none", tpu.DEFAULT),
    **{f"{decay}-{jnp.dtype(d).name}-c{c}": (decay, d, c, 128, 128, "value", tpu.DEFAULT)
       for decay in ("scalar", "channel") for d in (jnp.bfloat16, jnp.float32) for c in (16, 32, 64, 128)},
    "channel-head-major-sub32": ("channel", jnp.bfloat16, 64, 64, 64, "key", Config(sub=32)),
    "channel-sub8": ("channel", jnp.bfloat16, 64, 128, 128, "key", Config(sub=8)),
    "k256-block-v": ("scalar", jnp.bfloat16, 64, 256, 256, "key", Config(block_v=128)),
    "fp32-matmuls": ("scalar", jnp.bfloat16, 64, 128, 128, "key", Config(bf16_matmuls=False)),
    "head-major-128": ("scalar", jnp.bfloat16, 64, 128, 128, "key", Config(layout="head_major")),
}
_AOT_COVERING = ("scalar-bf16-c16-head-major", "channel-fp32-c128", "none-same-keys")


@_SKIP_AOT
@pytest.mark.parametrize("variant", [v if v in _AOT_COVERING else pytest.param(v, marks=pytest.mark.slow)
                                     for v in AOT_VARIANTS])
def test_aot_variants(variant, record_property):
  """Mosaic compiles both kernels (the value and every gradient) for every decay, dtype, chunk, layout and option
  with grouped value heads and padding (v5e)."""
  decay, dtype, chunk, kd, vd, kw, config = AOT_VARIANTS[variant]
  memory = _aot_memory("v5e:2x2", B=2, T=1000, H=2, HV=4, K=kd, V=vd, dtype=dtype, chunk=chunk, decay=decay,
                       k_write=kw, config=config, grad=True)
  record_property("memory", memory)
  print(f"v5e:2x2 {variant}: {memory}")


@_SKIP_AOT
@pytest.mark.parametrize("decay", ["scalar", pytest.param("channel", marks=pytest.mark.slow),
                                   pytest.param("none", marks=pytest.mark.slow)])
def test_aot_packed(decay, record_property):
  """Packed sequences compile too: the chunk codes prefetched into SMEM choose the per-segment state blocks in
  the index maps and the restarts in both kernels (v5e, bf16, B=2 T=1000 H=2 K=V=128, 7 segments, value and every
  gradient)."""
  from osdn_jax.train import aot
  b, t, h, kd, n = 2, 1000, 2, 128, 7
  sharding = jax.sharding.SingleDeviceSharding(aot.topology_devices("v5e:2x2")[0])
  spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
  f32 = jnp.float32
  log_decay = {"none": None, "scalar": spec((b, t, h), f32), "channel": spec((b, t, h, kd), f32)}[decay]

  def value_and_grads(q, k, v, beta, kw, log_decay, s0, ids):
    def loss(q, k, v, beta, kw, log_decay, s0):
      o, S = tpu.forward(q, k, v, beta, k_write=kw, log_decay=log_decay, initial_state=s0, segment_ids=ids,
                         num_segments=n)
      return jnp.sum(o.astype(f32)) + jnp.sum(S)
    argnums = (0, 1, 2, 3, 4, 6) if log_decay is None else tuple(range(7))
    return jax.value_and_grad(loss, argnums=argnums)(q, k, v, beta, kw, log_decay, s0)

  args = (spec((b, t, h, kd)), spec((b, t, h, kd)), spec((b, t, h, kd)), spec((b, t, h), f32),
          spec((b, t, h, kd)), log_decay, spec((n, h, kd, kd), f32), spec((b, t), jnp.int32))
  m = jax.jit(value_and_grads).lower(*args).compile().memory_analysis()
  memory = {name: getattr(m, f"{name}_size_in_bytes") for name in ("argument", "output", "temp", "generated_code")}
  record_property("memory", memory)
  print(f"v5e:2x2 packed decay {decay}: {memory}")
  assert memory["output"] > 0 and memory["generated_code"] > 0, memory
