"""OSDN's d-pass as a Pallas GPU kernel (`pallas_kernels.gpu.osdn`) in interpret mode on CPU: d_t for every
token, d_{T+1} and the gradients of a random projection of both w.r.t. u, n, β, r, d_1 and d_init against the
token-serial `lax.scan` (`precond.osdn_d_pass(implementation="reference")`, the kernel's contract) in fp32;
end to end through `osdn_write_key(implementation="pallas")`; dispatch; and lowering to Triton IR for CUDA.

Interpret mode is slow: small shapes (B = 2, T ≈ 70, G ≤ 4, K ≤ 24), each case combining several features.
"""
import contextlib
import dataclasses
import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import pallas_kernels
from osdn_jax.dgps import precond
from osdn_jax.testing import random_d_pass_inputs, rel_rms, values_and_grads
from pallas_kernels.gpu import osdn
from pallas_kernels.gpu.osdn import blocks as osdn_blocks
from pallas_kernels.gpu.osdn import forward as osdn_forward
from pallas_kernels.gpu.osdn import tables as osdn_tables
from pallas_kernels.gpu.osdn.layout import Static
from pallas_kernels.spec import Spec

TOL = 1e-6           # fp32 relative RMS, kernel against the scan
F32 = jnp.float32


@pytest.fixture(autouse=True)
def _poison():
  """Poisoned output buffers: a token row the kernels never write shows as NaN."""
  poison = getattr(pl, "enable_poison_buffers", None)
  with (poison(True) if poison is not None else contextlib.nullcontext()):
    yield


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


_inputs = random_d_pass_inputs


def _pre_clip(a, ds, *, eta, apf_anchor, learned_r):
  """d̄_{t+1} for every token from the d_t each token writes with (numpy, fp64)."""
  u, n, b, r, d0 = (np.asarray(a[x], np.float64) for x in ("u", "n", "beta", "r", "d0"))
  d = np.asarray(ds, np.float64)
  s = np.sum(d * u, -1)
  step = (eta * b * (1 - b * s) / n)[..., None] * u
  if not learned_r:
    return d + step
  return (r[..., None] * d if apf_anchor == "zero" else d0 + r[..., None] * (d - d0)) + step


def _both(a, *, learned_r, config=None, **kw):
  """(kernel, scan): each (outputs, gradients of a random projection w.r.t. u, n, β, [r,] d1, d0)."""
  names = ("u", "n", "beta", "r", "d1", "d0") if learned_r else ("u", "n", "beta", "d1", "d0")

  def run(impl):
    def fn(*xs):
      x = dict(zip(names, xs))
      args = (x["u"], x["n"], x["beta"], x.get("r"), x["d1"], x["d0"])
      if impl == "kernel":
        return osdn.d_pass(*args, config=config, **kw)
      return precond.osdn_d_pass(*args, implementation="reference", **kw)
    return fn

  return _values_and_grads(run, [a[n] for n in names], ("kernel", "scan")) + (names,)


def _values_and_grads(run, xs, impls, seed=0):
  """Per impl: (run(impl)(*xs), its gradients w.r.t. every x) under the same random cotangents
  (`osdn_jax.testing.values_and_grads`)."""
  n_out = len(jax.eval_shape(run(impls[-1]), *xs))
  return tuple((r[:n_out], r[n_out:]) for r in (values_and_grads(run(impl), xs, seed) for impl in impls))


def _assert_close(got, want, names, outputs=("ds", "d_last"), tol=TOL):
  """rel_rms(got, want) < tol for the outputs and every gradient; returns the errors by name."""
  errors = {}
  for label, g, w in zip(outputs + tuple("d" + n for n in names), got[0] + got[1], want[0] + want[1]):
    assert g.shape == w.shape and np.all(np.isfinite(np.asarray(g))), label
    errors[label] = rel_rms(g, w)
  assert all(e < tol for e in errors.values()), errors
  return errors


# (seed, anchor, learned r, η, d_min, d_max): the clip active on both bounds (r ≡ 1; APF toward 0; APF toward
# d_init), on the upper bound only (APF toward d_init), and no clip (r ≡ 1 toward d_init: d_init unused; APF
# toward d_init).
CASES = {"r1-clip": (1, "zero", False, 8.0, 0.0, 2.0),
         "apf-zero-clip": (2, "zero", True, 12.0, 0.0, 1.5),
         "apf-init-clip": (3, "init", True, 12.0, 0.2, 1.6),
         "apf-init-upper-only": (4, "init", True, 12.0, None, 1.4),
         "r1-init-noclip": (5, "init", False, 0.8, None, None),
         "apf-init-noclip": (6, "init", True, 0.8, None, None)}


# `make test`: the upper bound alone (APF toward d_init) and no clip (r ≡ 1). Both bounds run in the gate through
# tests/kernels/test_conformance_precond.py (this kernel on "apf_init-clip" and "r1-packed-clip"),
# test_keys_read_by_the_kernels["r1-f32"], test_chain_and_restart["zero"] and test_extreme_gates[True-xla]
# (APF toward 0); the slow step runs every case.
SLOW_CASES = ("r1-clip", "apf-zero-clip", "apf-init-clip", "apf-init-noclip")


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW_CASES else []) for c in CASES])
def test_matches_scan(case):
  """d_t for every token, d_{T+1} and the gradients w.r.t. every input against the token-serial scan; where the
  case clips, the clip is active on a good fraction of the entries (on each bound it has); gradients reach β."""
  seed, anchor, learned_r, eta, lo, hi = CASES[case]
  a = _inputs(seed)
  got, want, names = _both(a, learned_r=learned_r, eta=eta, d_min=lo, d_max=hi, apf_anchor=anchor)
  errors = _assert_close(got, want, names)
  if lo is not None or hi is not None:   # the clip is active on a good fraction of the entries
    d_bar = _pre_clip(a, want[0][0], eta=eta, apf_anchor=anchor, learned_r=learned_r)
    below = np.mean(d_bar < (-np.inf if lo is None else lo))
    above = np.mean(d_bar > (np.inf if hi is None else hi))
    assert below + above > 0.05 and (lo is None or below > 0) and (hi is None or above > 0), (below, above)
  assert float(jnp.max(jnp.abs(got[1][names.index("beta")]))) > 0      # gradients reach β
  print(case, errors)


@pytest.mark.parametrize("T,K,config", [
    (64, 16, osdn.Config(block_t=4, tables="kernel")), (5, 24, osdn.Config(block_t=8, tables="kernel")),
    pytest.param(37, 16, osdn.Config(block_t=8, solve_t_init=16, tables="kernel", share_inverse=False),
                 marks=pytest.mark.slow),
    (50, 16, osdn.Config(block_t=4, solve_t_init=16, tables="xla"))])
def test_block_boundaries(T, K, config):
  """T a multiple of the token block and of the 32-token block solve (no tail), T shorter than one block
  (tail only), 8-token blocks, 16-token block solves and a tail; the GPU defaults otherwise (block solves of
  32 tokens, the forward prefetching, the backward not). Tables from the kernel (the backward's inverse shared
  with the forward: 64; formed anew: 37) and from the reference throughout (50, 16-token block solves), which
  "auto", the GPU default, runs under differentiation."""
  a = _inputs(T, T=T, G=2, K=K)
  got, want, names = _both(a, learned_r=True, config=config, eta=4.0, d_min=0.0, d_max=2.0, apf_anchor="init")
  _assert_close(got, want, names)


def _block_inputs(seed, T=64, K=16):
  """One head with small gains (d moves slowly, inside [0, 2]) except tokens 20–27, whose keys point at
  channel 3 with a larger gain: it climbs to d_max = 2 within block 1 and stays there (the clip acts at every
  later token). The clip leaves block 0 alone and acts in blocks 1–3."""
  rng = np.random.default_rng(seed)
  k = np.abs(rng.normal(size=(1, T, 1, K))) + 0.1
  k[:, 20:28, :, 3] = 10.0
  k = _unit(k)
  beta = np.full((1, T, 1), 0.05)
  beta[:, 20:28] = 0.3
  f = lambda x: jnp.asarray(x, F32)
  u = f(k * k)
  return dict(u=u, n=jnp.sum(u, -1), beta=f(beta), r=f(np.ones((1, T, 1))), d1=f(np.ones((1, 1, K))),
              d0=f(np.ones((1, K))))


def test_block_solve_hypothesis():
  """The block solves (`_block_solve`, `_block_adjoint`, plain JAX here, with the reference tables) accept a
  block where the clip never acts, with the forward values of the token-serial scan, and reject the blocks
  where it does (the kernels then run them token by token); the kernel over all blocks matches the scan in
  values and gradients."""
  block_solve = jax.jit(osdn_blocks.block_solve, static_argnums=0)
  block_adjoint = jax.jit(osdn_blocks.block_adjoint, static_argnums=0)
  forward = jax.jit(osdn_forward.forward, static_argnums=0)
  a, L, eta, hi = _block_inputs(0), 16, 1.0, 2.0
  st = Static(batch=1, length=64, heads=1, key_dim=16, eta=eta, d_min=0.0, d_max=hi, mode="none",
                   config=osdn.INTERPRET, interpret=True)
  ds, _ = precond.osdn_d_pass(a["u"], a["n"], a["beta"], None, a["d1"], a["d0"], eta=eta, d_min=0.0, d_max=hi,
                              apf_anchor="zero", implementation="reference")
  tf, wf, tb, inv_b, gamma = osdn_tables.reference(st, a["u"], a["n"], a["beta"], None, None)
  g = jnp.asarray(np.random.default_rng(1).normal(size=ds.shape), F32)
  wb = osdn_tables.adjoint_rhs_reference(st, a["u"], g, inv_b, gamma)
  fwd_ok, smooth_ok, bwd_ok = [], [], []
  for i in range(4):
    sl = slice(i * L, (i + 1) * L)
    u, b, n = a["u"][0, sl, 0], a["beta"][0, sl, 0], a["n"][0, sl, 0]
    D, d_next, ok, smooth = block_solve(st, u, b, n, None, None, ds[0, i * L, 0], tf[0, i, 0], wf[0, i, 0], None)
    fwd_ok.append(bool(ok))
    smooth_ok.append(bool(smooth))
    if ok:
      np.testing.assert_allclose(D, ds[0, sl, 0], rtol=2e-6, atol=2e-6)
      np.testing.assert_allclose(d_next, ds[0, (i + 1) * L, 0], rtol=2e-6, atol=2e-6)
    bwd_ok.append(bool(block_adjoint(st, u, ds[0, sl, 0], g[0, sl, 0], b, n, None, None, g[0, 0, 0],
                                     tb[0, i, 0], wb[0, i, 0], None)[-1]))
  assert fwd_ok == smooth_ok == bwd_ok == [True, False, False, False], (fwd_ok, smooth_ok, bwd_ok)
  # The forward kernel stores that flag per block for the split backward (which runs flagged blocks as a λ
  # chain): 1 for block 0 only here; 1 everywhere when the bounds are never reached.
  for lo_hi, want_flags in (((0.0, hi), [1, 0, 0, 0]), ((-100.0, 100.0), [1, 1, 1, 1])):
    st_k = dataclasses.replace(st, d_min=lo_hi[0], d_max=lo_hi[1])
    assert st_k.blocked
    flags = forward(st_k, a["u"], a["n"], a["beta"], None, None, a["d1"], None)[1][2]
    assert np.asarray(flags)[0, :, 0].tolist() == want_flags, flags
  assert np.sum(np.asarray(ds[0, 32, 0]) == hi) == 1
  got, want, names = _both(a, learned_r=False, eta=eta, d_min=0.0, d_max=hi, apf_anchor="zero")
  _assert_close(got, want, names)
  # Padded channels (K = 12 → 16: u = 0, d = 0 = d_min, so d̄ = 0 at the bound) do not fail the checks.
  pad = lambda x: jnp.pad(x[..., :12], [(0, 0)] * (x.ndim - 1) + [(0, 4)])
  st12 = Static(batch=1, length=64, heads=1, key_dim=16, channels=12, eta=eta, d_min=0.0, d_max=hi,
                     mode="none", config=osdn.INTERPRET, interpret=True)
  u12 = pad(a["u"]) / jnp.sum(pad(a["u"]), -1, keepdims=True)
  n12 = jnp.sum(u12, -1)
  tf, wf, tb, inv_b, gamma = osdn_tables.reference(st12, u12, n12, a["beta"], None, None)
  wb = osdn_tables.adjoint_rhs_reference(st12, u12, pad(g), inv_b, gamma)
  d12 = pad(a["d1"])[0, 0]
  sl = slice(0, L)
  solve = lambda st: block_solve(st, u12[0, sl, 0], a["beta"][0, sl, 0], n12[0, sl, 0], None, None, d12,
                                 tf[0, 0, 0], wf[0, 0, 0], None)
  assert solve(st12)[2] and solve(st12)[3]            # ok and smooth (the split backward's flag)
  assert solve(dataclasses.replace(st12, channels=0))[2]             # d̄ = d_min counts as inside …
  assert not solve(dataclasses.replace(st12, channels=0))[3]         # … but not as smooth (∂clip = ½ there)
  assert block_adjoint(st12, u12[0, sl, 0], jnp.broadcast_to(d12, (L, 16)), pad(g)[0, sl, 0],
                       a["beta"][0, sl, 0], n12[0, sl, 0], None, None, d12, tb[0, 0, 0], wb[0, 0, 0], None)[-1]
  assert not block_adjoint(dataclasses.replace(st12, channels=0), u12[0, sl, 0],
                           jnp.broadcast_to(d12, (L, 16)), pad(g)[0, sl, 0], a["beta"][0, sl, 0],
                           n12[0, sl, 0], None, None, d12, tb[0, 0, 0], wb[0, 0, 0], None)[-1]


@pytest.mark.parametrize("anchor", [pytest.param("zero", marks=pytest.mark.slow), "init"])
def test_retentions_of_zero_and_one_pass_every_block(anchor):
  """APF retentions exactly 0 and 1 without the clip (every block accepted): values and gradients equal the scan.
  (`make test`: toward d_init, whose update reads both r and d_init.)"""
  a = _inputs(11, T=48, G=2, K=16)
  a["r"] = a["r"].at[:, 5::7].set(0.0).at[:, 3::7].set(1.0)
  got, want, names = _both(a, learned_r=True, eta=0.8, d_min=None, d_max=None, apf_anchor=anchor)
  _assert_close(got, want, names)


@pytest.mark.slow     # `make test`: the conformance base's clipped d-pass runs the chain and its restarts
@pytest.mark.parametrize("mode", ["none", "zero", "init"])
def test_chain_and_restart(mode):
  """The forward's chain and expansion (`forward._chained`: the d entering each block by the unclipped block
  recurrence, then every block's rows and checks in parallel), then the sequential kernel from each (batch,
  head)'s first failed block. With bounds the d-pass never reaches, every block passes, the sequential kernel
  changes nothing, and ds, d_{T+1} and the backward's flags equal the sequential kernel's from the start (and the
  scan's, in values and in gradients through the backward's chain-only kernel). With d_1 = 1 and bounds that
  head 0 reaches after its first block (β = 0 there) and head 1 (β = 0 throughout) never does, head 0 restarts
  at its first failed block from the d the chain stored for it and head 1 keeps the chain's results; both equal
  the scan. T = 53: three blocks of 16 and a tail of 5."""
  a = _inputs(31, T=53, G=2, K=16)
  learned_r = mode != "none"
  anchor = "init" if mode == "init" else "zero"
  o = a["d0"] if mode == "init" else None

  @functools.partial(jax.jit, static_argnums=(0, 1, 2))   # one program: the kernels and the XLA between them
  def run(eta, lo, hi):
    r = a["r"] if learned_r else None
    st = Static(batch=2, length=53, heads=2, key_dim=16, eta=eta, d_min=lo, d_max=hi, mode=mode,
                config=osdn.INTERPRET, interpret=True)
    tabs = osdn_tables.forward(st, a["u"], a["n"], a["beta"], r, o)
    tabs = list(tabs[:2]) + ([tabs[2]] if learned_r else [])
    args = (st, a["u"], a["n"], a["beta"], r, None, a["d1"], o)
    chained = osdn_forward._chained(st, a["u"], a["n"], a["beta"], r, a["d1"], o, tabs)
    return chained, osdn_forward._sequential(*args, tabs), osdn_forward.forward(*args)[1]

  (ds, d_last, smooth, ok, _), sequential, chosen = run(0.8, -50.0, 50.0)
  assert np.all(np.asarray(ok) == 1) and ok.shape == (2, 3, 2)
  for x, y in zip((ds, d_last), sequential[:2]):
    assert rel_rms(x, y) < TOL
  np.testing.assert_array_equal(smooth, sequential[2])
  for x, y in zip(chosen, (ds, d_last, smooth)):                  # nothing restarted
    np.testing.assert_array_equal(x, y)
  got, want, names = _both(a, learned_r=learned_r, eta=0.8, d_min=-50.0, d_max=50.0, apf_anchor=anchor)
  _assert_close(got, want, names)
  a["beta"], a["d1"] = a["beta"].at[:, :, 1].set(0.0).at[:, :16, 0].set(0.0), a["d1"].at[:].set(1.0)
  (ds, _, _, ok, _), sequential, chosen = run(8.0, 0.0, 1.5)
  first = np.asarray(osdn_forward.first_failed(ok))[..., 0]
  assert np.all((first[:, 0] >= 1) & (first[:, 0] < 3)) and np.all(first[:, 1] == 3), first
  assert rel_rms(ds[:, :, 0], sequential[0][:, :, 0]) > 1e-3       # the unclipped chain went wrong in head 0
  np.testing.assert_array_equal(chosen[0][:, :, 1], ds[:, :, 1])   # head 1: the chain's rows
  for x, y in zip(chosen, sequential):
    assert rel_rms(x, y) < TOL
  got, want, names = _both(a, learned_r=learned_r, eta=8.0, d_min=0.0, d_max=1.5, apf_anchor=anchor)
  _assert_close(got, want, names)


def _span_inputs(seed, T=151):
  """`_inputs` (B = G = 2, K = 16; d_1 per (batch, head) as a carried state), except that from token 100 on
  head 0's keys point at channel 3 with β = 0.3 (d_3 then climbs toward 1/β, past every value d reached
  before)."""
  a = _inputs(seed, T=T, G=2, K=16)
  u, beta = np.array(a["u"]), np.array(a["beta"])
  u[:, 100:, 0] = 0.02 / 15
  u[:, 100:, 0, 3] = 0.98
  beta[:, 100:, 0] = 0.3
  a["u"], a["beta"] = jnp.asarray(u), jnp.asarray(beta)
  a["n"] = jnp.sum(a["u"], -1)
  return a


# The gate runs spans through test_spanned_backward["init"] (its forward too); the slow step every mode here.
@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow) for m in ("none", "zero", "init")])
def test_spanned_chain(mode):
  """The forward's chain over spans of S blocks (`Config.spans`, `osdn.spans`): T = 151 (odd) is
  nine blocks of 16 and a tail of 7 tokens; S = 2 gives five spans, the last of one block (ragged), S = 4
  three; d_1 differs per (batch, head) (a carried state). The bounds are the extremes every (batch, head)
  reaches without the clip, except head 0 after token 100, which crosses them (`_span_inputs`): the d
  entering each block equals the whole chain's (S = 0) up to head 0's first failed block, which lies in a
  later span (block ≥ 6: after three spans' maps with S = 2), and the restart from there and head 1's
  chained rows (through the ragged span and the tail, d_{T+1}) equal the scan in values and gradients."""
  a = _span_inputs(41)
  learned_r = mode != "none"
  anchor = "init" if mode == "init" else "zero"
  r, o = (a["r"] if learned_r else None), (a["d0"] if mode == "init" else None)
  ds, _ = precond.osdn_d_pass(a["u"], a["n"], a["beta"], r, a["d1"], a["d0"], eta=0.8, d_min=None, d_max=None,
                              apf_anchor=anchor, implementation="reference")
  inside = np.concatenate([np.asarray(ds)[:, :101, 0].ravel(), np.asarray(ds)[:, :, 1].ravel()])
  lo, hi = float(inside.min()) - 1e-3, float(inside.max()) + 1e-3

  def chained(per):
    config = dataclasses.replace(osdn.INTERPRET, spans=per)
    st = Static(batch=2, length=151, heads=2, key_dim=16, eta=0.8, d_min=lo, d_max=hi, mode=mode, config=config,
                interpret=True)
    tabs = osdn_tables.forward(st, a["u"], a["n"], a["beta"], r, o)
    tabs = list(tabs[:2]) + ([tabs[2]] if learned_r else [])
    return st.chain_spans, osdn_forward._chained(st, a["u"], a["n"], a["beta"], r, a["d1"], o, tabs)

  (n0, whole), (n2, two), (n4, four) = chained(0), chained(2), chained(4)
  assert (n0, n2, n4) == (0, 5, 3)
  first = np.asarray(osdn_forward.first_failed(whole[3]))[..., 0]
  assert np.all((first[:, 0] >= 6) & (first[:, 0] < 9)) and np.all(first[:, 1] == 9), first
  for seg in (two, four):
    np.testing.assert_array_equal(osdn_forward.first_failed(seg[3]), osdn_forward.first_failed(whole[3]))
    for b in range(2):                   # the d entering each block, up to head 0's first failed block
      for g, upto in ((0, first[b, 0] + 1), (1, 9)):
        assert rel_rms(seg[4][b, :upto, g], whole[4][b, :upto, g]) < TOL
    assert rel_rms(seg[0][:, :, 1], whole[0][:, :, 1]) < TOL and rel_rms(seg[1][:, 1], whole[1][:, 1]) < TOL
  got, want, names = _both(a, learned_r=learned_r, config=dataclasses.replace(osdn.INTERPRET, spans=2), eta=0.8,
                           d_min=lo, d_max=hi, apf_anchor=anchor)
  _assert_close(got, want, names)


@pytest.mark.slow     # the span form, an option the default leaves off
@pytest.mark.parametrize("mode", ["none", "zero", "init"])
def test_spanned_backward(mode):
  """The backward's chain over spans (`Config.spans` = 2, every block flagged, so the `lax.cond` takes it):
  the spans' maps in reverse, the tail and the pass across spans, the blocks per span, then the
  parallel block gradients; T = 151 as in `test_spanned_chain` (a ragged last span, whose map the backward
  needs, and a tail), carried d_1. Values and every gradient equal the scan's."""
  a = _inputs(41, T=151, G=2, K=16)
  got, want, names = _both(a, learned_r=mode != "none", config=dataclasses.replace(osdn.INTERPRET, spans=2),
                           eta=0.8, d_min=-50.0, d_max=50.0, apf_anchor="init" if mode == "init" else "zero")
  _assert_close(got, want, names)


def test_spanned_packed_and_config():
  """`Config.spans` with packed inputs: no block solves, so the token-by-token kernel as without it (equal to
  the packed scan in values and gradients); a negative count is refused."""
  a = _inputs(5, T=37, G=2, K=16, segments=5)
  ids = jnp.asarray(np.stack([np.repeat(np.arange(3), [1, 20, 16]), np.repeat(np.arange(2), [30, 7])]), jnp.int32)
  config = dataclasses.replace(osdn.INTERPRET, spans=1)
  st = Static(batch=2, length=37, heads=2, key_dim=16, eta=4.0, d_min=0.0, d_max=2.0, mode="zero", config=config,
              interpret=True, segments=5)
  assert st.chain_spans == 0 and dataclasses.replace(st, segments=0).chain_spans == 2
  kw = dict(eta=4.0, d_min=0.0, d_max=2.0, apf_anchor="zero", segment_ids=ids)

  def run(impl):
    def fn(u, n, beta, r, d1):
      return precond.osdn_d_pass(u, n, beta, r, d1, a["d0"], implementation=impl, kernel_config=config, **kw)
    return fn
  got, want = _values_and_grads(run, [a[x] for x in ("u", "n", "beta", "r", "d1")], ("pallas", "reference"))
  _assert_close(got, want, ("u", "n", "beta", "r", "d1"))
  with pytest.raises(ValueError, match="spans"):
    osdn.Config(spans=-1)
  with pytest.raises(ValueError, match="dots_tables"):
    osdn.Config(dots_tables="bf16")


@pytest.mark.parametrize("mode,L", [("none", 32), ("zero", 16), ("init", 32)])
def test_tables_kernel(mode, L):
  """The table kernel (`osdn_tables.forward` / `.backward`, interpret mode) against the plain-JAX reference
  (batched triangular solves): tf, wf, tb, wb and Γ of every block, T with a partial last block, retentions
  exactly 0 and 1, spiky keys (M far from 0), β = 0 tokens."""
  a = _inputs(31, T=2 * L + 5, G=2, K=16)
  r = None if mode == "none" else a["r"].at[:, 5::9].set(0.0).at[:, 3::7].set(1.0)
  o = a["d0"] if mode == "init" else None
  config = osdn.Config(solve_t=L, solve_t_apf=L, solve_t_init=L, tables="kernel")
  st = Static(batch=2, length=2 * L + 5, heads=2, key_dim=16, eta=3.0, d_min=0.0, d_max=8.0, mode=mode,
                   config=config, interpret=True)
  g = jnp.asarray(np.random.default_rng(3).normal(size=a["u"].shape), F32)
  tf, wf, tb, inv_b, gamma = osdn_tables.reference(st, a["u"], a["n"], a["beta"], r, o)
  want = (tf, wf, tb, osdn_tables.adjoint_rhs_reference(st, a["u"], g, inv_b, gamma))
  (kf, kwf, kgf, none), (kb, kwb, kgb) = (osdn_tables.forward(st, a["u"], a["n"], a["beta"], r, o),
                                          osdn_tables.backward(st, a["u"], a["n"], a["beta"], r, g))
  assert kf.shape == (2, 2, 2, L, L) and kwb.shape == (2, 2, 2, L) and none is None
  for name, x, y in zip(("tf", "wf", "tb", "wb"), (kf, kwf, kb, kwb), want):
    assert rel_rms(x, y) < 1e-6, (name, rel_rms(x, y))
  if r is None:
    assert kgf is None and kgb is None
  else:
    np.testing.assert_allclose(kgf, gamma, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(kgf, kgb)
  auto = dataclasses.replace(st, config=dataclasses.replace(config, tables="auto"))
  assert osdn_tables.implementation(auto, False) == "kernel" and osdn_tables.implementation(auto, True) == "xla"
  # Shared (the custom_vjp's forward rule): the forward also forms the backward's inverse, the backward then
  # only its right-hand side; kernel and reference.
  for impl in ("kernel", "xla"):
    sst = dataclasses.replace(st, config=dataclasses.replace(config, tables=impl))
    sf, swf, sgf, saved = osdn_tables.forward(sst, a["u"], a["n"], a["beta"], r, o, differentiated=True)
    sb, swb, sgb = osdn_tables.backward(sst, a["u"], a["n"], a["beta"], r, g, saved, sgf)
    assert (saved[0] is None) == (impl == "kernel")
    for name, x, y in zip(("tf", "wf", "ib", "tb", "wb"), (sf, swf, saved[1], sb, swb), (tf, wf, inv_b) + want[2:]):
      assert rel_rms(x, y) < 1e-6, (impl, name, rel_rms(x, y))
    assert sgb is sgf


@pytest.mark.parametrize("clip,tables", [(False, None), pytest.param(True, None, marks=pytest.mark.slow),
                                         (True, "xla")])
def test_extreme_gates(clip, tables):
  """Zero keys (u = 0, n = 1e-12: α and c of 1e12 in the block tables), near-zero keys, β ∈ {0, 1}, APF: finite
  and equal to the scan, without and with the clip; the clipped case also with the plain-JAX tables (what the
  GPU default runs under differentiation). (`make test`: unclipped, and clipped with the plain-JAX tables.)"""
  a = _inputs(21, T=40, G=2, K=16)
  u = np.array(a["u"])
  u[:, 3::5] = 0.0
  u[:, 4::9] *= 1e-9
  a["u"] = jnp.asarray(u)
  a["n"] = jnp.maximum(jnp.sum(a["u"], -1), 1e-12)
  b = np.array(a["beta"])
  b[:, 1::4], b[:, 2::4] = 0.0, 1.0
  a["beta"] = jnp.asarray(b)
  config = dataclasses.replace(osdn.INTERPRET, tables=tables) if tables else None
  lo, hi = (0.0, 8.0) if clip else (None, None)
  got, want, names = _both(a, learned_r=True, eta=0.8, d_min=lo, d_max=hi, apf_anchor="zero", config=config)
  _assert_close(got, want, names)


# (anchor, learned r, keys' dtype, config overrides): blocks with the chain and a restart (r ≡ 1, the clip
# acting), APF toward d_init over spans of two blocks with the tables from XLA, token by token when packed.
KEY_CASES = {"r1-f32": ("zero", False, "float32", {}),
             "init-bf16-spans-xla": ("init", True, "bfloat16", dict(spans=2, tables="xla")),
             "zero-bf16-packed": ("zero", True, "bfloat16", {})}


# `make test`: f32 keys with the chain and a restart, bf16 keys packed; spans and the XLA tables are in the gate
# through test_spanned_backward["init"], test_extreme_gates[True-xla] and test_block_boundaries.
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if "spans" in c else []) for c in KEY_CASES])
def test_keys_read_by_the_kernels(case):
  """d_pass(keys=k): the kernels read k in its own dtype and square it on load; values and gradients w.r.t. k,
  n, β, r, d1 and d_init equal the token-serial scan on u = k ⊙ k (fp32, K = 20 padded to 32, odd T), k's
  gradient through u = k ⊙ k; `Config.read_keys=False` (u formed in XLA) gives the same."""
  anchor, learned_r, dtype, over = KEY_CASES[case]
  packed = case.endswith("packed")
  a = _inputs(11, T=67, G=2, K=20, segments=3 if packed else 0)
  rng = np.random.default_rng(12)
  k = jnp.asarray(np.sqrt(np.asarray(a["u"])) * rng.choice([-1.0, 1.0], size=a["u"].shape), dtype)
  ids = jnp.asarray(np.stack([np.repeat([0, 1], [30, 37]), np.full(67, 2)]), jnp.int32) if packed else None
  n = jnp.maximum(jnp.sum(jnp.square(k.astype(F32)), -1), 1e-12)
  names = ("k", "n", "beta", "r", "d1", "d0") if learned_r else ("k", "n", "beta", "d1", "d0")
  kw = dict(eta=8.0, d_min=0.0, d_max=2.0, apf_anchor=anchor, segment_ids=ids)

  def run(impl):
    def fn(*xs):
      x = dict(zip(names, xs))
      u = jnp.square(x["k"].astype(F32))
      args = (x["n"], x["beta"], x.get("r"), x["d1"], x["d0"])
      if impl == "scan":
        return precond.osdn_d_pass(u, *args, implementation="reference", **kw)
      config = osdn.INTERPRET.override(**over, read_keys=impl == "keys")
      return osdn.d_pass(None, *args, keys=x["k"], config=config, **kw)
    return fn

  xs = [k, n] + [a[x] for x in names[2:]]
  got, unread, want = _values_and_grads(run, xs, ("keys", "u", "scan"))
  assert got[1][0].dtype == k.dtype
  up = lambda r: (r[0], tuple(g.astype(F32) for g in r[1]))
  tol = TOL if dtype == "float32" else 4e-3            # k's gradient is rounded to bf16
  for x in (got, unread):
    errors = _assert_close(up(x), up(want), names, tol=tol)
    assert all(e < TOL for name, e in errors.items() if name != "dk"), errors
  print(case, errors)


def test_chaining():
  """Two calls through d_{T+1} equal one call."""
  a = _inputs(3, T=40, G=2, K=16)
  kw = dict(eta=4.0, d_min=0.0, d_max=2.0, apf_anchor="zero")
  run = lambda sl, d1: osdn.d_pass(a["u"][:, sl], a["n"][:, sl], a["beta"][:, sl], a["r"][:, sl], d1, a["d0"],
                                   **kw)
  ds, d_last = run(slice(None), a["d1"])
  ds1, mid = run(slice(0, 17), a["d1"])
  ds2, end = run(slice(17, None), mid)
  assert rel_rms(jnp.concatenate([ds1, ds2], 1), ds) < TOL and rel_rms(end, d_last) < TOL


def _write_key_inputs(seed, *, B, T, H, G, K, states):
  """Unit keys [B, T, H, K], gains and APF retentions [B, T, G], initial d [states, G, K] (fp32)."""
  rng = np.random.default_rng(seed)
  f = lambda x: jnp.asarray(x, F32)
  k = f(_unit(rng.normal(size=(B, T, H, K))))
  beta = f(1 / (1 + np.exp(-rng.normal(size=(B, T, G)))))
  r = f(1 / (1 + np.exp(-rng.normal(size=(B, T, G)) - 3)))
  return k, beta, r, f(0.5 + rng.random(size=(states, G, K)))


@pytest.mark.parametrize("anchor", [pytest.param("zero", marks=pytest.mark.slow), "init"])
def test_osdn_write_key_end_to_end(anchor):
  """osdn_write_key(implementation="pallas") against "reference": odd T, K = 20 (padded to 32), GVA gains
  (G = 2H), APF retention, an initial state, the guard, the default clip [0, 8] with an aggressive η; values and
  gradients w.r.t. k, β, r and the initial state."""
  k, beta, r, d0 = _write_key_inputs(7, B=2, T=37, H=2, G=4, K=20, states=2)

  def run(impl):
    return lambda k, beta, r, d0: precond.osdn_write_key(k, beta, retention=r, eta=6.0, d_init=1.5,
                                                         apf_anchor=anchor, initial_state=d0, implementation=impl)

  got, want = _values_and_grads(run, (k, beta, r, d0), ("pallas", "reference"))
  print(anchor, _assert_close(got, want, ("k", "beta", "r", "initial_state"), outputs=("k_write", "d_last")))


@pytest.mark.parametrize("anchor,traced", [("zero", False), ("init", True)])
def test_osdn_write_key_packed(anchor, traced):
  """Packed sequences through the kernel against the packed token-serial scan: segments of length 1, a
  segment ending at T, per-segment initial d; values (k̃ and every segment's last d) and gradients w.r.t. k,
  β, r and the initial states; under jit with traced ids and spare segments (N > segments present: zero last
  d, zero gradient), as the scan."""
  ids = np.stack([np.repeat(np.arange(4), [1, 20, 1, 15]), np.repeat(np.arange(2), [30, 7])]).astype(np.int32)
  k, beta, r, d0 = _write_key_inputs(9, B=2, T=37, H=1, G=2, K=16, states=6 + (2 if traced else 0))

  def run(impl):
    def fn(k, beta, r, d0):
      call = lambda ids, *xs: precond.osdn_write_key(xs[0], xs[1], retention=xs[2], eta=6.0, d_init=1.5,
                                                     apf_anchor=anchor, initial_state=xs[3], implementation=impl,
                                                     segment_ids=ids)
      return (jax.jit(call) if traced else call)(ids, k, beta, r, d0)
    return fn

  got, want = _values_and_grads(run, (k, beta, r, d0), ("pallas", "reference"))
  print(anchor, _assert_close(got, want, ("k", "beta", "r", "initial_state"), outputs=("k_write", "d_last")))


def test_dispatch():
  """lookup of "osdn_d_pass" finds the kernel for fp32, K ≤ 256, static constants, packed or not (on a TPU
  backend, the TPU kernel); importing
  osdn_jax.dgps imports no kernel; implementation="pallas" refuses traced bounds, an unknown implementation is
  named."""
  spec = Spec("osdn_d_pass", "gpu", "float32", key_dim=128)
  lookup = lambda **kw: pallas_kernels.lookup(dataclasses.replace(spec, **kw))
  assert lookup() is osdn.d_pass and lookup(platform="cpu") is osdn.d_pass and lookup(packed=True) is osdn.d_pass
  assert lookup(dtype="float64") is None and lookup(key_dim=512) is None
  from pallas_kernels.tpu import osdn as tpu_osdn
  assert lookup(platform="tpu") is tpu_osdn.d_pass
  assert lookup(static_params=False) is None
  k = jnp.ones((1, 8, 1, 16), F32) / 4
  beta = jnp.full((1, 8, 1), 0.5, F32)
  with pytest.raises(ValueError, match="static"):
    jax.jit(lambda e: precond.osdn_write_key(k, beta, eta=e, implementation="pallas"))(1.0)
  with pytest.raises(ValueError, match="`implementation`"):
    precond.osdn_write_key(k, beta, implementation="sequential")
  code = ("import sys, osdn_jax.dgps; assert not {'pallas_kernels.gpu', 'jax.experimental.pallas'} & set(sys.modules)")
  subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("anchor,learned_r,packed,keys", [("zero", False, False, True), ("zero", True, False, False),
                                                          ("init", True, False, False), ("init", True, True, True)])
def test_lowers_to_triton(triton_lowering, capsys, anchor, learned_r, packed, keys):
  """Forward and backward (default GPU blocks but the kernel tables: block solves and their table kernels
  unpacked, the backward's right-hand side from the forward's inverse; token by token packed; K = 128, T with
  a tail; packed: traced segment ids, per-segment d1 and last d; keys: bf16 keys read by the kernels in place
  of u) lower with the Triton backend for CUDA to IR that passes MLIR verification."""
  verified = triton_lowering
  b, t, g, kd, n_seg = 2, 100, 4, 128, 5
  sd = lambda *shape, dtype=F32: jax.ShapeDtypeStruct(shape, dtype)

  def loss(u, n, beta, r, d1, d0, ids):
    ds, d_last = osdn.d_pass(None if keys else u, n, beta, r if learned_r else None, d1, d0, eta=1.0, d_min=0.0,
                             d_max=8.0, apf_anchor=anchor, segment_ids=ids if packed else None, interpret=False,
                             keys=u if keys else None, config=dataclasses.replace(osdn.DEFAULT, tables="kernel"))
    return jnp.sum(ds) + jnp.sum(d_last)

  f = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5))
  args = (sd(b, t, g, kd, dtype=jnp.bfloat16 if keys else F32), sd(b, t, g), sd(b, t, g), sd(b, t, g),
          sd(n_seg if packed else b, g, kd), sd(g, kd), sd(b, t, dtype=jnp.int32))
  jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
  ir = capsys.readouterr().out
  assert "@osdn_d_pass_bwd(" in ir
  blocked = not packed
  assert all((f"@osdn_d_pass_{x}(" in ir) == blocked for x in ("fwd_chain", "fwd_expand", "fwd_restart", "bwd_chain"))
  assert ("@osdn_d_pass_fwd(" in ir) == packed
  assert ("@osdn_d_pass_fwd_tables(" in ir and "@osdn_d_pass_bwd_rhs(" in ir) == blocked   # share_inverse
  assert "scf.for" in ir and (not packed or "scf.if" in ir)
  assert all(verified), verified


@pytest.mark.parametrize("learned_r", [False, True])
def test_split_backward_lowers_to_triton(triton_lowering, capsys, learned_r):
  """The split backward: the λ-only sequential kernel and the parallel block-gradient kernel (with its in-place
  updated outputs) and the backward's own table kernel (kernel tables, not shared) lower to verified Triton
  IR, with one-pass TF32 dots in the tables' kernels and the expansion."""
  verified = triton_lowering
  b, t, g, kd = 2, 100, 4, 128
  sd = lambda *shape: jax.ShapeDtypeStruct(shape, F32)
  config = osdn.Config(solve_t_apf=32, tables="kernel", share_inverse=False, dots_tables="tf32", dots_expand="tf32")

  def loss(u, n, beta, r, d1, d0):
    ds, d_last = osdn.d_pass(u, n, beta, r if learned_r else None, d1, d0, eta=1.0, d_min=0.0, d_max=8.0,
                             apf_anchor="zero", config=config, interpret=False)
    return jnp.sum(ds) + jnp.sum(d_last)

  f = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
  jax.jit(f).trace(sd(b, t, g, kd), sd(b, t, g), sd(b, t, g), sd(b, t, g), sd(b, g, kd), sd(g, kd)).lower(
      lowering_platforms=("cuda",))
  ir = capsys.readouterr().out
  assert "@osdn_d_pass_bwd(" in ir and "@osdn_d_pass_bwd_blocks(" in ir and "@osdn_d_pass_bwd_tables(" in ir
  for name in ("osdn_d_pass_fwd_tables", "osdn_d_pass_bwd_tables", "osdn_d_pass_fwd_expand"):
    start = ir.index(f"@{name}(")
    end = ir.find("tt.func", start + 1)
    body = ir[start:end if end > 0 else None]
    assert 0 < body.count("tt.dot") == body.count("inputPrecision = tf32"), name    # every dot one-pass TF32
  assert all(verified), verified


@pytest.mark.parametrize("anchor,learned_r", [("zero", False), ("init", True)])
def test_spanned_lowers_to_triton(triton_lowering, capsys, anchor, learned_r):
  """The chains over spans (`Config.spans` = 2: K = 128, T = 233 is seven blocks of 32 in four spans,
  the last ragged, and a tail): forward and backward, the spans' maps, the pass across spans and the chain
  over (B, G, NS) lower to verified Triton IR, beside the expansion, the restart and the backward's other
  kernels."""
  verified = triton_lowering
  b, t, g, kd = 2, 233, 4, 128
  sd = lambda *shape: jax.ShapeDtypeStruct(shape, F32)
  config = dataclasses.replace(osdn.DEFAULT, tables="kernel", spans=2, solve_t_init=32)

  def loss(u, n, beta, r, d1, d0):
    ds, d_last = osdn.d_pass(u, n, beta, r if learned_r else None, d1, d0, eta=1.0, d_min=0.0, d_max=8.0,
                             apf_anchor=anchor, config=config, interpret=False)
    return jnp.sum(ds) + jnp.sum(d_last)

  f = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5))
  jax.jit(f).trace(sd(b, t, g, kd), sd(b, t, g), sd(b, t, g), sd(b, t, g), sd(b, g, kd), sd(g, kd)).lower(
      lowering_platforms=("cuda",))
  ir = capsys.readouterr().out
  names = ("fwd_maps", "fwd_across", "fwd_chain", "fwd_expand", "fwd_restart", "bwd_maps", "bwd_across", "bwd_chain",
           "bwd", "bwd_blocks")
  assert all(f"@osdn_d_pass_{x}(" in ir for x in names)
  assert all(verified) and len(verified) >= len(names), verified
