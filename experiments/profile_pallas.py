"""Per-kernel times of the Pallas GPU delta rule (forward and backward stages), to see where time goes.

Times each pallas_call of the forward (prep, state_pass, output) and of the backward (prep with T,
state_pass, dv_local, state_bwd, grads) on its own, jitted, median of runs; bf16 inputs, the default blocks.

  python -m experiments.profile_pallas --shape 4,4096,16,128 --decay none
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gpu import delta_rule_bwd as bwd
from pallas_kernels.gpu import delta_rule_fwd as fwd
from pallas_kernels.gpu.config import DEFAULT_BLOCKS
from pallas_kernels.gpu.layout import Static


def _ms(fn, *args, runs=20):
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(ts))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", default="4,4096,16,128")
  ap.add_argument("--decay", default="none")
  ap.add_argument("--chunk", type=int, default=64)
  a = ap.parse_args()
  b, t, h, d = map(int, a.shape.split(","))
  rng = np.random.default_rng(0)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  q, k = bf(unit(rng.normal(size=(b, t, h, d)))), bf(unit(rng.normal(size=(b, t, h, d))))
  v, do = bf(rng.normal(size=(b, t, h, d))), bf(rng.normal(size=(b, t, h, d)))
  beta = jnp.asarray(1 / (1 + np.exp(-rng.normal(size=(b, h, t)))), jnp.float32)
  G = None
  if a.decay == "scalar":
    g = -np.logaddexp(0, -(rng.normal(size=(b, h, t)) + 4))
    G = jnp.asarray(np.cumsum(g.reshape(b, h, t // a.chunk, a.chunk), -1).reshape(b, h, t), jnp.float32)
  elif a.decay == "channel":
    g = -np.logaddexp(0, -(rng.normal(size=(b, t, h, d)) + 4))
    G = jnp.asarray(np.cumsum(g.reshape(b, t // a.chunk, a.chunk, h, d), 2).reshape(b, t, h, d), jnp.float32)
  S0 = jnp.zeros((b, h, d, d), jnp.float32)
  dS = jnp.zeros((b, h, d, d), jnp.float32)
  st = Static(batch=b, length=t, heads=h, value_heads=h, kw_heads=h, key_dim=d, value_dim=d, chunk=a.chunk,
              decay=a.decay, scale=d ** -0.5, same_keys=True, blocks=DEFAULT_BLOCKS, interpret=jax.default_backend() == "cpu",
              low_precision=True)
  print(f"jax {jax.__version__} {jax.devices()[0].device_kind} shape B,T,H,K={a.shape} decay={a.decay}",
        flush=True)
  W, U = jax.jit(lambda *x: fwd.prep(st, *x))(k, k, v, beta, G)
  print(f"prep              {_ms(jax.jit(lambda *x: fwd.prep(st, *x)), k, k, v, beta, G):8.3f} ms", flush=True)
  state = jax.jit(lambda *x: fwd.state_pass(st, *x))
  V_new, S_in, _ = state(W, U, k, G, S0)
  print(f"state_pass        {_ms(state, W, U, k, G, S0):8.3f} ms", flush=True)
  out = jax.jit(lambda *x: fwd.output(st, *x, jnp.bfloat16))
  print(f"output            {_ms(out, q, k, G, S_in, V_new):8.3f} ms", flush=True)
  prep_t = jax.jit(lambda *x: fwd.prep(st, *x, emit_t=True, name_suffix='_bwd'))
  W2, U2, T = prep_t(k, k, v, beta, G)
  print(f"prep (with T)     {_ms(prep_t, k, k, v, beta, G):8.3f} ms", flush=True)
  dvl_fn = jax.jit(lambda *x: bwd.dv_local(st, *x))
  dvl = dvl_fn(q, k, G, do)
  print(f"dv_local          {_ms(dvl_fn, q, k, G, do):8.3f} ms", flush=True)
  sb = jax.jit(lambda *x: bwd.state_bwd(st, *x))
  dV_new, dS_out, _ = sb(W2, q, k, G, do, dvl, dS)
  print(f"state_bwd         {_ms(sb, W2, q, k, G, do, dvl, dS):8.3f} ms", flush=True)
  gr = jax.jit(lambda *x: bwd.grads(st, *x))
  print(f"grads             {_ms(gr, q, k, k, v, beta, G, T, S_in, dS_out, V_new, dV_new, do):8.3f} ms",
        flush=True)


if __name__ == "__main__":
  main()
