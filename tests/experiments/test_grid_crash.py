"""`experiments.grid` killed at any moment: the next run resumes each group from its state saved at its last curve
point (OUT/partial/) and writes the cells an uninterrupted run writes.

The state is saved as the trainer's checkpoints (`osdn_jax.train.checkpoints`: a temporary directory renamed when
complete), and each cell's file through a temporary file and a rename, so no kill leaves a file that the next run
finds damaged (slow: a `python -m experiments.grid` subprocess killed at random times)."""
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
STEPS, EVAL_EVERY = 40, 10
ARGS = ["--size=tiny", "--vocab_size=64", "--pairs=16:2", "--lrs=3e-3,1e-2", "--seeds=0", f"--steps={STEPS}",
        f"--eval_every={EVAL_EVERY}", "--batch_size=4", "--train_examples=64", "--test_examples=8",
        "--implementation=xla", "--variants=dn"]
# What a launch must not print: a sign of a damaged file, or of a crash.
DAMAGE = ("damaged", "Traceback", "error:")


@pytest.fixture(scope="session")
def compilation_cache(tmp_path_factory):
  """One persistent compilation cache for every sweep these tests start (kept between sessions)."""
  return tmp_path_factory.getbasetemp().parent / "grid-xla-cache"


def _start(out: pathlib.Path, cache: pathlib.Path, log: pathlib.Path) -> subprocess.Popen:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), JAX_COMPILATION_CACHE_DIR=str(cache),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
             MPLBACKEND="Agg")
  with log.open("w") as f:
    return subprocess.Popen([sys.executable, "-m", "experiments.grid", f"--out={out}", *ARGS], cwd=REPO, env=env,
                            stdout=f, stderr=subprocess.STDOUT)


def _started(log: pathlib.Path, proc: subprocess.Popen) -> None:
  """Waits until the sweep has looked at its cells (imports done), or ends."""
  while proc.poll() is None and "cells done" not in log.read_text():
    time.sleep(0.005)


def _saved_step(out: pathlib.Path) -> int:
  """The step of the group's newest saved state (a checkpoint directory named by its step; 0: none)."""
  return max((int(p.name) for p in (out / "partial").glob("*/*") if p.name.isdigit()), default=0)


def _cells(out: pathlib.Path) -> dict:
  return {p.name: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}


def _check_launch(log: pathlib.Path, saved: int, rc: int) -> None:
  """A launch on a directory whose group was saved at step `saved` resumed there (when it got that far), and
  printed no damage; when it ended by itself, it ended well."""
  text = log.read_text()
  assert rc in (0, -signal.SIGKILL), text[-3000:]
  assert not any(word in text for word in DAMAGE), text[-3000:]
  resumed = [line.strip() for line in text.splitlines() if "resumed at step" in line]
  assert resumed == ([f"resumed at step {saved}"] if saved else []) or not resumed, (saved, resumed)


def _check_finished(out: pathlib.Path, want: dict) -> None:
  """A finished sweep: the uninterrupted run's files, and its cells' learning curves (losses to rtol 1e-5)."""
  names = lambda d: sorted(str(p.relative_to(d)) for p in d.rglob("*"))
  assert names(out) == names(out.parent / "whole")
  got = _cells(out)
  assert sorted(got) == sorted(want)
  for name, cell in want.items():
    curve, wanted = got[name]["curve"], cell["curve"]
    assert [p["step"] for p in curve] == [p["step"] for p in wanted] == list(range(EVAL_EVERY, STEPS + 1,
                                                                                   EVAL_EVERY))
    np.testing.assert_allclose([p["loss"] for p in curve], [p["loss"] for p in wanted], rtol=1e-5)
    np.testing.assert_allclose([p["accuracy"] for p in curve], [p["accuracy"] for p in wanted], rtol=1e-5)


def _crash_loop(tmp_path: pathlib.Path, cache: pathlib.Path, *, trials: int, seed: int) -> str:
  """An uninterrupted sweep; then `trials` launches, each killed at a random time after it has looked at its cells
  (within 1.1 × the time the uninterrupted sweep took from there to its end), each on the directory the last one
  left (a new one once a sweep finishes), then one sweep to its end; every launch and finished sweep checked.
  Returns what it did."""
  began, log = time.perf_counter(), tmp_path / "log.txt"
  whole = tmp_path / "whole"
  proc = _start(whole, cache, log)
  _started(log, proc)
  t0 = time.perf_counter()
  _check_launch(log, 0, proc.wait(timeout=600))
  length = time.perf_counter() - t0
  want = _cells(whole)
  assert len(want) == 2
  rng, finished, out, seen = random.Random(seed), 0, tmp_path / "run0", []
  for _ in range(trials):
    saved = _saved_step(out)
    seen.append(saved)
    proc = _start(out, cache, log)
    _started(log, proc)
    time.sleep(rng.uniform(0, 1.1 * length))
    proc.send_signal(signal.SIGKILL)
    _check_launch(log, saved, proc.wait(timeout=600))
    if proc.returncode == 0:
      _check_finished(out, want)
      finished += 1
      out = tmp_path / f"run{finished}"
  saved = _saved_step(out)
  _check_launch(log, saved, _start(out, cache, log).wait(timeout=600))
  _check_finished(out, want)
  return (f"{trials} kills, {finished + 1} sweeps finished, {time.perf_counter() - began:.0f} s; the saved step at "
          f"each launch: {seen}; uninterrupted: {length:.1f} s after start-up")


@pytest.mark.slow
def test_kills_at_random_times_leave_the_uninterrupted_curves(tmp_path, compilation_cache):
  """SIGKILL at 50 random times, each followed by a rerun: each launch resumes from the group's saved state and
  warns of no damage; every finished sweep's cells hold the uninterrupted sweep's curves (`_crash_loop`)."""
  print(_crash_loop(tmp_path, compilation_cache, trials=50, seed=1))
