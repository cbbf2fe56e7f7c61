"""FLA / Hugging Face checkpoints in and out: DeltaNet, Gated DeltaNet, KDA, PGDN and PKDA.

    from osdn_jax import convert
    model = convert.load_fla("path/to/fla-checkpoint")             # a models.LanguageModel with its weights
    convert.fla_to_run("path/to/fla-checkpoint", "runs/fla-gdn")    # a work directory train.load and eval read
    convert.save_fla(model, "out/fla")                              # config.json + model.safetensors for FLA
    convert.run_to_fla("runs/pgdn", "out/fla-pgdn")                 # a run's newest checkpoint, likewise

or on the command line (`osdn_jax.convert.__main__`):

    python -m osdn_jax.convert --fla=path/to/fla-checkpoint --workdir=runs/fla-gdn [--data=TOKENS]
    python -m osdn_jax.convert --workdir=runs/pgdn --to_fla=out/fla-pgdn

A checkpoint directory holds config.json and model.safetensors, or shards listed by model.safetensors.index.json
(read with `safetensors`' numpy API; torch is never needed). Every config field maps, is known to leave the
function unchanged, or is refused by name (`fla_config`); every tensor maps, and one that no parameter takes is an
error (`fla_tensors`). Parameters are fp32 here whatever the file's dtype; out of here they are written in fp32
(exactly) or bf16.
"""
from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from osdn_jax import models
from osdn_jax.convert import fla_config, fla_tensors, safetensors_io
from osdn_jax.convert.fla_config import FAMILIES, Unsupported

CONFIG = "config.json"
TRAIN_CONFIG = "train_config.py"
# The trainer's --config for a converted run: the run's own config.json (the trainer's --config flag cannot add
# `model_fields`), so that `python -m osdn_jax.train --config=RUN/train_config.py --workdir=RUN` resumes it.
_TRAIN_CONFIG_TEXT = '''"""This run's config for the trainer (a converted checkpoint: its config.json, as converted):
python -m osdn_jax.train --config=<this file> --workdir=<this directory>"""
import json
import pathlib

import ml_collections


def get_config():
  return ml_collections.ConfigDict(json.loads((pathlib.Path(__file__).parent / "config.json").read_text()))
'''

__all__ = ["FAMILIES", "Unsupported", "build", "fla_to_run", "load_fla", "model_params", "read_fla", "run_to_fla",
           "save_fla", "write_fla"]


def _read_config(directory: pathlib.Path) -> dict:
  path = directory / CONFIG
  if not path.is_file():
    raise FileNotFoundError(f"convert: no {CONFIG} in {directory} (an FLA / Hugging Face checkpoint directory)")
  try:
    config = json.loads(path.read_text())
  except ValueError as e:
    raise ValueError(f"convert: {path} is not JSON ({e})") from None
  if not isinstance(config, dict):
    raise ValueError(f"convert: {path} holds no JSON object")
  return config


def read_fla(directory, **overrides) -> tuple[models.ModelConfig, dict]:
  """(model config, parameter tree of fp32 numpy arrays) of the FLA checkpoint in `directory`. overrides: the
  config's run-time fields (dtype, implementation, chunk_size, remat, scan_layers). Unsupported (a ValueError)
  naming the config field or tensor it cannot take."""
  directory = pathlib.Path(directory)
  config = _read_config(directory)
  family = fla_config.family_of(config)
  point, fields, options = fla_config.from_fla(config)
  bad = sorted(set(overrides) & set(models.STRUCTURE_FIELDS + ("variant", "vocab_size", "point_options")))
  if bad:
    raise ValueError(f"convert: {bad} are the checkpoint's, not overridable")
  cfg = models.ModelConfig(variant=point, vocab_size=int(config["vocab_size"]), point_options=tuple(options.items()),
                           name=f"fla-{family}", **fields, **overrides)
  return cfg, fla_tensors.fla_to_params(family, cfg, safetensors_io.read_tensors(directory))


def build(cfg: models.ModelConfig, params: dict) -> models.LanguageModel:
  """A LanguageModel of `cfg` holding `params` (a tree as `read_fla` returns; nothing random is drawn)."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: models.LanguageModel(cfg, rngs=nnx.Rngs(0))))
  params_state = nnx.state(nnx.merge(graphdef, state), nnx.Param)
  nnx.replace_by_pure_dict(params_state, jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params))
  model = nnx.merge(graphdef, state)
  nnx.update(model, params_state)
  return model


def load_fla(directory, **overrides) -> models.LanguageModel:
  """The FLA checkpoint in `directory` as a LanguageModel (`read_fla`'s overrides, e.g. dtype=jnp.bfloat16)."""
  return build(*read_fla(directory, **overrides))


def model_params(model: models.LanguageModel) -> dict:
  """A model's parameters as a tree of numpy arrays (the layout `read_fla` returns)."""
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def write_fla(cfg: models.ModelConfig, params: dict, directory, *, dtype: str = "float32",
              max_shard_bytes: int | None = None) -> pathlib.Path:
  """Writes config.json and the safetensors (sharded above max_shard_bytes) FLA's from_pretrained reads, tensors
  in `dtype` ("float32": exactly ours; "bfloat16": rounded to nearest). Unsupported naming what FLA cannot
  express."""
  dtypes = {"float32": np.float32, "bfloat16": jnp.bfloat16}
  if dtype not in dtypes:
    raise ValueError(f"convert: `dtype` must be one of {', '.join(dtypes)}, got {dtype!r}")
  config = fla_config.to_fla(cfg)
  config["torch_dtype"] = dtype
  tensors = fla_tensors.params_to_fla(config["model_type"], cfg, params, dtype=dtypes[dtype])
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  for old in [*directory.glob("*.safetensors"), directory / safetensors_io.INDEX]:
    if old.is_file():
      old.unlink()
  safetensors_io.write_tensors(directory, tensors, max_shard_bytes=max_shard_bytes)
  (directory / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
  return directory


def save_fla(model: models.LanguageModel, directory, **kwargs) -> pathlib.Path:
  """`write_fla` of a LanguageModel."""
  return write_fla(model.cfg, model_params(model), directory, **kwargs)


def fla_to_run(fla_dir, workdir, *, data=None, config: str = "340m", seq_len: int | None = None,
               batch_size: int | None = None, dtype: str | None = None) -> pathlib.Path:
  """A trainer's work directory holding the FLA checkpoint as its step-0 checkpoint (`train.load`,
  `osdn_jax.eval`, `osdn_jax.harness` and the trainer read it).

  config: the named training config the run's settings start from (`train.configs.CONFIGS`: optimiser, remat,
  cadence); seq_len, batch_size, dtype (the compute dtype, float32 | bfloat16): that config's unless given. data:
  None (the run's data is random tokens of the model's vocabulary; evaluate with `eval --data=DIR`), or a directory
  of prepared token shards (`python -m osdn_jax.data.prepare` with the checkpoint's tokenizer; its vocabulary must
  be the model's): then `eval`, the harness and the trainer read it and its tokenizer. The optimiser state is fresh
  (step 0). `workdir`/train_config.py is the run's config for the trainer (`python -m osdn_jax.train
  --config=RUN/train_config.py --workdir=RUN --config.steps=N` trains on from it; a resume changes only the run's
  length and cadence, so choose the rest here). FileExistsError when `workdir` already holds a run."""
  from osdn_jax.data import make_pipeline
  from osdn_jax.train import configs, loop, optim
  from osdn_jax.train.checkpoints import Checkpoints

  cfg, params = read_fla(fla_dir)
  workdir = pathlib.Path(workdir)
  if (workdir / loop.CONFIG).exists() or (workdir / "checkpoints").exists():
    raise FileExistsError(f"convert: {workdir} already holds a run; name a new work directory")
  c = configs.get_config(config)
  c.model = f"{cfg.variant}-tiny"
  c.model_fields = {f: getattr(cfg, f) for f in models.STRUCTURE_FIELDS}
  c.point_options = dict(cfg.point_options)
  for name, value in (("dtype", dtype), ("seq_len", seq_len), ("batch_size", batch_size)):
    if value is not None:
      c[name] = value
  c.data = configs.base().data
  c.data.prefetch = 0
  if data is None:
    c.data.source, c.data.vocab_size = "random", cfg.vocab_size
  else:
    c.data.source, c.data.path = "tokens", str(data)
  configs.validate(c)
  pipeline = make_pipeline(dict(c.data), seq_len=c.seq_len, batch_size=c.batch_size, seed=c.seed)
  try:
    if pipeline.vocab_size != cfg.vocab_size:
      raise ValueError(f"convert: the data in {data} has vocabulary {pipeline.vocab_size}, the checkpoint "
                       f"{cfg.vocab_size} (prepare it with the checkpoint's tokenizer)")
    data_state = pipeline.get_state()
  finally:
    pipeline.close()
  structure = lambda m: {f: getattr(m, f) for f in ("variant", "vocab_size", "point_options", *models.STRUCTURE_FIELDS)}
  if structure(loop.model_config(c, cfg.vocab_size)) != structure(cfg):
    raise AssertionError("convert: the run's model config differs from the checkpoint's")
  tx = optim.make(c.optimizer, c.steps)
  tree = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
  state = {"step": jnp.zeros((), jnp.int32), "params": tree, "opt_state": tx.init(tree),
           "rng": jax.random.key_data(jax.random.key(c.seed))}
  workdir.mkdir(parents=True, exist_ok=True)
  loop._record_config(workdir, c, 0)   # config.json and its history, as a trainer's start
  (workdir / TRAIN_CONFIG).write_text(_TRAIN_CONFIG_TEXT)
  ckpt = Checkpoints((workdir / "checkpoints").absolute(), keep=c.keep_checkpoints, async_save=False)
  try:
    ckpt.save(0, state, data_state)
  finally:
    ckpt.close()
  return workdir


def run_to_fla(workdir, fla_dir, *, step: int | None = None, **kwargs) -> pathlib.Path:
  """The newest checkpoint of the run in `workdir` (or checkpoint `step`) as an FLA checkpoint (`write_fla`'s
  kwargs)."""
  from osdn_jax.train import loop
  model, _, _ = loop.load_checkpoint(workdir, step=step)
  return save_fla(model, fla_dir, **kwargs)
