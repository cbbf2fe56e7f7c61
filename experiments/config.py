"""The experiments' settings: each experiment declares them once, as a dataclass whose fields have defaults (a
field that is itself a dataclass is a section), and its command line takes them as one ml_collections config flag,
as the trainer takes its config:

    python -m experiments.mqar --config.variants=dn,pdn --config.lengths=1024 --config.lrs=1e-3,3e-3
    python -m experiments.clip --config.mqar.steps=500 --config.text.steps=200

A sequence field takes comma-separated values (variants, ints, floats, `L:kv` pairs); every value is checked when
the flags are parsed, and a field that does not exist is refused with the closest names. A field's short spelling,
`--FIELD=VALUE` (a section's field: `--SECTION_FIELD=VALUE`, e.g. `--text_steps=200`), is the same override; a flag
that is neither a field nor one of the program's own flags (`--out`, `--smoke`, ...) is refused with the
`--config.*` forms of the closest fields. These are one-line usage errors (exit status 2, `osdn_jax.cli`).

    from experiments import config
    def main(argv):
      sweep = config.settings(Sweep)        # the dataclass, checked (its __post_init__) as a usage error
    if __name__ == "__main__":
      config.run(main, Sweep())             # --config.* from Sweep's fields, then absl's app.run
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import sys
import typing

import ml_collections
from absl import flags
from ml_collections import config_flags

from osdn_jax import cli

NAME = "config"


# -- sequence values --------------------------------------------------------------------------------------------
class Sequence(tuple):
  """A sequence field's value in the config: a tuple whose type says how the command line writes it (items joined
  by commas; `parse_item` reads one)."""
  expected = "a value"

  @classmethod
  def parse_item(cls, text: str):
    return text

  @classmethod
  def parse(cls, text: str) -> Sequence:
    """ValueError naming the item and what would be accepted for an item `parse_item` refuses."""
    out = []
    for item in (text.split(",") if text.strip() else []):
      try:
        out.append(cls.parse_item(item.strip()))
      except (ValueError, TypeError):
        raise ValueError(f"{item.strip()!r} is not {cls.expected}") from None
    return cls(out)

  @classmethod
  def format_item(cls, item) -> str:
    return str(item)

  @classmethod
  def format(cls, value) -> str:
    return ",".join(cls.format_item(x) for x in value)


class Names(Sequence):
  expected = "a name"

  @classmethod
  def parse_item(cls, text):
    if not text:
      raise ValueError(text)
    return text


class Ints(Sequence):
  expected = "an int (e.g. 0,1)"
  parse_item = staticmethod(int)


class Floats(Sequence):
  expected = "a number (e.g. 1e-3,3e-3)"
  parse_item = staticmethod(float)


class Pairs(Sequence):
  expected = "L:kv, two ints such as 256:64"
  parse_item = staticmethod(cli.int_pair)

  @classmethod
  def format_item(cls, item):
    return ":".join(map(str, item))


# The sequence types of a dataclass field's annotation.
SEQUENCES = {tuple[str, ...]: Names, tuple[int, ...]: Ints, tuple[float, ...]: Floats,
             tuple[tuple[int, int], ...]: Pairs}


class _SequenceParser(flags.ArgumentParser):
  def __init__(self, kind: type[Sequence]):
    self.kind = kind

  def parse(self, argument):
    return argument if isinstance(argument, self.kind) else self.kind.parse(str(argument))

  def flag_type(self):
    return f"comma-separated {self.kind.__name__.lower()}"


for _kind in SEQUENCES.values():
  config_flags.register_flag_parser_for_type(_kind, _SequenceParser(_kind))


# -- dataclass ↔ config ---------------------------------------------------------------------------------------------
@functools.cache
def _hints(cls) -> dict:
  return typing.get_type_hints(cls)


def _fields(cls):
  """(name, annotation) of each init field of dataclass `cls`."""
  hints = _hints(cls)
  return [(f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.init]


def to_config(spec) -> ml_collections.ConfigDict:
  """The config of dataclass instance `spec`: one entry per field, a section (a ConfigDict) per dataclass field,
  sequences as their `Sequence` type."""
  config = ml_collections.ConfigDict()
  for name, hint in _fields(type(spec)):
    value = getattr(spec, name)
    if dataclasses.is_dataclass(hint):
      config[name] = to_config(value)
    elif hint in SEQUENCES:
      config[name] = SEQUENCES[hint](value)
    elif typing.get_origin(hint) is tuple:
      raise TypeError(f"{type(spec).__name__}.{name}: a sequence field is one of {list(SEQUENCES)}, got {hint}")
    else:
      config[name] = value
  return config


def from_config(cls, config):
  """The `cls` instance of a config (`to_config`'s form; a config holding more fields than `cls` gives those of
  `cls`): sequences as plain tuples, sections as their dataclasses. Raises what `cls` raises for values it
  refuses."""
  values = {}
  for name, hint in _fields(cls):
    value = config[name]
    if dataclasses.is_dataclass(hint):
      value = from_config(hint, value)
    elif isinstance(value, tuple):
      value = tuple(value)
    values[name] = value
  return cls(**values)


def leaves(config, prefix: str = "") -> dict[str, object]:
  """{dotted path: value} of every field of a config, sections' fields included."""
  out = {}
  for name, value in config.items():
    path = prefix + name
    if isinstance(value, ml_collections.ConfigDict):
      out.update(leaves(value, path + "."))
    else:
      out[path] = value
  return out


def short_names(config) -> dict[str, str]:
  """{short spelling: dotted path}: a field's name, a section's field as SECTION_FIELD (a spelling two fields would
  share names neither)."""
  spelled = [(path.replace(".", "_"), path) for path in leaves(config)]
  counts = {}
  for short, _ in spelled:
    counts[short] = counts.get(short, 0) + 1
  return {short: path for short, path in spelled if counts[short] == 1}


def _spec_leaves(spec, prefix: str = "") -> dict[str, object]:
  """{dotted path: value} of a dataclass instance in its fields' order (`to_config`'s values, sections' fields
  included)."""
  out = {}
  for name, hint in _fields(type(spec)):
    value = getattr(spec, name)
    if dataclasses.is_dataclass(hint):
      out.update(_spec_leaves(value, f"{prefix}{name}."))
    else:
      out[prefix + name] = SEQUENCES[hint](value) if hint in SEQUENCES else value
  return out


def overrides(spec) -> list[str]:
  """The --config.PATH=VALUE overrides that make the defaults of `type(spec)` into `spec`, in field order."""
  now, default = _spec_leaves(spec), _spec_leaves(type(spec)())
  return [f"--{NAME}.{path}={_text(value)}" for path, value in now.items() if value != default[path]]


def _text(value) -> str:
  return type(value).format(value) if isinstance(value, Sequence) else str(value)


# -- the command line -----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Declared:
  defaults: object                      # the settings' defaults, a dataclass instance
  config: ml_collections.ConfigDict     # their config (`to_config`)

  @property
  def kind(self) -> type:
    return type(self.defaults)


_declared: list[_Declared] = []         # the program's settings (`define`): one


def define(defaults) -> None:
  """Declares the program's settings: the fields of dataclass instance `defaults`, each overridable as
  --config.FIELD (the flag itself is defined when the command line is parsed, `parse_flags`)."""
  _declared[:] = [_Declared(defaults, to_config(defaults))]


def _the_declared() -> _Declared:
  if not _declared:
    raise RuntimeError("experiments.config: the program's settings are not declared (`define`)")
  return _declared[0]


def _split(arg: str) -> tuple[str, str | None]:
  """("name", "value" or None) of a "--name=value" / "-name" argument."""
  body = arg.lstrip("-")
  name, eq, value = body.partition("=")
  return name, (value if eq else None)


# The names absl reads whatever the program defines.
_ABSL = ("help", "helpfull", "helpshort", "helpxml", "h", "?", "flagfile", "undefok")


def _is_flag(name: str) -> bool:
  return name in flags.FLAGS or (name.startswith("no") and name[2:] in flags.FLAGS)


def translate(argv: list[str], config) -> list[str]:
  """argv with every field's short spelling (`short_names`) as its --config.PATH form; `cli.UsageError` naming the
  closest --config.* forms for a flag that is neither a field nor one of the program's flags, and for a --config.*
  override of a field that does not exist."""
  paths, short = leaves(config), short_names(config)
  out, i = list(argv[:1]), 1
  while i < len(argv):
    arg = argv[i]
    i += 1
    if arg == "--":
      out += argv[i - 1:]
      break
    if not arg.startswith("-") or arg == "-":
      out.append(arg)
      continue
    name, value = _split(arg)
    if name.startswith(NAME + "."):
      if name[len(NAME) + 1:] not in paths:
        raise cli.UsageError(f"--{name}: {_the_declared().kind.__name__} has no field {name[len(NAME) + 1:]!r}"
                             + _closest(name[len(NAME) + 1:], paths, short))
      out.append(arg)
      continue
    if _is_flag(name) or name in _ABSL:
      out.append(arg)
      continue
    if name not in short and name.startswith("no") and isinstance(paths.get(short.get(name[2:])), bool):
      name, value = name[2:], "false"   # --noFIELD of a bool field
    if name not in short:
      raise cli.UsageError(f"--{name} is not a flag of this program; its settings are --{NAME}.FIELD=VALUE"
                           + _closest(name, paths, short))
    if value is None and isinstance(paths[short[name]], bool):
      value = "true"                      # --FIELD of a bool field
    if value is None:                     # --FIELD VALUE
      if i >= len(argv):
        raise cli.UsageError(f"--{name} needs a value: --{NAME}.{short[name]}=VALUE")
      value, i = argv[i], i + 1
    out.append(f"--{NAME}.{short[name]}={value}")
  return out


def _closest(name: str, paths, short) -> str:
  """"; did you mean --config.A or --config.B?" for the fields nearest `name` (by path, last name or short
  spelling), or the list of every field when none is near."""
  candidates = {p: p for p in paths} | {p.rsplit(".", 1)[-1]: p for p in paths} | dict(short)
  near = [p for p in paths if p.rsplit(".", 1)[-1] == name]
  near += [candidates[c] for c in difflib.get_close_matches(name, list(candidates), n=4, cutoff=0.6)]
  near = list(dict.fromkeys(near))
  if near:
    return "; did you mean " + " or ".join(f"--{NAME}.{p}" for p in near) + "?"
  return "; the fields are " + ", ".join(paths)


def parse_flags(argv: list[str]) -> list[str]:
  """The flags parser of an experiment (`run`): the short spellings translated (`translate`), the config flag
  defined for the overrides argv holds, then absl's parse (`cli.parse_flags`: one line for a value it refuses)."""
  config = _the_declared().config
  with cli.handled(status=cli.USAGE):
    argv = translate(list(argv), config)
  for name in [n for n in flags.FLAGS if n == NAME or n.startswith(NAME + ".")]:   # a program parsed again
    delattr(flags.FLAGS, name)
  fields = ", ".join(f"{path}={_text(value)}" for path, value in _spec_leaves(_the_declared().defaults).items())
  config_flags.DEFINE_config_dict(NAME, config.copy_and_resolve_references(), f"the settings "
                                  f"({_the_declared().kind.__name__}), each --{NAME}.FIELD=VALUE (--FIELD=VALUE is "
                                  f"the same); the fields and their defaults: {fields}", sys_argv=argv,
                                  lock_config=True)
  flags.FLAGS[NAME].default_as_str = None      # the help lists the fields' defaults (not the config as YAML)
  flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[NAME])   # --help lists it with the program's
  return cli.parse_flags(argv)


def run(main, defaults, argv: list[str] | None = None) -> None:
  """`cli.run(main)` with `defaults`'s fields as the --config.* flags (`define`, `parse_flags`)."""
  define(defaults)
  cli.run(main, argv, flags_parser=parse_flags)


def current():
  """The parsed config (absl's FLAGS.config)."""
  return flags.FLAGS[NAME].value


def settings(cls=None):
  """The parsed settings as dataclass `cls` (default the declared one), a `cli.UsageError` for a value it refuses."""
  with cli.usage():
    return from_config(cls or _the_declared().kind, current())
