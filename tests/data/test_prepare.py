"""Your own corpus: `python -m osdn_jax.data.prepare` (text → token shards) and the trainer's "tokens" source.

A tiny corpus in tmp_path (.txt, .jsonl, .jsonl.gz, with a record without the text field, a line that is not
UTF-8, a line that is not JSON, a text that is not a string, a blank line and an empty file): the skips counted by
reason; documents that decode back to their text in input order; byte-identical outputs from two runs (one with
two workers); the files of small batches through the segment cache and of one document at a time; the bytes,
bpe:N and tokenizer.json specs; a vocabulary too large for uint16; rows whose segments change exactly at document
boundaries; the config errors; and a few training steps on the shards."""
import functools
import gzip
import importlib.util
import json
import pathlib
import random
import subprocess
import sys

import numpy as np
import pytest

from osdn_jax import data
from osdn_jax.data import pipeline, prepare, segments, tokens
from osdn_jax.data.tokenizers import BPETokenizer

REPO = pathlib.Path(__file__).resolve().parents[2]
WORDS = ("the", "delta", "rule", "state", "naïve", "café", "日本語", "🙂", "key", "value", "gate", "and", "of",
         "linear", "attention", "chunk", "solve", "curvature", "precondition", "row")
# What the corpus skips, by reason (`corpus`).
SKIPS = {"missing_field": 1, "not_utf8": 1, "bad_json": 1, "not_string": 1, "blank_line": 1, "empty_file": 1}


def _doc(rng: random.Random, n: int) -> str:
  words = [rng.choice(WORDS) for _ in range(rng.randint(5, 120))]
  for i in range(0, len(words), 17):
    words[i] += "\n"
  return f"document {n}: " + " ".join(words) + "."


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """(directory, the documents' texts in input order): 2 .txt files, 40 .jsonl records and 25 .jsonl.gz records
  (6 skipped records or files, `SKIPS`)."""
  root = tmp_path_factory.mktemp("corpus")
  rng = random.Random(0)
  docs = [_doc(rng, n) for n in range(2 + 40 + 25)]
  (root / "a.txt").write_text(docs[0], encoding="utf-8")
  (root / "b.txt").write_text(docs[1], encoding="utf-8")
  (root / "empty.txt").write_bytes(b"")
  lines = [json.dumps({"text": t, "id": i}).encode() for i, t in enumerate(docs[2:42])]
  lines[3:3] = [json.dumps({"body": "no text field"}).encode(),             # missing_field
                b'{"text": "caf\xe9 in latin-1"}',                          # not_utf8
                b'{"text": "unterminated',                                  # bad_json
                json.dumps({"text": 17}).encode(),                          # not_string
                b"   "]                                                     # blank_line
  (root / "c.jsonl").write_bytes(b"\n".join(lines) + b"\n")
  (root / "d.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in docs[42:]).encode(),
                                                  mtime=0))
  return root, docs


def _run(corpus, out, spec="bytes", **kw):
  root, _ = corpus
  kw = {"validation": 0.0, "workers": 1, "progress": False, "verbose": False, **kw}
  return prepare.prepare([str(root / "*")], spec, out, **kw)


def _texts(out, split="train"):
  docs = data.TokenDocuments(out, split)
  tokenizer = tokens.load_tokenizer(out)
  return [tokenizer.decode(docs[j]) for j in range(len(docs))]


def _files(out) -> dict:
  return {p.name: p.read_bytes() for p in sorted(pathlib.Path(out).iterdir())}


@pytest.fixture(scope="module")
def tokenizer_json(corpus, tmp_path_factory):
  """A BPE tokenizer.json trained elsewhere (EOS "<eos>", found by name)."""
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  BPETokenizer.train(corpus[1][::2], 320).save(path)
  return path


# -- prepare --------------------------------------------------------------------------------------------------
def test_skips_are_counted_by_reason_and_printed(corpus, tmp_path, capsys):
  meta = _run(corpus, tmp_path / "out", verbose=True)
  reasons = {r: e["count"] for r, e in meta["skipped"]["reasons"].items()}
  assert reasons == SKIPS
  assert meta["skipped"]["count"] == sum(SKIPS.values())
  assert meta["skipped"]["reasons"]["missing_field"]["examples"] == [f"{corpus[0] / 'c.jsonl'}:4"]
  assert meta["skipped"]["reasons"]["empty_file"]["examples"] == [str(corpus[0] / "empty.txt")]
  assert meta["records"] == len(corpus[1]) + sum(SKIPS.values()) - SKIPS["empty_file"]
  train = meta["splits"]["train"]
  assert train["documents"] == len(corpus[1]) and meta["splits"]["validation"]["documents"] == 0
  assert train["tokens"] == train["text_bytes"] == sum(len(t.encode()) for t in corpus[1])
  assert [i["path"] for i in meta["inputs"]] == [str(corpus[0] / n) for n in
                                                 ("a.txt", "b.txt", "c.jsonl", "d.jsonl.gz", "empty.txt")]
  printed = capsys.readouterr().out
  for reason in SKIPS:
    assert reason in printed
  assert json.loads((tmp_path / "out" / "metadata.json").read_text()) == meta


@pytest.mark.parametrize("spec", ["bytes", "bpe:320", "tokenizer.json"])
def test_documents_decode_to_their_text_in_input_order(corpus, tokenizer_json, tmp_path, spec):
  spec = str(tokenizer_json) if spec == "tokenizer.json" else spec
  meta = _run(corpus, tmp_path / "out", spec)
  assert _texts(tmp_path / "out") == corpus[1]
  assert meta["eos_token"] == (None if spec == "bytes" else "<eos>") and meta["dtype"] == "uint16"
  if spec != "bytes":
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert meta["vocab_size"] == 320 and meta["eos_id"] == 0
  if spec == str(tokenizer_json):
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == tokenizer_json.read_bytes()


@pytest.mark.parametrize("spec", ["bytes", "bpe:320"])
def test_two_runs_are_byte_identical_whatever_the_workers(corpus, tmp_path, monkeypatch, spec):
  """Two runs, the second (for the BPE) with two workers and chunks of 3 records (so that chunks finish out of
  order): the same files, byte for byte, and the same metadata."""
  a = _run(corpus, tmp_path / "a", spec, validation=0.2, shard_tokens=3000)
  monkeypatch.setattr(prepare, "CHUNK_RECORDS", 3)
  b = _run(corpus, tmp_path / "b", spec, validation=0.2, shard_tokens=3000, workers=1 if spec == "bytes" else 2)
  assert a == b
  assert _files(tmp_path / "a") == _files(tmp_path / "b")
  assert len(a["splits"]["train"]["shards"]) > 1 and a["splits"]["validation"]["documents"] > 0


@pytest.mark.parametrize("spec", ["bpe:320", "tokenizer.json"])
def test_batches_write_the_files_of_one_document_at_a_time(corpus, tokenizer_json, tmp_path, monkeypatch, spec):
  """Chunks of 5 records through the segment cache (kept small, so that it misses, finds, skips segments too long
  to keep and starts afresh) write the files that encoding each document alone (`HFTokenizer.encode`) writes."""
  spec = str(tokenizer_json) if spec == "tokenizer.json" else spec
  monkeypatch.setattr(prepare, "CHUNK_RECORDS", 5)
  monkeypatch.setattr(segments, "SegmentCache", functools.partial(segments.SegmentCache, max_segments=40,
                                                                  max_bytes=6))
  calls = []
  monkeypatch.setattr(tokens.HFTokenizer, "encode_many", lambda self, texts, f=tokens.HFTokenizer.encode_many:
                      calls.append(len(texts)) or f(self, texts))
  batched = _run(corpus, tmp_path / "batched", spec, validation=0.2, shard_tokens=3000)
  assert len(calls) > 10 and max(calls) == 5

  def one_at_a_time(self, texts):
    ids = [self.encode(t) for t in texts]
    return np.concatenate(ids or [np.zeros(0, np.int32)]), np.array([len(i) for i in ids], np.int64)

  monkeypatch.setattr(tokens.HFTokenizer, "encode_many", one_at_a_time)
  assert _run(corpus, tmp_path / "alone", spec, validation=0.2, shard_tokens=3000) == batched
  assert _files(tmp_path / "batched") == _files(tmp_path / "alone")


def test_validation_split_partitions_the_documents(corpus, tmp_path):
  meta = _run(corpus, tmp_path / "out", validation=0.3, seed=1)
  train, validation = _texts(tmp_path / "out"), _texts(tmp_path / "out", "validation")
  assert 5 <= len(validation) <= 35 and sorted(train + validation) == sorted(corpus[1])
  for part in (train, validation):                         # each keeps the input order
    assert part == [t for t in corpus[1] if t in set(part)]
  assert meta["splits"]["validation"]["documents"] == len(validation)
  other = _run(corpus, tmp_path / "other", validation=0.3, seed=2)
  assert other["splits"]["validation"] != meta["splits"]["validation"]


def test_validation_input_makes_the_validation_split(corpus, tmp_path):
  root, docs = corpus
  meta = prepare.prepare([str(root / "*.txt"), str(root / "c.jsonl")], "bytes", tmp_path / "out",
                         validation_input=[str(root / "d.jsonl.gz")], workers=1, progress=False, verbose=False)
  assert _texts(tmp_path / "out", "validation") == docs[42:]
  assert _texts(tmp_path / "out") == docs[:42]
  assert meta["settings"]["validation"] is None


def test_vocabulary_must_fit_the_dtype(corpus, tmp_path):
  """A 70,000-word tokenizer: uint16 is an error naming the dtype; auto picks uint32 and stores the ids."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = {"<eos>": 0, "<unk>": 1, **{w: 2 + i for i, w in enumerate(sorted(set(" ".join(corpus[1]).split())))}}
  vocab.update({f"filler{i}": i for i in range(len(vocab), 70_000)})
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  path = tmp_path / "words.json"
  tok.save(str(path))
  with pytest.raises(ValueError, match="does not fit uint16"):
    _run(corpus, tmp_path / "u16", str(path), dtype="uint16")
  with pytest.raises(ValueError, match="does not fit uint16"):
    _run(corpus, tmp_path / "bpe", "bpe:70000", dtype="uint16")
  meta = _run(corpus, tmp_path / "auto", str(path))
  assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_000
  docs = data.TokenDocuments(tmp_path / "auto")
  assert docs[0].dtype == np.dtype("<u4")
  for j, text in enumerate(corpus[1]):
    np.testing.assert_array_equal(docs[j], tok.encode(text, add_special_tokens=False).ids)
  assert (tmp_path / "auto" / "train-00000.bin").stat().st_size == 4 * meta["splits"]["train"]["tokens"]


def test_refusals(corpus, tmp_path):
  """An earlier run's directory (without --overwrite), a glob of nothing, an unsupported file, a bad spec."""
  _run(corpus, tmp_path / "out")
  with pytest.raises(FileExistsError, match="--overwrite"):
    _run(corpus, tmp_path / "out")
  _run(corpus, tmp_path / "out", overwrite=True)
  with pytest.raises(ValueError, match="matches no file"):
    prepare.prepare([str(tmp_path / "nothing*.jsonl")], "bytes", tmp_path / "x", progress=False)
  (tmp_path / "notes.csv").write_text("a,b\n")
  with pytest.raises(ValueError, match="not a supported input"):
    prepare.prepare([str(tmp_path / "notes.csv")], "bytes", tmp_path / "x", progress=False)
  with pytest.raises(ValueError, match="bytes, bpe:N"):
    _run(corpus, tmp_path / "y", "wordpiece")


@pytest.mark.parametrize("suffix,package", [(".jsonl.zst", "zstandard"), (".parquet", "pyarrow"),
                                            (".model", "sentencepiece")])
def test_optional_formats_name_their_package(tmp_path, suffix, package):
  if importlib.util.find_spec(package):
    pytest.skip(f"{package} is installed")
  path = tmp_path / f"x{suffix}"
  path.write_bytes(b"")
  with pytest.raises(ImportError, match=f"pip install {package}"):
    if suffix == ".model":
      (tmp_path / "a.txt").write_text("text")
      prepare.prepare([str(tmp_path / "a.txt")], str(path), tmp_path / "out", progress=False)
    else:
      prepare.prepare([str(path)], "bytes", tmp_path / "out", progress=False)


def test_a_truncated_gzip_is_a_counted_skip(tmp_path):
  whole = gzip.compress("".join(json.dumps({"text": f"record {i} " * 50}) + "\n" for i in range(400)).encode())
  (tmp_path / "t.jsonl.gz").write_bytes(whole[:len(whole) // 2])
  meta = prepare.prepare([str(tmp_path / "t.jsonl.gz")], "bytes", tmp_path / "out", validation=0.0, workers=1,
                         progress=False, verbose=False)
  assert meta["skipped"]["reasons"]["corrupt_file"]["count"] == 1
  assert meta["splits"]["train"]["documents"] < 400


def test_command_line(corpus, tmp_path):
  """The CLI writes what the function writes, and prints the skips."""
  out = subprocess.run([sys.executable, "-m", "osdn_jax.data.prepare", f"--input={corpus[0] / '*'}",
                        "--tokenizer=bytes", f"--out={tmp_path / 'cli'}", "--validation=0.1", "--workers=1",
                        "--noprogress"], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
  assert "missing_field" in out.stdout and "MB/s per worker" in out.stdout
  _run(corpus, tmp_path / "api", validation=0.1)
  assert _files(tmp_path / "cli") == _files(tmp_path / "api")


# -- the tokens source ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
  out = tmp_path_factory.mktemp("prepared") / "bytes"
  _run(corpus, out, shard_tokens=2000)
  return out


def test_rows_are_the_stream_of_documents_with_eos(corpus, prepared):
  """Rows, in order, are the stream of documents each followed by EOS (across shards); `doc` changes exactly
  where a document starts, and every whole document in a row decodes to its text."""
  docs = corpus[1]
  length = 1001
  rows = data.TokenRows(prepared, "train", length)
  stream = np.concatenate([np.append(np.frombuffer(t.encode(), np.uint8), 0) for t in docs]).astype(np.int32)
  owner = np.repeat(np.arange(len(docs)), [len(t.encode()) + 1 for t in docs])
  assert len(rows) == len(stream) // length
  for i in range(len(rows)):
    row = rows[i]
    span = slice(i * length, (i + 1) * length)
    np.testing.assert_array_equal(row["ids"], stream[span])
    np.testing.assert_array_equal(row["doc"], owner[span] - owner[span][0])
  whole = [rows.tokenizer.decode(p) for i in range(len(rows))
           for p in np.split(rows[i]["ids"], np.flatnonzero(np.diff(rows[i]["doc"])) + 1)[1:-1]]
  assert len(whole) > 10 and all(text in docs for text in whole)


def test_pipeline_batches_mark_document_boundaries(prepared):
  """The pipeline's batches: a segment starts exactly after an EOS target, the loss is masked exactly at an EOS
  input, and the vocabulary is metadata.json's; a checkpointed position resumes exactly."""
  cfg = dict(source="tokens", path=str(prepared), prefetch=0)
  pipe = data.make_pipeline(cfg, seq_len=64, batch_size=4, seed=0)
  assert pipe.vocab_size == tokens.vocab_size(prepared) == 256 and pipe.eos_id == 0
  batches = [next(pipe) for _ in range(10)]
  state = pipe.get_state()
  following = next(pipe)
  pipe.set_state(state)
  np.testing.assert_array_equal(next(pipe)["tokens"], following["tokens"])
  pipe.close()
  for batch in batches:
    starts = batch["segment_ids"][:, 1:] != batch["segment_ids"][:, :-1]
    np.testing.assert_array_equal(starts, batch["targets"][:, :-1] == 0)
    np.testing.assert_array_equal(batch["loss_mask"], (batch["tokens"] != 0).astype(np.float32))


def test_config_errors_name_the_field(tmp_path):
  from osdn_jax.train import configs
  c = configs.get_config("tiny")
  c.data.source = "tokens"
  with pytest.raises(ValueError, match="`data.path`"):
    configs.validate(c)
  with pytest.raises(ValueError, match="`path`"):
    data.make_pipeline(dict(source="tokens"), seq_len=8, batch_size=1, seed=0)
  with pytest.raises(FileNotFoundError, match="metadata.json"):
    data.make_pipeline(dict(source="tokens", path=str(tmp_path)), seq_len=8, batch_size=1, seed=0)
  assert "tokens" in pipeline.SOURCES


def test_a_truncated_shard_is_named(prepared, tmp_path):
  import shutil
  copy = tmp_path / "copy"
  shutil.copytree(prepared, copy)
  with open(copy / "train-00001.bin", "r+b") as f:
    f.truncate(10)
  with pytest.raises(ValueError, match="train-00001.bin"):
    data.TokenRows(copy, "train", 65)


@pytest.mark.slow     # `make test`: evaluation on prepared token shards (tests/train/test_eval.py)
def test_a_few_training_steps_on_prepared_shards(prepared, tmp_path):
  from osdn_jax.train import configs, loop
  c = configs.get_config("tiny")
  c.data.source, c.data.path = "tokens", str(prepared)
  c.progress, c.async_checkpoint = False, False
  c.steps, c.log_every, c.checkpoint_every, c.diagnostics_every = 3, 1, 0, 0
  c.batch_size, c.seq_len, c.optimizer.warmup_steps = 2, 32, 1
  c.eval_every = 0      # the tiny corpus's validation split holds less than a row
  result = loop.run(c, tmp_path / "run")
  assert result.metrics["step"] == 3 and np.isfinite(result.metrics["loss"])
  assert result.model_config.vocab_size == 256


def test_zstd_and_parquet_inputs(corpus, tmp_path):
  """.jsonl.zst and .parquet (where their packages are installed) give the documents the .jsonl gives; a parquet
  file without the text column counts its rows as missing_field, and a null value as one."""
  root, docs = corpus
  zstandard, pq = pytest.importorskip("zstandard"), pytest.importorskip("pyarrow.parquet")
  import pyarrow as pa
  lines = "".join(json.dumps({"text": t}) + "\n" for t in docs[:10]).encode()
  (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
  pq.write_table(pa.table({"text": docs[10:20] + [None]}), tmp_path / "b.parquet", row_group_size=4)
  pq.write_table(pa.table({"body": ["x", "y"]}), tmp_path / "c.parquet")
  meta = prepare.prepare([str(tmp_path / "*.zst"), str(tmp_path / "*.parquet")], "bytes", tmp_path / "out",
                         validation=0.0, progress=False, verbose=False)
  assert _texts(tmp_path / "out") == docs[:20]
  assert meta["skipped"]["reasons"] == {"missing_field": {"count": 3, "examples": [
      f"{tmp_path / 'b.parquet'}:row 11", f"{tmp_path / 'c.parquet'}:row 1", f"{tmp_path / 'c.parquet'}:row 2"]}}
  whole = zstandard.ZstdCompressor().compress(lines * 20)
  (tmp_path / "t.jsonl.zst").write_bytes(whole[:len(whole) // 2])            # ends inside its frame
  meta = prepare.prepare([str(tmp_path / "t.jsonl.zst")], "bytes", tmp_path / "t", validation=0.0, progress=False,
                         verbose=False)
  assert meta["skipped"]["reasons"]["corrupt_file"]["count"] == 1
