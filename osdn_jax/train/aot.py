"""The trainer's sharded step compiled ahead of time for a TPU topology, on a host without TPUs.

    python -m osdn_jax.train.aot --config=1.3b --config.model=pgdn-1.3b --config.mesh.data=1 \\
        --config.mesh.fsdp=-1 --topology=v5p:4x4x4 --out=aot.json

libtpu (the `tpu-aot` extra) describes the topology's chips as compile-only devices
(`jax.experimental.topologies.get_topology_desc`); the step (`train.step`, checked as the trainer runs it) is
lowered with ShapeDtypeStructs that carry the trainer's shardings on `mesh.make_mesh(config.mesh, devices)` and
compiled by TPU's XLA, so no array of the model is ever allocated. The report: per-device memory
(`compiled.memory_analysis()`) against the chip's HBM, and the step's collectives (`train.collectives`).

Topologies: "<chip>:<shape>" with chip v4, v5p (3-D shapes, e.g. 4x4x4) or v5e, v6e (2-D, e.g. 16x16); one
device per chip (v4 and v5p as megacores). The implementation: "auto" compiles as "xla"; "pallas", "pallas-gpu" and
"pallas-tpu" are refused (the host is not a TPU backend, so a kernel would be chosen for the host and run in
interpret mode, not compiled by Mosaic for the topology).
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from osdn_jax import models
from osdn_jax.ops import dispatch
from osdn_jax.train import collectives, configs, loop, mesh as mesh_lib, optim
from osdn_jax.train.step import checked_train_step, graphdef, init_state, make_train_step

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  """A TPU generation: libtpu's name for it, its chip config, the dims of its topologies and HBM per chip."""
  libtpu_name: str
  chip_config: str
  dims: int
  hbm_gib: float


CHIPS = {"v4": Chip("v4", "megacore", 3, 32), "v5p": Chip("v5", "megacore", 3, 95),
         "v5e": Chip("v5e", "default", 2, 16), "v6e": Chip("v6e", "default", 2, 32)}


def parse_topology(topology: str) -> tuple[Chip, tuple[int, ...]]:
  """"v5p:4x4x4" → (CHIPS["v5p"], (4, 4, 4)); ValueError naming the forms for anything else."""
  name, _, shape = topology.partition(":")
  chip = CHIPS.get(name)
  try:
    dims = tuple(int(d) for d in shape.split("x"))
  except ValueError:
    dims = ()
  if chip is None or len(dims) != chip.dims or min(dims) < 1:
    raise ValueError(f"aot: `topology` must be '<chip>:<shape>' with chip one of {', '.join(CHIPS)} and a "
                     f"shape of 3 (v4, v5p) or 2 (v5e, v6e) sizes, e.g. 'v5p:4x4x4' or 'v5e:16x16'; "
                     f"got {topology!r}")
  return chip, dims


def _wrap(chip: Chip, dims: tuple[int, ...]) -> tuple[bool, bool, bool]:
  """The torus links of a slice: a 3-D slice whose sides are all ≥ 4 wraps in every dimension; a 2-D slice
  wraps along a side of 16 (a full v5e/v6e pod side)."""
  if chip.dims == 3:
    return (min(dims) >= 4,) * 3
  return tuple(d == 16 for d in dims) + (False,)


def topology_devices(topology: str) -> list:
  """The compile-only devices of a TPU topology string (RuntimeError when libtpu is not installed)."""
  chip, dims = parse_topology(topology)
  # libtpu takes a machine-wide lock for the chips it drives; compile-only devices drive none, and without
  # this a second compiling process (or a test worker) fails.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies
  bounds = tuple(min(2, d) for d in dims[:2]) + (1,)
  return topologies.get_topology_desc(
      platform="tpu", topology_name=f"{chip.libtpu_name}:{'x'.join(map(str, dims))}",
      chip_config_name=chip.chip_config, chips_per_host_bounds=bounds, num_slices=1,
      wrap=_wrap(chip, dims)).devices


def vocab_size(config) -> int:
  """The vocabulary the trainer's data would give, without building the pipeline: 256 for bytes and passkey,
  prepared token shards' from their metadata, else `data.vocab_size` (a BPE trained on a small corpus may stop
  short of it)."""
  data = config.data
  if data.source == "tokens":
    from osdn_jax.data import tokens
    return tokens.vocab_size(data.path)
  if (data.source == "text" and data.tokenizer == "byte") or data.source == "passkey":
    return 256
  return data.vocab_size


def _abstract_batch(config, sharding) -> dict:
  shape = (config.batch_size, config.seq_len)
  return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32, sharding=sharding)
          for k in ("tokens", "targets", "segment_ids", "loss_mask")}


def memory_report(compiled, hbm_gib: float) -> dict:
  """A compiled program's `memory_analysis()` in bytes, its total and whether it fits `hbm_gib` GiB of HBM."""
  m = compiled.memory_analysis()
  out = {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
         "alias_bytes": m.alias_size_in_bytes, "temp_bytes": m.temp_size_in_bytes,
         "generated_code_bytes": m.generated_code_size_in_bytes}
  # Donated state: outputs aliased to arguments occupy their buffers once.
  out["total_bytes"] = (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
                        + out["generated_code_bytes"])
  out["hbm_bytes"] = int(hbm_gib * GIB)
  out["fits"] = out["total_bytes"] <= out["hbm_bytes"]
  return out


def compile_for_topology(config, topology: str, *, segments_per_row: int | None = None,
                         vocab: int | None = None, devices=None, hlo_path=None) -> dict:
  """Compiles the trainer's step for `topology` and returns the report (module docstring; JSON-serialisable).

  segments_per_row: the step's static packing bound (`step.segments_bound`); default 4 for text (rows of
  packed documents: the smallest bound above 1) and 1 (unpacked) for the other sources. vocab: default
  `vocab_size(config)`. devices: the topology's devices when already made. hlo_path: where to write the
  optimised HLO text, if anywhere."""
  configs.validate(config)
  if dispatch.is_pallas(config.implementation):
    raise ValueError(f"aot: `implementation`={config.implementation!r} would run a kernel in interpret mode on this "
                     "host, not compiled for the topology; use 'xla' or 'auto'")
  config = config.copy_and_resolve_references()
  with config.unlocked():
    if config.implementation == "auto":
      config.implementation = "xla"
  chip, dims = parse_topology(topology)
  devices = topology_devices(topology) if devices is None else devices
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  loop.rows_per_process(config, mesh)
  cfg = loop.model_config(config, vocab or vocab_size(config))
  mesh_lib.check_tensor_axis(cfg, mesh)
  if segments_per_row is None:
    segments_per_row = 4 if config.data.source == "text" else 1

  tx = optim.make(config.optimizer, config.steps)
  abstract = jax.eval_shape(lambda: init_state(cfg, tx, config.seed))
  state_sh = loop.shard_state(abstract, mesh)
  batch_sh = mesh_lib.batch_sharding(mesh)
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_sh)
  step = make_train_step(graphdef(cfg), tx, grad_accum=config.grad_accum, loss_chunk=config.loss_chunk,
                         schedule=optim.schedule(config.optimizer, config.steps),
                         loss_positions=config.get("loss_positions", 0))
  fn = jax.jit(checked_train_step(step, cfg.vocab_size), in_shardings=(state_sh, batch_sh),
               out_shardings=(NamedSharding(mesh, P()), (state_sh, None)), donate_argnums=0, static_argnums=2)
  t0 = time.perf_counter()
  with jax.set_mesh(mesh):
    lowered = fn.lower(state, _abstract_batch(config, batch_sh), segments_per_row)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  hlo = compiled.as_text()
  if hlo_path:
    pathlib.Path(hlo_path).write_text(hlo)
  return {
      "topology": topology, "device_kind": devices[0].device_kind, "chips": math.prod(dims),
      "devices": len(devices), "hbm_gib": chip.hbm_gib, "model": config.model,
      "params": models.count_params(cfg), "vocab_size": cfg.vocab_size, "mesh": dict(mesh.shape),
      "batch_size": config.batch_size, "seq_len": config.seq_len, "grad_accum": config.grad_accum,
      "dtype": config.dtype, "remat": config.remat, "implementation": config.implementation,
      "chunk_size": config.chunk_size, "loss_chunk": config.loss_chunk, "segments_per_row": segments_per_row,
      "memory": memory_report(compiled, chip.hbm_gib), "collectives": collectives.count(hlo, len(devices)),
      "lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2),
      "versions": {p: _version(p) for p in ("jax", "jaxlib", "libtpu")},
  }


def _version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def _gib(n: float) -> str:
  return f"{n / GIB:.2f}"


def _size(n: float) -> str:
  for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= scale:
      return f"{n / scale:.1f} {unit}"
  return f"{n:.0f} B"


def table(report: dict) -> str:
  """The report as a few lines of text: memory per device, then the collectives."""
  m = {k: _gib(v) for k, v in report["memory"].items() if k.endswith("_bytes")}
  lines = [f"{report['model']} on {report['topology']} ({report['devices']} × {report['device_kind']}), mesh "
           f"{report['mesh']}, batch {report['batch_size']} × {report['seq_len']}, remat {report['remat']}, "
           f"solve {report['implementation']}; lowered in {report['lower_s']} s, compiled in "
           f"{report['compile_s']} s",
           f"memory per device (GiB): arguments {m['argument_bytes']} | outputs {m['output_bytes']} | aliased "
           f"{m['alias_bytes']} | temporaries {m['temp_bytes']} | code {m['generated_code_bytes']} | total "
           f"{m['total_bytes']} of {m['hbm_bytes']} HBM ({'fits' if report['memory']['fits'] else 'DOES NOT FIT'})",
           f"{'collective':<20}{'ops':>6}{'per step':>10}{'bytes/step':>12}{'ring traffic':>14}"]
  for kind in collectives.KINDS:
    c = report["collectives"][kind]
    lines.append(f"{kind:<20}{c['ops']:>6}{c['executed']:>10}{_size(c['bytes']):>12}"
                 f"{_size(c['traffic_bytes']):>14}")
  if report["collectives"]["unknown_trip_counts"]:
    lines.append(f"({report['collectives']['unknown_trip_counts']} loops of unknown length counted once)")
  return "\n".join(lines)


def main() -> None:
  from absl import flags

  from osdn_jax import cli, plugins

  config_flag = configs.define_config_flag()   # as the trainer's: --config.point_options.NAME=VALUE too
  plugins.define_imports_flag()                # --imports=my_points: points a module registers, by name
  topology = flags.DEFINE_string("topology", None, "<chip>:<shape>, e.g. v5p:4x4x4 or v5e:16x16")
  out = flags.DEFINE_string("out", None, "where to write the report as JSON")
  hlo = flags.DEFINE_string("hlo", None, "where to write the compiled program's HLO text")
  segments = flags.DEFINE_integer("segments", 0, "the step's packing bound (0: 4 for text, else 1)")
  vocab = flags.DEFINE_integer("vocab_size", 0, "the vocabulary (0: the config's data would give)")
  flags.mark_flags_as_required(["config", "topology"])

  def run(argv):
    if len(argv) > 1:
      raise cli.UsageError(f"unexpected arguments: {argv[1:]}")
    report = compile_for_topology(config_flag.value, topology.value, segments_per_row=segments.value or None,
                                  vocab=vocab.value or None, hlo_path=hlo.value)
    print(table(report))
    if out.value:
      path = pathlib.Path(out.value)
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(json.dumps(report, indent=2) + "\n")

  cli.run(run, argv=configs.flag_args(sys.argv))


if __name__ == "__main__":
  main()
