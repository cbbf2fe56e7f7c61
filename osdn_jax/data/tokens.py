"""Prepared token shards (`python -m osdn_jax.data.prepare`, which documents the format) as the trainer's
"tokens" source: `--config.data.source=tokens --config.data.path=DIR`.

  TokenRows        the grain random-access source: fixed rows of `length` tokens of one split's stream
  TokenDocuments   one split's documents, each its token ids (random access, memory-mapped)
  read_metadata, vocab_size, load_tokenizer   DIR/metadata.json, its vocabulary, its tokenizer

The stream of a split: its documents in order (the shards' order, which is the inputs' sorted order), each
followed by EOS (metadata's `eos_id`). The shards hold no separator: boundaries come from the `.idx` files, and
EOS is inserted here as the rows are cut, so a row looks exactly like the text source's (`pipeline`): EOS ends a
document (its target is scored) and serves as the next one's BOS (the input whose target starts the next
document, unscored). Row i is the stream's tokens [i·length, (i + 1)·length); the last partial row is dropped.

Every file is checked against metadata.json before it is used: an index's sha256 when its split is opened, a
shard's on the first read from it in this process (`verify_shard`); a file whose bytes changed is a ValueError
naming it.

Imports numpy only; the tokenizer (HuggingFace `tokenizers` or `sentencepiece`) is loaded on first use.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import pathlib

import numpy as np

from osdn_jax.data import segments

FORMAT = "osdn-tokens"
VERSION = 1
METADATA = "metadata.json"
SPLITS = ("train", "validation")
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
INDEX_DTYPE = np.dtype("<u8")
# End-of-text tokens looked for (in this order) in a tokenizer.json or sentencepiece model when --eos_token is
# not given.
EOS_CANDIDATES = ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>", "<|end|>",
                  "[SEP]")


def shard_files(split: str, number: int) -> tuple[str, str]:
  """The token and index file names of a split's shard: ("train-00000.bin", "train-00000.idx")."""
  return f"{split}-{number:05d}.bin", f"{split}-{number:05d}.idx"


def _directory(path) -> pathlib.Path:
  if not path or not isinstance(path, (str, pathlib.PurePath)) and not hasattr(path, "__fspath__"):
    raise ValueError(f"tokens: `path` must name a directory prepared by `python -m osdn_jax.data.prepare`, "
                     f"got {path!r}")
  return pathlib.Path(path)


# The fields of metadata.json a reader needs.
REQUIRED = ("format", "version", "tokenizer", "vocab_size", "eos_id", "dtype", "splits", "fingerprint")


def read_metadata(path) -> dict:
  """DIR/metadata.json, checked for its format, version and the fields a reader needs. FileNotFoundError (saying
  how to prepare the directory) where there is none; ValueError naming the file where it is not such a file (not
  UTF-8, not JSON, another format, a field missing)."""
  file = _directory(path) / METADATA
  if not file.is_file():
    raise FileNotFoundError(f"tokens: no {METADATA} in {file.parent} (a complete run of `python -m "
                            "osdn_jax.data.prepare --input=GLOB --tokenizer=SPEC --out=DIR` writes it last)")
  again = "; prepare the directory again (`python -m osdn_jax.data.prepare ... --overwrite`)"
  try:
    metadata = json.loads(file.read_text(encoding="utf-8"))
  except UnicodeDecodeError as e:
    raise ValueError(f"tokens: {file} is not UTF-8 text (byte {e.start}){again}") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"tokens: {file} is not JSON ({e.msg} at line {e.lineno}, column {e.colno}){again}") from None
  if not isinstance(metadata, dict):
    raise ValueError(f"tokens: {file} holds a JSON {type(metadata).__name__}, not the object prepare writes{again}")
  if metadata.get("format") != FORMAT or metadata.get("version") != VERSION:
    raise ValueError(f"tokens: {file} is format {metadata.get('format')!r} version {metadata.get('version')!r}, "
                     f"expected {FORMAT!r} version {VERSION}")
  if missing := [k for k in REQUIRED if k not in metadata] + [f"splits.{s}" for s in SPLITS
                                                               if s not in (metadata.get("splits") or {})]:
    raise ValueError(f"tokens: {file} lacks {', '.join(missing)}{again}")
  return metadata


def listed_files(metadata: dict) -> list[str]:
  """The names of the files a prepared directory's metadata lists besides itself: its tokenizer's, its shards
  and indexes."""
  names = [metadata["tokenizer"]["file"]] if metadata["tokenizer"].get("file") else []
  for split in SPLITS:
    for shard in metadata["splits"][split]["shards"]:
      names += [shard["bin"], shard["idx"]]
  return names


def vocab_size(path) -> int:
  """The vocabulary of a prepared directory (metadata's `vocab_size`): what the trainer's model is built for."""
  return int(read_metadata(path)["vocab_size"])


# -- tokenizers -----------------------------------------------------------------------------------------------
class HFTokenizer:
  """A HuggingFace `tokenizers` tokenizer.json, with `BPETokenizer`'s interface: encode(text) (no special tokens
  added; text that spells a special token is encoded as ordinary text), decode(ids) (special tokens, EOS among
  them, dropped), vocab_size, eos_id (the token `eos_token`)."""

  def __init__(self, path, eos_token: str | None):
    self._tokenizer = self.load(path)
    self._tokenizer.encode_special_tokens = True
    self._segments = None                            # encode_many's SegmentCache (False: none applies)
    vocab = self._tokenizer.get_vocab(with_added_tokens=True)
    self.vocab_size = max(self._tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
    self.eos_token = eos_token
    self.eos_id = None if eos_token is None else self._tokenizer.token_to_id(eos_token)
    if eos_token is not None and self.eos_id is None:
      raise ValueError(f"tokens: the tokenizer {path} has no token {eos_token!r}")

  @staticmethod
  def load(path):
    """The `tokenizers.Tokenizer` of a tokenizer.json; ValueError naming the file where the library cannot read
    it (not UTF-8, not JSON, not a tokenizer)."""
    from tokenizers import Tokenizer
    try:
      return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 -- the library raises a bare Exception
      detail = " ".join(str(e).split()) or type(e).__name__
      raise ValueError(f"tokens: {path} is not a tokenizer.json the `tokenizers` library reads ({detail})") from None

  @staticmethod
  def find_eos(path) -> str | None:
    """The first of `EOS_CANDIDATES` that the tokenizer.json holds, or None."""
    tokenizer = HFTokenizer.load(path)
    return next((t for t in EOS_CANDIDATES if tokenizer.token_to_id(t) is not None), None)

  def encode_many(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids [Σ lengths] int, lengths int64 [len(texts)]): the texts' ids, concatenated, the same as encode's.
    Through a `segments.SegmentCache` where it applies (each distinct word encoded once), else in one batch;
    either way the tokenizer's rayon threads encode what it encodes, unless TOKENIZERS_PARALLELISM=false."""
    if self._segments is None:
      self._segments = segments.SegmentCache(self._tokenizer) if segments.applies(self._tokenizer) else False
    if self._segments:
      return self._segments.encode(texts)
    return segments.encode_batch(self._tokenizer, texts)

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

  def decode(self, ids) -> str:
    return self._tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=True)


class SentencePieceTokenizer:
  """A sentencepiece model (needs the `sentencepiece` package), with the same interface. EOS: `eos_token` when
  given, else the model's own eos id."""

  def __init__(self, path, eos_token: str | None):
    sentencepiece = require("sentencepiece", "a sentencepiece .model tokenizer")
    self._model = sentencepiece.SentencePieceProcessor(model_file=str(path))
    self.vocab_size = int(self._model.get_piece_size())
    self.eos_token = eos_token
    if eos_token is not None:
      self.eos_id = int(self._model.piece_to_id(eos_token))
      if self._model.id_to_piece(self.eos_id) != eos_token:
        raise ValueError(f"tokens: the sentencepiece model {path} has no piece {eos_token!r}")
    else:
      self.eos_id = int(self._model.eos_id()) if self._model.eos_id() >= 0 else None

  def encode_many(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64 [Σ lengths], lengths int64 [len(texts)]): the texts' ids, concatenated."""
    ids = self._model.encode(texts, out_type=int)
    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    return np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(lengths.sum())), lengths

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._model.encode(text, out_type=int), np.int32)

  def decode(self, ids) -> str:
    ids = [int(i) for i in np.asarray(ids).reshape(-1) if int(i) != self.eos_id]
    return self._model.decode(ids)


def require(package: str, purpose: str):
  """The imported package, or ImportError naming it (`pip install PACKAGE`) and what needs it."""
  import importlib
  try:
    return importlib.import_module(package)
  except ImportError:
    raise ImportError(f"{purpose} needs the `{package}` package, which is not installed: pip install {package} "
                      "(or the osdn-jax extra `corpora`)") from None


def load_tokenizer(path, metadata: dict | None = None):
  """The tokenizer a prepared directory was made with: `tokenizers.ByteTokenizer` for bytes, `HFTokenizer` for
  a trained BPE or a tokenizer.json (DIR/tokenizer.json), `SentencePieceTokenizer` (DIR/tokenizer.model)."""
  metadata = read_metadata(path) if metadata is None else metadata
  info = metadata["tokenizer"]
  if info["kind"] == "bytes":
    from osdn_jax.data.tokenizers import ByteTokenizer
    return ByteTokenizer()
  file = pathlib.Path(path) / info["file"]
  if info["kind"] == "sentencepiece":
    return SentencePieceTokenizer(file, metadata.get("eos_token"))
  return HFTokenizer(file, metadata.get("eos_token"))


class LazyTokenizer:
  """A prepared directory's tokenizer, loaded on the first encode or decode; vocab_size and eos_id come from the
  metadata, so a training run that never decodes needs no tokenizer package."""

  def __init__(self, path, metadata: dict):
    self._path, self._metadata, self._loaded = pathlib.Path(path), metadata, None
    self.vocab_size = int(metadata["vocab_size"])
    self.eos_id = int(metadata["eos_id"])

  def _get(self):
    if self._loaded is None:
      self._loaded = load_tokenizer(self._path, self._metadata)
    return self._loaded

  def encode(self, text: str) -> np.ndarray:
    return self._get().encode(text)

  def decode(self, ids) -> str:
    return self._get().decode(ids)


# -- checksums ------------------------------------------------------------------------------------------------
_VERIFIED: set[tuple] = set()       # (path, size, mtime_ns, inode, sha256) of the shards this process verified


def _mismatch(file: pathlib.Path) -> ValueError:
  return ValueError(f"tokens: {file} does not match its sha256 in {METADATA} (its bytes changed after prepare "
                    "wrote them); prepare the directory again or copy it whole")


def _check_sha256(file: pathlib.Path, data: bytes, expected: str | None) -> None:
  if expected is not None and hashlib.sha256(data).hexdigest() != expected:
    raise _mismatch(file)


def verify_shard(file: pathlib.Path, expected: str | None) -> None:
  """ValueError naming the file unless its bytes' sha256 is `expected` (None: nothing to verify). Each file is
  hashed once per process while its size, modification time and inode stay the same."""
  if expected is None:
    return
  stat = file.stat()
  key = (str(file.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino, expected)
  if key in _VERIFIED:
    return
  digest = hashlib.sha256()
  with open(file, "rb") as f:
    while block := f.read(1 << 22):
      digest.update(block)
  if digest.hexdigest() != expected:
    raise _mismatch(file)
  _VERIFIED.add(key)


# -- documents and rows ---------------------------------------------------------------------------------------
class TokenDocuments:
  """The documents of one split ("train", "validation" or "all": train then validation) of a prepared directory:
  `docs[j]` is document j's token ids (a read-only view of the memory-mapped shard, the file's dtype).

  Opening checks every shard's files against the metadata's sizes (a truncated copy is a ValueError naming the
  file) and reads the indexes into memory (8 bytes per document), checking their sha256. Tokens stay on disk
  (numpy memmaps, opened on first use, after the shard's sha256 is checked, and not pickled)."""

  def __init__(self, path, split: str = "train"):
    self.path = _directory(path)
    if split not in SPLITS + ("all",):
      raise ValueError(f"tokens: `split` must be one of {', '.join(SPLITS + ('all',))}, got {split!r}")
    self.metadata = read_metadata(self.path)
    self.split = split
    self.dtype = DTYPES[self.metadata["dtype"]]
    self.shards: list[dict] = []
    for name in (SPLITS if split == "all" else (split,)):
      self.shards += self.metadata["splits"][name]["shards"]
    lengths = []
    for shard in self.shards:
      for key, size in (("bin", shard["tokens"] * self.dtype.itemsize),
                        ("idx", (shard["documents"] + 1) * INDEX_DTYPE.itemsize)):
        file = self.path / shard[key]
        if not file.is_file() or file.stat().st_size != size:
          raise ValueError(f"tokens: {file} should hold {size} bytes (metadata.json), "
                           f"{'is missing' if not file.is_file() else f'holds {file.stat().st_size}'}; "
                           "prepare the directory again or copy it whole")
      index = (self.path / shard["idx"]).read_bytes()
      _check_sha256(self.path / shard["idx"], index, shard.get("idx_sha256"))
      offsets = np.frombuffer(index, INDEX_DTYPE).astype(np.int64)
      if offsets[0] != 0 or offsets[-1] != shard["tokens"] or np.any(np.diff(offsets) < 0):
        raise ValueError(f"tokens: {self.path / shard['idx']} is not an index of {shard['tokens']} tokens")
      lengths.append(np.diff(offsets))
    self.lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    # Document j: shard shard_of[j], tokens [start, start + lengths[j]) of that shard's file.
    docs = np.array([s["documents"] for s in self.shards], np.int64)
    self._doc_base = np.concatenate([[0], np.cumsum(docs)])
    self._token_base = np.concatenate([[0], np.cumsum([s["tokens"] for s in self.shards])]).astype(np.int64)
    self.token_starts = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)   # over all shards
    self._maps: dict[int, np.memmap] = {}

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_maps"] = {}
    return state

  def __len__(self) -> int:
    return len(self.lengths)

  def _shard(self, number: int) -> np.ndarray:
    if number not in self._maps:
      shard = self.shards[number]
      verify_shard(self.path / shard["bin"], shard.get("bin_sha256"))
      self._maps[number] = np.memmap(self.path / shard["bin"], self.dtype, mode="r", shape=(shard["tokens"],))
    return self._maps[number]

  def tokens(self, j: int, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Tokens [start, stop) of document j (default: all of it)."""
    shard = int(np.searchsorted(self._doc_base, j, side="right") - 1)
    base = int(self.token_starts[j] - self._token_base[shard])
    stop = int(self.lengths[j]) if stop is None else stop
    return self._shard(shard)[base + start:base + stop]

  def __getitem__(self, j: int) -> np.ndarray:
    j = int(j)
    if not 0 <= j < len(self):
      raise IndexError(f"document {j} out of range [0, {len(self)})")
    return self.tokens(j)


class TokenRows:
  """A grain random-access source (`__len__`, `__getitem__`) of a prepared split's stream cut into rows of
  `length` tokens (module docstring). Record i: {"ids": int32 [length], "doc": int32 [length]} where doc is the
  document of each token (EOS counts with the document it ends), numbered from 0 at the row's first token: the
  text source's rows, which `pipeline` turns into tokens, targets, segment_ids and loss_mask.

  vocab_size, eos_id, tokenizer (`LazyTokenizer`), metadata and fingerprint (a hash of the inputs' bytes and the
  settings, for the pipeline's signature) describe the directory."""

  def __init__(self, path, split: str = "train", length: int = 2049):
    if not isinstance(length, (int, np.integer)) or isinstance(length, bool) or length < 2:
      raise ValueError(f"TokenRows: `length` must be an int ≥ 2, got {length!r}")
    self.documents = TokenDocuments(path, split)
    self.path, self.split, self.length = self.documents.path, split, int(length)
    self.metadata = self.documents.metadata
    self.vocab_size = int(self.metadata["vocab_size"])
    self.eos_id = int(self.metadata["eos_id"])
    self.tokenizer = LazyTokenizer(self.path, self.metadata)
    self.fingerprint = self.metadata["fingerprint"]
    # Document j spans the stream's positions [starts[j], starts[j + 1]): its tokens, then EOS.
    self.starts = np.concatenate([[0], np.cumsum(self.documents.lengths + 1)]).astype(np.int64)
    self.num_rows = int(self.starts[-1] // self.length)
    if self.num_rows == 0:
      raise ValueError(f"TokenRows: the {split!r} split of {self.path} holds {len(self.documents)} documents, "
                       f"{int(self.starts[-1])} tokens with their EOS: fewer than one row of {self.length} "
                       "(seq_len + 1)")

  def __len__(self) -> int:
    return self.num_rows

  def __getitem__(self, index) -> dict[str, np.ndarray]:
    index = int(index)
    if not 0 <= index < self.num_rows:
      raise IndexError(f"row {index} out of range [0, {self.num_rows})")
    begin, end = index * self.length, (index + 1) * self.length
    first = int(np.searchsorted(self.starts, begin, side="right") - 1)
    last = int(np.searchsorted(self.starts, end, side="left"))         # documents [first, last) meet the row
    ids = np.empty(self.length, np.int32)
    doc = np.empty(self.length, np.int32)
    for j in range(first, last):
      lo, hi = max(int(self.starts[j]), begin), min(int(self.starts[j + 1]), end)
      size = int(self.starts[j + 1] - self.starts[j]) - 1              # tokens without the EOS
      a, b = lo - int(self.starts[j]), hi - int(self.starts[j])        # positions within document j + EOS
      piece = self.documents.tokens(j, a, min(b, size))
      ids[lo - begin:lo - begin + len(piece)] = piece
      if b > size:                                                     # the EOS falls in the row
        ids[hi - begin - 1] = self.eos_id
      doc[lo - begin:hi - begin] = j - first
    return {"ids": ids, "doc": doc}


def fingerprint(inputs_sha256: str, settings_sha256: str) -> str:
  return hashlib.sha256(f"{inputs_sha256}\0{settings_sha256}".encode()).hexdigest()[:16]
