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
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from experiments import kernel_times, timing
from osdn_jax.dgps import precond
from osdn_jax.testing import rel_rms
from pallas_kernels.gpu import osdn, osdn_tables

F32 = jnp.float32


def _ms(fn, *args, runs):
  """Device ms per call, back-to-back calls (`experiments.timing`; a per-call sync adds ~0.1–0.3 ms)."""
  return timing.jax_ms(fn, *args, reps=runs)


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
  ap.add_argument("--blocks", default="", help="comma-separated FWD/BWD[/SOLVE[/WARPS_SOLVE]] to compare: tokens "
                  "per loop iteration forward and backward, tokens per block solve of both kernels (0: token by "
                  "token) and their warps, e.g. 16/8,16/8/0,16/8/16/2 (default: the kernel's)")
  ap.add_argument("--warps", type=int, default=None, help="DPassBlocks.num_warps")
  ap.add_argument("--stages", type=int, default=None, help="DPassBlocks.num_stages")
  ap.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=None,
                  help="the forward's block-solve loop loads the next block early (DPassBlocks.prefetch)")
  ap.add_argument("--prefetch-bwd", action=argparse.BooleanOptionalAction, default=None,
                  help="the same for the backward (DPassBlocks.prefetch_bwd)")
  ap.add_argument("--tables", default=None, choices=("kernel", "xla", "auto"), help="DPassBlocks.tables")
  ap.add_argument("--split-bwd", action=argparse.BooleanOptionalAction, default=None,
                  help="λ-only sequential backward + parallel block gradients (DPassBlocks.split_bwd)")
  ap.add_argument("--warps-tables", type=int, default=None, help="DPassBlocks.warps_tables (default: the kernel's)")
  ap.add_argument("--share-inverse", action=argparse.BooleanOptionalAction, default=None,
                  help="the forward's table kernel also forms the backward's inverse (DPassBlocks.share_inverse)")
  ap.add_argument("--tables-dots", default=None, choices=("ieee", "tf32x3"), help="DPassBlocks.tables_dots")
  ap.add_argument("--anchor", default="init", choices=("zero", "init"))
  ap.add_argument("--retention", action=argparse.BooleanOptionalAction, default=True,
                  help="APF retention r (else r ≡ 1, vanilla OSDN)")
  ap.add_argument("--trace", action="store_true",
                  help="also print each config's device time per kernel (profiler trace, experiments.kernel_times)")
  ap.add_argument("--scan", action=argparse.BooleanOptionalAction, default=True,
                  help="also time the token-serial lax.scan and compare values")
  a = ap.parse_args()
  shapes = a.shape or ["4,4096,16,128", "1,32768,8,128"]
  interpret = jax.default_backend() == "cpu"
  base = osdn.INTERPRET_BLOCKS if interpret else osdn.DEFAULT_BLOCKS
  full = (base.block_t, base.block_t_bwd, base.solve_t, base.warps_solve)
  a.warps = a.warps or base.num_warps
  a.stages = a.stages or base.num_stages
  for name in ("prefetch", "prefetch_bwd", "tables", "tables_dots", "split_bwd", "warps_tables",
               "share_inverse"):
    if getattr(a, name) is None:                      # unset flags: the kernel's defaults
      setattr(a, name, getattr(base, name))

  def blocks_of(text):   # F/B[/S[/W]]: S sets the block solve with and without a retention
    bf, bb, bs, ws = tuple(map(int, text.split("/"))) + full[len(text.split("/")):]
    return text, osdn.DPassBlocks(block_t=bf, block_t_bwd=bb, solve_t=bs, solve_t_apf=bs, solve_t_init=bs,
                                  warps_solve=ws, num_warps=a.warps, num_stages=a.stages, prefetch=a.prefetch,
                                  prefetch_bwd=a.prefetch_bwd, tables=a.tables, tables_dots=a.tables_dots,
                                  split_bwd=a.split_bwd, warps_tables=a.warps_tables,
                                  share_inverse=a.share_inverse)
  # No --blocks: the kernel's own blocks with the flags above (which default to them).
  configs = [blocks_of(p) for p in a.blocks.split(",") if p] or [("default", dataclasses.replace(
      base, num_warps=a.warps, num_stages=a.stages, prefetch=a.prefetch, prefetch_bwd=a.prefetch_bwd,
      tables=a.tables, tables_dots=a.tables_dots, split_bwd=a.split_bwd, warps_tables=a.warps_tables,
      share_inverse=a.share_inverse))]
  kw = dict(eta=1.0, d_min=0.0, d_max=8.0, anchor=a.anchor)
  print(f"jax {jax.__version__} {jax.devices()[0].device_kind} interpret={interpret} anchor={a.anchor} "
        f"clip=[0, 8] retention={a.retention} warps={a.warps} stages={a.stages} "
        f"prefetch={a.prefetch}/{a.prefetch_bwd} tables={a.tables} tables_dots={a.tables_dots} "
        f"split_bwd={a.split_bwd} warps_tables={a.warps_tables} share_inverse={a.share_inverse}", flush=True)
  for shape in shapes:
    b, t, g, kd = map(int, shape.split(","))
    args = _inputs(b, t, g, kd)
    if not a.retention:
      args = args[:3] + (None,) + args[4:]
    ref = None
    if a.scan:
      sf, sb = _fns("scan", None, kw)
      ref = jax.tree.leaves((sf(*args), sb(*args)))
      print(f"B,T,G,K={shape}: scan fwd {_ms(sf, *args, runs=a.runs):9.3f} ms  "
            f"scan fwd+bwd {_ms(sb, *args, runs=a.runs):9.3f} ms", flush=True)
    for label, blocks in configs:
      kf, kb = _fns("kernel", blocks, kw)
      line = (f"B,T,G,K={shape} blocks={label}: kernel fwd {_ms(kf, *args, runs=a.runs):9.3f} ms  "
              f"kernel fwd+bwd {_ms(kb, *args, runs=a.runs):9.3f} ms")
      tables = _tables_fn(blocks, args, kw)
      if tables is not None:
        line += f"  (of which forward tables {_ms(tables, *args, runs=a.runs):.3f} ms)"
      if ref is not None:
        err = max(rel_rms(x, y) for x, y in zip(jax.tree.leaves((kf(*args), kb(*args))), ref))
        line += f"  max rel-rms diff vs scan {err:.2e}"
      print(line, flush=True)
      if a.trace:
        for mode, fn in (("fwd", kf), ("fwd+bwd", kb)):
          times = kernel_times.per_call(fn, *args)
          print(f"  {mode} device ms per kernel: " + ", ".join(
              f"{name} {us / 1e3:.3f}" for (_, name), us in times.most_common()), flush=True)


def _tables_fn(blocks, args, kw):
  """The block solves' tables of the forward alone (kernel or reference, as `blocks.tables` says), jitted (None
  when the kernel runs token by token), to split the d-pass's time between them and the sequential kernel."""
  u, n, beta, r, d1, d0 = args
  b, t, g, kd = u.shape
  mode = "none" if r is None else kw["anchor"]
  st = osdn.Static(batch=b, length=t, heads=g, key_dim=osdn.padded_dim(kd), channels=kd, eta=kw["eta"],
                   d_min=kw["d_min"], d_max=kw["d_max"], mode=mode, blocks=blocks,
                   interpret=jax.default_backend() == "cpu")
  if not osdn._blocked(st):
    return None
  o = d0 if mode == "init" else None
  return jax.jit(lambda u, n, beta, r, d1, d0: osdn_tables.forward(st, u, n, beta, r, o)[:3])


if __name__ == "__main__":
  main()
