"""The Pallas GPU delta-rule kernels in interpret mode on CPU: outputs, final states and every input gradient
against the chunked XLA path and the fp64 token-serial oracle (docs/design.md §4 tolerances); poisoned outputs;
dispatch; and (where the installed jaxlib can) lowering to Triton IR without TF32 dots. The cases every backend
runs (every decay, fp32 and bf16, at the default launch config): tests/kernels/test_conformance_delta_rule.py; random
shapes, packings and gates against the oracle: tests/ops/test_properties.py (PallasDeltaRuleTest).

Interpret mode is slow: small shapes, and each test case combines several features.
"""
import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import pallas_kernels
from osdn_jax import ops
from osdn_jax.ops import checks, chunked, dispatch, naive
from tests.kernels.conformance import compare, jit_vjp_all, solve
from osdn_jax.testing import (FP32_TOL, assert_trees_close, close, contract_dtypes, random_problem, rel_rms,
                             vjp_all)
from pallas_kernels.gpu import delta_rule as gpu
from pallas_kernels.gpu.delta_rule import layout, output, prep, scores, state_fwd
from pallas_kernels.gpu.delta_rule.chunk_cumsum import chunk_cumsum
from pallas_kernels.gpu.delta_rule.config import DEFAULT
from pallas_kernels.spec import Spec

DECAYS = ("none", "scalar", "channel")
# (T, chunk, H, HV, k_write, initial state, also against XLA, config): T a multiple of the chunk with shared keys,
# no state, V split over two blocks in every kernel; the inter-chunk output formed by the state pass (fuse_inter)
# with key-head write keys, GVA and an output V block smaller than V. (Odd T with GVA, asymmetric write keys and a
# state, fp32 and bf16, at the default config: tests/kernels/test_conformance_delta_rule.py.)
_SPLIT_V = DEFAULT.override(state__block_v=16, output__block_v=16, grads__block_v=16, grads__block_v_fp32=16)
VARIANTS = {"mha-same": (64, 32, 2, 2, "none", False, False, _SPLIT_V),
            "fused-inter": (45, 16, 2, 4, "key", True, False,
                            DEFAULT.override(state__fuse_inter=True, output__block_v=16))}


@pytest.fixture(autouse=True)
def _poison():
  """Poisoned output buffers (interpret mode fills them with NaN anyway): an unwritten block shows as NaN."""
  poison = getattr(pl, "enable_poison_buffers", None)
  with (poison(True) if poison is not None else contextlib.nullcontext()):
    yield


def _compare(problem, dtype, chunk, *, xla=True, **kw):
  """These kernels (interpret mode, launch options `kw`) against the fp64 oracle and, where `xla`, the chunked XLA
  path in fp32 (`conformance.compare`)."""
  return compare(solve(gpu.delta_rule, chunk_size=chunk, **kw), problem, dtype, xla_chunk=chunk if xla else None)


# `make test`: each variant at one decay; the slow step: the rest of the product.
COVERING_FP32 = {("scalar", "mha-same"), ("channel", "fused-inter")}
FP32_CASES = [pytest.param(d, v, marks=[] if (d, v) in COVERING_FP32 else [pytest.mark.slow])
              for d in DECAYS for v in VARIANTS]


@pytest.mark.parametrize("decay,variant", FP32_CASES)
def test_fp32(decay, variant):
  """Outputs, final states and every gradient against the fp64 oracle (and the XLA path where the variant says)."""
  t, chunk, h, hv, kw, s0, xla, config = VARIANTS[variant]
  p = random_problem(t + hv, B=1, T=t, H=h, HV=hv, K=16, V=32, decay=decay, k_write=kw, initial_state=s0)
  _compare(p, jnp.float32, chunk, xla=xla, config=config)


def _pallas_calls(fn, *args):
  """(name, eqn) of every pallas_call in fn's jaxpr, nested jaxprs (custom_vjp, jit, cond) included."""
  out = []

  def walk(jx):
    for eqn in jx.eqns:
      if eqn.primitive.name == "pallas_call":
        out.append((str(eqn.params.get("name", "")) + str(eqn.params.get("name_and_src_info", "")), eqn))
      for v in eqn.params.values():
        for j in (v if isinstance(v, (list, tuple)) else [v]):
          if hasattr(j, "jaxpr") and hasattr(j.jaxpr, "eqns"):
            walk(j.jaxpr)
          elif hasattr(j, "eqns"):
            walk(j)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return out


def _kernel_names(fn, *args):
  return {m for name, _ in _pallas_calls(fn, *args) for m in re.findall(r"delta_rule_(\w+)", name)}


@pytest.mark.parametrize("decay,k_write", [("scalar", "value"), ("channel", "none")])
def test_bf16_gradients_leave_the_kernels_in_bf16(decay, k_write):
  """Without head groups, the backward kernels write dq, dk (dk_write) and dv in bf16 themselves (no fp32
  array and XLA convert between kernel and caller), and those gradients match the oracle as in test_bf16."""
  p = random_problem(16, B=1, T=45, H=2, HV=2, K=16, V=32, decay=decay, k_write=k_write)
  _compare(p, jnp.bfloat16, 16)
  finish = "delta_rule_grads_pairs" if decay == "channel" else "delta_rule_grads_finish"
  dtypes = {}
  for name, eqn in _pallas_calls(lambda a: vjp_all(solve(gpu.delta_rule, chunk_size=16), a), p.arrays(jnp.bfloat16)):
    for kernel in (finish, "delta_rule_grads_intra"):
      if kernel in name:
        dtypes[kernel] = [jnp.dtype(v.aval.dtype).name for v in eqn.outvars]
  n_keys = 3 if k_write != "none" else 2
  assert dtypes[finish][:n_keys] == ["bfloat16"] * n_keys, dtypes
  assert dtypes["delta_rule_grads_intra"][0] == "bfloat16", dtypes


def test_bf16_fp32_matmuls():
  """bf16 inputs with every dot in fp32: as accurate as the XLA path (errors from the output rounding)."""
  p = random_problem(8, B=1, T=45, H=2, HV=4, K=16, V=32, decay="scalar", k_write="value")
  errors = _compare(p, jnp.bfloat16, 16, bf16_matmuls=False)
  assert errors["S"] < 1e-5, errors


def test_padded_dims_chunk64():
  """K, V not powers of two (padded to 32), chunk 64 (four sub-blocks: the full block merge and reference
  rows), B = 2, V split in the state passes and the output kernel, K split over the gradient grids (two
  16-column programs of grads_state and grads_pairs)."""
  p = random_problem(9, B=2, T=70, H=1, HV=2, K=20, V=24, decay="channel", k_write="value")
  _compare(p, jnp.float32, 64, xla=False,
           config=DEFAULT.override(state__block_v=16, output__block_v=16, grads__block_k=16))


@pytest.mark.parametrize("decay", DECAYS)
def test_split_k(decay):
  """K = 32 in 16-column pieces: grads_state's K grid and scalar dG partial sums, grads_intra's K loops
  (none / scalar), grads_pairs' loop over K chunks inside one 32-column program (per channel), the K chunks
  of the per-channel diagonal sub-blocks; V loops of two 16-column steps; with decay the inter-chunk output
  formed by the state pass."""
  p = random_problem(14, B=1, T=40, H=1, HV=2, K=32, V=32, decay=decay, k_write="key", initial_state=True)
  config = DEFAULT.override(grads__block_k=32 if decay == "channel" else 16, diagonal__block_k=16,
                            grads__block_k_pairs=16, grads__block_v=16, grads__block_v_fp32=16,
                            state__fuse_inter=decay != "none")
  _compare(p, jnp.float32, 16, config=config)


@pytest.mark.slow     # `make test`: the per-channel tests, which "auto" runs with predecay
def test_predecay():
  """Per-channel decay with and without `State.predecay` (the state passes read K̃ ⊙ e^{G_C − G} and
  Q ⊙ e^G formed by `decayed_tiles`, or scale K̃ and Q themselves): without it against the oracle and the XLA
  path (GVA, odd T, a state, asymmetric keys; "auto" picks predecay at this size, so the other per-channel
  tests cover that path), and the two paths equal (the same bf16 operands, formed in another kernel)."""
  p = random_problem(18, B=2, T=45, H=1, HV=2, K=32, V=16, decay="channel", k_write="value", initial_state=True)
  _compare(p, jnp.float32, 16, config=DEFAULT.override(state__predecay=False))
  got, want = (jit_vjp_all(solve(gpu.delta_rule, chunk_size=16, config=DEFAULT.override(state__predecay=pre)),
                           p.arrays(jnp.bfloat16))
               for pre in (True, False))
  assert set(got) == set(want)
  for name in got:
    np.testing.assert_allclose(np.asarray(got[name], np.float32), np.asarray(want[name], np.float32),
                               rtol=1e-5, atol=1e-6, err_msg=name)


def test_channel_two_sub_blocks():
  """Per-channel decay at chunk 32 (`Chunks.channel`; the tuned table picks it at K = 128): two 16-row
  sub-blocks, factored off-diagonal and (decays allowing) factored diagonal blocks, odd T, GVA, asymmetric keys
  and a state."""
  p = random_problem(15, B=1, T=45, H=1, HV=2, K=16, V=16, decay="channel", k_write="value", initial_state=True)
  _compare(p, jnp.float32, 32, config=DEFAULT.override(chunks__channel=32))


@pytest.mark.parametrize("factor_diag,chunk", [(True, 32), (False, 16), pytest.param(True, 16, marks=pytest.mark.slow),
                                               pytest.param(False, 32, marks=pytest.mark.slow)])
def test_extreme_gates(factor_diag, chunk):
  """Strong per-channel decays with values far below the −30 clamp, and β = 0 and β = 1 rows. With
  factor_diag the first chunk's diagonal blocks are too steep to factor (pairwise) and the others factor.
  Chunk 32 is what one row runs at (`Chunks.channel_serial`): two sub-blocks with off-diagonal blocks.
  (`make test`: each flag and each chunk once.)"""
  p = random_problem(10, B=1, T=40, H=1, HV=1, K=16, V=16, decay="channel", k_write="key", decay_bias=-3.0)
  p.log_decay[:, 5:9] = -100.0
  p.beta[:, 12:14] = 0.0
  p.beta[:, 20:22] = 1.0
  config = DEFAULT.override(diagonal__factor=factor_diag)
  got = jit_vjp_all(solve(gpu.delta_rule, chunk_size=chunk, config=config), p.arrays(jnp.float32))
  want = jit_vjp_all(solve(chunked.delta_rule, chunk_size=16), p.arrays(jnp.float32))
  assert_trees_close(got, want, jnp.float32)


def test_scores_first():
  """Per-channel decay at chunk 32 (what `heuristics.chunk` picks for one row of two value heads) forms the Gram and
  the output scores in `scores` first (`Static.scores_first`), also under autodiff, and not at chunk 16: outputs,
  final states and every gradient against the oracle and the XLA path; GVA, odd T, value-head write keys, a
  state, two K steps in `scores`. (Chunks 32 and 64 with steep decays, β = 0 / 1: test_extreme_gates,
  test_padded_dims_chunk64.)"""
  p = random_problem(22, B=1, T=45, H=1, HV=2, K=32, V=16, decay="channel", k_write="value", initial_state=True,
                     decay_bias=0.0)
  a = p.arrays(jnp.float32)
  config = DEFAULT.override(scores__block_k=16)
  grads = lambda chunk: lambda a: vjp_all(solve(gpu.delta_rule, chunk_size=chunk, config=config), a)
  assert "scores" in _kernel_names(grads(64), a)
  assert "scores" not in _kernel_names(grads(16), a)
  _compare(p, jnp.float32, 64, config=config)


# (seed, B, T, H, HV, K, k_write, initial state, config): odd T with GVA, value-head write keys, a state and two
# K steps in `scores`; strong decays (some diagonal blocks too steep to factor, pairwise), β = 0 / 1.
# chunks__channel_serial=16: under autodiff these few rows run at chunk 16, without `scores`.
# "no-tiles": prep, output and the state pass forming the decayed operands themselves (`scores__tiles=False`).
WIDE = {"gva-asym-odd": (22, 1, 45, 1, 2, 32, "value", True,
                         DEFAULT.override(scores__block_k=16, chunks__channel_serial=16)),
        "steep": (23, 2, 100, 1, 1, 16, "key", False, DEFAULT.override(chunks__channel_serial=16)),
        "no-tiles": (25, 1, 45, 1, 2, 32, "value", True,
                     DEFAULT.override(scores__block_k=16, chunks__channel_serial=16, scores__tiles=False))}


@pytest.mark.parametrize("case", WIDE)
def test_wide_forward(case):
  """A per-channel forward that is not differentiated runs at `Chunks.channel_forward` (64: four sub-blocks,
  `scores` first): outputs and final states against the fp64 oracle and the XLA path; under autodiff the same
  call runs at `heuristics.chunk`'s chunk (16 here: no `scores`)."""
  seed, b, t, h, hv, kd, kw, s0, config = WIDE[case]
  p = random_problem(seed, B=b, T=t, H=h, HV=hv, K=kd, V=16, decay="channel", k_write=kw, initial_state=s0,
                     decay_bias=-3.0 if case == "steep" else 0.0)
  if case == "steep":
    p.log_decay[:, 5:9] = -100.0
    p.log_decay[:, 70:72] = 0.0
    p.beta[:, 12:14] = 0.0
    p.beta[:, 20:22] = 1.0
  a = p.arrays(jnp.float32)
  run = lambda impl, **kw: dict(zip("oS", impl(**a, **kw)))
  fwd = lambda **arrays: solve(gpu.delta_rule, config=config)(**arrays)
  names = _kernel_names(lambda a: fwd(**a), a)
  assert "scores" in names and ("decayed_tiles" in names) == (not config.scores.tiles)
  assert "scores" not in _kernel_names(lambda a: jax.vjp(lambda q: fwd(**dict(a, q=q)), a["q"])[0], a)
  got = run(jax.jit(fwd))
  want = dict(zip("oS", solve(naive.delta_rule)(**p.arrays(jnp.float64, jnp.float64, jnp.float64))))
  assert_trees_close(got, want, jnp.float32)
  assert_trees_close(got, run(solve(chunked.delta_rule, chunk_size=16)), jnp.float32)


def test_scores_kernel():
  """`delta_rule_fwd.scores` at chunk 64 against the dense formulas: A_ij = β_i Σ_c k_ic k̃_jc e^{G_ic − G_jc}
  (j < i) and P_ij = Σ_c q_ic k̃_jc e^{G_ic − G_jc} (j ≤ i) within each chunk, zeros elsewhere; one chunk's
  decays too steep for the factored diagonal blocks (their pairwise rewrite), every block written. With
  `tiles`, the decayed operands K ⊙ e^G, Q ⊙ e^G, K̃ ⊙ e^{G_C − G} as well (head-major), A and P unchanged."""
  rng = np.random.default_rng(24)
  b, t, hv, kd, c = 1, 128, 2, 32, 64
  n = lambda *shape: rng.normal(size=shape)
  q, k, kw = (n(b, t, hv, kd) / np.sqrt(kd) for _ in range(3))
  beta = 1 / (1 + np.exp(-n(b, hv, t)))
  g = -np.logaddexp(0, -(n(b, t, hv, kd) + 2))
  g[:, 70:74] = -30.0                                          # chunk 1: steep diagonal blocks
  G = np.cumsum(g.reshape(b, t // c, c, hv, kd), axis=2).reshape(b, t, hv, kd)
  st = layout.Static(batch=b, length=t, heads=hv, value_heads=hv, kw_heads=hv, key_dim=kd, value_dim=16, chunk=c,
                     decay="channel", scale=1.0, same_keys=False, config=DEFAULT.override(scores__block_k=16),
                     interpret=True)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  A, P = scores.scores(st, f32(q), f32(k), f32(kw), f32(beta), f32(G))
  A2, P2, kd_, qd_, kwd_, gc_ = scores.scores(st, f32(q), f32(k), f32(kw), f32(beta), f32(G), tiles=True)
  np.testing.assert_array_equal(A2, A)
  np.testing.assert_array_equal(P2, P)
  Gc = G.reshape(b, t // c, c, hv, kd)
  head_major = lambda x: np.swapaxes(x, 1, 2)
  G32 = np.asarray(f32(G), np.float64)                         # what the kernel reads
  to_end = (G32.reshape(Gc.shape)[:, :, -1:] - G32.reshape(Gc.shape)).reshape(G.shape)
  for got, want in ((kd_, k * np.exp(G32)), (qd_, q * np.exp(G32)), (kwd_, kw * np.exp(to_end))):
    np.testing.assert_allclose(got, head_major(want), rtol=2e-6, atol=1e-7)
  np.testing.assert_array_equal(gc_, np.swapaxes(np.asarray(f32(G)).reshape(Gc.shape)[:, :, -1], 1, 2))
  e = np.exp(Gc[:, :, :, None] - Gc[:, :, None, :])            # [b, nc, i, j, hv, kd]
  dense = lambda x: np.einsum("bnihc,bnjhc,bnijhc->bhnij", x.reshape(Gc.shape), kw.reshape(Gc.shape), e)
  i, j = np.arange(c)[:, None], np.arange(c)[None, :]
  want_a = np.where(i > j, dense(k), 0.0) * beta.reshape(b, hv, t // c, c)[..., None]
  want_p = np.where(i >= j, dense(q), 0.0)
  for got, want in ((A, want_a), (P, want_p)):
    got = np.asarray(got).reshape(b, hv, t // c, c, c)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_dispatch():
  """implementation="pallas" reaches these kernels (interpret mode on CPU; a TPU backend gets the TPU kernels);
  unsupported requests do not; a request's kernel config reaches the kernel of its backend only, and anything else
  given as `kernel_config` is refused by name."""
  p = random_problem(12, B=1, T=20, H=2, HV=2, K=16, V=16, decay="channel")
  q, k, v, beta = (p.arrays(jnp.float32)[n] for n in ("q", "k", "v", "beta"))
  spec = checks.check_solve("delta_rule", q, k, v, beta=beta, chunk_size=16)
  assert spec == Spec("delta_rule", "cpu", "float32", key_dim=16, value_dim=16, batch=1, length=20, heads=2,
                      value_heads=2, decay="none", chunk_size=16, num_segments=1)
  lookup = lambda **kw: pallas_kernels.lookup(dataclasses.replace(spec, **kw))
  assert lookup() is gpu.delta_rule and lookup(platform="gpu", dtype="bfloat16", chunk_size=64) is gpu.delta_rule
  assert lookup(op="linear_attention") is gpu.linear_attention
  assert lookup(dtype="float64") is None and lookup(platform="gpu", dtype="float16") is None
  assert lookup(chunk_size=24) is None and lookup(length=None) is None
  from pallas_kernels.tpu import delta_rule as tpu_delta_rule
  assert lookup(platform="tpu") is tpu_delta_rule.delta_rule
  assert lookup(packed=True, num_segments=None) is None and lookup(packed=True, num_segments=3) is gpu.delta_rule
  wide = np.zeros((1, 4, 1, 512), np.float32)
  big = checks.check_solve("delta_rule", wide, wide, wide, beta=np.zeros((1, 4, 1), np.float32))
  assert pallas_kernels.lookup(dataclasses.replace(big, platform="gpu")) is None
  config = gpu.DEFAULT.override("chunks.online=16")
  assert lookup(config=config) is gpu.delta_rule and lookup(platform="tpu", config=config) is None
  assert lookup(platform="tpu", config=tpu_delta_rule.DEFAULT) is tpu_delta_rule.delta_rule
  assert lookup(config=tpu_delta_rule.DEFAULT) is None
  kind, fn = dispatch.choose(dataclasses.replace(spec, config=config), "pallas")
  assert kind == "pallas" and fn.func is gpu.delta_rule and fn.keywords["config"] is config
  with pytest.raises(ValueError, match="kernel_config.*pallas_kernels.gpu.delta_rule.config.Config"):
    ops.delta_rule(q, k, v, beta, chunk_size=16, implementation="pallas-tpu", kernel_config=config)
  with pytest.raises(ValueError, match="`kernel_config` must be None or a kernel backend's Config"):
    ops.delta_rule(q, k, v, beta, chunk_size=16, kernel_config={"chunk": 16})
  o, s = ops.delta_rule(q, k, v, beta, log_decay=p.arrays(jnp.float32)["log_decay"], output_final_state=True,
                        chunk_size=16, implementation="pallas")
  o2, s2 = chunked.delta_rule(q, k, v, beta, log_decay=p.arrays(jnp.float32)["log_decay"], chunk_size=16)
  assert rel_rms(o, o2) < 1e-5 and rel_rms(s, s2) < 1e-5


def test_bad_input_errors():
  """The kernels' own entry points name the argument and what it should be, before any kernel is traced."""
  q, v, beta = np.zeros((1, 8, 1, 16), np.float32), np.zeros((1, 8, 1, 16), np.float32), np.zeros((1, 8, 1))
  ids = np.zeros((1, 8), np.int32)
  with pytest.raises(ValueError, match=r"`segment_ids` must be an integer array \[B, T\] = \(1, 8\)"):
    gpu.delta_rule(q, q, v, beta, segment_ids=ids[:, :7], num_segments=1)
  with pytest.raises(ValueError, match="`segment_ids` must be an integer array"):
    gpu.delta_rule(q, q, v, beta, segment_ids=ids.astype(np.float32), num_segments=1)
  with pytest.raises(ValueError, match="`num_segments`"):
    gpu.delta_rule(q, q, v, beta, segment_ids=ids)
  with pytest.raises(ValueError, match="dtype float16"):
    gpu.delta_rule(q.astype(np.float16), q, v, beta)
  with pytest.raises(ValueError, match="K and V must be ≤ 256"):
    gpu.delta_rule(np.zeros((1, 8, 1, 512), np.float32), np.zeros((1, 8, 1, 512), np.float32), v, beta)
  with pytest.raises(ValueError, match="chunk_size=24"):
    gpu.delta_rule(q, q, v, beta, chunk_size=24)


@pytest.mark.parametrize("chunk, kd, dtype", [(16, 16, "float32"), (64, 256, "float32"), (32, 32, "bfloat16")])
def test_chunk_cumsum(chunk, kd, dtype):
  """`chunk_cumsum` (per-channel G = in-chunk cumsum of max(g, −30)) and its backward kernel equal jnp's
  cumsum and autodiff per chunk: values below the floor (no gradient), exactly at it (½, as jnp.maximum), one
  chunk of two K blocks (K = 256), bf16 input (gradient in bf16)."""
  rng = np.random.default_rng(3)
  shape = (2, 2 * chunk, 3, kd)
  g = rng.normal(size=shape) * 4 - 2
  g[0, 1, 1, :3], g[1, chunk + 2, 2, :] = -30.0, -1e3
  g = jnp.asarray(g, dtype)
  w = jnp.asarray(rng.normal(size=shape), jnp.float32)
  ref = lambda g: jnp.cumsum(jnp.maximum(g.astype(jnp.float32), -30.0).reshape(2, 2, chunk, 3, kd),
                             axis=2).reshape(shape)
  G = chunk_cumsum(g, chunk, -30.0, interpret=True)
  assert G.dtype == jnp.float32
  np.testing.assert_allclose(G, ref(g), rtol=1e-6, atol=1e-5)
  grad = lambda f: jax.grad(lambda g: jnp.sum(f(g) * w))(g)
  dg, dg_ref = grad(lambda g: chunk_cumsum(g, chunk, -30.0, interpret=True)), grad(ref)
  assert dg.dtype == g.dtype
  tol = 1e-5 if dtype == "float32" else 1e-2
  np.testing.assert_allclose(np.asarray(dg, np.float32), np.asarray(dg_ref, np.float32), rtol=tol, atol=tol)
  assert float(jnp.abs(dg[1, chunk + 2, 2]).max()) == 0.0 and float(jnp.abs(dg[0, 1, 1, :3]).min()) > 0.0
  with pytest.raises(ValueError, match="multiple of 16"):
    chunk_cumsum(g[:, :chunk + 1], 16, -30.0, interpret=True)


@pytest.mark.slow
def test_log_decay_dtypes():
  """Per-channel log-decays in bf16, fp16 or fp64 give the results of their fp32 values (the wrapper hands the
  cumsum kernel bf16 as it is and casts the others to fp32); d log_decay comes back in the input's dtype."""
  p = random_problem(26, B=1, T=40, H=2, HV=2, K=16, V=16, decay="channel")
  a = p.arrays(jnp.float32)
  run = jax.jit(lambda g: dict(zip(("o", "S"), gpu.delta_rule(**dict(a, log_decay=g), chunk_size=16))))
  grad = jax.jit(jax.grad(lambda g: jnp.sum(run(g)["o"])))
  for dtype in (jnp.bfloat16, jnp.float16, jnp.float64):
    g = a["log_decay"].astype(dtype)
    assert_trees_close(run(g), run(g.astype(jnp.float32)), jnp.float32)
    dg = grad(g)
    assert dg.dtype == dtype and bool(jnp.isfinite(dg.astype(jnp.float32)).all())


def test_scalar_chunk_cumsum():
  """The wrapper's scalar-decay in-chunk cumsum and its transpose equal jnp.cumsum's per chunk."""
  from pallas_kernels.wrapper_math import chunk_cumsum as _chunk_cumsum
  rng = np.random.default_rng(3)
  g, w = (jnp.asarray(rng.normal(size=(2, 48, 3)), jnp.float32) for _ in range(2))
  ref = lambda g: jnp.cumsum(g.reshape(2, 3, 16, 3), axis=2).reshape(g.shape)
  np.testing.assert_allclose(_chunk_cumsum(g, 16), ref(g), rtol=1e-6, atol=1e-6)
  grad = lambda f: jax.grad(lambda g: jnp.sum(f(g) * w))(g)
  np.testing.assert_allclose(grad(lambda g: _chunk_cumsum(g, 16)), grad(ref), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("decay", [pytest.param("scalar", marks=pytest.mark.slow), "channel"])
def test_fused_inter_packed(decay):
  """Packed (segment resets, per-segment initial states), the inter-chunk output formed by the state pass
  (`State.fuse_inter`; per channel also `predecay`'s tiles) equals the
  default path: outputs, final states and every gradient."""
  p = random_problem(12, B=2, T=40, H=2, HV=2, K=32, V=32, decay=decay, k_write="value", initial_state=False)
  ids = jnp.asarray(np.repeat(np.array([[0, 0, 1, 1, 1], [2, 2, 2, 3, 3]]), 8, axis=1), jnp.int32)
  s0 = jnp.asarray(np.random.default_rng(2).normal(size=(4, 2, 32, 32)) / 4, jnp.float32)

  def run(fuse):
    def fn(q, k, v, beta, k_write, log_decay, initial_state):
      del initial_state
      return gpu.delta_rule(q, k, v, beta, k_write=k_write, log_decay=log_decay, initial_state=s0,
                            segment_ids=ids, num_segments=4, chunk_size=16,
                            config=DEFAULT.override(state__fuse_inter=fuse,
                                              state__predecay=fuse))
    return jit_vjp_all(fn, p.arrays(jnp.float32))
  got, want = run(True), run(False)
  assert set(got) == set(want) and len(got) >= 7, sorted(got)
  assert_trees_close(got, want, jnp.float32)


def test_poison_catches_unwritten_blocks():
  """An output kernel that skips the last chunk leaves NaN there, which the comparator rejects."""
  p = random_problem(13, B=1, T=32, H=1, HV=1, K=16, V=16, decay="scalar")
  a = p.arrays(jnp.float32)
  st = layout.Static(batch=1, length=32, heads=1, value_heads=1, kw_heads=1, key_dim=16, value_dim=16,
                     chunk=16, decay="scalar", scale=0.25, same_keys=True, config=DEFAULT,
                     interpret=True)
  beta = jnp.swapaxes(a["beta"], 1, 2)
  G = jnp.swapaxes(jnp.cumsum(a["log_decay"].reshape(1, 2, 16, 1), axis=2).reshape(1, 32, 1), 1, 2)
  W, U = prep.prep(st, a["k"], a["k"], a["v"], beta, G)
  V_new, S_in, _ = state_fwd.state_pass(st, W, U, a["k"], G, a["initial_state"])

  def skip_last(st_, *refs):
    @pl.when(pl.program_id(2) < st_.num_chunks - 1)
    def _():
      output.output_kernel(st_, *refs)

  full = output.output(st, a["q"], a["k"], G, S_in, V_new, jnp.float32)
  partial = output.output(st, a["q"], a["k"], G, S_in, V_new, jnp.float32, kernel_body=skip_last)
  want, _ = chunked.delta_rule(**a, scale=0.25, chunk_size=16)
  assert close(full, want, *FP32_TOL)
  assert np.isnan(np.asarray(partial[:, 16:])).all() and close(partial[:, :16], want[:, :16], *FP32_TOL)
  assert not close(partial, want, *FP32_TOL)


# The pallas_calls of forward + backward, per path and decay (prep also emits T; wu forms W, U from it; repair
# rewrites the rows of a fault's chunk before the fault).
_KERNELS = ("prep", "state_fwd", "output", "repair", "wu", "dv_local", "state_bwd", "grads_state", "grads_intra")


def _expected_kernels(decay):
  return set(_KERNELS) | ({"grads_pairs"} if decay == "channel" else {"grads_finish"})


def test_lowers_to_triton_without_tf32(triton_lowering, capsys):
  """Forward and backward lower with the Triton backend for CUDA to IR that passes MLIR verification, every
  kernel of every decay (K = 64 with 32-wide K blocks: the K loops and K-split grids run); no dot runs in plain
  TF32 (fp32 inputs: TF32x3, `Dots.fp32`). Per-channel decay without `predecay` (which the heuristic would
  pick at this size; `test_predecay_lowers_to_triton` lowers that path); at chunk 32 per-channel decay also runs
  `scores`."""
  verified = triton_lowering
  b, t, h, hv, kd = 1, 64, 1, 2, 64
  config = DEFAULT.override(grads__block_k=32, state__predecay=False)
  sd = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  for decay, g in (("none", None), ("scalar", sd(b, t, hv)), ("channel", sd(b, t, hv, kd))):
    def loss(q, k, v, beta, g, kw):
      o, s = gpu.delta_rule(q, k, v, beta, k_write=kw, log_decay=g, chunk_size=32, interpret=False,
                            config=config)
      return jnp.sum(o) + jnp.sum(s)
    f = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 5) + ((4,) if g is not None else ()))
    args = (sd(b, t, h, kd), sd(b, t, h, kd), sd(b, t, hv, kd), sd(b, t, hv), g, sd(b, t, hv, kd))
    jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    ir = capsys.readouterr().out
    names = set(re.findall(r"@delta_rule_(\w+)\(", ir))
    assert names == _expected_kernels(decay) | ({"scores"} if decay == "channel" else set()), (decay, names)
    assert ir.count("tt.dot") > 0 and not re.search(r"inputPrecision = tf32(?!x3)", ir)
    assert "inputPrecision = tf32x3" in ir         # fp32 inputs: the default Dots.fp32
  assert all(verified), verified


@pytest.mark.parametrize("mode", ["tf32x3", "tf32"])
def test_bf16_gradients_lower_to_triton(triton_lowering, capsys, mode):
  """bf16 inputs without head groups (dq, dk, dk_write, dv stored as bf16 by the kernels) lower to verified
  Triton IR, decay none / scalar (grads_finish) and per channel (grads_pairs); their fp32 dots (T, dA) run as
  `Dots.bf16` says and no other way."""
  verified = triton_lowering
  b, t, h, kd = 1, 64, 2, 32
  sd = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  other = {"tf32x3": r"inputPrecision = (tf32(?!x3)|ieee)", "tf32": r"inputPrecision = (tf32x3|ieee)"}[mode]
  for g in (None, jax.ShapeDtypeStruct((b, t, h), jnp.float32), jax.ShapeDtypeStruct((b, t, h, kd), jnp.float32)):
    def loss(q, k, v, kw, beta, g):
      o, s = gpu.delta_rule(q, k, v, beta, k_write=kw, log_decay=g, chunk_size=32, interpret=False,
                            config=DEFAULT.override(dots__bf16=mode))
      return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)
    args = (sd(b, t, h, kd), sd(b, t, h, kd), sd(b, t, h, kd), sd(b, t, h, kd),
            jax.ShapeDtypeStruct((b, t, h), jnp.float32), g)
    jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(*args).lower(lowering_platforms=("cuda",))
    ir = capsys.readouterr().out
    assert "@delta_rule_grads_" in ir
    assert re.search(rf"inputPrecision = {mode}\b", ir) and not re.search(other, ir), (mode, g)
  assert all(verified), verified


def test_channel_forward_lowers_to_triton(triton_lowering, capsys):
  """The per-channel forward without autodiff (bf16, GVA, chunk 64: `scores` storing the decayed operand tiles,
  prep and output loading them, the state pass reading one row of G per chunk) and the in-chunk cumsum kernels
  lower to verified Triton IR."""
  verified = triton_lowering
  b, t, h, hv, kd = 1, 128, 1, 2, 32
  sd = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)

  def fwd(q, k, v, beta, g):
    return gpu.delta_rule(q, k, v, beta, log_decay=g, chunk_size=64, interpret=False)
  args = (sd(b, t, h, kd), sd(b, t, h, kd), sd(b, t, hv, kd), sd(b, t, hv, dtype=jnp.float32),
          sd(b, t, hv, kd, dtype=jnp.float32))
  jax.jit(fwd).trace(*args).lower(lowering_platforms=("cuda",))
  jax.jit(jax.grad(lambda g: jnp.sum(chunk_cumsum(g, 64, -30.0, interpret=False)))).trace(
      args[-1]).lower(lowering_platforms=("cuda",))
  ir = capsys.readouterr().out
  assert set(re.findall(r"@delta_rule_(\w+)\(", ir)) == {"scores", "prep", "state_fwd", "output", "repair"}
  assert {"chunk_cumsum", "chunk_cumsum_bwd"} <= set(re.findall(r"@(chunk_cumsum\w*)\(", ir))
  assert all(verified), verified


def test_predecay_lowers_to_triton(triton_lowering, capsys):
  """Per-channel decay with `State.predecay` (bf16, GVA, packed): `decayed_tiles` and both state passes
  reading the head-major decayed tiles lower to verified Triton IR."""
  verified = triton_lowering
  b, t, h, hv, kd, n = 1, 64, 1, 2, 32, 2
  sd = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)

  def loss(q, k, v, beta, g, ids):
    o, s = gpu.delta_rule(q, k, v, beta, log_decay=g, segment_ids=ids, num_segments=n, chunk_size=16,
                          interpret=False, config=DEFAULT.override(state__predecay=True))
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)
  args = (sd(b, t, h, kd), sd(b, t, h, kd), sd(b, t, hv, kd), sd(b, t, hv, dtype=jnp.float32),
          sd(b, t, hv, kd, dtype=jnp.float32), sd(b, t, dtype=jnp.int32))
  jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*args).lower(lowering_platforms=("cuda",))
  names = set(re.findall(r"@delta_rule_(\w+)\(", capsys.readouterr().out))
  assert names == _expected_kernels("channel") | {"decayed_tiles"}, names
  assert all(verified), verified


@pytest.mark.parametrize("fuse_inter", [False, True])
def test_packed_lowers_to_triton(triton_lowering, capsys, fuse_inter):
  """Packed sequences (segment resets in both state passes: per-chunk int32 info, dynamic-row state loads
  and guarded stores) lower to verified Triton IR, bf16 inputs, scalar decay, traced segment ids; also with
  the inter-chunk output formed by the forward's state pass."""
  verified = triton_lowering
  b, t, h, hv, kd, n = 2, 80, 1, 2, 64, 5
  sd = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)

  def loss(q, k, v, beta, g, s0, ids):
    o, s = gpu.delta_rule(q, k, v, beta, log_decay=g, initial_state=s0, segment_ids=ids, num_segments=n,
                          chunk_size=32, interpret=False,
                          config=DEFAULT.override(state__fuse_inter=fuse_inter))
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)
  f = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5))
  args = (sd(b, t, h, kd), sd(b, t, h, kd), sd(b, t, hv, kd), sd(b, t, hv, dtype=jnp.float32),
          sd(b, t, hv, dtype=jnp.float32), sd(n, hv, kd, kd, dtype=jnp.float32), sd(b, t, dtype=jnp.int32))
  jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
  ir = capsys.readouterr().out
  assert set(re.findall(r"@delta_rule_(\w+)\(", ir)) == _expected_kernels("scalar")
  assert ir.count("scf.if") >= 2                 # the guarded final-state / dS0 stores
  assert all(verified), verified


def _offline(impl, **kw):
  def fn(q, k, v, beta, k_write, log_decay, initial_state):
    del k_write
    return impl.linear_attention(q, k, v, beta=beta, log_decay=log_decay, initial_state=initial_state, **kw)
  return fn


@pytest.mark.parametrize("decay", DECAYS)
def test_linear_attention_fp32(decay):
  """The offline solve through the delta-rule kernels (zero erase key): against the fp64 offline oracle and
  the XLA path, odd T, GVA, an initial state, β given; and β = None (1) through the public API."""
  p = random_problem(21, B=1, T=45, H=2, HV=4, K=16, V=32, decay=decay)
  arrays = p.arrays(jnp.float32)
  got = jit_vjp_all(_offline(gpu, chunk_size=16), arrays)
  want = jit_vjp_all(_offline(naive), p.arrays(jnp.float64, jnp.float64, jnp.float64))
  assert_trees_close(got, {n: w for n, w in want.items() if n in got}, jnp.float32, dtypes=contract_dtypes(arrays))
  assert_trees_close(got, jit_vjp_all(_offline(chunked, chunk_size=16), arrays), jnp.float32)
  run = lambda impl: ops.linear_attention(arrays["q"], arrays["k"], arrays["v"], log_decay=arrays["log_decay"],
                                          output_final_state=True, chunk_size=16, implementation=impl)
  assert_trees_close(dict(zip("oS", run("pallas"))), dict(zip("oS", run("xla"))), jnp.float32)
