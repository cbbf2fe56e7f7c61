"""A text corpus → token shards for the trainer (`--config.data.source=tokens --config.data.path=DIR`).

    python -m osdn_jax.data.prepare --input='corpus/*.jsonl.gz' --tokenizer=bpe:32000 --out=data/corpus
    python -m osdn_jax.train --config=340m --config.data.source=tokens --config.data.path=data/corpus --workdir=...

Inputs: every file the globs of --input match (`**` recurses; --input may repeat), read in sorted order:
  *.txt                one document per file (the whole file, as it is)
  *.jsonl, *.jsonl.gz  one JSON object per line; the document is its --text_field (default "text")
  *.jsonl.zst          likewise; needs the `zstandard` package
  *.parquet            one document per row of the --text_field column; needs `pyarrow`
Files are streamed (memory holds a few chunks of about 1 MiB per worker, never a file or the corpus). A
fraction --validation of the documents (default 0.005) goes to the validation split, chosen by a hash of each
record's index in the input order and --seed; --validation_input=GLOB takes the validation split from other files
instead (and all of --input goes to train).

Tokenizer SPEC (--tokenizer):
  bytes        UTF-8 bytes, ids 0..255, EOS 0 (`tokenizers.ByteTokenizer`)
  bpe:N        a byte-level BPE of N tokens trained on the training documents (`tokenizers.BPETokenizer.train`,
               EOS "<eos>" = 0; a first pass over the input, or its first --bpe_train_bytes of text)
  PATH.json    a HuggingFace `tokenizers` tokenizer.json
  PATH.model   a sentencepiece model; needs `sentencepiece`
EOS: --eos_token, else "<eos>" for bytes and bpe, else the first of `tokens.EOS_CANDIDATES` the tokenizer holds
(a sentencepiece model: its own eos id). Text is encoded without added special tokens, and text that spells a
special token is encoded as ordinary text. A chunk of documents is encoded in one call: through
`segments.SegmentCache` (each distinct word encoded once, then found again) for a BPE that pre-tokenizes with
GPT-2's byte-level regex (`segments.applies`: bpe:N's and GPT-2's family), else in one batch of the library.

Output in DIR:
  train-00000.bin, ...    the split's documents' token ids, concatenated: flat little-endian uint16 (vocabulary
  validation-00000.bin    ≤ 65536; --dtype=auto) or uint32; a shard closes after the document that brings it to
                          --shard_tokens tokens (a document never spans two shards)
  train-00000.idx, ...    beside each shard, uint64 little-endian [documents + 1]: document j is tokens
                          [idx[j], idx[j + 1]) of the shard
  tokenizer.json / .model the trained BPE, or a byte copy of the given tokenizer file
  metadata.json           written last (its presence means the directory is complete): format, tokenizer (spec,
                          kind, file, sha256), vocab_size, eos_id, eos_token, dtype, per split its documents,
                          tokens, text_bytes (UTF-8 bytes of its documents, for bits per byte) and shards (files,
                          sizes, sha256), skipped records by reason with their count and first examples, the
                          inputs (path, bytes, sha256 of each file's bytes as stored) and the sha256 of all of
                          their bytes in order, the settings and their sha256, and a fingerprint of both
DIR may hold other files. A run refuses a DIR holding a file of a name it writes unless --overwrite, which deletes
only the files DIR/metadata.json lists (and refuses such a name that it does not list). The run writes into a
hidden DIR/.prepare-* directory and moves its files into place once it has finished (the earlier run's removed
first, metadata.json last): a run that fails leaves DIR as it found it (tests/data/test_prepared_files.py). A run
killed at any moment is tidied by the next run on DIR: its working directory removed, or, where it had begun to
move its files, the move finished first (tests/data/test_prepare_crash.py). The
readers (`tokens`) verify each shard's and index's sha256 when they first read it.
No separator token is stored: the index records the document boundaries, and the reader (`tokens.TokenRows`)
appends EOS to each document as it cuts rows, so the text source's row layout is kept while a different
separator (or none) needs no new pass over the corpus.

Why flat arrays and an index rather than records (array_record, TFRecord, parquet): a training row is a fixed
slice of a split's token stream that crosses document boundaries, so the natural unit of access is a token
offset, not a record. A flat array gives that slice in O(1) with a numpy memmap: no decoding, no per-record
framing, pages read only as rows touch them, and grain reads it through a plain RandomAccessDataSource
(`tokens.TokenRows`). The index costs 8 bytes per document and is read into memory; the files are readable by
any tool (numpy, torch, nanoGPT's and Megatron's loaders read the same layout), and the format has no
dependency beyond numpy.

Promises (tests/data/test_prepare.py): the same inputs and settings give byte-identical files, whatever --workers (a
chunk's tokens are written in input order, not in the order the workers finish); every record the input holds
is either a document or a counted skip, never dropped silently. Skip reasons (`SKIP_REASONS`): empty_file,
blank_line, bad_json, not_object, missing_field, not_string, not_utf8, empty_text, no_tokens, corrupt_file; they
go to metadata.json with their first examples (file:line) and are printed at the end. A vocabulary that does not
fit --dtype is an error before anything is written.
"""
from __future__ import annotations

import array
import collections
import dataclasses
import fcntl
import glob as glob_lib
import gzip
import hashlib
import io
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator, Sequence

import numpy as np

from osdn_jax import cli
from osdn_jax.data import tokens as tokens_lib

SUFFIXES = {".txt": "txt", ".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".jsonl.zst": "jsonl", ".parquet": "parquet"}
SKIP_REASONS = {
    "empty_file": "a file of no bytes, or a .jsonl / .parquet file of no records",
    "blank_line": "an empty (or all-whitespace) line of a .jsonl",
    "bad_json": "a .jsonl line that is not JSON",
    "not_object": "a .jsonl line whose JSON is not an object",
    "missing_field": "a record without the text field (or null there; a parquet file without the column)",
    "not_string": "a text field that is not a string",
    "not_utf8": "bytes that are not UTF-8 (a .txt file, a .jsonl line), or a JSON string with a lone surrogate",
    "empty_text": "an empty text",
    "no_tokens": "a text the tokenizer encodes as no tokens",
    "corrupt_file": "a compressed file that is damaged or ends early (the records before the damage are kept)",
}
EXAMPLES = 5                       # examples kept per skip reason
CHUNK_BYTES = 1 << 20              # a task for a worker: records of about this many bytes...
CHUNK_RECORDS = 4096               # ...or this many records
DEFAULT_SHARD_TOKENS = 1 << 28
DEFAULT_VALIDATION = 0.005
WORK_PREFIX = ".prepare-"          # a run's working directory in out
JOURNAL = ".install.json"          # in it, once its files are being moved into place: the earlier files to remove
# The names of the files a run writes (`_earlier_run`): shards, indexes, a tokenizer, the metadata.
_OUTPUT_NAME = re.compile(rf"^(?:(?:{'|'.join(tokens_lib.SPLITS)})-[0-9]{{5}}\.(?:bin|idx)|tokenizer\.json|"
                          rf"tokenizer\.model|{re.escape(tokens_lib.METADATA)})$")


def _kind(path: pathlib.Path) -> str | None:
  name = path.name.lower()
  for suffix in sorted(SUFFIXES, key=len, reverse=True):
    if name.endswith(suffix):
      return SUFFIXES[suffix]
  return None


def expand(patterns: Sequence[str], flag: str = "--input") -> list[pathlib.Path]:
  """The files the globs match, sorted by path, each once. `cli.UsageError` (a ValueError) for a glob that
  matches nothing, a directory, or a file of an unsupported kind; ImportError naming the package a .zst or
  .parquet file needs."""
  if isinstance(patterns, (str, os.PathLike)):
    patterns = [patterns]
  files = set()
  for pattern in patterns:
    matches = sorted(glob_lib.glob(os.fspath(pattern), recursive=True))
    if not matches:
      raise cli.UsageError(f"prepare: {flag}={pattern} matches no file")
    for match in map(pathlib.Path, matches):
      if match.is_dir():
        raise cli.UsageError(f"prepare: {flag}={pattern} matches the directory {match}; use a glob of files such "
                             f"as '{match}/**/*.jsonl'")
      if _kind(match) is None:
        raise cli.UsageError(f"prepare: {match} is not a supported input ({', '.join(SUFFIXES)})")
      if match.name.lower().endswith(".zst"):
        tokens_lib.require("zstandard", f"prepare: {match} (.zst)")
      if _kind(match) == "parquet":
        tokens_lib.require("pyarrow", f"prepare: {match} (.parquet)")
      files.add(match)
  return sorted(files, key=str)


# -- reading --------------------------------------------------------------------------------------------------
class _Tap(io.RawIOBase):
  """A binary file read through a sha256 (of the file's bytes as stored), a byte count and a progress bar."""

  def __init__(self, file, hashes, bar):
    self._file, self._hashes, self._bar = file, hashes, bar
    self.count = 0

  def readable(self) -> bool:
    return True

  def readinto(self, buffer) -> int:
    n = self._file.readinto(buffer)
    if n:
      view = memoryview(buffer)[:n]
      for h in self._hashes:
        h.update(view)
      self.count += n
      self._bar.update(n)
    return n

  def drain(self) -> None:
    """Reads the rest of the file (what a decompressor left), so that the hash covers all of it."""
    buffer = bytearray(1 << 20)
    while self.readinto(buffer):
      pass


class _Zstd(io.RawIOBase):
  """The decompressed bytes of a zstd stream of one or more frames; EOFError where it ends inside a frame (a
  truncated file, which zstandard's stream_reader would end quietly)."""

  def __init__(self, source):
    import zstandard
    self._new = lambda: zstandard.ZstdDecompressor().decompressobj()
    self._source, self._decompressor, self._out, self._inside = source, self._new(), bytearray(), False

  def readable(self) -> bool:
    return True

  def readinto(self, buffer) -> int:
    while not self._out:
      data = self._source.read(1 << 20)
      if not data:
        if self._inside:
          raise EOFError("the zstd stream ends inside a frame")
        return 0
      while data:
        self._out += self._decompressor.decompress(data)
        self._inside = not self._decompressor.eof
        data = b""
        if self._decompressor.eof:                 # a frame ended: the rest is the next frame's
          data = self._decompressor.unused_data
          self._decompressor = self._new()
    n = min(len(buffer), len(self._out))
    buffer[:n] = self._out[:n]
    del self._out[:n]
    return n


@dataclasses.dataclass
class _Chunk:
  """Records of one file: kind "txt" (items: the file's bytes), "jsonl" (lines, bytes), "parquet" (values)."""
  kind: str
  path: str
  items: list
  first_line: int                  # the line (jsonl), row (parquet) number of items[0], 1-based; 0 for txt


class _Skips:
  def __init__(self):
    self.counts: dict[str, int] = collections.Counter()
    self.examples: dict[str, list[str]] = collections.defaultdict(list)

  def add(self, reason: str, where: str, count: int = 1) -> None:
    self.counts[reason] += count
    if len(self.examples[reason]) < EXAMPLES:
      self.examples[reason].append(where)

  def to_json(self) -> dict:
    return {"count": int(sum(self.counts.values())),
            "reasons": {r: {"count": int(self.counts[r]), "examples": self.examples[r]} for r in sorted(self.counts)}}


def _where(chunk: _Chunk, i: int) -> str:
  if chunk.kind == "txt":
    return chunk.path
  return f"{chunk.path}:{'row ' if chunk.kind == 'parquet' else ''}{chunk.first_line + i}"


def _chunks(path: pathlib.Path, text_field: str, skips: _Skips | None, hashes: list, bar) -> Iterator[_Chunk]:
  """The file's records in chunks. Empty and corrupt files are counted in `skips` (None: not counted)."""
  kind, name = _kind(path), str(path)
  skip = skips.add if skips is not None else (lambda *a, **k: None)
  if kind == "parquet":
    yield from _parquet_chunks(path, text_field, skip, hashes, bar)
    return
  with open(path, "rb", buffering=0) as raw:
    tap = _Tap(raw, hashes, bar)
    if kind == "txt":
      data = io.BufferedReader(tap, 1 << 20).read()
      if data:
        yield _Chunk("txt", name, [data], 0)
      else:
        skip("empty_file", name)
      return
    lower = name.lower()
    buffered = io.BufferedReader(tap, 1 << 20)
    if lower.endswith(".gz"):
      stream = gzip.GzipFile(fileobj=buffered, mode="rb")
      errors = (OSError, EOFError, zlib.error)
    elif lower.endswith(".zst"):
      import zstandard
      stream = io.BufferedReader(_Zstd(buffered), 1 << 20)
      errors = (OSError, EOFError, zstandard.ZstdError)
    else:
      stream, errors = buffered, ()
    items, size, first, line, corrupt = [], 0, 1, 0, False
    try:
      for record in stream:
        line += 1
        items.append(record)
        size += len(record)
        if size >= CHUNK_BYTES or len(items) >= CHUNK_RECORDS:
          yield _Chunk("jsonl", name, items, first)
          items, size, first = [], 0, line + 1
    except errors as e:
      skip("corrupt_file", f"{name}: {type(e).__name__}: {e} (after line {line})")
      corrupt = True
    if items:
      yield _Chunk("jsonl", name, items, first)
    elif line == 0 and not corrupt:
      skip("empty_file", name)
    tap.drain()


def _parquet_chunks(path: pathlib.Path, text_field: str, skip, hashes: list, bar) -> Iterator[_Chunk]:
  import pyarrow.parquet as pq
  with open(path, "rb", buffering=0) as raw:       # the file's bytes, for its sha256
    tap = _Tap(raw, hashes, bar)
    tap.drain()
  name = str(path)
  file = pq.ParquetFile(path)
  rows = file.metadata.num_rows
  if rows == 0:
    skip("empty_file", name)
    return
  if text_field not in file.schema_arrow.names:
    for first in range(0, rows, CHUNK_RECORDS):
      yield _Chunk("parquet", name, [None] * min(CHUNK_RECORDS, rows - first), first + 1)
    return
  first = 1
  for batch in file.iter_batches(batch_size=CHUNK_RECORDS, columns=[text_field]):
    values = batch.column(0).to_pylist()
    yield _Chunk("parquet", name, values, first)
    first += len(values)


def _text(kind: str, item, text_field: str) -> tuple[str | None, bytes | None, str | None]:
  """(text, its UTF-8 bytes, None) for a record that is a document, else (None, None, skip reason)."""
  if kind == "txt":
    try:
      text = item.decode("utf-8")
    except UnicodeDecodeError:
      return None, None, "not_utf8"
    return (text, item, None) if text else (None, None, "empty_text")
  if kind == "jsonl":
    if not item.strip():
      return None, None, "blank_line"
    try:
      line = item.decode("utf-8")
    except UnicodeDecodeError:
      return None, None, "not_utf8"
    try:
      record = json.loads(line)
    except ValueError:
      return None, None, "bad_json"
    if not isinstance(record, dict):
      return None, None, "not_object"
    item = record.get(text_field)
  if item is None:
    return None, None, "missing_field"
  if not isinstance(item, str):
    return None, None, "not_string"
  if not item:
    return None, None, "empty_text"
  try:
    return item, item.encode("utf-8"), None
  except UnicodeEncodeError:
    return None, None, "not_utf8"


# -- tokenizing (in this process or in workers) ---------------------------------------------------------------
class _Encoder:
  """Records → token ids, in a worker or in this process. desc: {"kind": "bytes"} or {"kind": "hf" |
  "sentencepiece", "file": ..., "eos_token": ...}."""

  def __init__(self, desc: dict, dtype: str, vocab_size: int, text_field: str):
    self.kind, self.dtype, self.vocab_size, self.text_field = desc["kind"], DTYPES[dtype], vocab_size, text_field
    if self.kind == "hf":
      self.tokenizer = tokens_lib.HFTokenizer(desc["file"], desc["eos_token"])
    elif self.kind == "sentencepiece":
      self.tokenizer = tokens_lib.SentencePieceTokenizer(desc["file"], desc["eos_token"])

  def __call__(self, kind: str, items: list):
    """(tokens [Σ lengths] of dtype, lengths int64 [records] (−1: skipped), skip reasons [records] (None:
    a document), text bytes int64 [records])."""
    parsed = [_text(kind, item, self.text_field) for item in items]
    reasons = [r for _, _, r in parsed]
    good = np.array([i for i, r in enumerate(reasons) if r is None], np.int64)
    ids, counts = self._encode([parsed[i][1 if self.kind == "bytes" else 0] for i in good])
    empty = good[counts == 0]
    for i in empty:
      reasons[i] = "no_tokens"
    lengths = np.full(len(items), -1, np.int64)
    lengths[good] = counts
    lengths[empty] = -1
    text_bytes = np.zeros(len(items), np.int64)
    text_bytes[good] = [len(parsed[i][1]) for i in good]
    text_bytes[empty] = 0
    if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
      raise ValueError(f"prepare: the tokenizer gave id {int(ids.max())} outside its vocabulary [0, "
                       f"{self.vocab_size})")
    return ids.astype(self.dtype), lengths, reasons, text_bytes

  def _encode(self, texts: list) -> tuple[np.ndarray, np.ndarray]:
    """(ids [Σ counts] int, counts int64 [documents]) of the documents (bytes: their UTF-8 bytes, else str)."""
    if self.kind == "bytes":
      return np.frombuffer(b"".join(texts), np.uint8), np.fromiter(map(len, texts), np.int64, len(texts))
    return self.tokenizer.encode_many(texts)


DTYPES = tokens_lib.DTYPES
_WORKER: _Encoder | None = None


def _init_worker(desc, dtype, vocab_size, text_field) -> None:
  os.environ["TOKENIZERS_PARALLELISM"] = "false"   # one thread per worker: the workers are the parallelism
  global _WORKER
  _WORKER = _Encoder(desc, dtype, vocab_size, text_field)


def _work(task):
  return _WORKER(*task)


# -- writing --------------------------------------------------------------------------------------------------
class _Writer:
  """One split's shards: documents appended in order, a shard closed after the document that brings it to
  shard_tokens tokens."""

  def __init__(self, out: pathlib.Path, split: str, dtype: str, shard_tokens: int):
    self.out, self.split, self.dtype, self.shard_tokens = out, split, DTYPES[dtype], shard_tokens
    self.shards: list[dict] = []
    self.documents = self.tokens = self.text_bytes = 0
    self._file = None

  def _open(self) -> None:
    self._bin, self._idx = tokens_lib.shard_files(self.split, len(self.shards))
    self._file = open(self.out / self._bin, "wb")
    self._sha = hashlib.sha256()
    self._offsets = array.array("Q", [0])             # 8 bytes a document

  def _close(self) -> None:
    self._file.close()
    self._file = None
    index = np.frombuffer(self._offsets, np.uint64).astype(tokens_lib.INDEX_DTYPE)
    index.tofile(self.out / self._idx)
    self.shards.append({"bin": self._bin, "idx": self._idx, "documents": len(index) - 1,
                        "tokens": int(index[-1]), "bin_sha256": self._sha.hexdigest(),
                        "idx_sha256": hashlib.sha256(index.tobytes()).hexdigest()})

  def add(self, ids: np.ndarray, lengths: np.ndarray, text_bytes: int) -> None:
    """Documents: ids (their tokens, concatenated, of the shard dtype) and lengths (each ≥ 1)."""
    self.documents += len(lengths)
    self.tokens += int(lengths.sum())
    self.text_bytes += int(text_bytes)
    ends = np.cumsum(lengths)
    done = 0                                            # documents written
    while done < len(lengths):
      if self._file is None:
        self._open()
      base = self._offsets[-1]
      start = int(ends[done - 1]) if done else 0
      # Documents done..k fit (k: the first that brings the shard to shard_tokens, else the last).
      cross = np.flatnonzero(base + ends[done:] - start >= self.shard_tokens)
      k = done + (int(cross[0]) if cross.size else len(lengths) - done - 1)
      data = memoryview(ids[start:int(ends[k])]).cast("B")
      self._file.write(data)
      self._sha.update(data)
      self._offsets.frombytes((base + ends[done:k + 1] - start).astype(np.uint64).tobytes())
      done = k + 1
      if cross.size:
        self._close()

  def finish(self) -> dict:
    if self._file is not None:
      self._close()
    return {"documents": self.documents, "tokens": self.tokens, "text_bytes": self.text_bytes,
            "shards": self.shards}


# -- the tokenizer --------------------------------------------------------------------------------------------
def _in_validation(index: int, seed: int, fraction: float) -> bool:
  """Whether record `index` (its position in the input order) goes to the validation split."""
  if fraction <= 0:
    return False
  digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little") < fraction * 2.0**64


def _sha256_file(path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _training_texts(files, text_field, seed, validation, limit, bar) -> Iterator[str]:
  """The texts of the training documents in input order (the first `limit` bytes' worth; 0: all)."""
  index, seen = 0, 0
  for path in files:
    for chunk in _chunks(path, text_field, None, [], bar):
      for item in chunk.items:
        text, data, reason = _text(chunk.kind, item, text_field)
        if reason is None and not _in_validation(index, seed, validation):
          yield text
          seen += len(data)
          if limit and seen >= limit:
            return
        index += 1


def _check_spec(spec: str, eos_token: str, out: pathlib.Path) -> None:
  """UsageError for a --tokenizer SPEC (module docstring) that names no tokenizer, or an --eos_token that does not
  apply to it; FileNotFoundError for a tokenizer file that does not exist; ImportError for its missing package."""
  if spec in ("bytes", "byte") or spec.startswith("bpe:"):
    if spec.startswith("bpe:") and (not spec[4:].isdigit() or int(spec[4:]) < 257):
      raise cli.UsageError(f"prepare: --tokenizer={spec}: the BPE's size must be an int ≥ 257 (256 bytes and EOS)")
    if eos_token:
      raise cli.UsageError(f"prepare: --eos_token does not apply to --tokenizer={spec} (its EOS is "
                           f"{'0' if spec.startswith('byte') else '<eos> = 0'})")
    return
  if not spec.endswith((".json", ".model")):
    raise cli.UsageError(f"prepare: --tokenizer={spec!r}: expected bytes, bpe:N, a tokenizer.json path or a "
                         "sentencepiece .model path")
  kind = "tokenizer.json" if spec.endswith(".json") else "sentencepiece model"
  if not pathlib.Path(spec).is_file():
    raise FileNotFoundError(f"prepare: --tokenizer={spec}: no such {kind}")
  if pathlib.Path(spec).resolve().parent == out.resolve():
    raise cli.UsageError(f"prepare: --tokenizer={spec} lies in --out={out}, whose files a run replaces; copy it "
                         "elsewhere first")
  if spec.endswith(".json"):
    tokens_lib.require("tokenizers", "prepare: a tokenizer.json")
  else:
    tokens_lib.require("sentencepiece", "prepare: a sentencepiece .model tokenizer")


def _tokenizer(spec: str, out: pathlib.Path, eos_token: str, files, text_field, seed, validation,
               bpe_train_bytes, progress) -> tuple[dict, dict, object]:
  """(worker description, metadata["tokenizer"] with eos, the tokenizer) for SPEC; trains or copies into out."""
  if spec in ("bytes", "byte"):
    from osdn_jax.data.tokenizers import ByteTokenizer
    return {"kind": "bytes"}, {"spec": spec, "kind": "bytes", "file": None, "sha256": None,
                               "eos_token": None}, ByteTokenizer()
  if spec.startswith("bpe:"):
    size = int(spec[4:])
    from osdn_jax.data.tokenizers import BPETokenizer
    from tqdm import tqdm
    total = sum(p.stat().st_size for p in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"train {spec}", disable=not progress,
              file=sys.stderr) as bar:
      trained = BPETokenizer.train(_training_texts(files, text_field, seed, validation, bpe_train_bytes, bar), size)
    trained.save(out / "tokenizer.json")
    kind, file, eos_token = "bpe", "tokenizer.json", BPETokenizer.EOS
  elif spec.endswith(".json"):
    source = pathlib.Path(spec)
    eos_token = eos_token or tokens_lib.HFTokenizer.find_eos(source)
    if eos_token is None:
      raise ValueError(f"prepare: the tokenizer {spec} holds none of {', '.join(tokens_lib.EOS_CANDIDATES)}; "
                       "name its end-of-text token with --eos_token")
    shutil.copyfile(source, out / "tokenizer.json")
    kind, file = "tokenizer.json", "tokenizer.json"
  else:
    shutil.copyfile(spec, out / "tokenizer.model")
    kind, file, eos_token = "sentencepiece", "tokenizer.model", eos_token or None
  desc = {"kind": "sentencepiece" if kind == "sentencepiece" else "hf", "file": str(out / file),
          "eos_token": eos_token}
  tokenizer = (tokens_lib.SentencePieceTokenizer if kind == "sentencepiece" else tokens_lib.HFTokenizer)(
      out / file if kind == "bpe" else spec, eos_token)          # a given tokenizer's errors name its path
  if tokenizer.eos_id is None:
    raise ValueError(f"prepare: the sentencepiece model {spec} has no eos id; name its end-of-text piece with "
                     "--eos_token")
  info = {"spec": spec, "kind": kind, "file": file, "sha256": _sha256_file(out / file), "eos_token": eos_token}
  return desc, info, tokenizer


def _dtype(requested: str, vocab_size: int) -> str:
  if requested == "auto":
    return "uint16" if vocab_size <= 1 << 16 else "uint32"
  if vocab_size > 1 << (8 * DTYPES[requested].itemsize):
    raise ValueError(f"prepare: a vocabulary of {vocab_size} tokens does not fit {requested} (ids up to "
                     f"{(1 << (8 * DTYPES[requested].itemsize)) - 1}); use --dtype=uint32 or --dtype=auto")
  return requested


def _earlier_run(out: pathlib.Path, overwrite: bool) -> list[pathlib.Path]:
  """The files of an earlier run that this one replaces: those out's metadata.json lists (of the names prepare
  writes; no other file is ever removed), metadata.json first.
  FileExistsError, before anything is written: without overwrite, for a directory holding any file of a name
  prepare writes (`_OUTPUT_NAME`); with it, for such a file that metadata.json does not list (another program's,
  or a run's that did not finish), and for a metadata.json that cannot be read."""
  if out.exists() and not out.is_dir():
    raise FileExistsError(f"prepare: --out={out} is a file; name a directory (a new one, or a prepared one with "
                          "--overwrite)")
  present = sorted(p.name for p in out.iterdir() if _OUTPUT_NAME.match(p.name)) if out.is_dir() else []
  if not present:
    return []
  if not overwrite:
    raise FileExistsError(f"prepare: {out} already holds prepared files ({present[0]}, ...); pass --overwrite "
                          "to replace them, or choose another --out")
  listed = {tokens_lib.METADATA: None}
  if (out / tokens_lib.METADATA).is_file():
    try:
      listed.update(dict.fromkeys(tokens_lib.listed_files(tokens_lib.read_metadata(out))))
    except (ValueError, KeyError, TypeError) as e:
      raise FileExistsError(f"prepare: --overwrite replaces only the files {out / tokens_lib.METADATA} lists, and "
                            f"it cannot be read ({e}); remove the directory's files yourself or choose another "
                            "--out") from None
  if stray := [name for name in present if name not in listed]:
    raise FileExistsError(f"prepare: {out} holds {stray[0]}, which its {tokens_lib.METADATA} does not list"
                          f"{'' if (out / tokens_lib.METADATA).is_file() else ' (there is none)'}; --overwrite "
                          "replaces only the files of the run metadata.json describes: move it away, or choose "
                          "another --out")
  return [out / name for name in listed if _OUTPUT_NAME.match(name) and (out / name).exists()]


def _missing_parents(out: pathlib.Path) -> list[pathlib.Path]:
  """out and those of its parents that do not exist, innermost first: what making out creates."""
  missing = []
  for p in (out, *out.parents):
    if p.exists():
      break
    missing.append(p)
  return missing


def _hold(work: pathlib.Path) -> int:
  """Locks the run's working directory (flock on its descriptor, released when the process ends, however it
  ends); returns the descriptor. `_recover` leaves a locked one alone."""
  fd = os.open(work, os.O_RDONLY)
  fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  return fd


def _recover(out: pathlib.Path) -> None:
  """Tidies the working directories of runs that were stopped (killed) in out: one whose move into place had begun
  (it holds `JOURNAL`) is finished (`_finish_install`), any other is removed. A directory a running run holds
  (`_hold`) is left alone."""
  if not out.is_dir():
    return
  for work in sorted(out.glob(WORK_PREFIX + "*")):
    if not work.is_dir():
      continue
    fd = os.open(work, os.O_RDONLY)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      os.close(fd)
      continue                                   # a run in progress
    try:
      if (work / JOURNAL).is_file():
        _finish_install(work, out)
        print(f"prepare: finished moving the files of a run stopped while moving them into {out}",
              file=sys.stderr)
      else:
        shutil.rmtree(work)
        print(f"prepare: removed {work.name}, the working directory of a run that did not finish",
              file=sys.stderr)
    finally:
      os.close(fd)


def _install(work: pathlib.Path, out: pathlib.Path, earlier: list[pathlib.Path]) -> None:
  """Moves a finished run's files from work into out, in place of the earlier run's: metadata.json last. The
  earlier files that no file of this run replaces are written to `JOURNAL` first, so that a run stopped midway is
  finished by the next (`_recover`)."""
  names = {p.name for p in work.iterdir()}
  remove = sorted(p.name for p in earlier if p.name not in names)
  temporary = work / (JOURNAL + ".tmp")
  temporary.write_text(json.dumps({"remove": remove}), encoding="utf-8")
  os.replace(temporary, work / JOURNAL)
  _finish_install(work, out)


def _finish_install(work: pathlib.Path, out: pathlib.Path) -> None:
  """The move `_install` began (again from the start: each step can be repeated): out's metadata.json removed
  while work still holds the new one, the earlier files `JOURNAL` names removed, work's files moved into out,
  metadata.json last; then work removed."""
  remove = json.loads((work / JOURNAL).read_text(encoding="utf-8"))["remove"]
  if (work / tokens_lib.METADATA).is_file():
    (out / tokens_lib.METADATA).unlink(missing_ok=True)
  for name in remove:
    if _OUTPUT_NAME.match(name):
      (out / name).unlink(missing_ok=True)
  for path in sorted(work.iterdir()):
    if path.name not in (tokens_lib.METADATA, JOURNAL):
      os.replace(path, out / path.name)
  if (work / tokens_lib.METADATA).is_file():
    os.replace(work / tokens_lib.METADATA, out / tokens_lib.METADATA)
  (work / JOURNAL).unlink()
  work.rmdir()


# -- the whole run ---------------------------------------------------------------------------------------------
def prepare(inputs: Sequence[str] | str, tokenizer: str, out, *, text_field: str = "text",
            validation: float = DEFAULT_VALIDATION, validation_input: Sequence[str] | str | None = None,
            seed: int = 0, workers: int = 1, dtype: str = "auto", shard_tokens: int = DEFAULT_SHARD_TOKENS,
            eos_token: str = "", bpe_train_bytes: int = 0, overwrite: bool = False, progress: bool = True,
            verbose: bool = True) -> dict:
  """Tokenizes the corpus into `out` (module docstring) and returns its metadata (what metadata.json holds).
  workers: processes that tokenize (1: this one; 0: one per CPU; bytes are always encoded in this process); the
  output does not depend on it. verbose: print the summary (`summary`) at the end."""
  start = time.perf_counter()
  if not isinstance(text_field, str) or not text_field:
    raise cli.UsageError(f"prepare: --text_field must be a non-empty string, got {text_field!r}")
  if not isinstance(validation, (int, float)) or not 0 <= validation < 1:
    raise cli.UsageError(f"prepare: --validation must be a fraction in [0, 1), got {validation!r}")
  for name, value, minimum in (("seed", seed, 0), ("workers", workers, 0), ("shard_tokens", shard_tokens, 1),
                               ("bpe_train_bytes", bpe_train_bytes, 0)):
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
      raise cli.UsageError(f"prepare: --{name} must be an int ≥ {minimum}, got {value!r}")
  if dtype != "auto" and dtype not in DTYPES:
    raise cli.UsageError(f"prepare: --dtype must be auto, uint16 or uint32, got {dtype!r}")
  workers = workers or os.cpu_count() or 1
  files = expand(inputs)
  validation_files = expand(validation_input, "--validation_input") if validation_input else []
  if both := set(files) & set(validation_files):
    raise cli.UsageError(f"prepare: {sorted(both)[0]} is matched by both --input and --validation_input")
  fraction = 0.0 if validation_files else float(validation)
  out = pathlib.Path(out)
  _check_spec(tokenizer, eos_token, out)
  if tokenizer.startswith("bpe:") and dtype == "uint16" and int(tokenizer[4:]) > 1 << 16:
    raise cli.UsageError(f"prepare: a vocabulary of {tokenizer[4:]} tokens does not fit uint16 (ids up to 65535); "
                         "use --dtype=uint32 or --dtype=auto")
  _recover(out)
  earlier = _earlier_run(out, overwrite)
  created = _missing_parents(out)
  out.mkdir(parents=True, exist_ok=True)
  # The run writes into a hidden directory of out, whose files replace the earlier run's once it has finished: a
  # run that fails leaves out as it found it, and one that is killed is tidied by the next (`_recover`).
  work = pathlib.Path(tempfile.mkdtemp(prefix=WORK_PREFIX, dir=out))
  held = _hold(work)
  try:
    metadata, workers = _write(work, files, validation_files, tokenizer, eos_token=eos_token,
                               text_field=text_field, seed=seed, fraction=fraction, workers=workers, dtype=dtype,
                               shard_tokens=shard_tokens, bpe_train_bytes=bpe_train_bytes, progress=progress)
    _install(work, out, earlier)
  except BaseException:
    shutil.rmtree(work, ignore_errors=True)
    for path in created:                         # the directories this run made, innermost first
      try:
        path.rmdir()
      except OSError:
        break
    raise
  finally:
    os.close(held)
  if verbose:
    print(summary(metadata, out, seconds=time.perf_counter() - start, workers=workers))
  return metadata


def _write(out: pathlib.Path, files, validation_files, tokenizer: str, *, eos_token, text_field, seed, fraction,
           workers, dtype, shard_tokens, bpe_train_bytes, progress) -> tuple[dict, int]:
  """Writes the run's files into out (`prepare`'s working directory); returns the metadata and the workers that
  tokenized."""
  desc, info, tok = _tokenizer(tokenizer, out, eos_token, files, text_field, seed, fraction, bpe_train_bytes,
                               progress)
  vocab_size = int(tok.vocab_size)
  dtype = _dtype(dtype, vocab_size)

  settings = {"tokenizer": tokenizer, "tokenizer_sha256": info["sha256"], "eos_token": info["eos_token"],
              "text_field": text_field, "validation": None if validation_files else fraction,
              "validation_input": bool(validation_files), "seed": seed, "dtype": dtype,
              "shard_tokens": shard_tokens, "bpe_train_bytes": bpe_train_bytes if info["kind"] == "bpe" else None,
              "format": [tokens_lib.FORMAT, tokens_lib.VERSION]}
  if info["kind"] == "bpe":
    import tokenizers
    settings["tokenizers_version"] = tokenizers.__version__

  writers = {s: _Writer(out, s, dtype, shard_tokens) for s in tokens_lib.SPLITS}
  skips = _Skips()
  all_bytes = hashlib.sha256()
  inputs_json = []
  encoder_args = (desc, dtype, vocab_size, text_field)
  pool = thread = None
  if desc["kind"] == "bytes":
    workers = 1       # encoding UTF-8 costs less than sending the records to a worker and the ids back
  if workers > 1:
    import multiprocessing
    from osdn_jax.data import prepare as module     # by its name, also where this runs as __main__ (-m)
    # Workers fork from a server that imported this package (grain, jax) and `tokenizers` once, rather than each
    # starting a fresh interpreter. (Not this module: where it runs as __main__ (-m), each worker runs it again as
    # __mp_main__, and runpy warns if it is imported already.)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([tokens_lib.__name__, "tokenizers"])
    pool = context.Pool(workers, module._init_worker, encoder_args)
    encode = lambda chunk: pool.apply_async(module._work, ((chunk.kind, chunk.items),))
  elif desc["kind"] == "bytes":
    local = _Encoder(*encoder_args)
    encode = lambda chunk: local(chunk.kind, chunk.items)
  else:
    # A thread tokenizes (the library and numpy release the GIL) while this one reads, hashes and writes.
    import concurrent.futures
    local = _Encoder(*encoder_args)
    thread = concurrent.futures.ThreadPoolExecutor(1)
    encode = lambda chunk: thread.submit(local, chunk.kind, chunk.items)
  pending = collections.deque()       # (chunk, its first record's index, forced split, result), in input order

  def write(chunk, index, split, result):
    if pool is not None:
      result = result.get()
    elif thread is not None:
      result = result.result()
    ids, lengths, reasons, text_bytes = result
    for i, reason in enumerate(reasons):
      if reason is not None:
        skips.add(reason, _where(chunk, i))
    keep = lengths >= 0
    if split is None:
      to_validation = np.array([_in_validation(index + i, seed, fraction) for i in range(len(lengths))], bool)
    else:
      to_validation = np.full(len(lengths), split == "validation")
    for name, mask in (("train", keep & ~to_validation), ("validation", keep & to_validation)):
      if mask.all():
        writers[name].add(ids, lengths, int(text_bytes.sum()))
      elif mask.any():
        picked = ids[np.repeat(mask[keep], lengths[keep])]
        writers[name].add(picked, lengths[mask], int(text_bytes[mask].sum()))

  from tqdm import tqdm
  total = sum(p.stat().st_size for p in files + validation_files)
  index = 0
  ok = False
  try:
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", disable=not progress,
              file=sys.stderr) as bar:
      for path, split in [(p, None) for p in files] + [(p, "validation") for p in validation_files]:
        file_hash = hashlib.sha256()
        for chunk in _chunks(path, text_field, skips, [file_hash, all_bytes], bar):
          pending.append((chunk, index, split, encode(chunk)))
          index += len(chunk.items)
          while len(pending) > 2 * workers:
            write(*pending.popleft())
        inputs_json.append({"path": str(path), "split": split or "train+validation", "bytes": path.stat().st_size,
                            "sha256": file_hash.hexdigest()})
      while pending:
        write(*pending.popleft())
    ok = True
  finally:
    if pool is not None:
      pool.close() if ok else pool.terminate()
      pool.join()
    if thread is not None:
      thread.shutdown(cancel_futures=True)

  splits = {name: w.finish() for name, w in writers.items()}
  settings_sha256 = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
  metadata = {
      "format": tokens_lib.FORMAT, "version": tokens_lib.VERSION,
      "tokenizer": {k: info[k] for k in ("spec", "kind", "file", "sha256")},
      "vocab_size": vocab_size, "eos_id": int(tok.eos_id), "eos_token": info["eos_token"], "dtype": dtype,
      "records": index, "splits": splits, "skipped": skips.to_json(),
      "inputs": inputs_json, "inputs_sha256": all_bytes.hexdigest(),
      "settings": settings, "settings_sha256": settings_sha256,
      "fingerprint": tokens_lib.fingerprint(all_bytes.hexdigest(), settings_sha256),
  }
  (out / tokens_lib.METADATA).write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n", encoding="utf-8")
  return metadata, workers


def summary(metadata: dict, out="", *, seconds: float | None = None, workers: int = 1) -> str:
  """The report printed at the end of a run: splits, skips by reason (with examples), and the speed."""
  lines = [f"prepared {out}: tokenizer {metadata['tokenizer']['spec']} (vocabulary {metadata['vocab_size']}, "
           f"{metadata['dtype']}, EOS {metadata['eos_id']}), {metadata['records']:,} records read"]
  text = 0
  for name, split in metadata["splits"].items():
    text += split["text_bytes"]
    lines.append(f"  {name:<10} {split['documents']:>12,} documents {split['tokens']:>15,} tokens "
                 f"{split['text_bytes'] / 1e6:>12,.1f} MB of text {len(split['shards']):>5} shards")
  skipped = metadata["skipped"]
  lines.append(f"  skipped {skipped['count']:,} (records; an empty or damaged file counts once)"
               + (":" if skipped["count"] else ""))
  for reason, entry in skipped["reasons"].items():
    lines.append(f"    {reason:<14} {entry['count']:>10,}  ({SKIP_REASONS[reason]}; e.g. "
                 f"{', '.join(entry['examples'][:3])})")
  if seconds:
    lines.append(f"  {text / 1e6:,.1f} MB of text in {seconds:.1f} s: {text / 1e6 / seconds:.2f} MB/s, "
                 f"{text / 1e6 / seconds / workers:.2f} MB/s per worker ({workers})")
  return "\n".join(lines)


def main(argv) -> None:
  from absl import flags
  if len(argv) > 1:
    raise cli.UsageError(f"prepare: unexpected arguments {argv[1:]}; every argument is a --flag (--help lists them)")
  f = flags.FLAGS
  prepare(f.input, f.tokenizer, f.out, text_field=f.text_field, validation=f.validation,
          validation_input=f.validation_input, seed=f.seed, workers=f.workers, dtype=f.dtype,
          shard_tokens=f.shard_tokens, eos_token=f.eos_token, bpe_train_bytes=f.bpe_train_bytes,
          overwrite=f.overwrite, progress=f.progress)


def _define_flags() -> None:
  from absl import flags
  flags.DEFINE_multi_string("input", None, "glob of input files (.txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet); "
                            "may repeat")
  flags.DEFINE_string("tokenizer", None, "bytes | bpe:N | path/to/tokenizer.json | path/to/spm.model")
  flags.DEFINE_string("out", None, "output directory")
  flags.DEFINE_string("text_field", "text", "the JSON field / parquet column holding the text")
  flags.DEFINE_float("validation", DEFAULT_VALIDATION, "fraction of the documents held out (by a hash of their "
                     "index and --seed)")
  flags.DEFINE_multi_string("validation_input", None, "glob of files that make the validation split instead")
  flags.DEFINE_integer("seed", 0, "seed of the validation hash")
  flags.DEFINE_integer("workers", 0, "tokenizing processes (0: one per CPU; bytes: always 1); the output does "
                       "not depend on it")
  flags.DEFINE_string("dtype", "auto", "auto | uint16 | uint32")
  flags.DEFINE_integer("shard_tokens", DEFAULT_SHARD_TOKENS, "tokens per shard (a shard ends at a document)")
  flags.DEFINE_string("eos_token", "", "the tokenizer's end-of-text token (default: found by name)")
  flags.DEFINE_integer("bpe_train_bytes", 0, "bpe:N: train on the first this many bytes of text (0: all)")
  flags.DEFINE_bool("overwrite", False, "replace an earlier run's files in --out")
  flags.DEFINE_bool("progress", True, "progress bars on stderr")
  flags.mark_flags_as_required(["input", "tokenizer", "out"])


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
