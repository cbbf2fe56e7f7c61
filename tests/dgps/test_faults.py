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

REPO = pathlib.Path(__file__).resolve().parents[2]
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
def _shards_script(devices: int) -> str:
  """The opening of a fresh process's script with `devices` host devices on one "context" mesh axis: imports,
  the mesh, and f(*shape), normal fp32 draws from one seeded generator."""
  return textwrap.dedent(f"""
      import os, json
      os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count={devices}"
      import jax, jax.numpy as jnp, numpy as np
      from jax.sharding import PartitionSpec as P
      from osdn_jax import dgps
      from osdn_jax.ops import context
      from osdn_jax.testing import random_point_inputs
      mesh = jax.sharding.Mesh(np.array(jax.devices()), ("context",))
      rng = np.random.default_rng(0)
      f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
      """)


_CONTEXT = _shards_script(2) + textwrap.dedent("""
    B, T, H, K, V = 1, 64, 2, 16, 16                      # 32 tokens per shard
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


# ---------------------------------------------------------------------------------------------------------
# The packed XLA second moment (an affine scan with segment resets): the gradients of the next segment.
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["k", "beta", "log_decay"])
def test_packed_second_moment_fault_leaves_the_next_segments_gradients_clean(where):
  """A NaN at t = 10 in segment 0 (tokens 0–19) of a packed row: the second moment A_t of segment 1, and the
  gradients of its inputs (k, βᴾ, gᴾ) and of its initial state, equal the clean run's; segment 0 is non-finite
  from t on (in the key channel of the NaN; a NaN in βᴾ or gᴾ reaches every channel). The scan's combine drops the earlier part at a reset, so its backward must not multiply the NaN
  there by the zero cotangent of the dropped branch."""
  rng = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  k, beta_p, log_decay_p = f(B, T, 2, 8), jax.nn.sigmoid(f(B, T, 2)), -jax.nn.softplus(f(B, T, 2))
  s0, w, w_last = jnp.abs(f(2, 2, 8)), f(B, T, 2, 8), f(2, 2, 8)
  ids = jnp.asarray([[0] * 20 + [1] * 28], jnp.int32)

  def loss(k, beta_p, log_decay_p, s0):
    A, last = precond.second_moment(k, beta_p, log_decay_p, initial_state=s0, segment_ids=ids,
                                    implementation="xla")
    return jnp.sum(A * w) + jnp.sum(last * w_last), (A, last)

  run = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
  clean_args = (k, beta_p, log_decay_p, s0)
  index = {"k": (0, (0, 10, 0, 3)), "beta": (1, (0, 10, 0)), "log_decay": (2, (0, 10, 0))}[where]
  faulty_args = list(clean_args)
  faulty_args[index[0]] = faulty_args[index[0]].at[index[1]].set(np.nan)
  (grads, (A, last)), (c_grads, (cA, c_last)) = run(*faulty_args), run(*clean_args)
  assert not np.isfinite(np.asarray(A)[0, 10:20, 0, 3]).any() and not np.isfinite(np.asarray(last)[0, 0, 3])
  np.testing.assert_allclose(A[:, :10], cA[:, :10], rtol=1e-6)
  np.testing.assert_allclose(A[:, 20:], cA[:, 20:], rtol=1e-6)
  np.testing.assert_allclose(last[1], c_last[1], rtol=1e-6)
  for name, g, c in zip(("k", "beta_p", "log_decay_p"), grads[:3], c_grads[:3]):
    assert np.isfinite(np.asarray(g)[:, 20:]).all(), f"a NaN in {where} crossed the reset into ∂{name}"
    np.testing.assert_allclose(g[:, 20:], c[:, 20:], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grads[3][1], c_grads[3][1], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# Context parallelism over 4 devices: linear attention's composed maps and OSDN's ring of P − 1 rounds.
# ---------------------------------------------------------------------------------------------------------
_RING = _shards_script(4) + textwrap.dedent("""
    B, T, H, K, V = 2, 64, 2, 8, 8                        # 16 tokens per shard
    tok = P(None, "context")
    w_o = f(B, T, H, V)
    def err(x, y):
      x, y = np.asarray(x), np.asarray(y)
      return float(np.max(np.abs(x - y), initial=0.0)) if np.isfinite(x).all() else float("inf")
    def report(t, seq, n, faulty, clean):
      # The NaN is in k of row 0, key head 0, at token t of the sequence holding row 0's tokens `seq` (state n).
      # faulty, clean: (o [B, T, HV, V], final states [N, HV, ...], per-token gradients [B, T, H|HV, ...],
      # initial-state gradients [N, HV, ...]). Everything outside that sequence's head 0 must be the clean run's.
      (o, finals, grads, s_grads), (co, c_finals, c_grads, c_s_grads) = faulty, clean
      def outside(x, c, per_token):
        hit = np.zeros(np.shape(x)[:3 if per_token else 2], bool)
        if per_token:
          hit[0, seq, 0] = True
        else:
          hit[n, 0] = True
        return err(np.asarray(x)[~hit], np.asarray(c)[~hit])
      return {
          "o before the fault": err(o[0, :t, 0], co[0, :t, 0]),
          "o elsewhere": outside(o, co, True),
          "finite o rows of the sequence from the fault on": int(np.isfinite(np.asarray(o)[0, t:seq.stop, 0]).all(-1).sum()),
          "final states elsewhere": max(outside(x, c, False) for x, c in zip(finals, c_finals)),
          "gradients elsewhere": max(outside(x, c, True) for x, c in zip(grads, c_grads)),
          "initial-state gradients elsewhere": max(outside(x, c, False) for x, c in zip(s_grads, c_s_grads)),
      }
    out = {}
    # Linear attention with a decay: the NaN on shard 0 (t = 5) or shard 2 (t = 40).
    w_s = f(B, H, K, V)
    def la_loss(q, k, v, g, s0):
      body = lambda q, k, v, g: context.linear_attention(q, k, v, log_decay=g, initial_state=s0,
          output_final_state=True, chunk_size=16, axis_name="context", implementation="xla")
      o, S = jax.shard_map(body, mesh=mesh, in_specs=(tok,) * 4, out_specs=(tok, P()), check_vma=False)(q, k, v, g)
      return jnp.sum(o * w_o) + jnp.sum(S * w_s), (o, S)
    run = jax.jit(jax.grad(la_loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
    q, k, v, g, s0 = f(B, T, H, K) / 4, f(B, T, H, K) / 4, f(B, T, H, V), -jax.nn.softplus(f(B, T, H)), f(B, H, K, V)
    c_grads, (co, cS) = run(q, k, v, g, s0)
    for t in (5, 40):
      grads, (o, S) = run(q, k.at[0, t, 0, 3].set(np.nan), v, g, s0)
      out[f"linear attention, t={t}"] = report(t, slice(0, T), 0, (o, [S], grads[:4], grads[4:]),
                                               (co, [cS], c_grads[:4], c_grads[4:]))
    # OSDN: d passes as a ring (clipped on the GDN backbone; unbounded with APF), unpacked with the NaN on shard 0
    # or 2; packed (row 0: segments of 20, 30 and 14 tokens, row 1: one) with the NaN in the segment that spans
    # shards 1 to 3.
    ids = jnp.asarray([[0] * 20 + [1] * 30 + [2] * 14, [3] * 64], jnp.int32)
    cases = [("osdn-gdn", {}, None, 5), ("osdn-gdn", {}, None, 40), ("osdn-apf", dict(d_min=None, d_max=None), None, 5),
             ("osdn-gdn", {}, ids, 25)]
    for name, opts, seg, t in cases:
      point, dims = dgps.get(name, **opts), dgps.Dims(H, H, K, V)
      q, k, v, feats, params = random_point_inputs(point, dims, 0, B=B, T=T)
      n_states = B if seg is None else 4
      fresh = point.initial_state(n_states, dims)
      state = {"S": f(*fresh["S"].shape) / 4, "precond": fresh["precond"] + 0.1 * jnp.abs(f(*fresh["precond"].shape))}
      w_S, w_d = f(*fresh["S"].shape), f(*fresh["precond"].shape)
      def point_loss(q, k, v, feats, state):
        body = lambda q, k, v, feats, seg: point(q, k, v, feats, params, state=state, output_final_state=True,
                                                 segment_ids=seg, implementation="xla", chunk_size=16,
                                                 context="context")
        fspec = jax.tree.map(lambda _: tok, feats)
        o, fin = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, fspec, None if seg is None else tok),
                               out_specs=(tok, P()), check_vma=False)(q, k, v, feats, seg)
        return jnp.sum(o * w_o) + jnp.sum(fin["S"] * w_S) + jnp.sum(fin["precond"] * w_d), (o, fin)
      run = jax.jit(jax.grad(point_loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
      parts = lambda gr: (list(gr[:3]) + jax.tree.leaves(gr[3]), [gr[4]["S"], gr[4]["precond"]])
      c_grads, (co, cfin) = run(q, k, v, feats, state)
      grads, (o, fin) = run(q, k.at[0, t, 0, 3].set(np.nan), v, feats, state)
      seq, n = (slice(0, T), 0) if seg is None else (slice(20, 50), 1)
      out[f"{name}, t={t}" + (", packed" if seg is not None else "")] = report(
          t, seq, n, (o, [fin["S"], fin["precond"]], *parts(grads)), (co, [cfin["S"], cfin["precond"]], *parts(c_grads)))
    print(json.dumps(out))
""")
_RING_CASES = ["linear attention, t=5", "linear attention, t=40", "osdn-gdn, t=5", "osdn-gdn, t=40", "osdn-apf, t=5",
               "osdn-gdn, t=25, packed"]


@pytest.fixture(scope="module")
def ring_faults():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  out = subprocess.run([sys.executable, "-c", _RING], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
  assert out.returncode == 0, out.stderr[-4000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow   # one process for all cases: about 14 s on 2 cores
@pytest.mark.parametrize("case", _RING_CASES)
def test_context_parallel_fault_stays_in_its_head_over_four_shards(ring_faults, case):
  """A NaN in k (row 0, key head 0) on 4 shards, through `context.linear_attention`'s composed maps and through
  OSDN's d, which passes between the shards as a ring of 3 rounds (`context.carry`; clipped, unbounded, packed
  with the faulty segment spanning shards 1–3): the outputs before it, and the outputs, final states (the
  solve's and d) and input gradients (q, k, v, every feature, both initial states) of the other row, the other
  head and the other packed segments equal the clean run's; the faulty sequence's head is non-finite from t on."""
  r = ring_faults[case]
  assert r["finite o rows of the sequence from the fault on"] == 0, r
  for name in ("o before the fault", "o elsewhere", "final states elsewhere", "gradients elsewhere",
               "initial-state gradients elsewhere"):
    assert r[name] <= 1e-5, (name, r)
