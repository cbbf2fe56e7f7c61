"""The input pipeline (`osdn_jax.data`): batch layout, packing against the source's records, determinism,
checkpoint round trips with and without prefetch, process shards, text splits, recall rows (MQAR, passkey),
tokenizers, config errors.

Tests of the text source need the corpus at its default place (`make data`, which `make install` runs) and skip
without it."""
import hashlib
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from osdn_jax import data, testing
from osdn_jax.data import pipeline, recall, sources

T, B = 64, 4
PASSKEY_T = 256                                            # a passkey row holds a needle, a question and filler


needs_corpus = testing.needs_corpus()

TEXT = dict(source="text", tokenizer="byte", prefetch=0, block_chars=1024)
RANDOM = dict(source="random", vocab_size=1000, num_records=64, prefetch=0)
MQAR = dict(source="mqar", vocab_size=256, mqar_pairs=8, num_records=64, prefetch=0)
PASSKEY = dict(source="passkey", passkey_digits=5, num_records=64, prefetch=0)
SOURCE_CFGS = [pytest.param(TEXT, marks=needs_corpus), RANDOM, MQAR, PASSKEY]


def _seq_len(cfg) -> int:
  return PASSKEY_T if cfg["source"] == "passkey" else T


def _batches(cfg, n, *, seq_len=None, batch_size=B, seed=0, **kw):
  seq_len = _seq_len(cfg) if seq_len is None else seq_len
  pipe = data.make_pipeline(cfg, seq_len=seq_len, batch_size=batch_size, seed=seed, **kw)
  out = [next(pipe) for _ in range(n)]
  pipe.close()
  return out


def _same(a, b) -> bool:
  return len(a) == len(b) and all(x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
                                  for x, y in zip(a, b))


def _digest(batches) -> str:
  h = hashlib.sha256()
  for batch in batches:
    for k in sorted(batch):
      h.update(k.encode() + batch[k].tobytes())
  return h.hexdigest()


@pytest.mark.parametrize("cfg", SOURCE_CFGS, ids=lambda c: c["source"])
def test_batch_layout(cfg):
  """Keys, shapes and dtypes; ids in the vocabulary; non-decreasing segment ids; a 0/1 loss mask. Text and random
  rows are shifted by one (targets = the next token); recall rows have targets 0 and segment 0 wherever nothing is
  scored, and as many scored positions as the task asks."""
  t = _seq_len(cfg)
  batches = _batches(cfg, 3)
  for batch in batches:
    assert set(batch) == {"tokens", "targets", "segment_ids", "loss_mask"}
    for k, dtype in (("tokens", np.int32), ("targets", np.int32), ("segment_ids", np.int32),
                     ("loss_mask", np.float32)):
      assert batch[k].shape == (B, t) and batch[k].dtype == dtype, k
    assert np.all(np.diff(batch["segment_ids"], axis=1) >= 0)
    assert set(np.unique(batch["loss_mask"])) <= {0.0, 1.0}
    if cfg["source"] in ("text", "random"):
      np.testing.assert_array_equal(batch["tokens"][:, 1:], batch["targets"][:, :-1])
    else:
      assert np.all(batch["targets"][batch["loss_mask"] == 0] == 0)
      assert np.all(batch["segment_ids"] == 0)
      scored = cfg["mqar_pairs"] if cfg["source"] == "mqar" else cfg["passkey_digits"]
      np.testing.assert_array_equal(batch["loss_mask"].sum(axis=1), scored)
    vocab = 256 if cfg["source"] in ("text", "passkey") else cfg["vocab_size"]
    for k in ("tokens", "targets"):
      assert 0 <= batch[k].min() and batch[k].max() < vocab, k


@needs_corpus
def test_text_rows_pack_the_shuffled_records_with_eos():
  """Rows are consecutive pieces of one stream: records, each followed by EOS. A segment starts exactly after an
  EOS target, and the loss is masked exactly where the target starts the next document."""
  pipe = data.make_pipeline(TEXT, seq_len=T, batch_size=B, seed=0)
  eos = pipe.eos_id
  batches = [next(pipe) for _ in range(60)]
  pipe.close()
  for batch in batches:
    starts = batch["segment_ids"][:, 1:] != batch["segment_ids"][:, :-1]
    np.testing.assert_array_equal(starts, batch["targets"][:, :-1] == eos)
    np.testing.assert_array_equal(batch["loss_mask"], (batch["tokens"] != eos).astype(np.float32))
  rows = [np.append(b["tokens"][r], b["targets"][r, -1]) for b in batches for r in range(B)]
  pieces = np.split(np.concatenate(rows), np.flatnonzero(np.concatenate(rows) == eos) + 1)
  records = set(data.TextSource("", TEXT["block_chars"]).records)
  whole = [pipe.tokenizer.decode(p) for p in pieces[1:-1]]
  assert len(whole) >= 5 and all(text in records for text in whole)
  assert len(set(whole)) == len(whole)                     # no record twice within an epoch


@needs_corpus
@pytest.mark.parametrize("split", ["train", "validation"])
def test_text_split_rows_hold_only_that_splits_blocks(split):
  """The pipeline of one split packs only blocks of that split (the default split is "train")."""
  cfg = dict(TEXT, split=split) if split != "train" else TEXT
  pipe = data.make_pipeline(cfg, seq_len=T, batch_size=B, seed=0)
  assert pipe.signature["split"] == split
  eos = pipe.eos_id
  batches = [next(pipe) for _ in range(40)]
  pipe.close()
  stream = np.concatenate([np.append(b["tokens"][r], b["targets"][r, -1]) for b in batches for r in range(B)])
  whole = [pipe.tokenizer.decode(p) for p in np.split(stream, np.flatnonzero(stream == eos) + 1)[1:-1]]
  records = set(data.TextSource("", TEXT["block_chars"], split).records)
  assert len(whole) >= 5 and all(text in records for text in whole)


@pytest.mark.parametrize("cfg", SOURCE_CFGS, ids=lambda c: c["source"])
def test_same_seed_same_batches_other_seed_other_batches(cfg):
  a, b, c = (_batches(cfg, 4, seed=s) for s in (3, 3, 4))
  assert _same(a, b)
  assert not np.array_equal(a[0]["tokens"], c[0]["tokens"])


def test_a_fresh_process_gives_the_same_batches_and_bpe():
  """Same batches (and, with the corpus, the same BPE from the same training) in another interpreter."""
  cfg = TEXT if not needs_corpus.args[0] else RANDOM
  code = ("import hashlib, json, sys\n"
          "from tests.test_data import SAMPLE, _batches, _digest, _small_bpe\n"
          "cfg = json.loads(sys.argv[1])\n"
          "print(_digest(_batches(cfg, 3, seed=7)))\n"
          "print(hashlib.sha256(_small_bpe().encode(SAMPLE).tobytes()).hexdigest() if cfg['source'] == 'text' "
          "else '-')\n")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], capture_output=True, text=True, cwd=root,
                       check=True).stdout.split()
  assert out[0] == _digest(_batches(cfg, 3, seed=7))
  if cfg is TEXT:
    assert out[1] == hashlib.sha256(_small_bpe().encode(SAMPLE).tobytes()).hexdigest()


@pytest.mark.parametrize("prefetch", [0, 3])
@pytest.mark.parametrize("cfg", SOURCE_CFGS, ids=lambda c: c["source"])
def test_state_round_trip(cfg, prefetch):
  """get_state describes the next batch, also while a prefetch thread reads ahead: a new pipeline (with or
  without prefetch) set to a JSON round trip of the state returns the same batches."""
  cfg, t = dict(cfg, prefetch=prefetch), _seq_len(cfg)
  pipe = data.make_pipeline(cfg, seq_len=t, batch_size=B, seed=1)
  for _ in range(5):
    next(pipe)
  time.sleep(0.05 if prefetch else 0)                      # lets the prefetch thread read ahead
  states = [json.loads(json.dumps(pipe.get_state()))]
  ahead = [next(pipe) for _ in range(3)]
  time.sleep(0.05 if prefetch else 0)
  states.append(json.loads(json.dumps(pipe.get_state())))
  later = [next(pipe) for _ in range(2)]
  pipe.close()
  for other_prefetch in {prefetch, 0}:
    again = data.make_pipeline(dict(cfg, prefetch=other_prefetch), seq_len=t, batch_size=B, seed=1)
    again.set_state(states[0])
    assert _same([next(again) for _ in range(3)], ahead)
    again.set_state(states[1])
    assert _same([next(again) for _ in range(2)], later)
    again.close()


def test_state_of_another_pipeline_is_refused():
  state = data.make_pipeline(RANDOM, seq_len=T, batch_size=B, seed=0).get_state()
  other = data.make_pipeline(RANDOM, seq_len=T, batch_size=B, seed=0, process_index=1, process_count=2)
  with pytest.raises(ValueError, match="process_count"):
    other.set_state(state)


def test_process_shards_are_disjoint_and_cover_the_records():
  """Two processes, one epoch each (8 of 16 records): disjoint rows that together are every record."""
  cfg = dict(RANDOM, num_records=16)
  seen = []
  for index in range(2):
    batches = _batches(cfg, 2, process_index=index, process_count=2)
    seen.append({tuple(np.append(b["tokens"][r], b["targets"][r, -1])) for b in batches for r in range(B)})
    assert len(seen[-1]) == 8
  assert not seen[0] & seen[1]
  records = sources.RandomTokens(cfg["vocab_size"], T + 1, 16, seed=0)
  assert seen[0] | seen[1] == {tuple(records[i]) for i in range(16)}


@needs_corpus
def test_text_shards_differ():
  a, b = (_batches(TEXT, 1, process_index=i, process_count=2)[0] for i in range(2))
  assert not np.array_equal(a["tokens"], b["tokens"])


def test_mqar_rows_are_the_source_records_scored_at_their_queries():
  """Every MQAR row is a record of the pipeline's source, its kv block k1 v1 … at [0, 2·kv); it is scored at
  exactly kv even positions after the block, each reading one key once, whose target is the value paired with it."""
  n, vocab = MQAR["mqar_pairs"], MQAR["vocab_size"]
  pipe = data.make_pipeline(MQAR, seq_len=T, batch_size=B, seed=0)
  src = pipe.source
  assert isinstance(src, data.MQARSource) and src.row_length == T
  labels_of = {tuple(src[i]["inputs"]): src[i]["labels"] for i in range(len(src))}
  batches = [next(pipe) for _ in range(4)]
  pipe.close()
  for batch in batches:
    for tokens, targets, mask in zip(batch["tokens"], batch["targets"], batch["loss_mask"]):
      labels = labels_of[tuple(tokens)]
      np.testing.assert_array_equal(mask, labels != recall.IGNORE)
      np.testing.assert_array_equal(targets, np.where(labels != recall.IGNORE, labels, 0))
      keys, values = tokens[0:2 * n:2], tokens[1:2 * n:2]
      assert len(set(keys)) == n and np.all((1 <= keys) & (keys < vocab // 2))
      assert np.all((vocab // 2 <= values) & (values < vocab))
      value_of = dict(zip(keys.tolist(), values.tolist()))
      queries = np.flatnonzero(mask)
      assert len(queries) == n and np.all(queries >= 2 * n) and np.all(queries % 2 == 0)
      assert sorted(tokens[queries].tolist()) == sorted(value_of)
      assert [targets[t] for t in queries] == [value_of[tokens[t]] for t in queries]


SAMPLE = "Thou art more lovely and more temperate: <eos> ✓ café\n\n  To be, or not to be"


def test_byte_tokenizer_round_trip():
  tok = data.ByteTokenizer()
  ids = tok.encode(SAMPLE)
  assert ids.dtype == np.int32 and len(ids) == len(SAMPLE.encode()) and tok.eos_id not in ids
  assert tok.decode(ids) == SAMPLE
  assert tok.decode(np.append(ids, tok.eos_id)) == SAMPLE


def _small_bpe():
  texts = [p.read_text() for p in sources.corpus_files()[:2]]
  return data.BPETokenizer.train(texts, 300)


@needs_corpus
def test_bpe_round_trip_and_deterministic():
  a, b = _small_bpe(), _small_bpe()
  assert a.vocab_size == 300 and a.eos_id == 0
  ids = a.encode(SAMPLE)
  assert ids.dtype == np.int32 and a.eos_id not in ids      # the literal "<eos>" stays text
  assert len(ids) < len(SAMPLE.encode())
  np.testing.assert_array_equal(ids, b.encode(SAMPLE))
  assert a.decode(ids) == SAMPLE and a.decode(np.append(ids, a.eos_id)) == SAMPLE


@needs_corpus
def test_bpe_pipeline_trains_once_then_loads_the_cache(tmp_path, monkeypatch):
  corpus = tmp_path / "shakespeare"
  corpus.mkdir()
  for path in sources.corpus_files()[:2]:
    (corpus / path.name).write_text(path.read_text())
  cfg = dict(TEXT, tokenizer="bpe", vocab_size=300, text_dir=str(corpus))
  first = _batches(cfg, 2)
  assert len(list(tmp_path.glob("bpe-300-*.json"))) == 1

  def no_training(*args, **kwargs):
    raise AssertionError("trained again instead of loading the cache")
  monkeypatch.setattr(data.BPETokenizer, "train", no_training)
  pipe = data.make_pipeline(cfg, seq_len=T, batch_size=B, seed=0)
  assert pipe.vocab_size == 300
  assert _same([next(pipe) for _ in range(2)], first)
  pipe.close()


def test_split_blocks():
  text = "\n\nA a.\nA b.\n\n\n  B a.\n \nC " + "c" * 30 + "\n\nD."
  assert sources.split_blocks(text, 12) == ["A a.\nA b.", "B a.", "C " + "c" * 30, "D."]
  assert sources.split_blocks(text, 24) == ["A a.\nA b.\n\n\n  B a.", "C " + "c" * 30, "D."]
  assert sources.split_blocks(text, 0) == [text.strip()]


def test_missing_corpus_says_to_run_make_data(tmp_path, monkeypatch):
  with pytest.raises(FileNotFoundError, match="make data"):
    data.TextSource(tmp_path / "absent")
  monkeypatch.setenv("OSDN_DATA_DIR", str(tmp_path))
  assert sources.default_text_dir() == tmp_path / "shakespeare"
  with pytest.raises(FileNotFoundError, match="make data"):
    data.make_pipeline(dict(TEXT, text_dir=""), seq_len=T, batch_size=B, seed=0)


def test_config_dict():
  ml_collections = pytest.importorskip("ml_collections")
  cfg = ml_collections.ConfigDict(dict(RANDOM, text_dir="", tokenizer="bpe", mqar_pairs=8))
  assert _same(_batches(cfg, 2), _batches(RANDOM, 2))


@pytest.mark.parametrize("field,cfg,kw", [
    ("source", dict(source="web"), {}),
    ("tokenizer", dict(tokenizer="wordpiece"), {}),
    ("vocab_size", dict(RANDOM, vocab_size=0), {}),
    ("vocab_size", dict(TEXT, tokenizer="bpe", vocab_size=100), {}),
    ("vocab_size", dict(MQAR, vocab_size=0), {}),
    ("vocab_size", dict(MQAR, vocab_size=16), {}),
    ("num_records", dict(RANDOM, num_records=0), {}),
    ("split", dict(TEXT, split="test"), {}),
    ("split", dict(RANDOM, split=""), {}),
    ("mqar_pairs", dict(MQAR, mqar_pairs=0), {}),
    ("mqar_pairs", dict(MQAR, mqar_pairs=T // 4 + 1), {}),
    ("mqar_reads", dict(MQAR, mqar_reads=0), {}),
    ("mqar_reads", dict(MQAR, mqar_reads=3), {}),
    ("mqar_power", dict(MQAR, mqar_power=0.0), {}),
    ("passkey_depth", dict(PASSKEY, passkey_depth=1.5), {}),
    ("passkey_depth", dict(PASSKEY, passkey_depth=-0.5), {}),
    ("passkey_depth", dict(PASSKEY, passkey_depth="middle"), {}),
    ("passkey_depth", dict(PASSKEY, passkey_depth=True), {}),
    ("passkey_digits", dict(PASSKEY, passkey_digits=0), {}),
    ("seq_len", PASSKEY, dict(seq_len=T)),
    ("prefetch", dict(RANDOM, prefetch=-1), {}),
    ("prefetch", dict(RANDOM, prefetch=1.5), {}),
    ("block_chars", dict(TEXT, block_chars=-1), {}),
    ("text_dir", dict(TEXT, text_dir=3), {}),
    ("seq_len", RANDOM, dict(seq_len=0)),
    ("batch_size", RANDOM, dict(batch_size=0)),
    ("seed", RANDOM, dict(seed=-1)),
    ("process_index", RANDOM, dict(process_index=2, process_count=2)),
    ("process_count", dict(RANDOM, num_records=2), dict(process_index=0, process_count=3)),
])
def test_bad_config_names_the_field(field, cfg, kw):
  """Each bad value raises ValueError naming the config field (or make_pipeline's argument) at fault."""
  kw = dict(dict(seq_len=T, batch_size=B, seed=0), **kw)
  with pytest.raises(ValueError, match=f"`{field}`"):
    data.make_pipeline(cfg, **kw)
  if field == "tokenizer":
    with pytest.raises(ValueError, match="`tokenizer`.*byte, bpe"):
      data.make_tokenizer("wordpiece", 300, "")


def test_state_is_json_with_tuples_and_bytes():
  state = {"a": (1, (2, b"\x00\xff")), "b": [np.int64(3), None, "s"], "c": {"d": 1.5}}
  encoded = pipeline._to_json(state)
  assert pipeline._from_json(json.loads(json.dumps(encoded))) == {"a": (1, (2, b"\x00\xff")), "b": [3, None, "s"],
                                                                 "c": {"d": 1.5}}
