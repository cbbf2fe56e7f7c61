"""Faults stay where they happen at the boundaries the solves' helpers add (docs/faults.md): the chunks of OSDN's
exact d-pass, a key whose square overflows, the shards of context parallelism, and the segment starts that the
preconditioner kernels fold into a log-decay. Outputs before the fault, in the other value heads and in every
other sequence equal the clean run's; from the fault on its sequence is non-finite."""
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osdn_jax import dgps, ops
from osdn_jax.dgps import precond
from osdn_jax.testing import random_point_inputs

REPO = pathlib.Path(__file__).resolve().parents[1]
DIMS = dgps.Dims(heads=2, value_heads=2, key_dim=16, value_dim=16)
B, T, C = 1, 48, 16


def _assert_confined(faulty, clean, poisoned):
  """faulty equals clean outside `poisoned` ([B, T, HV] bool) and has a non-finite entry in every poisoned row."""
  faulty, clean = np.asarray(faulty), np.asarray(clean)
  np.testing.assert_allclose(faulty[~poisoned], clean[~poisoned], rtol=1e-6, atol=1e-6)
  assert not np.isfinite(faulty[poisoned]).all(axis=-1).any(), "a row after the fault is finite"


def _rows(spans, heads=(0,)):
  """[B, T, HV] bool: True at the (start, stop) token spans of row 0 in the value heads `heads`."""
  mask = np.zeros((B, T, DIMS.value_heads), bool)
  for start, stop in spans:
    mask[0, start:stop, list(heads)] = True
  return mask


def _with_nan(arrays, *index):
  return arrays.at[index].set(np.nan)


# ---------------------------------------------------------------------------------------------------------
# OSDN unbounded: the exact chunked d-pass, and a key whose square overflows.
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("implementation", ["xla", "reference"])
@pytest.mark.parametrize("name, where", [("osdn", "k"), ("osdn", "gain"), ("osdn-apf", "retention")])
def test_osdn_unbounded_nan_leaves_the_rows_before_it_clean(implementation, name, where):
  """A NaN at t = 25 in k, in the gain's logit (β) or in APF's retention logit: the d-pass's chunk (64 tokens, the
  whole row) keeps its rows before t. The retention r_t enters d_{t+1} only, so o_t stays finite there."""
  point = dgps.get(name, d_min=None, d_max=None)
  q, k, v, f, prm = random_point_inputs(point, DIMS, 0, B=B, T=T)
  run = jax.jit(lambda k, f: point(q, k, v, f, prm, chunk_size=C, implementation=implementation)[0])
  if where == "k":
    faulty = (_with_nan(k, 0, 25, 0, 3), f)
  else:
    axis, feature = ("gain", "b") if where == "gain" else ("precond", "r")
    faulty = (k, dict(f, **{axis: {feature: _with_nan(f[axis][feature], 0, 25, 0)}}))
  _assert_confined(run(*faulty), run(k, f), _rows([(26 if where == "retention" else 25, T)]))


def _osdn_solve(k, *, implementation, segment_ids, guard):
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=k.shape), k.dtype)
  v = jnp.asarray(rng.normal(size=k.shape[:3] + (DIMS.value_dim,)), k.dtype)
  beta = jax.nn.sigmoid(jnp.asarray(rng.normal(size=k.shape[:3]), k.dtype))
  k_write, _ = precond.osdn_write_key(k, beta, d_min=None, d_max=None, guard=guard, chunk_size=C,
                                      segment_ids=segment_ids, implementation=implementation)
  return ops.delta_rule(q, k, v, beta, k_write=k_write, chunk_size=C, segment_ids=segment_ids,
                        implementation=implementation)[0]


@pytest.mark.parametrize("implementation", ["xla", "reference"])
@pytest.mark.parametrize("packed, guard", [(False, 2.0), (True, None)], ids=["unpacked", "packed-unguarded"])
def test_osdn_key_whose_square_overflows_is_a_fault_of_its_token(implementation, packed, guard):
  """k_25 · 1e20 is finite, k_25² is not: the write key is NaN from t = 25 (not a finite 1e20 that overflows in
  the chunked solve), so the rows before it and the segment after it in the same chunk equal the clean run."""
  ids = jnp.asarray([[0] * 16 + [1] * 12 + [2] * 20], jnp.int32) if packed else None
  k = jnp.asarray(np.random.default_rng(0).normal(size=(B, T, DIMS.heads, DIMS.key_dim)), jnp.float32)
  run = jax.jit(lambda k: _osdn_solve(k, implementation=implementation, segment_ids=ids, guard=guard))
  poisoned = _rows([(25, 28 if packed else T)], heads=range(DIMS.value_heads))
  _assert_confined(run(k.at[0, 25].multiply(1e20)), run(k), poisoned)


# ---------------------------------------------------------------------------------------------------------
# Context parallelism over 2 devices (a fresh process: the device count is fixed when JAX starts).
# ---------------------------------------------------------------------------------------------------------
_CONTEXT = textwrap.dedent("""
    import os, json
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    from osdn_jax import dgps
    from osdn_jax.ops import context
    from osdn_jax.testing import random_point_inputs
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("context",))
    B, T, H, K, V = 1, 64, 2, 16, 16                      # 32 tokens per shard
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    q, k, v, beta = f(B, T, H, K) / 4, f(B, T, H, K) / 4, f(B, T, H, V), jax.nn.sigmoid(f(B, T, H))
    w_o, w_s = f(B, T, H, V), f(3, H, K, V)
    tok = P(None, "context")
    def split(q, k, v, beta, s0, ids):
      body = lambda q, k, v, beta, ids: context.delta_rule(q, k, v, beta, initial_state=s0, segment_ids=ids,
          output_final_state=True, chunk_size=16, axis_name="context", implementation="xla")
      return jax.shard_map(body, mesh=mesh, in_specs=(tok,) * 5, out_specs=(tok, P()), check_vma=False)(
          q, k, v, beta, ids)
    def loss(args, ids):
      o, S = split(*args, ids)
      return jnp.sum(o * w_o) + jnp.sum(S * w_s), (o, S)
    def err(x, y):
      x, y = np.asarray(x), np.asarray(y)
      return float(np.max(np.abs(x - y), initial=0.0)) if np.isfinite(x).all() else float("inf")
    def report(t, lengths, faulty, clean):
      # faulty, clean: (per-token input gradients, initial-state gradients, o, final states [3, H, K, V]).
      (grads, s0_grads, o, S), (c_grads, c_s0_grads, co, cS) = faulty, clean
      other, others = np.repeat(np.arange(3), lengths) != 1, np.array([0, 2])
      return {
          "o before the fault": err(o[:, :t], co[:, :t]),
          "o of the other segments": err(o[:, other], co[:, other]),
          "o after the fault finite": bool(np.isfinite(np.asarray(o)[0, t:sum(lengths[:2]), 0]).any()),
          "final states of the other segments": err(S[others], cS[others]),
          "final state of the faulty segment finite": bool(np.isfinite(np.asarray(S)[1, 0]).any()),
          "gradients of the other segments": max(err(g[:, other], c[:, other]) for g, c in zip(grads, c_grads)),
          "initial-state gradients of the other segments": max(err(g[others], c[others])
                                                               for g, c in zip(s0_grads, c_s0_grads)),
      }
    run = jax.jit(jax.grad(loss, has_aux=True))
    out = {}
    # The NaN is in segment 1: spanning both shards (at t = 25 on the first or t = 35 on the second), or ending on
    # the shard boundary (t = 32).
    for case, lengths, t in (("spanning", (20, 20, 24), 25), ("spanning, on the second shard", (20, 20, 24), 35),
                             ("ending on the boundary", (20, 12, 32), 25)):
      ids = jnp.asarray([np.repeat(np.arange(3), lengths)], jnp.int32)
      s0 = f(3, H, K, V) / 4
      (*grads, ds0), (o, S) = run((q, k.at[0, t, 0, 3].set(np.nan), v, beta, s0), ids)
      (*c_grads, c_ds0), (co, cS) = run((q, k, v, beta, s0), ids)
      out[case] = report(t, lengths, (grads, [ds0], o, S), (c_grads, [c_ds0], co, cS))
    # A point whose preconditioner state passes between the shards too (PGDN's second moment).
    point, dims, lengths = dgps.get("pgdn"), dgps.Dims(H, H, K, V), (20, 20, 24)
    q, k, v, feats, params = random_point_inputs(point, dims, 0, B=B, T=T)
    ids = jnp.asarray([np.repeat(np.arange(3), lengths)], jnp.int32)
    def point_loss(k, state):
      body = lambda q, k, v, feats, ids: point(q, k, v, feats, params, state=state, output_final_state=True,
                                               segment_ids=ids, implementation="xla", chunk_size=16, context="context")
      o, fin = jax.shard_map(body, mesh=mesh, in_specs=(tok,) * 5, out_specs=(tok, P()), check_vma=False)(
          q, k, v, feats, ids)
      return jnp.sum(o * w_o) + jnp.sum(fin["S"] * w_s) + jnp.sum(fin["precond"]), (o, fin["S"])
    run = jax.jit(jax.grad(point_loss, argnums=(0, 1), has_aux=True))
    state = point.initial_state(3, dims)
    (dk, ds), (o, S) = run(k.at[0, 25, 0, 3].set(np.nan), state)
    (c_dk, c_ds), (co, cS) = run(k, state)
    out["pgdn"] = report(25, lengths, ([dk], [ds["S"], ds["precond"]], o, S),
                         ([c_dk], [c_ds["S"], c_ds["precond"]], co, cS))
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def context_faults():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  out = subprocess.run([sys.executable, "-c", _CONTEXT], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-4000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["spanning", "spanning, on the second shard", "ending on the boundary", "pgdn"])
def test_context_parallel_fault_stays_in_its_segment(context_faults, case):
  """A NaN in a packed segment on 2 shards: the other segments' outputs, final states and input gradients (q, k,
  v, β, their initial states) equal the clean run's, also when the faulty segment ends on the shard boundary."""
  r = context_faults[case]
  assert not r["o after the fault finite"] and not r["final state of the faulty segment finite"], r
  for name in ("o before the fault", "o of the other segments", "final states of the other segments",
               "gradients of the other segments", "initial-state gradients of the other segments"):
    assert r[name] <= 1e-5, (name, r)


# ---------------------------------------------------------------------------------------------------------
# The preconditioner kernels (interpret mode on CPU) with traced segment ids and no carried state.
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, packed", [("pdn", True), ("pgdn", True), ("pla", True), ("pgdn", False)])
def test_pallas_preconditioner_fault_stays_in_its_segment(name, packed):
  """A NaN in k at t = 10. Packed (segment 0 is tokens 0–19), segment starts are folded into a −30 log-decay: the
  rows before it and segment 1 are as in the clean run. Unpacked: the rows of its kernel chunk before it."""
  point = dgps.get(name)
  q, k, v, f, prm = random_point_inputs(point, DIMS, 0, B=B, T=T)
  state = {"S": jnp.zeros((2, DIMS.value_heads, DIMS.key_dim, DIMS.value_dim)), "precond": None} if packed else None
  run = jax.jit(lambda k, ids: point(q, k, v, f, prm, state=state, segment_ids=ids, chunk_size=C,
                                     implementation="pallas")[0])
  ids = jnp.asarray([[0] * 20 + [1] * 28], jnp.int32) if packed else None
  _assert_confined(run(_with_nan(k, 0, 10, 0, 3), ids), run(k, ids), _rows([(10, 20 if packed else T)]))
