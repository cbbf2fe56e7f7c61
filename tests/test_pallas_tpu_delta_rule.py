"""The Pallas TPU (Mosaic) delta-rule forward: in the TPU interpreter on CPU against the fp64 token-serial oracle
and the chunked XLA path (outputs and final states, every decay, odd lengths, asymmetric write keys, grouped
value heads, carried states, extreme gates, both token layouts, split V), the matmul-only (I + A)⁻¹ and the
per-channel scores, a check that the kernel holds no 64-bit value under x64 and, where libtpu is installed,
ahead-of-time compilation by the real Mosaic compiler for TPU v5e, v5p and v6e at B=4 T=4096 H=16 K=V=128 in bf16
(the memory figures are printed and recorded as test properties).

Interpret mode is slow: small shapes, and each case combines several features.
"""
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from osdn_jax.ops import chunked, naive
from osdn_jax.testing import assert_trees_close, random_problem, rel_rms
from pallas_kernels.tpu import delta_rule as tpu
from pallas_kernels.tpu.delta_rule import Config
from pallas_kernels.tpu.delta_rule.kernel import channel_scores, unit_lower_inverse
from pallas_kernels.tpu.delta_rule.layout import interpret_mode

DECAYS = ("none", "scalar", "channel")


def _run(fn, arrays, **kw):
  a = arrays
  return fn(a["q"], a["k"], a["v"], a["beta"], k_write=a["k_write"], log_decay=a["log_decay"],
            initial_state=a["initial_state"], **kw)


def _oracle(problem, dtype):
  ref = problem.rounded(dtype) if dtype != jnp.float32 else problem
  o, S = _run(naive.delta_rule, ref.arrays(jnp.float64, jnp.float64, jnp.float64))
  return {"o": o, "S": S}


def _compare(problem, dtype, chunk, *, xla=True, config=tpu.DEFAULT):
  """The kernel (interpret mode) against the fp64 oracle at §4's tolerance for `dtype`, and against the XLA path
  in fp32 (also §4's fp32 tolerance). Returns the errors against the oracle."""
  o, S = _run(tpu.forward, problem.arrays(dtype), chunk_size=chunk, interpret=True, config=config)
  assert o.dtype == dtype and S.dtype == jnp.float32
  got = {"o": o, "S": S}
  errors = assert_trees_close(got, _oracle(problem, dtype), dtype)
  if xla and dtype == jnp.float32:
    o2, S2 = _run(chunked.delta_rule, problem.arrays(dtype), chunk_size=chunk)
    assert_trees_close(got, {"o": o2, "S": S2}, dtype)
  return errors


# (T, chunk, H, HV, K, V, k_write, initial state, config): odd T shorter than three chunks with GVA, value-head write
# keys and a carried state (head-major layout, K and V below 128); T = 100 at chunk 64 (four per-channel
# sub-blocks) with shared keys and no state; K = V = 128 in the token layout with key-head write keys, GVA and V
# split over two programs (V = 256); T = 5 in one chunk of 64, three value heads per key head, K = 20 and V = 24
# (padded to 32). `make test`: every decay on the first, one decay on each other.
VARIANTS = {
    "gva-asym-odd": (37, 16, 2, 4, 16, 32, "value", True, tpu.DEFAULT),
    "same-keys-100": (100, 64, 2, 2, 16, 16, "none", False, tpu.DEFAULT),
    "tokens-split-v": (45, 16, 1, 2, 128, 256, "key", True, Config(block_v=128)),
    "short-padded": (5, 64, 1, 3, 20, 24, "value", True, tpu.DEFAULT),
}
_COVERING = {("channel", "same-keys-100"), ("scalar", "tokens-split-v"), ("none", "short-padded")}
CASES = [pytest.param(d, v, marks=[] if v == "gva-asym-odd" or (d, v) in _COVERING else [pytest.mark.slow])
         for d in DECAYS for v in VARIANTS]


@pytest.mark.parametrize("decay,variant", CASES)
def test_fp32(decay, variant):
  t, chunk, h, hv, kd, vd, kw, s0, config = VARIANTS[variant]
  p = random_problem(t + hv, B=1, T=t, H=h, HV=hv, K=kd, V=vd, decay=decay, k_write=kw, initial_state=s0)
  _compare(p, jnp.float32, chunk, config=config)


@pytest.mark.parametrize("decay,bf16_matmuls", [("scalar", True), ("channel", True),
                                                pytest.param("scalar", False, marks=pytest.mark.slow)])
def test_bf16(decay, bf16_matmuls):
  """bf16 inputs against the oracle on the same bf16 values; with every dot in fp32 the state is as accurate as
  fp32 arithmetic allows (the error is o's rounding to bf16)."""
  p = random_problem(5, B=2, T=45, H=1, HV=2, K=16, V=32, decay=decay, k_write="value")
  errors = _compare(p, jnp.bfloat16, 32, config=Config(bf16_matmuls=bf16_matmuls))
  if not bf16_matmuls:
    assert errors["S"] < 1e-5, errors


@pytest.mark.parametrize("decay", ["scalar", "channel"])
def test_extreme_gates(decay):
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


def test_layouts_agree():
  """The head-major layout computes what the token layout does (K = V = 128, where both apply)."""
  p = random_problem(12, B=1, T=24, H=1, HV=2, K=128, V=128, decay="scalar", k_write="value")
  a = p.arrays(jnp.float32)
  o1, S1 = _run(tpu.forward, a, chunk_size=16, interpret=True, config=Config(layout="tokens"))
  o2, S2 = _run(tpu.forward, a, chunk_size=16, interpret=True, config=Config(layout="head_major"))
  np.testing.assert_allclose(o1, o2, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(S1, S2, rtol=1e-6, atol=1e-7)


def test_traced_scale():
  """A traced scale (applied to q outside the kernel) gives what the XLA path gives for that scale."""
  p = random_problem(13, B=1, T=20, H=1, HV=1, K=16, V=16, decay="none", initial_state=False)
  a = p.arrays(jnp.float32)
  f = jax.jit(lambda s: _run(tpu.forward, a, chunk_size=16, interpret=True, scale=s))
  o, S = f(jnp.float32(0.3))
  o2, S2 = _run(chunked.delta_rule, a, chunk_size=16, scale=0.3)
  assert_trees_close({"o": o, "S": S}, {"o": o2, "S": S2}, jnp.float32)


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
  """Interpret mode runs the TPU interpreter with race detection where this JAX has it, and the kernel has no
  race (the state scratch is read and written by one program per (b, h, V block), chunks in order)."""
  mode = interpret_mode(True)
  assert interpret_mode(False) is False
  params = getattr(pltpu, "InterpretParams", None)
  if params is None:
    assert mode is True
    return
  assert isinstance(mode, params) and mode.detect_races
  p = random_problem(14, B=2, T=40, H=1, HV=2, K=16, V=16, decay="scalar")
  jax.block_until_ready(_run(tpu.forward, p.arrays(jnp.float32), chunk_size=16, interpret=True))
  try:   # private: the interpreter's race record
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    races = ipc.races
  except (ImportError, AttributeError):
    return
  assert races is not None and not races.races_found


def test_bad_inputs():
  a = random_problem(15, B=1, T=16, H=2, HV=4, K=16, V=16).arrays(jnp.float32)
  with pytest.raises(ValueError, match="log_decay"):
    _run(tpu.forward, dict(a, log_decay=a["log_decay"][..., None, :]), interpret=True)
  with pytest.raises(ValueError, match="chunk_size"):
    _run(tpu.forward, a, chunk_size=24, interpret=True)
  with pytest.raises(ValueError, match="dtype"):
    _run(tpu.forward, dict(a, q=a["q"].astype(jnp.float16)), interpret=True)
  with pytest.raises(ValueError, match="block_v"):
    _run(tpu.forward, a, interpret=True, config=Config(block_v=8))
  with pytest.raises(ValueError, match="layout"):
    Config(layout="rows")
  with pytest.raises(ValueError, match="sub"):
    Config(sub=12)


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
  """The dtypes of every value in the kernel bodies and of the block indices of the pallas_calls in fn's jaxpr."""
  found = set()

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        _dtypes(eqn.params["jaxpr"], found)
        for bm in eqn.params["grid_mapping"].block_mappings:   # block indices, literals included
          found.update(jnp.dtype(v.aval.dtype) for v in bm.index_map_jaxpr.jaxpr.outvars)
      for sub in _sub_jaxprs(eqn):
        walk(sub)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


@pytest.mark.parametrize("decay,k_write", [("scalar", "value"), ("none", "none"), ("channel", "key")])
def test_kernel_is_32_bit_under_x64(decay, k_write):
  """With x64 enabled (as here), nothing in the kernel or its index maps is 64-bit: Mosaic rejects i64 block
  indices and aborts the process on a 64-bit vector, which interpret mode would run without complaint."""
  p = random_problem(16, B=1, T=20, H=1, HV=2, K=16, V=16, decay=decay, k_write=k_write)
  a = p.arrays(jnp.float32)
  dtypes = _kernel_dtypes(lambda q: _run(tpu.forward, dict(a, q=q), chunk_size=16, interpret=True), a["q"])
  assert dtypes and all(d.itemsize <= 4 for d in dtypes), dtypes


# ---------------------------------------------------------------------------------------------------------
# Ahead-of-time compilation for TPU (libtpu's compile-only devices; the real Mosaic compiler).
# ---------------------------------------------------------------------------------------------------------
_NO_LIBTPU = importlib.util.find_spec("libtpu") is None
_SKIP_AOT = pytest.mark.skipif(_NO_LIBTPU, reason="libtpu is not installed (the `tpu-aot` extra): no TPU compiler "
                                                  "on this host")
TOPOLOGIES = ("v5e:2x2", "v5p:2x2x1", "v6e:2x2")
LARGE = dict(B=4, T=4096, H=16, HV=16, K=128, V=128)


def _aot_memory(topology: str, *, B, T, H, HV, K, V, dtype=jnp.bfloat16, chunk=64, decay="scalar", k_write="key",
                initial_state=True, projected=True, config=tpu.DEFAULT) -> dict:
  """Compiles the forward for one chip of `topology` and returns `compiled.memory_analysis()` in bytes, and the
  kernel's scoped VMEM.
  k_write: "none", "key" (H heads) or "value" (HV heads). projected: q, k, k_write, v and per-channel log-decays
  come as [B, T, heads·D] (as a projection makes them; the token layout is then a free reshape) and o leaves as
  [B, T, HV·V]; else as [B, T, heads, D]."""
  from osdn_jax.train import aot
  sharding = jax.sharding.SingleDeviceSharding(aot.topology_devices(topology)[0])
  kw_heads = {"none": 0, "key": H, "value": HV}[k_write]

  def spec(heads, d, dt=dtype):
    return jax.ShapeDtypeStruct((B, T, heads * d) if projected else (B, T, heads, d), dt, sharding=sharding)

  def fn(q, k, v, beta, kw, log_decay, s0):
    if projected:
      q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, HV, V)
      kw = None if kw is None else kw.reshape(B, T, kw_heads, K)
      log_decay = log_decay.reshape(B, T, HV, -1) if decay == "channel" else log_decay
    o, S = tpu.forward(q, k, v, beta, k_write=kw, log_decay=log_decay, initial_state=s0, chunk_size=chunk,
                       config=config)
    return (o.reshape(B, T, -1) if projected else o), S

  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)
  channel = f32(B, T, HV * K) if projected else f32(B, T, HV, K)
  log_decay = {"none": None, "scalar": f32(B, T, HV), "channel": channel}[decay]
  args = (spec(H, K), spec(H, K), spec(HV, V), f32(B, T, HV), spec(kw_heads, K) if kw_heads else None, log_decay,
          f32(B, HV, K, V) if initial_state else None)
  compiled = jax.jit(fn).lower(*args).compile()
  m = compiled.memory_analysis()
  out = {n: getattr(m, f"{n}_size_in_bytes") for n in ("argument", "output", "temp", "generated_code")}
  out["kernel_vmem"] = _kernel_vmem(compiled.as_text())
  return out


def _kernel_vmem(hlo: str):
  """The scoped VMEM the compiled kernel reserves (its custom call's backend config), or None where the HLO does
  not say."""
  for line in hlo.splitlines():
    if 'custom_call_target="tpu_custom_call"' in line:
      sizes = re.findall(r'"used_scoped_memory_configs":\[\{[^]]*"size":"(\d+)"', line)
      return int(sizes[0]) if sizes else None
  return None


@_SKIP_AOT
@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("decay", ["scalar", "channel", pytest.param("none", marks=pytest.mark.slow)])
def test_aot_compiles_for_tpu(topology, decay, record_property):
  """Mosaic compiles the bf16 kernel (key-head write keys, an initial state) for one chip of each topology at
  B=4 T=4096 H=16 K=V=128. Fed [B, T, H·D] arrays, the program's memory is the inputs, o and S_T: its temporaries
  are only β and scalar G laid out for the kernel (where XLA keeps them in HBM: v5p; none on v5e and v6e), below a
  quarter of one input's size (per-channel log-decays go into the kernel as they come)."""
  memory = _aot_memory(topology, decay=decay, **LARGE)
  record_property("memory", memory)
  print(f"{topology} decay {decay}, [B, T, H·D] inputs: {memory}")
  b, t, h, kd, vd = (LARGE[n] for n in "BTHKV")
  assert memory["temp"] <= b * t * h * kd * 2 // 4, memory
  assert 0 <= memory["output"] - (b * t * h * vd * 2 + b * h * kd * vd * 4) <= 4096, memory   # (+ tuple table)


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
  """Mosaic compiles every decay, dtype, chunk, layout and option with grouped value heads and padding (v5e)."""
  decay, dtype, chunk, kd, vd, kw, config = AOT_VARIANTS[variant]
  memory = _aot_memory("v5e:2x2", B=2, T=1000, H=2, HV=4, K=kd, V=vd, dtype=dtype, chunk=chunk, decay=decay,
                       k_write=kw, config=config)
  record_property("memory", memory)
  print(f"v5e:2x2 {variant}: {memory}")
