"""What a run reports: DIR/metrics.jsonl (one JSON object per logged step), TensorBoard event files under
DIR/tensorboard, and a progress bar (step, loss, tokens/s, ETA). Only process 0 writes."""
from __future__ import annotations

import json
import math
import os
import pathlib

import tensorboardX
import tqdm
from absl import logging


def _row(line: str):
  """The logged row of a metrics.jsonl line, or None if the line is not a JSON object with an integer step."""
  try:
    row = json.loads(line)
  except json.JSONDecodeError:
    return None
  return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def _scalar(v):
  return float(v) if not isinstance(v, (list, tuple)) else [float(x) for x in v]


def _replace(path: pathlib.Path, text: str) -> None:
  """Makes `text` the content of `path` at once: written to path.part, flushed to disk, renamed over `path`; a
  process killed at any moment leaves the old content or the new one."""
  part = path.with_name(path.name + ".part")
  with part.open("w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(part, path)


class Writer:
  """Appends logged steps to metrics.jsonl and TensorBoard. resume_step: the step a resumed run restarted
  from; lines and events logged after it by the interrupted run are dropped, so each step is logged once. The
  kept lines replace metrics.jsonl whole (`_replace`), never in place."""

  def __init__(self, workdir, *, enabled: bool, resume_step: int = 0):
    self.enabled = enabled
    if not enabled:
      return
    self.path = pathlib.Path(workdir) / "metrics.jsonl"
    if self.path.exists():
      text = self.path.read_text()
      rows = [(line, _row(line)) for line in text.splitlines() if line.strip()]
      if rows and rows[-1][1] is None:   # a final line torn by a kill or a full disk mid-write
        logging.warning("%s: dropped a torn last line %r", self.path, rows.pop()[0][:80])
      for number, (line, row) in enumerate(rows, 1):
        if row is None:
          raise ValueError(f"{self.path}, line {number}: not a JSON object with an integer `step`: {line[:80]!r}")
      kept = "".join(line + "\n" for line, row in rows if row["step"] <= resume_step)
      if kept != text:
        _replace(self.path, kept)
    self.file = self.path.open("a")
    self.tb = tensorboardX.SummaryWriter(str(pathlib.Path(workdir) / "tensorboard"), purge_step=resume_step + 1)

  def write(self, step: int, scalars: dict) -> None:
    if not self.enabled:
      return
    row = {"step": int(step), **{k: _scalar(v) for k, v in scalars.items()}}
    self.file.write(json.dumps(row, allow_nan=True) + "\n")
    self.file.flush()
    for key, value in row.items():
      if key == "step":
        continue
      if isinstance(value, list):
        for i, x in enumerate(value):
          if math.isfinite(x):
            self.tb.add_scalar(f"{key}/layer_{i:02d}", x, step)
      elif math.isfinite(value):
        self.tb.add_scalar(key, value, step)

  def close(self) -> None:
    if self.enabled:
      self.file.close()
      self.tb.close()


class Progress:
  """A tqdm bar on process 0: position, ETA, and the last logged loss and tokens/s."""

  def __init__(self, *, total: int, initial: int, enabled: bool):
    self.bar = tqdm.tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True) if enabled else None

  def update(self, n: int = 1, **postfix) -> None:
    if self.bar is not None:
      if postfix:
        self.bar.set_postfix(postfix, refresh=False)
      self.bar.update(n)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
