"""On a GPU: the Pallas paths beyond the plain delta rule, against their references — accuracy, then speed.

Cases (each: pallas vs its reference, values and every input gradient under random cotangents, fp32 at
HIGHEST; then bf16 speed of both, forward and forward+backward, `experiments.timing`):
  packed    `ops.delta_rule` with `segment_ids` (random segment lengths, per-segment initial states), scalar
            decay, value-head write keys: implementation "pallas" vs "xla";
  offline   `ops.linear_attention` (per-channel decay): "pallas" (the delta-rule kernels, zero erase key) vs
            "xla";
  pdn       `precond.pdn_write_key` (initial state, per-head centre): implementation "pallas" (the fused kernel
            `precond_key`: A never stored) vs "scan" (associative scan);
  atq       `precond.atq_query` likewise (`precond_key` with ATQ's transform) vs "scan";
  osdn      `precond.osdn_write_key` packed, clip on: method "pallas" (packed d-pass kernel) vs "sequential"
            (token-serial scan; skipped from timing at long T).
Writes JSON (--out) after every measurement.

  python -m experiments.check_pallas_extras --out results/extras.json
  JAX_PLATFORMS=cpu python -m experiments.check_pallas_extras --shape 1,64,2,16 --segments 3 --notime  # smoke
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.timing import jax_ms
from osdn_jax import ops
from osdn_jax.dgps import precond

_SHAPE = flags.DEFINE_string("shape", "4,4096,16,128", "B,T,H,D (HV = H, K = V = D)")
_SEGMENTS = flags.DEFINE_integer("segments", 8, "segments per row of the packed cases")
_CASES = flags.DEFINE_list("cases", ["packed", "offline", "pdn", "atq", "osdn"], "cases to run")
_TIME = flags.DEFINE_bool("time", True, "also time the Pallas implementation")
_TIME_REF = flags.DEFINE_bool("time_ref", True, "also time the reference implementation")
_OUT = flags.DEFINE_string("out", "results/check_pallas_extras.json", "JSON results")


def _rel(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.sqrt(jnp.mean((a - b) ** 2)) / jnp.maximum(jnp.sqrt(jnp.mean(b ** 2)), 1e-30))


def _inputs(b, t, h, d, segments, seed=0):
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  sig = lambda x: 1 / (1 + np.exp(-x))
  cuts = np.sort(rng.choice(np.arange(1, t), size=(b, segments - 1), replace=True), axis=1)
  ids = (np.arange(t)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(np.int32)     # [B, T]
  n = int(sum(len(np.unique(r)) for r in ids))
  x = dict(q=unit(rng.normal(size=(b, t, h, d))), k=unit(rng.normal(size=(b, t, h, d))),
           kw=unit(rng.normal(size=(b, t, h, d))) * np.exp(0.3 * np.clip(rng.normal(size=(b, t, h, d)), -1, 1)),
           v=rng.normal(size=(b, t, h, d)), beta=sig(rng.normal(size=(b, t, h))),
           g=-np.logaddexp(0, -(rng.normal(size=(b, t, h)) + 4)),
           gc=-np.logaddexp(0, -(rng.normal(size=(b, t, h, d)) + 4)),
           beta_p=sig(rng.normal(size=(b, t, h))), g_p=-np.logaddexp(0, -(rng.normal(size=(b, t, h)) + 4)),
           r=sig(rng.normal(size=(b, t, h)) + 3), S0=rng.normal(size=(n, h, d, d)) / np.sqrt(d),
           d0=0.5 + rng.random(size=(n, h, d)), A0=rng.random(size=(b, h, d)), center=np.linspace(-0.5, 0.3, h))
  return {k: jnp.asarray(a, jnp.float32) for k, a in x.items()}, ids


def _case(name, ids):
  """(args of x, fn(impl, *args) → tuple of outputs, the two implementations)."""
  if name == "packed":
    def f(impl, q, k, kw, v, beta, g, S0):
      return ops.delta_rule(q, k, v, beta, k_write=kw, log_decay=g, initial_state=S0, segment_ids=ids,
                            output_final_state=True, implementation=impl)
    return ("q", "k", "kw", "v", "beta", "g", "S0"), f, ("pallas", "xla")
  if name == "offline":
    def f(impl, q, k, v, beta, gc):
      return ops.linear_attention(q, k, v, beta=beta, log_decay=gc, output_final_state=True, implementation=impl)
    return ("q", "k", "v", "beta", "gc"), f, ("pallas", "xla")
  if name == "pdn":
    def f(impl, k, beta_p, g_p, A0, center):
      return precond.pdn_write_key(k, beta_p, g_p, center, initial_state=A0, implementation=impl)
    return ("k", "beta_p", "g_p", "A0", "center"), f, ("pallas", "scan")
  if name == "atq":
    def f(impl, q, k, beta_p, g_p, A0):
      return precond.atq_query(q, k, beta_p, g_p, initial_state=A0, implementation=impl)
    return ("q", "k", "beta_p", "g_p", "A0"), f, ("pallas", "scan")
  if name == "osdn":
    def f(impl, k, beta, r, d0):
      return precond.osdn_write_key(k, beta, retention=r, initial_state=d0, segment_ids=ids, method=impl)
    return ("k", "beta", "r", "d0"), f, ("pallas", "sequential")
  raise KeyError(name)


def _value_and_grads(fn, args, seed=1):
  outs, pull = jax.vjp(fn, *args)
  rng = np.random.default_rng(seed)
  cts = tuple(jnp.asarray(rng.normal(size=o.shape), o.dtype) for o in outs)
  return outs, pull(cts)


def main(argv):
  del argv
  b, t, h, d = map(int, _SHAPE.value.split(","))
  x, ids = _inputs(b, t, h, d, _SEGMENTS.value)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; shape {(b, t, h, d)}, "
        f"{int(sum(len(np.unique(r)) for r in ids))} segments", flush=True)
  results = {}

  def save():
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, "w") as fh:
      json.dump(results, fh, indent=1)

  for name in _CASES.value:
    names, f, (impl, ref) = _case(name, ids)
    args = tuple(x[n] for n in names)
    try:
      with jax.default_matmul_precision("highest"):
        got = jax.jit(lambda *a: _value_and_grads(lambda *z: f(impl, *z), a))(*args)
        want = jax.jit(lambda *a: _value_and_grads(lambda *z: f(ref, *z), a))(*args)
      errs = {f"out{i}": _rel(g, w) for i, (g, w) in enumerate(zip(got[0], want[0]))}
      errs.update({f"d{n}": _rel(g, w) for n, g, w in zip(names, got[1], want[1])})
      results[f"{name}/accuracy"] = errs
      print(f"[check] {name:8s} {impl} vs {ref}: " + " ".join(f"{k}={e:.1e}" for k, e in errs.items()),
            flush=True)
    except Exception as e:  # noqa: BLE001 — record and go on
      results[f"{name}/accuracy"] = dict(error=repr(e)[:1000])
      print(f"[check] {name}: FAILED {e!r}"[:1000], flush=True)
    save()
    if not _TIME.value:
      continue
    bf = tuple(a.astype(jnp.bfloat16) if n in ("q", "k", "kw", "v") else a for n, a in zip(names, args))
    for which in (impl, ref) if _TIME_REF.value else (impl,):
      if which == "sequential" and t > 8192:
        continue
      fwd = jax.jit(lambda *a: f(which, *a))
      grad = jax.jit(jax.grad(lambda *a: sum(jnp.sum(o.astype(jnp.float32)) for o in f(which, *a)
                                             if o is not None), argnums=tuple(range(len(bf)))))
      for mode, fn in (("fwd", fwd), ("fwdbwd", grad)):
        try:
          ms = jax_ms(fn, *bf)
          results[f"{name}/{mode}/{which}"] = ms
          print(f"[time] {name:8s} {mode:6s} {which:10s} {ms:9.3f} ms", flush=True)
        except Exception as e:  # noqa: BLE001
          results[f"{name}/{mode}/{which}"] = dict(error=repr(e)[:1000])
          print(f"[time] {name} {mode} {which}: FAILED {e!r}"[:1000], flush=True)
        save()


if __name__ == "__main__":
  app.run(main)
