"""The input pipeline (`osdn_jax.data`): batch layout, packing against the source's records, determinism,
checkpoint round trips with and without prefetch, the same global batches on any number of processes (and
positions that resume on another number), text splits, recall rows (MQAR, passkey), tokenizers, config errors.

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
          "from tests.data.test_pipeline import SAMPLE, _batches, _digest, _small_bpe\n"
          "cfg = json.loads(sys.argv[1])\n"
          "print(_digest(_batches(cfg, 3, seed=7)))\n"
          "print(hashlib.sha256(_small_bpe().encode(SAMPLE).tobytes()).hexdigest() if cfg['source'] == 'text' "
          "else '-')\n")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
  """set_state refuses the state of another global batch (or seed); a state of any process fits any process."""
  pipe = data.make_pipeline(RANDOM, seq_len=T, batch_size=B, seed=0)
  state = pipe.get_state()
  for kw, field in ((dict(batch_size=2 * B), "batch_size"), (dict(seed=1), "seed")):
    other = data.make_pipeline(RANDOM, **dict(dict(seq_len=T, batch_size=B, seed=0), **kw))
    with pytest.raises(ValueError, match=field):
      other.set_state(state)
    other.close()
  for index in range(2):
    second = data.make_pipeline(RANDOM, seq_len=T, batch_size=B, seed=0, process_index=index, process_count=2)
    assert "process_index" not in second.signature and "process_count" not in second.signature
    assert second.signature == pipe.signature and second.get_state() == state
    second.set_state(state)
    second.close()
  pipe.close()
  with pytest.raises(ValueError, match="version"):
    data.make_pipeline(RANDOM, seq_len=T, batch_size=B, seed=0).set_state(dict(state, version=1))


@pytest.fixture(scope="module")
def prepared_tokens(tmp_path_factory):
  """A directory of prepared byte tokens (`python -m osdn_jax.data.prepare`) of 30 short documents."""
  from osdn_jax.data import prepare
  corpus = tmp_path_factory.mktemp("docs")
  rng = np.random.default_rng(0)
  for i in range(30):
    words = rng.choice(["to", "be", "or", "not", "that", "is", "the", "question"], size=int(rng.integers(5, 40)))
    (corpus / f"{i:02d}.txt").write_text(f"{i} " + " ".join(words))
  out = tmp_path_factory.mktemp("prepared") / "bytes"
  prepare.prepare([str(corpus / "*.txt")], "bytes", out, validation=0.0, workers=1, progress=False, verbose=False)
  return dict(source="tokens", path=str(out), prefetch=0)


def _source_cfg(request, cfg):
  return request.getfixturevalue("prepared_tokens") if cfg == "tokens" else cfg


# Every source (the prepared tokens by name: a fixture builds them), for the tests of the global batch.
GLOBAL_CFGS = [*SOURCE_CFGS, "tokens"]


@pytest.mark.parametrize("cfg", GLOBAL_CFGS, ids=lambda c: c if isinstance(c, str) else c["source"])
def test_the_processes_batches_side_by_side_are_the_global_batch(cfg, request):
  """Process p of P reads rows [p·r, (p + 1)·r) of every global batch: the P processes' batches, concatenated,
  are the 1-process batches (P = 2, 4), and every process holds the same state (which names no process)."""
  cfg = _source_cfg(request, cfg)
  t = _seq_len(cfg)
  global_batch, steps = 8, 3

  def run(index, count):
    pipe = data.make_pipeline(cfg, seq_len=t, batch_size=global_batch, seed=2, process_index=index,
                              process_count=count)
    out = [next(pipe) for _ in range(steps)]
    state = pipe.get_state()
    pipe.close()
    return out, state

  whole, state = run(0, 1)
  assert state["batches"] == steps
  for count in (2, 4):
    parts = [run(index, count) for index in range(count)]
    for batches, part_state in parts:
      assert all(b["tokens"].shape == (global_batch // count, t) for b in batches)
      assert part_state == state
    joined = [{k: np.concatenate([batches[s][k] for batches, _ in parts]) for k in whole[s]} for s in range(steps)]
    assert _same(joined, whole)


@pytest.mark.parametrize("cfg", [RANDOM, pytest.param(TEXT, marks=needs_corpus)], ids=lambda c: c["source"])
def test_rows_picks_those_rows_of_the_global_batch(cfg):
  """`rows` (any rows, in any order) gives exactly those rows of every global batch."""
  rows = [5, 0, 2]
  whole = _batches(cfg, 3, batch_size=6)
  picked = _batches(cfg, 3, batch_size=6, rows=rows)
  assert _same(picked, [{k: b[k][rows] for k in b} for b in whole])


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("cfg", GLOBAL_CFGS, ids=lambda c: c if isinstance(c, str) else c["source"])
def test_a_position_saved_on_two_processes_resumes_on_one_and_back(cfg, prefetch, request):
  """A state saved after k global batches by a process of 2 resumes a 1-process pipeline at global batch k + 1
  (and a 1-process state resumes each of 2 processes at its rows of global batch k + 1)."""
  cfg = _source_cfg(request, cfg)
  t = _seq_len(cfg)
  cfg = dict(cfg, prefetch=prefetch)
  make = lambda **kw: data.make_pipeline(cfg, seq_len=t, batch_size=4, seed=5, **kw)
  whole = make()
  expected = [next(whole) for _ in range(6)]
  whole.close()
  k = 3
  for index in range(2):
    part = make(process_index=index, process_count=2)
    for _ in range(k):
      next(part)
    time.sleep(0.05 if prefetch else 0)                    # lets the prefetch thread read ahead
    state = json.loads(json.dumps(part.get_state()))
    part.close()
    assert state["batches"] == k
    one = make()
    one.set_state(state)
    assert _same([next(one) for _ in range(3)], expected[k:])
    one.close()
  one = make()
  for _ in range(k):
    next(one)
  state = json.loads(json.dumps(one.get_state()))
  one.close()
  for index in range(2):
    part = make(process_index=index, process_count=2)
    part.set_state(state)
    assert _same([next(part) for _ in range(3)],
                 [{key: b[key][2 * index:2 * index + 2] for key in b} for b in expected[k:]])
    part.close()


def test_a_bad_token_id_is_named_by_its_row_of_the_global_batch():
  pipe = data.make_pipeline(RANDOM, seq_len=T, batch_size=B, seed=0, process_index=1, process_count=2)
  pipe.vocab_size = 1                                      # every id but 0 is outside it
  with pytest.raises(pipeline.TokenIdError, match=r"^data: `tokens`\[2, ") as info:
    next(pipe)
  assert info.value.row == 2
  pipe.close()


def test_every_epoch_reads_every_record_once_across_the_processes():
  """16 records, global batches of 4: the first 4 global batches are one epoch (every record once), the next 4
  another order of them; on 2 processes the rows split between them and together are the same."""
  cfg = dict(RANDOM, num_records=16)
  records = sources.RandomTokens(cfg["vocab_size"], T + 1, 16, seed=0)
  every = {tuple(records[i]) for i in range(16)}
  row = lambda b, r: tuple(np.append(b["tokens"][r], b["targets"][r, -1]))
  batches = _batches(cfg, 8)
  epochs = [[row(b, r) for b in batches[e * 4:(e + 1) * 4] for r in range(B)] for e in range(2)]
  assert all(len(set(epoch)) == 16 and set(epoch) == every for epoch in epochs)
  assert epochs[0] != epochs[1]
  halves = [[row(b, r) for b in _batches(cfg, 4, process_index=i, process_count=2) for r in range(B // 2)]
            for i in range(2)]
  assert not set(halves[0]) & set(halves[1]) and set(halves[0]) | set(halves[1]) == every


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
    ("process_count", RANDOM, dict(process_index=0, process_count=3)),
    ("rows", RANDOM, dict(rows=[0, B])),
    ("rows", RANDOM, dict(rows=[1, 1])),
    ("rows", RANDOM, dict(rows=[])),
    ("rows", RANDOM, dict(rows=[0], process_index=1, process_count=2)),
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
