"""The training loop: build the mesh, data, model and optimiser from a config; restore the newest checkpoint in
the work directory if there is one; step, log, checkpoint; stop on a non-finite loss or gradient norm, or on a
failed check.

A work directory belongs to one trainer at a time: process 0 holds DIR/lock (`WorkdirLock`) for the whole run, and
a second trainer on the same directory stops with `WorkdirLockedError` naming the holder. DIR/config.json holds
the config of the latest (re)start and DIR/config_history.jsonl one record per (re)start; a resume may change only
the fields of `RESUMABLE` (the run's length and what is logged, checkpointed and shown), and any other change
stops it before a file but the lock is written (ValueError naming every such field, old → new).

The data pipeline checks every batch's token ids on the host (`data.pipeline.check_token_ids`). The step checks
its batch on the device in checked mode (`step.checked_train_step`: token ids, segment ids); those errors are read
without blocking, whenever the loop fetches metrics (logging, before a checkpoint is written) and at the end, so
a failed check stops the run (ValueError naming the step) before a checkpoint holds its result.

Every `eval_every` steps and at the last step (none when 0) the loop evaluates the held-out loss on the same
`eval_batches` batches of the validation split (`eval_batches`, read once before the first step; `evaluate`), with
the step's loss and sharding and no gradient, and logs eval_loss (mean nats per scored token), eval_perplexity
(its exp) and eval_tokens (the scored tokens) on that step's line of metrics.jsonl. An evaluation reads the
parameters only: the training steps are the same with it and without it.

    metrics = osdn_jax.train.train(configs.get_config("tiny"), "/tmp/run")   # the last logged metrics
    result = osdn_jax.train.run(config, workdir)      # also the trained model (result.model)
    result = train_loop(config, setup(config, workdir))   # `run` in its two parts (hold the work directory's lock)
    model, config = osdn_jax.train.load("/tmp/run")   # the newest checkpoint of a work directory
"""
from __future__ import annotations

import dataclasses
import datetime
import fcntl
import json
import math
import os
import pathlib
import socket
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from osdn_jax import checking, models
from osdn_jax import data as data_lib
from osdn_jax.data.pipeline import TokenIdError
from osdn_jax.train import configs, mesh as mesh_lib, optim
from osdn_jax.train.checkpoints import UNVERIFIED, Checkpoints, nonfinite_entry
from osdn_jax.train.metrics import Progress, Writer
from osdn_jax.train.step import (checked_train_step, graphdef, init_state, make_eval_step, make_train_step,
                                 segments_bound)

# Steps whose checks may wait unread; beyond this the oldest are read (long finished: nothing waits in practice).
MAX_UNREAD_CHECKS = 64

CONFIG, CONFIG_HISTORY, LOCK = "config.json", "config_history.jsonl", "lock"
# The config fields a resume may change: `steps` (the schedule is then the new length's) and the fields that
# leave every step's computation as it was: what is logged, checkpointed and shown, and the data's prefetch depth.
RESUMABLE = ("steps", "log_every", "checkpoint_every", "keep_checkpoints", "async_checkpoint", "progress",
             "diagnostics_every", "data.prefetch", "eval_every", "eval_batches")
# The held-out batches' seed (`eval_batches`): one draw for every run of a config whatever its `seed`, so that runs
# of several seeds are evaluated on the same rows (experiments.common.validation_tokens draws with it too).
EVAL_SEED = 12345
_ABSENT = "(absent)"


class NonFiniteError(FloatingPointError):
  """Raised when a logged loss or gradient norm is NaN or ±Inf."""


class WorkdirLockedError(RuntimeError):
  """Raised when another trainer holds the work directory."""


class WorkdirLock:
  """An exclusive hold on a work directory: DIR/lock, locked with flock(2) while held and holding the holder's
  {"host", "pid"}. The kernel releases it when the holding process ends, however it ends; `release` (or leaving
  the `with` block) empties the file and releases it. WorkdirLockedError, naming the directory and the holder,
  when another holds it."""

  def __init__(self, workdir):
    self.workdir = pathlib.Path(workdir)
    self.file = os.fdopen(os.open(self.workdir / LOCK, os.O_RDWR | os.O_CREAT, 0o644), "r+")
    try:
      fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = self._holder()
      self.file.close()
      raise WorkdirLockedError(f"train: {self.workdir} is in use by another trainer ({holder}); wait for it to "
                               "end or use another work directory") from None
    except OSError as e:   # a filesystem without flock (some network filesystems)
      logging.warning("train: cannot lock %s (%s); the directory is not protected from a second trainer",
                      self.workdir / LOCK, e)
    self.file.truncate(0)
    self.file.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}) + "\n")
    self.file.flush()

  def _holder(self) -> str:
    try:
      owner = json.loads(self.file.read())
      return f"host {owner['host']}, pid {owner['pid']}"
    except (ValueError, KeyError, TypeError):
      return "a holder that has not written its host and pid yet"

  def release(self) -> None:
    if not self.file.closed:
      self.file.truncate(0)
      self.file.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.release()


@dataclasses.dataclass
class TrainResult:
  """What `run` returns: the last logged metrics ({"step", "loss", ...}; empty when no step ran), the final
  training state (`step.init_state`'s layout) and the model's config; `model` rebuilds the trained model.
  summary: this (re)start's {"start", "step", "steps", "loss" (the last step's training loss; None when no step
  ran), "eval" (the last evaluation's eval_* metrics, with its "step"; None when none ran), "seconds",
  "eval_seconds", "tokens_per_s" (over the steps, evaluations excluded), "data_wait" (the share of those
  seconds spent waiting for the next host batch), "checkpoint" (the newest one's path; None when none was
  written), "checkpoint_verified" (whether it holds checksums)}; `describe` puts it in words."""
  metrics: dict
  state: dict
  model_config: models.ModelConfig
  summary: dict = dataclasses.field(default_factory=dict)

  @property
  def model(self) -> models.LanguageModel:
    return nnx.merge(graphdef(self.model_config), self.state["params"])


def model_config(config, vocab_size: int) -> models.ModelConfig:
  """The model of a run: `config.model`'s named config with the run's vocabulary, dtype, solve settings and point
  options, and the fields of `config.model_fields` when the config has them (a converted checkpoint's shape:
  d_model, num_layers, heads, gates, ...; `osdn_jax.convert`)."""
  return models.config(config.model, vocab_size=vocab_size, dtype=jnp.dtype(config.dtype),
                       chunk_size=config.chunk_size, implementation=config.implementation, remat=config.remat,
                       scan_layers=config.get("scan_layers", True),
                       point_options=tuple(dict(config.get("point_options", {})).items()),
                       **models.structure_fields(config.get("model_fields", {})))


def _data_shard(config, mesh) -> tuple[int, int, int]:
  """(index, count, rows): this process's shard of the global batch's rows among the distinct sets of rows the
  processes hold (`data.make_pipeline`'s process_index and process_count for the held-out batches) and the number
  of rows it holds. Processes holding the same rows (the batch whole over an axis split across processes: tensor,
  context) have the same shard, the others disjoint ones."""
  shape = (config.batch_size, config.seq_len)
  held = {}
  for device, index in mesh_lib.batch_sharding(mesh).devices_indices_map(shape).items():
    held.setdefault(device.process_index, set()).add(index[0].indices(shape[0])[:2])
  if jax.process_index() not in held:
    raise ValueError(f"train: process {jax.process_index()} holds none of the mesh's devices")
  shards = sorted({tuple(sorted(spans)) for spans in held.values()})
  mine = tuple(sorted(held[jax.process_index()]))
  return shards.index(mine), len(shards), sum(stop - start for start, stop in mine)


def _batch_rows(config, mesh) -> list[int]:
  """The rows of every global batch that this process's devices hold, in order: the rows it reads
  (`data.make_pipeline`'s rows) and that `global_batch` places."""
  shape = (config.batch_size, config.seq_len)
  rows = set()
  for device, index in mesh_lib.batch_sharding(mesh).devices_indices_map(shape).items():
    if device.process_index == jax.process_index():
      rows.update(range(*index[0].indices(shape[0])[:2]))
  if not rows:
    raise ValueError(f"train: process {jax.process_index()} holds none of the mesh's devices")
  return sorted(rows)


def rows_per_process(config, mesh) -> int:
  """The rows of the global batch this process holds on `mesh`; ValueError unless batch_size divides over the
  mesh's batch axes."""
  split = math.prod(mesh.shape[a] for a in mesh_lib.BATCH)
  if config.batch_size % split:
    raise ValueError(f"train config: `batch_size` ({config.batch_size}) must be a multiple of the mesh's "
                     f"data × fsdp size ({split})")
  if (config.batch_size // config.grad_accum) % split:
    raise ValueError(f"train config: the microbatch (`batch_size` / `grad_accum` = "
                     f"{config.batch_size // config.grad_accum} rows) must be a multiple of the mesh's "
                     f"data × fsdp size ({split})")
  return _data_shard(config, mesh)[2]


def _throw_failed_checks(unread: list, keep: int = 0) -> None:
  """ValueError "step s: <message>" for the first failed check of unread [(step, checkify.Error)], read oldest
  first until `keep` remain."""
  while len(unread) > keep:
    step, error = unread.pop(0)
    try:
      checking.throw(error)
    except ValueError as e:
      raise ValueError(f"step {step}: {e}") from None


def global_batch(batch: dict, sharding, global_shape=None) -> dict:
  """The global batch from this process's rows (`_batch_rows`); global_shape: [B, T] of every array (needed
  when an axis split across processes splits the positions)."""
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v), global_shape) for k, v in batch.items()}


def shard_state(abstract, mesh):
  """The training state's shardings on `mesh` (parameters and optimiser state by `mesh.param_shardings`, the step
  and the key replicated) for a state shaped like `abstract`."""
  params_sh = mesh_lib.param_shardings(abstract["params"], mesh)
  replicated = NamedSharding(mesh, P())
  return {"step": replicated, "params": params_sh,
          "opt_state": mesh_lib.like_params(abstract["opt_state"], abstract["params"], params_sh, mesh),
          "rng": replicated}


def _good_words(last_good) -> str:
  """The last good checkpoint (step, path, verified) in words: "checkpoint 4 (DIR/checkpoints/4)", with
  ", unverified: ..." when it holds no checksums, or "none (no checkpoint was written)"."""
  if not last_good:
    return "none (no checkpoint was written)"
  step, path, verified = last_good
  return f"checkpoint {step} ({path}{'' if verified else ', ' + UNVERIFIED})"


def _check_finite(step: int, values: dict, last_good) -> None:
  for name in ("loss", "grad_norm"):
    v = float(values[name])
    if not math.isfinite(v):
      raise NonFiniteError(f"training stopped at step {step}: `{name}` is {v}; the last good checkpoint is "
                           f"{_good_words(last_good)}")


def check_state_finite(step: int, state, last_good) -> None:
  """NonFiniteError naming the first parameter or optimiser entry of `state` that holds a NaN or ±Inf, before it
  is saved: a checkpoint only ever holds a finite state."""
  if entry := nonfinite_entry(state):
    raise NonFiniteError(f"training stopped at step {step}: the state's `{entry}` holds non-finite values, so it "
                         f"is not saved; the last good checkpoint is {_good_words(last_good)}")


def _peak_memory_gb():
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None


def _lock_workdir(workdir: pathlib.Path) -> WorkdirLock | None:
  """Process 0's `WorkdirLock` on workdir (None on the other processes, which write no file); every process
  raises WorkdirLockedError when process 0 cannot take it."""
  lock = error = None
  if jax.process_index() == 0:
    try:
      lock = WorkdirLock(workdir)
    except WorkdirLockedError as e:
      error = e
  if jax.process_count() > 1 and multihost_utils.broadcast_one_to_all(np.int32(error is not None)):
    error = error or WorkdirLockedError(f"train: {workdir} is in use by another trainer (process 0 names it)")
  if error is not None:
    raise error
  return lock


def _flat(tree: dict, prefix: str = "") -> dict:
  """{"a.b": leaf} of a nested dict (an empty dict adds nothing)."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def _record(config) -> dict:
  """The config as config.json holds it (JSON types)."""
  return json.loads(json.dumps(config.to_dict(), sort_keys=True))


def config_changes(old: dict, new: dict) -> dict:
  """{"field.sub": (old value, new value)} of the fields whose values differ between two configs as config.json
  holds them ("(absent)" for a field one of them lacks)."""
  a, b = _flat(old), _flat(new)
  return {k: (a.get(k, _ABSENT), b.get(k, _ABSENT)) for k in sorted(a.keys() | b.keys())
          if a.get(k, _ABSENT) != b.get(k, _ABSENT)}


def _describe(changes: dict) -> str:
  show = lambda v: v if v is _ABSENT else repr(v)
  return ", ".join(f"`{k}` {show(old)} → {show(new)}" for k, (old, new) in changes.items())


def _latest_config(workdir: pathlib.Path) -> dict | None:
  """The config of the work directory's latest (re)start: config.json, or when it is missing the last record of
  config_history.jsonl (with a warning); None when it has neither."""
  path = workdir / CONFIG
  if not path.is_file():
    record = _last_record(workdir / CONFIG_HISTORY)
    if record is not None:
      logging.warning("train: %s is missing; the run's settings are those of the last record of %s", path,
                      workdir / CONFIG_HISTORY)
    return record
  try:
    return json.loads(path.read_text())
  except ValueError as e:
    raise ValueError(f"train: {path} is not the JSON of a config ({e}); use a new work directory") from None


def _last_record(path: pathlib.Path) -> dict | None:
  """The config of config_history.jsonl's last record (a torn last line, cut by a kill mid-write, skipped), or None
  when it holds none; ValueError naming the file and the line when another line is not a record."""
  if not path.is_file():
    return None
  lines = path.read_text().splitlines()
  last = None
  for number, line in enumerate(lines, 1):
    try:
      config = json.loads(line)["config"]
      if not isinstance(config, dict):
        raise TypeError
      last = config
    except (ValueError, KeyError, TypeError):
      if number < len(lines):
        raise ValueError(f"train: {path}, line {number}: not a record {{\"time\", \"start\", \"config\"}}"
                         ) from None
  return last


def _restore(ckpt: Checkpoints, config, workdir: pathlib.Path, abstract, pipeline=None):
  """`Checkpoints.restore_latest` of a (re)start of `config`, refusing a resume that changes a field not in
  RESUMABLE from the latest (re)start's config: RuntimeError naming those fields when no checkpoint fits the
  state (another model, say), ValueError naming them when one was restored. With `pipeline`, sets it to the
  restored data position (`_resume_data`). Writes nothing until the resume is accepted; then moves the damaged
  checkpoints aside (`Checkpoints.set_aside`)."""
  previous = _latest_config(workdir)
  if previous is None and ckpt.manager.all_steps():
    raise ValueError(f"train: {workdir} holds checkpoints but neither {CONFIG} nor {CONFIG_HISTORY}: the settings "
                     "they were trained with are unknown; put one of those files back or use a new work directory")
  defaults = _flat(configs.base().to_dict())
  # A field the run's config lacks (one the trainer gained since) at its default is the run's behaviour.
  added = lambda k, v: v[0] is _ABSENT and k in defaults and defaults[k] == v[1]
  refused = {} if previous is None else {
      k: v for k, v in config_changes(previous, _record(config)).items() if k not in RESUMABLE and not added(k, v)}
  try:
    restored = ckpt.restore_latest(abstract)
  except RuntimeError as e:
    if refused:
      raise RuntimeError(f"{e}; this config changes {_describe(refused)}") from None
    raise
  if restored is not None and refused:
    raise ValueError(f"train: {workdir} holds a run that this config would resume from checkpoint {restored[0]}, "
                     f"but it changes {_describe(refused)}; a resume may change only "
                     f"{', '.join(f'`{k}`' for k in RESUMABLE)}. Rerun with the run's settings (config.json) or "
                     "use a new work directory")
  if restored is not None and pipeline is not None:
    _resume_data(pipeline, restored.data_state, restored.step, workdir)
  ckpt.set_aside()
  return restored


def _resume_data(pipeline, position: dict, step: int, workdir: pathlib.Path) -> None:
  """Sets the training pipeline to checkpoint `step`'s data position. The position names no process (the global
  batches consumed and the global stream's state), so a run resumes on any number of processes; the pipeline
  checks its signature (the source, seq_len, the global batch size, the seed, ...). ValueError naming the
  checkpoint when the position is another pipeline's or does not stand after `step` global batches."""
  where = f"train: checkpoint {step} in {workdir / 'checkpoints'}"
  try:
    pipeline.set_state(position)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None
  if position.get("batches") != step:
    raise ValueError(f"{where}: its data position stands after {position.get('batches')!r} global batches, "
                     f"not {step}")


def _drop_torn_line(path: pathlib.Path) -> None:
  """Cuts a last line that does not end in a newline (a kill mid-append) off `path`, with a warning."""
  if not path.is_file():
    return
  with path.open("rb+") as f:
    data = f.read()
    if data and not data.endswith(b"\n"):
      keep = data.rfind(b"\n") + 1
      logging.warning("%s: dropped a torn last line %r", path, data[keep:keep + 80])
      f.truncate(keep)


def _record_config(workdir: pathlib.Path, config, start: int) -> None:
  """Appends this (re)start's record {"time", "start", "config"} to config_history.jsonl (after dropping a torn
  last line) and makes config.json its config (written whole, then renamed over the old one). start: the step it
  resumed from (0: afresh)."""
  record = _record(config)
  stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  _drop_torn_line(workdir / CONFIG_HISTORY)
  with (workdir / CONFIG_HISTORY).open("a") as f:
    f.write(json.dumps({"time": stamp, "start": start, "config": record}, sort_keys=True) + "\n")
  part = workdir / f"{CONFIG}.part"
  part.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
  os.replace(part, workdir / CONFIG)


def perplexity(loss: float) -> float:
  """exp(loss), inf where that overflows."""
  return math.exp(loss) if loss < 700 else math.inf


def eval_batches(config, *, rows: int, shard: int = 0, shards: int = 1, data=None, count: int | None = None,
                 vocab_size: int | None = None) -> list[tuple[dict, int]]:
  """The held-out batches of a run of `config`: [(batch, segments bound)] of `count` (`config.eval_batches`) global
  batches of `rows` × `shards` rows, this process's `rows` of each (its shard `shard` of `shards`, `_data_shard`),
  each with its `step.segments_bound` (the largest of every process's). The same batches at every call: the validation
  split of the run's data (text: the corpus's validation blocks; tokens: the prepared validation split), or of
  prepared token shards `data` (a directory), shuffled with EVAL_SEED. random, mqar and passkey have no validation
  split: their held-out batches are the same source drawn with seed EVAL_SEED (EVAL_SEED + 1 for a run whose seed is
  EVAL_SEED), other rows than the training ones. ValueError when the split cannot be read or (`vocab_size`) its
  vocabulary differs."""
  data_cfg = dict(config.data) if data is None else dict(source="tokens", path=str(data))
  data_cfg.update(split="validation", prefetch=0)
  seed = EVAL_SEED
  if data_cfg.get("source", "text") not in ("text", "tokens") and config.seed == EVAL_SEED:
    seed = EVAL_SEED + 1
  count = config.get("eval_batches", 8) if count is None else count
  try:
    pipeline = data_lib.make_pipeline(data_cfg, seq_len=config.seq_len, batch_size=rows * shards, seed=seed,
                                      process_index=shard, process_count=shards)
  except (ValueError, FileNotFoundError) as e:
    where = "the run's data" if data is None else str(data)
    raise ValueError(f"evaluation: cannot read the validation split of {where}: {e}") from None
  try:
    if vocab_size is not None and pipeline.vocab_size != vocab_size:
      raise ValueError(f"evaluation: the validation data's vocabulary ({pipeline.vocab_size}) is not the model's "
                       f"({vocab_size})")
    batches = []
    for _ in range(count):
      batch = next(pipeline)
      bound = segments_bound(batch["segment_ids"])
      if jax.process_count() > 1:   # one program everywhere: the largest bound of all processes
        bound = int(np.max(multihost_utils.process_allgather(np.asarray(bound))))
      batches.append((batch, bound))
  finally:
    pipeline.close()
  return batches


def evaluate(eval_fn, params, batches, put=lambda batch: batch) -> dict:
  """{"eval_loss": Σ −log p / scored tokens over all of `batches` (`eval_batches`), "eval_perplexity",
  "eval_tokens"}; eval_fn: a jitted `step.make_eval_step`, put: a host batch → eval_fn's batch (the global one)."""
  outs = [eval_fn(params, put(batch), bound) for batch, bound in batches]
  total = count = 0.0
  for t, n in jax.device_get(outs):
    total, count = total + float(t), count + float(n)
  loss = total / max(count, 1.0)
  return {"eval_loss": loss, "eval_perplexity": perplexity(loss), "eval_tokens": count}


def describe(summary: dict, workdir) -> str:
  """A run's `TrainResult.summary` in two lines: its steps, final training loss, held-out loss, tokens/s; where
  its checkpoints, metrics and events are."""
  workdir = pathlib.Path(workdir)
  s = summary
  if s["step"] <= s["start"]:
    head = f"train: nothing to run: {workdir} is at step {s['start']} of {s['steps']}"
  else:
    excluded = f", evaluations ({s['eval_seconds']:.1f} s) excluded" if s["eval_seconds"] else ""
    head = (f"train: steps {s['start'] + 1}-{s['step']} of {s['steps']} in {s['seconds']:.1f} s "
            f"({s['tokens_per_s']:,.0f} tokens/s{excluded}, {100 * s.get('data_wait', 0.0):.1f} % waiting for "
            f"data); final training loss {s['loss']:.4f}")
    if s.get("eval"):
      e = s["eval"]
      head += (f"; held-out loss {e['eval_loss']:.4f}, perplexity {e['eval_perplexity']:.4g} (step {e['step']}, "
               f"{e['eval_tokens']:,.0f} tokens)")
  checkpoint = s.get("checkpoint") or f"none in {workdir / 'checkpoints'}"
  if s.get("checkpoint") and not s.get("checkpoint_verified", True):
    checkpoint += f" ({UNVERIFIED})"
  return (f"{head}\ncheckpoint: {checkpoint}; metrics: {workdir / 'metrics.jsonl'}; TensorBoard: "
          f"{workdir / 'tensorboard'}")


def train(config, workdir) -> dict:
  """Runs (or resumes) the run described by `config` in `workdir`; returns the last logged metrics."""
  return run(config, workdir).metrics


def load(workdir, *, step: int | None = None):
  """(model, config) of a work directory: its config.json (the latest (re)start's config) and its newest
  checkpoint that passes its checksums (or checkpoint `step`), on the default device. FileNotFoundError when the
  directory holds no run or no checkpoint. Reads only: a trainer may be running in the directory."""
  return load_checkpoint(workdir, step=step)[:2]


def load_checkpoint(workdir, *, step: int | None = None):
  """`load`, with the step of the checkpoint it read: (model, config, step)."""
  workdir = pathlib.Path(workdir)
  config = _latest_config(workdir)
  if config is None:
    raise FileNotFoundError(f"train.load: no {CONFIG} in {workdir} (not a training work directory)")
  config = configs.ml_collections.ConfigDict(config)
  pipeline = data_lib.make_pipeline(dict(config.data, prefetch=0), seq_len=config.seq_len, batch_size=1,
                                    seed=config.seed)
  pipeline.close()
  cfg = model_config(config, pipeline.vocab_size)
  tx = optim.make(config.optimizer, config.steps)
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                          jax.eval_shape(lambda: init_state(cfg, tx, config.seed)))
  if not (workdir / "checkpoints").is_dir():
    raise FileNotFoundError(f"train.load: no checkpoint in {workdir / 'checkpoints'}")
  ckpt = Checkpoints((workdir / "checkpoints").absolute(), keep=config.keep_checkpoints, async_save=False,
                     read_only=True)
  try:
    restored = ckpt.restore_latest(abstract, step=step)
  finally:
    ckpt.close()
  if restored is None:
    raise FileNotFoundError(f"train.load: no checkpoint{'' if step is None else f' {step}'} in "
                            f"{workdir / 'checkpoints'}")
  return nnx.merge(graphdef(cfg), restored[1]["params"]), config, restored[0]


def run(config, workdir) -> TrainResult:
  """`train`, returning the final state and the model's config with the metrics (`TrainResult`)."""
  configs.validate(config)
  workdir = pathlib.Path(workdir)
  try:
    workdir.mkdir(parents=True, exist_ok=True)
  except (FileExistsError, NotADirectoryError):
    raise NotADirectoryError(f"train: the work directory {workdir} is a file (or lies under one); name a directory"
                             ) from None
  lock = _lock_workdir(workdir)
  try:
    return _run_holding(config, workdir)
  finally:
    if lock is not None:
      lock.release()


def _run_holding(config, workdir: pathlib.Path) -> TrainResult:
  """`run` in a work directory this run holds: `setup`, then `train_loop`."""
  return train_loop(config, setup(config, workdir))


@dataclasses.dataclass
class TrainSetup:
  """Everything the loop steps with, built by `setup`: the mesh, the rows per process, the data pipeline (at the
  restored position), the model's config, the held-out batches, the state (restored or fresh) and the step it is
  at, the newest good checkpoint ((step, path, whether it holds checksums) or None), the checkpoint manager, the jitted train, eval and
  diagnostics functions and the host → device batch placement."""
  workdir: pathlib.Path
  mesh: object
  rows: int
  pipeline: object
  model_config: models.ModelConfig
  held_out: list
  state: dict
  start: int
  last_good: tuple | None
  ckpt: Checkpoints
  batch_sharding: object
  step_fn: object
  eval_fn: object
  diag_fn: object

  def put(self, host: dict, config) -> dict:
    return global_batch(host, self.batch_sharding, (config.batch_size, config.seq_len))

  def close(self) -> None:
    self.ckpt.close()
    self.pipeline.close()


def setup(config, workdir: pathlib.Path) -> TrainSetup:
  """Builds the run's mesh, data, model, optimiser and step functions, and restores the newest good checkpoint of
  `workdir` (refusing a resume that changes a field outside `RESUMABLE`); process 0 records the config."""
  lead = jax.process_index() == 0
  mesh = mesh_lib.make_mesh(config.mesh)
  rows = rows_per_process(config, mesh)
  shard, shards, _ = _data_shard(config, mesh)
  pipeline = data_lib.make_pipeline(config.data, seq_len=config.seq_len, batch_size=config.batch_size,
                                    seed=config.seed, rows=_batch_rows(config, mesh))
  cfg = model_config(config, pipeline.vocab_size)
  mesh_lib.check_tensor_axis(cfg, mesh)
  mesh_lib.check_length(config.seq_len, mesh)
  try:
    held_out = eval_batches(config, rows=rows, shard=shard, shards=shards, vocab_size=cfg.vocab_size) \
        if config.get("eval_every", 0) else []
  except ValueError as e:
    pipeline.close()
    raise ValueError(f"train: {e}; `eval_every` = 0 trains without evaluation") from None
  tx = optim.make(config.optimizer, config.steps)
  schedule = optim.schedule(config.optimizer, config.steps)

  abstract = jax.eval_shape(lambda: init_state(cfg, tx, config.seed))
  state_sh = shard_state(abstract, mesh)
  ckpt = Checkpoints((workdir / "checkpoints").absolute(), keep=config.keep_checkpoints,
                     async_save=config.async_checkpoint)
  try:
    restored = _restore(ckpt, config, workdir, jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_sh), pipeline)
  except BaseException:
    ckpt.close()
    pipeline.close()
    raise
  if lead:
    _record_config(workdir, config, restored[0] if restored else 0)
  if restored is None:
    state = jax.jit(lambda: init_state(cfg, tx, config.seed), out_shardings=state_sh)()
    start = 0
  else:
    start, state = restored.step, restored.state   # the pipeline stands at the restored position (`_restore`)
    logging.info("resumed from checkpoint %d%s in %s%s", start, "" if restored.verified else f" ({UNVERIFIED})",
                 workdir / "checkpoints", "; the run is already complete" if start >= config.steps else "")
  last_good = (start, str(workdir / "checkpoints" / str(start)), restored.verified) if restored else None

  graph = graphdef(cfg)
  batch_sh = mesh_lib.batch_sharding(mesh)
  train_step = make_train_step(graph, tx, grad_accum=config.grad_accum, loss_chunk=config.loss_chunk,
                               schedule=schedule, loss_positions=config.get("loss_positions", 0))
  step_fn = jax.jit(checked_train_step(train_step, cfg.vocab_size), in_shardings=(state_sh, batch_sh),
                    out_shardings=(NamedSharding(mesh, P()), (state_sh, None)), donate_argnums=0,
                    static_argnums=2)
  diag_fn = jax.jit(lambda params, tokens: nnx.merge(graph, params).diagnostics(tokens))
  eval_fn = jax.jit(make_eval_step(graph, grad_accum=config.grad_accum, loss_chunk=config.loss_chunk,
                                   loss_positions=config.get("loss_positions", 0)),
                    in_shardings=(state_sh["params"], batch_sh), out_shardings=NamedSharding(mesh, P()),
                    static_argnums=2)
  if lead:
    logging.info("model %s: %s parameters; mesh %s; %d × %d tokens per step", config.model,
                 f"{models.count_params(cfg):,}", dict(mesh.shape), config.batch_size, config.seq_len)
  return TrainSetup(workdir=workdir, mesh=mesh, rows=rows, pipeline=pipeline, model_config=cfg, held_out=held_out,
                    state=state, start=start, last_good=last_good, ckpt=ckpt, batch_sharding=batch_sh,
                    step_fn=step_fn, eval_fn=eval_fn, diag_fn=diag_fn)


def train_loop(config, run: TrainSetup) -> TrainResult:
  """Steps from `run.start` to `config.steps`: logs, evaluates and checkpoints at their cadences, stops on a failed
  check or a non-finite loss, gradient norm or state; closes the pipeline and the checkpoints at the end."""
  lead = jax.process_index() == 0
  workdir, mesh, pipeline, ckpt = run.workdir, run.mesh, run.pipeline, run.ckpt
  state, start, last_good, cfg = run.state, run.start, run.last_good, run.model_config
  run.state = None     # donated to the first step
  eval_every = config.get("eval_every", 0)
  put = lambda host: run.put(host, config)
  writer = Writer(workdir, enabled=lead, resume_step=start)
  progress = Progress(total=config.steps, initial=start, enabled=lead and config.progress)
  tokens_per_step = config.batch_size * config.seq_len
  last, t0, since, waited = {}, time.perf_counter(), 0, 0.0
  began, eval_seconds, evaluated, metrics, waited_all = t0, 0.0, None, None, 0.0
  unread = []        # [(step, checkify.Error)] of the steps whose checks are not read yet
  try:
    for step in range(start + 1, config.steps + 1):
      try:
        t_data = time.perf_counter()
        host = next(pipeline)
        took_data = time.perf_counter() - t_data
        waited, waited_all = waited + took_data, waited_all + took_data
      except TokenIdError as e:
        raise TokenIdError(e.name, e.row, e.position, e.value, e.vocab_size, where=f"step {step}") from None
      bound = segments_bound(host["segment_ids"])
      if jax.process_count() > 1:   # one program everywhere: the largest bound of all processes
        bound = int(np.max(multihost_utils.process_allgather(np.asarray(bound))))
      batch = put(host)
      with jax.set_mesh(mesh):
        error, (state, metrics) = run.step_fn(state, batch, bound)
      unread.append((step, error))
      _throw_failed_checks(unread, keep=MAX_UNREAD_CHECKS)
      since += 1
      diagnose = config.diagnostics_every and step % config.diagnostics_every == 0
      log = diagnose or (config.log_every and (step % config.log_every == 0 or step == config.steps))
      save = config.checkpoint_every and (step % config.checkpoint_every == 0 or step == config.steps)
      if log or save:
        values = jax.device_get(metrics)
        _throw_failed_checks(unread)
        _check_finite(step, values, last_good)
      row = {}
      if log:
        elapsed = time.perf_counter() - t0
        row = {"loss": float(values["loss"]), "grad_norm": float(values["grad_norm"]), "lr": float(values["lr"]),
               "tokens_per_s": since * tokens_per_step / elapsed, "step_time_s": elapsed / since,
               "data_wait": waited / elapsed}
        if (peak := _peak_memory_gb()) is not None:
          row["peak_memory_gb"] = peak
        if diagnose:
          with jax.set_mesh(mesh):
            diag = jax.device_get(run.diag_fn(state["params"], batch["tokens"][:min(run.rows, 4)]))
          row.update({k: list(v) for k, v in diag.items()})
      if eval_every and (step % eval_every == 0 or step == config.steps):
        t = time.perf_counter()
        with jax.set_mesh(mesh):
          row.update(evaluate(run.eval_fn, state["params"], run.held_out, put))
        evaluated = {"step": step, **{k: v for k, v in row.items() if k.startswith("eval_")}}
        took = time.perf_counter() - t
        eval_seconds += took
        if not log:
          t0 += took     # the throughput window leaves the evaluation out
      if row:
        writer.write(step, row)
        last = {"step": step, **row}
      if log:
        postfix = {"eval": f"{row['eval_loss']:.4f}"} if "eval_loss" in row else {}
        progress.update(since, loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:,.0f}", **postfix)
        t0, since, waited = time.perf_counter(), 0, 0.0
      if save:
        check_state_finite(step, state, last_good)
        ckpt.save(step, state, pipeline.get_state())
        last_good = (step, str(workdir / "checkpoints" / str(step)), True)
    _throw_failed_checks(unread)
    ckpt.wait()
  finally:
    progress.close()
    writer.close()
    ckpt.close()
    pipeline.close()
  end = max(start, config.steps)
  seconds = time.perf_counter() - began
  summary = {"start": start, "step": end, "steps": config.steps, "eval": evaluated, "seconds": seconds,
             "eval_seconds": eval_seconds, "checkpoint": last_good[1] if last_good else None,
             "checkpoint_verified": bool(last_good and last_good[2]),
             "loss": None if metrics is None else float(jax.device_get(metrics["loss"])),
             "tokens_per_s": (end - start) * tokens_per_step / max(seconds - eval_seconds, 1e-9),
             "data_wait": waited_all / max(seconds - eval_seconds, 1e-9)}
  return TrainResult(metrics=last, state=state, model_config=cfg, summary=summary)
