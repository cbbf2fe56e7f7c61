"""The block form of OSDN's d-pass TPU kernel (`osdn.Config(form="blocks")`, `pallas_kernels/tpu/osdn/blocks.py`)
without a TPU.

The block math on its own (plain JAX, no kernel): the [N, N] unit triangular inverse of interleaved heads against
numpy, one block of the forward and of the adjoint against the token recurrence in fp64. Then the kernels in TPU
interpret mode (two simulated TensorCores, the race detector on) against the token form and
`precond.osdn_d_pass` ("xla" in fp32, the token-serial reference in fp64): ds, d_{T+1} and the gradients w.r.t.
u, n, β, r, d1 and d_init; where the token loop runs a block instead (`kernel._fallback`, marked here to write NaN
rows) and where it does not; a NaN input; the config's checks; and ahead-of-time compilation by libtpu's Mosaic
compiler of shapes that are not whole tiles. The benchmark shapes' compilation, with the compiled program's memory,
is `test_osdn.py::test_compiles_for_tpu`, in both forms.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osdn_jax.dgps import precond
from osdn_jax.testing import rel_rms, values_and_grads
from pallas_kernels.tpu import osdn
from pallas_kernels.tpu.osdn import blocks, kernel
from pallas_kernels.tpu.osdn.config import static
from tests.kernels.tpu.test_osdn import INTERPRET, TOL, _clipped_fraction, _inputs, _lower, needs_libtpu

F32, F64 = jnp.float32, jnp.float64


@pytest.fixture
def seed():
  return int(np.random.default_rng().integers(2**31))


# ---------------------------------------------------------------------------------------------------------
# The block math in plain JAX.
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hg, L", [(8, 16), (3, 32), (8, 2)])
@pytest.mark.parametrize("upper", [False, True], ids=["lower", "upper"])
def test_unit_inverse_of_interleaved_heads(hg, L, upper, seed):
  """(I + a)⁻¹ of a strictly lower (upper) table in token order with zeros between heads, against numpy."""
  geo = blocks.geometry(hg, L)
  rng = np.random.default_rng(seed)
  a = np.where(np.asarray(geo.upper if upper else geo.lower), rng.normal(size=(hg * L,) * 2) / 4, 0.0)
  got = np.asarray(blocks.unit_inverse(jnp.asarray(a, F32), geo, upper=upper), np.float64)
  want = np.linalg.inv(np.eye(hg * L) + a)
  assert np.max(np.abs(got - want)) < 1e-5 * max(1.0, np.max(np.abs(want))), seed
  assert not np.any(got[~np.asarray(geo.same)]), seed          # no entry between heads


def _block_problem(seed, hg, L, K, mode):
  """One block's rows [N, K], columns [N, 1] (row t·hg + h), its entering d [hg, K] and o [hg, K], fp64 numpy."""
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(L, hg, K)) ** 3
  u = k * k / np.sum(k * k, axis=-1, keepdims=True)
  beta = 1 / (1 + np.exp(-rng.normal(size=(L, hg)) - 0.5))
  a, c = 0.8 * beta, 0.8 * beta * beta                  # n = 1: unit keys
  r = None if mode == "none" else 1 / (1 + np.exp(-rng.normal(size=(L, hg)) - 2))
  d = 0.5 + rng.random(size=(hg, K))
  o = 0.8 + 0.4 * rng.random(size=(hg, K))
  return u, a, c, r, d, o


def _flat(x):
  return None if x is None else jnp.asarray(x.reshape((-1,) + x.shape[2:] if x.ndim == 3 else (-1, 1)), F32)


@pytest.mark.parametrize("hg, L, K, mode", [(8, 16, 20, "init"), (3, 32, 16, "zero"), (8, 16, 37, "none")])
def test_blocks_match_the_token_recurrence(hg, L, K, mode, seed):
  """`forward_block` (rows d_t and d_L) and `backward_block` (rows μ_t = λ_{t+1} and λ_0) against the token
  recurrence and its adjoint in fp64, no bound acting."""
  u, a, c, r, d, o = _block_problem(seed, hg, L, K, mode)
  st = static(L, hg, K, eta=0.8, d_min=None, d_max=None, mode=mode, segments=0, config=osdn.Config(), interpret=False)
  anchor = o if mode == "init" else None
  rows, d_next, bad = blocks.forward_block(st, _flat(u), _flat(a), _flat(c), _flat(r),
                                           None if anchor is None else jnp.asarray(anchor, F32), jnp.asarray(d, F32))
  want, x = [], d
  for t in range(L):
    want.append(x)
    coef = (a[t] - c[t] * np.sum(x * u[t], -1))[:, None]
    keep = x if r is None else (r[t][:, None] * x if mode == "zero" else o + r[t][:, None] * (x - o))
    x = keep + coef * u[t]
  assert float(bad[0, 0]) == 0.0
  assert rel_rms(rows, np.stack(want).reshape(-1, K)) < 2e-6 and rel_rms(d_next, x) < 2e-6, seed
  rng = np.random.default_rng(seed + 1)
  g, lam = rng.normal(size=(L, hg, K)), rng.normal(size=(hg, K))
  mu, lam0, bad = blocks.backward_block(st, _flat(u), _flat(np.stack(want)), _flat(g), _flat(a), _flat(c), _flat(r),
                                        None if anchor is None else jnp.asarray(anchor, F32), jnp.asarray(lam, F32))
  want_mu, y = [None] * L, lam
  for t in reversed(range(L)):
    want_mu[t] = y
    cp = (c[t] * np.sum(y * u[t], -1))[:, None]
    y = g[t] + (y if r is None else r[t][:, None] * y) - cp * u[t]
  assert float(bad[0, 0]) == 0.0
  assert rel_rms(mu, np.stack(want_mu).reshape(-1, K)) < 2e-6 and rel_rms(lam0, y) < 2e-6, seed


def _tie_problem(seed, hg, L, K, bound):
  """A block (r ≡ 1) whose channel 0 has u = 0 and d = bound: d̄ stays exactly on the bound there, every token."""
  u, a, c, _, d, _ = _block_problem(seed, hg, L, K, "none")
  u[..., 0] = 0.0
  d[:, 0] = bound
  rows = [d]
  for t in range(L - 1):
    rows.append(rows[-1] + (a[t] - c[t] * np.sum(rows[-1] * u[t], -1))[:, None] * u[t])
  return u, a, c, d, np.stack(rows)


def test_block_check_takes_ties_and_faults(seed):
  """`forward_block` and `backward_block` report a block as bad where a d̄ sits exactly on a bound (jnp.clip's
  derivative there is ½) but not where the bound is one fp32 step above it, and where u, a, c, r, ∂L/∂ds or the
  entering d holds a NaN or an inf."""
  hg, L, K, bound = 8, 16, 16, 4.0
  u, a, c, d, rows = _tie_problem(seed, hg, L, K, bound)
  rng = np.random.default_rng(seed)
  g, lam = _flat(rng.normal(size=(L, hg, K))), jnp.asarray(rng.normal(size=(hg, K)), F32)

  def bad(hi, u=u, a=a, c=c, r=None, d=d, g=g, mode="none"):
    st = static(L, hg, K, eta=0.8, d_min=0.0, d_max=hi, mode=mode, segments=0, config=osdn.Config(), interpret=False)
    fwd = blocks.forward_block(st, _flat(u), _flat(a), _flat(c), _flat(r), None, jnp.asarray(d, F32))[2]
    bwd = blocks.backward_block(st, _flat(u), _flat(rows), g, _flat(a), _flat(c), _flat(r), None, lam)[2]
    return float(fwd[0, 0]), float(bwd[0, 0])
  assert bad(bound) == (1.0, 1.0), seed
  assert bad(float(np.nextafter(np.float32(bound), np.float32(np.inf)))) == (0.0, 0.0), seed
  assert bad(None) == (0.0, 0.0), seed
  hi = 2 * bound
  poke = lambda x, index, value: np.where(np.arange(x.size).reshape(x.shape) == index, value, x)
  for value in (np.nan, np.inf):
    for name, x in (("u", u), ("a", a), ("c", c), ("r", np.ones_like(a))):
      kw = {name: poke(x, 37, value)} if name != "r" else dict(r=poke(x, 37, value), mode="zero")
      assert bad(hi, **kw)[0] == 1.0, (seed, name, value)
    assert bad(hi, d=poke(d, 5, value))[0] == 1.0, (seed, "d", value)
    assert bad(hi, g=_flat(poke(np.asarray(g).reshape(L, hg, K), 99, value)))[1] == 1.0, (seed, "g", value)


# ---------------------------------------------------------------------------------------------------------
# The kernels in TPU interpret mode.
# ---------------------------------------------------------------------------------------------------------
# (B, T, G, K, learned r, anchor, η, d_min, d_max, L, block_h, unroll): odd T (one token; 37: two blocks and 5 tokens;
# 100: one chunk of 104; 150 and 300: partial last chunks and blocks), K not a multiple of 128, G = 16 (two head
# blocks, or two head groups of one block with block_h = 16), G = 3 and 12 (one head group of all G), r ≡ 1 and both
# anchors, both bounds (most blocks run token by token), the upper bound only, no bound (every whole block solved at
# once). A small unroll (the token loop's) where the case clips nowhere keeps the interpreter's tracing short.
CASES = {
    "T37-K16-G8-apf_zero-noclip": (2, 37, 8, 16, True, "zero", 0.8, None, None, 16, 8, 2),
    "T100-K20-G16-apf_init-clip": (1, 100, 16, 20, True, "init", 12.0, 0.2, 1.6, 16, 8, 8),
    "T150-K37-G8-r1-noclip-L32": (1, 150, 8, 37, False, "zero", 0.8, None, None, 32, 8, 2),
    "T1-K24-G8-r1-noclip": (2, 1, 8, 24, False, "init", 0.8, None, None, 16, 8, 8),
    "T300-K128-G16-apf_init-noclip-Hb16": (1, 300, 16, 128, True, "init", 0.8, None, None, 32, 16, 8),
    "T300-K20-G8-apf_init-upper": (1, 300, 8, 20, True, "init", 12.0, None, 1.4, 16, 8, 8),
    "T300-K128-G16-r1-clip": (1, 300, 16, 128, False, "zero", 16.0, 0.0, 1.5, 32, 8, 8),
    "T200-K20-G3-apf_init-noclip": (2, 200, 3, 20, True, "init", 0.8, None, None, 16, 8, 8),
    "T37-K16-G12-r1-clip": (1, 37, 12, 16, False, "zero", 8.0, 0.0, 2.0, 32, 8, 8),
}
SLOW = (tuple(CASES)[0],) + tuple(CASES)[3:]


def _fn(names, impl, kw, config=None, dtype=F32):
  """The d-pass of the arrays named `names` (a subset of u, n, beta, r, d1, d0) by impl "kernel" (`config`) or a
  `precond.osdn_d_pass` implementation, in dtype."""
  def fn(*xs):
    x = dict(zip(names, (v.astype(dtype) for v in xs)))
    args = (x["u"], x["n"], x["beta"], x.get("r"), x["d1"], x["d0"])
    if impl == "kernel":
      return osdn.d_pass(*args, interpret=INTERPRET, config=config, **kw)
    return precond.osdn_d_pass(*args, implementation=impl, **kw)
  return fn


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW else []) for c in CASES])
def test_interpret_parity(case, seed, races):
  """Every output and gradient of the block form within 4e-6 relative RMS of the token form and of the fp32 XLA
  implementation, and within 2e-6 of the fp64 reference, or, where the case clips, within twice the distance of an
  fp32 implementation from fp64 (exact ties with a bound make the clipped gradients jump: test_osdn.py's `_run`)."""
  B, T, G, K, learned_r, anchor, eta, lo, hi, L, hb, unroll = CASES[case]
  a = _inputs(seed, B, T, G, K)
  names = ["u", "n", "beta"] + (["r"] if learned_r else []) + ["d1", "d0"]
  kw = dict(eta=eta, d_min=lo, d_max=hi, apf_anchor=anchor)
  args = [a[n] for n in names]
  config = lambda form: osdn.Config(form=form, block_t=L, block_h=hb, unroll=unroll)
  got = values_and_grads(_fn(names, "kernel", kw, config("blocks")), args, seed)
  tokens = values_and_grads(_fn(names, "kernel", kw, config("tokens")), args, seed)
  want32 = values_and_grads(_fn(names, "xla", kw), args, seed)
  want64 = values_and_grads(_fn(names, "reference", kw, dtype=F64), args, seed)
  labels = ["ds", "d_last"] + ["d" + n for n in names]
  assert [g.dtype for g in got] == [F32] * len(labels), [g.dtype for g in got]
  for label, x, y, y32, y64 in zip(labels, got, tokens, want32, want64):
    if label == "dd0" and not learned_r:
      assert not np.any(np.asarray(x)), seed
      continue
    assert x.shape == y64.shape and np.all(np.isfinite(np.asarray(x))), (seed, label)
    own = max(rel_rms(y, y64), rel_rms(y32, y64))          # the fp32 forms' own distance from fp64
    errors = rel_rms(x, y), rel_rms(x, y32), rel_rms(x, y64)
    assert errors[0] < max(2 * TOL, 2 * own) and errors[1] < max(2 * TOL, 2 * own), (seed, label, errors, own)
    assert errors[2] < max(TOL, 2 * own), (seed, label, errors, own)
  if lo is not None or hi is not None:
    fraction = _clipped_fraction(a, want64[0], eta=eta, lo=lo, hi=hi, apf_anchor=anchor, learned_r=learned_r)
    assert fraction > 0.02, (seed, fraction)


def _marked(passes):
  """`kernel._fallback` that also writes NaN over the block's rows in the passes named (False: the forward's ds,
  True: the backward's μ) while carrying the token loop's d (λ) on, so the blocks that ran token by token show as
  NaN rows."""
  real = kernel._fallback

  def fallback(st, body, carry, t0, back):
    def marked(t, x):
      out = body(t, x)
      if back in passes:
        body(t, jnp.full_like(x, jnp.nan))        # writes row t again, with NaN; its result is dropped
      return out
    return real(st, marked, carry, t0, back)
  return fallback


def _d_bar(a, ds, eta):
  """d̄_{t+1} [T, G, K] of row 0 (anchor "init") from the d_t each token writes with, fp64."""
  u, n, b, r, o = (np.asarray(a[x], np.float64)[0] for x in ("u", "n", "beta", "r", "d0"))
  d = np.asarray(ds, np.float64)[0]
  return o + r[..., None] * (d - o) + (eta * b * (1 - b * np.sum(d * u, -1)) / n)[..., None] * u


def _block_max(d_bar, L):
  """The largest d̄ of every block of L whole tokens."""
  return np.max(d_bar[:d_bar.shape[0] // L * L].reshape(d_bar.shape[0] // L, -1), axis=1)


@pytest.mark.slow     # `make test`: the clipped parity case, whose blocks fall back where the clip acts
def test_fallback_only_where_the_clip_acts(monkeypatch, seed, races):
  """With d_max between the two largest block maxima of the unclipped d̄, the clip acts in a few blocks: the block
  form's ds and d_{T+1} equal the token form's; with the fallback marked, the blocks where some d̄ reaches d_max
  (ties included) come out as NaN rows and those where every d̄ is below it by over 1e-4 do not (between, rounding
  may decide), in the forward's ds and in the backward's μ (so ∂u); without a bound no block does."""
  B, T, G, K, L = 1, 160, 8, 16, 16
  a = _inputs(seed, B, T, G, K)
  names = ["u", "n", "beta", "r", "d1", "d0"]
  args = [a[n] for n in names]
  kw = dict(eta=0.8, d_min=None, apf_anchor="init")
  fn = lambda form, hi: _fn(names, "kernel", dict(kw, d_max=hi), osdn.Config(form=form, unroll=2))
  top = np.sort(_block_max(_d_bar(a, fn("tokens", None)(*args)[0], 0.8), L))
  d_max = float(np.float32((top[-1] + top[-2]) / 2))
  tokens = fn("tokens", d_max)(*args)
  top = _block_max(_d_bar(a, tokens[0], 0.8), L)
  classes = np.where(top >= d_max, 1, np.where(top < d_max - 1e-4, -1, 0))
  assert np.any(classes == 1) and np.any(classes == -1), (seed, classes)
  never = -np.ones_like(classes)
  # (which passes write NaN rows, the bound, the rows looked at: ds (forward) or ∂u (backward), the marked blocks)
  for passes, hi, looked, want in (((False,), d_max, ((0, False),), classes), ((True,), d_max, ((2, True),), classes),
                                   ((False, True), None, ((0, False), (2, True)), never)):
    monkeypatch.setattr(kernel, "_fallback", _marked(passes))
    jax.clear_caches()                       # the jitted d-pass was traced with the real fallback
    outs = values_and_grads(fn("blocks", hi), args, seed) if True in passes else fn("blocks", hi)(*args)
    monkeypatch.undo()
    if passes == (True,):                    # the forward ran its blocks as they are
      assert rel_rms(outs[0], tokens[0]) < 2 * TOL and rel_rms(outs[1], tokens[1]) < 2 * TOL, seed
    for index, reverse in looked:
      nan_rows = np.isnan(np.asarray(outs[index])[0]).any(axis=(1, 2))
      marked = nan_rows[:T // L * L].reshape(-1, L)
      assert not np.any(nan_rows[T // L * L:]), (seed, reverse)               # the tail runs token by token anyway
      assert np.all(marked[want == 1]) and not np.any(marked[want == -1]), (seed, reverse, hi, want)
      assert np.all(marked.all(1) | ~marked.any(1)), (seed, reverse)          # whole blocks
  jax.clear_caches()


def test_ties_with_a_bound_run_token_by_token(seed, races):
  """r ≡ 1, channel 0 of u zero and of d1 exactly on d_max: d̄ stays on the bound there at every token (jnp.clip's
  derivative ½) while the other channels stay inside. The block form's outputs and gradients equal the token
  form's (a block solve would take the derivative as 1 and lose ∂d1's halving per token)."""
  B, T, G, K = 1, 40, 8, 16
  a = _inputs(seed, B, T, G, K)
  u = a["u"].at[..., 0].set(0.0)
  d1 = a["d1"].at[..., 0].set(4.0)
  args = [u, jnp.sum(u, -1), a["beta"], d1, a["d0"]]
  kw = dict(eta=0.8, d_min=None, d_max=4.0, apf_anchor="zero")
  fn = lambda form: lambda u, n, beta, d1, d0: osdn.d_pass(u, n, beta, None, d1, d0, interpret=INTERPRET,
                                                           config=osdn.Config(form=form, unroll=2), **kw)
  got, want = (values_and_grads(fn(form), args, seed) for form in ("blocks", "tokens"))
  assert np.all(np.asarray(want[0])[..., 0] == 4.0) and np.all(np.asarray(want[0])[..., 1:] < 3.9), seed
  for x, y in zip(got, want):
    assert rel_rms(x, y) < TOL, seed


def test_nan_input_stays_where_the_token_form_puts_it(seed, races):
  """A NaN in u at t = 37 (inside the third block of 16) of one head, unbounded: every row before it equals the
  clean run's, d of that head is NaN from t + 1 on as in the token form, and every other head is finite and equals
  the token form's."""
  B, T, G, K = 1, 80, 16, 20
  a = _inputs(seed, B, T, G, K)
  kw = dict(eta=0.8, d_min=None, d_max=None, apf_anchor="init")
  run = lambda u, form: osdn.d_pass(u, a["n"], a["beta"], a["r"], a["d1"], a["d0"], interpret=INTERPRET,
                                    config=osdn.Config(form=form), **kw)
  bad_u = a["u"].at[0, 37, 3, 5].set(jnp.nan)
  clean, faulty, tokens = run(a["u"], "blocks"), run(bad_u, "blocks"), run(bad_u, "tokens")
  ds, want = np.asarray(faulty[0]), np.asarray(tokens[0])
  np.testing.assert_array_equal(np.isnan(ds), np.isnan(want))
  np.testing.assert_array_equal(np.isnan(faulty[1]), np.isnan(tokens[1]))
  assert np.all(np.isnan(ds[0, 38:, 3])) and np.isfinite(np.delete(ds, 3, axis=2)).all(), seed
  assert np.isfinite(ds[0, :38]).all(), seed
  np.testing.assert_array_equal(ds[0, :32], np.asarray(clean[0])[0, :32])    # the blocks before the fault's
  np.testing.assert_allclose(ds[0, :38], np.asarray(clean[0])[0, :38], rtol=1e-6, atol=1e-6)
  finite = np.isfinite(want)
  np.testing.assert_allclose(ds[finite], want[finite], rtol=1e-5, atol=1e-6)


def test_config_and_packed():
  """`form` and `block_t` are checked like the other fields; packed sequences run the token form."""
  for bad in ({"form": "block"}, {"form": None}, {"block_t": 8}, {"block_t": 64}, {"block_t": True}):
    with pytest.raises(ValueError, match=next(iter(bad))):
      osdn.Config(**bad)
  assert osdn.Config().form == "tokens" and osdn.Config().block_t == 16
  config = osdn.Config(form="blocks", block_t=32)
  make = lambda segments: static(300, 16, 128, eta=1.0, d_min=0.0, d_max=8.0, mode="init", segments=segments,
                                 config=config, interpret=False)
  assert make(0).form == "blocks" and make(0).block_t == 32 and make(4).form == "tokens"


# ---------------------------------------------------------------------------------------------------------
# Ahead-of-time compilation by libtpu.
# ---------------------------------------------------------------------------------------------------------
@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("topology", ["v5e:1x1", "v6e:1x1"])
def test_odd_shapes_compile_for_tpu(topology):
  """`value_and_grad` of the block form for head groups that are not whole 8-row tiles and blocks that are not
  whole (8, 128) tiles: G = 3 with K = 37 and T = 300 (r ≡ 1, L = 16), G = 12 with K = 64 and T = 37 (L = 32),
  block_h = 16 (two head groups per program) with K = 20, and T = 1 with K = 256 (no whole block)."""
  calls = [((2, 300, 3, 37), "none", 16, 8), ((2, 37, 12, 64), "init", 32, 8), ((1, 150, 16, 20), "zero", 16, 16),
           ((1, 1, 16, 256), "zero", 16, 8)]
  shapes, parts = [], []
  for (B, T, G, K), mode, L, hb in calls:
    parts.append((len(shapes), mode, osdn.Config(form="blocks", block_t=L, block_h=hb)))
    shapes += [((B, T, G, K), F32), ((B, T, G), F32), ((B, T, G), F32), ((B, T, G), F32), ((B, G, K), F32),
               ((G, K), F32)]

  def loss(*xs):
    total = 0.0
    for i, mode, config in parts:
      u, n, beta, r, d1, d0 = xs[i:i + 6]
      outs = osdn.d_pass(u, n, beta, None if mode == "none" else r, d1, d0, eta=1.0, d_min=0.0, d_max=8.0,
                         apf_anchor="zero" if mode == "none" else mode, interpret=False, config=config)
      total = total + sum(jnp.sum(y) for y in outs)
    return total
  compiled, _ = _lower(topology, shapes, loss, grad=True)
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 2 * len(calls)
