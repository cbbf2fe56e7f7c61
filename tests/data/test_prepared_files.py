"""`prepare` never destroys a user's files, and shards changed after `prepare` wrote them are never read.

--overwrite removes only the files its directory's metadata.json lists, and refuses a directory holding a file
of a shard's or tokenizer's name that no metadata lists; a run that fails (a bad --eos_token, an error while
writing) leaves --out as it found it, so the corrected rerun is not refused; a shard or index whose bytes differ
from their sha256 in metadata.json is a ValueError naming the file when it is first read."""
import json
import pathlib
import shutil

import numpy as np
import pytest

from osdn_jax import data
from osdn_jax.data import prepare, tokens


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp("corpus")
  for i in range(6):
    (root / f"{i}.txt").write_text(f"document {i}: " + "the delta rule and its state " * (20 + i), encoding="utf-8")
  return root


def _run(corpus, out, spec="bytes", **kw):
  kw = {"validation": 0.0, "workers": 1, "progress": False, "verbose": False, **kw}
  return prepare.prepare([str(corpus / "*.txt")], spec, out, **kw)


def _files(out) -> dict:
  """Every file under out (hidden ones too), by its path relative to out, with its bytes."""
  out = pathlib.Path(out)
  return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


USER = {"model-00001.bin": b"weights", "model-00001.idx": b"index", "data-00000.bin": b"mine", "notes.txt": b"x"}


def _user_files(out):
  out.mkdir(parents=True, exist_ok=True)
  for name, content in USER.items():
    (out / name).write_bytes(content)


def test_overwrite_removes_only_the_files_its_metadata_lists(corpus, tmp_path):
  """A directory holding a user's *-NNNNN.bin/.idx files is accepted, and --overwrite replaces the earlier run's
  files (5 shards → 1) and leaves the user's, byte for byte."""
  out = tmp_path / "out"
  _user_files(out)
  first = _run(corpus, out, shard_tokens=200)
  assert len(first["splits"]["train"]["shards"]) > 2
  second = _run(corpus, out, overwrite=True)
  names = {f for s in second["splits"].values() for shard in s["shards"] for f in (shard["bin"], shard["idx"])}
  assert set(_files(out)) == set(USER) | names | {"metadata.json"}
  assert all(_files(out)[name] == content for name, content in USER.items())
  assert len(data.TokenDocuments(out)) == 6


def test_overwrite_refuses_a_shard_name_no_metadata_lists(corpus, tmp_path):
  """A train-00007.bin that metadata.json does not list (nor a tokenizer.json without a run) is not replaced: the
  run is refused naming it, the directory unchanged."""
  out = tmp_path / "out"
  _run(corpus, out)
  (out / "train-00007.bin").write_bytes(b"someone else's")
  before = _files(out)
  with pytest.raises(FileExistsError, match=r"train-00007\.bin.*metadata\.json does not list"):
    _run(corpus, out, overwrite=True)
  assert _files(out) == before
  alone = tmp_path / "alone"
  alone.mkdir()
  (alone / "tokenizer.json").write_text("{}")
  with pytest.raises(FileExistsError, match=r"tokenizer\.json"):
    _run(corpus, alone, overwrite=True)
  assert _files(alone) == {"tokenizer.json": b"{}"}


def test_a_failed_run_leaves_out_as_it_found_it(corpus, tmp_path, monkeypatch):
  """A bad --eos_token (after the tokenizer is copied) leaves no --out behind, so the corrected run is not refused;
  an error after the shards are written leaves a prepared directory holding a user's files as it was (the
  earlier run's files still readable)."""
  from osdn_jax.data.tokenizers import BPETokenizer
  tokenizer = tmp_path / "tok" / "tokenizer.json"
  tokenizer.parent.mkdir()
  BPETokenizer.train(["the delta rule and its state"] * 4, 300).save(tokenizer)
  out = tmp_path / "new" / "out"
  with pytest.raises(ValueError, match="no token '<nope>'"):
    _run(corpus, out, str(tokenizer), eos_token="<nope>")
  assert not (tmp_path / "new").exists()
  _run(corpus, out, str(tokenizer), eos_token="<eos>")          # the corrected run: no --overwrite needed

  kept = tmp_path / "kept"
  _user_files(kept)
  _run(corpus, kept)
  before = _files(kept)
  monkeypatch.setattr(prepare._Writer, "finish", lambda self: (_ for _ in ()).throw(OSError("disk full")))
  with pytest.raises(OSError, match="disk full"):
    _run(corpus, kept, "bpe:300", overwrite=True, shard_tokens=100)
  assert _files(kept) == before
  assert len(data.TokenDocuments(kept)) == 6


def _copy(prepared, tmp_path) -> pathlib.Path:
  copy = tmp_path / "copy"
  shutil.copytree(prepared, copy)
  return copy


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
  out = tmp_path_factory.mktemp("prepared") / "bytes"
  _run(corpus, out, shard_tokens=1500)             # 3 documents a shard
  return out


def test_a_shard_changed_after_prepare_is_named_when_first_read(prepared, tmp_path):
  """Bytes of train-00001.bin overwritten with other in-vocabulary ids (the size unchanged): the rows of other
  shards read, the first read of that shard is a ValueError naming it and its sha256; the pipeline's (the trainer's)
  first batches stop likewise."""
  copy = _copy(prepared, tmp_path)
  with open(copy / "train-00001.bin", "r+b") as f:
    f.seek(10)
    f.write(b"\x41\x00\x42\x00")                      # ids 65, 66: in the vocabulary, another text
  docs = data.TokenDocuments(copy)
  assert docs.shards[1]["bin"] == "train-00001.bin" and len(docs[0]) > 0       # shard 0 is intact
  first_of_shard_1 = int(docs._doc_base[1])
  with pytest.raises(ValueError, match=r"train-00001\.bin.*sha256.*metadata\.json"):
    docs[first_of_shard_1]
  pipe = data.make_pipeline(dict(source="tokens", path=str(copy), prefetch=0), seq_len=32, batch_size=4, seed=0)
  with pytest.raises(ValueError, match=r"train-00001\.bin.*sha256"):
    for _ in range(100):
      next(pipe)
  pipe.close()


def test_an_index_changed_after_prepare_is_named_when_opened(prepared, tmp_path):
  """An .idx whose boundaries moved within the shard (still a valid index) is a ValueError naming it."""
  copy = _copy(prepared, tmp_path)
  index = np.fromfile(copy / "train-00000.idx", tokens.INDEX_DTYPE)
  assert len(index) > 2
  index[1] += 1
  index.tofile(copy / "train-00000.idx")
  with pytest.raises(ValueError, match=r"train-00000\.idx.*sha256"):
    data.TokenDocuments(copy)


def test_hand_made_metadata_without_checksums_is_read(prepared, tmp_path):
  """Shards listed without their sha256 are read as they are (nothing to verify against)."""
  copy = _copy(prepared, tmp_path)
  meta = json.loads((copy / "metadata.json").read_text())
  for split in meta["splits"].values():
    for shard in split["shards"]:
      del shard["bin_sha256"], shard["idx_sha256"]
  (copy / "metadata.json").write_text(json.dumps(meta))
  docs = data.TokenDocuments(copy)
  assert sum(len(docs[j]) for j in range(len(docs))) == meta["splits"]["train"]["tokens"]
