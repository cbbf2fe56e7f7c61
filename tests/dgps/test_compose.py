"""Axis values written outside the library (`dgps.Axis`, `dgps.State`, `dgps.register_axis`, `dgps.compose`): a
user's preconditioner and decay run, carry their state across calls, decode and split over context shards as the
built-in ones do, and compositions that cannot work are named errors."""
from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osdn_jax import dgps
from osdn_jax.testing import rel_rms

REPO = pathlib.Path(__file__).resolve().parents[2]
DIMS = dgps.Dims(heads=2, value_heads=2, key_dim=8, value_dim=4)

# A user's preconditioner: the write key scaled by 1/√(EMA of k⊙k) (one state vector per key head), as
# `notebooks/04_your_own_preconditioner.ipynb` writes it.
EMA_SOURCE = '''
def ema_scale(c):
  rho, eps = c.options["rho"], 1e-3
  m0 = jnp.zeros((c.k.shape[0],) + c.k.shape[2:], jnp.float32) if c.state is None else c.state
  def step(m, k2):
    m = rho * m + (1 - rho) * k2
    return m, m
  last, ms = jax.lax.scan(step, m0, jnp.moveaxis(jnp.square(c.k.astype(jnp.float32)), 1, 0))
  scale = jax.lax.rsqrt(jnp.moveaxis(ms, 0, 1) + eps)
  return {"k_write": (c.k * scale / jnp.sqrt(jnp.sum(jnp.square(c.k * scale), -1, keepdims=True) + 1e-6))
          .astype(c.k.dtype)}, last

EMA = dgps.Axis(ema_scale, sets=("k_write",), defaults={"rho": 0.9},
                check=lambda owner, o: None if 0 < o["rho"] < 1 else (_ for _ in ()).throw(
                    ValueError(f"{owner}: `rho` must be in (0, 1), got {o['rho']}")),
                state=dgps.State(heads="H", init=lambda o: 0.0, carry="rerun"))
'''
exec(EMA_SOURCE)   # defines ema_scale and EMA here


def _inputs(point, seed=0, B=2, T=24):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q, k, v = f(B, T, DIMS.heads, DIMS.key_dim), f(B, T, DIMS.heads, DIMS.key_dim), f(B, T, DIMS.value_heads, 4)
  feats = jax.tree.map(lambda s: f(B, T, *s), point.feature_shapes(DIMS), is_leaf=lambda x: isinstance(x, tuple))
  return q, k, v, feats, point.init_params(jax.random.key(seed), DIMS)


def test_a_custom_preconditioner_is_stateful_and_carries_across_calls():
  point = dgps.compose(decay="scalar", precond=EMA, rho=0.8)
  assert point.stateful_precond and point.opts["rho"] == 0.8 and point.axis_name("precond") == "custom precond"
  s0 = point.initial_state(2, DIMS)
  assert s0["precond"].shape == (2, DIMS.heads, DIMS.key_dim) and not np.any(s0["precond"])
  q, k, v, f, p = _inputs(point)
  whole, final = point(q, k, v, f, p, output_final_state=True)
  half = lambda x, s: jax.tree.map(lambda a: a[:, s], x)
  a, mid = point(q[:, :10], k[:, :10], v[:, :10], half(f, slice(0, 10)), p, output_final_state=True)
  b, end = point(q[:, 10:], k[:, 10:], v[:, 10:], half(f, slice(10, None)), p, state=mid, output_final_state=True)
  assert rel_rms(jnp.concatenate([a, b], 1), whole) < 1e-5
  assert rel_rms(end["precond"], final["precond"]) < 1e-6 and rel_rms(end["S"], final["S"]) < 1e-5
  # The state matters: restarting the second half from zero gives another output.
  c, _ = point(q[:, 10:], k[:, 10:], v[:, 10:], half(f, slice(10, None)), p, state={"S": mid["S"]})
  assert rel_rms(c, b) > 1e-3


def test_a_custom_preconditioner_decodes_token_by_token():
  point = dgps.compose(precond=EMA)
  q, k, v, f, p = _inputs(point, seed=1, T=9)
  whole, _ = point(q, k, v, f, p, implementation="reference")
  state, outs = point.initial_state(2, DIMS), []
  for t in range(9):
    o, state = point.step(q[:, t], k[:, t], v[:, t], jax.tree.map(lambda a: a[:, t], f), p, state)
    outs.append(o)
  assert rel_rms(jnp.stack(outs, 1), whole) < 1e-5


def test_registered_axis_values_name_like_built_in_ones():
  dgps.register_axis("precond", "test-ema", EMA, replace=True)
  half_life = dgps.Axis(lambda c: jnp.full(c.v.shape[:3], -jnp.log(2.0) / c.options["half_life"]),
                        sets=("log_decay",), defaults={"half_life": 16.0})
  dgps.register_axis("decay", "test-half-life", half_life, replace=True)
  point = dgps.register(dgps.compose(decay="test-half-life", precond="test-ema", name="test-ema-dn"), replace=True)
  assert dgps.get("test-ema-dn", half_life=4.0).opts["half_life"] == 4.0      # options on the decay axis too
  assert point.axis_name("precond") == "test-ema" and point.stateful_precond
  q, k, v, f, p = _inputs(point)
  o, _ = point(q, k, v, f, p)
  assert o.shape == (2, 24, DIMS.value_heads, 4) and bool(jnp.all(jnp.isfinite(o)))
  with pytest.raises(ValueError, match="`rho` must be in"):
    dgps.get("test-ema-dn", rho=1.5)
  with pytest.raises(ValueError, match="unknown options"):
    dgps.get("test-ema-dn", x=2.0)


def test_compositions_that_cannot_work_are_named_errors():
  with pytest.raises(ValueError, match="sets the write key, which the 'offline' solve does not read"):
    dgps.compose(precond=EMA, solve="offline")
  stateless_key = dgps.Axis(lambda c: ({"k_write": c.k}, None))       # sets nothing it declares
  with pytest.raises(ValueError, match="returned \\['k_write'\\], but the 'offline' solve reads only"):
    point = dgps.compose(precond=stateless_key, solve="offline")
    point(*_inputs(point))
  clash = dgps.Axis(lambda c: None, sets=("log_decay",), defaults={"rho": 0.5})
  with pytest.raises(ValueError, match="option 'rho' is declared by both the decay and the precond axis"):
    dgps.compose(decay=clash, precond=EMA)
  with pytest.raises(ValueError, match="cannot replace|already has"):
    dgps.register_axis("precond", "pdn", EMA, replace=True)
  with pytest.raises(ValueError, match="`value` must be a dgps.Solve"):
    dgps.register_axis("solve", "mine", EMA)
  with pytest.raises(ValueError, match="`kind` must be one of"):
    dgps.register_axis("norm", "mine", EMA)
  with pytest.raises(ValueError, match="`carry` must be one of"):
    dgps.State(carry="ring")


def test_check_point_passes_a_sound_value_and_fails_one_that_drops_its_state():
  dims = dgps.Dims(heads=2, value_heads=2, key_dim=8, value_dim=8)
  good = dgps.check_point(dgps.compose(decay="scalar", precond=EMA), dims, length=13)
  assert good["ok"] and set(good) == {"chunked", "chaining", "decoding", "gradients", "ok"}, good
  forgetful = dgps.Axis(lambda c: ema_scale(dataclasses.replace(c, state=None)), sets=("k_write",),
                        defaults={"rho": 0.9}, state=dgps.State(heads="H", carry="rerun"))
  bad = dgps.check_point(dgps.compose(precond=forgetful), dims, length=13)
  assert not bad["ok"] and bad["chaining"] > 1e-3 and bad["chunked"] < 1e-4, bad


def test_a_custom_pass_is_named_for_the_remat_policies():
  point = dgps.compose(precond=EMA)
  q, k, v, f, p = _inputs(point)
  jaxpr = str(jax.make_jaxpr(lambda *a: point.prepare(*a)["k_write"])(q, k, v, f, p))
  assert "name=precond_pass" in jaxpr


_SPLIT = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    from osdn_jax import dgps
    exec(open(sys.argv[1]).read())
    carry = sys.argv[2]
    axis = EMA if carry == "rerun" else dgps.Axis(ema_scale, sets=("k_write",), defaults={"rho": 0.9},
                                                  state=dgps.State(heads="H"))
    point = dgps.compose(precond=axis)
    dims = dgps.Dims(2, 2, 8, 4)
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q, k, v = f(2, 16, 2, 8), f(2, 16, 2, 8), f(2, 16, 2, 4)
    feats, params = {"decay": {}, "gain": {"b": f(2, 16, 2)}, "precond": {}}, point.init_params(jax.random.key(0), dims)
    whole, fin = jax.jit(lambda q, k, v, feats: point(q, k, v, feats, params, output_final_state=True))(q, k, v, feats)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("context",))
    tok = P(None, "context")
    body = lambda q, k, v, feats: point(q, k, v, feats, params, output_final_state=True, context="context")
    try:
      split, sfin = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, {"decay": {}, "gain": {"b": tok},
                                          "precond": {}}), out_specs=(tok, P()), check_vma=False))(q, k, v, feats)
    except ValueError as e:
      print("ValueError:", e); sys.exit(0)
    err = lambda a, b: float(jnp.sqrt(jnp.mean((a - b) ** 2) / jnp.mean(b ** 2)))
    print("errors", err(split, whole), err(sfin["precond"], fin["precond"]))
""")


@pytest.mark.parametrize("carry", ["rerun", "none"])
def test_a_custom_state_splits_over_context_shards_by_its_carry_rule(carry, tmp_path):
  """With a carry rule the split run equals the unsplit one; without, it is a named error."""
  (tmp_path / "ema.py").write_text("import jax, jax.numpy as jnp\nfrom osdn_jax import dgps\n" + EMA_SOURCE)
  (tmp_path / "split.py").write_text(_SPLIT)
  out = subprocess.run([sys.executable, str(tmp_path / "split.py"), str(tmp_path / "ema.py"), carry],
                       capture_output=True, text=True, cwd=REPO, env={**__import__("os").environ,
                                                                    "JAX_PLATFORMS": "cpu"}, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  if carry == "rerun":
    errors = [float(x) for x in out.stdout.split("errors")[1].split()]
    assert max(errors) < 1e-5, out.stdout
  else:
    assert "without a carry rule" in out.stdout, out.stdout


def test_a_state_that_breaks_its_declaration_is_a_named_error():
  """The state a preconditioner returns is checked against its `state` declaration: one returned without a
  declaration, a declared one not returned, one of another shape, and one that ignores packed rows (a state per
  row where the point has one per segment) are ValueErrors, not states silently dropped or misplaced."""
  def ema_any(state_decl, out=None):
    def apply(c):
      key, last = ema_scale(dataclasses.replace(c, options={"rho": 0.9}))
      return key, (last if out is None else out(c, last))
    return dgps.Axis(apply, sets=("k_write",), state=state_decl)
  rerun = dgps.State(heads="H", carry="rerun")
  cases = [
      (ema_any(None), {}, "returned a state but declares none"),
      (ema_any(rerun, lambda c, last: None), {}, "declares a state .* returned None"),
      (ema_any(rerun, lambda c, last: last[:, :1]), {}, r"returned a state of shape \(2, 1, 8\)"),
      (ema_any(rerun), {"segment_ids": jnp.array([[0] * 12 + [1] * 12, [2] * 5 + [3] * 19])},
       r"returned a state of shape \(2, 2, 8\), .* \(4, 2, 8\)"),
  ]
  for axis, kw, message in cases:
    point = dgps.compose(precond=axis)
    with pytest.raises(ValueError, match=message):
      point(*_inputs(point), output_final_state=True, **kw)
  # A value that handles packed rows (the built-in PDN) returns one state per segment and passes.
  point = dgps.compose(precond="pdn")
  _, final = point(*_inputs(point), output_final_state=True, **cases[-1][1])
  assert final["precond"].shape == (4, DIMS.heads, DIMS.key_dim)


def test_check_point_holds_a_diagonal_carry_to_its_declaration():
  """carry="diagonal" tells context parallelism to compose the shards' states as a ⊙ entering + b; `check_point`
  checks that claim on the chained halves, so a pass that is not diagonal-affine in its state (here a clipped
  one) fails it, while the same pass declared "rerun" passes."""
  def clipped(c):
    m0 = jnp.full((c.k.shape[0],) + c.k.shape[2:], 0.3, jnp.float32) if c.state is None else c.state
    def step(m, a):
      m = jnp.minimum(jnp.maximum(0.9 * m, jnp.abs(a)), 2.0)
      return m, m
    last, ms = jax.lax.scan(step, m0, jnp.moveaxis(c.k.astype(jnp.float32), 1, 0))
    return {"k_write": (c.k / (jnp.moveaxis(ms, 0, 1) + 0.5)).astype(c.k.dtype)}, last
  dims = dgps.Dims(heads=2, value_heads=2, key_dim=8, value_dim=8)
  report = {carry: dgps.check_point(dgps.compose(precond=dgps.Axis(
      clipped, sets=("k_write",), state=dgps.State(heads="H", init=lambda o: 0.3, carry=carry))), dims, length=13)
      for carry in ("rerun", "diagonal")}
  assert report["rerun"]["ok"], report
  assert not report["diagonal"]["ok"] and report["diagonal"]["chaining"] > 1e-2, report
  # The diagonal-affine second moment passes as declared.
  assert dgps.check_point(dgps.compose(precond=EMA_DIAGONAL), dims, length=13)["ok"]


EMA_DIAGONAL = dgps.Axis(ema_scale, sets=("k_write",), defaults={"rho": 0.9},
                         state=dgps.State(heads="H", init=lambda o: 0.0, carry="diagonal"))


def test_a_solve_takes_options_like_every_axis():
  """A solve with an option (`Solve.defaults`, `Solve.check`): the point passes it to run and to step, its range
  check runs when the point is made, and `check_point` holds it (chunked, chaining, decoding, gradients)."""
  online = dgps.AXES["solve"]["online"]
  scaled = dgps.Solve(
      reads=online.reads, defaults={"beta_scale": 1.0},
      run=lambda q, k, v, beta, *, beta_scale, **kw: online.run(q, k, v, beta * beta_scale, **kw),
      step=lambda q, k, v, beta, state, *, beta_scale, **kw: online.step(q, k, v, beta * beta_scale, state, **kw),
      check=lambda owner, o: dgps.checks.number(owner, "beta_scale", o["beta_scale"], low=0.0, high=1.0,
                                                low_open=True))
  half = dgps.compose(solve=scaled, beta_scale=0.5, name="test-scaled-solve")
  q, k, v, feats, params, state = dgps.conformance.random_inputs(half, DIMS, 0)
  got, _ = half(q, k, v, feats, params, state=state)
  x = half.prepare(q, k, v, feats, params)
  want, _ = online.run(x["q"], x["k"], x["v"], 0.5 * x["beta"], k_write=x["k_write"], log_decay=x["log_decay"],
                       initial_state=state["S"])
  whole, _ = dgps.compose(solve=scaled, name="test-scaled-solve-1")(q, k, v, feats, params, state=state)
  assert rel_rms(got, want) < 1e-6 and rel_rms(whole, want) > 1e-2
  assert half.opts["beta_scale"] == 0.5
  assert dgps.check_point(half, DIMS)["ok"]
  with pytest.raises(ValueError, match="beta_scale"):
    dgps.compose(solve=scaled, beta_scale=2.0, name="test-scaled-solve-2")
