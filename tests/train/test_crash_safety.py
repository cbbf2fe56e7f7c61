"""A work directory survives every crash and every damaged file: a checkpoint that fails verification or holds a
non-finite state is moved aside (kept, renamed) and its step saved again, a checkpoint without checksums is called
unverified, metrics.jsonl is replaced whole, the resume guard reads config_history.jsonl when config.json is gone,
and a trainer killed with SIGKILL at random times always resumes without losing or changing a step."""
import builtins
import io
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osdn_jax.testing import override
from osdn_jax.train import checkpoints, configs, loop
from osdn_jax.train.metrics import Writer
from tests.train.test_integrity import _files, _metrics, _params

REPO = pathlib.Path(__file__).resolve().parents[2]


def _tiny(**changes):
  """The tiny config made small (random tokens, 2 × 16 tokens, 6 steps, checkpoints every 2 steps, the newest 2
  kept: 4 and 6 at the end), quiet, synchronous checkpoints, no evaluation; `changes` by dotted field."""
  c = configs.get_config("tiny")
  c.data.source = "random"
  c.progress = False
  c.async_checkpoint = False
  c.steps, c.checkpoint_every, c.keep_checkpoints, c.log_every = 6, 2, 2, 1
  c.diagnostics_every = c.eval_every = 0
  c.batch_size, c.seq_len, c.optimizer.warmup_steps = 2, 16, 1
  return override(c, changes)


def _steps(workdir) -> list[str]:
  return sorted((p.name for p in (pathlib.Path(workdir) / "checkpoints").iterdir() if p.name.isdigit()), key=int)


def _aside(workdir, step: int) -> list[pathlib.Path]:
  return sorted((pathlib.Path(workdir) / "checkpoints").glob(f"{step}.damaged-*"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A finished run of `_tiny()` (checkpoints 4 and 6), its checkpoint 6's parameters and its metrics."""
  workdir = tmp_path_factory.mktemp("crash_safety") / "run"
  loop.train(_tiny(), workdir)
  return workdir, _params(loop.load(workdir, step=6)[0]), _metrics(workdir)


def _copy(finished, tmp_path) -> pathlib.Path:
  shutil.copytree(finished[0], tmp_path / "run")
  return tmp_path / "run"


def _write_over(path: pathlib.Path, at: int, data: bytes) -> None:
  """`data` written over `path` from byte `at` (its size unchanged)."""
  content = bytearray(path.read_bytes())
  content[at:at + len(data)] = data
  path.write_bytes(bytes(content))


# -- a damaged checkpoint is moved aside and its step saved again --------------------------------------------
def test_a_checkpoint_that_fails_verification_is_moved_aside_and_saved_again(finished, tmp_path, caplog):
  """64 random bytes at offset 100 of checkpoint 6's state/_METADATA; the run started again resumes from 4, moves
  6 aside as 6.damaged-<time> (the damaged bytes kept, a warning naming it), saves step 6 again (what the summary
  names, `load` reads: the uninterrupted run's parameters) and logs every step once. Extended to 8 steps, the
  two newest checkpoints (6 and 8) are kept, both verified: the one moved aside holds no slot."""
  workdir = _copy(finished, tmp_path)
  _write_over(workdir / "checkpoints" / "6" / "state" / "_METADATA", 100, np.random.default_rng(0).bytes(64))
  damaged = (workdir / "checkpoints" / "6" / "state" / "_METADATA").read_bytes()
  with caplog.at_level("INFO"):
    result = loop.run(_tiny(), workdir)
  [aside] = _aside(workdir, 6)
  assert (aside / "state" / "_METADATA").read_bytes() == damaged
  assert "resumed from checkpoint 4" in caplog.text
  assert any("checkpoints/6 cannot be restored (fails verification" in r.getMessage()
             and f"moved aside to {aside}" in r.getMessage() for r in caplog.records), caplog.text
  assert result.summary["checkpoint"] == str(workdir / "checkpoints" / "6")
  assert checkpoints.verify(workdir / "checkpoints" / "6") is None
  model, _, step = loop.load_checkpoint(workdir)
  assert step == 6
  for got, want in zip(_params(model), finished[1]):
    np.testing.assert_array_equal(got, want)
  rows = _metrics(workdir)
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
  np.testing.assert_array_equal([r["loss"] for r in rows], [r["loss"] for r in finished[2]])

  result = loop.run(_tiny(steps=8), workdir)
  assert _steps(workdir) == ["6", "8"] and _aside(workdir, 6) == [aside]
  assert all(checkpoints.verify(workdir / "checkpoints" / s) is None for s in _steps(workdir))
  assert result.summary["checkpoint"] == str(workdir / "checkpoints" / "8")
  assert loop.load_checkpoint(workdir)[2] == 8


def test_an_unreadable_checkpoint_newer_than_the_restored_one_is_moved_aside(finished, tmp_path, caplog):
  """Checkpoint 6 without checksums.json and without its state's manifest (unverified, then unreadable): the
  run started again warns, resumes from 4, moves 6 aside and saves step 6 again."""
  workdir = _copy(finished, tmp_path)
  step_dir = workdir / "checkpoints" / "6"
  (step_dir / checkpoints.CHECKSUMS).unlink()
  (step_dir / "state" / "manifest.ocdbt").unlink()
  with caplog.at_level("INFO"):
    loop.train(_tiny(), workdir)
  [aside] = _aside(workdir, 6)
  assert "resumed from checkpoint 4" in caplog.text and f"moved aside to {aside}" in caplog.text
  assert checkpoints.verify(step_dir) is None and checkpoints.has_checksums(step_dir)


# -- metrics.jsonl is replaced whole --------------------------------------------------------------------------
class _Killed(BaseException):
  """The process's end, as a test raises it: nothing after it runs."""


def _dies_at_the_first_write_under(monkeypatch, directory: pathlib.Path) -> None:
  """Every open for writing ("w") of a file under `directory` opens it (truncating it) and then ends the process
  (`_Killed`) before a byte is written."""
  real = io.open

  def opened(file, mode="r", *args, **kwargs):
    f = real(file, mode, *args, **kwargs)
    if "w" in mode and isinstance(file, (str, os.PathLike)) and pathlib.Path(file).is_relative_to(directory):
      f.close()
      raise _Killed(str(file))
    return f
  monkeypatch.setattr(io, "open", opened)
  monkeypatch.setattr(builtins, "open", opened)


def test_a_resume_never_leaves_metrics_jsonl_part_written(tmp_path, monkeypatch):
  """A resume that drops rows logged after its step, killed at its first write: metrics.jsonl is as it was (the
  rows are written to another file, renamed over it whole); the next resume drops them."""
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)))
  before = path.read_bytes()
  with monkeypatch.context() as patch:
    _dies_at_the_first_write_under(patch, tmp_path)
    with pytest.raises(_Killed):
      Writer(tmp_path, enabled=True, resume_step=2)
  assert path.read_bytes() == before
  Writer(tmp_path, enabled=True, resume_step=2).close()
  assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
  assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["metrics.jsonl"]


# -- a restored state is checked for finiteness; a checkpoint without checksums is unverified -------------------
def _poison(monkeypatch, at: int, poison) -> None:
  """The trainer's step with `poison` {"state": new state → new state, "metrics": ...} applied to step `at`'s
  output (under jit: a jnp.where on the step)."""
  real = loop.make_train_step

  def poisoned(*args, **kwargs):
    step = real(*args, **kwargs)

    def wrapped(state, batch, bound=None):
      new, metrics = step(state, batch, bound)
      hit = new["step"] == at
      pick = lambda bad, good: jax.tree.map(lambda b, g: jnp.where(hit, b, g), bad, good)
      return (pick(poison.get("state", lambda x: x)(new), new),
              pick(poison.get("metrics", lambda x: x)(metrics), metrics))
    return wrapped
  monkeypatch.setattr(loop, "make_train_step", poisoned)


@pytest.mark.slow     # `make test`: a non-finite state is never saved (test_integrity)
def test_a_restored_state_that_is_not_finite_falls_back(finished, tmp_path, caplog, monkeypatch):
  """A checkpoint 8 whose parameters are NaN (the state's check before the save turned off) and without
  checksums.json: `load` warns that it is unverified and names the non-finite entry, returns checkpoint 6 and
  changes nothing; a resume moves 8 aside and saves it again."""
  workdir = _copy(finished, tmp_path)
  with monkeypatch.context() as patch:
    _poison(patch, 8, {"state": lambda s: dict(s, params=jax.tree.map(lambda p: p * jnp.nan, s["params"]))})
    patch.setattr(loop, "check_state_finite", lambda *args: None)
    loop.train(_tiny(steps=8), workdir)
  step_dir = workdir / "checkpoints" / "8"
  (step_dir / checkpoints.CHECKSUMS).unlink()
  before = _files(workdir)
  with caplog.at_level("WARNING"):
    assert loop.load_checkpoint(workdir)[2] == 6
  assert _files(workdir) == before
  assert any("checkpoints/8 cannot be restored (unverified: it holds no checksums.json; its state's `['params']"
             in r.getMessage() and "holds non-finite values)" in r.getMessage() for r in caplog.records), caplog.text
  caplog.clear()
  with caplog.at_level("INFO"):
    loop.train(_tiny(steps=8), workdir)
  assert "resumed from checkpoint 6" in caplog.text and len(_aside(workdir, 8)) == 1
  assert checkpoints.verify(step_dir) is None and loop.load_checkpoint(workdir)[2] == 8


def test_a_checkpoint_without_checksums_is_called_unverified(finished, tmp_path, caplog, monkeypatch):
  """Checkpoint 6 without checksums.json (otherwise whole) restores with a warning; the resume's log and the
  NaN guard's last good checkpoint call it unverified."""
  workdir = _copy(finished, tmp_path)
  (workdir / "checkpoints" / "6" / checkpoints.CHECKSUMS).unlink()
  _poison(monkeypatch, 7, {"metrics": lambda m: dict(m, loss=m["loss"] * jnp.nan)})
  with caplog.at_level("INFO"), pytest.raises(loop.NonFiniteError) as error:
    loop.train(_tiny(steps=8), workdir)
  unverified = "unverified: it holds no checksums.json"
  assert f"the last good checkpoint is checkpoint 6 ({workdir / 'checkpoints' / '6'}, {unverified})" in \
      str(error.value)
  assert f"resumed from checkpoint 6 ({unverified})" in caplog.text


# -- the resume guard without config.json ----------------------------------------------------------------------
@pytest.mark.slow
def test_a_resume_without_config_json_is_checked_against_the_history(finished, tmp_path, caplog):
  """config.json deleted: a resume that changes `optimizer.lr` is refused naming it (the last record of
  config_history.jsonl is the run's settings; a torn record after it is not), before any file is written; a
  resume with the run's settings writes config.json again. Without either file a directory holding checkpoints
  is refused."""
  workdir = _copy(finished, tmp_path)
  (workdir / loop.CONFIG).unlink()
  with (workdir / loop.CONFIG_HISTORY).open("a") as f:
    f.write('{"config": {"optimizer": {"lr": 0.001')
  before = _files(workdir)
  with pytest.raises(ValueError, match="`optimizer.lr` 0.003 → 0.001"):
    loop.train(_tiny(**{"optimizer.lr": 1e-3}), workdir)
  assert _files(workdir) == before
  with caplog.at_level("WARNING"):
    loop.train(_tiny(steps=8), workdir)
  assert "torn last line" in caplog.text
  history = [json.loads(line) for line in (workdir / loop.CONFIG_HISTORY).read_text().splitlines()]
  assert [(h["start"], h["config"]["steps"]) for h in history] == [(0, 6), (6, 8)]
  assert json.loads((workdir / loop.CONFIG).read_text()) == history[-1]["config"]
  (workdir / loop.CONFIG).unlink()
  (workdir / loop.CONFIG_HISTORY).unlink()
  before = _files(workdir)
  with pytest.raises(ValueError, match=f"{workdir} holds checkpoints but neither {loop.CONFIG} nor "
                                       f"{loop.CONFIG_HISTORY}"):
    loop.train(_tiny(steps=8), workdir)
  assert _files(workdir) == before


# -- SIGKILL at random times ---------------------------------------------------------------------------------
# The tiny config made small, checkpointing every step, asynchronously.
ARGS = ["--config=tiny", "--config.data.source=random", "--config.steps=6", "--config.batch_size=2",
        "--config.seq_len=16", "--config.optimizer.warmup_steps=1", "--config.log_every=1",
        "--config.checkpoint_every=1", "--config.keep_checkpoints=2", "--config.diagnostics_every=0",
        "--config.eval_every=0", "--config.progress=false"]
STEPS = 6
# What a launch after a kill must not print: a sign of a damaged checkpoint, or of a crash.
DAMAGE = ("cannot be restored", "moved aside", "unverified", "Traceback")


@pytest.fixture(scope="session")
def compilation_cache(tmp_path_factory):
  """One persistent compilation cache for every trainer these tests start (kept between sessions)."""
  return tmp_path_factory.getbasetemp().parent / "train-xla-cache"


def _start(workdir: pathlib.Path, cache: pathlib.Path, log: pathlib.Path) -> subprocess.Popen:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), JAX_COMPILATION_CACHE_DIR=str(cache),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  with log.open("w") as err:
    return subprocess.Popen([sys.executable, "-m", "osdn_jax.train", f"--workdir={workdir}", *ARGS], cwd=REPO,
                            env=env, stdout=subprocess.DEVNULL, stderr=err)


def _holding(workdir: pathlib.Path, proc: subprocess.Popen) -> bool:
  """Whether `proc` holds the work directory's lock (it has imported everything and is about to restore)."""
  try:
    return json.loads((workdir / loop.LOCK).read_text())["pid"] == proc.pid
  except (OSError, ValueError, KeyError, TypeError):
    return False


def _wait_for_the_lock(workdir: pathlib.Path, proc: subprocess.Popen) -> None:
  deadline = time.perf_counter() + 600
  while not _holding(workdir, proc) and proc.poll() is None and time.perf_counter() < deadline:
    time.sleep(0.005)


def _newest(workdir: pathlib.Path) -> int:
  return int(_steps(workdir)[-1]) if (workdir / "checkpoints").is_dir() and _steps(workdir) else 0


def _check_launch(log: pathlib.Path, newest: int, rc: int) -> None:
  """A launch on a directory whose newest checkpoint was `newest` resumed from it (when it got that far) and
  warned of no damage; when it ended by itself, it ended well."""
  text = log.read_text()
  assert rc in (0, -signal.SIGKILL), text[-3000:]
  assert not any(word in text for word in DAMAGE), text[-3000:]
  resumed = [line for line in text.splitlines() if "resumed from checkpoint" in line]
  assert all(f"resumed from checkpoint {newest} in " in line for line in resumed), (newest, resumed)
  assert newest or not resumed, resumed


def _check_finished(workdir: pathlib.Path, want: list[dict]) -> None:
  """A finished run: every step logged once with the uninterrupted run's loss, the last step the newest of its
  checkpoints, every checkpoint verified, none moved aside, every (re)start's settings the run's."""
  rows = _metrics(workdir)
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  np.testing.assert_array_equal([r["loss"] for r in rows], [r["loss"] for r in want])
  assert _newest(workdir) == STEPS
  assert all(checkpoints.verify(workdir / "checkpoints" / s) is None for s in _steps(workdir))
  assert not list((workdir / "checkpoints").glob("*.damaged-*"))
  history = [json.loads(line) for line in (workdir / loop.CONFIG_HISTORY).read_text().splitlines()]
  assert all(h["config"]["steps"] == STEPS for h in history)


def _reference(workdir: pathlib.Path, cache: pathlib.Path, log: pathlib.Path) -> tuple[list[dict], float, float]:
  """An uninterrupted run, checked: (its metrics, seconds from taking the lock to its first logged step, and to
  its end)."""
  proc = _start(workdir, cache, log)
  _wait_for_the_lock(workdir, proc)
  held = time.perf_counter()
  metrics = workdir / "metrics.jsonl"
  while not (metrics.is_file() and metrics.stat().st_size) and proc.poll() is None:
    time.sleep(0.005)
  setup = time.perf_counter() - held
  _check_launch(log, 0, proc.wait(timeout=600))
  want = _metrics(workdir)
  _check_finished(workdir, want)
  return want, setup, time.perf_counter() - held


def _crash_loop(tmp_path: pathlib.Path, cache: pathlib.Path, *, trials: int, seed: int) -> str:
  """An uninterrupted run (`_reference`), then `trials` launches of the trainer killed with SIGKILL at a random
  time after each takes the lock (within 1.1 × the time the reference took to set up and to run the steps the
  directory has left), each on the directory the last one left (a new directory once a run finishes), then
  one run to its end; every launch checked (`_check_launch`) and every finished run (`_check_finished`). Returns
  what it did."""
  began, log = time.perf_counter(), tmp_path / "stderr.txt"
  want, setup, length = _reference(tmp_path / "whole", cache, log)
  rng = random.Random(seed)
  finished_runs, workdir, seen = 0, tmp_path / "run0", []
  for _ in range(trials):
    newest = _newest(workdir)
    seen.append(newest)
    proc = _start(workdir, cache, log)
    _wait_for_the_lock(workdir, proc)
    time.sleep(rng.uniform(0, 1.1 * (setup + (length - setup) * (1 - newest / STEPS))))
    proc.send_signal(signal.SIGKILL)
    _check_launch(log, newest, proc.wait(timeout=600))
    if proc.returncode == 0:
      _check_finished(workdir, want)
      finished_runs += 1
      workdir = tmp_path / f"run{finished_runs}"
  newest = _newest(workdir)
  _check_launch(log, newest, _start(workdir, cache, log).wait(timeout=600))
  _check_finished(workdir, want)
  return (f"{trials} kills, {finished_runs + 1} runs finished, {time.perf_counter() - began:.0f} s; the newest "
          f"checkpoint at each launch: {seen}; reference: {setup:.1f} s to the first step, {length:.1f} s in all")


@pytest.mark.slow
def test_a_few_kills_lose_no_step(tmp_path, compilation_cache):
  """Two launches killed at random times, then a resume to the end: each step logged once with the uninterrupted
  run's loss (`_crash_loop`)."""
  _crash_loop(tmp_path, compilation_cache, trials=2, seed=0)


@pytest.mark.slow
def test_kills_at_random_times_never_lose_or_change_a_step(tmp_path, compilation_cache):
  """SIGKILL at 60 random times over a whole run's length, each followed by a resume: the directory always
  resumes from its newest checkpoint, warns of no damage, and every finished run logs each step once with the
  uninterrupted run's loss, its last step checkpointed (`_crash_loop`)."""
  print(_crash_loop(tmp_path, compilation_cache, trials=60, seed=1))
