"""The lm-evaluation-harness adapter (`osdn_jax.harness`): each request's answer against the model computed
directly (one unpadded forward per request), batching and windows that change nothing, greedy generation cut at
its stop string, a trained run loaded by its work directory, and lm_eval's own base class where lm_eval is
installed."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from osdn_jax import harness, models, testing
from osdn_jax.data.tokenizers import ByteTokenizer
from osdn_jax.train import configs, loop

TOK = ByteTokenizer()
PAIRS = [("The quick brown fox", " jumps"), ("", "A"), ("abc" * 30, "defg"), ("x", ""), ("hello", " world!")]


@pytest.fixture(scope="module")
def model():
  return models.build("dn-tiny", rngs=nnx.Rngs(3))


def _direct(model, ids):
  """log p of ids[1:] given the prefixes, from one forward over ids[:-1] (float64 sums)."""
  logits = model(jnp.asarray([ids[:-1]], jnp.int32))[0].astype(jnp.float32)
  logp = np.asarray(jax.nn.log_softmax(logits, axis=-1), np.float64)
  return logp[np.arange(len(ids) - 1), ids[1:]], np.asarray(jnp.argmax(logits, axis=-1))


def test_loglikelihood_is_the_models_log_probability_of_the_continuation(model):
  """Σ log p(continuation | context) and whether greedy decoding gives it, against one unpadded forward; an empty
  context is the EOS token, an empty continuation is (0, True), a long pair is cut on the left to max_length + 1."""
  lm = harness.RunLM(model, TOK, max_length=64, batch_size=2)
  got = lm.loglikelihood(PAIRS)
  for (context, continuation), (logp, greedy) in zip(PAIRS, got):
    ctx, cont = list(TOK.encode(context)) or [TOK.eos_id], list(TOK.encode(continuation))
    ids = (ctx + cont)[-65:]
    if not cont:
      assert (logp, greedy) == (0.0, True)
      continue
    want, argmax = _direct(model, ids)
    n = len(cont)
    np.testing.assert_allclose(logp, want[-n:].sum(), rtol=1e-5)
    assert greedy == bool(np.all(argmax[-n:] == ids[-n:]))
    assert logp < 0


def test_batches_and_padding_change_no_answer(model):
  """All requests in batches of 4 (padded to a common width) give what each alone gives."""
  batched = harness.RunLM(model, TOK, max_length=64, batch_size=4).loglikelihood(PAIRS)
  alone = [harness.RunLM(model, TOK, max_length=64, batch_size=1).loglikelihood([p])[0] for p in PAIRS]
  np.testing.assert_allclose([b[0] for b in batched], [a[0] for a in alone], rtol=1e-5)
  assert [b[1] for b in batched] == [a[1] for a in alone]


class CharIds:
  """A tokenizer whose text is its ids (character n is id n): every id sequence is a text."""
  eos_id = 0

  def encode(self, text):
    return np.asarray([ord(c) for c in text], np.int32)

  def decode(self, ids):
    return "".join(map(chr, np.asarray(ids).tolist()))


def test_a_continuation_that_greedy_decoding_gives_is_greedy(model):
  """The model's own greedy continuation of a context is reported as greedy, a changed last token is not."""
  prompt = "ROMEO: "
  tokens, _ = models.generate(model, jnp.asarray([[ord(c) for c in prompt]], jnp.int32), 3)
  continuation = "".join(chr(int(t)) for t in np.asarray(tokens[0]))
  other = continuation[:-1] + chr((ord(continuation[-1]) + 1) % 256)
  lm = harness.RunLM(model, CharIds(), max_length=64)
  (_, greedy), (_, not_greedy) = lm.loglikelihood([(prompt, continuation), (prompt, other)])
  assert greedy and not not_greedy


def test_rolling_loglikelihood_carries_the_state_across_windows(model):
  """The text's log-likelihood after an EOS from windows of 16 tokens (each continuing the last one's cache)
  equals one forward over the whole text."""
  text = "To be, or not to be, that is the question: whether 'tis nobler in the mind"
  ids = [TOK.eos_id] + list(TOK.encode(text))
  want = _direct(model, ids)[0].sum()
  short, long = (harness.RunLM(model, TOK, max_length=m).loglikelihood_rolling([(text,)])[0] for m in (16, 256))
  np.testing.assert_allclose(long, want, rtol=1e-5)
  np.testing.assert_allclose(short, want, rtol=1e-4)


def test_generate_until_is_greedy_decoding_cut_before_the_stop_string(model):
  lm = harness.RunLM(model, CharIds(), max_length=64)
  prompt = "Enter HAMLET"
  tokens, _ = models.generate(model, jnp.asarray([[ord(c) for c in prompt]], jnp.int32), 12)
  ids = [int(t) for t in np.asarray(tokens[0])]
  full = "".join(map(chr, ids[:ids.index(0)] if 0 in ids else ids))
  assert len(full) > 4
  assert lm.generate_until([(prompt, {"until": [], "max_gen_toks": 12})]) == [full]
  stop = full[3:5]
  assert lm.generate_until([(prompt, {"until": ["never in the text", stop], "max_gen_toks": 12})]) == [
      full[:full.find(stop)]]


def test_bad_arguments_are_named(model):
  with pytest.raises(ValueError, match="max_length"):
    harness.RunLM(model, TOK, max_length=0)
  with pytest.raises(ValueError, match="batch_size"):
    harness.RunLM(model, TOK, batch_size=1.5)
  with pytest.raises(ValueError, match="greedily"):
    harness.RunLM(model, TOK).generate_until([("a", {"do_sample": True})])
  with pytest.raises(ValueError, match="str"):
    harness.RunLM(model, TOK).loglikelihood([(b"bytes", "x")])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A tiny run on the corpus's bytes: 2 steps of 2 × 32 tokens, checkpointed."""
  c = configs.get_config("tiny")
  c.progress, c.async_checkpoint, c.diagnostics_every, c.eval_every = False, False, 0, 0
  c.steps, c.log_every, c.checkpoint_every, c.batch_size, c.seq_len = 2, 1, 2, 2, 32
  c.optimizer.warmup_steps = 1
  workdir = tmp_path_factory.mktemp("harness") / "run"
  loop.run(c, workdir)
  return workdir


@testing.needs_corpus()
def test_a_run_is_read_with_its_tokenizer_and_length(run):
  lm = harness.RunLM.from_workdir(run)
  model, _ = loop.load(run)
  assert lm.max_length == 32 and isinstance(lm.tokenizer, ByteTokenizer)
  ids = [TOK.eos_id] + list(TOK.encode("Hi"))
  np.testing.assert_allclose(lm.loglikelihood([("", "Hi")])[0][0], _direct(model, ids)[0].sum(), rtol=1e-5)


@testing.needs_corpus()
def test_lm_evals_base_class_runs_its_requests(run):
  """Where lm_eval is installed: the registered "osdn" model built from --model_args strings answers lm_eval
  `Instance`s as `RunLM` does."""
  pytest.importorskip("lm_eval")
  from lm_eval.api.instance import Instance
  from lm_eval.api.model import LM
  from lm_eval.api.registry import get_model
  cls = harness.lm_class()
  assert get_model("osdn") is cls and issubclass(cls, LM)
  lm = cls.create_from_arg_string(f"workdir={run},batch_size=2")
  request = Instance(request_type="loglikelihood", doc={}, arguments=("To be", " or not"), idx=0)
  assert lm.loglikelihood([request]) == harness.RunLM.from_workdir(run).loglikelihood([("To be", " or not")])
  (text,) = lm.generate_until([Instance(request_type="generate_until", doc={}, idx=0,
                                        arguments=("To be", {"until": ["\n"], "max_gen_toks": 4}))])
  assert isinstance(text, str) and "\n" not in text


@testing.needs_corpus()
def test_lm_eval_scores_a_local_task_as_the_requests_answer_it(run, tmp_path):
  """Where lm_eval is installed: `simple_evaluate` on a two-question multiple-choice task of local files gives the
  accuracy that the adapter's own log-likelihoods of the choices give."""
  pytest.importorskip("lm_eval")
  import lm_eval
  from lm_eval.tasks import TaskManager
  docs = [{"context": "To be, or not to", "choices": [" be", " qx"], "label": 0},
          {"context": "ROMEO: ", "choices": ["zzzzzz", "Juliet"], "label": 1}]
  (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
  (tmp_path / "task.yaml").write_text(
      "task: osdn_test_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
      f"    test: {tmp_path / 'docs.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
      'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
      "metric_list:\n  - metric: acc\n")
  lm = harness.lm_class().create_from_arg_string(f"workdir={run}")
  results = lm_eval.simple_evaluate(model=lm, tasks=["osdn_test_choice"],
                                    task_manager=TaskManager(include_path=str(tmp_path)))["results"]
  right = [int(np.argmax([ll for ll, _ in lm.run.loglikelihood([(d["context"], c) for c in d["choices"]])]))
           == d["label"] for d in docs]
  assert results["osdn_test_choice"]["acc,none"] == pytest.approx(np.mean(right))
