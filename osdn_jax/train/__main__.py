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

The command line's errors (an unknown config name, a config field that does not exist such as --config.stpes=3,
a bad value, a work directory that is a file, any other flag error) and the errors a run stops with that the
user's input causes (`osdn_jax.cli.user_errors`: data that cannot be read, a token id outside the vocabulary
(`TokenIdError`), a non-finite loss or state (`NonFiniteError`), a work directory another trainer holds
(`WorkdirLockedError`), ...) are one line on stderr, `train: <message>`; the exit status is 2 for the command
line's errors and the config's fields the trainer refuses before any work (`configs.validate`), 1 for the others
(an --imports module that cannot be imported among them); --debug (or
OSDN_DEBUG=1) shows their tracebacks instead. The end of a run prints its summary (steps, final training loss,
held-out loss, tokens/s, where the checkpoints and metrics are) on stdout.
"""
from __future__ import annotations

import os
import re
import sys
import traceback

import jax
from absl import app, flags

from osdn_jax import cli as cli_lib
from osdn_jax import plugins
from osdn_jax.train import configs
from osdn_jax.train.checkpoints import quiet_checkpoint_logs
from osdn_jax.train.loop import describe, run

# --help shows the config's fields too (absl prints the main module's docstring).
if __doc__ and configs.__doc__:   # (none under python -OO)
  __doc__ += "\nConfig fields" + configs.__doc__.split("\nFields", 1)[1]
HELP = ("--help", "-help", "--helpshort", "-helpshort", "-?", "-h", "--helpfull", "-helpfull")

_CONFIG = configs.define_config_flag()
_IMPORTS = plugins.define_imports_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "where the run's config, metrics and checkpoints go")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "join a multi-process run first: jax.distributed.initialize() "
                                  "from the cluster's environment (or from the three flags below)")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0's coordination service")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "processes in the run", lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index in [0, num_processes)", lower_bound=0)
cli_lib.define_debug_flag()
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


def _line(message) -> str:
  """The error's one line, "train: " first unless it names the trainer already ("train: ", "train config: ")."""
  text = cli_lib.one_line(message)
  return text if text.startswith(("train:", "train config:")) else "train: " + text


def fail(message: str, status: int = cli_lib.RUNTIME):
  """Ends the command with `message` as one line on stderr, exit `status` (1; 2 for a usage error)."""
  cli_lib.fail(_line(message), status, prefix="")


def _imports_failed(error: BaseException) -> bool:
  """Whether a flags error is --imports' validator's: a module that could not be imported (an ImportError)."""
  return str(error).startswith(f"flag --{plugins.FLAG}=")


def _unknown_field(error: KeyError, args: list[str]) -> str:
  """The one line for ml_collections' KeyError of an override naming a field the config lacks."""
  text = str(error.args[0]) if error.args else ""
  # A missing field: 'Key "stpes" does not exist ...'; a missing parent (--config.optimzer.lr): "'optimzer'".
  found = re.search(r'Key "([^"]+)" does not exist', text) or re.match(r"'([^']+)'", text)
  key = found[1] if found else text
  given = next((a.split("=", 1)[0] for a in args if a.startswith("--config.")
                and key in a.split("=", 1)[0].split(".")[1:]), None)
  if given is None:
    return f"bad config override: {type(error).__name__}: {text.splitlines()[0] if text else ''}"
  guess, hint = re.search(r'Did you mean "([^"]+)"', text), ""
  if guess:
    parts = given.split(".")
    parts[parts.index(key)] = guess[1]
    hint = f"; did you mean {'.'.join(parts)}?"
  return f"{given}: the config has no field {key!r}{hint} (--help lists the fields)"


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (app.run's flags_parser) with the trainer's manners: --help (-h, --helpshort,
  --helpfull) prints the usage with the config's fields and exits 0; an unknown --config name, an override of a
  field the config lacks, and any other flag error end the command with one line (`fail`)."""
  args = argv[1:argv.index("--")] if "--" in argv else argv[1:]
  if any(a in HELP for a in args):
    app.usage(shorthelp=not any(a in ("--helpfull", "-helpfull") for a in args), writeto_stdout=True)
    sys.exit(0)
  values = [a.split("=", 1)[1] for a in args if a.startswith("--config=")]
  values += [v for a, v in zip(args, args[1:]) if a == "--config"]
  for value in values:   # flag_args made a named config its file in configs.py; ml_collections reads path[:arg]
    if not os.path.isfile(value.split(":", 1)[0]):
      fail(f"unknown --config {value!r}: not a named config ({', '.join(configs.CONFIGS)}) nor a config file "
           "(--config=path/to/file.py[:arg], a file with get_config())", cli_lib.USAGE)
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    lines = [line for line in str(e).splitlines() if line.strip()]
    # A config file that raised: absl's message holds the traceback, whose last line is the error.
    fail(lines[0] + (f" {lines[-1].strip()}" if len(lines) > 1 and "Traceback" in str(e) else "")
         if lines else type(e).__name__, cli_lib.RUNTIME if _imports_failed(e) else cli_lib.USAGE)
  except KeyError as e:
    fail(_unknown_field(e, args), cli_lib.USAGE)


def main(argv):
  quiet_checkpoint_logs()
  if len(argv) > 1:
    fail(f"unexpected arguments: {argv[1:]}", cli_lib.USAGE)
  config, workdir = _CONFIG.value, _WORKDIR.value
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    fail(f"--workdir={workdir} is a file; name a directory (a new one starts a run, an existing run's resumes it)",
         cli_lib.USAGE)
  try:
    configs.validate(config)
  except ValueError as e:
    fail(str(e), cli_lib.USAGE)
  try:
    explicit = distributed_args(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  except app.UsageError as e:
    fail(str(e), cli_lib.USAGE)
  if explicit is not None:
    jax.distributed.initialize(**explicit)
  elif _DISTRIBUTED.value:
    jax.distributed.initialize()
  distributed = explicit is not None or _DISTRIBUTED.value
  try:
    result = run(config, workdir)
    if jax.process_index() == 0:
      print(describe(result.summary, workdir), flush=True)
  except BaseException as e:
    user_error = isinstance(e, cli_lib.user_errors()) and not cli_lib.debug()
    if not distributed:
      if user_error:
        fail(e)
      raise
    # The others may wait in a collective with this process: exiting normally would first wait for them at the
    # distributed runtime's shutdown barrier (minutes). Exiting at once fails their collectives instead.
    if user_error:
      sys.stderr.write(_line(e) + "\n")
    else:
      traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)


if __name__ == "__main__":
  app.run(main, argv=configs.flag_args(sys.argv), flags_parser=parse_flags)
