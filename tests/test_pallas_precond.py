"""The Pallas decayed-sum kernel of the PDN / ATQ preconditioners (interpret mode on CPU) against the
`lax.associative_scan` path: values, final state and every input gradient; through `pdn_write_key` and
`atq_query`; dispatch; lowering to Triton IR for CUDA."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from osdn_jax.dgps import precond
from osdn_jax.ops.scan import affine_scan
from osdn_jax.testing import rel_rms
from pallas_kernels.gpu import decayed_sum as ds

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


def _values_and_grads(fn, args, seed=1):
  """(outputs, gradients of Σ ⟨w, outputs⟩ w.r.t. every non-None argument)."""
  names = [i for i, a in enumerate(args) if a is not None]
  outs = jax.eval_shape(fn, *args)
  rng = np.random.default_rng(seed)
  ws = [jnp.asarray(rng.normal(size=o.shape), F32) for o in outs]

  def loss(*xs):
    full = list(args)
    for i, x in zip(names, xs):
      full[i] = x
    o = fn(*full)
    return sum(jnp.sum(a.astype(F32) * w) for a, w in zip(o, ws)), o
  (_, o), grads = jax.value_and_grad(loss, argnums=tuple(range(len(names))), has_aux=True)(
      *(args[i] for i in names))
  return tuple(o) + tuple(grads)


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
  got = _values_and_grads(kernel, (x, g, beta, A0))
  want = _values_and_grads(_scan_ref, (x, g, beta, A0))
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


@pytest.mark.parametrize("which", ["pdn", "atq"])
def test_preconditioners_through_the_kernel(which):
  """pdn_write_key / atq_query with implementation="pallas" against "scan": values and gradients w.r.t. k,
  the gates and the initial state (and q for ATQ)."""
  x, g, beta, A0 = _inputs(5, H=2, K=16)
  k = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = jnp.flip(k, 1)

  def run(impl):
    if which == "pdn":
      return lambda k, g, beta, A0: precond.pdn_write_key(k, beta, g, jnp.array([-0.2, 0.1]), initial_state=A0,
                                                          implementation=impl)
    return lambda k, g, beta, A0: precond.atq_query(q, k, beta, g, initial_state=A0, implementation=impl)

  got = _values_and_grads(run("pallas"), (k, g, beta, A0))
  want = _values_and_grads(run("scan"), (k, g, beta, A0))
  for i, (a, b) in enumerate(zip(got, want)):
    assert rel_rms(a, b) < TOL, (i, rel_rms(a, b))


def test_dispatch_and_errors():
  spec = lambda packed: type("Spec", (), {"key_dim": 64, "packed": packed})()
  assert pallas_kernels.lookup("decayed_sum", spec(False), F32, 0, "gpu") is ds.decayed_sum
  assert pallas_kernels.lookup("decayed_sum", spec(True), F32, 0, "gpu") is None
  assert pallas_kernels.lookup("decayed_sum", spec(False), jnp.float64, 0, "gpu") is None
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
