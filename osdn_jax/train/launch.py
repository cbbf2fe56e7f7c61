"""Runs the trainer as N processes of one machine on loopback: a multi-process run to test with.

    python -m osdn_jax.train.launch --processes=2 --devices_per_process=1 -- --config=tiny --workdir=/tmp/run

Starts N processes of `python -m osdn_jax.train <trainer args> --coordinator_address=127.0.0.1:PORT
--num_processes=N --process_id=I` (PORT a free one), prints their output line by line prefixed with "[I] ",
and waits for all of them. When one fails, the others end (or are killed 5 s later) and the launcher exits with
the failed one's status (128 + N for a process killed by signal N).
--devices_per_process=D gives each process D CPU devices (JAX_PLATFORMS=cpu,
--xla_force_host_platform_device_count=D); without it the processes inherit the environment as it is.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

from absl import flags

from osdn_jax import cli

_PROCESSES = flags.DEFINE_integer("processes", 2, "processes to start", lower_bound=1)
_DEVICES = flags.DEFINE_integer("devices_per_process", None, "CPU devices per process (default: as the "
                                "environment says)", lower_bound=1)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(devices: int | None) -> dict[str, str]:
  """The environment of every process: the launcher's, with D CPU devices when devices is given."""
  env = dict(os.environ)
  if devices is not None:
    kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(kept + [f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
  return env


def _relay(index: int, stream) -> None:
  for line in stream:
    sys.stdout.write(f"[{index}] {line}")
    sys.stdout.flush()


def launch(trainer_args: list[str], processes: int, devices: int | None = None) -> int:
  """Runs the processes (module docstring); returns 0, or the exit status of the first one that failed."""
  port, env = free_port(), process_env(devices)
  procs, relays = [], []
  try:
    for i in range(processes):
      cmd = [sys.executable, "-u", "-m", "osdn_jax.train", *trainer_args, f"--coordinator_address=127.0.0.1:{port}",
             f"--num_processes={processes}", f"--process_id={i}"]
      procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
      relays.append(threading.Thread(target=_relay, args=(i, procs[-1].stdout), daemon=True))
      relays[-1].start()
    while True:
      codes = [p.poll() for p in procs]
      if any(codes) or all(c == 0 for c in codes):
        break
      time.sleep(0.1)
    status = next((c if c > 0 else 128 - c for c in codes if c), 0)   # 128 + N: killed by signal N
  finally:
    # A failed trainer process exits at once and its peers' collectives fail with it; any process still running
    # after a few seconds is killed (JAX's distributed runtime takes SIGTERM as a preemption notice, not an end).
    deadline = time.time() + 5
    for p in procs:
      try:
        p.wait(timeout=max(0.0, deadline - time.time()))
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    for t in relays:
      t.join(timeout=5)
  return status


def main(argv):
  if len(argv) < 2:
    raise cli.UsageError("usage: python -m osdn_jax.train.launch --processes=N [--devices_per_process=D] -- "
                         "<trainer args>")
  sys.exit(launch(argv[1:], _PROCESSES.value, _DEVICES.value))


if __name__ == "__main__":
  cli.run(main)
