"""The experiments' settings (`experiments.config`): a dataclass and its config round-trip, sequences read from and
written to the command line, a field's short spelling is its --config.* override, and a flag or field that does not
exist is refused with the nearest --config.* forms."""
from __future__ import annotations

import dataclasses

import pytest

from experiments import config
from osdn_jax import cli


@dataclasses.dataclass(frozen=True)
class Section:
  steps: int = 10
  lrs: tuple[float, ...] = (1e-3,)


@dataclasses.dataclass(frozen=True)
class Settings:
  names: tuple[str, ...] = ("dn", "pdn")
  seeds: tuple[int, ...] = (0, 1)
  pairs: tuple[tuple[int, int], ...] = ()
  rate: float = 0.5
  order: str = "epoch"
  quick: bool = False
  text: Section = Section()


def test_a_dataclass_and_its_config_round_trip():
  spec = Settings(names=("gdn",), pairs=((256, 64),), text=Section(steps=3, lrs=(1e-2, 3e-2)))
  c = config.to_config(spec)
  assert isinstance(c.names, config.Names) and isinstance(c.pairs, config.Pairs) and c.text.steps == 3
  back = config.from_config(Settings, c)
  assert back == spec and type(back.names) is tuple and type(back.text.lrs) is tuple


def test_sequences_are_comma_separated_and_each_item_is_checked():
  assert config.Floats.parse("1e-3,3e-3") == (1e-3, 3e-3)
  assert config.Pairs.parse("1024:32, 1024:64") == ((1024, 32), (1024, 64))
  assert config.Names.parse("osdn-apf:apf_anchor=init,dn") == ("osdn-apf:apf_anchor=init", "dn")
  assert config.Ints.parse("") == ()
  assert config.Pairs.format(((1024, 32), (1024, 64))) == "1024:32,1024:64"
  with pytest.raises(ValueError, match=r"'x' is not an int"):
    config.Ints.parse("0,x")
  with pytest.raises(ValueError, match=r"'abc' is not L:kv"):
    config.Pairs.parse("abc")


def test_overrides_are_the_fields_that_differ_in_field_order():
  spec = Settings(rate=0.25, names=("gdn",), text=Section(lrs=(1e-2, 3e-2)))
  assert config.overrides(spec) == ["--config.names=gdn", "--config.rate=0.25", "--config.text.lrs=0.01,0.03"]
  assert config.overrides(Settings()) == []


def test_short_spellings_translate_to_config_overrides():
  c = config.to_config(Settings())
  assert config.short_names(c)["text_steps"] == "text.steps"
  argv = config.translate(["prog", "--names=gdn,pdn", "--seeds", "3", "--text_steps=5", "--config.rate=0.1",
                           "positional"], c)
  assert argv == ["prog", "--config.names=gdn,pdn", "--config.seeds=3", "--config.text.steps=5", "--config.rate=0.1",
                  "positional"]
  assert config.translate(["prog", "--quick"], c) == ["prog", "--config.quick=true"]
  assert config.translate(["prog", "--noquick", "--", "--names"], c) == ["prog", "--config.quick=false", "--",
                                                                         "--names"]


@pytest.mark.parametrize("argv,match", [
    (["--nmaes=dn"], r"--nmaes is not a flag of this program.*did you mean --config.names\?"),
    (["--steps=3"], r"--steps is not a flag.*--config.text.steps"),
    (["--config.rat=1"], r"--config.rat: Settings has no field 'rat'; did you mean --config.rate"),
    (["--seeds"], r"--seeds needs a value: --config.seeds=VALUE"),
])
def test_a_flag_that_names_no_field_is_refused_with_the_nearest_fields(argv, match):
  config.define(Settings())
  with pytest.raises(cli.UsageError, match=match):
    config.translate(["prog", *argv], config.to_config(Settings()))
