r"""Exact word-level caching for HuggingFace tokenizers that pre-tokenize with GPT-2's regex (`ByteLevel`).

GPT-2's pre-tokenizing regex, `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`, ends a
pre-token at every position p of a text where (`cuts`)
  p holds whitespace and p − 1 does not (no alternative matches a non-whitespace character, then whitespace),
  p − 1 holds an ASCII letter or digit and p ASCII punctuation (`PUNCTUATION`, the apostrophe among it),
  p − 1 holds ASCII punctuation but the apostrophe (which begins the contractions) and p an ASCII letter or digit,
  or one of them an ASCII letter and the other an ASCII digit
(no alternative spans those two classes). It finds in the text up to such a p, and in the text from p, the
pre-tokens it finds there in the whole text: it looks behind nowhere, and its one look-ahead, `(?!\S)`, ends a
whitespace run, which a text cut there never ends with but at its end. The model encodes each pre-token alone,
so the ids of a text are those of its segments (the pieces between such cuts), concatenated: `SegmentCache`
encodes each distinct segment once. `applies(tokenizer)` says where this holds.

Whitespace (`WHITESPACE`) is Unicode's White_Space, the `\s` of onig (the regex engine of `tokenizers`);
Python's `\s` also holds U+001C..U+001F, which are not whitespace to onig. Imports numpy; `tokenizers` is the
caller's.
"""
from __future__ import annotations

import itertools
import re
import string

import numpy as np

WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"   # a regex class body
PUNCTUATION = string.punctuation
# Classes of a byte (`_CLASS`): a character's, for ASCII; _LEAD for the first byte of a character that may be
# whitespace wider than ASCII (`cuts` gives its bytes _SPACE or _OTHER); _OTHER for any other byte.
_OTHER, _SPACE, _LETTER, _DIGIT, _MARK, _APOSTROPHE, _LEAD = range(7)
_CLASS = np.zeros(256, np.uint8)
for _chars, _class in (("\t\n\x0b\x0c\r ", _SPACE), (string.ascii_letters, _LETTER), (string.digits, _DIGIT),
                       (PUNCTUATION, _MARK), ("'", _APOSTROPHE)):
  _CLASS[list(_chars.encode())] = _class
_CLASS[[0xC2, 0xE1, 0xE2, 0xE3]] = _LEAD
_CUT = np.zeros((7, 7), bool)                      # [class before p, class at p]: a cut at p
_CUT[[_OTHER, _LETTER, _DIGIT, _MARK, _APOSTROPHE], _SPACE] = True
_CUT[_LETTER, [_DIGIT, _MARK, _APOSTROPHE]] = True
_CUT[_DIGIT, [_LETTER, _MARK, _APOSTROPHE]] = True
_CUT[_MARK, [_LETTER, _DIGIT]] = True
_CUT = _CUT.reshape(-1)
# The UTF-8 of the whitespace wider than ASCII, as (first byte << 16 | second << 8 | third) (2 bytes: third 0).
_WIDE_SPACES = np.array(sorted(int.from_bytes(c.encode().ljust(3, b"\0"), "big")
                               for c in map(chr, range(0x80, 0x3001)) if re.fullmatch(f"[{WHITESPACE}]", c)), np.int64)
_PACKED = 7                                        # segments of up to this many bytes are their own keys
_MASKS = np.array([(1 << 8 * k) - 1 for k in range(9)], np.uint64)     # the low k bytes of a word
_BASE = 0x9E3779B97F4A7C15                         # odd: the multiplier of the hash of longer segments...
_LENGTH = np.uint64(0xD6E8FEB86659FD93)            # ...and the weight of a segment's length in it
_JOINED = 256                                      # new segments joined into one text to encode


def applies(tokenizer) -> bool:
  """Whether encode(text) = the concatenated encodings of text's segments for this `tokenizers.Tokenizer`,
  encoded without added special tokens: no normalizer; the pre-tokenizer ByteLevel with GPT-2's regex and no
  prefix space; no added token that the encoder would split out of the text (every one is special, and
  `encode_special_tokens` is set); no truncation, padding or BPE dropout."""
  from tokenizers import pre_tokenizers
  pre = tokenizer.pre_tokenizer
  added = list(tokenizer.get_added_tokens_decoder().values())
  return (tokenizer.normalizer is None and isinstance(pre, pre_tokenizers.ByteLevel) and pre.use_regex
          and not pre.add_prefix_space and tokenizer.truncation is None and tokenizer.padding is None
          and not getattr(tokenizer.model, "dropout", None)
          and (not added or tokenizer.encode_special_tokens and all(t.special for t in added)))


def encode_batch(tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
  """(ids int64 [Σ lengths], lengths int64 [len(texts)]): the texts encoded by the `tokenizers.Tokenizer` in
  one batch (rayon threads, unless TOKENIZERS_PARALLELISM is false), without added special tokens."""
  encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
  ids = [e.ids for e in encode(texts, add_special_tokens=False)]
  lengths = np.fromiter(map(len, ids), np.int64, len(ids))
  return np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(lengths.sum())), lengths


def _joiner(tokenizer) -> tuple[tuple | None, np.ndarray]:
  """((a copy of the tokenizer that splits text at special tokens, the id of a special token whose text joins
  texts, that text) or None where no special token suits, the special tokens' ids int64 [specials]). A joint
  strips no whitespace, and no proper prefix of its text is a suffix of it (a text's end and a joint's start
  never spell it)."""
  from tokenizers import Tokenizer
  added = sorted(tokenizer.get_added_tokens_decoder().items())
  special_ids = np.array([i for i, t in added if t.special], np.int64)
  for i, token in added:
    text = token.content
    if (token.special and not (token.lstrip or token.rstrip or token.single_word) and text
        and all(text[:k] != text[-k:] for k in range(1, len(text)))):
      joiner = Tokenizer.from_str(tokenizer.to_str())
      joiner.encode_special_tokens = False
      return (joiner, i, text), special_ids
  return None, special_ids


def cuts(data: bytes, starts: np.ndarray) -> np.ndarray:
  """int64 [segments]: where the texts whose UTF-8 is data (concatenated) are cut into segments: at each text's
  start (`starts`, int64, ascending) and at every position the module's docstring names."""
  b = np.frombuffer(data, np.uint8)
  classes = np.take(_CLASS, b)                     # (take: faster than indexing with a uint8 index)
  lead = np.flatnonzero(classes == _LEAD)
  if lead.size:
    classes[lead] = _OTHER
    padded = np.concatenate([b, np.zeros(2, np.uint8)])
    code = padded[lead].astype(np.int64) << 16 | padded[lead + 1].astype(np.int64) << 8 | padded[lead + 2]
    two = np.isin(code & ~0xFF, _WIDE_SPACES)          # C2 85, C2 A0: the third byte is another character's
    three = np.isin(code, _WIDE_SPACES) & (b[lead] != 0xC2)
    for width, found in ((2, lead[two]), (3, lead[three])):
      for k in range(width):
        classes[found + k] = _SPACE
  cut = np.zeros(len(b), bool)
  cut[1:] = np.take(_CUT, classes[:-1] * 7 + classes[1:])
  cut[starts[starts < len(b)]] = True
  return np.flatnonzero(cut)


class _Table:
  """A hash table of uint64 keys (0: an empty place) → int32 values, in numpy arrays: open addressing, linear
  probing from the key's top bits (mixed), a lookup or insertion of many keys at once."""

  def __init__(self, size: int):
    self._bits = max(int(size - 1).bit_length(), 2)
    self._keys = np.zeros(1 << self._bits, np.uint64)
    self._values = np.zeros(1 << self._bits, np.int32)
    self.room = 3 << (self._bits - 2)              # keys it takes (three quarters of its places)

  def _home(self, keys: np.ndarray) -> np.ndarray:
    return ((keys * np.uint64(_BASE)) >> np.uint64(64 - self._bits)).astype(np.int64)

  def find(self, keys: np.ndarray) -> np.ndarray:
    """int64 [keys]: each key's value, −1 where it is absent."""
    found = np.full(len(keys), -1, np.int64)
    place, todo = self._home(keys), np.arange(len(keys))
    while todo.size:
      held = self._keys[place[todo]]
      hit = held == keys[todo]
      found[todo[hit]] = self._values[place[todo[hit]]]
      todo = todo[~hit & (held != 0)]
      place[todo] = (place[todo] + 1) & ((1 << self._bits) - 1)
    return found

  def insert(self, keys: np.ndarray, values: np.ndarray) -> None:
    """Adds keys (distinct, absent, non-zero; at most `room`) with their values."""
    self.room -= len(keys)
    place, todo = self._home(keys), np.arange(len(keys))
    while todo.size:
      free = todo[self._keys[place[todo]] == 0]
      self._keys[place[free]] = keys[free]                 # keys wanting one place: one of them gets it
      won = free[self._keys[place[free]] == keys[free]]
      self._values[place[won]] = values[won]
      todo = np.setdiff1d(todo, won, assume_unique=True)
      place[todo] = (place[todo] + 1) & ((1 << self._bits) - 1)


class SegmentCache:
  """Texts → token ids through a `tokenizers.Tokenizer` for which `applies` holds, each distinct segment encoded
  once (new ones by `encode_batch`, once per call) and its ids kept: segments of up to max_bytes bytes (UTF-8),
  until the cache holds max_segments of them or max_ids ids, when it starts afresh. A segment is looked up by a
  key: a segment of up to 7 bytes is its own key; a longer one's is a hash of its bytes, which are then compared
  with the kept ones. So the ids never depend on what it holds."""

  def __init__(self, tokenizer, max_segments: int = 1 << 19, max_bytes: int = 64, max_ids: int = 1 << 23,
               window: int = 1 << 20):
    self.tokenizer, self.max_segments, self.max_bytes, self.max_ids = tokenizer, max_segments, max_bytes, max_ids
    self._window = window                          # bytes looked up at a time (what bounds _find's memory)
    self._joiner, self._special_ids = _joiner(tokenizer)
    self._clear()

  def _clear(self) -> None:
    self._table = _Table(2 * self.max_segments)    # key → slot
    self._ids = np.zeros(1 << 16, np.int32)        # slot s: ids [_id_start[s], _id_start[s] + _id_length[s])
    self._bytes = np.zeros(1 << 16, np.uint8)      # slot s: its bytes [_byte_start[s], ... + _byte_length[s])
    self._id_start, self._id_length, self._byte_start, self._byte_length = (np.zeros(1 << 12, np.int64)
                                                                            for _ in range(4))
    self._used = (0, 0, 0)                         # slots, ids, bytes

  def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [Σ lengths], lengths int64 [len(texts)]): the texts' token ids, concatenated."""
    if not any(texts):
      return np.zeros(0, np.int32), np.zeros(len(texts), np.int64)
    encoded = [t.encode("utf-8") for t in texts]
    sizes = np.fromiter(map(len, encoded), np.int64, len(encoded))
    data = b"".join(encoded)
    b = np.frombuffer(data, np.uint8)
    text_starts = np.cumsum(sizes) - sizes
    starts = cuts(data, text_starts)
    ends = np.append(starts[1:], len(b))
    slots = np.full(len(starts), -1, np.int64)
    short = ends - starts <= self.max_bytes
    firsts = np.unique(np.searchsorted(starts, np.arange(0, len(b), self._window)))
    for i, j in zip(firsts.tolist(), np.append(firsts[1:], len(starts)).tolist()):
      block = i + np.flatnonzero(short[i:j])       # the short segments that start in one window of bytes
      if block.size:
        slots[block] = self._find(data, b, starts[block], ends[block])
    kept = self._used
    others = np.flatnonzero(slots < 0)             # too long to keep, or another's key: encoded for this call
    if others.size:
      slots[others] = self._append(data, starts[others], ends[others])
    lengths = self._id_length[slots]
    total = np.concatenate([[0], np.cumsum(lengths)])
    ids = self._ids[np.repeat(self._id_start[slots] - total[:-1], lengths) + np.arange(total[-1])]
    self._used = kept
    if kept[0] > self.max_segments or kept[1] > self.max_ids:
      self._clear()
    first = np.searchsorted(starts, text_starts)   # each text's first segment
    return ids, total[np.append(first[1:], len(starts))] - total[first]

  def _find(self, data: bytes, b: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """int64 [segments]: the slots of segments of at most max_bytes bytes starting within `window` bytes of the
    first, new ones (kept while the table has room) for those the cache lacks; −1 where another segment of the
    same key holds the slot."""
    keys = self._keys(b, starts, ends)
    slots = self._table.find(keys)
    missing = np.flatnonzero(slots < 0)
    if missing.size:
      unique, first, inverse = np.unique(keys[missing], return_index=True, return_inverse=True)
      new = self._append(data, starts[missing[first]], ends[missing[first]])
      if len(unique) <= self._table.room:
        self._table.insert(unique, new)
      slots[missing] = new[inverse]
    lengths = ends - starts
    wrong = self._byte_length[slots] != lengths    # a short segment's key is its bytes: its length tells the rest
    long = np.flatnonzero(lengths > _PACKED)
    if long.size:                                  # a long one's is a hash: its bytes are compared
      sizes = lengths[long]
      total = np.cumsum(sizes)
      offsets = np.arange(total[-1]) - np.repeat(total - sizes, sizes)
      differ = self._bytes[np.repeat(self._byte_start[slots[long]], sizes) + offsets] != b[
          np.repeat(starts[long], sizes) + offsets]
      wrong[long[np.searchsorted(total, np.flatnonzero(differ), "right")]] = True
    slots[wrong] = -1
    return slots

  def _keys(self, b: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """uint64 [segments] (never 0): a segment of up to _PACKED bytes is its bytes (little-endian) with its length
    in the top byte, exact; a longer one a hash of its 8-byte words and length (`_hash`)."""
    lengths = ends - starts
    size = int(ends[-1] - starts[0]) + self.max_bytes + 8
    padded = np.zeros(size + (-size) % 8, np.uint8)
    padded[:ends[-1] - starts[0]] = b[starts[0]:ends[-1]]
    words = np.lib.stride_tricks.as_strided(padded.view("<u8"), (size - 7,), (1,))   # the 8 bytes from each
    keys = words[starts - starts[0]] & _MASKS[np.minimum(lengths, 8)]
    short = lengths <= _PACKED
    keys[short] |= lengths[short].astype(np.uint64) << np.uint64(56)
    long = np.flatnonzero(~short)
    if long.size:
      keys[long] = self._hash(words, starts[long] - starts[0], lengths[long])
    return keys

  @staticmethod
  def _hash(words: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """uint64 [segments] (never 0): of the bytes words[offset + 8i] holds (the segment's, zero past its end)
    and its length, mixed word by word (multiply-xor): equal bytes give equal hashes, others rarely."""
    keys = lengths.astype(np.uint64) * _LENGTH
    for i in range(0, int(lengths.max()), 8):
      more = np.flatnonzero(lengths > i)           # a segment's rounds: its words, whatever the others' lengths
      mixed = (keys[more] ^ (words[offsets[more] + i] & _MASKS[np.minimum(lengths[more] - i, 8)])) * np.uint64(_BASE)
      keys[more] = mixed ^ (mixed >> np.uint64(29))
    keys[keys == 0] = 1                            # 0 marks an empty place of the table
    return keys

  def _append(self, data: bytes, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Encodes the segments data[start:end] and gives each the next slot (its ids and bytes); returns the slots."""
    pieces = [data[s:e] for s, e in zip(starts.tolist(), ends.tolist())]
    ids, lengths = self._encode_joined([p.decode("utf-8") for p in pieces])
    held = b"".join(pieces)
    slots, used_ids, used_bytes = self._used
    self._grow(slots + len(pieces), used_ids + len(ids), used_bytes + len(held))
    new = slice(slots, slots + len(pieces))
    self._id_length[new], self._byte_length[new] = lengths, ends - starts
    self._id_start[new] = used_ids + np.cumsum(lengths) - lengths
    self._byte_start[new] = used_bytes + np.cumsum(ends - starts) - (ends - starts)
    self._ids[used_ids:used_ids + len(ids)] = ids
    self._bytes[used_bytes:used_bytes + len(held)] = np.frombuffer(held, np.uint8)
    self._used = (slots + len(pieces), used_ids + len(ids), used_bytes + len(held))
    return np.arange(new.start, new.stop)

  def _encode_joined(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """`encode_batch(tokenizer, texts)`, the texts joined by a special token into a few (the library's cost is
    mostly per text) and encoded by a copy of the tokenizer that splits text at special tokens; each alone where
    one holds a special token's text (the special ids found are then not the joints alone)."""
    if self._joiner is None or len(texts) < 2:
      return encode_batch(self.tokenizer, texts)
    joiner, joint_id, joint = self._joiner
    groups = [texts[i:i + _JOINED] for i in range(0, len(texts), _JOINED)]
    ids, lengths = encode_batch(joiner, [joint.join(g) for g in groups])
    special = np.flatnonzero(np.isin(ids, self._special_ids))
    if len(special) != len(texts) - len(groups) or (ids[special] != joint_id).any():
      return encode_batch(self.tokenizer, texts)
    ends = np.sort(np.concatenate([special, np.cumsum(lengths)]))     # where the texts' ids end, in ids...
    ends -= np.searchsorted(special, ends)                            # ...and without the joints
    return np.delete(ids, special), np.diff(ends, prepend=0)

  def _grow(self, slots: int, ids: int, nbytes: int) -> None:
    """Room for this many slots, ids and bytes in all (at least doubling what grows)."""
    if slots > len(self._id_start):
      size = max(slots, 2 * len(self._id_start))
      self._id_start, self._id_length, self._byte_start, self._byte_length = (
          np.resize(a, size) for a in (self._id_start, self._id_length, self._byte_start, self._byte_length))
    if ids > len(self._ids):
      self._ids = np.resize(self._ids, max(ids, 2 * len(self._ids)))
    if nbytes > len(self._bytes):
      self._bytes = np.resize(self._bytes, max(nbytes, 2 * len(self._bytes)))
