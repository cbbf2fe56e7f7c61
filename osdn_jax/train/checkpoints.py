"""Checkpoints: orbax's CheckpointManager (asynchronous, keep-N, atomic) holding the training state and each
process's data-iterator position, under DIR/checkpoints/<step>/.

A step directory appears only once its save is complete (orbax writes to a temporary name and renames), so a
process killed mid-save leaves the previous checkpoints intact and the temporary one is removed at the next
start. A complete checkpoint that cannot be read (a damaged file) is skipped with a warning naming it, and the
one before it is tried.
"""
from __future__ import annotations

import json
import logging as py_logging

import grain.checkpoint
import orbax.checkpoint as ocp
from absl import logging


class _DataPosition:
  """A data position in the duck type grain's orbax handler saves and restores (get_state/set_state as
  bytes): a snapshot taken when the save is asked for, so an asynchronous save never sees a later position."""

  def __init__(self, state=None):
    self.state = state

  def get_state(self) -> bytes:
    return json.dumps(self.state).encode()

  def set_state(self, state: bytes) -> None:
    self.state = json.loads(state)

  def start_prefetch(self) -> None:
    """Called by grain's handler after a restore; a snapshot has nothing to prefetch."""


class _QuietOrbax(py_logging.Filter):
  """Drops orbax's INFO records (one batch of lines per save); its warnings and errors pass."""

  def filter(self, record):
    return record.levelno >= py_logging.WARNING or "/orbax/" not in record.pathname


def quiet_checkpoint_logs() -> None:
  """Keeps orbax's per-save INFO lines out of the absl log (warnings and errors still show)."""
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _QuietOrbax) for f in handler.filters):
    handler.addFilter(_QuietOrbax())


class Checkpoints:
  def __init__(self, directory, *, keep: int, async_save: bool = True):
    self.directory = directory
    self.manager = ocp.CheckpointManager(
        directory, item_names=("state", "data"),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                             cleanup_tmp_directories=True, create=True))

  def save(self, step: int, state, data_state) -> None:
    """Starts saving `state` (a pytree of arrays) and `data_state` (JSON-able) as checkpoint `step`."""
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(_DataPosition(data_state))))

  def restore_latest(self, abstract_state, *, step: int | None = None):
    """(step, state, data_state) of the newest readable checkpoint (of checkpoint `step` only, if given), or
    None if there is none.

    abstract_state: the state's pytree of jax.ShapeDtypeStruct with shardings (where the arrays go). Raises
    RuntimeError when checkpoints exist but none can be read (a run of another model, say): starting afresh
    there would mix two runs in one directory."""
    steps = sorted(self.manager.all_steps(), reverse=True)
    if step is not None:
      steps = [s for s in steps if s == step]
    for step in steps:
      position = _DataPosition()
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=grain.checkpoint.CheckpointRestore(position)))
      except Exception as e:  # noqa: BLE001 — any unreadable checkpoint falls back to the one before
        logging.warning("checkpoint %s/%d cannot be restored (%s: %s); falling back to the previous one",
                        self.directory, step, type(e).__name__, str(e).splitlines()[0][:300])
        continue
      return step, restored["state"], position.state
    if steps:
      raise RuntimeError(f"none of the checkpoints {sorted(steps)} in {self.directory} can be restored into this "
                         "run's state (the warnings above say why); use a new work directory")
    return None

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()
