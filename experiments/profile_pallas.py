"""Per-kernel times of the Pallas GPU delta rule (forward and backward stages), to see where time goes.

Times each pallas_call of the forward (prep, state_pass, output; prep emitting T as under autodiff) and of
the backward (wu from T, state_pass, dv_local, state_bwd, grads_state, grads_intra and grads_finish, or with
per-channel decay grads_pairs) on its own, jitted, per call with back-to-back calls (experiments.timing);
bf16 inputs, the default blocks.
Then the whole forward and the whole backward (every kernel chained, as the custom_vjp runs them).

  python -m experiments.profile_pallas --shape 4,4096,16,128 --decay none
  python -m experiments.profile_pallas --decay channel --sweep      # also a few launch parameters per kernel
  python -m experiments.profile_pallas --decay channel --sweep prep,grads_pairs   # of these kernels only
  python -m experiments.profile_pallas --census                      # static per-program census, nothing runs

On CPU the kernels run in interpret mode (times meaningless; a smoke test):
  JAX_PLATFORMS=cpu python -m experiments.profile_pallas --shape 1,64,2,16 --chunk 16
"""
from __future__ import annotations

import argparse
import dataclasses
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gpu import delta_rule_bwd as bwd
from pallas_kernels.gpu import delta_rule_fwd as fwd
from pallas_kernels.gpu.census import census, format_census
from pallas_kernels.gpu.config import DEFAULT_BLOCKS
from experiments.timing import jax_ms
from pallas_kernels.gpu.layout import Static

# --sweep: per kernel, BlockSizes overrides to try (each one compiles that kernel once more).
SWEEPS = {
    "scores": [dict(warps_scores=4), dict(block_k_scores=16), dict(block_k_scores=64), dict(fp32_dots_bf16="tf32x3")],
    "prep": [dict(warps_prep=2), dict(warps_prep=8), dict(warps_prep_channel=4), dict(factor_diag=False),
             dict(sub=32), dict(stages=1), dict(stages=3), dict(fp32_dots_bf16="tf32x3")],
    "state_pass": [dict(block_v_state=16), dict(block_v_state=64), dict(block_v_state=32, warps_state=2),
                   dict(warps_state=8), dict(warps_state=2), dict(warps_state=1), dict(stages=2),
                   dict(stages=4), dict(state_k_piece=64), dict(state_k_piece=32),
                   dict(state_k_piece=64, warps_state=2)],
    "state_bwd": [dict(block_v_state=32), dict(block_v_state=32, warps_state=2), dict(warps_state=8),
                  dict(warps_state=2), dict(warps_state=1), dict(stages=2), dict(stages=4)],
    "wu (from T)": [dict(warps_prep=8), dict(warps_prep=2)],
    "inverse (T only)": [dict(warps_prep=2), dict(warps_prep=8)],
    "output": [dict(warps_chunk=8), dict(block_v_out=64), dict(factor_diag=False), dict(stages=3)],
    "dv_local": [dict(warps_chunk=8), dict(block_v_out=64), dict(factor_diag=False)],
    "grads_state": [dict(warps_grad_state=8), dict(block_k_grad=32), dict(block_k_grad=128, warps_grad_state=8),
                    dict(block_v_grad=32), dict(block_v_grad=128)],
    "grads_intra": [dict(warps_grad=4), dict(block_v_grad=128), dict(block_v_grad=32)],
    "grads_finish": [dict(warps_finish=4), dict(block_k_grad=32), dict(block_k_grad=32, warps_finish=4),
                     dict(block_k_grad=128)],
    "grads_pairs": [dict(warps_pairs=8), dict(block_k_pairs=32), dict(block_k_pairs=16),
                    dict(block_k_grad=32, block_k_pairs=32), dict(factor_diag=False)],
}


def make_inputs(b, t, h, d, decay, chunk):
  """bf16 unit q, k; bf16 v, dO; β = σ(N); the in-chunk cumsum G of logσ(N + 4) decays; zero S0, dS_T."""
  rng = np.random.default_rng(0)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  x = dict(q=bf(unit(rng.normal(size=(b, t, h, d)))), k=bf(unit(rng.normal(size=(b, t, h, d)))),
           v=bf(rng.normal(size=(b, t, h, d))), do=bf(rng.normal(size=(b, t, h, d))),
           beta=jnp.asarray(1 / (1 + np.exp(-rng.normal(size=(b, h, t)))), jnp.float32), G=None,
           S0=jnp.zeros((b, h, d, d), jnp.float32), dS=jnp.zeros((b, h, d, d), jnp.float32))
  if decay == "scalar":
    g = -np.logaddexp(0, -(rng.normal(size=(b, h, t)) + 4))
    x["G"] = jnp.asarray(np.cumsum(g.reshape(b, h, t // chunk, chunk), -1).reshape(b, h, t), jnp.float32)
  elif decay == "channel":
    g = -np.logaddexp(0, -(rng.normal(size=(b, t, h, d)) + 4))
    x["G"] = jnp.asarray(np.cumsum(g.reshape(b, t // chunk, chunk, h, d), 2).reshape(b, t, h, d), jnp.float32)
  return x


def parse_blocks(text: str, sep: str = ","):
  """BlockSizes overrides "name=value<sep>name=value" ("" or "default": the defaults); values are ints, True /
  False, "auto", or strings for the fp32_dots fields. An invalid value raises BlockSizes' ValueError."""
  if text in ("", "default"):
    return DEFAULT_BLOCKS
  words = {"True": True, "False": False, "auto": "auto"}

  def value(k, v):
    if k.startswith("fp32_dots") or v in words:
      return words.get(v, v)
    try:
      return int(v)
    except ValueError:
      raise ValueError(f"BlockSizes.{k}={v!r}: expected an int, True, False or auto") from None
  over = dict(kv.split("=") for kv in text.split(sep) if kv)
  return dataclasses.replace(DEFAULT_BLOCKS, **{k: value(k, v) for k, v in over.items()})


def make_static(b, t, h, d, decay, chunk, blocks):
  return Static(batch=b, length=t, heads=h, value_heads=h, kw_heads=h, key_dim=d, value_dim=d, chunk=chunk,
                decay=decay, scale=d ** -0.5, same_keys=True, blocks=blocks,
                interpret=jax.default_backend() == "cpu", low_precision=True)


class Kernel:
  """One pallas_call: `run(st, *args)` jitted per Static (compiled once per block sizes)."""

  def __init__(self, name, fn, args):
    self.name, self.fn, self.args, self._jit = name, fn, args, {}

  def jitted(self, st):
    if st not in self._jit:
      self._jit[st] = jax.jit(lambda *a: self.fn(st, *a))
    return self._jit[st]

  def __call__(self, st):
    return self.jitted(st)(*self.args)


def stages(st, x, report=lambda kern: None):
  """[Kernel] for every pallas_call of forward and backward, in order, each fed the real upstream results
  (computed by the same jitted function that is timed, so every kernel compiles once). `report(kernel)` runs
  as soon as a kernel has run once (a later kernel that fails to compile raises after the earlier reports)."""
  q, k, v, do, beta, G, S0, dS = (x[n] for n in ("q", "k", "v", "do", "beta", "G", "S0", "dS"))
  out = []

  def add(name, fn, *args):
    out.append(Kernel(name, fn, args))
    result = jax.block_until_ready(out[-1](st))
    report(out[-1])
    return result

  A = P = None                 # per-channel decay at chunk ≥ 32: the Gram and output scores come from `scores`
  tiles = fwd.scores_tiles(st)  # ... and with them the decayed operands (as `fwd.forward`)
  kd, qd, kwd, G_state = k, q, k, G
  if tiles:
    A, P, kd, qd, kwd, G_state = add("scores", lambda s, *a: fwd.scores(s, *a, tiles=True), q, k, k, beta, G)
  elif st.scores_first:
    A, P = add("scores", lambda s, *a: fwd.scores(s, *a), q, k, k, beta, G)
  W, U = add("prep", lambda s, *a: fwd.prep(s, *a[:5], A=a[5], decayed=tiles), kd, k, v, beta, G, A)
  state_st = fwd.predecayed if tiles else (lambda s: s)
  V_new, S_in, _ = add("state_pass", lambda s, *a: fwd.state_pass(state_st(s), *a, ends=tiles), W, U, kwd, G_state,
                       S0)
  add("output", lambda s, *a: fwd.output(s, *a[:5], jnp.bfloat16, P=a[5], decayed=tiles), qd, k, G, S_in, V_new, P)
  _, _, T = add("prep (with T)", lambda s, *a: fwd.prep(s, *a[:5], A=a[5], emit_t=True, decayed=tiles), kd, k, v,
                beta, G, A)
  add("inverse (T only)", lambda s, *a: fwd.inverse(s, *a[:4], A=a[4]), k, k, beta, G, A)
  add("wu (from T)", lambda s, *a: fwd.prep(s, *a[:5], T=a[5]), k, k, v, beta, G, T)
  dvl = add("dv_local", lambda s, *a: bwd.dv_local(s, *a), q, k, G, do)
  dV_new, dS_out, _ = add("state_bwd", lambda s, *a: bwd.state_bwd(s, *a), W, q, k, G, do, dvl, dS)
  dq_s, dws, dkw_s, dG_s = add("grads_state", lambda s, *a: bwd.grads_state(s, *a), q, k, G, S_in, dS_out,
                               V_new, dV_new, do)
  if st.decay == "scalar":
    dG_s = jnp.sum(dG_s, axis=0)
  dv, dbeta_v, Mw, Aw = add("grads_intra", lambda s, *a: bwd.grads_intra(s, *a), k, v, beta, G, T, V_new,
                            dV_new, do, dws)
  if st.decay != "channel":
    add("grads_finish", lambda s, *a: bwd.grads_finish(s, *a), q, k, k, beta, G, T, dws, Mw, Aw, dq_s, dkw_s)
  else:
    add("grads_pairs", lambda s, *a: bwd.grads_pairs(s, *a), q, k, k, beta, G, T, dws, Mw, Aw, dq_s, dkw_s,
        dG_s)
  return out


def _timed(label, run, runs):
  """Per-call ms of run(), pipelined (experiments.timing; compile not timed); None if it fails."""
  try:
    ms = jax_ms(run, n=runs)
    print(f"{label:52s} {ms:8.3f} ms", flush=True)
    return ms
  except Exception as e:  # noqa: BLE001 — a kernel that fails to compile is reported, the rest still runs
    print(f"{label:52s} FAILED {e!r}"[:600], flush=True)
    traceback.print_exc(limit=2)
    return None


def _key(overrides):
  return ",".join(f"{k}={v}" for k, v in overrides.items())


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", default="4,4096,16,128", help="B,T,H,D (H = HV, K = V = D)")
  ap.add_argument("--decay", default="none")
  ap.add_argument("--chunk", type=int, default=64)
  ap.add_argument("--runs", type=int, default=20)
  ap.add_argument("--sweep", nargs="?", const="all", default="",
                  help="also time kernels under the SWEEPS overrides: all, or a comma list of kernel names")
  ap.add_argument("--census", action="store_true", help="print the static per-program census and exit")
  ap.add_argument("--blocks", default="", help="BlockSizes overrides for the whole run, e.g. "
                  "warps_prep=2,block_v_state=64 (ints, or strings for fp32_dots)")
  a = ap.parse_args()
  b, t, h, d = map(int, a.shape.split(","))
  blocks = parse_blocks(a.blocks)
  st = make_static(b, t, h, d, a.decay, a.chunk, blocks)
  x = make_inputs(b, t, h, d, a.decay, a.chunk)
  print(f"jax {jax.__version__} {jax.devices()[0].device_kind} shape B,T,H,K={a.shape} decay={a.decay} "
        f"chunk={a.chunk} blocks={a.blocks or 'default'}", flush=True)
  if a.census:
    inputs = (x["q"], x["k"], x["k"], x["v"], x["beta"], x["G"], x["S0"])
    rows = census(lambda *r: fwd.forward(st, *r, emit_t=True), *inputs)
    T = fwd.forward(st, *inputs, emit_t=True)[2]
    rows += census(lambda *r: bwd.backward(st, (*r[:7], None, r[7]), r[8], r[9]), *inputs, T, x["do"], x["dS"])
    print(format_census(rows))
    return
  sweep = set(SWEEPS) if a.sweep == "all" else {n for n in a.sweep.split(",") if n}
  total = {"forward": 0.0, "backward": 0.0}

  def report(kern):
    ms = _timed(kern.name, lambda: kern(st), a.runs)
    if ms is not None:
      if kern.name in ("scores", "prep (with T)", "state_pass", "output"):
        total["forward"] += ms
      if not kern.name.startswith(("prep", "output", "inverse", "scores")):
        total["backward"] += ms
    for over in (SWEEPS.get(kern.name, []) if kern.name in sweep else []):
      try:
        st_v = dataclasses.replace(st, blocks=dataclasses.replace(blocks, **over))
      except ValueError as e:
        print(f"  {kern.name} [{_key(over)}]: skipped ({e})")
        continue
      _timed(f"  {kern.name} [{_key(over)}]", lambda: kern(st_v), a.runs)

  try:
    stages(st, x, report)
  except Exception as e:  # noqa: BLE001 — a kernel failed to compile or run: its successors cannot run
    print(f"FAILED building the next kernel: {e!r}"[:2000], flush=True)
    traceback.print_exc(limit=3)
  print(f"{'sum of kernels: forward (emitting T)':52s} {total['forward']:8.3f} ms")
  print(f"{'sum of kernels: backward (reruns wu, state_pass)':52s} {total['backward']:8.3f} ms")
  inputs = (x["q"], x["k"], x["k"], x["v"], x["beta"], x["G"], x["S0"])
  whole_fwd = jax.jit(lambda *r: fwd.forward(st, *r))
  _timed("whole forward (jit)", lambda: whole_fwd(*inputs), a.runs)
  st_inter = dataclasses.replace(st, blocks=dataclasses.replace(blocks, fuse_inter=not st.fuse_inter))
  inter_fwd = jax.jit(lambda *r: fwd.forward(st_inter, *r))
  _timed(f"whole forward, fuse_inter={st_inter.fuse_inter} (jit)", lambda: inter_fwd(*inputs), a.runs)
  for label, f in ((st.fuse_inter, whole_fwd), (st_inter.fuse_inter, inter_fwd)):
    try:
      m = f.lower(*inputs).compile().memory_analysis()
      print(f"{'  whole forward, fuse_inter=' + str(label) + ': temp MB':52s} {m.temp_size_in_bytes / 1e6:8.1f}")
    except Exception as e:  # noqa: BLE001 — memory_analysis is not available on every backend/version
      print(f"  memory_analysis unavailable: {e!r}"[:200])
  fwd_t = jax.jit(lambda *r: fwd.forward(st, *r, emit_t=True))
  _timed("whole forward emitting T (jit)", lambda: fwd_t(*inputs), a.runs)
  st_split = dataclasses.replace(st, blocks=dataclasses.replace(blocks, split_prep=True))
  split_fwd = jax.jit(lambda *r: fwd.forward(st_split, *r, emit_t=True))
  _timed("whole forward emitting T, split_prep (jit)", lambda: split_fwd(*inputs), a.runs)
  T = fwd_t(*inputs)[2]
  whole_bwd = jax.jit(lambda *r: bwd.backward(st, (*r[:7], None, r[7]), r[8], r[9]))
  _timed("whole backward (jit)", lambda: whole_bwd(*inputs, T, x["do"], x["dS"]), a.runs)


if __name__ == "__main__":
  main()
