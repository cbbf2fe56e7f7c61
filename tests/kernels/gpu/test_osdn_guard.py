"""OSDN's write key as one Pallas GPU kernel each way (`pallas_kernels.gpu.osdn.guard.write_key`, op
"osdn_guard") in interpret mode on CPU, against its contract, the plain-JAX write key of
`precond.osdn_write_key` (`_guarded_key(implementation="xla")`): k̃ and the gradients of a random projection
w.r.t. ds, k and β, on fresh random inputs (the seed in every failure) where the guard acts on some rows and not
on others, with β ∈ {0, 1} rows, a zero key and non-finite keys (NaN, inf, a square that overflows: NaN rows,
the same NaNs in the gradients); a tie at the guard; dispatch and `Config.fused_guard`; Triton lowering.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osdn_jax.dgps import precond
from osdn_jax.ops import dispatch
from osdn_jax.testing import rel_rms, values_and_grads
from pallas_kernels.gpu import delta_rule as gpu_delta_rule
from pallas_kernels.gpu import osdn
from pallas_kernels.spec import Spec

F32 = jnp.float32
GUARD = 2.0


@pytest.fixture
def seed():
  return int(np.random.default_rng().integers(2**31))


def _inputs(seed, B, T, G, K, dtype):
  """ds in [0, 3] (so β⟨d, k²⟩ with unit-norm keys is on both sides of γ = 2 when scaled), keys of norm ~2,
  β ∈ [0, 1] with exact 0 and 1 rows; row (0, 1, 0) a zero key, rows (0, 2, *) NaN / inf / 1e20 in one channel."""
  rng = np.random.default_rng(seed)
  ds = rng.uniform(0.0, 3.0, (B, T, G, K))
  k = 2.0 * rng.normal(size=(B, T, G, K)) / np.sqrt(K)
  beta = rng.uniform(0.0, 1.0, (B, T, G))
  beta[0, 0, 0], beta[-1, -1, -1] = 0.0, 1.0
  k[0, 1, 0] = 0.0
  k[0, 2, 0, 0] = np.nan
  k[0, 2, -1, -1] = np.inf
  k[0, 2, 1 % G, K // 2] = 1e20
  k = jnp.asarray(k, dtype)
  n = jnp.maximum(jnp.sum(jnp.square(k.astype(F32)), -1), 1e-12)
  return jnp.asarray(ds, F32), k, jnp.asarray(beta, F32), n


def _values_and_grads(fn, ds, k, beta, seed):
  """(fn's k̃, its gradients w.r.t. ds, k, β) under random cotangents that are zero on k̃'s NaN entries
  (`osdn_jax.testing.values_and_grads`)."""
  masked = lambda *x: jnp.where(jnp.isnan(y := fn(*x)), jnp.zeros((), y.dtype), y)
  return (fn(ds, k, beta),) + values_and_grads(masked, (ds, k, beta), seed)[1:]


def _plain(n):
  return lambda ds, k, beta: precond._guarded_key(ds, k.astype(F32), k, beta, n, GUARD, "xla").astype(k.dtype)


def _kernel(n):
  return lambda ds, k, beta: osdn.write_key(ds, k, beta, n, guard=GUARD)


@pytest.mark.parametrize("shape,dtype,tol", [((2, 37, 3, 37), F32, 1e-6), ((1, 40, 4, 128), jnp.bfloat16, 4e-3)])
def test_matches_plain_jax(seed, shape, dtype, tol):
  """k̃ and ∂ds, ∂k, ∂β within `tol` relative RMS on the finite entries (fp32: rounding; bf16: k̃ and ∂k are
  rounded to bf16 once), NaN exactly where plain JAX has NaN; the guard scales between 10 % and 90 % of the rows."""
  ds, k, beta, n = _inputs(seed, *shape, dtype)
  got = _values_and_grads(_kernel(n), ds, k, beta, seed)
  want = _values_and_grads(_plain(n), ds, k, beta, seed)
  for label, x, y in zip(("k_write", "dds", "dk", "dbeta"), got, want):
    x, y = np.asarray(x.astype(F32)), np.asarray(y.astype(F32))
    assert x.shape == y.shape and x.dtype == y.dtype, (seed, label)
    assert np.array_equal(np.isnan(x), np.isnan(y)), (seed, label, np.argwhere(np.isnan(x) != np.isnan(y))[:4])
    ok = ~np.isnan(y)
    assert rel_rms(x[ok], y[ok]) < tol, (seed, label, rel_rms(x[ok], y[ok]))
  bad = sorted({0, 1 % shape[2], shape[2] - 1})                                   # the NaN, 1e20, inf keys
  assert got[0].dtype == dtype and np.all(np.isnan(np.asarray(got[0][0, 2, bad].astype(F32))))
  assert np.all(np.isfinite(np.asarray(got[0][0, :2].astype(F32))))                 # β = 0 and the zero key
  s = beta * jnp.sum(ds * jnp.square(k.astype(F32)), -1)
  guarded = float(jnp.mean(jnp.where(jnp.isfinite(n), s > GUARD, False)))
  assert 0.1 < guarded < 0.9, (seed, guarded)


def test_tie_at_the_guard():
  """β⟨d, k²⟩ = γ exactly: the derivative of min(1, γ/s) is ½ of each side's, as `jnp.minimum` takes it."""
  ds = jnp.full((1, 2, 1, 16), 2.0, F32)
  k = jnp.zeros((1, 2, 1, 16), F32).at[..., 0].set(1.0)
  beta = jnp.asarray([[[1.0], [0.5]]], F32)
  n = jnp.sum(k * k, -1)
  got = _values_and_grads(_kernel(n), ds, k, beta, 0)
  want = _values_and_grads(_plain(n), ds, k, beta, 0)
  for x, y in zip(got, want):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_a_large_guard_at_the_floor():
  """γ = 1e15 on rows with β = 0 or a zero key (s at the 1e-12 floor): γ / s² overflows, the gradients must not
  (autodiff's order of the products); 21 rows, padded to the block."""
  rng = np.random.default_rng(0)
  ds = jnp.asarray(rng.uniform(0.5, 2.0, (1, 7, 3, 16)), F32)
  k = jnp.asarray(rng.normal(size=(1, 7, 3, 16)), F32).at[0, 1].set(0.0)
  beta = jnp.asarray(rng.uniform(0.2, 1.0, (1, 7, 3)), F32).at[0, 0].set(0.0)
  n = jnp.maximum(jnp.sum(k * k, -1), 1e-12)
  plain = lambda ds, k, beta: precond._guarded_key(ds, k, k, beta, n, 1e15, "xla")
  kernel = lambda ds, k, beta: osdn.write_key(ds, k, beta, n, guard=1e15)
  w = jnp.asarray(rng.normal(size=ds.shape), F32)
  for fn in (plain, kernel):
    grads = jax.grad(lambda *x: jnp.sum(fn(*x) * w), argnums=(0, 1, 2))(ds, k, beta)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)
  got = jax.grad(lambda *x: jnp.sum(kernel(*x) * w), argnums=(0, 1, 2))(ds, k, beta)
  want = jax.grad(lambda *x: jnp.sum(plain(*x) * w), argnums=(0, 1, 2))(ds, k, beta)
  for x, y in zip(got, want):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_dispatch_and_the_switch():
  """The GPU registry serves "osdn_guard" for fp32 / bf16 keys with a static guard; `fused_guard=False` in the
  request's d-pass config (`kernel_config`, as `osdn:fused_guard=False` gives it) turns it off, and `osdn_write_key`
  then writes the same key in plain JAX; a config of another family is refused; no TPU kernel (an explicit
  "pallas-tpu" d-pass keeps the plain-JAX key)."""
  gpu = lambda **kw: Spec("osdn_guard", "gpu", kw.pop("dtype", "bfloat16"), key_dim=128, **kw)
  assert dispatch.kernel(gpu()) is osdn.write_key and dispatch.kernel(gpu(dtype="float32")) is osdn.write_key
  assert dispatch.kernel(gpu(static_params=False)) is None and dispatch.kernel(gpu(dtype="float64")) is None
  assert dispatch.kernel(Spec("osdn_guard", "tpu", "bfloat16", key_dim=128)) is None
  off = dataclasses.replace(osdn.INTERPRET, fused_guard=False)
  assert dispatch.kernel(gpu(config=off)) is None and dispatch.kernel(gpu(config=osdn.INTERPRET)) is osdn.write_key
  assert dispatch.kernel(gpu(config=gpu_delta_rule.DEFAULT)) is None
  ds, k, beta, n = _inputs(3, 1, 20, 2, 16, F32)
  b2 = beta * 0.5 + 0.25
  runs = {}
  for name, config in (("on", osdn.INTERPRET), ("off", off)):
    runs[name] = precond.osdn_write_key(k[:, 3:], b2[:, 3:], d_min=0.0, d_max=8.0, implementation="pallas",
                                        kernel_config=config)[0]
  np.testing.assert_allclose(runs["on"], runs["off"], rtol=2e-6, atol=1e-7)
  with pytest.raises(ValueError, match="`beta` must be"):
    osdn.write_key(ds, k, beta[:, 1:], n, guard=GUARD)


@pytest.mark.parametrize("dtype,kd", [(jnp.bfloat16, 128), (F32, 37)])
def test_lowers_to_triton(triton_lowering, capsys, dtype, kd):
  """Forward and backward lower with the Triton backend for CUDA to IR that passes MLIR verification (bf16 keys
  at K = 128; fp32 keys at K = 37, padded to 64)."""
  verified = triton_lowering
  b, t, g = 2, 100, 4
  sd = lambda *shape, dt=F32: jax.ShapeDtypeStruct(shape, dt)

  def loss(ds, k, beta, n):
    return jnp.sum(osdn.write_key(ds, k, beta, n, guard=GUARD, interpret=False).astype(F32))
  jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(
      sd(b, t, g, kd), sd(b, t, g, kd, dt=dtype), sd(b, t, g), sd(b, t, g)).lower(lowering_platforms=("cuda",))
  ir = capsys.readouterr().out
  assert "@osdn_guard_fwd(" in ir and "@osdn_guard_bwd(" in ir
  assert all(verified), verified
