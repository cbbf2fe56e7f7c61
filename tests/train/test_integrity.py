"""What keeps a work directory whole: checkpoints verified against their checksums on restore (a damaged one
falls back to the one before), resumes that may change only the fields of `loop.RESUMABLE` (refused before a
file is written, every (re)start's config kept), and the lock that keeps a second trainer out."""
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from flax import nnx

from osdn_jax.testing import override
from osdn_jax.train import checkpoints, configs, loop, optim

REPO = pathlib.Path(__file__).resolve().parents[2]


def _tiny(**changes):
  """The tiny config made small (random tokens, 2 × 16 tokens, 4 steps, checkpoints at 2 and 4), quiet,
  synchronous checkpoints; `changes` by dotted field."""
  c = configs.get_config("tiny")
  c.data.source = "random"
  c.progress = False
  c.async_checkpoint = False
  c.steps, c.checkpoint_every, c.log_every, c.diagnostics_every = 4, 2, 1, 0
  c.batch_size, c.seq_len, c.optimizer.warmup_steps = 2, 16, 1
  return override(c, changes)


def _metrics(workdir):
  return [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def _params(model):
  return jax.tree.leaves(nnx.state(model, nnx.Param).to_pure_dict())


def _files(workdir) -> dict:
  """{relative path: bytes} of every file under workdir but the lock."""
  return {str(p.relative_to(workdir)): p.read_bytes() for p in sorted(pathlib.Path(workdir).rglob("*"))
          if p.is_file() and p.name != "lock"}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A finished run of `_tiny()` (checkpoints 2 and 4), and its checkpoint 2's parameters."""
  workdir = tmp_path_factory.mktemp("integrity") / "run"
  loop.train(_tiny(), workdir)
  return workdir, _params(loop.load(workdir, step=2)[0])


def _copy(finished, tmp_path) -> pathlib.Path:
  shutil.copytree(finished[0], tmp_path / "run")
  return tmp_path / "run"


def _damage(path: pathlib.Path) -> None:
  """64 random bytes written over the middle of a file (its size unchanged where it is 64 bytes or more)."""
  data = bytearray(path.read_bytes())
  at = max(0, len(data) // 2 - 32)
  data[at:at + 64] = np.random.default_rng(0).bytes(64)
  path.write_bytes(bytes(data))


def _largest_array_file(step_dir: pathlib.Path) -> pathlib.Path:
  return max((p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
             key=lambda p: p.stat().st_size)


# -- checksums ------------------------------------------------------------------------------------------------
def test_a_checkpoint_holds_the_checksums_of_its_files(finished, tmp_path):
  """checksums.json lists the SHA-256 of every file of the state and the data positions; `verify` names a
  changed or missing file and a missing checksums.json."""
  step_dir = _copy(finished, tmp_path) / "checkpoints" / "4"
  listed = set(json.loads((step_dir / checkpoints.CHECKSUMS).read_text())["sha256"])
  files = {p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file()}
  assert listed == files - {checkpoints.CHECKSUMS, "_CHECKPOINT_METADATA", "commit_success.txt"}
  assert "data/process_0-of-1.json" in listed and "state/_METADATA" in listed
  assert checkpoints.verify(step_dir) is None
  array_file = _largest_array_file(step_dir)
  _damage(array_file)
  assert checkpoints.verify(step_dir) == f"{array_file.relative_to(step_dir).as_posix()} does not match its checksum"
  array_file.unlink()
  assert checkpoints.verify(step_dir) == f"{array_file.relative_to(step_dir).as_posix()} is missing"
  unlisted = _copy(finished, tmp_path / "unlisted") / "checkpoints" / "4"
  (unlisted / checkpoints.CHECKSUMS).unlink()
  assert checkpoints.verify(unlisted) is None   # written without checksums: restored unverified, with a warning


@pytest.mark.parametrize("target", ["array file", "state/_METADATA", "state/_sharding", "state/manifest.ocdbt",
                                    "data/process_0-of-1.json", "checksums.json"])
def test_a_damaged_checkpoint_fails_verification_and_the_previous_loads(finished, tmp_path, caplog, target):
  """64 random bytes in any file of the newest checkpoint (an array file, the state's metadata, a data position,
  the checksums themselves): `load` warns naming checkpoint 4 and returns checkpoint 2's parameters. It changes
  nothing in the directory (a running trainer's temporary checkpoint included)."""
  workdir = _copy(finished, tmp_path)
  step_dir = workdir / "checkpoints" / "4"
  _damage(_largest_array_file(step_dir) if target == "array file" else step_dir / target)
  saving = workdir / "checkpoints" / "6.orbax-checkpoint-tmp"
  saving.mkdir()
  (saving / "_CHECKPOINT_METADATA").write_text("{}")
  before = _files(workdir)
  with caplog.at_level("WARNING"):
    model, _ = loop.load(workdir)
  assert _files(workdir) == before
  assert any("checkpoints/4 cannot be restored (fails verification" in r.getMessage()
             and "falling back to the previous one" in r.getMessage() for r in caplog.records), caplog.text
  for got, want in zip(_params(model), finished[1]):
    np.testing.assert_array_equal(got, want)


def test_a_run_resumes_from_the_checkpoint_before_a_damaged_one(finished, tmp_path, caplog):
  """The finished run with a damaged array file in checkpoint 4, run again: it warns, resumes from checkpoint 2
  and logs steps 3 and 4 as the run did."""
  workdir = _copy(finished, tmp_path)
  _damage(_largest_array_file(workdir / "checkpoints" / "4"))
  with caplog.at_level("INFO"):
    loop.train(_tiny(), workdir)
  assert "does not match its checksum" in caplog.text and "resumed from checkpoint 2" in caplog.text
  want, got = _metrics(finished[0]), _metrics(workdir)
  assert [r["step"] for r in got] == [1, 2, 3, 4]
  np.testing.assert_array_equal([r["loss"] for r in got], [r["loss"] for r in want])


# -- resuming with another config -------------------------------------------------------------------------------
def test_a_resume_refuses_changed_settings_before_writing_a_file(finished, tmp_path):
  """Other `steps`, `optimizer.lr` and `optimizer.weight_decay`: a ValueError naming the two refused fields, old
  → new; every file of the directory is as it was, and `load` still reads the run."""
  workdir = _copy(finished, tmp_path)
  before = _files(workdir)
  with pytest.raises(ValueError) as error:
    loop.train(_tiny(steps=8, **{"optimizer.lr": 1e-3, "optimizer.weight_decay": 0.1}), workdir)
  message = str(error.value)
  assert "`optimizer.lr` 0.003 → 0.001" in message and "`optimizer.weight_decay` 0.01 → 0.1" in message
  assert "`steps` 4 → 8" not in message and "a resume may change only `steps`" in message
  assert _files(workdir) == before
  assert loop.load(workdir)[1].optimizer.lr == 3e-3


def test_another_model_is_refused_and_config_json_kept(finished, tmp_path):
  """Another model (no checkpoint fits its state): RuntimeError naming the changed field; config.json is the
  run's and `load` rebuilds its model."""
  workdir = _copy(finished, tmp_path)
  before = _files(workdir)
  with pytest.raises(RuntimeError, match="this config changes `model` 'gdn-tiny' → 'pgdn-tiny'"):
    loop.train(_tiny(model="pgdn-tiny"), workdir)
  assert _files(workdir) == before
  model, config = loop.load(workdir)
  assert config.model == "gdn-tiny" and model.cfg.variant == "gdn"


def test_a_resume_may_extend_the_run_and_change_its_cadence(finished, tmp_path, caplog):
  """`steps` 4 → 6 with other cadence fields: the run resumes from checkpoint 4, its learning rate follows the
  schedule of 6 steps; config_history.jsonl holds both (re)starts and config.json the latest, which `load`
  reads."""
  workdir = _copy(finished, tmp_path)
  changes = {"steps": 6, "checkpoint_every": 3, "keep_checkpoints": 2, "diagnostics_every": 3,
             "async_checkpoint": True, "data.prefetch": 1}
  with caplog.at_level("INFO"):
    loop.train(_tiny(**changes), workdir)
  assert "resumed from checkpoint 4" in caplog.text
  rows = _metrics(workdir)
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
  schedule = optim.schedule(_tiny().optimizer, 6)
  np.testing.assert_allclose([r["lr"] for r in rows[4:]], [float(schedule(4)), float(schedule(5))], rtol=1e-6)
  history = [json.loads(line) for line in (workdir / "config_history.jsonl").read_text().splitlines()]
  assert [(h["start"], h["config"]["steps"]) for h in history] == [(0, 4), (4, 6)]
  assert json.loads((workdir / "config.json").read_text()) == history[-1]["config"]
  assert loop.load(workdir)[1].steps == 6
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == ["4", "6"]


def test_a_run_written_before_a_field_existed_resumes_at_its_default(finished, tmp_path, caplog):
  """A config.json without a field the trainer has now (`scan_layers`, `data.path`) resumes when the field is at
  its default (the run's own behaviour), and is refused at another value."""
  workdir = _copy(finished, tmp_path)
  config = json.loads((workdir / "config.json").read_text())
  del config["scan_layers"], config["data"]["path"]
  (workdir / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="`scan_layers` \\(absent\\) → False"):
    loop.train(_tiny(steps=5, scan_layers=False), workdir)
  with caplog.at_level("INFO"):
    loop.train(_tiny(steps=5), workdir)
  assert "resumed from checkpoint 4" in caplog.text


def test_config_changes_names_every_differing_field():
  old = loop._record(_tiny())
  new = loop._record(_tiny(model="pgdn-tiny", **{"optimizer.lr": 1e-3, "mesh.data": 1}))
  new["point_options"] = {"apf_anchor": "init"}
  assert loop.config_changes(old, new) == {"mesh.data": (-1, 1), "model": ("gdn-tiny", "pgdn-tiny"),
                                           "optimizer.lr": (3e-3, 1e-3),
                                           "point_options.apf_anchor": ("(absent)", "init")}
  assert set(loop.RESUMABLE) <= set(loop._flat(old))


# -- the lock ---------------------------------------------------------------------------------------------------
def test_a_second_trainer_is_refused_naming_the_holder(tmp_path):
  """While a trainer holds the directory, another stops before writing anything, naming the directory and the
  holder's host and pid; the holder's release empties the lock file."""
  with loop.WorkdirLock(tmp_path) as held:
    assert json.loads((tmp_path / loop.LOCK).read_text()) == {"host": socket.gethostname(), "pid": os.getpid()}
    with pytest.raises(loop.WorkdirLockedError,
                       match=rf"{tmp_path} is in use by another trainer \(host {socket.gethostname()}, "
                             rf"pid {os.getpid()}\)"):
      loop.train(_tiny(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [loop.LOCK]
  assert held.file.closed and (tmp_path / loop.LOCK).read_text() == ""


def test_a_trainer_started_beside_a_running_one_stops(tmp_path):
  """A trainer (the CLI, in another process) runs in the directory; a second one started there stops with
  WorkdirLockedError naming the first one's host and pid."""
  args = ["--config=tiny", f"--workdir={tmp_path}", "--config.data.source=random", "--config.steps=100000",
          "--config.batch_size=2", "--config.seq_len=16", "--config.log_every=1", "--config.checkpoint_every=0",
          "--config.diagnostics_every=0", "--config.progress=false"]
  first = subprocess.Popen([sys.executable, "-m", "osdn_jax.train", *args], cwd=REPO, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO)))
  try:
    deadline = time.time() + 120
    while not (tmp_path / "metrics.jsonl").is_file() and first.poll() is None and time.time() < deadline:
      time.sleep(0.05)
    assert first.poll() is None, first.stderr.read().decode()[-2000:]
    with pytest.raises(RuntimeError, match=rf"\(host {socket.gethostname()}, pid {first.pid}\)") as error:
      loop.train(_tiny(checkpoint_every=0), tmp_path)
    assert type(error.value).__name__ == "WorkdirLockedError"
  finally:
    first.kill()
    first.wait()


def test_a_run_releases_the_lock_however_it_ends(finished, tmp_path):
  """After a finished run and after a refused resume the directory can be taken again."""
  loop.WorkdirLock(finished[0]).release()
  workdir = _copy(finished, tmp_path)
  with pytest.raises(ValueError):
    loop.train(_tiny(seed=1), workdir)
  loop.WorkdirLock(workdir).release()


def test_the_lock_ends_with_its_holder(tmp_path):
  """A holder killed with SIGKILL leaves its host and pid in the file but no lock: the next trainer takes it."""
  script = textwrap.dedent(f"""
      import os, signal
      from osdn_jax.train import loop
      loop.WorkdirLock({str(tmp_path)!r})
      os.kill(os.getpid(), signal.SIGKILL)
  """)
  done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                        capture_output=True, timeout=120)
  assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
  assert json.loads((tmp_path / loop.LOCK).read_text())["pid"] != os.getpid()
  with loop.WorkdirLock(tmp_path):
    assert json.loads((tmp_path / loop.LOCK).read_text())["pid"] == os.getpid()


def test_only_process_0_takes_the_lock(tmp_path, monkeypatch):
  monkeypatch.setattr(loop.jax, "process_index", lambda: 1)
  assert loop._lock_workdir(tmp_path) is None and not (tmp_path / loop.LOCK).exists()


# -- a non-finite state is never saved -----------------------------------------------------------------------
def test_a_non_finite_state_is_not_saved(tmp_path):
  """A learning rate that is finite as a Python float but infinite in fp32 (1e39) passes validation; the first
  update makes the parameters non-finite while the step's own loss and gradient norm are finite. The guard
  checks the state before the save: the run stops naming a parameter, and no checkpoint is written."""
  config = _tiny(steps=2, checkpoint_every=1, **{"optimizer.lr": 1e39, "optimizer.warmup_steps": 0})
  with pytest.raises(loop.NonFiniteError, match=r"step 1: the state's `\['params'\].*non-finite values, so it is "
                                                r"not saved; the last good checkpoint is none"):
    loop.train(config, tmp_path / "run")
  steps = tmp_path / "run" / "checkpoints"
  assert not steps.exists() or not [p for p in steps.iterdir() if p.name.isdigit()]
