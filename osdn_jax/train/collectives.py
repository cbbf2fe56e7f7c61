"""The collectives of a compiled program, read from its optimised HLO text (`compiled.as_text()`).

    stats = collectives.count(compiled.as_text(), num_devices=64)
    stats["all-gather"]   # {"ops": 96, "executed": 1152, "bytes": ..., "traffic_bytes": ...}

Kinds: all-gather, reduce-scatter, all-reduce, collective-permute, all-to-all. Per kind, for one device and one
run of the program:
  ops            collectives in the computations the program reaches (one per channel id)
  executed       how often they run: an instruction inside a while loop counts once per iteration when the
                 loop's condition is `i < N` on a constant N (a scan's form), else once (`unknown_trip_counts`)
  bytes          Σ over runs of the collective's full buffer: the gathered result of an all-gather, the input of
                 a reduce-scatter (before the scatter), the buffer of an all-reduce, a permute or an all-to-all
  traffic_bytes  what a ring algorithm sends per device for those runs: bytes·(n−1)/n for all-gather,
                 reduce-scatter and all-to-all, 2·bytes·(n−1)/n for all-reduce, bytes for a permute (n: the
                 replica group's size)
Sizes are the logical shapes' (layout padding and tiling not counted). TPU's compiler emits a reduce-scatter as
an all-reduce inside a fusion computation named "all-reduce-scatter…", counted here as a reduce-scatter, and
some all-gathers as an all-reduce of a zero buffer holding the device's shard (a dynamic-update-slice into a
broadcast), counted here as an all-gather with the all-reduce's traffic; async
pairs (`-start`/`-done`) count once, at the start, and so does a collective that TPU's compiler splits into a
chain of fusions overlapped with compute (the same channel id in each; it runs as often as its least frequent
part). The HLO text is read with `train.hlo`.
"""
from __future__ import annotations

import math
import re

from osdn_jax.train import hlo

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
_OPS = {"all-gather": "all-gather", "all-gather-start": "all-gather", "reduce-scatter": "reduce-scatter",
        "all-reduce": "all-reduce", "all-reduce-start": "all-reduce", "collective-permute": "collective-permute",
        "collective-permute-start": "collective-permute", "all-to-all": "all-to-all",
        "ragged-all-to-all": "all-to-all"}


def _arrays(type_text: str) -> list[tuple[int, int]]:
  """[(bytes, rank)] of the arrays in an HLO type (one array or a tuple)."""
  return [(hlo.array_bytes(t, dims), len([d for d in dims.split(",") if d]))
          for t, dims in hlo.ARRAY.findall(type_text)]


def _group_size(rest: str, num_devices: int) -> int:
  """The replica group's size from `replica_groups=` in any of its printed forms."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)
  if m:
    sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
    return math.prod(sizes[a] for a in re.findall(r"'([^']+)'", m.group(2)))
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)
  if m:
    return int(m.group(2))
  m = re.search(r"replica_groups=\{\{([^}]*)\}", rest)
  if m:
    return len(m.group(1).split(","))
  return num_devices


_PASS = ("copy", "copy-start", "copy-done", "bitcast")


def _source(table: dict, name: str | None) -> str | None:
  """The instruction `name` stands for, through copies and bitcasts."""
  for _ in range(8):
    if name not in table or table[name][0] not in _PASS:
      break
    name = (hlo.operands(table[name][1]) or [None])[0]
  return name


def _zero_based_update(comps, roots, comp: str, name: str) -> bool:
  """Whether instruction `name` of `comp` is a dynamic-update-slice into a broadcast (a zero buffer holding one
  shard), directly or as a fusion's root, through copies and bitcasts."""
  table = {n: (op, rest) for n, _, op, rest in comps[comp]}
  name = _source(table, name)
  if name not in table:
    return False
  op, rest = table[name]
  if op == "dynamic-update-slice":
    base = _source(table, (hlo.operands(rest) or [None])[0])
    return base in table and table[base][0] == "broadcast"
  m = re.search(r"\bcalls=%([\w.\-]+)", rest)
  if op != "fusion" or not m or m.group(1) not in roots:
    return False
  inner = {n: (o, r) for n, _, o, r in comps[m.group(1)]}
  root = inner[roots[m.group(1)]]
  if root[0] != "dynamic-update-slice":
    return False
  base = _source(inner, (hlo.operands(root[1]) or [None])[0])
  if base in inner and inner[base][0] == "parameter":
    index, outer = int(re.match(r"(\d+)", inner[base][1]).group(1)), hlo.operands(rest)
    base, inner = _source(table, outer[index]) if index < len(outer) else None, table
  return base in inner and inner[base][0] == "broadcast"


def count(hlo_text: str, num_devices: int) -> dict:
  """{kind: {"ops", "executed", "bytes", "traffic_bytes"}} for `KINDS`, and "unknown_trip_counts": the while
  loops whose iterations could not be read (their collectives counted once)."""
  comps, roots, entry = hlo.parse(hlo_text)
  runs, unknown = hlo.runs(comps, entry)
  found = {}   # (kind, channel id or instruction) → (bytes, traffic per run, runs)
  for comp, instrs in comps.items():
    if not runs[comp]:
      continue
    for name, type_text, op, rest in instrs:
      kind = _OPS.get(op)
      if kind is None:
        continue
      factor = None
      if kind == "all-reduce" and comp.startswith("all-reduce-scatter"):
        kind = "reduce-scatter"
      elif kind == "all-reduce" and all(_zero_based_update(comps, roots, comp, a) for a in hlo.operands(rest)):
        kind, factor = "all-gather", 2.0   # a gather run as an all-reduce: its traffic is the all-reduce's
      arrays = _arrays(type_text)
      if op.endswith("-start") and type_text.startswith("("):   # (inputs…, outputs…, scalar contexts)
        arrays = [a for a in arrays if a[1]]
        arrays = arrays[len(arrays) // 2:]
      size = sum(b for b, _ in arrays)
      n = _group_size(rest, num_devices)
      if kind == "reduce-scatter" and op == "reduce-scatter":
        size *= n
      share = (n - 1) / n if n > 1 else 0.0
      if kind == "collective-permute":
        traffic = size
      else:
        traffic = (factor or (2.0 if kind == "all-reduce" else 1.0)) * share * size
      channel = re.search(r"\bchannel_id=(\d+)", rest)
      key = (kind, channel.group(1) if channel else f"{comp}/{name}")
      # The parts of a chain may sit in a loop that runs them piecewise: the collective runs as often as its
      # least frequent part (its start).
      times = min(runs[comp], found[key][2]) if key in found else runs[comp]
      found[key] = (size, traffic, times)
  out = {k: {"ops": 0, "executed": 0, "bytes": 0, "traffic_bytes": 0} for k in KINDS}
  for (kind, _), (size, traffic, times) in found.items():
    row = out[kind]
    row["ops"] += 1
    row["executed"] += times
    row["bytes"] += size * times
    row["traffic_bytes"] += int(traffic * times)
  out["unknown_trip_counts"] = unknown
  return out
