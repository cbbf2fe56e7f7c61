"""`python -m osdn_jax.train --config=NAME --workdir=DIR [--config.FIELD=VALUE ...]`.

NAME is a named config (`osdn_jax/train/configs.py`: tiny, 340m, 1.3b, mqar) or a path to a Python file with
get_config() (ml_collections' config files: `--config=my_config.py:arg`). Every field can be overridden, e.g.
`--config.steps=200 --config.model=pgdn-340m --config.optimizer.lr=1e-3 --config.mesh.fsdp=2`; `point_options`
also takes new keys (`--config.point_options.x=2.0`), which the point checks. `--imports=my_points[,...]` imports
modules first (`osdn_jax.plugins`; the current directory is on the path), so a point one registers trains by name
(`--config.model=my-pgdn-tiny`).
Running again on the same DIR resumes from its newest complete checkpoint that passes its checksums; the resume
may change only `steps` and the logging, checkpointing and progress fields (`loop.RESUMABLE`). A second trainer
on a DIR that one is running in stops at once (`WorkdirLockedError`).

Several processes (docs/training.md, "Several processes"): every process runs the same command. With
--distributed alone, each first joins the run through `jax.distributed.initialize()`, which reads the cluster's
environment (SLURM, TPU pods, Open MPI, ...); with --coordinator_address=HOST:PORT --num_processes=N
--process_id=I (all three), through those values instead (the coordinator is process 0's host).
"""
from __future__ import annotations

import os
import sys
import traceback

import jax
from absl import app, flags

from osdn_jax import plugins
from osdn_jax.train import configs
from osdn_jax.train.checkpoints import quiet_checkpoint_logs
from osdn_jax.train.loop import train

_CONFIG = configs.define_config_flag()
_IMPORTS = plugins.define_imports_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "where the run's config, metrics and checkpoints go")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "join a multi-process run first: jax.distributed.initialize() "
                                  "from the cluster's environment (or from the three flags below)")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0's coordination service")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "processes in the run", lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index in [0, num_processes)", lower_bound=0)
flags.mark_flags_as_required(["config", "workdir"])


def distributed_args(coordinator_address, num_processes, process_id) -> dict | None:
  """jax.distributed.initialize's keyword arguments from the three flags: None when none is set, a dict when all
  are; app.UsageError for a partial set or a process id outside [0, num_processes)."""
  given = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
  if all(v is None for v in given.values()):
    return None
  if missing := [f"--{k}" for k, v in given.items() if v is None]:
    raise app.UsageError(f"--coordinator_address, --num_processes and --process_id go together; missing "
                         f"{', '.join(missing)} (or pass --distributed alone to read the cluster's environment)")
  if process_id >= num_processes:
    raise app.UsageError(f"--process_id ({process_id}) must be below --num_processes ({num_processes})")
  return given


def main(argv):
  quiet_checkpoint_logs()
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  explicit = distributed_args(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  if explicit is not None:
    jax.distributed.initialize(**explicit)
  elif _DISTRIBUTED.value:
    jax.distributed.initialize()
  try:
    train(_CONFIG.value, _WORKDIR.value)
  except BaseException:
    if explicit is None and not _DISTRIBUTED.value:
      raise
    # The others may wait in a collective with this process: exiting normally would first wait for them at the
    # distributed runtime's shutdown barrier (minutes). Exiting at once fails their collectives instead.
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)


if __name__ == "__main__":
  app.run(main, argv=configs.flag_args(sys.argv))
