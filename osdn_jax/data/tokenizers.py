"""Tokenizers of the text pipeline: UTF-8 bytes, and a byte-level BPE trained on the corpus and cached on disk.

Both have `encode(text) -> np.ndarray int32 [n]` (no EOS: the pipeline appends `eos_id` to every record),
`decode(ids) -> str` (EOS dropped), `vocab_size` and `eos_id`; both are lossless (decode(encode(s)) == s).
`make_tokenizer` picks one by the data config's name. The BPE needs the `tokenizers` package (HuggingFace),
imported on first use.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile
import warnings
from collections.abc import Iterable

import numpy as np

from osdn_jax.data import sources

TOKENIZERS = ("byte", "bpe")


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255; EOS is 0 (NUL, which no text of the corpus holds)."""

  vocab_size = 256
  eos_id = 0

  def encode(self, text: str) -> np.ndarray:
    """int32 [number of UTF-8 bytes]."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    """ids [n] → text; EOS dropped, invalid UTF-8 replaced by U+FFFD."""
    ids = np.asarray(ids).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() > 255):
      raise ValueError(f"ByteTokenizer.decode: ids must lie in [0, 256), got [{ids.min()}, {ids.max()}]")
    return ids[ids != self.eos_id].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class BPETokenizer:
  """Byte-level BPE (HuggingFace `tokenizers`): GPT-2's byte-to-character map without a prefix space, the 256
  byte symbols, merges learned from a corpus, and one special token "<eos>" = id 0. Text that spells "<eos>" is
  encoded as ordinary text, so EOS comes only from the pipeline.

  `train(texts, vocab_size)` learns the merges (deterministic: the same texts give the same tokenizer in any
  process); `from_corpus(texts_dir, vocab_size)` trains on the corpus once and caches the result as JSON.
  """

  EOS = "<eos>"

  def __init__(self, tokenizer):
    """tokenizer: a `tokenizers.Tokenizer` with the special token "<eos>" (what `train` and `load` build)."""
    self._tokenizer = tokenizer
    self._tokenizer.encode_special_tokens = True
    self.eos_id = tokenizer.token_to_id(self.EOS)
    if self.eos_id is None:
      raise ValueError(f"BPETokenizer: the tokenizer has no {self.EOS!r} token")
    self.vocab_size = tokenizer.get_vocab_size()

  @classmethod
  def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """Learns merges from texts until the vocabulary (256 bytes, "<eos>" and the merged tokens) holds vocab_size
    tokens, or no pair is left to merge."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if not isinstance(vocab_size, int) or vocab_size < 257:
      raise ValueError(f"BPETokenizer: `vocab_size` must be an int ≥ 257 (256 bytes and EOS), got {vocab_size!r}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[cls.EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return cls(tokenizer)

  @classmethod
  def load(cls, path) -> BPETokenizer:
    from tokenizers import Tokenizer
    return cls(Tokenizer.from_file(str(path)))

  def save(self, path) -> None:
    """Writes the tokenizer's JSON to path atomically (processes training the same tokenizer may race)."""
    path = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
      self._tokenizer.save(tmp)
      os.chmod(tmp, 0o644)
      os.replace(tmp, path)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)

  @classmethod
  def from_corpus(cls, texts_dir, vocab_size: int, cache_dir=None) -> BPETokenizer:
    """Trained on every file of the corpus (`sources.corpus_files(texts_dir)`), loaded from
    `<cache_dir>/bpe-<vocab_size>-<fingerprint>.json` where an earlier call saved it. The fingerprint hashes the
    files' names and contents and the `tokenizers` version, so a changed corpus or library trains anew.
    cache_dir: default the corpus directory's parent; where it cannot be written, nothing is cached. A file that
    is not UTF-8 is a ValueError naming it (`sources.read_text`)."""
    import tokenizers
    files = sources.corpus_files(texts_dir)
    texts = [sources.read_text(p, "BPETokenizer.from_corpus") for p in files]
    digest = hashlib.sha256(f"{tokenizers.__version__}\0{vocab_size}".encode())
    for path, text in zip(files, texts):
      digest.update(f"\0{path.name}\0".encode() + text.encode("utf-8"))
    cache = pathlib.Path(cache_dir) if cache_dir else files[0].parent.parent
    path = cache / f"bpe-{vocab_size}-{digest.hexdigest()[:16]}.json"
    if path.exists():
      return cls.load(path)
    tokenizer = cls.train(texts, vocab_size)
    try:
      cache.mkdir(parents=True, exist_ok=True)
      tokenizer.save(path)
    except OSError as e:
      warnings.warn(f"BPETokenizer: could not cache the tokenizer at {path} ({e}); it is trained again next time")
    return tokenizer

  def encode(self, text: str) -> np.ndarray:
    """int32 [number of tokens]."""
    return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

  def decode(self, ids) -> str:
    """ids [n] → text; EOS dropped."""
    return self._tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=True)


def make_tokenizer(name: str, vocab_size: int, texts_dir=None, *, cache_dir=None):
  """"byte" → `ByteTokenizer()` (vocab_size ignored: always 256); "bpe" → `BPETokenizer.from_corpus(texts_dir,
  vocab_size, cache_dir)` (texts_dir "" or None: `sources.default_text_dir()`)."""
  if name == "byte":
    return ByteTokenizer()
  if name == "bpe":
    return BPETokenizer.from_corpus(texts_dir, vocab_size, cache_dir)
  raise ValueError(f"data: unknown `tokenizer` {name!r}; choices: {', '.join(TOKENIZERS)}")
