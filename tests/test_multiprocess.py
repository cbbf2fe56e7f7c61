"""The trainer as several processes on JAX's distributed runtime, on CPU over loopback (`osdn_jax.train.launch`,
gloo collectives): a 2-process run writes its files once and checkpoints every process's data position; it
equals one process holding both devices; a restart resumes it exactly; a batch whole over an axis split across
the processes (tensor, context) makes them read the same rows; 4 processes train and checkpoint; a failure ends
every process; the distributed flags go together."""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from absl import app

from osdn_jax.train import __main__ as cli, launch

REPO = pathlib.Path(__file__).resolve().parents[1]
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


def test_two_processes_train_and_checkpoint(two_processes):
  """Process 0 alone writes config, metrics (each step once) and events; both processes save their data
  position into every checkpoint, each its own shard's."""
  workdir, out = two_processes
  assert [r["step"] for r in _metrics(workdir)] == [1, 2, 3, 4]
  assert json.loads((workdir / "config.json").read_text())["batch_size"] == 4
  assert len(list((workdir / "tensorboard").iterdir())) == 1
  logged = [line for line in out.splitlines() if "parameters; mesh" in line]
  assert len(logged) == 1 and logged[0].startswith("[0] ") and "[1] " in out
  steps = sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert steps == ["2", "4"]
  for step in steps:
    positions = [json.loads((workdir / "checkpoints" / step / "data" / f"process_{i}-of-2.json").read_text())
                 for i in range(2)]
    assert [p["signature"]["process_index"] for p in positions] == [0, 1]
    assert all(p["signature"]["process_count"] == 2 and p["signature"]["batch_size"] == 2 for p in positions)


# One process holding both devices, reading both processes' shards side by side: the 2-process run's global batch.
_ONE_PROCESS = textwrap.dedent("""
    import sys
    import numpy as np
    from osdn_jax.train import __main__ as cli, loop
    make = loop.data_lib.make_pipeline

    class BothShards:
      def __init__(self, cfg, *, batch_size, process_index, process_count, **kw):
        self.parts = [make(cfg, batch_size=batch_size // 2, process_index=i, process_count=2, **kw) for i in (0, 1)]
        self.vocab_size = self.parts[0].vocab_size
      def __next__(self):
        parts = [next(p) for p in self.parts]
        return {k: np.concatenate([b[k] for b in parts]) for k in parts[0]}
      def get_state(self):
        return [p.get_state() for p in self.parts]
      def close(self):
        for p in self.parts:
          p.close()

    loop.data_lib.make_pipeline = BothShards
    cli.app.run(cli.main, argv=cli.configs.flag_args(sys.argv))
""")


def test_two_processes_equal_one_process_with_two_devices(two_processes, tmp_path):
  """The same global batches on one process with 2 devices: the same losses and gradient norms (fp32)."""
  workdir, _ = two_processes
  out = subprocess.run([sys.executable, "-c", _ONE_PROCESS, *TINY, f"--workdir={tmp_path}"],
                       env=dict(launch.process_env(2), PYTHONPATH=str(REPO)), cwd=REPO, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-4000:]
  assert "mesh {'data': 2" in out.stderr
  want, got = _metrics(tmp_path), _metrics(workdir)
  assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose(_column(got, key), _column(want, key), rtol=1e-5, atol=0, err_msg=key)


def test_restart_resumes_exactly(two_processes, tmp_path):
  """The 2-process run restarted from its step-2 checkpoint (the later one removed): both processes restore
  the state and their own data positions, and steps 3 and 4 log what the uninterrupted run logged."""
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
  """A run that fails (here in every process: an unknown model) ends at once with a non-zero status."""
  out = _launch(tmp_path, 2, "--config.model=nope-tiny")
  assert out.returncode == 1, out.stdout[-3000:]
  assert "[0] " in out.stdout and "[1] " in out.stdout and "`model`" in out.stdout


def test_distributed_flags_go_together():
  assert cli.distributed_args(None, None, None) is None
  assert cli.distributed_args("h:1", 2, 1) == {"coordinator_address": "h:1", "num_processes": 2, "process_id": 1}
  with pytest.raises(app.UsageError, match="missing --num_processes, --process_id"):
    cli.distributed_args("h:1", None, None)
  with pytest.raises(app.UsageError, match="must be below"):
    cli.distributed_args("h:1", 2, 2)
