"""Context parallelism (`osdn_jax.ops.context`): T split over 8 fake CPU devices equals the unsplit solve.

Every case runs in a fresh process with 8 host devices (the device count is fixed when JAX starts) and the
suite's XLA flags (`tests/conftest.py`: fast compilation). The points run under `shard_map` with T split over the
"context" axis and compare with the same point unsplit: the fp64 token-serial reference for values (outputs, the
solve's and the preconditioner's final states), the unsplit XLA or Pallas (interpret) path for every input
gradient (q, k, v, features, parameters, initial states). Inputs are drawn afresh every run; a failure prints its
seed.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

_CASES = textwrap.dedent("""
    import os, sys, json
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    jax.config.update("jax_enable_x64", True)
    from osdn_jax import dgps
    from osdn_jax.ops import packing
    assert jax.device_count() == 8
    mode, names, impl, seed = sys.argv[1], sys.argv[2].split(","), sys.argv[3], int(sys.argv[4])
    packings = [p == "packed" for p in sys.argv[5].split(",")]
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("context",))
    rng = np.random.default_rng(seed)
    B, T, H, K, HV, V = 2, 56, 2, 8, 4, 6        # 7 tokens per shard
    dims = dgps.Dims(H, HV, K, V)
    dt = jnp.float64 if impl != "pallas" else jnp.float32
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dt)
    def ids_spanning():
      ids = np.zeros((B, T), np.int32)                  # row 0: a segment over shards 1-4, one starting on a
      ids[0, 5:] = 1; ids[0, 35:] = 2; ids[0, 42:] = 3  # boundary (42 = 6·7), one within a shard
      ids[1, 20:] = 1; ids[1, 21:] = 2                  # row 1: a one-token segment
      return ids
    worst = {}
    for name in names:
      pt = dgps.get(name)
      for packed in packings:
        q, k, v = f(B, T, H, K), f(B, T, H, K), f(B, T, HV, V)
        feats = jax.tree.map(lambda s: f(B, T, *s), pt.feature_shapes(dims), is_leaf=lambda x: isinstance(x, tuple))
        params = jax.tree.map(lambda a: jnp.asarray(a, dt) + 0.1 * f(*np.shape(a)),
                              pt.init_params(jax.random.key(seed), dims))
        seg = jnp.asarray(ids_spanning()) if packed else None
        n = packing.num_segments(ids_spanning()) if packed else B
        st = pt.initial_state(n, dims, dt)
        st = {"S": f(*st["S"].shape),
              "precond": None if st["precond"] is None else st["precond"] + 0.3 * jnp.abs(f(*st["precond"].shape))}
        tok = P(None, "context")
        def split(q, k, v, feats, params, st, seg):
          body = lambda q, k, v, feats, seg: pt(q, k, v, feats, params, state=st, output_final_state=True,
                                                segment_ids=seg, implementation=impl, chunk_size=16, context="context")
          return jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, tok, None if seg is None else tok),
                               out_specs=(tok, P()), check_vma=False)(q, k, v, feats, seg)
        def whole(q, k, v, feats, params, st, seg, implementation=impl):
          return pt(q, k, v, feats, params, state=st, output_final_state=True, segment_ids=seg,
                    implementation=implementation, chunk_size=16)
        args = (q, k, v, feats, params, st)
        if mode == "values":
          got = jax.jit(split)(*args, seg)
          want = whole(*args, seg, implementation="reference")
        else:
          w_o = f(B, T, HV, V)
          def loss(fn):
            def l(*a):
              o, fin = fn(*a, seg)
              s = jnp.sum(o * w_o) + jnp.sum(jnp.sin(fin["S"]))
              return s + (0.0 if fin["precond"] is None else jnp.sum(jnp.sin(fin["precond"])))
            return jax.jit(jax.grad(l, argnums=tuple(range(6))))
          got, want = loss(split)(*args), loss(whole)(*args)
        for path, a in jax.tree_util.tree_flatten_with_path(want)[0]:
          b = got
          for key in path:
            b = b[key.idx] if hasattr(key, "idx") else b[key.key]
          scale = max(float(jnp.max(jnp.abs(a))), 1e-30)
          err = float(jnp.max(jnp.abs(b - a))) / scale
          tag = f"{name} packed={packed} {jax.tree_util.keystr(path)}"
          worst[tag] = err
    print(json.dumps(worst))
""")


def _run(mode: str, names: list[str], implementation: str, tol: float, packings: str = "unpacked,packed") -> None:
  seed = int(np.random.SeedSequence().entropy % 2**31)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  out = subprocess.run([sys.executable, "-c", _CASES, mode, ",".join(names), implementation, str(seed), packings],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
  assert out.returncode == 0, f"seed {seed}\n{out.stderr[-4000:]}"
  worst = json.loads(out.stdout.strip().splitlines()[-1])
  bad = {k: v for k, v in worst.items() if not v <= tol}
  assert not bad, f"seed {seed}: relative max errors above {tol}: {bad}"


# The quick suite: every value of every DGPS axis (decay scalar and channel, gain sigmoid and one, preconditioner
# identity, pdn, osdn-apf and atq, solve online and offline) in four points; every point of the registry in the
# slow one.
QUICK = ["kda", "pgdn", "osdn-apf-gdn", "pmamba2"]
ALL = ["dn", "gdn", "kda", "pdn", "pgdn", "pkda", "osdn", "osdn-gdn", "osdn-kda", "osdn-apf", "osdn-apf-gdn",
       "osdn-apf-kda", "dn-fixed-d", "la", "retnet", "mamba2", "gla", "pla", "pmamba2", "pgla", "longhorn", "nlms"]


@pytest.mark.slow     # `make test`: packed segments over context shards (tests/dgps/test_faults.py, test_compose.py)
def test_context_parallel_values_equal_the_oracle():
  """Outputs and final states (solve and preconditioner) of the split solve against the fp64 oracle, packed
  (segments spanning shards, starting on a shard boundary, of one token) and not, with initial states."""
  _run("values", QUICK, "xla", 1e-9)


@pytest.mark.slow     # `make test`: the values; the gradients of packed segments (tests/dgps/test_faults.py)
def test_context_parallel_gradients_equal_the_unsplit_ones():
  """Every input gradient (q, k, v, features, parameters, initial states) through the ring and the gathered
  state maps equals the unsplit XLA path's: a per-channel decay with OSDN-APF's carry (the slow step: the
  offline solve with the second moment's carry, and more points)."""
  _run("grads", ["osdn-apf-kda"], "xla", 1e-9)


@pytest.mark.slow
def test_context_parallel_gradients_of_more_points():
  _run("grads", ["pgla", "gdn", "pdn", "osdn"], "xla", 1e-9)


@pytest.mark.slow
def test_every_point_context_parallel_values():
  _run("values", ALL, "xla", 1e-9)


@pytest.mark.slow
def test_every_point_context_parallel_gradients():
  """Packed (the bookkeeping of segments across shards); the unpacked path's gradients are in the quick test."""
  _run("grads", ALL, "xla", 1e-9, "packed")


@pytest.mark.slow
def test_context_parallel_pallas_kernels():
  """The Pallas kernels (interpret mode, fp32) inside the split solve: values against the oracle and gradients
  against the unsplit kernels."""
  _run("values", ["dn", "gdn", "kda", "la"], "pallas", 1e-4)
  _run("grads", ["gdn", "kda"], "pallas", 1e-4)


_TRAIN_STEP = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, numpy as np, optax
    jax.config.update("jax_enable_x64", False)
    from osdn_jax.train import configs, loop, mesh as mesh_lib
    from osdn_jax.train.step import init_state, graphdef, make_train_step, segments_bound
    c = configs.get_config("tiny"); c.model = sys.argv[1]
    shapes = [tuple(int(x) for x in s.split("x")) for s in sys.argv[2].split(",")]
    cfg = loop.model_config(c, 256)
    tx = optax.sgd(1.0)          # the update is the gradient itself
    rng = np.random.default_rng(int(sys.argv[3]))
    t = rng.integers(0, 256, (4, 65)).astype(np.int32)
    seg = np.sort(rng.integers(0, 4, (4, 64)), axis=1).astype(np.int32)
    batch = dict(tokens=t[:, :-1], targets=t[:, 1:], segment_ids=seg, loss_mask=np.ones((4, 64), np.float32))
    def run(shape):
      m = mesh_lib.make_mesh(dict(zip(("data", "fsdp", "context", "tensor"), shape)),
                             jax.devices()[:int(np.prod(shape))])
      sh = loop.shard_state(jax.eval_shape(lambda: init_state(cfg, tx, 0)), m)
      state = jax.jit(lambda: init_state(cfg, tx, 0), out_shardings=sh)()
      before = jax.device_get(state["params"])
      fn = jax.jit(make_train_step(graphdef(cfg), tx, grad_accum=1, loss_chunk=16),
                   in_shardings=(sh, mesh_lib.batch_sharding(m)), out_shardings=(sh, None), static_argnums=2)
      with jax.set_mesh(m):
        state, met = fn(state, loop.global_batch(batch, mesh_lib.batch_sharding(m)), segments_bound(seg))
      return float(met["loss"]), jax.tree.map(lambda a, b: a - b, before, jax.device_get(state["params"]))
    loss0, g0 = run((1, 1, 1, 1))
    flat = lambda t: np.concatenate([x.ravel() for x in jax.tree.leaves(t)])
    for shape in shapes:
      loss, g = run(shape)
      assert abs(loss - loss0) <= 1e-6 * abs(loss0), (shape, loss, loss0)
      err = np.linalg.norm(flat(g) - flat(g0)) / np.linalg.norm(flat(g0))
      assert err <= 5e-5, (shape, err)     # sums split over devices round differently in fp32
      print(shape, "relative gradient error", err)
""")


def _train_step(model: str, shapes: str) -> None:
  seed = int(np.random.SeedSequence().entropy % 2**31)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  out = subprocess.run([sys.executable, "-c", _TRAIN_STEP, model, shapes, str(seed)], capture_output=True,
                       text=True, env=env, cwd=REPO, timeout=900)
  assert out.returncode == 0, f"seed {seed}\n{out.stderr[-4000:]}"


@pytest.mark.slow
def test_train_step_with_context_parallelism_equals_one_device():
  """A packed training step with the positions split over 8 devices: the loss and every parameter's gradient
  (here the SGD update) equal the one-device step's (fp32: loss to 1e-6, update to 5e-5 relative)."""
  _train_step("pgdn-tiny", "1x1x8x1")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gdn-tiny", "osdn-apf-gdn-tiny", "kda-tiny"])
def test_train_step_with_context_and_other_axes(model):
  """Context with data × tensor and with fsdp."""
  _train_step(model, "1x1x8x1,2x1x2x2,1x2x4x1")


def test_context_must_divide_the_length():
  from osdn_jax.train import mesh as mesh_lib

  class FakeMesh:
    shape = {"data": 1, "fsdp": 1, "context": 4, "tensor": 1}
  mesh_lib.check_length(64, FakeMesh())
  with pytest.raises(ValueError, match="mesh.context"):
    mesh_lib.check_length(62, FakeMesh())
