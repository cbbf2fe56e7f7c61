"""`check_point`: what every point must satisfy, as one call a notebook can make on a point it composed.

    report = dgps.check_point(point, dgps.Dims(heads=2, value_heads=2, key_dim=16, value_dim=16))
    assert report["ok"], report

Four checks, each on fresh random projected inputs (fp64 where x64 is on, else fp32) with a carried, non-zero
initial state:
  chunked    the chunked path (`implementation`, default "xla") against the point's token-serial reference
             composition ("reference"): the output and both final states;
  chaining   the sequence cut in two, the second call starting from the first's final state, against one call;
             for a preconditioner state carried "diagonal" (`dgps.State`) also the second half's final state
             composed as context parallelism composes it (a ⊙ entering + b, from entering states 0 and 1);
  decoding   `Point.step` token by token against the forward;
  gradients  the gradients of a random projection of the output with respect to q, k, v, every feature and
             parameter and the initial states, chunked against reference, all finite.
Each entry of the report is the largest relative RMS error of its check (rms(x − y) / rms(y)); "ok" is whether
every one is below `tol`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from osdn_jax.dgps.registry import Dims, Point


def _rel(x, y) -> float:
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  den = np.sqrt(np.mean(y ** 2))
  num = np.sqrt(np.mean((x - y) ** 2))
  return float(num / den) if den > 0 else float(num)


def _worst(a, b) -> float:
  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b))
  return max((_rel(x, y) for x, y in pairs), default=0.0)


def random_inputs(point: Point, dims: Dims, seed: int, *, batch: int = 2, length: int = 37, dtype=None):
  """(q, k, v, features, params, state): random projected inputs as a fresh layer would give them (features
  N(0, 1) plus their projection's initial bias), the point's initial parameters, and a random initial state
  (the preconditioner's a positive perturbation of its initial value: entrywise, or X Xᵀ for a matrix state)."""
  dtype = dtype or (jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  q, k = f(batch, length, dims.heads, dims.key_dim), f(batch, length, dims.heads, dims.key_dim)
  v = f(batch, length, dims.value_heads, dims.value_dim)
  features = {w: {n: f(batch, length, *ft.resolve(dims)) + (ft.bias or 0.0) for n, ft in fs.items()}
              for w, fs in point.features().items()}
  params = jax.tree.map(lambda a: jnp.asarray(a, dtype), point.init_params(jax.random.key(seed), dims))
  s0 = point.initial_state(batch, dims, dtype)
  p0 = s0["precond"]
  if p0 is not None and point.axis("precond").state.matrix:   # a K×K state: a symmetric positive perturbation
    x = f(*p0.shape)
    p0 = p0 + 0.2 * jnp.einsum("...ij,...kj->...ik", x, x) / dims.key_dim
  elif p0 is not None:
    p0 = p0 + 0.2 * jnp.abs(f(*p0.shape))
  state = {"S": 0.3 * f(*s0["S"].shape), "precond": p0}
  return q, k, v, features, params, state


def check_point(point: Point, dims: Dims, *, seed: int = 0, length: int = 37, implementation: str = "xla",
                chunk_size: int = 16, tol: float | None = None) -> dict:
  """The report of the module docstring's four checks for `point` at `dims` ({check: worst relative error,
  "ok": bool}). tol: default 1e-8 under x64, else 2e-4 (fp32 rounding of chunked against token-serial sums)."""
  tol = tol if tol is not None else (1e-8 if jax.config.jax_enable_x64 else 2e-4)
  q, k, v, feats, params, state = random_inputs(point, dims, seed, length=length)

  def run(impl, q, k, v, feats, params, state):
    return point(q, k, v, feats, params, state=state, output_final_state=True, chunk_size=chunk_size,
                 implementation=impl)

  fast, ref = run(implementation, q, k, v, feats, params, state), run("reference", q, k, v, feats, params, state)
  report = {"chunked": _worst(fast, ref)}

  cut = length // 2 + 1
  part = lambda tree, s: jax.tree.map(lambda a: a[:, s], tree)
  first = run(implementation, q[:, :cut], k[:, :cut], v[:, :cut], part(feats, slice(None, cut)), params, state)
  second = run(implementation, q[:, cut:], k[:, cut:], v[:, cut:], part(feats, slice(cut, None)), params, first[1])
  report["chaining"] = _worst((jnp.concatenate([first[0], second[0]], 1), second[1]), fast)
  st = point.axis("precond").state
  if st is not None and st.carry == "diagonal":
    # The declared carry: the second half's final state as a ⊙ entering + b, a and b from entering 0 and 1 (the
    # maps context parallelism composes), against the second half run from the first's final state.
    entering = first[1]["precond"]
    from_ = lambda value: run(implementation, q[:, cut:], k[:, cut:], v[:, cut:], part(feats, slice(cut, None)),
                              params, dict(first[1], precond=jnp.full_like(entering, value)))[1]["precond"]
    b = from_(0.0)
    report["chaining"] = max(report["chaining"], _rel((from_(1.0) - b) * entering + b, second[1]["precond"]))

  outs, s = [], state
  for t in range(length):
    o, s = point.step(q[:, t], k[:, t], v[:, t], part(feats, t), params, s)
    outs.append(o)
  report["decoding"] = _worst((jnp.stack(outs, 1), s), ref)

  probe = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(fast[0].shape), fast[0].dtype)

  def loss(impl, args):
    o, final = run(impl, *args)
    return jnp.sum(o * probe) + sum(jnp.sum(x) for x in jax.tree.leaves(final))

  args = (q, k, v, feats, params, state)
  g_fast, g_ref = jax.grad(loss, argnums=1)(implementation, args), jax.grad(loss, argnums=1)("reference", args)
  finite = all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(g_fast))
  report["gradients"] = _worst(g_fast, g_ref) if finite else float("inf")
  report["ok"] = all(err < tol for err in report.values())
  return report
