"""`python -m osdn_jax.train --config=NAME --workdir=DIR [--config.FIELD=VALUE ...]`.

NAME is a named config (`osdn_jax/train/configs.py`: tiny, 340m, 1.3b, mqar) or a path to a Python file with
get_config() (ml_collections' config files: `--config=my_config.py:arg`). Every field can be overridden, e.g.
`--config.steps=200 --config.model=pgdn-340m --config.optimizer.lr=1e-3 --config.mesh.fsdp=2`.
Running again on the same DIR resumes from its newest complete checkpoint. With --distributed, the process
first joins a multi-process run (`jax.distributed.initialize()`, which reads the cluster's environment).
"""
from __future__ import annotations

import pathlib
import sys

import jax
from absl import app, flags
from ml_collections import config_flags

from osdn_jax.train import configs
from osdn_jax.train.checkpoints import quiet_checkpoint_logs
from osdn_jax.train.loop import train

_CONFIG = config_flags.DEFINE_config_file("config", None, "a named config (tiny, 340m, 1.3b) or a config file",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "where the run's config, metrics and checkpoints go")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "call jax.distributed.initialize() first")
flags.mark_flags_as_required(["config", "workdir"])


def _named_configs(argv: list[str]) -> list[str]:
  """--config=NAME → --config=<this package's configs.py>:NAME, for the names in `configs.CONFIGS`."""
  path = pathlib.Path(configs.__file__)
  out = []
  for i, arg in enumerate(argv):
    if arg.startswith("--config=") and arg.split("=", 1)[1] in configs.CONFIGS:
      arg = f"--config={path}:{arg.split('=', 1)[1]}"
    elif i and argv[i - 1] == "--config" and arg in configs.CONFIGS:
      arg = f"{path}:{arg}"
    out.append(arg)
  return out


def main(argv):
  quiet_checkpoint_logs()
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _DISTRIBUTED.value:
    jax.distributed.initialize()
  train(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main, argv=_named_configs(sys.argv))
