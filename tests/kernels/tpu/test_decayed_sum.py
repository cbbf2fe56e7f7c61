"""The Pallas TPU (Mosaic) kernels without a TPU.

`pallas_kernels.tpu.decayed_sum` in TPU interpret mode (two simulated TensorCores sharing the "parallel" grid axes,
the race detector on, unspecified memory filled with NaN) against `precond.second_moment(implementation="xla")`
(plain form: `affine_scan`) and the same contract in fp64: A, A_T and the gradients w.r.t. x, β, g and A0. Then
registration (platform "tpu" only) and dispatch, and ahead-of-time compilation by libtpu's Mosaic compiler for
v5e, v5p and v6e chips at the benchmark shapes, forward and backward, with the compiled program's memory. PDN's
write key and ATQ's query (`pallas_kernels.tpu.precond_key`: the moment kernel, then the transform) against the
library's XLA path."""
import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from osdn_jax.dgps import precond
from osdn_jax.ops import dispatch
from osdn_jax.ops.scan import affine_scan
from osdn_jax.testing import rel_rms, values_and_grads
from pallas_kernels.gpu import decayed_sum as gpu_ds
from pallas_kernels.spec import OPS, Spec
from pallas_kernels.tpu import common
from pallas_kernels.tpu import decayed_sum as ds
from pallas_kernels.tpu import precond_key as pk

F32, F64 = jnp.float32, jnp.float64
TOL = 2e-6
INTERPRET = common.interpret_params(detect_races=True, num_cores=2)


def _inputs(seed, B, T, H, K, dtype=F32, extreme=False):
  """x ~ N(0, 1); g = log σ(z − 2) < 0; β = σ(z); A0 ~ U[0, 1). extreme: log-decays of −1e3 and exactly 0 (a run
  across a chunk boundary), β ∈ {0, 1}."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(B, T, H, K)), dtype)
  g = np.log(1 / (1 + np.exp(-rng.normal(size=(B, T, H)) - 2)))
  beta = 1 / (1 + np.exp(-rng.normal(size=(B, T, H))))
  if extreme:
    g[:, 5], g[:, 6], g[:, 120:140] = -1e3, 0.0, 0.0
    beta[:, 7], beta[:, 8] = 0.0, 1.0
  A0 = jnp.asarray(rng.random(size=(B, H, K)), F32)
  return x, jnp.asarray(g, F32), jnp.asarray(beta, F32), A0


def _contract(x, g, beta, A0, *, precision):
  """The library's result: `second_moment(implementation="xla")` (square) or `affine_scan` (plain), in fp32 or in
  fp64 (inputs promoted)."""
  dt = F32 if precision == "fp32" else F64
  x, g, A0 = (a.astype(dt) for a in (x, g, A0))
  if beta is not None:
    return precond.second_moment(x, beta.astype(dt), g, initial_state=A0, implementation="xla")
  return affine_scan(jnp.exp(g)[..., None], x, initial=A0, axis=1)


CASES = {   # (B, T, H, K, square, initial state, extreme gates, dtype, config)
    "T300-K128-multi_chunk": (2, 300, 2, 128, True, True, True, F32, None),
    "T37-K64": (2, 37, 3, 64, True, False, True, F32, None),
    "T1-K128-plain": (2, 1, 2, 128, False, True, False, F32, None),
    "T300-K37-plain": (1, 300, 3, 37, False, True, True, F32, None),
    "T300-K256-H16-v6e_blocks-bf16": (1, 300, 16, 256, True, True, False, jnp.bfloat16, ds.TUNING["v6e"]),
}


# `make test`: all but the bf16 case with v6e's blocks (the slow step: every case).
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if "bf16" in c else []) for c in CASES])
def test_interpret_parity(case, races):
  """Interpret mode against the fp32 XLA path and fp64: every output and gradient within 2e-6 relative RMS (bf16 x
  is read as is and the references square the same bf16 values; dx is rounded to bf16, within 2⁻⁸)."""
  B, T, H, K, square, initial, extreme, dtype, config = CASES[case]
  x, g, beta, A0 = _inputs(list(CASES).index(case), B, T, H, K, dtype, extreme)
  args = (x, g, beta if square else None, A0 if initial else None)
  kernel = lambda x, g, beta, A0: ds.decayed_sum(x, g, beta=beta, initial_state=A0, interpret=INTERPRET,
                                                 config=config)
  got = values_and_grads(kernel, args)
  names = ["A", "A_T", "dx", "dg"] + (["dbeta"] if square else []) + (["dA0"] if initial else [])
  assert len(got) == len(names) and got[0].dtype == F32 and got[2].dtype == dtype
  for precision in ("fp32", "fp64"):
    contract = lambda x, g, beta, A0: _contract(x, g, beta, jnp.zeros((B, H, K), F32) if A0 is None else A0,
                                                precision=precision)
    want = values_and_grads(contract, args)
    for name, a, b in zip(names, got, want):
      tol = 2**-8 if name == "dx" and dtype == jnp.bfloat16 else TOL
      assert a.shape == b.shape and np.all(np.isfinite(np.asarray(a))), (precision, name)
      assert rel_rms(a, b) < tol, (precision, name, rel_rms(a, b))


def test_default_interpret_on_cpu_matches_the_gpu_kernel(races):
  """On a CPU backend `interpret=None` interprets (one simulated core); the result is the GPU kernel's."""
  x, g, beta, A0 = _inputs(7, 2, 70, 2, 16)
  got = jax.jit(lambda *a: ds.decayed_sum(a[0], a[1], beta=a[2], initial_state=a[3]))(x, g, beta, A0)
  want = jax.jit(lambda *a: gpu_ds.decayed_sum(a[0], a[1], beta=a[2], initial_state=a[3]))(x, g, beta, A0)
  assert all(rel_rms(a, b) < TOL for a, b in zip(got, want))


@pytest.mark.parametrize("transform", ["pdn", "atq"])
def test_precond_key(transform, races):
  """PDN's write key and ATQ's query (the moment kernel, then the transform in XLA): y, A_T and every gradient
  (k, q, β, g, A0, the center) against `precond.pdn_write_key` / `atq_query` on the XLA path."""
  x, g, beta, A0 = _inputs(9, 2, 70, 3, 64, extreme=True)
  q = jnp.asarray(np.random.default_rng(10).normal(size=x.shape), F32)
  center = jnp.asarray([0.1, -0.3, 0.5], F32)
  if transform == "pdn":
    def fn(k, g, b, a0, c):
      return pk.precond_key(k, b, g, transform="pdn", center=c, x=1.5, initial_state=a0, interpret=INTERPRET)

    def ref(k, g, b, a0, c):
      return precond.pdn_write_key(k, b, g, c, x=1.5, initial_state=a0, implementation="xla")
    args = (x, g, beta, A0, center)
  else:
    def fn(k, g, b, a0, q):
      return pk.precond_key(k, b, g, transform="atq", q=q, lam=0.5, initial_state=a0, interpret=INTERPRET)

    def ref(k, g, b, a0, q):
      return precond.atq_query(q, k, b, g, lam=0.5, initial_state=a0, implementation="xla")
    args = (x, g, beta, A0, q)
  got, want = values_and_grads(fn, args), values_and_grads(ref, args)
  errors = [rel_rms(a, b) for a, b in zip(got, want)]
  assert max(errors) < TOL, errors
  with pytest.raises(ValueError, match="center"):
    pk.precond_key(x, beta, g, transform="pdn", center=jnp.zeros(5), interpret=INTERPRET)


def test_registration_and_dispatch():
  """The TPU kernels are chosen on platform "tpu" only: a CPU or GPU request gets what it got before."""
  tpu = lambda op, **kw: Spec(op, "tpu", **{"dtype": "float32", "key_dim": 128, **kw})
  assert pallas_kernels.lookup(tpu("decayed_sum")) is ds.decayed_sum
  assert pallas_kernels.lookup(tpu("precond_key")) is pk.precond_key
  assert pallas_kernels.lookup(tpu("precond_key", static_params=False)) is None
  assert pallas_kernels.lookup(tpu("decayed_sum", dtype="bfloat16")) is ds.decayed_sum
  assert pallas_kernels.lookup(tpu("decayed_sum", packed=True)) is None
  assert pallas_kernels.lookup(tpu("decayed_sum", dtype="float64")) is None
  assert dispatch.choose(tpu("decayed_sum"), "auto") == ("pallas", ds.decayed_sum)
  for platform in ("cpu", "gpu"):
    assert pallas_kernels.lookup(Spec("decayed_sum", platform, "float32", 128)) is gpu_ds.decayed_sum
  for op in OPS:
    for kernel in pallas_kernels.kernels(op):
      assert kernel.name.split(".")[0] in ("gpu", "tpu"), kernel.name
      if kernel.name.startswith("tpu."):
        assert not any(kernel.supports(Spec(op, p, "float32", 128)) for p in ("cpu", "gpu")), kernel.name
  with pytest.raises(ValueError, match="no kernel"):
    dispatch.choose(tpu("decayed_sum", packed=True), "pallas")


def test_configs_layouts_and_errors():
  assert ds.default_config(None, "TPU v5 lite") == ds.TUNING["v5e"] and ds.default_config(None, "TPU v5e") == ds.TUNING["v5e"]
  assert ds.default_config(None, "TPU v5") == ds.default_config(None, "TPU v5p") == ds.TUNING["v5p"]
  assert ds.default_config(None, "TPU v6 lite") == ds.TUNING["v6e"] and ds.default_config(None, "TPU v4") == ds.TUNING["v4"]
  assert ds.default_config(None, "cpu") == ds.Config() and ds.default_config() == ds.Config()    # this backend is a CPU
  for bad in ({"chunk": 100}, {"chunk": 0}, {"block_k": 64}, {"block_h": 4}, {"chunk": True}):
    with pytest.raises(ValueError, match=next(iter(bad))):
      ds.Config(**bad)
  cfg = ds.Config(chunk=256, block_k=256, block_h=8)
  assert ds.layout(4096, 16, 128, cfg) == ds.Layout(chunk=256, block_h=8, width=128, tp=4096)
  assert ds.layout(300, 12, 512, cfg) == ds.Layout(chunk=256, block_h=12, width=256, tp=512)
  assert ds.layout(37, 3, 37, cfg) == ds.Layout(chunk=40, block_h=3, width=37, tp=40)
  x, g, beta, A0 = _inputs(9, 2, 8, 3, 16)
  for kwargs, match in (({"beta": beta[:, :4]}, "`beta`"), ({"initial_state": A0[:1]}, "`initial_state`")):
    with pytest.raises(ValueError, match=match):
      ds.decayed_sum(x, g, **kwargs)
  with pytest.raises(ValueError, match="`x`"):
    ds.decayed_sum(x[0], g)


# ---------------------------------------------------------------------------------------------------------
# Ahead-of-time compilation by libtpu (Mosaic: block layouts, VMEM), forward and backward.
# ---------------------------------------------------------------------------------------------------------
BENCH = {"B4-T4096-H16-K128": (4, 4096, 16, 128), "B1-T32768-H8-K128": (1, 32768, 8, 128)}
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (the tpu-aot extra)")


# `make test`: a v5e chip at odd shapes (test_odd_shapes_compile_for_tpu); the slow step: every chip and shape.
@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("shape", [pytest.param(BENCH["B4-T4096-H16-K128"], id="B4-T4096-H16-K128"),
                                   pytest.param(BENCH["B1-T32768-H8-K128"], id="B1-T32768-H8-K128",
                                                marks=pytest.mark.slow)])
@pytest.mark.parametrize("topology", ["v5e:1x1", "v5p:1x1x1", "v6e:1x1"])
def test_compiles_for_tpu(topology, shape, record_property, capsys):
  """bf16 keys, fp32 gates and state: `value_and_grad` of the kernel's outputs (forward and reverse kernel) compiled
  for one chip with that generation's block sizes. The program's temporaries are the saved A and λ (fp32) and
  little else."""
  from jax.sharding import SingleDeviceSharding

  from osdn_jax.train import aot
  devices = aot.topology_devices(topology)
  config = ds.default_config(None, devices[0].device_kind)
  sd = lambda *s, dtype=F32: jax.ShapeDtypeStruct(s, dtype, sharding=SingleDeviceSharding(devices[0]))
  B, T, H, K = shape

  def loss(x, g, beta, A0):
    A, A_T = ds.decayed_sum(x, g, beta=beta, initial_state=A0, interpret=False, config=config)
    return jnp.sum(A) + jnp.sum(A_T)
  with jax.default_device(devices[0]):    # Pallas' lowering asks the default device for the chip
    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(
        sd(B, T, H, K, dtype=jnp.bfloat16), sd(B, T, H), sd(B, T, H), sd(B, H, K))
  compiled = lowered.compile()
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 2
  memory = aot.memory_report(compiled, aot.CHIPS[topology.split(":")[0]].hbm_gib)
  record_property("memory", json.dumps(memory))
  with capsys.disabled():
    print(f"\n{topology} ({devices[0].device_kind}) {config} B,T,H,K={shape}: {memory}")
  state = B * T * H * K * 4
  assert memory["temp_bytes"] <= 2.4 * state and memory["fits"], memory


@needs_libtpu
def test_odd_shapes_compile_for_tpu():
  """Blocks that are not whole (8, 128) tiles compile for a v5e chip (forward and backward): K = 37 and H = 3 as
  full dims with bf16 x and a partial last chunk (T = 300), H = 12 (not a multiple of the head block) with K = 64
  and T = 37 (one chunk longer than the sequence), and T = 1 with two blocks of K = 256 (plain form)."""
  from jax.sharding import SingleDeviceSharding

  from osdn_jax.train import aot
  devices = aot.topology_devices("v5e:1x1")
  config = ds.default_config(None, devices[0].device_kind)
  sd = lambda *s, dtype=F32: jax.ShapeDtypeStruct(s, dtype, sharding=SingleDeviceSharding(devices[0]))

  def loss(*args):
    calls = ((args[0:4], True), (args[4:8], True), ((*args[8:10], None, None), False))
    total = 0.0
    for (x, g, beta, A0), square in calls:
      A, A_T = ds.decayed_sum(x, g, beta=beta if square else None, initial_state=A0, interpret=False,
                              config=config)
      total = total + jnp.sum(A) + jnp.sum(A_T)
    return total
  args = (sd(2, 300, 3, 37, dtype=jnp.bfloat16), sd(2, 300, 3), sd(2, 300, 3), sd(2, 3, 37),
          sd(2, 37, 12, 64), sd(2, 37, 12), sd(2, 37, 12), sd(2, 12, 64),
          sd(1, 1, 16, 256, dtype=jnp.bfloat16), sd(1, 1, 16))
  with jax.default_device(devices[0]):
    lowered = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))))).lower(*args)
  assert lowered.compile().as_text().count('custom_call_target="tpu_custom_call"') == 6
