"""Context parallelism: a point's whole solve (preconditioner pass + solve), forward and backward, with T split
over P devices (`osdn_jax.ops.context`) against the same call unsplit on one device.

Per point and T: "whole" runs on device 0; "split P" runs under `shard_map` with T split over the first P
devices (P = 1 is the split algorithm's own cost on one device: the widened solve, the gathers and the
correction). Each row: ms per forward + backward (`timing.jax_ms`), tokens/s, and the compiled program's temp +
output bytes per device (`timing.compiled_bytes`). A configuration that fails (e.g. out of memory) is a row
with its error. Rows are appended to --out as measured.

  python -m benchmarks.context --points=gdn,pgdn,osdn --lengths=16384,65536 --devices=1,2
  JAX_PLATFORMS=cpu python -m benchmarks.context --points=gdn --lengths=256 --heads=2 --dim=16 --dtype=float32
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from benchmarks.timing import compiled_bytes, jax_ms
from osdn_jax import dgps
from osdn_jax.ops import dispatch

_POINTS = flags.DEFINE_list("points", ["gdn", "pgdn", "osdn"], "DGPS points")
_LENGTHS = flags.DEFINE_list("lengths", ["16384", "65536"], "sequence lengths T")
_DEVICES = flags.DEFINE_list("devices", ["1", "2"], "P values for the split runs (≤ the visible devices)")
_HEADS = flags.DEFINE_integer("heads", 8, "heads H = HV")
_DIM = flags.DEFINE_integer("dim", 128, "K = V")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "q, k, v dtype")
_IMPL = flags.DEFINE_enum("implementation", "auto", dispatch.NAMES, "the point's implementation")
_OUT = flags.DEFINE_string("out", "", "JSON file the rows are appended to")


def _inputs(point, t: int):
  h, d = _HEADS.value, _DIM.value
  dims = dgps.Dims(h, h, d, d)
  rng = np.random.default_rng(0)
  wide = jnp.dtype(_DTYPE.value)
  f = lambda shape, dtype=jnp.float32: jnp.asarray(rng.standard_normal(shape), dtype)
  tokens = (f((1, t, h, d), wide), f((1, t, h, d), wide), f((1, t, h, d), wide),
            jax.tree.map(lambda s: f((1, t, *s)), point.feature_shapes(dims), is_leaf=lambda x: isinstance(x, tuple)))
  return tokens, point.init_params(jax.random.key(0), dims)


def _fwdbwd(point, params, context):
  def loss(q, k, v, feats):
    o, _ = point(q, k, v, feats, params, implementation=_IMPL.value, context=context)
    return jnp.sum(o.astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2, 3))


def _measure(name: str, t: int, parts: int | None) -> dict:
  point = dgps.get(name)
  tokens, params = _inputs(point, t)
  row = {"point": name, "T": t, "devices": parts or 1, "mode": "whole" if parts is None else f"split {parts}"}
  try:
    if parts is None:
      fn = jax.jit(_fwdbwd(point, params, None))
    else:
      mesh = Mesh(np.asarray(jax.devices()[:parts]), ("context",))
      spec = P(None, "context")
      body = _fwdbwd(point, params, "context")
      fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 4, check_vma=False))
      tokens = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, spec))
    ms = jax_ms(fn, *tokens, n=5, reps=5)
    return dict(row, ms=ms, tokens_per_s=t / ms * 1e3, bytes_per_device=compiled_bytes(fn, *tokens))
  except Exception as e:  # noqa: BLE001 — an out-of-memory configuration is a result
    return dict(row, error=str(e).splitlines()[0][:300])


def _table(rows: list[dict]) -> str:
  out = ["| point | T | run | ms fwd+bwd | tokens/s | ÷ whole | GB per device |", "|---|---|---|---|---|---|---|"]
  whole = {(r["point"], r["T"]): r.get("ms") for r in rows if r["mode"] == "whole"}
  for r in rows:
    if "error" in r:
      out.append(f"| {r['point']} | {r['T']} | {r['mode']} | – | – | – | {r['error'][:60]} |")
      continue
    base = whole.get((r["point"], r["T"]))
    ratio = f"{base / r['ms']:.2f}" if base else "–"
    gb = "–" if r["bytes_per_device"] is None else f"{r['bytes_per_device'] / 2**30:.1f}"
    out.append(f"| {r['point']} | {r['T']} | {r['mode']} | {r['ms']:.2f} | {r['tokens_per_s']:,.0f} | {ratio} | {gb} |")
  return "\n".join(out)


def main(argv):
  del argv
  rows = []
  available = jax.device_count()
  for name in _POINTS.value:
    for t in map(int, _LENGTHS.value):
      for parts in [None] + [int(p) for p in _DEVICES.value if int(p) <= available]:
        rows.append(_measure(name, t, parts))
        print(json.dumps(rows[-1]), flush=True)
        if _OUT.value:
          with open(_OUT.value, "a") as f:
            f.write(json.dumps(rows[-1]) + "\n")
  print(f"{jax.devices()[0].device_kind}, {available} device(s), H = {_HEADS.value}, K = V = {_DIM.value}, "
        f"{_DTYPE.value}, speed-up over the whole run on one device (÷ whole)")
  print(_table(rows))


if __name__ == "__main__":
  app.run(main)
