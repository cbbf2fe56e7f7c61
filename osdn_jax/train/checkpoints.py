"""Checkpoints: orbax's CheckpointManager (asynchronous, keep-N, atomic) holding the training state and the data
position, under DIR/checkpoints/<step>/, with the SHA-256 of every file it wrote in
DIR/checkpoints/<step>/checksums.json.

The data position (`data.Pipeline.get_state`) is the same in every process and names no process: each process
writes it as data/process_<I>-of-<N>.json (grain's handler), and a restore reads data/process_0-of-<N>.json
whatever the number of processes restoring, so a run resumes on another number of processes.

A step directory appears only once its save is complete (orbax writes to a temporary name and renames), so a
process killed mid-save leaves the previous checkpoints intact and the temporary one is removed at the next
start. The checksums are written into the temporary directory after every process's files and before the
rename, so a complete checkpoint always holds them. A restore first verifies them (every listed file present,
with its digest), then reads the checkpoint and checks that its state is finite (one reduction). A checkpoint that
fails (a changed byte, a missing file or checksums.json, a NaN or ±Inf in its state) or that cannot be read is
skipped with a warning naming it, and the one before it is tried. A trainer then moves a checkpoint that failed,
and an unreadable one newer than the checkpoint it restored, aside to <step>.damaged-<UTC time> beside it
(`set_aside`: kept, never deleted, and no longer a checkpoint, so it holds none of the `keep` slots and its step
is saved again). A checkpoint without checksums.json (written by a version that wrote none) is restored
unverified, and every message about it says so.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import logging as py_logging
import os
import pathlib
from typing import Any, NamedTuple

import grain.checkpoint
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils
from orbax.checkpoint.path import atomicity_types

CHECKSUMS = "checksums.json"
# Top-level files orbax writes or rewrites at the commit, after the checksums: the step's metadata (its commit
# time; no array or position) and the commit marker.
_COMMITTED_LATER = ("_CHECKPOINT_METADATA", "commit_success.txt")
UNVERIFIED = f"unverified: it holds no {CHECKSUMS}"
DAMAGED = ".damaged-"


class Restored(NamedTuple):
  """A restored checkpoint: its step, the state, the data position and whether it passed its checksums (False:
  it holds none)."""
  step: int
  state: Any
  data_state: Any
  verified: bool


class _DataPosition:
  """A data position in the duck type grain's orbax handler saves (get_state as bytes): a snapshot taken when the
  save is asked for, so an asynchronous save never sees a later position."""

  def __init__(self, state=None):
    self.state = state

  def get_state(self) -> bytes:
    return json.dumps(self.state).encode()


class _QuietOrbax(py_logging.Filter):
  """Drops orbax's INFO records (one batch of lines per save); its warnings and errors pass."""

  def filter(self, record):
    return record.levelno >= py_logging.WARNING or "/orbax/" not in record.pathname


def quiet_checkpoint_logs() -> None:
  """Keeps orbax's per-save INFO lines out of the absl log (warnings and errors still show)."""
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _QuietOrbax) for f in handler.filters):
    handler.addFilter(_QuietOrbax())


def _digest(path: pathlib.Path) -> str:
  with path.open("rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def _summed_files(step_dir: pathlib.Path) -> list[str]:
  """The paths (relative, "/"-separated) of a checkpoint directory's files that its checksums cover."""
  return sorted(p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*")
                if p.is_file() and not (p.parent == step_dir and p.name in (CHECKSUMS, *_COMMITTED_LATER)))


def write_checksums(step_dir) -> None:
  """Writes step_dir/checksums.json: {"sha256": {relative path: hex digest}} of every file it covers."""
  step_dir = pathlib.Path(step_dir)
  sums = {name: _digest(step_dir / name) for name in _summed_files(step_dir)}
  part = step_dir / f"{CHECKSUMS}.part"
  part.write_text(json.dumps({"sha256": sums}, indent=1, sort_keys=True) + "\n")
  os.replace(part, step_dir / CHECKSUMS)


def verify(step_dir) -> str | None:
  """Why the checkpoint directory fails its checksums (a file missing or changed, checksums.json unreadable), or
  None when every file checksums.json lists has its digest, and when it holds no checksums.json (written by a
  version that wrote none: `has_checksums` tells, and a restore calls it unverified)."""
  step_dir = pathlib.Path(step_dir)
  try:
    sums = json.loads((step_dir / CHECKSUMS).read_text())["sha256"]
  except FileNotFoundError:
    return None
  except (ValueError, KeyError, TypeError):   # UnicodeDecodeError is a ValueError
    return f"its {CHECKSUMS} is unreadable"
  if not isinstance(sums, dict):
    return f"its {CHECKSUMS} is unreadable"
  for name, want in sorted(sums.items()):
    path = step_dir / name
    if not path.is_file():
      return f"{name} is missing"
    if _digest(path) != want:
      return f"{name} does not match its checksum"
  return None


def has_checksums(step_dir) -> bool:
  """Whether the checkpoint directory holds checksums.json (whatever its content)."""
  return (pathlib.Path(step_dir) / CHECKSUMS).is_file()


@jax.jit
def _finite_leaves(state):
  return jax.tree.map(lambda x: jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else True, state)


def nonfinite_entry(state) -> str | None:
  """The path (`jax.tree_util.keystr`) of the first array of `state` that holds a NaN or ±Inf, or None when all
  are finite: one jitted reduction per array, read on the host."""
  flags = jax.device_get(_finite_leaves(state))
  for path, ok in jax.tree_util.tree_leaves_with_path(flags):
    if not bool(ok):
      return jax.tree_util.keystr(path)
  return None


def _stamp() -> str:
  """The UTC time now, as 20250101T120000Z."""
  return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


class Checkpoints:
  """orbax's manager over `directory` (keep: checkpoints kept; async_save: whether `save` returns before the
  files are written; read_only: for restores only, leaving the directory as it is, a running trainer's
  temporary checkpoint included)."""

  def __init__(self, directory, *, keep: int, async_save: bool = True, read_only: bool = False):
    self.directory = pathlib.Path(directory)
    self.async_save = async_save
    self.read_only = read_only
    self._saving = None   # the step whose save is in flight (one at a time)
    self.damaged = []     # [(step, why)] of the checkpoints the last restore found damaged (`set_aside`)
    # Always orbax's asynchronous checkpointer (its post-finalisation callback writes the checksums); a
    # synchronous save waits for it.
    self.manager = ocp.CheckpointManager(
        directory, item_names=("state", "data"),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True, cleanup_tmp_directories=not read_only,
            create=not read_only,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._write_checksums)))

  def _write_checksums(self) -> None:
    """orbax's post-finalisation callback: on process 0, in the save's thread, once every process's files are
    written and before the commit renames the temporary directory (which then is the step's)."""
    for path in (self.directory / f"{self._saving}{atomicity_types.TMP_DIR_SUFFIX}",
                 self.directory / str(self._saving)):
      if path.is_dir():
        return write_checksums(path)
    raise FileNotFoundError(f"checkpoint {self._saving}: no directory under {self.directory} to write its "
                            f"{CHECKSUMS} into")

  def save(self, step: int, state, data_state) -> None:
    """Starts saving `state` (a pytree of arrays) and `data_state` (JSON-able) as checkpoint `step` (and
    finishes it, unless async_save). RuntimeError when orbax declines (the directory holds step `step` or a
    later one), so no save is ever skipped silently."""
    self.manager.wait_until_finished()   # orbax's save waits too; the callback reads self._saving
    self._saving = step
    saved = self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(_DataPosition(data_state))))
    if not saved:
      raise RuntimeError(f"checkpoint {step} was not saved: {self.directory} already holds checkpoint "
                         f"{self.manager.latest_step()}")
    if not self.async_save:
      self.manager.wait_until_finished()

  def _verification(self, step: int) -> tuple[str | None, bool]:
    """(`verify`'s answer, whether it holds checksums) for checkpoint `step`: read on process 0, shared with every
    process (so all restore the same checkpoint)."""
    if jax.process_index() == 0:
      step_dir = self.directory / str(step)
      problem, verified = verify(step_dir), has_checksums(step_dir)
    else:
      problem, verified = None, False
    if jax.process_count() > 1:
      code = int(multihost_utils.broadcast_one_to_all(np.int32(2 if problem else int(verified))))
      problem = (problem or "it fails verification on process 0") if code == 2 else None
      verified = code == 1
    return problem, verified

  def _skip(self, step: int, why: str, *, older: bool = True) -> None:
    logging.warning("checkpoint %s/%d cannot be restored (%s); %s", self.directory, step, why,
                    "falling back to the previous one" if older else "no older checkpoint is left")

  def restore_latest(self, abstract_state, *, step: int | None = None) -> Restored | None:
    """The newest checkpoint (checkpoint `step` only, if given) that passes its checksums, can be read and holds a
    finite state (`Restored`), or None if there is none. Writes nothing: `damaged` then lists (step, why) of the
    checkpoints that failed and of those newer than the one restored that could not be read, for `set_aside`.

    abstract_state: the state's pytree of jax.ShapeDtypeStruct with shardings (where the arrays go). Raises
    RuntimeError when none can be restored and some would remain (a run of another model, say: starting afresh
    there would mix two runs in one directory); when every one is damaged, a trainer's manager returns None (its
    run starts afresh once they are set aside)."""
    steps = sorted(self.manager.all_steps(), reverse=True)
    if step is not None:
      steps = [s for s in steps if s == step]
    self.damaged, unreadable = [], []
    for i, step in enumerate(steps):
      older = i + 1 < len(steps)
      problem, verified = self._verification(step)
      note = "" if verified else f"{UNVERIFIED}; "
      if problem:
        self._fail(step, f"fails verification: {problem}", older=older)
        continue
      try:
        position = self._data_position(step)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state)))
      except Exception as e:  # noqa: BLE001 — any unreadable checkpoint falls back to the one before
        why = f"{note}{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        self._skip(step, why, older=older)
        unreadable.append((step, why))
        continue
      if entry := nonfinite_entry(restored["state"]):
        self._fail(step, f"{note}its state's `{entry}` holds non-finite values", older=older)
        continue
      self.damaged += unreadable
      if not verified:
        logging.warning("checkpoint %s/%d restored without verification (%s)", self.directory, step, UNVERIFIED)
      return Restored(step, restored["state"], position, verified)
    if left := sorted([s for s, _ in unreadable] + ([s for s, _ in self.damaged] if self.read_only else [])):
      raise RuntimeError(f"none of the checkpoints {left} in {self.directory} can be restored into this run's "
                         "state (the warnings above say why); use a new work directory")
    return None

  def _fail(self, step: int, why: str, *, older: bool) -> None:
    self._skip(step, why, older=older)
    self.damaged.append((step, why))

  def _aside(self, step: int) -> pathlib.Path:
    """A free name for checkpoint `step` moved aside: <step>.damaged-<UTC time>[-<n>]."""
    name = f"{step}{DAMAGED}{_stamp()}"
    target, n = self.directory / name, 1
    while target.exists():
      n += 1
      target = self.directory / f"{name}-{n}"
    return target

  def set_aside(self) -> None:
    """Moves every checkpoint of `damaged` (the last restore's) aside: renamed (on process 0) to
    <step>.damaged-<UTC time> beside the others, kept and no longer a checkpoint, with a warning naming it; then
    every process rereads the steps, so each such step is saved again."""
    if self.read_only or not self.damaged:
      return
    if jax.process_index() == 0:
      for step, why in self.damaged:
        target = self._aside(step)
        os.replace(self.directory / str(step), target)
        logging.warning("checkpoint %s/%d cannot be restored (%s): moved aside to %s", self.directory, step, why,
                        target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("checkpoints: damaged ones moved aside")
    self.manager.reload()
    self.damaged = []

  def _data_position(self, step: int):
    """Checkpoint `step`'s data position: process 0's file, which every process of the run that saved it wrote
    alike; FileNotFoundError when it holds none, ValueError when it is not JSON."""
    data = self.directory / str(step) / "data"
    found = sorted(data.glob("process_0-of-*.json"))
    if len(found) != 1:
      raise FileNotFoundError(f"{data} holds {'no' if not found else 'more than one'} data position "
                              "process_0-of-<N>.json")
    return json.loads(found[0].read_text())

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()
