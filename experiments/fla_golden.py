"""Golden files from FLA (flash-linear-attention) for CI: inputs and outputs of five FLA ops at small shapes.

q, k, v go to FLA in bf16 (its delta-rule kernels refuse fp32); the files hold their bf16-rounded values as
fp32, so our fp32 path sees exactly FLA's inputs and the difference is FLA's bf16 arithmetic.

Run once on a GPU with FLA importable; writes one compressed .npz per op (inputs, outputs, final states and,
where FLA allows the backward, the gradients of every input under a fixed cotangent) and prints our XLA path's
error against each. tests/ops/test_fla_golden.py checks our ops against these files without torch.

  python3 -m experiments.fla_golden --out tests/fixtures/fla [--ops chunk_kda,...] [--one-config]

--one-config keeps only the first of each FLA kernel's autotuning configs (Triton then skips benchmarking).
Block sizes change only the order of FLA's fp32 accumulations, not the function; the files are checked at bf16
tolerances, and FLA's autotuning takes minutes per op without it. A forward-only file is written as soon as FLA's
forward is done. Never use it for timing FLA.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

OPS = ("chunk_delta_rule", "chunk_kda", "chunk_precond_kda", "chunk_precond_gated_delta_rule",
       "chunk_gated_delta_rule")
SHAPE = (2, 100, 2, 32)   # B, T (not a multiple of 64), H, K = V


def inputs(op, seed=0):
  """fp32 inputs: L2-normalised q, k; β = σ(N); decays logσ(N + 3); PDN gates; random initial states."""
  b, t, h, d = SHAPE
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  sig = lambda x: 1 / (1 + np.exp(-x))
  logsig = lambda x: -np.logaddexp(0, -x)
  x = dict(q=unit(rng.normal(size=(b, t, h, d))), k=unit(rng.normal(size=(b, t, h, d))),
           v=rng.normal(size=(b, t, h, d)), beta=sig(rng.normal(size=(b, t, h))),
           initial_state=rng.normal(size=(b, h, d, d)) * 0.1)
  if op in ("chunk_gated_delta_rule", "chunk_precond_gated_delta_rule"):
    x["g"] = logsig(rng.normal(size=(b, t, h)) + 3)
  if op in ("chunk_kda", "chunk_precond_kda"):
    x["g"] = logsig(rng.normal(size=(b, t, h, d)) + 3)
  if op.startswith("chunk_precond"):
    x["beta_p"] = sig(rng.normal(size=(b, t, h)))
    x["g_p"] = logsig(rng.normal(size=(b, t, h)) + 3)
    x["center"] = -0.2 + 0.1 * rng.normal(size=(h,))
    x["initial_A_state"] = np.abs(rng.normal(size=(b, h, d)))
  x["do"] = rng.normal(size=(b, t, h, d))
  x = {n: a.astype(np.float32) for n, a in x.items()}
  for n in BF16_INPUTS:   # FLA runs q, k, v (and dO) in bf16: store the bf16-rounded values, exactly
    x[n] = _round_bf16(x[n])
  return x


BF16_INPUTS = ("q", "k", "v", "do")


def _round_bf16(a):
  """fp32 → nearest bf16 (round half to even) → fp32, in numpy."""
  bits = a.astype(np.float32).view(np.uint32)
  bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
  return bits.view(np.float32)


def keep_first_autotune_config():
  """Patch `triton.autotune` (before fla is imported) to keep only the first config of every kernel."""
  import triton
  full = triton.autotune

  def first_only(configs, *args, **kwargs):
    return full(list(configs)[:1], *args, **kwargs)

  triton.autotune = first_only


def run_fla(op, x, save_forward=None):
  """FLA's op on x (bf16 q, k, v): outputs and, where FLA allows its backward, every input gradient.
  `save_forward(outputs)` is called once the forward is done."""
  import torch
  t0 = time.time()
  from fla import ops as fops
  dev = "cuda"
  t = {n: torch.tensor(a, device=dev, dtype=torch.bfloat16 if n in BF16_INPUTS else torch.float32)
       for n, a in x.items()}
  grad_names = [n for n in t if n not in ("do", "center")]
  for n in grad_names:
    t[n].requires_grad_(True)
  common = dict(initial_state=t["initial_state"], output_final_state=True)
  A = None
  if op == "chunk_delta_rule":
    o, S = fops.delta_rule.chunk_delta_rule(t["q"], t["k"], t["v"], t["beta"], **common)
  elif op == "chunk_gated_delta_rule":
    o, S = fops.gated_delta_rule.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], **common)
  elif op == "chunk_kda":
    o, S = fops.kda.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], **common)
  elif op == "chunk_precond_gated_delta_rule":
    o, S, A = fops.precond_gated_delta_rule.chunk_precond_gated_delta_rule(
        t["q"], t["k"], t["v"], t["g_p"], t["g"], t["beta_p"], t["beta"], initial_A_state=t["initial_A_state"],
        log_atk_scale=t["center"], **common)
  else:
    o, S, A = fops.precond_kda.chunk_precond_kda(
        t["q"], t["k"], t["v"], t["g"], t["g_p"], t["beta_p"], t["beta"], initial_A_state=t["initial_A_state"],
        log_atk_scale=t["center"], **common)
  f32 = lambda a: a.detach().float().cpu().numpy()
  out = dict(o=f32(o), S=f32(S))
  if A is not None:
    out["A"] = f32(A)
  print(f"{op}: FLA forward done at {time.time() - t0:.0f} s", flush=True)
  if save_forward is not None:   # a forward-only file first: FLA's backward compilation can outlast the call
    save_forward(out)
  try:
    (o.float() * t["do"].float()).sum().backward()
    for n in grad_names:
      if t[n].grad is not None:
        out["d_" + n] = t[n].grad.float().cpu().numpy()
    print(f"{op}: FLA backward done at {time.time() - t0:.0f} s", flush=True)
  except Exception as e:  # FLA refuses the gated backwards on Hopper with Triton 3.6
    print(f"{op}: no backward ({type(e).__name__}: {str(e)[:120]})", flush=True)
  return out


def ours(op, x):
  """Our XLA path on the same inputs (fp32): (o, S, A or None) and the input gradients under `do`."""
  import jax
  import jax.numpy as jnp
  from osdn_jax import ops
  from osdn_jax.dgps import precond

  arrays = {n: jnp.asarray(a) for n, a in x.items() if n not in ("do",)}

  def f(a):
    k_write, A = None, None
    if op.startswith("chunk_precond"):
      k_write, A = precond.pdn_write_key(a["k"], a["beta_p"], a["g_p"], a["center"],
                                         initial_state=a["initial_A_state"])
    o, S = ops.delta_rule(a["q"], a["k"], a["v"], a["beta"], k_write=k_write, log_decay=a.get("g"),
                          initial_state=a["initial_state"], output_final_state=True, implementation="xla")
    return o, S, A

  (o, S, A), pull = jax.vjp(f, arrays)
  grads = pull((jnp.asarray(x["do"]), jnp.zeros_like(S), None if A is None else jnp.zeros_like(A)))[0]
  if op.startswith("chunk_precond"):
    # FLA's preconditioned ops L2-normalise q and k inside: on unit inputs their gradient is ours with the
    # radial part removed, (I − x xᵀ) dx.
    for n in ("q", "k"):
      xn = arrays[n]
      grads[n] = grads[n] - xn * jnp.sum(xn * grads[n], -1, keepdims=True)
  return dict(o=o, S=S, A=A), grads


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="tests/fixtures/fla")
  ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {OPS}")
  ap.add_argument("--one-config", action="store_true", help="keep the first FLA autotuning config only")
  args = ap.parse_args()
  ops = args.ops.split(",")
  if not set(ops) <= set(OPS):
    raise ValueError(f"--ops={args.ops}: expected a subset of {OPS}")
  if args.one_config:
    keep_first_autotune_config()
  os.makedirs(args.out, exist_ok=True)
  for op in ops:
    x = inputs(op)
    save = lambda y, op=op, x=x: np.savez_compressed(os.path.join(args.out, f"{op}.npz"),
                                                     **{f"in_{n}": a for n, a in x.items()},
                                                     **{f"out_{n}": a for n, a in y.items()})
    try:
      y = run_fla(op, x, save_forward=save)
    except Exception as e:
      print(f"{op}: FLA failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    save(y)
    got, grads = ours(op, x)
    errs = {n: rel(got[n], y[n]) for n in ("o", "S", "A") if n in y}
    errs.update({f"d_{n}": rel(grads[n], y[f"d_{n}"]) for n in grads if f"d_{n}" in y})
    print(op, " ".join(f"{n}={e:.1e}" for n, e in errs.items()), flush=True)


if __name__ == "__main__":
  main()
