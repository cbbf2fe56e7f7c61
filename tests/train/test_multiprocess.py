"""The trainer as several processes on JAX's distributed runtime, on CPU over loopback (`osdn_jax.train.launch`,
gloo collectives): a 2-process run writes its files once and checkpoints one data position, the same in every
process; it trains on the global batches of a 1-process run and logs its losses; a restart resumes it exactly,
and its checkpoint resumes on 1 process (and a 1-process one on 2); a batch whole over an axis split across the
processes (tensor, context) makes them read the same rows; 4 processes train and checkpoint; a failure ends
every process; the distributed flags go together."""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from absl import app

from osdn_jax import data
from osdn_jax.train import __main__ as cli, loop

REPO = pathlib.Path(__file__).resolve().parents[2]
# The tiny config made smaller: 4 steps of 4 rows × 32 random tokens, checkpoints at steps 2 and 4.
TINY = ["--config=tiny", "--config.data.source=random", "--config.steps=4", "--config.checkpoint_every=2",
        "--config.log_every=1", "--config.diagnostics_every=0", "--config.batch_size=4", "--config.seq_len=32",
        "--config.optimizer.warmup_steps=1", "--config.progress=false"]


def _env(**changes) -> dict:
  return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), **changes)


def _launch(workdir, processes: int, *args: str, devices: int = 1) -> subprocess.CompletedProcess:
  cmd = [sys.executable, "-m", "osdn_jax.train.launch", f"--processes={processes}",
         f"--devices_per_process={devices}", "--", *TINY, f"--workdir={workdir}", *args]
  return subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600)


def _ok(out: subprocess.CompletedProcess) -> str:
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
  return out.stdout


def _metrics(workdir) -> list[dict]:
  return [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def _column(rows: list[dict], key: str) -> np.ndarray:
  return np.array([r[key] for r in rows])


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
  """(work directory, output) of the tiny run as 2 processes of 1 CPU device each."""
  workdir = tmp_path_factory.mktemp("two") / "run"
  return workdir, _ok(_launch(workdir, 2))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
  """The work directory of the tiny run as 1 process of 1 CPU device."""
  workdir = tmp_path_factory.mktemp("one") / "run"
  _ok(_launch(workdir, 1))
  return workdir


def _same_losses(got: list[dict], want: list[dict], rtol: float = 1e-5) -> None:
  assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose(_column(got, key), _column(want, key), rtol=rtol, atol=0, err_msg=key)


def _data_positions(step_dir: pathlib.Path, processes: int) -> list[dict]:
  files = sorted(p.name for p in (step_dir / "data").glob("process_*.json"))
  assert files == [f"process_{i}-of-{processes}.json" for i in range(processes)]
  return [json.loads((step_dir / "data" / name).read_text()) for name in files]


@pytest.mark.slow     # `make test`: a failure in one process ends every process
def test_two_processes_train_and_checkpoint(two_processes):
  """Process 0 alone writes config, metrics (each step once) and events; both processes save the data position
  into every checkpoint, the same one: the global batches consumed, with no process in its signature."""
  workdir, out = two_processes
  assert [r["step"] for r in _metrics(workdir)] == [1, 2, 3, 4]
  assert json.loads((workdir / "config.json").read_text())["batch_size"] == 4
  assert len(list((workdir / "tensorboard").iterdir())) == 1
  logged = [line for line in out.splitlines() if "parameters; mesh" in line]
  assert len(logged) == 1 and logged[0].startswith("[0] ") and "[1] " in out
  steps = sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert steps == ["2", "4"]
  for step in steps:
    positions = _data_positions(workdir / "checkpoints" / step, 2)
    assert positions[0] == positions[1] and positions[0]["batches"] == int(step)
    signature = positions[0]["signature"]
    assert signature["batch_size"] == 4 and not {"process_index", "process_count"} & set(signature)


@pytest.mark.slow
def test_one_and_two_processes_train_on_the_same_batches(two_processes, one_process):
  """The tiny run on 2 processes (a mesh of 2 devices) logs the losses and gradient norms of the run on 1 process
  of 1 device (to fp32 rounding: the meshes differ): the global batch of every step is the same."""
  _same_losses(_metrics(two_processes[0]), _metrics(one_process))
  positions = [_data_positions(one_process / "checkpoints" / "4", 1)[0],
               _data_positions(two_processes[0] / "checkpoints" / "4", 2)[0]]
  assert positions[0] == positions[1]


@pytest.mark.slow
def test_restart_resumes_exactly(two_processes, tmp_path):
  """The 2-process run restarted from its step-2 checkpoint (the later one removed): both processes restore
  the state and the data position, and steps 3 and 4 log what the uninterrupted run logged (the quick suite
  resumes a 2-process checkpoint on 1 process)."""
  whole, _ = two_processes
  workdir = tmp_path / "run"
  shutil.copytree(whole, workdir)
  shutil.rmtree(workdir / "checkpoints" / "4")
  out = _ok(_launch(workdir, 2))
  for i in range(2):
    assert any(line.startswith(f"[{i}] ") and "resumed from checkpoint 2" in line for line in out.splitlines())
  want, got = _metrics(whole), _metrics(workdir)
  assert [r["step"] for r in got] == [1, 2, 3, 4]
  for key in ("loss", "grad_norm"):
    np.testing.assert_array_equal(_column(got, key), _column(want, key), err_msg=key)


def _resume_on(whole: pathlib.Path, tmp_path, processes: int) -> pathlib.Path:
  """A copy of the finished run `whole` without its step-4 checkpoint, resumed on `processes` processes."""
  workdir = tmp_path / "run"
  shutil.copytree(whole, workdir)
  shutil.rmtree(workdir / "checkpoints" / "4")
  out = _ok(_launch(workdir, processes))
  assert "resumed from checkpoint 2" in out
  return workdir


@pytest.mark.slow
def test_a_two_process_checkpoint_resumes_on_one_process(two_processes, one_process, tmp_path):
  """The 2-process run's step-2 checkpoint resumed on 1 process: steps 3 and 4 log what the uninterrupted runs
  (on 2 processes, and on 1) logged, to fp32 rounding, and its checkpoint holds the same data position."""
  workdir = _resume_on(two_processes[0], tmp_path, 1)
  _same_losses(_metrics(workdir), _metrics(two_processes[0]))
  _same_losses(_metrics(workdir), _metrics(one_process))
  assert (_data_positions(workdir / "checkpoints" / "4", 1)
          == _data_positions(two_processes[0] / "checkpoints" / "4", 2)[:1])


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_on_two_processes(two_processes, one_process, tmp_path):
  workdir = _resume_on(one_process, tmp_path, 2)
  _same_losses(_metrics(workdir), _metrics(one_process))
  _same_losses(_metrics(workdir), _metrics(two_processes[0]))


def test_a_data_position_of_another_pipeline_or_step_is_refused(tmp_path):
  """A resume sets the pipeline to the checkpoint's data position; a position of another global batch size, or
  one that does not stand after as many global batches as the checkpoint's step, stops it naming the checkpoint."""
  make = lambda batch_size: data.make_pipeline(dict(source="random", num_records=32, prefetch=0), seq_len=8,
                                               batch_size=batch_size, seed=0)
  saved = make(4)
  for _ in range(2):
    next(saved)
  position = saved.get_state()
  expected = next(saved)
  saved.close()
  resumed = make(4)
  loop._resume_data(resumed, position, 2, tmp_path)
  assert all(np.array_equal(v, expected[k]) for k, v in next(resumed).items())
  with pytest.raises(ValueError, match=r"checkpoint 3 in .*: its data position stands after 2 global batches, not 3"):
    loop._resume_data(resumed, position, 3, tmp_path)
  resumed.close()
  other = make(8)
  with pytest.raises(ValueError, match=r"checkpoint 2 in .*: data: the state belongs to a different pipeline: "
                                       r"batch_size 4 ≠ 8"):
    loop._resume_data(other, position, 2, tmp_path)
  other.close()


@pytest.mark.slow
@pytest.mark.parametrize("axis", ["tensor", "context"])
def test_axis_across_processes_reads_one_shard(axis, tmp_path):
  """mesh data = 1 and `axis` = 2 over 2 processes: the batch's rows are whole on both, so both read the same
  rows, and the run equals one process with 2 devices on the same mesh."""
  mesh = ["--config.mesh.data=1", f"--config.mesh.{axis}=2", "--config.checkpoint_every=0"]
  _ok(_launch(tmp_path / "two", 2, *mesh))
  _ok(_launch(tmp_path / "one", 1, *mesh, devices=2))
  want, got = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose(_column(got, key), _column(want, key), rtol=1e-5, atol=0, err_msg=key)


@pytest.mark.slow
def test_four_processes_train_and_checkpoint(tmp_path):
  out = _ok(_launch(tmp_path, 4, "--config.steps=3"))
  assert "mesh {'data': 4" in out
  assert [r["step"] for r in _metrics(tmp_path)] == [1, 2, 3]
  for step in ("2", "3"):
    data = tmp_path / "checkpoints" / step / "data"
    assert sorted(p.name for p in data.glob("process_*.json")) == [f"process_{i}-of-4.json" for i in range(4)]


def test_a_failure_ends_every_process(tmp_path):
  """A run that fails (here in every process: an unknown model, a usage error) ends at once with its status, 2."""
  out = _launch(tmp_path, 2, "--config.model=nope-tiny")
  assert out.returncode == 2, out.stdout[-3000:]
  assert "[0] " in out.stdout and "[1] " in out.stdout and "`model`" in out.stdout


def test_distributed_flags_go_together():
  assert cli.distributed_args(None, None, None) is None
  assert cli.distributed_args("h:1", 2, 1) == {"coordinator_address": "h:1", "num_processes": 2, "process_id": 1}
  with pytest.raises(app.UsageError, match="missing --num_processes, --process_id"):
    cli.distributed_args("h:1", None, None)
  with pytest.raises(app.UsageError, match="must be below"):
    cli.distributed_args("h:1", 2, 2)
