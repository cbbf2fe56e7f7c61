"""User code on the command line: `--imports=module[,module]` imports Python modules before a program reads its
config or its variant names, so that a point a module registers (`dgps.register(...)`) trains and is measured by
name like a built-in one:

    # my_points.py, in the directory the command runs in (or anywhere on PYTHONPATH)
    from osdn_jax import dgps
    dgps.register(dgps.compose(decay="scalar", precond="pdn", name="my-pgdn"))

    python -m osdn_jax.train --imports=my_points --config=tiny --config.model=my-pgdn-tiny --workdir=runs/mine
    python -m experiments.mqar --imports=my_points --config.variants=gdn,my-pgdn

The trainer (`python -m osdn_jax.train`, `osdn_jax.train.aot`) and every experiment that takes variant or point
names define the flag through `define_imports_flag`. It lives at the package's top rather than in
`osdn_jax.train`, so that a program without the trainer (`experiments.tour`) takes it without importing the
trainer, and both sides reach it without a cycle (osdn_jax never imports experiments); it imports only the
standard library, and absl (the `train` extra) only when the flag is defined.
"""
from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable
from types import ModuleType

FLAG = "imports"
_IMPORTED: list[str] = []   # the names import_modules imported, in order (`imported`)


def import_modules(names: Iterable[str]) -> list[ModuleType]:
  """Imports each module named (`importlib.import_module`, dotted names too) with the current directory on
  sys.path (first, as `python -m` puts it), and returns them. ImportError naming the module for one that cannot be
  imported, whatever its import raised (a missing module, an error in its code, a point it registers twice, a
  sys.exit, which would end the program having done nothing)."""
  cwd = os.getcwd()
  if not any(os.path.abspath(p or os.curdir) == cwd for p in sys.path):
    sys.path.insert(0, cwd)
  modules = []
  for name in names:
    name = name.strip()
    if not name:
      continue
    try:
      modules.append(importlib.import_module(name))
      if name not in _IMPORTED:
        _IMPORTED.append(name)
    except SystemExit as e:   # a script, not a module: importing it must not end the program that imports it
      raise ImportError(f"cannot import module {name!r}: importing it called sys.exit({e.code!r}); a module for "
                        "--imports defines and registers, and runs nothing on import (guard a script's work with "
                        "`if __name__ == \"__main__\":`)") from None
    except Exception as e:  # noqa: BLE001 -- any failure of the user's module is reported as one line
      hint = f" (a module name, e.g. {name[:-3]!r}, not a file)" if name.endswith(".py") else ""
      detail = str(e).splitlines()[0] if str(e) else ""
      raise ImportError(f"cannot import module {name!r}{hint}: {type(e).__name__}"
                        + (f": {detail}" if detail else "")) from e
  return modules


def imported() -> tuple[str, ...]:
  """The modules `import_modules` has imported in this process (what a command that reruns it passes to
  --imports)."""
  return tuple(_IMPORTED)


def define_imports_flag(flag_values=None):
  """Defines `--imports=module[,module]` on `flag_values` (absl's FLAGS by default) and returns its FlagHolder.
  The modules are imported once the command line is parsed (an absl flag validator: after every flag, before the
  program's main), so before any config or variant name is checked; one that cannot be imported stops the
  program with a one-line flags error naming the flag and the module (exit status 1). Defining it again on the
  same FlagValues returns the existing flag (programs that import each other's flag definitions)."""
  from absl import flags

  flag_values = flags.FLAGS if flag_values is None else flag_values
  if FLAG in flag_values:
    return flags.FlagHolder(flag_values, flag_values[FLAG])
  holder = flags.DEFINE_list(FLAG, [], "Python modules to import first (comma-separated; the current directory "
                             "is on the path), e.g. ones that register DGPS points (`dgps.register`) to name "
                             "in the config or the variants", flag_values=flag_values)

  def _import(names) -> bool:
    try:
      import_modules(names or ())
    except ImportError as e:
      raise flags.ValidationError(str(e)) from None   # absl prefixes "flag --imports=[...]: "
    return True

  flags.register_validator(FLAG, _import, flag_values=flag_values)
  return holder
