"""A tour of the DGPS registry on random data (`make tour`).

For every named point: the chunked XLA path (fp32) against the point's own token-serial composition (fp64):
outputs, final state and the worst gradient over all inputs (q, k, v, projected features, parameters), as
relative RMS; `dgps.check_point`'s chaining (the sequence cut in two, carried through the final state) and
decoding (one token at a time) in fp64; then the diagnostics of the run: q_geo (closed form from the gates, and
measured through the recurrence), the range of the per-step eigenvalues, max ‖S_t‖₂ and the recall residual
of the final state on all stored pairs; and the forward time of each implementation.

  python -m experiments.tour [--config.batch=2 --config.length=256 --config.heads=2 --config.value_heads=4 \
      --config.dim=32 --config.chunk=64]

The settings are `Tour`'s fields, each `--config.FIELD=VALUE` (`experiments.config`; `--FIELD=VALUE` is the same).
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from experiments import config
from osdn_jax import dgps, diagnostics, plugins
from osdn_jax.testing import random_point_inputs, rel_rms



@dataclasses.dataclass(frozen=True)
class Tour:
  """The tour's sizes: B, T, H (key heads), HV (value heads, a multiple of H), K = V, the chunk size; the timed runs
  per implementation (their median is reported); the registry keys toured (default: all)."""
  batch: int = 2
  length: int = 256
  heads: int = 2
  value_heads: int = 4
  dim: int = 32
  chunk: int = 64
  repeats: int = 3
  points: tuple[str, ...] = ()


_EIG_TOKENS = 64   # per-step spectra are dense eigen-decompositions: only the first tokens


def _run_with_grads(point, inputs, impl, dtype, chunk):
  cast = lambda t: jax.tree.map(lambda x: x.astype(dtype), t)

  def loss(q, k, v, features, params):
    o, st = point(q, k, v, features, params, output_final_state=True, chunk_size=chunk, implementation=impl)
    w = jnp.cos(jnp.arange(o.size, dtype=o.dtype)).reshape(o.shape)
    return jnp.sum(o * w) + jnp.sum(jnp.sin(st["S"])), (o, st)

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(*cast(inputs))
  return out, grads


def _median_ms(point, inputs, impl, chunk, repeats):
  f = jax.jit(lambda *a: point(*a, chunk_size=chunk, implementation=impl)[0])
  jax.block_until_ready(f(*inputs))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*inputs))
    times.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(times))


def _diagnostics(point, inputs):
  f64 = [jax.tree.map(lambda a: a.astype(jnp.float64), t) for t in inputs]
  x = point.prepare(*f64, implementation="reference")
  online = point.online
  kw = dict(log_decay=x["log_decay"], online=online)
  if online:
    kw["k_write"] = x["k_write"]
  _, spec = diagnostics.state_norms(x["k"] if online else x["k"], x["v"], x["beta"], **kw)
  o, st = point(*f64, output_final_state=True, implementation="reference")
  recall = float(jnp.mean(diagnostics.recall_residual(st["S"], x["k"], x["v"])))
  if not online:
    return "–", "–", "–", "–", float(jnp.max(spec)), recall
  rho = diagnostics.rho_closed_form(x["k"], x["beta"], x["k_write"])
  rho_m = diagnostics.rho_measured(x["k"], x["v"], x["beta"], k_write=x["k_write"], log_decay=x["log_decay"])
  cut = lambda a: None if a is None else a[:, :_EIG_TOKENS]
  eig = diagnostics.step_eigenvalues(cut(x["k"]), cut(x["beta"]), cut(x["k_write"]), cut(x["log_decay"]))
  return (f"{float(diagnostics.q_geo(rho)):.4f}", f"{float(diagnostics.q_geo(rho_m)):.4f}",
          f"{float(np.min(eig.real)):+.3f}", f"{float(np.max(np.abs(eig))):.3f}", float(jnp.max(spec)), recall)


def main(argv):
  del argv
  jax.config.update("jax_enable_x64", True)
  spec = config.settings(Tour)
  dims = dgps.Dims(spec.heads, spec.value_heads, spec.dim, spec.dim)
  b, t, c = spec.batch, spec.length, spec.chunk
  print(f"backend {jax.default_backend()}, jax {jax.__version__}; B={b} T={t} H={dims.heads} HV={dims.value_heads} "
        f"K=V={dims.key_dim} chunk={c}; errors: relative RMS, chunked fp32 vs the point's token-serial fp64")
  head = (f"{'point':<13} {'D/G/P/S':<31} {'err o':>7} {'err S':>7} {'err ∇':>7} {'chain':>7} {'decode':>7} "
          f"{'q_geo':>6} {'q_geo*':>6} "
          f"{'min Reλ':>7} {'max|λ|':>6} {'max‖S‖':>7} {'recall':>7} {'xla ms':>7} {'ref ms':>8}")
  print(head + "\n" + "-" * len(head))
  for name in spec.points or dgps.names():
    point = dgps.get(name)
    inputs = random_point_inputs(point, dims, seed=0, B=b, T=t)
    (o, st), g = _run_with_grads(point, inputs, "xla", jnp.float32, c)
    (o_ref, st_ref), g_ref = _run_with_grads(point, inputs, "reference", jnp.float64, c)
    err_g = max(rel_rms(a, r) for a, r in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)))
    report = dgps.check_point(point, dims, chunk_size=min(c, 16))
    qg, qm, lo, hi, smax, recall = _diagnostics(point, inputs)
    axes = "/".join(point.axis_name(kind) for kind in ("decay", "gain", "precond", "solve"))
    print(f"{name:<13} {axes:<31} {rel_rms(o, o_ref):7.1e} {rel_rms(st['S'], st_ref['S']):7.1e} {err_g:7.1e} "
          f"{report['chaining']:7.1e} {report['decoding']:7.1e}{'' if report['ok'] else '!'} "
          f"{qg:>6} {qm:>6} {lo:>7} {hi:>6} {smax:7.3f} {recall:7.3f} "
          f"{_median_ms(point, inputs, 'xla', c, spec.repeats):7.2f} "
          f"{_median_ms(point, inputs, 'reference', c, spec.repeats):8.2f}", flush=True)
  print("chain, decode: `dgps.check_point` (! where a check exceeds its tolerance). q_geo: exp(mean log "
        "(1 − β⟨k, k̃⟩)²) from the gates; q_geo*: measured through the recurrence. λ: the "
        f"per-step transition's eigenvalues (first {_EIG_TOKENS} tokens, decay included). max‖S‖: largest "
        "spectral norm of the state over the run. recall: mean ‖S_Tᵀk_j − v_j‖²/‖v_j‖² over all pairs. Inputs "
        "are random projections, not a trained model: a tour of the machinery, not a comparison of variants.")


if __name__ == "__main__":
  plugins.define_imports_flag()
  config.run(main, Tour())
