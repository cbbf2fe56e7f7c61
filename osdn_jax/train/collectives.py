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
part).
"""
from __future__ import annotations

import math
import re

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
_OPS = {"all-gather": "all-gather", "all-gather-start": "all-gather", "reduce-scatter": "reduce-scatter",
        "all-reduce": "all-reduce", "all-reduce-start": "all-reduce", "collective-permute": "collective-permute",
        "collective-permute-start": "collective-permute", "all-to-all": "all-to-all",
        "ragged-all-to-all": "all-to-all"}
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32,
         "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128, "token": 0}

_HEADER = re.compile(r"^(?:ENTRY )?%?([^\s(]+) .*\{$")
_INSTR = re.compile(r"^\s+(ROOT )?%?([^\s=]+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_CALL = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_CALL_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[([0-9,]*)\]")
_OPERANDS = re.compile(r"%([\w.\-]+)")


def _bytes(dtype: str, dims: str) -> int:
  bits = _BITS.get(dtype, 8 if dtype.startswith("f8") else 32)
  return math.prod(int(d) for d in dims.split(",") if d) * bits // 8


def _arrays(type_text: str) -> list[tuple[int, int]]:
  """[(bytes, rank)] of the arrays in an HLO type (one array or a tuple)."""
  return [(_bytes(t, dims), len([d for d in dims.split(",") if d])) for t, dims in _ARRAY.findall(type_text)]


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


def _parse(text: str):
  """{computation: [(name, type, op, rest)]}, {computation: its root's name}, the entry computation's name."""
  comps, roots, entry, current = {}, {}, None, None
  for line in text.splitlines():
    if not line.startswith((" ", "}")) and (m := _HEADER.match(line)):
      current = m.group(1)
      comps[current] = []
      if line.startswith("ENTRY"):
        entry = current
    elif current is not None and (m := _INSTR.match(line)):
      root, *instr = m.groups()
      comps[current].append(tuple(instr))
      if root:
        roots[current] = instr[0]
  return comps, roots, entry


def _operands(rest: str) -> list[str]:
  return _OPERANDS.findall(rest.split(")", 1)[0])


_PASS = ("copy", "copy-start", "copy-done", "bitcast")


def _source(table: dict, name: str | None) -> str | None:
  """The instruction `name` stands for, through copies and bitcasts."""
  for _ in range(8):
    if name not in table or table[name][0] not in _PASS:
      break
    name = (_operands(table[name][1]) or [None])[0]
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
    base = _source(table, (_operands(rest) or [None])[0])
    return base in table and table[base][0] == "broadcast"
  m = re.search(r"\bcalls=%([\w.\-]+)", rest)
  if op != "fusion" or not m or m.group(1) not in roots:
    return False
  inner = {n: (o, r) for n, _, o, r in comps[m.group(1)]}
  root = inner[roots[m.group(1)]]
  if root[0] != "dynamic-update-slice":
    return False
  base = _source(inner, (_operands(root[1]) or [None])[0])
  if base in inner and inner[base][0] == "parameter":
    index, outer = int(re.match(r"(\d+)", inner[base][1]).group(1)), _operands(rest)
    base, inner = _source(table, outer[index]) if index < len(outer) else None, table
  return base in inner and inner[base][0] == "broadcast"


def _trip_count(cond: list) -> int | None:
  """N for a loop condition whose root is `compare(i, N), direction=LT` (or `N > i`) on a constant N."""
  constants = {}
  for name, _, op, rest in cond:
    if op == "constant" and (m := re.match(r"(-?\d+)\)", rest)):
      constants[name] = int(m.group(1))
  for name, _, op, rest in reversed(cond):
    if op == "compare":
      args = _OPERANDS.findall(rest.split(")", 1)[0])
      direction = re.search(r"direction=(\w+)", rest)
      if len(args) == 2 and direction:
        if direction.group(1) == "LT" and args[1] in constants:
          return constants[args[1]]
        if direction.group(1) == "GT" and args[0] in constants:
          return constants[args[0]]
      return None
  return None


def _runs(comps: dict, entry: str) -> tuple[dict, int]:
  """({computation: runs per run of the entry}, loops whose trip count is unknown)."""
  runs = dict.fromkeys(comps, 0)
  unknown = set()

  def visit(comp, times):
    runs[comp] += times
    for name, _, op, rest in comps[comp]:
      if op.endswith(("-done", "-update")):   # an async op's computation runs once, under its start
        continue
      callees = [(c, 1) for _, c in _CALL.findall(rest) if c in comps]
      for group in _CALL_LIST.findall(rest):
        callees += [(c, 1) for c in _OPERANDS.findall(group) if c in comps]
      if op == "while":
        body = re.search(r"\bbody=%([\w.\-]+)", rest).group(1)
        trips = _trip_count(comps[re.search(r"\bcondition=%([\w.\-]+)", rest).group(1)])
        if trips is None:
          unknown.add(name)
        callees = [(c, (trips or 1) if c == body else 1) for c, _ in callees]
      for callee, factor in callees:
        visit(callee, times * factor)

  visit(entry, 1)
  return runs, len(unknown)


def count(hlo_text: str, num_devices: int) -> dict:
  """{kind: {"ops", "executed", "bytes", "traffic_bytes"}} for `KINDS`, and "unknown_trip_counts": the while
  loops whose iterations could not be read (their collectives counted once)."""
  comps, roots, entry = _parse(hlo_text)
  runs, unknown = _runs(comps, entry)
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
      elif kind == "all-reduce" and all(_zero_based_update(comps, roots, comp, a) for a in _operands(rest)):
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
