"""`python -m osdn_jax.eval --workdir=RUN [--data=DIR] [--batches=N] [--step=S]`: the held-out loss of a run's
checkpoint, as one JSON line on stdout:

    {"step": 200, "eval_loss": 2.6021086048139725, "eval_perplexity": 13.49215769021727, "tokens": 8191}

RUN is a trainer's work directory; its newest checkpoint that passes its checksums is read (`train.load`), or
checkpoint S. The batches are the ones the trainer evaluates on (`train.loop.eval_batches`): N (default: the run's
`eval_batches`) batches of the run's batch_size rows of its data's validation split, or of the validation split of
prepared token shards DIR (`python -m osdn_jax.data.prepare`; its vocabulary must be the model's). The loss is the
trainer's (`step.make_eval_step`: mean nats per scored token), on one device, so for a run of one process it is
the eval_loss the trainer logged at that step. `--imports` as the trainer's (a run of a point a module registers).
Errors (no run, no such checkpoint, no validation split) are one line on stderr, `error: <message>`, and exit
status 1; a flag it cannot take, status 2 (`osdn_jax.cli`).
"""
from __future__ import annotations

import json

import jax
from flax import nnx

from osdn_jax import cli, plugins
from osdn_jax.train import loop
from osdn_jax.train.checkpoints import quiet_checkpoint_logs
from osdn_jax.train.step import graphdef, make_eval_step

def evaluate(workdir, *, step: int | None = None, data=None, batches: int | None = None) -> dict:
  """{"step", "eval_loss", "eval_perplexity", "tokens"} of checkpoint `step` (the newest) of the run in `workdir`
  (module docstring)."""
  model, config, step = loop.load_checkpoint(workdir, step=step)
  held_out = loop.eval_batches(config, rows=config.batch_size, data=data or None, count=batches,
                               vocab_size=model.cfg.vocab_size)
  fn = jax.jit(make_eval_step(graphdef(model.cfg), grad_accum=config.grad_accum, loss_chunk=config.loss_chunk,
                              loss_positions=config.get("loss_positions", 0)), static_argnums=2)
  out = loop.evaluate(fn, nnx.state(model, nnx.Param).to_pure_dict(), held_out)
  return {"step": step, "eval_loss": out["eval_loss"], "eval_perplexity": out["eval_perplexity"],
          "tokens": int(out["eval_tokens"])}


def main(argv):
  from absl import flags
  quiet_checkpoint_logs()
  f = flags.FLAGS
  if len(argv) > 1:
    raise cli.UsageError(f"eval: unexpected arguments {argv[1:]}; every argument is a --flag (--help lists them)")
  try:
    result = evaluate(f.workdir, step=f.step, data=f.data, batches=f.batches)
  except RuntimeError as e:                       # a checkpoint orbax cannot restore
    raise ValueError(f"eval: {cli.one_line(e)}") from e
  print(json.dumps(result))


def _define_flags() -> None:
  """The command line's flags (defined only when this module is the program: the trainer's share names)."""
  from absl import flags
  flags.DEFINE_string("workdir", None, "the run's work directory")
  flags.DEFINE_string("data", "", "prepared token shards to evaluate on (their validation split) instead of the "
                      "run's data")
  flags.DEFINE_integer("batches", None, "batches to evaluate (default: the run's eval_batches)", lower_bound=1)
  flags.DEFINE_integer("step", None, "the checkpoint's step (default: the newest)", lower_bound=0)
  plugins.define_imports_flag()
  flags.mark_flags_as_required(["workdir"])


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
