"""MesaNet's query preconditioner (`osdn_jax.dgps.mesa`): the chunked CG against the token-serial oracle, CG against
the exact solve, chaining through the K×K state, bf16 inputs with extreme gates, and bad arguments."""
import functools
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osdn_jax import dgps
from osdn_jax.dgps import mesa, precond
from osdn_jax.testing import close, rel_rms

NAMES = ("q", "k", "beta", "log_decay", "lam", "initial_state")


def _problem(seed, *, B=2, T=37, H=2, HV=4, K=16, decay=True, state=True, dtype=jnp.float64):
  """Unit q and k [B, T, H, K], β = σ(N(0, 1)) and g = log σ(N(0, 1) + 3) [B, T, HV], λ ∈ (0.25, ...) [HV, K] and a
  symmetric positive initial state [B, HV, K, K] (None with state=False)."""
  rng = np.random.default_rng(seed)
  f = lambda *s: rng.standard_normal(s)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  x = f(B, HV, K, K)
  args = dict(q=unit(f(B, T, H, K)), k=unit(f(B, T, H, K)), beta=1 / (1 + np.exp(-f(B, T, HV))),
              log_decay=-np.log1p(np.exp(-(f(B, T, HV) + 3))) if decay else None,
              lam=0.25 + np.log1p(np.exp(f(HV, K))),
              initial_state=0.2 * np.einsum("bhij,bhkj->bhik", x, x) / K if state else None)
  return {n: None if a is None else jnp.asarray(a, dtype) for n, a in args.items()}


def _run(args, **kw):
  a = dict(args)
  return mesa.mesa_query(a.pop("q"), a.pop("k"), a.pop("beta"), a.pop("log_decay"), **a, **kw)


def _grads(args, **kw):
  """(q̃, H_T) and the gradients of every given input under fixed random cotangents on both."""
  names = [n for n in NAMES if args[n] is not None]

  @functools.partial(jax.jit, static_argnames=())
  def fn(diff):
    def loss(diff):
      x, H = _run(dict(args, **diff), **kw)
      wx = jnp.cos(jnp.arange(x.size, dtype=jnp.float64)).reshape(x.shape)
      wh = jnp.sin(jnp.arange(H.size, dtype=jnp.float64)).reshape(H.shape)
      return jnp.sum(x.astype(jnp.float64) * wx) + jnp.sum(H.astype(jnp.float64) * wh), (x, H)
    return jax.grad(loss, has_aux=True)(diff)

  grads, out = fn({n: args[n] for n in names})
  return out, grads


CASES = [  # (T, chunk, H, HV, decay, carried state)
    (37, 16, 2, 4, True, True),      # odd length, grouped value heads, carried state
    (1, 64, 2, 2, True, True),       # one token (decoding's shape)
    (100, 32, 1, 1, False, False),   # no decay, fresh state, T not a multiple of the chunk
    (63, 64, 2, 2, True, False),     # T < C
]


@pytest.mark.parametrize("T,chunk,H,HV,decay,state", CASES)
def test_chunked_cg_matches_the_serial_oracle_with_gradients(T, chunk, H, HV, decay, state):
  """fp64: the chunked CG equals the token-serial CG (same iterations) in q̃, H_T and every input's gradient."""
  args = _problem(T, T=T, H=H, HV=HV, decay=decay, state=state)
  (x, H_T), g = _grads(args, implementation="xla", chunk_size=chunk)
  (x_r, H_r), g_r = _grads(args, implementation="reference")
  assert x.shape == (2, T, HV, 16) and H_T.shape == (2, HV, 16, 16)
  assert rel_rms(x, x_r) < 1e-10 and rel_rms(H_T, H_r) < 1e-12
  assert set(g) == set(g_r) == {n for n in NAMES if args[n] is not None}
  for n in g:
    assert rel_rms(g[n], g_r[n]) < 1e-9, n


def test_fp32_chunked_matches_the_fp64_oracle():
  """fp32 inputs (fp32 arithmetic) against the fp64 oracle fed the same values: the fp32 tolerances of the solves
  for q̃ and H_T, rtol 1e-4 for gradients (those of whole points, docs/design.md §4)."""
  args = _problem(1, T=45)
  (x, H_T), g = _grads(jax.tree.map(lambda a: a.astype(jnp.float32), args), implementation="xla", chunk_size=16)
  (x_r, H_r), g_r = _grads(args, implementation="reference")
  assert x.dtype == jnp.float32 and H_T.dtype == jnp.float32
  assert close(x, x_r, 1e-5, 1e-6) and close(H_T, H_r, 1e-5, 1e-6)
  for n in g:
    assert close(g[n], g_r[n], 1e-4, 1e-6), (n, rel_rms(g[n], g_r[n]))


def test_cg_against_the_exact_solve():
  """The default CG (30 iterations, tolerance 1e-6) against a dense solve per token: q̃ and every gradient within
  2e-5 relative here (T = 200, K = 32, decays near 1, λ from 0.25). With the tolerance at 0 and enough iterations
  CG is the exact solve to rounding."""
  args = _problem(2, T=200, H=2, HV=2, K=32)
  args["log_decay"] = args["log_decay"] / 10                               # slow decay: H_t grows large
  (x, _), g = _grads(args, implementation="reference")
  (x_e, _), g_e = _grads(args, implementation="reference", solver="exact")
  assert 0 < rel_rms(x, x_e) < 2e-5
  for n in g:
    assert rel_rms(g[n], g_e[n]) < 2e-5, (n, rel_rms(g[n], g_e[n]))
  (x_long, _), _ = _grads(args, implementation="xla", cg_steps=64, cg_tol=0.0)
  assert rel_rms(x_long, x_e) < 1e-10


def test_exact_solve_without_decay_is_the_exact_preconditioner():
  """No decay, λ = 1 everywhere and H_0 = 0: (H_t + I)⁻¹ q_t is the exact preconditioner's read query
  (`precond.exact_query`, the Gram of docs/design.md §1.4)."""
  args = _problem(3, T=20, H=2, HV=2, decay=False, state=False)
  args["lam"] = jnp.ones_like(args["lam"])
  x, _ = _run(args, implementation="reference", solver="exact")
  x_exact, _ = precond.exact_query(args["q"], args["k"], args["beta"], lam=1.0)
  assert rel_rms(x, x_exact) < 1e-10


def test_chaining_through_the_state_equals_one_call():
  args = _problem(4, T=50)
  x, H_T = _run(args, implementation="xla", chunk_size=16)
  cut = lambda a, s: a[:, s]
  first = dict(args, **{n: cut(args[n], slice(None, 21)) for n in ("q", "k", "beta", "log_decay")})
  x1, H1 = _run(first, implementation="xla", chunk_size=16)
  second = dict(args, initial_state=H1, **{n: cut(args[n], slice(21, None)) for n in ("q", "k", "beta", "log_decay")})
  x2, H2 = _run(second, implementation="xla", chunk_size=16)
  assert rel_rms(jnp.concatenate([x1, x2], 1), x) < 1e-12 and rel_rms(H2, H_T) < 1e-12


# Packed rows: segments of 13, 17 and 10 tokens in row 0, of 16, 1 and 23 in row 1.
_SEGS = [(0, 0, 13), (0, 13, 30), (0, 30, 40), (1, 0, 16), (1, 16, 17), (1, 17, 40)]


def _packed_ids():
  ids = np.zeros((2, 40), np.int32)
  for n, (b, s, e) in enumerate(_SEGS):
    ids[b, s:e] = n
  return jnp.asarray(ids)


def test_packed_rows_match_each_segment_alone():
  """Chunked (no initial states) and token-serial (per-segment initial states) packed runs against each segment
  run alone, q̃ and the per-segment final states; the chunked packed gradients against the token-serial ones."""
  args = _problem(6, T=40, state=False)
  ids = _packed_ids()
  x, H = _run(args, segment_ids=ids, implementation="xla", chunk_size=16)
  assert H.shape == (len(_SEGS), 4, 16, 16)
  x0 = jnp.asarray(np.random.default_rng(0).standard_normal((len(_SEGS), 4, 16, 16)))
  H0 = 0.2 * jnp.einsum("nhij,nhkj->nhik", x0, x0) / 16
  x_r, H_r = _run(dict(args, initial_state=H0), segment_ids=ids, implementation="reference")
  for n, (b, s, e) in enumerate(_SEGS):
    alone = {name: (a[b:b + 1, s:e] if name in ("q", "k", "beta", "log_decay") else a) for name, a in args.items()}
    x1, H1 = _run(alone, implementation="reference")
    assert rel_rms(x[b, s:e], x1[0]) < 1e-10 and rel_rms(H[n], H1[0]) < 1e-10, n
    x1, H1 = _run(dict(alone, initial_state=H0[n:n + 1]), implementation="reference")
    assert rel_rms(x_r[b, s:e], x1[0]) < 1e-12 and rel_rms(H_r[n], H1[0]) < 1e-12, n
  (_, _), g = _grads(args, segment_ids=ids, implementation="xla", chunk_size=16)
  (_, _), g_r = _grads(args, segment_ids=ids, implementation="reference")
  for n in g:
    assert rel_rms(g[n], g_r[n]) < 1e-9, n
  traced, none = jax.jit(lambda ids: _run(args, segment_ids=ids, implementation="xla", chunk_size=16))(ids)
  assert none is None and rel_rms(traced, x) < 1e-12


def test_bf16_inputs_with_extreme_gates_stay_finite_and_match_the_oracle():
  """bf16 q and k, log-decays −1e3 and 0, β = 0 and 1, zero keys and a zero query: q̃, H_T and every gradient are
  finite, and q̃ matches the fp64 oracle fed the bf16 values at the bf16 tolerance."""
  args = _problem(5, T=40, H=2, HV=2)
  g = args["log_decay"].at[:, 5].set(-1e3).at[:, 6:9].set(0.0)
  beta = args["beta"].at[:, 10].set(0.0).at[:, 11:14].set(1.0)
  k = args["k"].at[:, 15].set(0.0)
  q = args["q"].at[:, 16].set(0.0)
  args = dict(args, q=q.astype(jnp.bfloat16), k=k.astype(jnp.bfloat16), beta=beta.astype(jnp.float32),
              log_decay=g.astype(jnp.float32), lam=args["lam"].astype(jnp.float32),
              initial_state=args["initial_state"].astype(jnp.float32))
  (x, H_T), grads = _grads(args, implementation="xla", chunk_size=16)
  assert x.dtype == jnp.bfloat16 and H_T.dtype == jnp.float32
  for a in (x, H_T, *grads.values()):
    assert bool(jnp.all(jnp.isfinite(a.astype(jnp.float32))))
  assert bool(jnp.all(x[:, 16] == 0))
  wide = jax.tree.map(lambda a: a.astype(jnp.float64), args)
  (x_r, H_r), g_r = _grads(wide, implementation="reference")
  assert close(x, x_r, 1e-2, 1e-5) and close(H_T, H_r, 1e-2, 1e-5)
  for n in ("q", "k"):
    assert close(grads[n], g_r[n], 1.5e-2, 1e-5), n
  for n in ("beta", "log_decay"):
    assert close(grads[n], g_r[n], 3e-2, 1e-5), n


@pytest.mark.slow     # `make test`: the point against its serial composition (test_points) and the tests here
def test_the_point_passes_check_point_and_decodes():
  report = dgps.check_point(dgps.get("mesa"), dgps.Dims(heads=2, value_heads=4, key_dim=8, value_dim=8), length=9)
  assert report["ok"], report
  point = dgps.get("mesa", cg_steps=5, cg_tol=0.0)
  assert point.opts["cg_steps"] == 5 and point.initial_state(3, dgps.Dims(2, 4, 8, 8))["precond"].shape == (3, 4, 8, 8)


BAD = [
    (dict(q=jnp.zeros((2, 5, 2))), "`q` must be an array \\[B, T, H, K\\]"),
    (dict(k=jnp.zeros((2, 5, 2, 4))), "`k` must be of q's shape"),
    (dict(q=jnp.zeros((2, 5, 2, 8), jnp.int32)), "`q` must be a floating array"),
    (dict(beta=jnp.zeros((2, 5, 3))), "`beta` must be \\[B, T, HV\\]"),
    (dict(log_decay=jnp.zeros((2, 5, 4, 8))), "`log_decay` must be a scalar decay per value head"),
    (dict(log_decay=jnp.zeros((2, 4, 4))), "`log_decay` must be of shape \\[B, T, HV\\]"),
    (dict(lam=jnp.ones((3, 8))), "`lam` must be broadcastable to \\[HV, K\\]"),
    (dict(lam=jnp.zeros((4, 8))), "`lam` must be a finite number > 0"),
    (dict(initial_state=jnp.zeros((2, 4, 8))), "`initial_state` must be of shape \\[B, HV, K, K\\]"),
    (dict(cg_steps=0), "`cg_steps` must be an int ≥ 1"),
    (dict(cg_tol=-1.0), "`cg_tol` must be a finite number ≥ 0"),
    (dict(solver="lu"), "`solver` must be one of"),
    (dict(solver="exact", implementation="xla"), "`solver`='exact' runs only with implementation 'reference'"),
    (dict(implementation="pallas"), "has no kernel"),
    (dict(implementation="fast"), "`implementation` must be one of"),
    (dict(segment_ids=jnp.zeros((2, 4), jnp.int32)), "`segment_ids` must be of shape \\[B, T\\]"),
    (dict(segment_ids=jnp.zeros((2, 5), jnp.int32), initial_state=jnp.zeros((2, 4, 8, 8))),
     "packed rows \\(`segment_ids`\\) with an `initial_state` run only with implementation 'reference'"),
    (dict(segment_ids=jnp.zeros((2, 5), jnp.int32), initial_state=jnp.zeros((3, 4, 8, 8)), implementation="reference"),
     "`initial_state` must be of shape \\[N, HV, K, K\\] = \\(2, 4, 8, 8\\)"),
]


@pytest.mark.parametrize("bad,match", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_arguments_name_themselves(bad, match):
  args = dict(q=jnp.ones((2, 5, 2, 8)), k=jnp.ones((2, 5, 2, 8)), beta=jnp.ones((2, 5, 4)),
              log_decay=jnp.zeros((2, 5, 4)), lam=jnp.ones((4, 8)))
  args.update(bad)
  with pytest.raises(ValueError, match=match):
    _run(args)


@pytest.mark.parametrize("options,match", [
    (dict(lam_min=0.0), "`lam_min` must be a finite number > 0"),
    (dict(lam_min=1.0, lam_init=1.0), "`lam_init` \\(1.0\\) must be > `lam_min` \\(1.0\\)"),
    (dict(cg_steps=2.5), "`cg_steps` must be an int ≥ 1"),
    (dict(cg_tol=float("nan")), "`cg_tol` must be a finite number ≥ 0"),
])
def test_bad_point_options_name_themselves(options, match):
  with pytest.raises(ValueError, match=match):
    dgps.get("mesa", **options)


def test_a_per_channel_decay_is_refused_when_the_point_runs():
  point = dgps.compose(decay="channel", gain="sigmoid", precond="mesa", solve="offline")
  dims = dgps.Dims(2, 2, 8, 8)
  params = point.init_params(jax.random.key(0), dims)
  f = {w: {n: jnp.zeros((1, 3) + s) for n, s in fs.items()} for w, fs in point.feature_shapes(dims).items()}
  x = jnp.ones((1, 3, 2, 8))
  with pytest.raises(ValueError, match="per-channel decay"):
    point(x, x, x, f, params)


@pytest.mark.parametrize("implementation", ["xla", "reference"])
def test_a_nonfinite_key_stays_in_its_sequence_from_its_token_on(implementation):
  """A NaN key at token 20 of row 0 (inside a chunk): row 0's q̃ before it and all of row 1 keep their clean values;
  in the value heads that read it, row 0's q̃ from token 20 on and its final state hold NaN (every entry in the
  chunked form, at least one in the oracle's)."""
  args = _problem(7, T=40, state=False)
  clean, H = _run(args, implementation=implementation, chunk_size=16)
  bad = dict(args, k=args["k"].at[0, 20, 1, 3].set(jnp.nan))
  x, H_bad = _run(bad, implementation=implementation, chunk_size=16)
  np.testing.assert_array_equal(np.asarray(x[0, :20]), np.asarray(clean[0, :20]))
  np.testing.assert_array_equal(np.asarray(x[1]), np.asarray(clean[1]))
  assert bool(jnp.all(jnp.any(jnp.isnan(x[0, 20:, 2:]), axis=-1)))
  assert bool(jnp.all(jnp.any(jnp.isnan(H_bad[0, 2:]), axis=(-2, -1))))
  assert bool(jnp.all(jnp.isfinite(x[0, 20:, :2])))                          # value heads 0, 1 read key head 0
  np.testing.assert_array_equal(np.asarray(H_bad[1]), np.asarray(H[1]))


_SPLIT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    from osdn_jax import dgps
    from osdn_jax.testing import random_point_inputs, rel_rms
    point, dims = dgps.get("mesa"), dgps.Dims(2, 2, 8, 4)
    q, k, v, feats, params = random_point_inputs(point, dims, 0, B=2, T=32)
    whole, fin = jax.jit(lambda q, k, v, f: point(q, k, v, f, params, output_final_state=True, chunk_size=16))(
        q, k, v, feats)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("context",))
    tok = P(None, "context")
    body = lambda q, k, v, f: point(q, k, v, f, params, output_final_state=True, chunk_size=16, context="context")
    specs = (tok, tok, tok, jax.tree.map(lambda _: tok, feats))
    split, sfin = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(tok, P()), check_vma=False))(
        q, k, v, feats)
    print("errors", rel_rms(split, whole), rel_rms(sfin["S"], fin["S"]), rel_rms(sfin["precond"], fin["precond"]))
""")


def test_the_point_splits_over_context_shards(tmp_path):
  """Context parallelism on two host devices: the K×K state carried "diagonal" gives the unsplit outputs and states."""
  (tmp_path / "split.py").write_text(_SPLIT)
  repo = pathlib.Path(__file__).resolve().parents[2]
  path = os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))
  out = subprocess.run([sys.executable, str(tmp_path / "split.py")], capture_output=True, text=True, cwd=repo,
                       env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  errors = [float(x) for x in out.stdout.split("errors")[1].split()]
  assert len(errors) == 3 and max(errors) < 1e-5, errors


def test_a_bf16_model_with_packed_rows_has_finite_loss_and_gradients():
  """mesa-tiny in bf16 on packed rows (as the trainer feeds it), with a large forget-gate bias (decays near 1, H_t
  large) and the smallest λ: the loss and every parameter gradient are finite, and the gradients are not zero."""
  from flax import nnx

  from osdn_jax import layers, models
  model = models.build("mesa-tiny", rngs=nnx.Rngs(0), dtype=jnp.bfloat16, num_layers=1)
  mixers = [node for _, node in nnx.iter_graph(model) if isinstance(node, layers.DGPSMixer)]
  assert mixers
  for mixer in mixers:
    proj = mixer.features["decay"]["a"].proj
    proj.bias[...] = jnp.full_like(proj.bias[...], 8.0)
    raw = mixer.point_params["precond"]["lam_raw"]
    raw[...] = jnp.full_like(raw[...], -20.0)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 96)), jnp.int32)
  ids = jnp.asarray(np.repeat(np.array([[0, 1, 2], [3, 4, 5]]), [40, 50, 6], axis=1), jnp.int32)

  def loss(model):
    logits = model(tokens, segment_ids=ids).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1))

  value, grads = jax.jit(nnx.value_and_grad(loss))(model)
  leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
  assert np.isfinite(float(value)) and all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
  assert float(sum(jnp.sum(jnp.abs(g)) for g in leaves)) > 0
