"""`prepare` killed at any moment: the next run with the same arguments (and --overwrite) tidies --out and writes
the files an uninterrupted run writes, byte for byte, and nothing else.

A run writes into a hidden working directory of --out, locked while it runs; the next run removes an unlocked one,
or, where the killed run had begun to move its files into place (its journal says which earlier files go), it
finishes that move first. Two loops: SIGKILL at each step of the move (a forked child, killed when it renames or
removes a file for the k-th time, and the run after it at the same step), and SIGKILL at random times of a
`python -m osdn_jax.data.prepare` subprocess (slow)."""
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import pytest

from osdn_jax.data import prepare

REPO = pathlib.Path(__file__).resolve().parents[2]
SHARD_TOKENS = 40_000


def _corpus(root: pathlib.Path, kilobytes: int) -> list[str]:
  """.txt documents and two .jsonl files of about `kilobytes` KB of text in all, seeded; their globs."""
  rng = random.Random(0)
  words = ["delta", "rule", "state", "key", "value", "gate", "decay", "chunk", "token", "shard", "ünïcode", "☃"]
  text = lambda n: " ".join(rng.choice(words) for _ in range(n))
  root.mkdir(parents=True, exist_ok=True)
  per_file = kilobytes * 1024 // 4
  for i in range(20):
    (root / f"doc{i:02d}.txt").write_text(text(per_file // 20 // 6), encoding="utf-8")
  for i in range(2):
    lines = [f'{{"text": "{text(rng.randint(20, 400))}"}}' for _ in range(per_file * 3 // 2 // 1400)]
    (root / f"part{i}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
  return [str(root / "*.txt"), str(root / "*.jsonl")]


def _files(out: pathlib.Path) -> dict:
  """Every file and directory under out (hidden ones too): a file's bytes, a directory's None."""
  return {str(p.relative_to(out)): (p.read_bytes() if p.is_file() else None) for p in sorted(out.rglob("*"))}


def _prepare(inputs, out, shard_tokens=SHARD_TOKENS) -> dict:
  return prepare.prepare(inputs, "bytes", out, validation=0.1, workers=1, shard_tokens=shard_tokens,
                         overwrite=True, progress=False, verbose=False)


def _killed_at(step: int, inputs, out, shard_tokens: int) -> int:
  """Runs `_prepare` in a forked child that kills itself (SIGKILL) at its `step`-th rename or removal of a file
  under out; the child's exit status (-SIGKILL, or 0 when it finished first)."""
  pid = os.fork()
  if pid == 0:
    calls = [0]

    def dying(real):
      def call(src, *args, **kwargs):
        if str(src).startswith(str(out)):
          calls[0] += 1
          if calls[0] == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(src, *args, **kwargs)
      return call
    os.replace, os.unlink, os.rmdir = dying(os.replace), dying(os.unlink), dying(os.rmdir)
    try:
      _prepare(inputs, out, shard_tokens)
    finally:
      os._exit(0)
  _, status = os.waitpid(pid, 0)
  return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def test_kills_while_moving_files_into_place_are_finished_by_the_next_run(tmp_path):
  """Over an earlier run of other shards: a run killed at each of its renames and removals, the next run killed at
  the same step, then a run to its end: the uninterrupted run's files, byte for byte, and nothing else."""
  inputs, shard_tokens = _corpus(tmp_path / "corpus", 64), 12_000
  want = (_prepare(inputs, tmp_path / "whole", shard_tokens), _files(tmp_path / "whole"))[1]
  assert sum(name.endswith(".bin") for name in want) > 3
  step, finished = 0, 0
  while finished < 2:
    step += 1
    out = tmp_path / f"out{step}"
    _prepare(inputs, out, shard_tokens // 3)
    statuses = [_killed_at(step, inputs, out, shard_tokens) for _ in range(2)]
    assert all(s in (0, -signal.SIGKILL) for s in statuses), statuses
    finished += statuses[0] == 0
    _prepare(inputs, out, shard_tokens)
    assert _files(out) == want, step


# -- SIGKILL at random times -----------------------------------------------------------------------------------
def _start(inputs, out: pathlib.Path, log: pathlib.Path) -> subprocess.Popen:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  args = [f"--input={g}" for g in inputs] + [
      "--tokenizer=bytes", f"--out={out}", "--validation=0.1", "--workers=1", f"--shard_tokens={SHARD_TOKENS}",
      "--progress=false", "--overwrite"]
  with log.open("w") as err:
    return subprocess.Popen([sys.executable, "-m", "osdn_jax.data.prepare", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=err)


def _working(out: pathlib.Path, before: set, proc: subprocess.Popen) -> None:
  """Waits until a working directory not in `before` appears in out (the run has imported everything and
  tidied out), or the run ends."""
  while proc.poll() is None and not ({p.name for p in out.glob(".prepare-*")} - before):
    time.sleep(0.002)


def _check_launch(log: pathlib.Path, rc: int) -> None:
  text = log.read_text()
  assert rc in (0, -signal.SIGKILL), text[-3000:]
  assert "Traceback" not in text and "error:" not in text, text[-3000:]


def _crash_loop(tmp_path: pathlib.Path, *, trials: int, seed: int) -> str:
  """An uninterrupted run; then `trials` runs on one --out, each killed at a random time within 1.1 × the
  uninterrupted run's time from its working directory's appearance to its end, or within its start-up (one in
  four), then one run to its end; every finished run's files are the uninterrupted run's. Returns what it did."""
  began, log = time.perf_counter(), tmp_path / "stderr.txt"
  inputs = _corpus(tmp_path / "corpus", 384)
  whole = tmp_path / "whole"
  whole.mkdir()
  t0 = time.perf_counter()
  proc = _start(inputs, whole, log)
  _working(whole, set(), proc)
  setup = time.perf_counter() - t0
  _check_launch(log, proc.wait(timeout=600))
  length = time.perf_counter() - t0 - setup
  want = _files(whole)
  assert sum(name.endswith(".bin") for name in want) > 5, sorted(want)
  rng, out, outcomes = random.Random(seed), tmp_path / "out", []
  out.mkdir()
  for _ in range(trials):
    before = {p.name for p in out.glob(".prepare-*")}
    proc = _start(inputs, out, log)
    if rng.random() < 0.25:
      time.sleep(rng.uniform(0.5, 1.1) * setup)
    else:
      _working(out, before, proc)
      time.sleep(rng.uniform(0, 1.1 * length))
    proc.send_signal(signal.SIGKILL)
    _check_launch(log, proc.wait(timeout=600))
    outcomes.append("finished" if proc.returncode == 0 else "killed")
    if proc.returncode == 0:
      assert _files(out) == want
  _check_launch(log, _start(inputs, out, log).wait(timeout=600))
  assert _files(out) == want
  return (f"{trials} kills ({outcomes.count('finished')} runs finished first), {time.perf_counter() - began:.0f} s; "
          f"uninterrupted: {setup:.1f} s to start, {length:.2f} s to write")


@pytest.mark.slow
def test_kills_at_random_times_leave_the_uninterrupted_runs_files(tmp_path):
  """SIGKILL at 50 random times, each followed by a rerun (`_crash_loop`)."""
  print(_crash_loop(tmp_path, trials=50, seed=1))
