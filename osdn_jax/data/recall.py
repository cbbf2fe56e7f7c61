"""Synthetic recall tasks: multi-query associative recall (MQAR), its read-twice (JRT) form, and passkey retrieval.

Every record is a dict of two int32 arrays of one length L: "inputs" (the tokens the model reads) and "labels"
(the token to predict at each position, `IGNORE` = −100 where nothing is scored), a pure function of the
constructor's arguments and the record's index. Imports only numpy.

MQAR follows zoology's `multiquery_ar` (Arora et al., 2023), read for its definition:

  vocabulary V: keys from [1, V/2), values from [V/2, V) (V/2 rounded down), both drawn without replacement, so
                kv ≤ V/2 − 1
  [0, 2·kv)     k_1 v_1 … k_kv v_kv                     the context (the kv block)
  [2·kv, L)     (L − 2·kv)/2 slots of two tokens; key i is queried in slot g_i (distinct slots, drawn with
                probability ∝ a·s^(a−1), s = 1 … slots, a = power_a = 0.01: mostly early, with a long tail), at
                position 2·kv + 2·g_i, whose label is v_i; every other position of this part holds a random
                token from [0, V), also the one right after a query (so a value follows its query only by chance)

The read-twice form (`context_reads=2`, after Arora et al., 2024, "Just read twice") is the same example with
the kv block written twice before the queries, so every key recurs: rows are L + 2·kv long, and record i of the
two forms shows the same pairs, queries and filler.

Passkey (S-NIAH-1 style) over UTF-8 bytes: a haystack of a repeated filler sentence, one needle sentence
naming a number at a chosen depth, and a closing question whose answer (the number's digits) is the labelled
part; `PasskeySource.prompt` gives the same example cut before the answer, for scoring by generation.
"""
from __future__ import annotations

import numpy as np

from osdn_jax.data.sources import check_int as _check_int, record_index as _index

IGNORE = -100


def gap_probabilities(slots: int, power_a: float = 0.01) -> np.ndarray:
  """p_s ∝ a·s^(a−1) over slots s = 1 … slots (the query slots' distribution), float64 [slots], sums to 1."""
  p = power_a * np.arange(1, slots + 1, dtype=np.float64) ** (power_a - 1)
  return p / p.sum()


class MQARSource:
  """MQAR records (module docstring): record i of `num_records` is seeded by (seed, i); train and test sets are
  two sources with different seeds. Fields: vocab_size V, length L (even; the row is L + 2·kv·(context_reads −
  1) long), num_pairs kv (4·kv ≤ L, and kv ≤ V/2 − 1 distinct keys), power_a, context_reads (1 or 2).
  `query_positions(i)` and `pairs(i)` expose an example's structure for tests and diagnostics.
  """

  def __init__(self, *, vocab_size: int = 8192, length: int, num_pairs: int, num_records: int, seed: int,
               power_a: float = 0.01, context_reads: int = 1):
    owner = "MQARSource"
    self.vocab_size = _check_int(owner, "vocab_size", vocab_size, 4)
    self.length = _check_int(owner, "length", length, 4)
    self.num_pairs = _check_int(owner, "num_pairs", num_pairs, 1)
    self.num_records = _check_int(owner, "num_records", num_records, 1)
    self.seed = _check_int(owner, "seed", seed, 0)
    self.context_reads = _check_int(owner, "context_reads", context_reads, 1)
    if context_reads > 2:
      raise ValueError(f"{owner}: `context_reads` must be 1 or 2, got {context_reads}")
    if length % 2:
      raise ValueError(f"{owner}: `length` must be even (the query part is made of two-token slots), got {length}")
    if 4 * num_pairs > length:
      raise ValueError(f"{owner}: `num_pairs` ({num_pairs}) needs length ≥ 4·num_pairs = {4 * num_pairs} "
                       f"(the kv block and as many query slots), got {length}")
    self.key_vocab = vocab_size // 2
    if num_pairs > self.key_vocab - 1:
      raise ValueError(f"{owner}: `num_pairs` ({num_pairs}) exceeds the {self.key_vocab - 1} distinct keys of "
                       f"`vocab_size` {vocab_size} (needs vocab_size ≥ {2 * num_pairs + 2})")
    if isinstance(power_a, bool) or not isinstance(power_a, (int, float, np.floating)) or not 0 < power_a <= 1:
      raise ValueError(f"{owner}: `power_a` must be a number in (0, 1], got {power_a!r}")
    self.power_a = float(power_a)
    self.slots = (length - 2 * num_pairs) // 2
    self.row_length = length + 2 * num_pairs * (context_reads - 1)
    self._p = gap_probabilities(self.slots, self.power_a)

  def __len__(self) -> int:
    return self.num_records

  def _draw(self, index: int):
    rng = np.random.default_rng([self.seed, _index(index, self.num_records)])
    kv = self.num_pairs
    keys = rng.choice(np.arange(1, self.key_vocab), kv, replace=False)
    values = rng.choice(np.arange(self.key_vocab, self.vocab_size), kv, replace=False)
    gaps = rng.choice(self.slots, kv, replace=False, p=self._p)
    filler = rng.integers(0, self.vocab_size, self.length - 2 * kv)
    return keys, values, gaps, filler

  def pairs(self, index: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys [kv], values [kv]) of record `index`, in context order."""
    keys, values, _, _ = self._draw(index)
    return keys.astype(np.int32), values.astype(np.int32)

  def query_positions(self, index: int) -> np.ndarray:
    """The row positions of record `index`'s queries, in key order (query j asks key j): int [kv]."""
    _, _, gaps, _ = self._draw(index)
    return 2 * self.num_pairs * self.context_reads + 2 * gaps

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    keys, values, gaps, filler = self._draw(index)
    kv = self.num_pairs
    context = np.empty(2 * kv, np.int64)
    context[0::2], context[1::2] = keys, values
    queries = filler.copy()
    queries[2 * gaps] = keys
    labels = np.full(self.length - 2 * kv, IGNORE, np.int64)
    labels[2 * gaps] = values
    inputs = np.concatenate([context] * self.context_reads + [queries])
    labels = np.concatenate([np.full(2 * kv * self.context_reads, IGNORE), labels])
    return {"inputs": inputs.astype(np.int32), "labels": labels.astype(np.int32)}


FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is "


class PasskeySource:
  """Passkey retrieval over UTF-8 bytes (ids 0–255): `FILLER` repeated and cut to fit (the last sentence runs
  into the question), `NEEDLE` with a random `digits`-digit number inserted at the filler sentence boundary
  nearest to depth·(haystack length), then `QUESTION` and the number's digits, the only labelled tokens (each
  predicted from the byte before it). Rows are `length` bytes: the haystack fills what the needle, question and
  answer leave.

  depth: a fixed fraction in [0, 1], or None to draw one uniformly per record. Record i is seeded by (seed, i).
  `answer(i)` is the number's digits (bytes), `prompt(i)` the row up to and without them.
  """

  def __init__(self, *, length: int, num_records: int, seed: int, depth: float | None = None, digits: int = 5):
    owner = "PasskeySource"
    self.length = _check_int(owner, "length", length, 1)
    self.num_records = _check_int(owner, "num_records", num_records, 1)
    self.seed = _check_int(owner, "seed", seed, 0)
    self.digits = _check_int(owner, "digits", digits, 1)
    if depth is not None and (not isinstance(depth, (int, float)) or not 0 <= depth <= 1):
      raise ValueError(f"{owner}: `depth` must be None or a number in [0, 1], got {depth!r}")
    self.depth = depth
    fixed = len(NEEDLE.format(key="0" * digits)) + len(QUESTION) + digits
    if length < fixed + len(FILLER):
      raise ValueError(f"{owner}: `length` ({length}) must be ≥ {fixed + len(FILLER)} (needle, question, answer "
                       "and the filler once)")
    self.vocab_size = 256
    self._haystack = length - fixed

  def __len__(self) -> int:
    return self.num_records

  def _draw(self, index: int) -> tuple[str, str]:
    """(text before the answer, the answer) of record `index`."""
    rng = np.random.default_rng([self.seed, _index(index, self.num_records)])
    depth = rng.random() if self.depth is None else self.depth
    key = "".join(str(d) for d in rng.integers(0, 10, self.digits))
    if key[0] == "0":
      key = str(1 + rng.integers(0, 9)) + key[1:]
    hay = (FILLER * (self._haystack // len(FILLER) + 1))[:self._haystack]
    bounds = [0] + [i + 2 for i in range(len(hay) - 1) if hay[i:i + 2] == ". "]   # where sentences start
    cut = min(bounds, key=lambda b: abs(b - depth * len(hay)))
    return hay[:cut] + NEEDLE.format(key=key) + hay[cut:] + QUESTION, key

  def answer(self, index: int) -> np.ndarray:
    return np.frombuffer(self._draw(index)[1].encode(), np.uint8).astype(np.int32)

  def prompt(self, index: int) -> np.ndarray:
    return np.frombuffer(self._draw(index)[0].encode(), np.uint8).astype(np.int32)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    text, key = self._draw(index)
    row = np.frombuffer((text + key).encode(), np.uint8).astype(np.int32)
    # Position t is scored on token t + 1: the digits are predicted from the byte before each of them.
    inputs = row
    labels = np.full(len(row), IGNORE, np.int32)
    labels[len(text) - 1:len(row) - 1] = row[len(text):]
    return {"inputs": inputs, "labels": labels}
