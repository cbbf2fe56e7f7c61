"""The Pallas kernels of the PDN / ATQ preconditioners (interpret mode on CPU) against the
`lax.associative_scan` path: `decayed_sum` (the second moment) and `precond_key` (the second moment fused with
PDN's write key / ATQ's query, through `pdn_write_key` and `atq_query`): values, final state and every input
gradient; dispatch and errors; lowering to Triton IR for CUDA."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as hs

import pallas_kernels
from osdn_jax.dgps import precond
from osdn_jax.ops.scan import affine_scan
from osdn_jax.testing import close, examples, rel_rms, values_and_grads
from pallas_kernels.gpu import decayed_sum as ds
from pallas_kernels.spec import Spec

F32 = jnp.float32
TOL = 2e-6


def _inputs(seed, B=2, T=77, H=3, K=20, dtype=F32, extreme=False):
  """T not a multiple of the chunk, K padded to 32; extreme: log-decays of −1e3 and exactly 0, β ∈ {0, 1}."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(B, T, H, K)), dtype)
  g = np.log(1 / (1 + np.exp(-rng.normal(size=(B, T, H)) - 2)))
  beta = 1 / (1 + np.exp(-rng.normal(size=(B, T, H))))
  if extreme:
    g[:, 5], g[:, 6], g[:, 40:44] = -1e3, 0.0, 0.0
    beta[:, 7], beta[:, 8] = 0.0, 1.0
  A0 = jnp.asarray(rng.random(size=(B, H, K)), F32)
  return x, jnp.asarray(g, F32), jnp.asarray(beta, F32), A0


def _scan_ref(x, g, beta, A0):
  b = x.astype(F32) if beta is None else beta[..., None] * x.astype(F32) ** 2
  return affine_scan(jnp.exp(jnp.maximum(g, -30.0))[..., None], b, initial=A0, axis=1)


@pytest.mark.parametrize("square,initial,extreme", [(True, True, False), (False, False, False),
                                                    (True, False, True)])
def test_decayed_sum_against_associative_scan(square, initial, extreme):
  x, g, beta, A0 = _inputs(3, extreme=extreme)
  beta = beta if square else None
  A0 = A0 if initial else None
  kernel = lambda x, g, beta, A0: ds.decayed_sum(x, g, beta=beta, initial_state=A0)
  got = values_and_grads(kernel, (x, g, beta, A0))
  want = values_and_grads(_scan_ref, (x, g, beta, A0))
  for i, (a, b) in enumerate(zip(got, want)):
    assert a.shape == b.shape and np.all(np.isfinite(np.asarray(a))), i
    assert rel_rms(a, b) < TOL, (i, rel_rms(a, b))


def test_decayed_sum_bf16_input():
  """bf16 x is read as is and squared in fp32: equal to the scan on the same bf16 values."""
  x, g, beta, A0 = _inputs(4, dtype=jnp.bfloat16)
  got = ds.decayed_sum(x, g, beta=beta, initial_state=A0)
  want = _scan_ref(x, g, beta, A0)
  assert got[0].dtype == F32 and rel_rms(got[0], want[0]) < TOL and rel_rms(got[1], want[1]) < TOL
  dx = jax.grad(lambda x: jnp.sum(ds.decayed_sum(x, g, beta=beta)[0]))(x)
  assert dx.dtype == jnp.bfloat16


def test_dispatch_and_errors():
  lookup = lambda **kw: pallas_kernels.lookup(Spec("decayed_sum", "gpu", **{"dtype": "float32", "key_dim": 64, **kw}))
  assert lookup() is ds.decayed_sum and lookup(dtype="bfloat16") is ds.decayed_sum
  assert lookup(packed=True) is None and lookup(dtype="float64") is None
  x, g, beta, A0 = _inputs(6, T=8, K=16)
  with pytest.raises(ValueError, match="packed"):
    precond.second_moment(x, beta, g, segment_ids=jnp.zeros((2, 8), jnp.int32), implementation="pallas")
  with pytest.raises(ValueError, match="`implementation`"):
    precond.second_moment(x, beta, g, implementation="triton")
  with pytest.raises(ValueError, match="`beta`"):
    ds.decayed_sum(x, g, beta=beta[:, :4])
  with pytest.raises(ValueError, match="`initial_state`"):
    ds.decayed_sum(x, g, initial_state=A0[:1])


def test_lowers_to_triton(triton_lowering, capsys):
  """Forward and backward (the same kernel run in reverse) lower to verified Triton IR for CUDA."""
  verified = triton_lowering
  sd = lambda *shape, dtype=F32: jax.ShapeDtypeStruct(shape, dtype)

  def loss(x, g, beta, A0):
    A, A_T = ds.decayed_sum(x, g, beta=beta, initial_state=A0, interpret=False)
    return jnp.sum(A) + jnp.sum(A_T)
  f = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))
  jax.jit(f).trace(sd(2, 100, 4, 128, dtype=jnp.bfloat16), sd(2, 100, 4), sd(2, 100, 4),
                   sd(2, 4, 128)).lower(lowering_platforms=("cuda",))
  ir = capsys.readouterr().out
  assert ir.count("@decayed_sum(") >= 2 and "scf.for" in ir
  assert all(verified), verified


# ---------------------------------------------------------------------------------------------------------
# The fused kernel `precond_key` (A never stored) through pdn_write_key / atq_query, against the scan path.
# ---------------------------------------------------------------------------------------------------------
def _key_inputs(seed, T, dtype=F32, extreme=False):
  """(k, q, beta, g, A0, center): B=2, H=3, K=20 (padded to 32), L2-normalised keys; extreme adds zero keys
  (whole tokens and some channels) to `_inputs`' extreme gates."""
  x, g, beta, A0 = _inputs(seed, T=T, extreme=extreme)
  rng = np.random.default_rng(seed + 100)
  k = np.array(x / jnp.linalg.norm(x, axis=-1, keepdims=True))
  if extreme:
    k[:, 10:12], k[:, 20:30, :, :5] = 0.0, 0.0
  q = rng.normal(size=k.shape)
  center = jnp.asarray([-0.2, 0.1, 0.3], F32)
  return jnp.asarray(k, dtype), jnp.asarray(q, dtype), beta, g, A0, center


def _key_fn(which, impl):
  """fn(k, q, beta, g, A0, center) → (y, A_T) through `precond.pdn_write_key` or `precond.atq_query`."""
  if which == "pdn":
    return lambda k, q, beta, g, A0, c: precond.pdn_write_key(k, beta, g, c, x=1.7, initial_state=A0,
                                                              implementation=impl)
  return lambda k, q, beta, g, A0, c: precond.atq_query(q, k, beta, g, lam=0.5, initial_state=A0,
                                                        implementation=impl)


def _key_args(which, k, q, beta, g, A0, center, initial=True):
  return (k, q if which == "atq" else None, beta, g, A0 if initial else None, center if which == "pdn" else None)


@pytest.mark.parametrize("which,T,initial,extreme", [("pdn", 77, True, False), ("pdn", 150, False, True),
                                                     ("atq", 150, True, True), ("atq", 77, False, False)])
def test_precond_key_against_scan(which, T, initial, extreme):
  """Outputs, A_T and the gradients of every input (k, q, β, g, center, A0) under random cotangents on both
  outputs; T = 77 (one padded chunk and a part) or 150 (three chunks), K = 20; extreme gates finite and equal."""
  args = _key_args(which, *_key_inputs(7, T, extreme=extreme), initial=initial)
  got = values_and_grads(_key_fn(which, "pallas"), args)
  want = values_and_grads(_key_fn(which, "xla"), args)
  assert len(got) == 2 + sum(a is not None for a in args)
  for i, (a, b) in enumerate(zip(got, want)):
    assert a.shape == b.shape and a.dtype == b.dtype and np.all(np.isfinite(np.asarray(a))), i
    assert rel_rms(a, b) < TOL, (i, rel_rms(a, b))


@settings(max_examples=examples(3))
@given(seed=hs.integers(0, 2**31 - 1), which=hs.sampled_from(("pdn", "atq")), H=hs.integers(1, 3),
       K=hs.sampled_from((8, 20, 64)), T=hs.integers(1, 70), initial=hs.booleans(), extreme=hs.booleans())
@example(seed=24528819, which="pdn", H=1, K=20, T=58, initial=False, extreme=True)   # dc nearly cancels
def test_precond_key_random_shapes(seed, which, H, K, T, initial, extreme):
  """Random shapes, gates and keys (with `extreme`: log-decays −1e3 and 0, β ∈ {0, 1}, zero keys) through the
  fp32 kernel against the fp64 scan: outputs, A_T and every input gradient. dc sums every token's term into H
  numbers that can nearly cancel (the example: the fp32 scan 2.4e-4 relative off, the kernel 1.9e-4): where it
  misses 1e-5, its error must stay within twice the fp32 scan's on the same inputs."""
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(2, T, H, K)) / np.sqrt(K)
  g = -np.logaddexp(0.0, -(rng.normal(size=(2, T, H)) + 2.0))
  beta = 1 / (1 + np.exp(-rng.normal(size=(2, T, H))))
  if extreme:
    g[:, ::5], g[:, 1::7] = -1e3, 0.0
    beta[:, ::3], beta[:, 2::4] = 1.0, 0.0
    k[:, 3::4] = 0.0
  raw = (k, rng.normal(size=k.shape), beta, g, rng.random(size=(2, H, K)), rng.normal(size=(H,)) * 0.3)
  args = lambda dtype: _key_args(which, *(jnp.asarray(x, dtype) for x in raw), initial=initial)
  got = values_and_grads(_key_fn(which, "pallas"), args(F32))
  want = values_and_grads(_key_fn(which, "xla"), args(jnp.float64))
  for i, (a, b) in enumerate(zip(got, want)):
    assert a.shape == b.shape and a.dtype == F32 and np.all(np.isfinite(np.asarray(a))), i
    if which == "pdn" and i == len(got) - 1 and not close(a, b, 1e-5, 1e-7):       # dc
      scan_fp32 = values_and_grads(_key_fn(which, "xla"), args(F32))[i]
      assert rel_rms(a, b) <= 2 * rel_rms(scan_fp32, b), (rel_rms(a, b), rel_rms(scan_fp32, b))
    else:
      assert close(a, b, 1e-5, 1e-7), (i, rel_rms(a, b))


def test_precond_key_split_blocks():
  """The GPU's chunk (16) with K split into two blocks of 16 (partial sums of dβ, dg, dc over K blocks) gives
  the same function as the interpret-mode default (chunk 4, one K block)."""
  from pallas_kernels.gpu import precond_key as pk
  config = pk.Config(chunk=16, block_k=16, warps=1)
  args = _key_args("pdn", *_key_inputs(10, 77))

  def fn(k, q, beta, g, A0, c):
    return pk.precond_key(k, beta, g, transform="pdn", center=c, x=1.7, initial_state=A0, config=config)
  got = values_and_grads(fn, args)
  want = values_and_grads(_key_fn("pdn", "xla"), args)
  for i, (a, b) in enumerate(zip(got, want)):
    assert rel_rms(a, b) < TOL, (i, rel_rms(a, b))
  with pytest.raises(ValueError, match="Config.chunk"):
    pk.Config(chunk=2)


def test_precond_key_bf16_inputs():
  """bf16 k and q: outputs in bf16 and every gradient within a bf16 tolerance of the scan on the same inputs."""
  k, q, beta, g, A0, center = _key_inputs(8, 77, dtype=jnp.bfloat16)
  for which in ("pdn", "atq"):
    args = _key_args(which, k, q, beta, g, A0, center)
    got = values_and_grads(_key_fn(which, "pallas"), args)
    want = values_and_grads(_key_fn(which, "xla"), args)
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == F32 and got[2].dtype == jnp.bfloat16
    for i, (a, b) in enumerate(zip(got, want)):
      assert a.dtype == b.dtype and rel_rms(a, b) < 1e-2, (which, i, rel_rms(a, b))


def test_precond_key_dispatch_and_errors():
  from pallas_kernels.gpu import precond_key as pk
  lookup = lambda **kw: pallas_kernels.lookup(Spec("precond_key", "gpu", **{"dtype": "float32", "key_dim": 64, **kw}))
  assert lookup(dtype="bfloat16") is pk.precond_key and lookup(packed=True) is None
  assert lookup(static_params=False) is None and lookup(dtype="float64") is None
  k, q, beta, g, A0, center = _key_inputs(9, 8)
  with pytest.raises(ValueError, match="packed"):
    precond.pdn_write_key(k, beta, g, center, segment_ids=jnp.zeros((2, 8), jnp.int32), implementation="pallas")
  with pytest.raises(ValueError, match="float64"):
    precond.atq_query(q.astype(jnp.float64), k, beta, g, implementation="pallas")
  with pytest.raises(ValueError, match="static"):
    jax.jit(lambda x: precond.pdn_write_key(k, beta, g, center, x=x, implementation="pallas"))(1.5)
  with pytest.raises(ValueError, match="`implementation`"):
    precond.atq_query(q, k, beta, g, implementation="triton")
  bad = [(dict(k=k[0]), "`k`"), (dict(beta=beta[:, :4]), "`beta`"), (dict(log_decay=g[..., :1]), "`log_decay`"),
         (dict(initial_state=A0[:1]), "`initial_state`"), (dict(center=center[:2]), "`center`"),
         (dict(transform="atq"), "`q`"), (dict(transform="atq", q=q[:, :4]), "`q`"),
         (dict(transform="exact"), "`transform`"), (dict(lam=0.0), "lam")]
  for change, match in bad:
    kw = {**dict(k=k, beta=beta, log_decay=g, transform="pdn", center=center), **change}
    with pytest.raises(ValueError, match=match):
      pk.precond_key(kw.pop("k"), kw.pop("beta"), kw.pop("log_decay"), **kw)


@pytest.mark.parametrize("which", ["pdn", "atq"])
def test_precond_key_lowers_to_triton(which, triton_lowering, capsys):
  """Forward (apply) and backward (carry_grad, grads) and the chunk-carry `decayed_sum` passes lower to verified
  Triton IR for CUDA."""
  from pallas_kernels.gpu import precond_key as pk
  verified = triton_lowering
  sd = lambda *shape, dtype=F32: jax.ShapeDtypeStruct(shape, dtype)

  def loss(k, q, beta, g, A0, c):
    y, A_T = pk.precond_key(k, beta, g, transform=which, q=q, center=c, initial_state=A0, interpret=False)
    return jnp.sum(y.astype(F32)) + jnp.sum(A_T)
  f = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5) if which == "pdn" else (0, 1, 2, 3, 4))
  bf = jnp.bfloat16
  jax.jit(f).trace(sd(2, 100, 4, 128, dtype=bf), sd(2, 100, 4, 128, dtype=bf), sd(2, 100, 4), sd(2, 100, 4),
                   sd(2, 4, 128), sd(4)).lower(lowering_platforms=("cuda",))
  ir = capsys.readouterr().out
  for name in ("precond_key_apply", "precond_key_carry_grad", "precond_key_grads", "decayed_sum"):
    assert f"@{name}(" in ir, name
  assert all(verified), verified


@pytest.mark.parametrize("which", ["pdn", "atq", "moment"])
def test_packed_traced_segments_fold_into_the_unpacked_kernels(which):
  """Packed with traced segment_ids and no carried state (a training step): the kernels run unpacked with each
  segment start's log-decay at the floor. Values and every gradient equal the packed associative scan (which
  zeroes the state at a start), and the final state is None on both."""
  k, q, beta, g, _, center = _key_inputs(11, 150)
  seg = jnp.asarray(np.cumsum(np.random.default_rng(3).random((2, 150)) < 0.04, axis=1), jnp.int32)
  fns = {"pdn": lambda impl: lambda k, q, b, g, c, s: precond.pdn_write_key(k, b, g, c, x=1.7, segment_ids=s,
                                                                              implementation=impl),
         "atq": lambda impl: lambda k, q, b, g, c, s: precond.atq_query(q, k, b, g, lam=0.5, segment_ids=s,
                                                                          implementation=impl),
         "moment": lambda impl: lambda k, q, b, g, c, s: precond.second_moment(k, b, g, segment_ids=s,
                                                                                implementation=impl)}

  def run(impl):
    fn = fns[which](impl)

    @jax.jit
    def go(k, q, beta, g, center, seg):
      (y, A_T), vjp = jax.vjp(lambda k, q, beta, g, center: fn(k, q, beta, g, center, seg), k, q, beta, g, center)
      assert A_T is None
      w = jnp.cos(jnp.arange(y.size, dtype=F32)).reshape(y.shape).astype(y.dtype)
      return (y,) + vjp((w, None))
    return go(k, q, beta, g, center, seg)

  got, want = run("pallas"), run("xla")
  for i, (a, b) in enumerate(zip(got, want)):
    if b is None or not np.any(np.asarray(b)):
      continue
    assert np.all(np.isfinite(np.asarray(a))), i
    assert rel_rms(a, b) < 5 * TOL, (i, rel_rms(a, b))   # the kernels' chunked sums against a scan's order
