"""OSDN's d-pass as a Pallas TPU (Mosaic) kernel (`pallas_kernels.tpu.osdn`) without a TPU.

TPU interpret mode (two simulated TensorCores sharing the "parallel" grid axes, the race detector on, unspecified
memory filled with NaN) against `precond.osdn_d_pass(implementation="xla")` in fp32 and the token-serial reference
in fp64: ds, d_{T+1} (or every segment's last d) and the gradients of a random projection of both w.r.t. u, n, β, r,
d1 and d_init. Inputs are drawn afresh every run (the seed is in every failure message). Then the arguments' checks
and `supports`, and ahead-of-time compilation by libtpu's Mosaic compiler for v5e, v5p and v6e chips at the
benchmark shapes, forward and `value_and_grad`, with the compiled program's memory.
"""
import dataclasses
import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osdn_jax.dgps import precond
from osdn_jax.ops import packing
from osdn_jax.testing import random_d_pass_inputs, rel_rms, values_and_grads
from pallas_kernels.spec import Spec
from pallas_kernels.tpu import common
from pallas_kernels.tpu import osdn

F32, F64 = jnp.float32, jnp.float64
TOL = 2e-6
INTERPRET = common.interpret_params(detect_races=True, num_cores=2)


@pytest.fixture
def seed():
  return int(np.random.default_rng().integers(2**31))


_inputs = random_d_pass_inputs


def _clipped_fraction(a, ds, *, eta, lo, hi, apf_anchor, learned_r):
  """The fraction of entries whose d̄_{t+1} lies beyond a bound, from the d_t each token writes with (fp64)."""
  u, n, b, r, o = (np.asarray(a[x], np.float64) for x in ("u", "n", "beta", "r", "d0"))
  d = np.asarray(ds, np.float64)
  step = (eta * b * (1 - b * np.sum(d * u, -1)) / n)[..., None] * u
  keep = d if not learned_r else (r[..., None] * d if apf_anchor == "zero" else o + r[..., None] * (d - o))
  d_bar = keep + step
  return float(np.mean((d_bar < (-np.inf if lo is None else lo)) | (d_bar > (np.inf if hi is None else hi))))


# (B, T, G, K, learned r, anchor, η, d_min, d_max, packed): odd T (one token, one chunk of 40, three chunks with a
# partial last one), K not a multiple of 128, G = 16 (two head blocks), both anchors with and without a retention,
# both bounds, the upper bound only, no bound; packed rows (`_packed_ids`).
CASES = {
    "T300-K20-apf_init-clip": (1, 300, 3, 20, True, "init", 12.0, 0.2, 1.6, False),
    "T37-K37-apf_zero-clip": (2, 37, 2, 37, True, "zero", 12.0, 0.0, 1.5, False),
    "T1-K24-r1-noclip": (2, 1, 3, 24, False, "init", 0.8, None, None, False),
    "T300-K128-G16-r1-clip": (1, 300, 16, 128, False, "zero", 16.0, 0.0, 1.5, False),
    "T150-K16-apf_init-upper": (1, 150, 2, 16, True, "init", 12.0, None, 1.4, False),
    "T150-K16-apf_zero-noclip": (1, 150, 2, 16, True, "zero", 0.8, None, None, False),
    "T200-K20-packed-apf_init-clip": (2, 200, 2, 20, True, "init", 12.0, 0.2, 1.6, True),
    "T37-K16-packed-r1-clip": (2, 37, 2, 16, False, "zero", 8.0, 0.0, 2.0, True),
}
SLOW = ("T300-K20-apf_init-clip", "T300-K128-G16-r1-clip", "T150-K16-apf_init-upper", "T150-K16-apf_zero-noclip")


def _packed_ids(T):
  """Raw segment ids [2, T] (the reference's input) and the number of d1 rows. T = 200 (chunks of 128): row 0 has a
  one-token segment at t = 0, one ending at 127 (the next starts at the chunk boundary 128) and a one-token
  segment in the middle of a chunk; row 1 a one-token segment and one spanning the boundary; two spare d1 rows
  (no tokens: zero last d and zero gradient). T = 37: more segments than d1 rows (the last ones start from
  d1[N − 1], as the reference clamps them)."""
  if T == 200:
    rows = [[1, 127, 50, 1, 21], [60, 1, 139]]
    spare = 2
  else:
    rows = [[5, 1, 31], [20, 17]]
    spare = -2
  ids = np.stack([np.repeat(np.arange(len(r)), r) + 10 * i for i, r in enumerate(rows)]).astype(np.int32)
  return ids, sum(map(len, rows)) + spare


def _run(case, seed):
  B, T, G, K, learned_r, anchor, eta, lo, hi, packed = CASES[case]
  ids, count = _packed_ids(T) if packed else (None, 0)
  a = _inputs(seed, B, T, G, K, count)
  names = ["u", "n", "beta"] + (["r"] if learned_r else []) + ["d1", "d0"]
  kw = dict(eta=eta, d_min=lo, d_max=hi, apf_anchor=anchor)

  def call(impl, dtype=F32):
    def fn(*xs):
      x = dict(zip(names, (v.astype(dtype) for v in xs)))
      args = (x["u"], x["n"], x["beta"], x.get("r"), x["d1"], x["d0"])
      if impl == "kernel":
        segs = None if ids is None else packing.segment_index(ids)
        return osdn.d_pass(*args, segment_ids=segs, interpret=INTERPRET, **kw)
      return precond.osdn_d_pass(*args, segment_ids=ids, implementation=impl, **kw)
    return fn
  args = [a[n] for n in names]
  got = values_and_grads(call("kernel"), args, seed)
  labels = ["ds", "d_last"] + ["d" + n for n in names]
  assert [g.dtype for g in got] == [F32] * len(labels), [g.dtype for g in got]
  if not learned_r:      # d_init is unused: its gradient is zero (the chunked form leaves rounding noise)
    assert not np.any(np.asarray(got[-1])), seed
  want32, want64 = values_and_grads(call("xla"), args, seed), values_and_grads(call("reference", F64), args, seed)
  for label, x, y32, y64 in zip(labels, got, want32, want64):
    if label == "dd0" and not learned_r:
      continue
    assert x.shape == y64.shape and np.all(np.isfinite(np.asarray(x))), (seed, label)
    errors = rel_rms(x, y32), rel_rms(x, y64), rel_rms(y32, y64)
    # Where d sits at a bound, a step below half an fp32 ulp of the bound leaves d̄ exactly on it, and jnp.clip's
    # derivative there is ½; two fp32 implementations that round d̄ differently (operation order, fused
    # multiply-adds) then disagree on such ties as much as either disagrees with fp64 (and a little more: the two
    # distances add), so the bound against the fp32 form is twice its own distance from fp64.
    assert errors[0] < max(2 * TOL, 2 * errors[2]) and errors[1] < max(TOL, 2 * errors[2]), (seed, label, errors)
  if lo is not None or hi is not None:
    fraction = _clipped_fraction(a, want64[0], eta=eta, lo=lo, hi=hi, apf_anchor=anchor, learned_r=learned_r)
    assert fraction > 0.02, (seed, fraction)   # the cases' least over 300 seeds: 0.049
  assert float(jnp.max(jnp.abs(got[labels.index("dbeta")]))) > 0, seed
  return got, labels, count


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW else []) for c in CASES])
def test_interpret_parity(case, seed, races):
  """Every output and gradient within 4e-6 relative RMS of the fp32 XLA implementation (the chunked form where
  unclipped and unpacked, else the scan), or within that implementation's own distance from the fp64 reference
  where it is larger; against the fp64 reference, within 2e-6 or twice the fp32 implementation's own error. The
  clipped gradients are discontinuous at exact ties with a bound (∂clip = ½), and fp32 rounding makes ties that
  fp64 does not: at T = 300, K = 128 fp32 has 2.6 times as many, and ∂u is 1.7e-2 from fp64 in either fp32 form;
  where the case clips, over 2% of the entries are clipped; packed, spare segments have a
  zero last d and zero ∂d1."""
  got, labels, count = _run(case, seed)
  if count > 0 and CASES[case][1] == 200:
    ids, _ = _packed_ids(200)
    present = int(packing.segment_index(ids).max()) + 1
    assert not np.any(np.asarray(got[1])[present:]) and not np.any(np.asarray(got[labels.index("dd1")])[present:])


def test_default_interpret_and_chaining(seed, races):
  """`interpret=None` on a CPU backend runs TPU interpret mode (one simulated core); two calls through d_{T+1} give
  one call's results."""
  a = _inputs(seed, 2, 40, 2, 16)
  kw = dict(eta=4.0, d_min=0.0, d_max=2.0, apf_anchor="zero")
  run = jax.jit(lambda u, n, beta, r, d1: osdn.d_pass(u, n, beta, r, d1, a["d0"], config=osdn.Config(unroll=4),
                                                      **kw))
  cut = lambda sl: [a[x][:, sl] for x in ("u", "n", "beta", "r")]
  ds, d_last = run(*cut(slice(None)), a["d1"])
  ds1, mid = run(*cut(slice(0, 17)), a["d1"])
  ds2, end = run(*cut(slice(17, None)), mid)
  assert rel_rms(jnp.concatenate([ds1, ds2], 1), ds) < TOL and rel_rms(end, d_last) < TOL, seed
  want = precond.osdn_d_pass(a["u"], a["n"], a["beta"], a["r"], a["d1"], a["d0"], implementation="reference", **kw)
  assert rel_rms(ds, want[0]) < TOL and rel_rms(d_last, want[1]) < TOL, seed


def test_errors_config_and_supports():
  a = _inputs(0, 2, 8, 3, 16)
  args = lambda **kw: {**dict(u=a["u"], n=a["n"], beta=a["beta"], retention=a["r"], d1=a["d1"], d_init=a["d0"]),
                       **kw}
  kw = dict(eta=1.0, d_min=0.0, d_max=8.0, apf_anchor="zero")
  ids = jnp.zeros((2, 8), jnp.int32)
  for bad, match in ((dict(u=a["u"][0]), "`u`"), (dict(u=jnp.zeros((2, 8, 3, 300))), "`u`"),
                     (dict(n=a["n"][:, :4]), "`n`"), (dict(beta=a["beta"][..., :2]), "`beta`"),
                     (dict(retention=a["r"][0]), "`retention`"), (dict(d1=a["d1"][:1]), "`d1`"),
                     (dict(d_init=jnp.ones((3, 5))), "`d_init`")):
    with pytest.raises(ValueError, match=match):
      osdn.d_pass(**args(**bad), **kw)
  for bad, match in ((dict(apf_anchor="one"), "`apf_anchor`"), (dict(eta=None), "`eta`"),
                     (dict(segment_ids=ids[:, :4]), "`segment_ids`"),
                     (dict(segment_ids=ids.astype(F32)), "`segment_ids`")):
    with pytest.raises(ValueError, match=match):
      osdn.d_pass(**args(), **{**kw, **bad})
  with pytest.raises(ValueError, match="`d1`"):
    osdn.d_pass(**args(d1=a["d1"][:, :2]), segment_ids=ids, **kw)
  with pytest.raises(ValueError, match="`d_max`"):
    jax.jit(lambda hi: osdn.d_pass(**args(), eta=1.0, d_min=0.0, d_max=hi, apf_anchor="zero"))(8.0)
  for bad in ({"chunk": 100}, {"chunk": 0}, {"block_h": 4}, {"unroll": 3}, {"chunk": True}):
    with pytest.raises(ValueError, match=next(iter(bad))):
      osdn.Config(**bad)
  spec = Spec("osdn_d_pass", "tpu", "float32", key_dim=128)
  ok = lambda **kw: osdn.supports(dataclasses.replace(spec, **kw))
  assert ok() and ok(packed=True) and ok(key_dim=256) and ok(key_dim=37)
  assert not ok(platform="cpu") and not ok(platform="gpu") and not ok(dtype="bfloat16")
  assert not ok(key_dim=512) and not ok(static_params=False)


# ---------------------------------------------------------------------------------------------------------
# Ahead-of-time compilation by libtpu (Mosaic: block layouts, SMEM and VMEM use, the restart copies).
# ---------------------------------------------------------------------------------------------------------
BENCH = {"B4-T4096-H16-K128": (4, 4096, 16, 128), "B1-T32768-H8-K128": (1, 32768, 8, 128)}
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (the tpu-aot extra)")


def _lower(topology, shapes, fn, grad: bool):
  from jax.sharding import SingleDeviceSharding

  from osdn_jax.train import aot
  device = aot.topology_devices(topology)[0]
  sds = [jax.ShapeDtypeStruct(s, dt, sharding=SingleDeviceSharding(device)) for s, dt in shapes]
  f = jax.value_and_grad(fn, argnums=tuple(i for i, (_, dt) in enumerate(shapes) if dt == F32)) if grad else fn
  with jax.default_device(device):    # Pallas' lowering asks the default device for the chip
    return jax.jit(f).lower(*sds).compile(), device


_FORMS = {"tokens": osdn.Config(), "blocks16": osdn.Config(form="blocks", block_t=16),
          "blocks32": osdn.Config(form="blocks", block_t=32)}
# `make test`: the 16-token block form on v6e at the first shape (the token form on a v5e chip:
# test_odd_and_packed_shapes_compile_for_tpu); the slow step: every form on every chip at both shapes.
_QUICK = {("blocks16", "v6e:1x1")}


@needs_libtpu
@pytest.mark.parametrize("shape", [pytest.param(BENCH["B4-T4096-H16-K128"], id="B4-T4096-H16-K128"),
                                   pytest.param(BENCH["B1-T32768-H8-K128"], id="B1-T32768-H8-K128",
                                                marks=pytest.mark.slow)])
@pytest.mark.parametrize("config,topology", [
    pytest.param(config, topology, id=f"{form}-{topology}",
                 marks=[] if (form, topology) in _QUICK else [pytest.mark.slow])
    for form, config in _FORMS.items() for topology in ("v5e:1x1", "v5p:1x1x1", "v6e:1x1")])
def test_compiles_for_tpu(config, topology, shape, record_property, capsys):
  """The forward alone and `value_and_grad` (forward and backward kernel) with an APF retention, anchor "init" and
  the default clip [0, 8], compiled for one chip, in the token form and the block form (L = 16, 32). The gradient
  program's temporaries are the saved ds and μ (fp32) and little else."""
  from osdn_jax.train import aot
  B, T, H, K = shape

  def d_pass(u, n, beta, r, d1, d0):
    return osdn.d_pass(u, n, beta, r, d1, d0, eta=1.0, d_min=0.0, d_max=8.0, apf_anchor="init", interpret=False,
                       config=config)
  shapes = [((B, T, H, K), F32), ((B, T, H), F32), ((B, T, H), F32), ((B, T, H), F32), ((B, H, K), F32),
            ((H, K), F32)]
  forward, _ = _lower(topology, shapes, d_pass, grad=False)
  assert forward.as_text().count('custom_call_target="tpu_custom_call"') == 1
  compiled, device = _lower(topology, shapes, lambda *xs: sum(jnp.sum(x) for x in d_pass(*xs)), grad=True)
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 2
  memory = aot.memory_report(compiled, aot.CHIPS[topology.split(":")[0]].hbm_gib)
  record_property("memory", json.dumps(memory))
  with capsys.disabled():
    print(f"\n{topology} ({device.device_kind}) {config.form} L={config.block_t} B,T,H,K={shape}: {memory}")
  state = B * T * H * K * 4
  assert memory["temp_bytes"] <= 2.6 * state and memory["fits"], memory


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:1x1", pytest.param("v6e:1x1", marks=pytest.mark.slow)])
def test_odd_and_packed_shapes_compile_for_tpu(topology):
  """`value_and_grad` compiles for blocks that are not whole (8, 128) tiles: K = 37 and G = 3 as full dims with a
  partial last chunk (T = 300) and packed rows (SMEM codes, restart copies from HBM); G = 12 with K = 64 and
  T = 37 (one chunk of 40) without a retention; T = 1 with K = 256; and packed at the benchmark shape."""
  def d_pass(packed, mode, xs):
    u, n, beta, r, d1, d0, ids = xs
    return osdn.d_pass(u, n, beta, None if mode == "none" else r, d1, d0, eta=1.0, d_min=0.0, d_max=8.0,
                       apf_anchor="zero" if mode == "none" else mode, segment_ids=ids if packed else None,
                       interpret=False)
  calls = [((2, 300, 3, 37), 5, True, "init"), ((2, 37, 12, 64), 2, False, "none"), ((1, 1, 16, 256), 1, False, "zero"),
           ((4, 4096, 16, 128), 9, True, "zero")]
  shapes, parts = [], []
  for (B, T, G, K), count, packed, mode in calls:
    part = [((B, T, G, K), F32), ((B, T, G), F32), ((B, T, G), F32), ((B, T, G), F32), ((count, G, K), F32),
            ((G, K), F32), ((B, T), jnp.int32)]
    parts.append((len(shapes), packed, mode))
    shapes += part

  def loss(*xs):
    return sum(sum(jnp.sum(y) for y in d_pass(packed, mode, xs[i:i + 7])) for i, packed, mode in parts)
  compiled, _ = _lower(topology, shapes, loss, grad=True)
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 2 * len(calls)
