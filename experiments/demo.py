"""The main job on a small default: every solve × decay type on random data.

For each row: the chunked XLA path against the fp64 token-serial oracle (outputs, final state and the worst
input gradient, relative RMS), the residual contraction q_geo (closed form from the gates and measured through
the recurrence; online solves only) and the throughput of each implementation (forward, median of runs).

  python -m experiments.demo [--batch 2 --length 512 --heads 4 --dim 64 --chunk 64 --repeats 5]
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from osdn_jax import diagnostics, ops
from osdn_jax.ops import chunked, naive
from osdn_jax.testing import random_problem, rel_rms, vjp_all

FLAGS = flags.DEFINE_integer("batch", 2, "B"), flags.DEFINE_integer("length", 512, "T")
_HEADS = flags.DEFINE_integer("heads", 4, "H (= HV)")
_DIM = flags.DEFINE_integer("dim", 64, "K = V")
_CHUNK = flags.DEFINE_integer("chunk", 64, "chunk size")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed runs per implementation (median)")


SOLVES = {"dn": ("online", "none"), "gdn": ("online", "scalar"), "kda": ("online", "channel"),
          "dn, k̃≠k": ("online-asym", "none"), "gdn, k̃≠k": ("online-asym", "scalar"),
          "kda, k̃≠k": ("online-asym", "channel"),
          "la": ("offline", "none"), "mamba2-style": ("offline", "scalar"), "gla-style": ("offline", "channel")}


def _fn(impl, solve, chunk=None):
  kw = {} if chunk is None else dict(chunk_size=chunk)

  def fn(q, k, v, beta, k_write, log_decay, initial_state):
    if solve == "offline":
      return impl.linear_attention(q, k, v, beta=beta, log_decay=log_decay, initial_state=initial_state, **kw)
    return impl.delta_rule(q, k, v, beta, k_write=k_write, log_decay=log_decay, initial_state=initial_state,
                           **kw)
  return fn


def _median_ms(fn, arrays, repeats):
  f = jax.jit(lambda a: fn(**a))
  jax.block_until_ready(f(arrays))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(arrays))
    times.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(times))


def main(argv):
  del argv
  jax.config.update("jax_enable_x64", True)
  b, t, h, d, c = FLAGS[0].value, FLAGS[1].value, _HEADS.value, _DIM.value, _CHUNK.value
  tokens = b * t
  print(f"backend {jax.default_backend()}, jax {jax.__version__}; B={b} T={t} H={h} K=V={d} chunk={c}; "
        "errors: relative RMS of the chunked path (fp32) against the token-serial oracle (fp64)")
  head = (f"{'point':<12} {'decay':<8} {'err o':>8} {'err S':>8} {'err ∇':>8} {'q_geo':>7} {'q_geo*':>7} "
          f"{'naive ms':>9} {'xla ms':>8} {'xla tok/s':>10} {'naive/xla':>9}")
  print(head + "\n" + "-" * len(head))
  for name, (solve, decay) in SOLVES.items():
    p = random_problem(0, B=b, T=t, H=h, K=d, V=d, decay=decay,
                       k_write="key" if solve == "online-asym" else "none")
    mode = "offline" if solve == "offline" else "online"
    f32 = p.arrays(jnp.float32)
    f64 = p.arrays(jnp.float64, jnp.float64, jnp.float64)
    got = vjp_all(_fn(chunked, mode, c), f32)
    want = vjp_all(_fn(naive, mode), f64)
    grads = [n for n in want if n not in ("o", "S")]
    err_g = max(rel_rms(got[n], want[n]) for n in grads)
    if mode == "online":
      rho = diagnostics.rho_closed_form(f64["k"], f64["beta"], f64["k_write"])
      rho_m = diagnostics.rho_measured(f64["k"], f64["v"], f64["beta"], k_write=f64["k_write"],
                                       log_decay=f64["log_decay"], initial_state=f64["initial_state"])
      qg, qm = f"{float(diagnostics.q_geo(rho)):7.4f}", f"{float(diagnostics.q_geo(rho_m)):7.4f}"
    else:
      qg = qm = f"{'–':>7}"
    ms_naive = _median_ms(_fn(naive, mode), f32, _REPEATS.value)
    ms_xla = _median_ms(_fn(chunked, mode, c), f32, _REPEATS.value)
    print(f"{name:<12} {decay:<8} {rel_rms(got['o'], want['o']):8.1e} {rel_rms(got['S'], want['S']):8.1e} "
          f"{err_g:8.1e} {qg} {qm} {ms_naive:9.2f} {ms_xla:8.2f} {tokens / ms_xla * 1e3:10.3g} "
          f"{ms_naive / ms_xla:9.2f}", flush=True)
  print("q_geo: closed form exp(mean log (1 − β⟨k, k̃⟩)²); q_geo*: measured through the recurrence. "
        "err ∇: the worst input gradient (q, k, k̃, v, β, log-decay, S0) under random cotangents.")


if __name__ == "__main__":
  app.run(main)
