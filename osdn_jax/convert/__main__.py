"""`python -m osdn_jax.convert`: FLA / Hugging Face checkpoints into a work directory, and a run's checkpoint out.

    python -m osdn_jax.convert --fla=DIR --workdir=RUN [--data=TOKENS] [--config=340m] [--seq_len=N]
        [--batch_size=N] [--dtype=float32|bfloat16]
    python -m osdn_jax.convert --workdir=RUN --to_fla=DIR [--step=S] [--dtype=float32] [--max_shard_mb=N]

The first reads DIR (config.json + safetensors of DeltaNetForCausalLM, GatedDeltaNetForCausalLM, KDAForCausalLM,
PrecondGatedDeltaNetForCausalLM or PrecondKDAForCausalLM) and writes RUN, a work directory whose step-0 checkpoint
`python -m osdn_jax.eval --workdir=RUN --data=TOKENS`, `train.load`, the harness and the trainer read. The second
writes the newest checkpoint of RUN (or step S) as such a directory, tensors in --dtype. Prints one JSON line:
{"from", "to", "point", "parameters"}. Errors are one line on stderr (`osdn_jax.cli`): a config field or tensor
the other side cannot express is named.
"""
from __future__ import annotations

import json

from osdn_jax import cli


def main(argv):
  from absl import flags
  f = flags.FLAGS
  if len(argv) > 1:
    raise cli.UsageError(f"convert: unexpected arguments {argv[1:]}; every argument is a --flag (--help lists them)")
  if bool(f.fla) == bool(f.to_fla):
    raise cli.UsageError("convert: give exactly one of --fla=DIR (an FLA checkpoint into --workdir) and "
                         "--to_fla=DIR (--workdir's checkpoint out to FLA)")
  from osdn_jax import convert, models
  from osdn_jax.train import loop
  from osdn_jax.train.checkpoints import quiet_checkpoint_logs
  quiet_checkpoint_logs()
  if f.dtype not in (None, "float32", "bfloat16"):
    raise cli.UsageError(f"--dtype={f.dtype}: float32 or bfloat16")
  if f.fla:
    convert.fla_to_run(f.fla, f.workdir, data=f.data or None, config=f.config, seq_len=f.seq_len,
                       batch_size=f.batch_size, dtype=f.dtype)
    model, _ = loop.load(f.workdir)
    source, target = f.fla, f.workdir
  else:
    model, _, _ = loop.load_checkpoint(f.workdir, step=f.step)
    convert.save_fla(model, f.to_fla, dtype=f.dtype or "float32",
                     max_shard_bytes=None if f.max_shard_mb is None else f.max_shard_mb << 20)
    source, target = f.workdir, f.to_fla
  print(json.dumps({"from": str(source), "to": str(target), "point": model.cfg.variant,
                    "parameters": models.count_params(model)}))


def _define_flags() -> None:
  from absl import flags
  flags.DEFINE_string("fla", "", "an FLA / Hugging Face checkpoint directory to read into --workdir")
  flags.DEFINE_string("to_fla", "", "a directory to write --workdir's checkpoint into, as an FLA checkpoint")
  flags.DEFINE_string("workdir", None, "the run's work directory (written with --fla, read with --to_fla)")
  flags.DEFINE_string("data", "", "with --fla: prepared token shards (the checkpoint's tokenizer) as the run's data")
  flags.DEFINE_string("config", "340m", "with --fla: the named training config the run's settings start from "
                      "(tiny, 340m, 1.3b, mqar)")
  flags.DEFINE_integer("seq_len", None, "with --fla: the run's tokens per row (default: --config's)", lower_bound=1)
  flags.DEFINE_integer("batch_size", None, "with --fla: the run's rows per step (default: --config's)", lower_bound=1)
  flags.DEFINE_string("dtype", None, "with --fla: the run's compute dtype (default: --config's); with --to_fla: "
                      "the tensors' (default float32); float32 | bfloat16")
  flags.DEFINE_integer("step", None, "with --to_fla: the checkpoint's step (default: the newest)", lower_bound=0)
  flags.DEFINE_integer("max_shard_mb", None, "with --to_fla: shard the safetensors above this size",
                       lower_bound=1)
  flags.mark_flags_as_required(["workdir"])


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
