"""`data.segments`: a text's ids through the segment cache are exactly the tokenizer's own, text by text.

Random texts over an alphabet that holds every whitespace character of Unicode and of Python, U+001C..U+001F
(whitespace to Python, not to the tokenizer's regex), letters, marks, digits and other numbers, punctuation,
contractions, emoji and the special token's text; a BPE trained on some of them; batches small enough, and a cache
small enough, that segments are missed, found, too long to keep, and the cache starts afresh; hash collisions
(among long segments, and with a short one's key); each distinct segment kept once;
new segments encoded joined by a special token; the cuts, against the module docstring's rules and against the
regex's own pre-tokens."""
import random
import re

import numpy as np
import pytest

pytest.importorskip("tokenizers")
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers  # noqa: E402

from osdn_jax.data import segments, tokens  # noqa: E402
from osdn_jax.data.tokenizers import BPETokenizer  # noqa: E402

SPACES = [chr(c) for c in range(0x110000) if chr(c).isspace()]
PIECES = (SPACES + [" "] * 20 + ["\n"] * 5 + ["  ", "\n\n", " \n", "\r\n", "\x1c", "\x1f"]
          + ["the", "The", "delta", "naïve", "café", "e\u0301", "日本語", "Ωμέγα", "١٢٣", "²", "Ⅻ", "42", "1000000",
             "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'", "don't", ",", ".", "...", "!?", "--", "(", ")", "\"",
             "🙂", "👍🏽", "<eos>", "<", "eos>", "\x00", "\u200b", "\ufeff", "x" * 80, "a1", "1st", "x2y", "$5",
             "e.g.", "#tag", "x_y", "-", "'tis", "''", "rock'n'roll", "3'", "A", "z", "0", "9", "@", "~"])


def _texts(seed: int, n: int) -> list[str]:
  rng = random.Random(seed)
  return ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 60))) for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer():
  """A byte-level BPE of 400 tokens (EOS "<eos>", special) as `tokens.HFTokenizer` loads it."""
  return BPETokenizer.train(_texts(0, 300), 400)._tokenizer


def _one_at_a_time(tokenizer, texts):
  return [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]


def _pieces(text: str) -> list[str]:
  """The text's segments (`segments.cuts`)."""
  data = text.encode()
  at = segments.cuts(data, np.zeros(1, np.int64)).tolist() + [len(data)]
  return [data[a:b].decode() for a, b in zip(at[:-1], at[1:])]


def _reference_pieces(text: str) -> list[str]:
  """The cuts of the module's docstring, character by character."""
  def kind(c):
    if re.fullmatch(f"[{segments.WHITESPACE}]", c):
      return "space"
    if c.isascii() and c.isalpha():
      return "letter"
    if c.isascii() and c.isdigit():
      return "digit"
    return "'" if c == "'" else "mark" if c in segments.PUNCTUATION else "other"
  at = [0] + [p for p in range(1, len(text)) if (kind(text[p - 1]), kind(text[p])) in CUTS
              or kind(text[p]) == "space" != kind(text[p - 1])]
  return [text[a:b] for a, b in zip(at, at[1:] + [len(text)])]


CUTS = {("letter", "digit"), ("letter", "mark"), ("letter", "'"), ("digit", "letter"), ("digit", "mark"),
        ("digit", "'"), ("mark", "letter"), ("mark", "digit")}


def test_whitespace_is_the_regex_engines():
  """WHITESPACE holds exactly the characters the ByteLevel regex treats as \\s: "a" + c + c + "b" splits into 4
  pre-tokens where c is whitespace to it (a, c, c, b), 3 where it is not (a, cc, b); a segment starts at c."""
  pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  for c in SPACES + ["\x1c", "\x1d", "\x1e", "\x1f", "\u180e", "\u200b", "\ufeff", "é", "\x00"]:
    regex_space = c == " " or len(pre.pre_tokenize_str("a" + c + c + "b")) == 4
    assert bool(re.fullmatch(f"[{segments.WHITESPACE}]", c)) == regex_space, repr(c)
    assert _pieces("a" + c + "b") == (["a", c + "b"] if regex_space else ["a" + c + "b"]), repr(c)


def test_segments_are_pre_token_boundaries():
  """The segments are the docstring's, and the ByteLevel regex finds in them, one by one, the pre-tokens it finds
  in the whole text (what makes the cache exact for any model)."""
  pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  for text in _texts(2, 2000):
    found = _pieces(text)
    assert found == _reference_pieces(text)
    assert [p for s in found for p, _ in pre.pre_tokenize_str(s)] == [p for p, _ in pre.pre_tokenize_str(text)]


def test_cuts_start_each_text():
  texts = _texts(5, 300) + ["", "x", ""]
  data = [t.encode() for t in texts]
  starts = np.cumsum([0] + [len(d) for d in data[:-1]])
  expected = [int(start) + len("".join(_pieces(t)[:k]).encode()) for t, start in zip(texts, starts)
              for k in range(len(_pieces(t)))]
  assert segments.cuts(b"".join(data), starts).tolist() == expected


@pytest.mark.parametrize("batch, settings", [
    (1, {}),
    (64, {}),
    (7, {"max_segments": 50, "max_bytes": 4, "window": 64}),      # afresh often, long segments, many windows
    (64, {"max_segments": 50}),                                     # more new segments than the table takes
])
def test_cache_gives_the_tokenizers_ids(tokenizer, batch, settings):
  assert segments.applies(tokenizer)
  texts = _texts(1, 400) + ["", "x" * 300, " " * 70, ""]
  cache = segments.SegmentCache(tokenizer, **settings)
  got = []
  for i in range(0, len(texts), batch):
    ids, lengths = cache.encode(texts[i:i + batch])
    assert ids.dtype == np.int32 and lengths.dtype == np.int64 and lengths.sum() == len(ids)
    got += np.split(ids, np.cumsum(lengths)[:-1])
  assert [g.tolist() for g in got] == _one_at_a_time(tokenizer, texts)


@pytest.mark.parametrize("collide", ["among_long", "with_short"])
def test_hash_collisions_are_found(tokenizer, monkeypatch, collide):
  """Segments longer than 7 bytes hashed to 3 values (nearly every lookup finds another long segment's slot, and
  their bytes tell them apart), or all to the key of the short segment " the" (its length tells them apart)."""
  hash_ = segments.SegmentCache._hash
  the = np.frombuffer(b" the".ljust(8, b"\0"), "<u8")[0] | np.uint64(4 << 56)
  fake = {"among_long": lambda *a: hash_(*a) % np.uint64(3) + np.uint64(1),
          "with_short": lambda *a: np.full(len(a[1]), the, np.uint64)}[collide]
  monkeypatch.setattr(segments.SegmentCache, "_hash", staticmethod(fake))
  texts = [" understanding the" + t for t in _texts(4, 200)]       # a long segment met before " the"
  cache = segments.SegmentCache(tokenizer)
  ids, lengths = cache.encode(texts[:100])
  more, more_lengths = cache.encode(texts[100:])
  got = np.split(np.concatenate([ids, more]), np.cumsum(np.concatenate([lengths, more_lengths]))[:-1])
  assert [g.tolist() for g in got] == _one_at_a_time(tokenizer, texts)


@pytest.mark.parametrize("window", [64, 1 << 20])
def test_each_distinct_segment_is_kept_once(tokenizer, window):
  """Whatever the batches and windows it is met in, a segment's key is the same: the cache keeps it once."""
  texts = _texts(5, 300)
  cache = segments.SegmentCache(tokenizer, window=window)
  for i in range(0, len(texts), 7):
    cache.encode(texts[i:i + 7])
  distinct = {s.encode() for t in texts for s in _pieces(t) if len(s.encode()) <= cache.max_bytes}
  kept = [bytes(cache._bytes[start:start + size]) for start, size in
          zip(cache._byte_start[:cache._used[0]], cache._byte_length[:cache._used[0]])]
  assert len(kept) == len(set(kept)) and set(kept) == distinct
  assert sum(len(s) > 7 for s in distinct) > 50


def test_new_segments_are_encoded_joined(tokenizer, monkeypatch):
  """New segments are encoded joined by "<eos>" (in groups of 5 here), unless one holds a special token's text."""
  monkeypatch.setattr(segments, "_JOINED", 5)
  used, encode_batch = [], segments.encode_batch
  monkeypatch.setattr(segments, "encode_batch", lambda t, texts: used.append(t) or encode_batch(t, texts))
  cache = segments.SegmentCache(tokenizer)
  for texts, joined in (([" the", "\n\ndelta", "'s", " 42", "🙂", "\u3000x", "\t"] * 3, True),
                        ([" a<eos>", "b", "<eos>", " <eos", "eos>"] * 3, False)):
    used.clear()
    ids, lengths = cache._encode_joined(texts)
    assert [g.tolist() for g in np.split(ids, np.cumsum(lengths)[:-1])] == _one_at_a_time(tokenizer, texts)
    assert (used[0] is cache._joiner[0]) and (len(used) == 1) == joined


def test_a_joint_strips_nothing_and_has_no_border():
  other = Tokenizer(models.BPE())
  other.add_special_tokens(["abab", AddedToken("<x>", lstrip=True), AddedToken("<y>", rstrip=True), "<z>"])
  joiner, special_ids = segments._joiner(other)
  assert joiner[1:] == (other.token_to_id("<z>"), "<z>") and len(special_ids) == 4
  assert segments._joiner(Tokenizer(models.BPE()))[0] is None


def _variant(tokenizer, change) -> Tokenizer:
  other = Tokenizer.from_str(tokenizer.to_str())
  other.encode_special_tokens = True
  change(other)
  return other


@pytest.mark.parametrize("change", [
    lambda t: setattr(t, "normalizer", normalizers.NFKC()),
    lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.ByteLevel(add_prefix_space=True)),
    lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Whitespace()),
    lambda t: t.add_tokens([AddedToken("ta d", special=False)]),
    lambda t: setattr(t, "encode_special_tokens", False),
    lambda t: t.enable_truncation(8),
], ids=["normalizer", "prefix_space", "other_pre_tokenizer", "added_token", "special_tokens_split", "truncation"])
def test_other_tokenizers_are_encoded_whole(tokenizer, tmp_path, change):
  """Where the cache does not apply, `HFTokenizer.encode_many` encodes each text whole, as encode does."""
  other = _variant(tokenizer, change)
  assert not segments.applies(other)
  other.save(str(tmp_path / "tokenizer.json"))
  hf = tokens.HFTokenizer(tmp_path / "tokenizer.json", "<eos>")
  hf._tokenizer = other          # keeps encode_special_tokens=False, which HFTokenizer would set
  texts = _texts(3, 50)
  ids, lengths = hf.encode_many(texts)
  assert hf._segments is False
  assert [g.tolist() for g in np.split(ids, np.cumsum(lengths)[:-1])] == _one_at_a_time(other, texts)
