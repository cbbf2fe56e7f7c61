"""Reading a compiled program's optimised HLO text (`compiled.as_text()`): its computations and instructions, an
instruction's operands, the sizes of HLO array types, and how often each computation runs.

    comps, roots, entry = hlo.parse(compiled.as_text())
    runs, unknown = hlo.runs(comps, entry)      # {computation: runs per run of the entry}, loops of unknown length
    for name, type_text, op, rest in comps[entry]:
      hlo.operands(rest)                        # the names of the instruction's operands

Shared by `train.collectives` (the collectives of a step) and `benchmarks/tpu_cost.py` (the roofline of every op).
"""
from __future__ import annotations

import math
import re

# dtype → bits per element (f8 types not listed here count 8, any other unknown type 32: `dtype_bits`).
BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32,
        "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128, "token": 0}
# One array in an HLO type, `dtype[dims]`: groups (dtype, dims as "d0,d1,…").
ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[([0-9,]*)\]")

_HEADER = re.compile(r"^(?:ENTRY )?%?([^\s(]+) .*\{$")
_INSTR = re.compile(r"^\s+(ROOT )?%?([^\s=]+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_CALL = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_CALL_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_OPERANDS = re.compile(r"%([\w.\-]+)")


def dtype_bits(dtype: str) -> int:
  """Bits per element of an HLO dtype (`BITS`; 8 for an unlisted f8 type, else 32)."""
  return BITS.get(dtype, 8 if dtype.startswith("f8") else 32)


def array_bytes(dtype: str, dims: str) -> int:
  """The logical bytes of one array, dims as printed ("d0,d1,…"; "" for a scalar); no layout padding."""
  return math.prod(int(d) for d in dims.split(",") if d) * dtype_bits(dtype) // 8


def parse(text: str):
  """(comps, roots, entry): {computation: [(name, type, op, rest)]} in program order (`rest`: the text after the
  op's opening parenthesis), {computation: its root's name}, the entry computation's name."""
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


def operands(rest: str) -> list[str]:
  """The names of an instruction's operands, from its `rest` (`parse`)."""
  return _OPERANDS.findall(rest.split(")", 1)[0])


def trip_count(cond: list) -> int | None:
  """N for a loop condition (its instructions, as `parse` lists them) whose root is `compare(i, N),
  direction=LT` (or `N > i`) on a constant N; else None."""
  constants = {}
  for name, _, op, rest in cond:
    if op == "constant" and (m := re.match(r"(-?\d+)\)", rest)):
      constants[name] = int(m.group(1))
  for name, _, op, rest in reversed(cond):
    if op == "compare":
      args = operands(rest)
      direction = re.search(r"direction=(\w+)", rest)
      if len(args) == 2 and direction:
        if direction.group(1) == "LT" and args[1] in constants:
          return constants[args[1]]
        if direction.group(1) == "GT" and args[0] in constants:
          return constants[args[0]]
      return None
  return None


def runs(comps: dict, entry: str) -> tuple[dict, int]:
  """({computation: runs per run of the entry}, loops whose trip count is unknown): a while body runs
  `trip_count` times per run of its loop (once when unknown); every other callee once per call; an async op's
  computation once, under its start; computations the entry never reaches 0."""
  counts = dict.fromkeys(comps, 0)
  unknown = set()

  def visit(comp, times):
    counts[comp] += times
    for name, _, op, rest in comps[comp]:
      if op.endswith(("-done", "-update")):   # an async op's computation runs once, under its start
        continue
      callees = [(c, 1) for _, c in _CALL.findall(rest) if c in comps]
      for group in _CALL_LIST.findall(rest):
        callees += [(c, 1) for c in _OPERANDS.findall(group) if c in comps]
      if op == "while":
        body = re.search(r"\bbody=%([\w.\-]+)", rest).group(1)
        trips = trip_count(comps[re.search(r"\bcondition=%([\w.\-]+)", rest).group(1)])
        if trips is None:
          unknown.add(name)
        callees = [(c, (trips or 1) if c == body else 1) for c, _ in callees]
      for callee, factor in callees:
        visit(callee, times * factor)

  visit(entry, 1)
  return counts, len(unknown)
