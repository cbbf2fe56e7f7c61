"""Named training configurations (`ml_collections.ConfigDict`) and their validation.

    python -m osdn_jax.train --config=tiny --workdir=/tmp/run --config.steps=200 --config.model=pgdn-tiny

`get_config(name)` is the file's ml_collections entry point (`--config=osdn_jax/train/configs.py:340m` works
too). Names: tiny (CPU, bytes of the text corpus, about a minute), 340m and 1.3b (the paper's recipes: 2048
tokens per row, 16 rows per GPU for 340M, BPE 32000), each with any registry point through `model`, and mqar (the
zoology MQAR setting: a 2-layer, d_model 128 model on vocabulary 8192, AdamW with weight decay 0.1).

Fields (every one overridable from the command line):
  model         a `models.config` name "<point>-<size>"; the vocabulary is the data's, not the size's
  model_fields  optional: `models.STRUCTURE_FIELDS` overriding the size's (d_model, heads, gates, ...), as a
                converted checkpoint's config.json holds them (`python -m osdn_jax.convert`)
  point_options the point's preconditioner options (e.g. {"apf_anchor": "init"}; `dgps.get`); on the command line
                the one field that takes new keys (`--config.point_options.x=2.0`; `define_config_flag`)
  dtype         compute dtype (float32 | bfloat16); parameters and optimiser state are fp32
  implementation, chunk_size   the solve's (`ops.dispatch.IMPLEMENTATIONS`, or the alias "naive")
  remat         what a block keeps for the backward (`models.config.REMAT_POLICIES`)
  scan_layers   blocks as one `lax.scan` (True) or unrolled (False: faster for a few layers)
  seq_len, batch_size   tokens per row and rows per optimiser step over all devices
  grad_accum    microbatches per step (batch_size / grad_accum rows each)
  loss_chunk    tokens per piece of the cross-entropy (the [tokens, vocab] logits exist one piece at a time)
  loss_positions  0, or the scored positions per row the head reads (the first ones; recall tasks score few)
  steps         the schedule's length; log_every, checkpoint_every, diagnostics_every count steps (0: never;
                the last step is always logged, and checkpointed unless checkpoint_every is 0)
  eval_every    steps between evaluations of the held-out loss (0: never); a run that evaluates also does so at its
                last step. Each is `eval_batches` batches of batch_size rows of the validation split, the same ones
                every time (`loop.eval_batches`); logged as eval_loss, eval_perplexity and eval_tokens
  eval_batches  batches per evaluation
  keep_checkpoints, async_checkpoint, seed, progress
  optimizer     lr, warmup_steps, min_lr_ratio (cosine floor ÷ lr, in [0, 1]), b1, b2, eps, weight_decay, clip
                (the global norm gradients are clipped to, > 0)
  mesh          data, fsdp, context, tensor: device counts per axis; one of them may be -1 (the rest of the
                devices). context > 1 splits every row's positions (context parallelism; it divides seq_len)
  data          `osdn_jax.data.make_pipeline`'s fields: source, path, tokenizer, vocab_size, text_dir, split,
                block_chars, num_records, mqar_pairs, mqar_power, mqar_reads, passkey_depth, passkey_digits,
                prefetch, order
  data.path     source = tokens: the directory of `python -m osdn_jax.data.prepare` (its metadata.json sets the
                vocabulary; docs/training.md, "Your own corpus")
"""
from __future__ import annotations

import math
import pathlib

import ml_collections
from absl import flags
from ml_collections import config_flags

from osdn_jax import dgps
from osdn_jax.models.config import REMAT_POLICIES, config as model_config, structure_fields
from osdn_jax.ops import dispatch
from osdn_jax.train import mesh as mesh_lib

DTYPES = ("float32", "bfloat16")


def base() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = "gdn-340m"
  c.point_options = ml_collections.ConfigDict()
  c.dtype = "bfloat16"
  c.implementation = "auto"
  c.chunk_size = 64
  c.remat = "dots_solve"
  c.scan_layers = True
  c.seq_len = 2048
  c.batch_size = 16
  c.grad_accum = 1
  c.loss_chunk = 2048
  c.loss_positions = 0
  c.steps = 1000
  c.log_every = 10
  c.checkpoint_every = 500
  c.diagnostics_every = 0
  c.eval_every = 0
  c.eval_batches = 8
  c.keep_checkpoints = 3
  c.async_checkpoint = True
  c.seed = 0
  c.progress = True
  c.optimizer = ml_collections.ConfigDict(dict(
      lr=3e-4, warmup_steps=100, min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.01, clip=1.0))
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, context=1, tensor=1))
  c.data = ml_collections.ConfigDict(dict(
      source="text", path="", tokenizer="bpe", vocab_size=32000, text_dir="", split="train", block_chars=8192,
      num_records=100_000, mqar_pairs=8, mqar_power=0.01, mqar_reads=1, passkey_depth=-1.0, passkey_digits=5,
      prefetch=16, order="epoch"))
  return c


def tiny() -> ml_collections.ConfigDict:
  """A 2-layer GDN on the corpus's bytes: trains on a CPU in about a minute (fp32, so runs reproduce exactly)."""
  c = base()
  c.model = "gdn-tiny"
  c.dtype = "float32"
  c.remat = "none"
  c.seq_len = 128
  c.batch_size = 8
  c.loss_chunk = 256
  c.steps = 200
  c.log_every = 10
  c.checkpoint_every = 100
  c.diagnostics_every = 50
  c.eval_every = 100
  c.optimizer.lr = 3e-3
  c.optimizer.warmup_steps = 4
  c.data.tokenizer = "byte"
  c.data.vocab_size = 256
  c.data.prefetch = 0
  return c


def recipe_340m() -> ml_collections.ConfigDict:
  """The paper's 340M recipe per GPU: 16 rows × 2048 tokens, bf16 compute, BPE 32000 on the text corpus; the
  held-out loss every 500 steps (8 batches: 8 forward passes, by estimate about 3 steps' time)."""
  c = base()
  c.eval_every = 500
  return c


def recipe_1_3b() -> ml_collections.ConfigDict:
  c = base()
  c.model = "gdn-1.3b"
  c.batch_size = 8
  c.eval_every = 500
  return c


def mqar() -> ml_collections.ConfigDict:
  """MQAR as zoology trains it: 2 mixer + 2 MLP layers of width 128 (`models.SIZES["mqar"]`), vocabulary 8192,
  rows of 256 tokens with 16 pairs, AdamW (weight decay 0.1) on a cosine schedule to 0, fp32, the training rows
  20,000 distinct rows drawn with replacement (docs/experiments.md, "The MQAR protocol"). The loss reads only the
  scored positions (one per pair)."""
  c = base()
  c.model = "gdn-mqar"
  c.dtype = "float32"
  c.remat = "none"
  c.scan_layers = False
  c.seq_len = 256
  c.batch_size = 64
  c.loss_chunk = 256
  c.loss_positions = 16
  c.steps = 1000
  c.log_every = 50
  c.checkpoint_every = 0
  c.optimizer.lr = 1e-3
  c.optimizer.warmup_steps = 50
  c.optimizer.weight_decay = 0.1
  c.optimizer.min_lr_ratio = 0.0
  c.data.source = "mqar"
  c.data.vocab_size = 8192
  c.data.mqar_pairs = 16
  c.data.num_records = 20_000
  c.data.order = "replacement"
  c.data.prefetch = 0
  return c


CONFIGS = {"tiny": tiny, "340m": recipe_340m, "1.3b": recipe_1_3b, "mqar": mqar}


def get_config(name: str = "tiny") -> ml_collections.ConfigDict:
  """The named config (ml_collections' entry point: `--config=configs.py:NAME`)."""
  if name not in CONFIGS:
    raise ValueError(f"train: unknown `config` {name!r}; named configs: {', '.join(CONFIGS)} "
                     "(or a path to a .py file with get_config())")
  return CONFIGS[name]()


def _int(c, field, *, minimum=1):
  value = c[field]
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise ValueError(f"train config: `{field}` must be an int ≥ {minimum}, got {value!r}")


def validate(c: ml_collections.ConfigDict) -> None:
  """ValueError naming the field for anything the trainer cannot run. The mesh against the devices and the
  data fields are checked where they are used (`train.mesh`, `osdn_jax.data`)."""
  if not isinstance(c.model, str):
    raise ValueError(f"train config: `model` must be a models.config name '<point>-<size>', got {c.model!r}")
  try:
    variant = model_config(c.model).variant
  except ValueError as e:
    raise ValueError(f"train config: `model` {c.model!r}: {e}") from None
  try:
    model_config(c.model, **structure_fields(c.get("model_fields", {})))
  except ValueError as e:
    raise ValueError(f"train config: `model_fields` of {c.model!r}: {e}") from None
  options = dgps.checks.option_mapping("train config", c.point_options)
  try:
    dgps.get(variant, **options)
  except ValueError as e:
    raise ValueError(f"train config: `point_options` of {c.model!r}: {e}") from None
  if c.dtype not in DTYPES:
    raise ValueError(f"train config: `dtype` must be one of {', '.join(DTYPES)}, got {c.dtype!r}")
  if not isinstance(c.get("scan_layers", True), bool):
    raise ValueError(f"train config: `scan_layers` must be a bool, got {c.scan_layers!r}")
  if c.remat not in REMAT_POLICIES:
    raise ValueError(f"train config: `remat` must be one of {', '.join(REMAT_POLICIES)}, "
                     f"got {c.remat!r}")
  for field in ("seq_len", "batch_size", "grad_accum", "loss_chunk", "steps", "keep_checkpoints"):
    _int(c, field)
  for field in ("log_every", "checkpoint_every", "diagnostics_every", "seed", "loss_positions"):
    _int(c, field, minimum=0)
  for field, minimum in (("eval_every", 0), ("eval_batches", 1)):   # a config file may predate them (loop: defaults)
    if field in c:
      _int(c, field, minimum=minimum)
  if c.batch_size % c.grad_accum:
    raise ValueError(f"train config: `grad_accum` ({c.grad_accum}) must divide `batch_size` ({c.batch_size})")
  o = c.optimizer
  for field in ("lr", "b1", "b2", "eps", "weight_decay", "clip", "min_lr_ratio"):
    if not isinstance(o[field], (int, float)) or not math.isfinite(o[field]) or o[field] < 0:
      raise ValueError(f"train config: `optimizer.{field}` must be a finite number ≥ 0, got {o[field]!r}")
  if o.clip <= 0:
    raise ValueError(f"train config: `optimizer.clip` must be > 0 (the global norm gradients are clipped to; 0 "
                     f"scales every update to 0, so nothing trains), got {o.clip!r}")
  if o.min_lr_ratio > 1:
    raise ValueError(f"train config: `optimizer.min_lr_ratio` must lie in [0, 1] (the cosine's floor ÷ lr), got "
                     f"{o.min_lr_ratio!r}")
  if not 0 <= o.b1 < 1 or not 0 <= o.b2 < 1:
    raise ValueError(f"train config: `optimizer.b1` and `optimizer.b2` must lie in [0, 1), got {o.b1}, {o.b2}")
  _int(o, "warmup_steps", minimum=0)
  if o.warmup_steps >= c.steps:
    raise ValueError(f"train config: `optimizer.warmup_steps` ({o.warmup_steps}) must be below `steps` "
                     f"({c.steps})")
  axes = ("data", "fsdp", "context", "tensor")
  for field in axes:
    size = c.mesh.get(field, 1)
    if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
      raise ValueError(f"train config: `mesh.{field}` must be a positive int or -1, got {size!r}")
  if [c.mesh.get(a, 1) for a in axes].count(-1) > 1:
    raise ValueError("train config: at most one of `mesh.data`, `mesh.fsdp`, `mesh.context`, `mesh.tensor` may "
                     "be -1")
  if c.mesh.get("context", 1) != -1:    # -1 is resolved against the devices, and checked then
    mesh_lib.check_length(c.seq_len, c.mesh.get("context", 1))
  if c.data.get("source") == "tokens" and not c.data.get("path"):
    raise ValueError("train config: `data.path` must name a directory of prepared token shards for "
                     "data.source = tokens (`python -m osdn_jax.data.prepare --input=GLOB --tokenizer=SPEC --out=DIR`)")
  if not isinstance(c.implementation, str) or c.implementation not in dispatch.NAMES:
    raise ValueError(f"train config: `implementation` must be one of {dispatch.IMPLEMENTATIONS} (or 'naive', an "
                     f"alias of 'reference'), got {c.implementation!r}")


class _LockAllButPointOptions(flags.ArgumentParser):
  """The --config flag's parser: ml_collections' config-file parser (`inner`), then the loaded config locked as
  `lock_config=True` would lock it, but for `point_options`. So a `--config.FIELD=VALUE` override may set a field
  the config has (`--config.stpes=3` is a KeyError naming `stpes`, with a "did you mean"), and add any key to
  `point_options`, the point's options (`--config.point_options.x=2.0`: the value is read as a Python literal,
  else kept as a string), which `validate` checks against the point (an unknown option is a ValueError naming
  it)."""

  def __init__(self, inner: flags.ArgumentParser):
    self.inner = inner

  def parse(self, argument):
    config = self.inner.parse(argument)
    if isinstance(config, ml_collections.ConfigDict):   # not ml_collections' stand-in for an unreadable file
      config.lock()
      if isinstance(config.get("point_options"), ml_collections.ConfigDict):
        config.point_options.unlock()
    return config

  def flag_type(self):
    return self.inner.flag_type()


def define_config_flag(help_string: str = "a named config (tiny, 340m, 1.3b, mqar) or a config file",
                       flag_values=None):
  """Defines the --config flag of the trainer's command lines on `flag_values` (absl's FLAGS by default) and
  returns its FlagHolder: ml_collections' config-file flag, every field overridable, new keys accepted under
  `point_options` only (`_LockAllButPointOptions`)."""
  flag_values = flags.FLAGS if flag_values is None else flag_values
  # ml_collections takes new keys (accept_new_attributes) only into an unlocked config: its parser loads the
  # config unlocked, and ours locks all of it but point_options before the overrides are applied.
  holder = config_flags.DEFINE_config_file("config", None, help_string, flag_values=flag_values, lock_config=False,
                                           accept_new_attributes=True)
  flag = flag_values[holder.name]
  flag.parser = _LockAllButPointOptions(flag.parser)
  return holder


def flag_args(argv: list[str]) -> list[str]:
  """Command-line args with --config=NAME (a name of `CONFIGS`) made --config=<this file>:NAME, the form
  ml_collections' config flag reads; other args unchanged."""
  path = pathlib.Path(__file__)
  out = []
  for i, arg in enumerate(argv):
    if arg.startswith("--config=") and arg.split("=", 1)[1] in CONFIGS:
      arg = f"--config={path}:{arg.split('=', 1)[1]}"
    elif i and argv[i - 1] == "--config" and arg in CONFIGS:
      arg = f"{path}:{arg}"
    out.append(arg)
  return out
