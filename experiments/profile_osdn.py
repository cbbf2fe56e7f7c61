"""Times OSDN's sequential d-pass: the Pallas kernel (`pallas_kernels.gpu.osdn.d_pass`) against the token-serial
`lax.scan` (`osdn_jax.dgps.precond._osdn_serial(implementation="scan")`), forward and forward+backward.

APF retention with anchor "init" and the default clip [0, 8] (the heaviest configuration); unit keys, σ gains,
fp32. Jitted, median of runs, ms. Also prints the largest relative RMS difference between the two (values and
gradients). Default shapes B,T,G,K = 4,4096,16,128 and 1,32768,8,128; on a CPU backend the kernel runs in
interpret mode (use a tiny shape):

  python -m experiments.profile_osdn                        # on a GPU
  python -m experiments.profile_osdn --shape 1,64,2,16      # CPU, interpret mode
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from osdn_jax.dgps import precond
from osdn_jax.testing import rel_rms
from pallas_kernels.gpu import osdn

F32 = jnp.float32


def _ms(fn, *args, runs):
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(ts))


def _inputs(b, t, g, kd, seed=0):
  """u = k², n = ‖k‖² [B, T, G, K], [B, T, G]; β, r [B, T, G]; d1 [B, G, K]; d_init [G, K]."""
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(b, t, g, kd)).astype(np.float32)
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  sig = lambda x: 1 / (1 + np.exp(-x))
  u = jnp.asarray(k * k, F32)
  return (u, jnp.maximum(jnp.sum(u, -1), 1e-12), jnp.asarray(sig(rng.normal(size=(b, t, g))), F32),
          jnp.asarray(sig(rng.normal(size=(b, t, g)) + 4), F32), jnp.ones((b, g, kd), F32), jnp.ones((g, kd), F32))


def _fns(impl, blocks, kw):
  def fwd(u, n, beta, r, d1, d0):
    if impl == "kernel":
      return osdn.d_pass(u, n, beta, r, d1, d0, blocks=blocks, **kw)
    return precond._osdn_serial(u, n, beta, r, d1, d0, implementation="scan", **kw)

  def loss(u, n, beta, r, d1, d0):
    ds, d_last = fwd(u, n, beta, r, d1, d0)
    return jnp.sum(ds * u) + jnp.sum(d_last)

  return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", action="append", help="B,T,G,K (repeatable); default 4,4096,16,128 and "
                  "1,32768,8,128")
  ap.add_argument("--runs", type=int, default=10)
  ap.add_argument("--blocks", default="", help="comma-separated FWD/BWD tokens per loop iteration to compare, "
                  "e.g. 16/8,32/16 (default: the kernel's)")
  ap.add_argument("--warps", type=int, default=None)
  ap.add_argument("--stages", type=int, default=1)
  ap.add_argument("--anchor", default="init", choices=("zero", "init"))
  ap.add_argument("--scan", action=argparse.BooleanOptionalAction, default=True,
                  help="also time the token-serial lax.scan and compare values")
  a = ap.parse_args()
  shapes = a.shape or ["4,4096,16,128", "1,32768,8,128"]
  interpret = jax.default_backend() == "cpu"
  base = osdn.INTERPRET_BLOCKS if interpret else osdn.DEFAULT_BLOCKS
  pairs = [tuple(map(int, p.split("/"))) for p in a.blocks.split(",") if p] or [(base.block_t, base.block_t_bwd)]
  kw = dict(eta=1.0, d_min=0.0, d_max=8.0, anchor=a.anchor)
  print(f"jax {jax.__version__} {jax.devices()[0].device_kind} interpret={interpret} anchor={a.anchor} "
        f"clip=[0, 8] warps={a.warps} stages={a.stages}", flush=True)
  for shape in shapes:
    b, t, g, kd = map(int, shape.split(","))
    args = _inputs(b, t, g, kd)
    ref = None
    if a.scan:
      sf, sb = _fns("scan", None, kw)
      ref = jax.tree.leaves((sf(*args), sb(*args)))
      print(f"B,T,G,K={shape}: scan fwd {_ms(sf, *args, runs=a.runs):9.3f} ms  "
            f"scan fwd+bwd {_ms(sb, *args, runs=a.runs):9.3f} ms", flush=True)
    for bf, bb in pairs:
      blocks = osdn.DPassBlocks(block_t=bf, block_t_bwd=bb, num_warps=a.warps, num_stages=a.stages)
      kf, kb = _fns("kernel", blocks, kw)
      line = (f"B,T,G,K={shape} block_t={bf}/{bb}: kernel fwd {_ms(kf, *args, runs=a.runs):9.3f} ms  "
              f"kernel fwd+bwd {_ms(kb, *args, runs=a.runs):9.3f} ms")
      if ref is not None:
        err = max(rel_rms(x, y) for x, y in zip(jax.tree.leaves((kf(*args), kb(*args))), ref))
        line += f"  max rel-rms diff vs scan {err:.2e}"
      print(line, flush=True)


if __name__ == "__main__":
  main()
