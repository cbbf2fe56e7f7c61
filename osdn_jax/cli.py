"""The command lines' manners: a mistake a user can make is one line on stderr, never a traceback.

    from osdn_jax import cli
    def main(argv):
      lrs = cli.floats("lrs", FLAGS.lrs)          # "--lrs=abc: 'abc' is not a number ..."
      with cli.usage():                           # a ValueError here is a usage error (exit status 2)
        spec = Spec(...)
      ...
    if __name__ == "__main__":
      cli.run(main)                               # absl's app.run with the manners below

`run` (every program of the package but the trainer, whose own parser keeps exit status 1 for everything;
`osdn_jax.train.__main__`) ends a command that fails with one line on stderr, `error: <message>`, where the
message names the argument or file and what would be accepted, and exits with status 2 for a usage error (a flag
absl cannot parse, `UsageError`, absl's `app.UsageError`) or 1 for any other error a user's input causes
(`USER_ERRORS`: ValueError, a missing or existing file, a package that is not installed, the trainer's
`NonFiniteError` and `WorkdirLockedError`). `--debug` (or OSDN_DEBUG=1 in the environment) lets the error raise
as it would, traceback and all; any other exception is a bug and keeps its traceback.

Imports only the standard library, and absl when a program runs.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import NoReturn

DEBUG_ENV = "OSDN_DEBUG"
USAGE, RUNTIME = 2, 1            # exit statuses
# The classes of error a user's input causes (besides the trainer's, `user_errors`).
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
               PermissionError, ImportError)
# Named errors of modules that are not imported here (they import jax): (module, class name).
_NAMED = (("osdn_jax.train.loop", "NonFiniteError"), ("osdn_jax.train.loop", "WorkdirLockedError"))


class UsageError(ValueError):
  """An argument the command cannot accept: the message names it and what would be accepted. Exit status 2 on
  the command line; a ValueError to a Python caller."""


def user_errors() -> tuple[type, ...]:
  """`USER_ERRORS` and the named errors of the modules this process has imported."""
  named = [getattr(sys.modules[m], name) for m, name in _NAMED if m in sys.modules]
  return USER_ERRORS + tuple(named)


def is_usage(error: BaseException) -> bool:
  """Whether the error is a usage error (exit status 2): `UsageError`, absl's `app.UsageError` or flags error."""
  if isinstance(error, UsageError):
    return True
  absl = sys.modules.get("absl.app"), sys.modules.get("absl.flags")
  return ((absl[0] is not None and isinstance(error, absl[0].UsageError))
          or (absl[1] is not None and isinstance(error, absl[1].Error)))


def debug() -> bool:
  """Whether errors keep their tracebacks: --debug, or OSDN_DEBUG set to anything but "", "0" or "false"."""
  if os.environ.get(DEBUG_ENV, "").lower() not in ("", "0", "false"):
    return True
  absl_flags = sys.modules.get("absl.flags")
  return absl_flags is not None and "debug" in absl_flags.FLAGS and bool(absl_flags.FLAGS["debug"].value)


def one_line(error: BaseException | str) -> str:
  """The error's message on one line (its type's name where it has none)."""
  text = error if isinstance(error, str) else (str(error) or type(error).__name__)
  if isinstance(error, KeyError) and error.args:
    text = str(error.args[0])
  return " ".join(text.split())


def fail(message: BaseException | str, status: int = RUNTIME, prefix: str = "error: ") -> NoReturn:
  """Ends the command: `prefix` + the message as one line on stderr, exit `status`."""
  sys.stdout.flush()
  sys.stderr.write(prefix + one_line(message) + "\n")
  sys.stderr.flush()
  sys.exit(status)


@contextlib.contextmanager
def handled(prefix: str = "error: ", status: int | None = None):
  """Inside: a user's error (`user_errors`, a usage error) ends the command through `fail` (status: 2 for a usage
  error, else 1, unless given), unless `debug()`; any other exception passes."""
  try:
    yield
  except BaseException as e:   # noqa: BLE001 -- filtered just below
    if debug() or not (isinstance(e, user_errors()) or is_usage(e)):
      raise
    fail(e, status if status is not None else (USAGE if is_usage(e) else RUNTIME), prefix)


@contextlib.contextmanager
def usage():
  """Inside: a ValueError is a `UsageError` (exit status 2): for building settings from the flags."""
  try:
    yield
  except UsageError:
    raise
  except ValueError as e:
    raise UsageError(one_line(e)) from e


def define_debug_flag() -> None:
  """Defines --debug on absl's FLAGS, once."""
  from absl import flags
  if "debug" not in flags.FLAGS:
    flags.DEFINE_bool("debug", False, f"show an error's traceback (as {DEBUG_ENV}=1 does)")


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing with one line for a flag it cannot parse (exit status 2)."""
  from absl import flags
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    if "--debug" in argv or debug():
      raise
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = " ".join(lines[:1] + (lines[-1:] if len(lines) > 1 and "Traceback" in str(e) else []))
    fail(text or type(e).__name__, USAGE)


def run(main: Callable[[list[str]], object], argv: list[str] | None = None,
        flags_parser: Callable[[list[str]], list[str]] | None = None) -> None:
  """absl's `app.run(main)` with --debug and one-line errors (module docstring); flags_parser: default
  `parse_flags` (one that ends a usage error through `fail` as it does)."""
  from absl import app
  define_debug_flag()

  def guarded(args):
    with handled():
      return main(args)
  app.run(guarded, argv=argv, flags_parser=flags_parser or parse_flags)


# -- the values of list flags -----------------------------------------------------------------------------------
def items(flag: str, values: Iterable[str], parse: Callable[[str], object], expected: str) -> tuple:
  """Each value of the list flag --`flag` parsed; `UsageError` naming the flag, the value and `expected` (what
  would be accepted) for one that `parse` refuses (ValueError or TypeError)."""
  values = list(values)
  out = []
  for value in values:
    try:
      out.append(parse(value.strip()))
    except (ValueError, TypeError):
      raise UsageError(f"--{flag}={','.join(values)}: {value.strip()!r} is not {expected}") from None
  return tuple(out)


def floats(flag: str, values: Iterable[str]) -> tuple[float, ...]:
  """The numbers of a list flag (`items`): "1e-3,3e-3"."""
  return items(flag, values, float, "a number (e.g. 1e-3,3e-3)")


def ints(flag: str, values: Iterable[str], minimum: int | None = None) -> tuple[int, ...]:
  """The ints of a list flag (`items`), each ≥ minimum when given."""
  def parse(text):
    value = int(text)
    if minimum is not None and value < minimum:
      raise ValueError(text)
    return value
  return items(flag, values, parse, "an int" + (f" ≥ {minimum}" if minimum is not None else ""))


def choices(flag: str, values: Iterable[str], allowed: Sequence[str]) -> tuple[str, ...]:
  """The values of a list flag, each one of `allowed`."""
  def parse(text):
    if text not in allowed:
      raise ValueError(text)
    return text
  return items(flag, values, parse, f"one of {', '.join(map(str, allowed))}")


def int_pair(text: str) -> tuple[int, int]:
  """"256:64" → (256, 64); ValueError for anything but two ints joined by a colon."""
  parts = text.split(":")
  if len(parts) != 2:
    raise ValueError(text)
  return int(parts[0]), int(parts[1])
