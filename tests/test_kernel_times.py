"""experiments.kernel_times reads device kernel events out of a profiler trace: only complete events on GPU
processes count, per (device line, kernel) and per call; a folder without a trace is an error."""
import gzip
import json
import os

import pytest

from experiments import kernel_times


def _write_trace(folder):
  events = [
      {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
      {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "pid": 7, "tid": 3, "name": "thread_name", "args": {"name": "Stream #14(Compute)"}},
      {"ph": "X", "pid": 1, "tid": 9, "name": "python call", "ts": 0, "dur": 5000.0},   # host: ignored
      {"ph": "X", "pid": 7, "tid": 3, "name": "delta_rule_prep", "ts": 0, "dur": 300.0},
      {"ph": "X", "pid": 7, "tid": 3, "name": "delta_rule_prep", "ts": 400, "dur": 260.0},
      {"ph": "X", "pid": 7, "tid": 3, "name": "osdn_d_pass_fwd", "ts": 700, "dur": 1000.0},
      {"ph": "i", "pid": 7, "tid": 3, "name": "marker", "ts": 5},                         # not complete
  ]
  path = os.path.join(folder, "plugins", "profile", "run")
  os.makedirs(path)
  with gzip.open(os.path.join(path, "perfetto_trace.json.gz"), "wt") as f:
    json.dump({"traceEvents": events}, f)


def test_device_events_and_table(tmp_path):
  _write_trace(str(tmp_path))
  events = kernel_times.device_events(str(tmp_path))
  assert sorted(events) == [("Stream #14(Compute)", "delta_rule_prep", 260.0),
                            ("Stream #14(Compute)", "delta_rule_prep", 300.0),
                            ("Stream #14(Compute)", "osdn_d_pass_fwd", 1000.0)]
  lines = kernel_times.table(events, calls=2, top=5)
  assert lines[0].strip() == "[Stream #14(Compute)] total 0.780 ms per call"
  assert "0.500 ms  64.1%  osdn_d_pass_fwd" in lines[1] and "0.280 ms  35.9%  delta_rule_prep" in lines[2]


def test_no_trace_is_an_error(tmp_path):
  with pytest.raises(FileNotFoundError):
    kernel_times.device_events(str(tmp_path))


def test_per_call_runs_under_the_profiler(tmp_path):
  """The profiler round trip itself (on CPU: no device lines, so no kernels)."""
  import jax
  import jax.numpy as jnp
  times = kernel_times.per_call(jax.jit(lambda x: x * 2.0), jnp.ones(8), calls=2, folder=str(tmp_path))
  assert isinstance(times, dict) and all(us >= 0 for us in times.values())
