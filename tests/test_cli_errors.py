"""A user's mistake on a command line is one line on stderr naming the argument or file and what would be accepted,
with exit status 2 (a usage error) or 1 (any other), and no traceback (`osdn_jax.cli`); settings that would do
nothing useful are refused before any work.

The commands run in subprocesses, a few at a time (each costs the import of JAX); the pieces they rely on are
checked in this process."""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from osdn_jax import cli, plugins
from osdn_jax.data import prepare, tokens
from osdn_jax.train import configs

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN = ["--config=tiny", "--config.data.source=random", "--config.seq_len=16", "--config.batch_size=2",
         "--config.steps=2", "--config.log_every=1", "--config.checkpoint_every=0", "--config.eval_every=0",
         "--config.diagnostics_every=0", "--config.progress=false", "--config.async_checkpoint=false",
         "--config.optimizer.warmup_steps=0"]


def _commands(cases: dict, cwd, parallel: int = 4) -> dict:
  """{name: (exit status, stdout, stderr)} of `python -m MODULE ARGS...` for each case (module, args), run
  `parallel` at a time."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", OSDN_PROGRESS="0", PYTHONPATH=str(ROOT))
  env.pop(cli.DEBUG_ENV, None)
  pending, running, done = list(cases.items()), {}, {}
  while pending or running:
    while pending and len(running) < parallel:
      name, (module, args) = pending.pop(0)
      running[name] = subprocess.Popen([sys.executable, "-m", module, *args], cwd=cwd, env=env, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for name, proc in list(running.items()):
      if proc.poll() is not None:
        out, err = proc.communicate()
        done[name] = (proc.returncode, out, err)
        del running[name]
    time.sleep(0.05)
  return done


def _one_line(result, status: int, *words: str, alone: bool = True) -> str:
  """The error's line, the last of stderr (alone: the only one), after checking the status, that there is no
  traceback and that the line holds `words`."""
  code, _, err = result
  lines = [line for line in err.splitlines() if line.strip()]
  assert code == status and lines and "Traceback" not in err, (code, err[-3000:])
  assert len(lines) == 1 or not alone, err[-3000:]
  assert all(w in lines[-1] for w in words), lines[-1]
  return lines[-1]


@pytest.fixture
def absl_flags():
  """absl's FLAGS for a program's flags defined in this process, as in a process of its own: the flags other
  modules of this process defined are set apart during the test (a program may define a flag of the same name),
  those defined inside are removed afterwards, and the others, the parse state and absl's log level come back."""
  import logging

  from absl import flags
  level, parsed = logging.getLogger("absl").level, flags.FLAGS.is_parsed()
  others = {name: flags.FLAGS[name] for name in list(flags.FLAGS)
            if not flags.FLAGS.find_module_defining_flag(name, "").startswith("absl")}
  modules = {name: flags.FLAGS.find_module_defining_flag(name) for name in others}
  for name in others:
    delattr(flags.FLAGS, name)
  before = set(flags.FLAGS)
  yield flags.FLAGS
  for name in set(flags.FLAGS) - before:
    delattr(flags.FLAGS, name)
  for name, flag in others.items():
    flags.FLAGS[name] = flag
    flags.FLAGS.register_flag_by_module(modules[name], flag)
  if not parsed:
    flags.FLAGS.unparse_flags()
  logging.getLogger("absl").setLevel(level)


# -- the experiments and prepare --------------------------------------------------------------------------------
@pytest.mark.slow
def test_experiment_flags_that_cannot_work_are_one_line_before_any_work(tmp_path):
  """--kv that fits no length (recall), --pairs that does not parse (grid) and a needle depth outside [0, 1]
  (passkey) are usage errors (exit status 2) naming the flag, before anything is trained or written."""
  out = str(tmp_path / "out")
  results = _commands({
      "recall": ("experiments.recall", ["--kv=100", f"--out={out}"]),
      "pairs": ("experiments.grid", ["--pairs=abc", f"--out={out}"]),
      "depths": ("experiments.passkey", ["--depths=1.5", "--steps=1", f"--out={out}"]),
  }, ROOT)
  _one_line(results["recall"], 2, "error: ", "`kv` 100", "lengths")
  _one_line(results["pairs"], 2, "--config.pairs=abc", "'abc'", "256:64")
  _one_line(results["depths"], 2, "`depths`", "[0, 1]", "1.5")
  assert not pathlib.Path(out).exists()


@pytest.mark.parametrize("program,args,match", [
    ("mqar", ["--kv=100", "--lengths=32"], r"`kv` 100 fits none of `lengths` \(32,\)"),
    ("mqar", ["--lrs=1e-3,fast"], r"--config.lrs=1e-3,fast: 'fast' is not a number"),
    ("mqar", ["--config.lrs=1e-3,fast"], r"--config.lrs=1e-3,fast: 'fast' is not a number"),
    ("grid", ["--lrs=abc"], r"--config.lrs=abc: 'abc' is not a number"),
    ("grid", ["--cut=z"], r"`cut` 'z' is not one of a, b, c"),
    ("grid", ["--seeds=0,x"], r"--config.seeds=0,x: 'x' is not an int"),
    ("grid", ["--seeds=-1"], r"`seeds` -1 is not an int ≥ 0"),
    ("grid", ["--stpes=3"], r"--stpes is not a flag of this program.*did you mean --config.steps"),
    ("grid", ["--config.stpes=3"], r"--config.stpes: Grid has no field 'stpes'; did you mean --config.steps"),
])
def test_experiment_mains_check_their_flags_first(absl_flags, capsys, tmp_path, program, args, match):
  """The flags as their programs parse them (in this process): a value a field cannot take, a field that does not
  exist or a flag that names none is one line naming it and its --config.* form (exit status 2); a setting the
  experiment refuses is a `cli.UsageError` from its main. Either comes before any work: nothing is written."""
  from experiments import config, grid, mqar
  module = {"mqar": mqar, "grid": grid}[program]
  grid.define_flags() if program == "grid" else mqar.define_flags(mqar.Sweep())
  try:
    config.parse_flags([program, *args, f"--out={tmp_path / 'out'}"])
  except SystemExit as e:
    assert e.code == cli.USAGE
    message = capsys.readouterr().err
    assert message.startswith("error: ") and message.count("\n") == 1, message
  else:
    with pytest.raises(cli.UsageError) as e:
      module.main([program])
    message = str(e.value)
  assert re.search(match, message), message
  assert not (tmp_path / "out").exists()


def test_old_flag_spellings_are_the_config_fields_they_name(absl_flags):
  """A field's short spelling (--FIELD=VALUE, --FIELD VALUE, a section's --SECTION_FIELD) is its --config.* override;
  a flag a nested config holds under several sections is refused with each of their --config.* forms."""
  from experiments import clip, config, grid
  grid.define_flags()
  config.parse_flags(["grid", "--pairs=1024:32,1024:64", "--variants=pdn", "--lrs", "1e-3", "--config.seeds=2",
                      "--steps=10", "--order=epoch", "--reads=2", "--budget_s=5", "--max_cells=3",
                      "--train_examples=100", "--cut=a", "--report"])
  spec = config.settings(grid.Grid)
  assert (spec.pairs, spec.variants, spec.lrs, spec.seeds) == (((1024, 32), (1024, 64)), ("pdn",), (1e-3,), (2,))
  assert (spec.steps, spec.order, spec.reads, spec.budget_s, spec.max_cells) == (10, "epoch", 2, 5.0, 3)
  assert (spec.train_examples, spec.cut, absl_flags.report) == (100, ("a",), True)
  assert spec.protocol == grid.Protocol(steps=10, order="epoch", reads=2, train_examples=100)
  short = config.short_names(config.to_config(clip.Clip()))
  assert short["text_steps"] == "text.steps" and short["mqar_rows"] == "mqar_rows" and "steps" not in short
  with pytest.raises(cli.UsageError, match=r"--steps is not a flag.*--config.mqar.steps or --config.text.steps"):
    config.translate(["clip", "--steps=3"], config.to_config(clip.Clip()))


@pytest.mark.slow
def test_prepare_errors_are_one_line_and_leave_no_output(tmp_path):
  """A tokenizer.json that is not JSON is named (exit status 1); a bad --validation is a usage error (2); --debug
  shows the traceback; no --out is left behind."""
  (tmp_path / "corpus.txt").write_text("a document\n")
  (tmp_path / "garbage.json").write_text("{not json")
  base = [f"--input={tmp_path / 'corpus.txt'}", "--noprogress"]
  results = _commands({
      "json": ("osdn_jax.data.prepare", base + [f"--tokenizer={tmp_path / 'garbage.json'}", "--out=a"]),
      "validation": ("osdn_jax.data.prepare", base + ["--tokenizer=bytes", "--validation=2", "--out=b"]),
      "debug": ("osdn_jax.data.prepare", base + [f"--tokenizer={tmp_path / 'garbage.json'}", "--out=c",
                                                 "--debug"]),
  }, tmp_path)
  _one_line(results["json"], 1, str(tmp_path / "garbage.json"), "not a tokenizer.json")
  _one_line(results["validation"], 2, "--validation", "[0, 1)", "2.0")
  code, _, err = results["debug"]
  assert code == 1 and "Traceback" in err and "garbage.json" in err
  assert not any((tmp_path / name).exists() for name in "abc")


def test_prepare_names_a_tokenizer_that_is_not_utf8_and_refuses_arguments_as_usage(tmp_path):
  (tmp_path / "corpus.txt").write_text("a document\n")
  latin1 = tmp_path / "latin1.json"
  latin1.write_bytes('{"caf\u00e9": 1}'.encode("latin-1"))
  run = lambda tokenizer, inputs=(str(tmp_path / "corpus.txt"),), **kw: prepare.prepare(
      list(inputs), tokenizer, tmp_path / "out", progress=False, verbose=False, **kw)
  with pytest.raises(ValueError, match=rf"^tokens: {latin1} is not a tokenizer.json .*UTF-8"):
    run(str(latin1))
  for kw, match in (({"inputs": ["nothing*.txt"]}, "matches no file"), ({"validation": 1.0}, "--validation"),
                    ({"eos_token": "<eos>"}, "--eos_token does not apply"), ({"dtype": "int8"}, "--dtype")):
    with pytest.raises(cli.UsageError, match=match):
      run("bytes", **kw)
  assert not (tmp_path / "out").exists()


# -- the trainer --------------------------------------------------------------------------------------------------
@pytest.mark.slow     # `make test`: the other programs' one-line errors and the trainer's config checks in process
def test_trainer_errors_are_one_line(tmp_path):
  """A work directory another trainer holds (`WorkdirLockedError`), a token id outside the vocabulary
  (`TokenIdError`), a non-finite state (`NonFiniteError`, a learning rate of 1e39) and an --imports module that
  calls sys.exit(0) end the trainer with one line and exit status 1, having trained nothing."""
  from osdn_jax.train import loop
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("the delta rule and its state " * 40)
  small = tmp_path / "small-vocab"
  prepare.prepare([str(corpus)], "bytes", small, validation=0.0, workers=1, progress=False, verbose=False)
  meta = json.loads((small / "metadata.json").read_text())
  (small / "metadata.json").write_text(json.dumps(dict(meta, vocab_size=64)))       # the ids reach 116
  (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
  locked = tmp_path / "locked"
  locked.mkdir()
  tokens_config = ["--config.data.source=tokens"]
  with loop.WorkdirLock(locked):
    results = _commands({
        "locked": ("osdn_jax.train", TRAIN + [f"--workdir={locked}"]),
        "ids": ("osdn_jax.train", TRAIN + tokens_config + [f"--config.data.path={small}", "--workdir=ids"]),
        "nonfinite": ("osdn_jax.train", TRAIN + ["--config.optimizer.lr=1e39", "--config.checkpoint_every=1",
                                                 "--workdir=nonfinite"]),
        "exits": ("osdn_jax.train", ["--imports=exits"] + TRAIN + ["--workdir=exits"]),
    }, tmp_path)
  # The trainer reports its settings on stderr before it starts; the error is the last line.
  _one_line(results["locked"], 1, "train: ", str(locked), "in use", alone=False)
  _one_line(results["ids"], 1, "train: ", "outside the vocabulary [0, 64)", alone=False)
  _one_line(results["nonfinite"], 1, "train: ", "step 1", "non-finite", alone=False)
  _one_line(results["exits"], 1, "train: ", "--imports", "'exits'", "sys.exit(0)")
  assert not (tmp_path / "exits").exists()



def test_the_other_programs_end_a_users_mistake_with_one_line(tmp_path):
  """`experiments.plot_run` without a run directory, `osdn_jax.train.launch` without the trainer's arguments and
  `osdn_jax.eval` given an argument that is not a flag: one line, `error: <message>`, exit status 2 (`cli.run`)."""
  results = _commands({
      "plot_run": ("experiments.plot_run", []),
      "launch": ("osdn_jax.train.launch", ["--processes=2"]),
      "eval": ("osdn_jax.eval", [f"--workdir={tmp_path}", "extra"]),
  }, tmp_path, parallel=3)
  _one_line(results["plot_run"], 2, "error: ", "give one or more run directories")
  _one_line(results["launch"], 2, "error: ", "usage: python -m osdn_jax.train.launch")
  _one_line(results["eval"], 2, "error: ", "unexpected arguments ['extra']")

# -- the pieces, in this process ------------------------------------------------------------------------------------
def test_list_flags_name_the_flag_the_value_and_what_it_takes():
  assert cli.floats("lrs", ["1e-3", " 3e-3"]) == (1e-3, 3e-3)
  assert cli.items("pairs", ["256:64"], cli.int_pair, "L:kv") == ((256, 64),)
  with pytest.raises(cli.UsageError, match=r"^--lrs=1e-3,abc: 'abc' is not a number"):
    cli.floats("lrs", ["1e-3", "abc"])
  with pytest.raises(cli.UsageError, match=r"^--pairs=256:64:1: '256:64:1' is not L:kv"):
    cli.items("pairs", ["256:64:1"], cli.int_pair, "L:kv")
  with pytest.raises(cli.UsageError, match=r"^--seeds=-1: '-1' is not an int ≥ 0"):
    cli.ints("seeds", ["-1"], minimum=0)
  with pytest.raises(cli.UsageError, match=r"^--cut=z: 'z' is not one of a, b"):
    cli.choices("cut", ["z"], ("a", "b"))
  with pytest.raises(cli.UsageError, match="`kv` 100 fits none"), cli.usage():
    from experiments import mqar
    mqar.Sweep(lengths=(32,), kv=(100,))


def test_an_imported_module_that_exits_is_an_import_error(tmp_path, monkeypatch):
  (tmp_path / "quits.py").write_text("import sys\nsys.exit(0)\n")
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", list(sys.path))
  with pytest.raises(ImportError, match=r"cannot import module 'quits': importing it called sys.exit\(0\)"):
    plugins.import_modules(["quits"])
  sys.modules.pop("quits", None)


@pytest.mark.parametrize("field,value,match", [
    ("clip", 0.0, r"`optimizer.clip` must be > 0 .*nothing trains"),
    ("min_lr_ratio", 1.5, r"`optimizer.min_lr_ratio` must lie in \[0, 1\]"),
])
def test_optimizer_settings_that_do_nothing_useful_are_refused(field, value, match):
  """Clipping to global norm 0 scales every update to 0 (optax's clip_by_global_norm), and a cosine floor above
  the peak turns the schedule upside down: both are refused; min_lr_ratio = 1 (a constant rate) is accepted."""
  c = configs.get_config("tiny")
  c.optimizer[field] = value
  with pytest.raises(ValueError, match=match):
    configs.validate(c)
  c.optimizer.clip, c.optimizer.min_lr_ratio = 1e-3, 1.0
  configs.validate(c)


def test_passkey_settings_are_checked_when_made():
  from experiments import passkey
  with pytest.raises(ValueError, match=r"passkey: `depths` must be numbers in \[0, 1\].*got 1.5"):
    passkey.Passkey(depths=(0.0, 1.5))
  with pytest.raises(ValueError, match=r"passkey: `lengths` 50: PasskeySource: `length` \(50\) must be ≥"):
    passkey.Passkey(lengths=(512, 50))
  with pytest.raises(ValueError, match="unknown point"):
    passkey.Passkey(variants=("dn", "nope"))


@pytest.mark.parametrize("content,match", [
    (b"{not json", r"is not JSON \(Expecting property name"),
    (b"\xff\xfe{}", r"is not UTF-8 text"),
    (b"[1, 2]", r"holds a JSON list, not the object prepare writes"),
    (json.dumps({"format": tokens.FORMAT, "version": tokens.VERSION}).encode(), r"lacks tokenizer, vocab_size"),
], ids=["json", "utf8", "list", "fields"])
def test_a_metadata_json_that_is_not_prepares_is_named(tmp_path, content, match):
  (tmp_path / "metadata.json").write_bytes(content)
  with pytest.raises(ValueError, match=rf"^tokens: {tmp_path / 'metadata.json'} " + match):
    tokens.read_metadata(tmp_path)


def test_a_tokenizer_json_that_is_not_json_is_named(tmp_path):
  pytest.importorskip("tokenizers")
  path = tmp_path / "tokenizer.json"
  path.write_text("{not json")
  with pytest.raises(ValueError, match=rf"^tokens: {path} is not a tokenizer.json the `tokenizers` library reads"):
    tokens.HFTokenizer(path, None)


def test_debug_keeps_the_traceback(monkeypatch, capsys):
  """Outside --debug a user's error is one line and exit status 1; with OSDN_DEBUG=1 it raises as it was."""
  def fails():
    with cli.handled():
      raise FileNotFoundError("no such thing: x.json")
  monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
  with pytest.raises(SystemExit) as exit_:
    fails()
  assert exit_.value.code == 1 and capsys.readouterr().err == "error: no such thing: x.json\n"
  monkeypatch.setenv(cli.DEBUG_ENV, "1")
  with pytest.raises(FileNotFoundError):
    fails()
  with pytest.raises(KeyError), cli.handled():       # a bug keeps its traceback
    raise KeyError("x")
