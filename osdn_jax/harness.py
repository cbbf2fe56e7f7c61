"""lm-evaluation-harness's model interface over a trained run (the harness itself is optional: `pip install lm_eval`).

    import lm_eval
    from osdn_jax import harness
    lm = harness.lm_class()(workdir="runs/tiny", batch_size=8)      # or lm_eval's --model osdn after lm_class()
    lm_eval.simple_evaluate(model=lm, tasks=["lambada_openai"])

`RunLM` is the harness's three requests on a model and its tokenizer, with no import of lm_eval (a request is an
lm_eval `Instance` or the tuple of its `args`):
  loglikelihood          (context, continuation) → (Σ log p(continuation | context), whether greedy decoding
                         gives the continuation); context and continuation are tokenized apart, an empty context
                         is the EOS token, and the tokens are cut on the left to max_length + 1;
  loglikelihood_rolling  (text,) → Σ log p of every token of the text after an EOS, the whole text through the
                         recurrent state (`models.prefill` over windows of max_length tokens, each continuing the
                         last window's cache: no token loses its left context);
  generate_until         (context, {"until": [...], "max_gen_toks": n}) → the greedy continuation
                         (`models.generate`), cut before the first stop string or EOS; sampling is refused.
Loglikelihood requests of one batch, and the last window of a rolling one, are padded on the right to a multiple
of 64 tokens (a padding token after a sequence changes none of its logits: the mixers are causal), so few shapes
compile. `lm_class()` is the same
behind lm_eval's `LM` base class, registered under the name "osdn".
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from osdn_jax import models

_BUCKET = 64          # loglikelihood batches are padded to a multiple of this many tokens


def _args(request) -> tuple:
  return tuple(getattr(request, "args", request))


@functools.partial(jax.jit, static_argnums=0)
def _scored(graphdef, params, tokens, targets):
  """(log p(target) [B, L], whether the target is the argmax [B, L]) of the model on tokens [B, L]."""
  logits = nnx.merge(graphdef, params)(tokens).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return picked, jnp.argmax(logits, axis=-1) == targets


class RunLM:
  """The harness's requests (module docstring) on `model` (a `models.LanguageModel`) and `tokenizer` (encode(text)
  → int ids, decode(ids) → text, eos_id). max_length: tokens per forward (default: the model's training length
  where known, else 2048); batch_size: loglikelihood requests per forward."""

  def __init__(self, model, tokenizer, *, max_length: int | None = None, batch_size: int = 8):
    for name, value in (("max_length", max_length), ("batch_size", batch_size)):
      if value is not None and (not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1):
        raise ValueError(f"harness: `{name}` must be an int ≥ 1, got {value!r}")
    self.model, self.tokenizer = model, tokenizer
    self.max_length = int(max_length or 2048)
    self.batch_size = int(batch_size)
    self._graphdef, self._params = nnx.split(model)

  @classmethod
  def from_workdir(cls, workdir, *, step: int | None = None, max_length: int | None = None, batch_size: int = 8):
    """The model of a trainer's work directory (its newest checkpoint, or `step`: `train.load`) and the tokenizer
    of its data; max_length defaults to the run's seq_len."""
    from osdn_jax.data import make_pipeline
    from osdn_jax.train import loop
    model, config, _ = loop.load_checkpoint(workdir, step=step)
    pipeline = make_pipeline(dict(config.data, prefetch=0), seq_len=config.seq_len, batch_size=1, seed=config.seed)
    pipeline.close()
    if pipeline.tokenizer is None:
      raise ValueError(f"harness: the run in {workdir} trained on `{config.data.source}` data, which has no "
                       "tokenizer to read text with")
    return cls(model, pipeline.tokenizer, max_length=max_length or int(config.seq_len), batch_size=batch_size)

  # -- tokens ----------------------------------------------------------------------------------------------------
  def _encode(self, text: str) -> list[int]:
    if not isinstance(text, str):
      raise ValueError(f"harness: a request's text must be a str, got {type(text).__name__}")
    return [int(t) for t in np.asarray(self.tokenizer.encode(text)).reshape(-1)]

  def _decode(self, ids) -> str:
    ids = list(ids)
    if self.tokenizer.eos_id in ids:
      ids = ids[:ids.index(self.tokenizer.eos_id)]
    return self.tokenizer.decode(np.asarray(ids, np.int32))

  # -- the three requests ------------------------------------------------------------------------------------
  def loglikelihood(self, requests: Sequence[Any], **unused) -> list[tuple[float, bool]]:
    rows = []
    for r in requests:
      context, continuation = _args(r)[:2]
      ctx = self._encode(context) or [self.tokenizer.eos_id]
      cont = self._encode(continuation)
      ids = (ctx + cont)[-(self.max_length + 1):]
      rows.append((ids, min(len(cont), len(ids) - 1)))
    out: list[tuple[float, bool]] = [(0.0, True)] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))     # similar lengths share a batch
    for start in range(0, len(order), self.batch_size):
      batch = order[start:start + self.batch_size]
      width = -(-max(1, *(len(rows[i][0]) - 1 for i in batch)) // _BUCKET) * _BUCKET
      tokens = np.full((len(batch), width), self.tokenizer.eos_id, np.int32)
      targets = np.zeros((len(batch), width), np.int32)
      for j, i in enumerate(batch):
        ids = rows[i][0]
        tokens[j, :len(ids) - 1], targets[j, :len(ids) - 1] = ids[:-1], ids[1:]
      logp, greedy = map(np.asarray, _scored(self._graphdef, self._params, jnp.asarray(tokens), jnp.asarray(targets)))
      for j, i in enumerate(batch):
        ids, n = rows[i]
        scored = slice(len(ids) - 1 - n, len(ids) - 1)
        out[i] = (float(np.sum(logp[j, scored], dtype=np.float64)), bool(np.all(greedy[j, scored])))
    return out

  def loglikelihood_rolling(self, requests: Sequence[Any], **unused) -> list[float]:
    out = []
    for r in requests:
      ids = [self.tokenizer.eos_id] + self._encode(_args(r)[0])
      total, cache = 0.0, None
      for start in range(0, len(ids) - 1, self.max_length):
        window = ids[start:start + self.max_length + 1]
        n = len(window) - 1
        if start + self.max_length + 1 < len(ids):
          inputs = window[:-1]
        else:     # the last window, padded on the right (its cache is not used again): few shapes compile
          inputs = window[:-1] + [self.tokenizer.eos_id] * (-(-n // _BUCKET) * _BUCKET - n)
        logits, cache = models.prefill(self.model, jnp.asarray([inputs], jnp.int32), cache=cache)
        logp = jax.nn.log_softmax(jnp.asarray(logits[0, :n], jnp.float32), axis=-1)
        total += float(np.sum(np.asarray(logp)[np.arange(n), window[1:]], dtype=np.float64))
      out.append(total)
    return out

  def generate_until(self, requests: Sequence[Any], **unused) -> list[str]:
    out = []
    for r in requests:
      context, kwargs = (_args(r) + ({},))[:2]
      kwargs = dict(kwargs or {})
      if kwargs.get("do_sample") or float(kwargs.get("temperature", 0.0) or 0.0) > 0:
        raise ValueError("harness: generate_until decodes greedily; `do_sample` / `temperature` > 0 are not "
                         f"supported, got {kwargs}")
      until = kwargs.get("until") or []
      until = [until] if isinstance(until, str) else list(until)
      num = int(kwargs.get("max_gen_toks", 256))
      prompt = (self._encode(context) or [self.tokenizer.eos_id])[-self.max_length:]
      tokens, _ = models.generate(self.model, jnp.asarray([prompt], jnp.int32), num)
      text = self._decode(np.asarray(tokens[0]).tolist())
      cut = min((text.find(s) for s in until if s and s in text), default=len(text))
      out.append(text[:cut])
    return out


_REGISTERED: list = []


def lm_class():
  """`RunLM` behind lm_eval's `LM` base class, constructed as OSDN(workdir=..., step=None, batch_size=8,
  max_length=None) (lm_eval's `--model_args` give strings; other keywords lm_eval passes are ignored) and
  registered with lm_eval as "osdn". Needs lm_eval installed (ImportError otherwise)."""
  if _REGISTERED:
    return _REGISTERED[0]
  from lm_eval.api.model import LM
  from lm_eval.api.registry import register_model

  class OSDN(LM):
    def __init__(self, workdir, step=None, batch_size=8, max_length=None, **unused):
      super().__init__()
      number = lambda x: None if x in (None, "", "None", "auto") else int(x)     # lm_eval's "auto": the default
      self.run = RunLM.from_workdir(workdir, step=number(step), max_length=number(max_length),
                                    batch_size=number(batch_size) or 8)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
      return self.run.loglikelihood(requests)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
      return self.run.loglikelihood_rolling(requests)

    def generate_until(self, requests, disable_tqdm: bool = False):
      return self.run.generate_until(requests)

  _REGISTERED.append(register_model("osdn")(OSDN))
  return _REGISTERED[0]
