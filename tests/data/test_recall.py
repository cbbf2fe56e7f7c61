"""The recall tasks' records (`osdn_jax.data.recall`): MQAR's layout and query-gap law, seeding, the read-twice
form and argument errors; passkey rows; the text source's fixed validation split; the pipeline's recall batches.

Tests of the text split need the corpus at its default place (`make data`) and skip without it."""
import numpy as np
import pytest

from osdn_jax import data, testing
from osdn_jax.data import recall, sources

IGNORE = recall.IGNORE


needs_corpus = testing.needs_corpus()


def _mqar(vocab_size, length, num_pairs, *, num_records=50, seed=0, **kw):
  return data.MQARSource(vocab_size=vocab_size, length=length, num_pairs=num_pairs, num_records=num_records,
                         seed=seed, **kw)


# (vocab, L, kv): the default vocabulary at zoology's sizes, small and odd vocabularies, and kv = L/4 (every
# query slot holds a query) and kv = V//2 − 1 (every key is used).
MQAR_SIZES = [(8192, 256, 16), (8192, 256, 64), (8192, 512, 32), (64, 64, 8), (33, 40, 10), (16, 28, 7)]


@pytest.mark.parametrize("vocab,length,kv", MQAR_SIZES, ids=lambda x: str(x))
def test_mqar_record_layout(vocab, length, kv):
  """Keys distinct in [1, V//2), values distinct in [V//2, V), written k1 v1 k2 v2 … at [0, 2·kv); exactly kv
  scored positions, at even offsets ≥ 2·kv, each reading its key once and labelled with the value paired with it
  in the context; every other label IGNORE; all ids in [0, V); `pairs` and `query_positions` describe the row."""
  src = _mqar(vocab, length, kv, num_records=20, seed=5)
  assert len(src) == 20 and src.row_length == length and src.slots == (length - 2 * kv) // 2
  half = vocab // 2
  for i in range(len(src)):
    rec = src[i]
    inputs, labels = rec["inputs"], rec["labels"]
    assert inputs.dtype == labels.dtype == np.int32 and inputs.shape == labels.shape == (length,)
    assert inputs.min() >= 0 and inputs.max() < vocab
    keys, values = src.pairs(i)
    assert len(set(keys.tolist())) == kv and np.all((1 <= keys) & (keys < half))
    assert len(set(values.tolist())) == kv and np.all((half <= values) & (values < vocab))
    np.testing.assert_array_equal(inputs[0:2 * kv:2], keys)
    np.testing.assert_array_equal(inputs[1:2 * kv:2], values)
    scored = np.flatnonzero(labels != IGNORE)
    assert len(scored) == kv and np.all(scored >= 2 * kv) and np.all(scored % 2 == 0)
    assert sorted(inputs[scored].tolist()) == sorted(keys.tolist())          # every key queried once
    value_of = dict(zip(keys.tolist(), values.tolist()))
    assert [labels[t] for t in scored] == [value_of[inputs[t]] for t in scored]
    positions = src.query_positions(i)
    np.testing.assert_array_equal(np.sort(positions), scored)
    np.testing.assert_array_equal(inputs[positions], keys)
    np.testing.assert_array_equal(labels[positions], values)
    assert np.all(labels[: 2 * kv] == IGNORE)


def test_mqar_filler_is_random_over_the_whole_vocabulary():
  """The unqueried positions of the query part hold tokens from all of [0, V), 0 included, not a constant."""
  src = _mqar(16, 64, 2, num_records=40)
  filler = []
  for i in range(len(src)):
    rec = src[i]
    part = np.ones(64, bool)
    part[:4] = False
    part[src.query_positions(i)] = False
    filler.append(rec["inputs"][part])
  assert set(np.concatenate(filler).tolist()) == set(range(16))


def _chi2_critical(df: int, z: float = 3.719) -> float:
  """The χ² quantile of df degrees of freedom at upper tail α where z is the normal's (3.719: α = 1e-4), by the
  Wilson–Hilferty approximation."""
  c = 2 / (9 * df)
  return df * (1 - c + z * np.sqrt(c)) ** 3


def _chi2(counts: np.ndarray, p: np.ndarray) -> tuple[float, int]:
  """Pearson's χ² of counts against probabilities p, adjacent bins merged until each expects ≥ 5: (χ², dof)."""
  expected = counts.sum() * p
  obs, exp, o, e = [], [], 0.0, 0.0
  for c, x in zip(counts, expected):
    o, e = o + c, e + x
    if e >= 5:
      obs.append(o)
      exp.append(e)
      o, e = 0.0, 0.0
  if e:
    obs[-1], exp[-1] = obs[-1] + o, exp[-1] + e
  obs, exp = np.array(obs), np.array(exp)
  return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


def test_chi2_critical_value():
  """The approximate quantiles are within 3% of tabulated χ² values at α = 1e-4."""
  for df, table in ((5, 25.745), (10, 35.564), (30, 67.633), (60, 109.50)):
    assert abs(_chi2_critical(df) - table) < 0.03 * table


def test_gap_probabilities():
  """p_s ∝ s^(a−1) over s = 1 … slots: sums to 1, decreasing, with the power law's ratios."""
  p = recall.gap_probabilities(100, 0.01)
  assert p.shape == (100,) and p.dtype == np.float64 and np.isclose(p.sum(), 1)
  assert np.all(np.diff(p) < 0)
  np.testing.assert_allclose(p[9] / p[0], 10.0 ** -0.99)
  np.testing.assert_allclose(recall.gap_probabilities(7, 1.0), np.full(7, 1 / 7))


@pytest.mark.parametrize("slots", [31, 127])
def test_mqar_query_slot_follows_the_power_law(slots):
  """With one pair the query's slot is drawn from gap_probabilities (a = 0.01): a χ² goodness-of-fit test at
  α = 1e-4 accepts it, and rejects the same draws against a uniform law and against a = 0.5."""
  n = 4000
  src = _mqar(8192, 2 + 2 * slots, 1, num_records=n, seed=11)
  gaps = np.array([(src.query_positions(i)[0] - 2) // 2 for i in range(n)])
  assert gaps.min() >= 0 and gaps.max() < slots
  counts = np.bincount(gaps, minlength=slots).astype(np.float64)
  stat, dof = _chi2(counts, recall.gap_probabilities(slots, 0.01))
  assert dof >= 10 and stat < _chi2_critical(dof)
  for wrong in (np.full(slots, 1 / slots), recall.gap_probabilities(slots, 0.5)):
    stat, dof = _chi2(counts, wrong)
    assert stat > _chi2_critical(dof)


def test_mqar_query_slot_power_law_follows_power_a():
  """A larger power_a moves the queries later: with a = 1 the slot is uniform (the χ² test accepts it)."""
  slots, n = 31, 3000
  src = _mqar(8192, 2 + 2 * slots, 1, num_records=n, seed=12, power_a=1.0)
  counts = np.bincount([(src.query_positions(i)[0] - 2) // 2 for i in range(n)], minlength=slots)
  stat, dof = _chi2(counts.astype(np.float64), np.full(slots, 1 / slots))
  assert stat < _chi2_critical(dof)


def test_mqar_records_are_seeded_by_seed_and_index():
  """The same (seed, index) gives the same record, also from another source object; other seeds and indices
  give other records."""
  a, b, c = _mqar(8192, 256, 16, seed=0), _mqar(8192, 256, 16, seed=0), _mqar(8192, 256, 16, seed=1)
  for i in (0, 7, 49):
    for k in ("inputs", "labels"):
      np.testing.assert_array_equal(a[i][k], a[i][k])
      np.testing.assert_array_equal(a[i][k], b[i][k])
    assert not np.array_equal(a[i]["inputs"], c[i]["inputs"])
    assert not np.array_equal(a[i]["inputs"][:32], c[i]["inputs"][:32])
  assert not np.array_equal(a[0]["inputs"], a[1]["inputs"])
  with pytest.raises(IndexError):
    a[50]


@pytest.mark.parametrize("vocab,length,kv", [(8192, 256, 16), (8192, 256, 64), (33, 40, 10)], ids=lambda x: str(x))
def test_mqar_read_twice(vocab, length, kv):
  """context_reads=2 writes the same kv block twice, then the same queries and filler: the row is 2·kv longer and
  the query positions move by 2·kv; nothing in the two blocks is scored."""
  once = _mqar(vocab, length, kv, num_records=10, seed=3)
  twice = _mqar(vocab, length, kv, num_records=10, seed=3, context_reads=2)
  assert twice.row_length == length + 2 * kv
  for i in range(10):
    a, b = once[i], twice[i]
    assert b["inputs"].shape == b["labels"].shape == (length + 2 * kv,)
    block = a["inputs"][: 2 * kv]
    np.testing.assert_array_equal(b["inputs"][: 2 * kv], block)
    np.testing.assert_array_equal(b["inputs"][2 * kv:4 * kv], block)
    np.testing.assert_array_equal(b["inputs"][2 * kv:], a["inputs"])
    np.testing.assert_array_equal(b["labels"][2 * kv:], a["labels"])
    assert np.all(b["labels"][: 4 * kv] == IGNORE)
    for x, y in zip(once.pairs(i), twice.pairs(i)):
      np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(twice.query_positions(i), once.query_positions(i) + 2 * kv)


@pytest.mark.parametrize("kw,argument", [
    (dict(vocab_size=8192, length=63, num_pairs=8), "length"),
    (dict(vocab_size=8192, length=62, num_pairs=16), "num_pairs"),
    (dict(vocab_size=16, length=64, num_pairs=8), "num_pairs"),
    (dict(vocab_size=8192, length=64, num_pairs=0), "num_pairs"),
    (dict(vocab_size=3, length=64, num_pairs=1), "vocab_size"),
    (dict(vocab_size=8192, length=64, num_pairs=8, context_reads=3), "context_reads"),
    (dict(vocab_size=8192, length=64, num_pairs=8, context_reads=0), "context_reads"),
    (dict(vocab_size=8192, length=64, num_pairs=8, power_a=0.0), "power_a"),
    (dict(vocab_size=8192, length=64, num_pairs=8, power_a=-0.5), "power_a"),
    (dict(vocab_size=8192, length=64, num_pairs=8, power_a=1.5), "power_a"),
    (dict(vocab_size=8192, length=64, num_pairs=8, num_records=0), "num_records"),
    (dict(vocab_size=8192, length=64, num_pairs=8, seed=-1), "seed"),
])
def test_mqar_bad_arguments_name_the_argument(kw, argument):
  """Each bad argument raises ValueError naming it; the largest allowed sizes build."""
  kw = dict(dict(num_records=4, seed=0), **kw)
  with pytest.raises(ValueError, match=f"`{argument}`"):
    data.MQARSource(**kw)
  _mqar(8192, 64, 16)                                        # 4·kv = L
  _mqar(16, 64, 7)                                           # kv = V//2 − 1: every key


def test_mqar_vocabulary_too_small_for_the_pairs_names_the_vocabulary():
  """kv beyond the V//2 − 1 keys: the message names both num_pairs and vocab_size."""
  with pytest.raises(ValueError, match="`num_pairs`.*`vocab_size` 16"):
    _mqar(16, 64, 8)


def _text(ids: np.ndarray) -> str:
  return bytes(ids.astype(np.uint8)).decode("ascii")


@pytest.mark.parametrize("length,digits", [(256, 5), (1000, 5), (512, 1), (4096, 12)])
def test_passkey_rows(length, digits):
  """Rows are `length` ASCII bytes; exactly the last `digits` positions before the final one are scored, each on
  the byte after it, together the answer; the prompt is the row before the answer and holds the needle with the
  key once, before the question; keys have `digits` digits and no leading zero."""
  src = data.PasskeySource(length=length, num_records=60, seed=2, digits=digits)
  assert src.vocab_size == 256
  keys = set()
  for i in range(len(src)):
    rec = src[i]
    inputs, labels = rec["inputs"], rec["labels"]
    assert inputs.dtype == labels.dtype == np.int32 and inputs.shape == labels.shape == (length,)
    assert inputs.min() >= 0 and inputs.max() < 128
    answer, prompt = src.answer(i), src.prompt(i)
    key = _text(answer)
    assert len(key) == digits and key.isdigit() and key[0] != "0"
    keys.add(key)
    assert len(prompt) == length - digits
    np.testing.assert_array_equal(inputs, np.concatenate([prompt, answer]))
    scored = np.flatnonzero(labels != IGNORE)
    np.testing.assert_array_equal(scored, np.arange(length - digits - 1, length - 1))
    np.testing.assert_array_equal(labels[scored], answer)
    np.testing.assert_array_equal(labels[scored], inputs[scored + 1])
    text = _text(prompt)
    needle = recall.NEEDLE.format(key=key)
    assert text.count(needle) == 1 and text.endswith(recall.QUESTION)
    assert text.index(needle) < text.index(recall.QUESTION)
  assert len(keys) >= (9 if digits == 1 else 50)            # keys differ between records


def test_passkey_needle_depth():
  """The needle sits at the filler sentence boundary nearest depth·(haystack length): first at depth 0, last at
  depth 1, moving later with the depth; the key does not depend on it; depth None draws it per record."""
  length, digits = 2000, 5
  hay = length - len(recall.NEEDLE.format(key="0" * digits)) - len(recall.QUESTION) - digits
  longest = max(len(s) + 2 for s in recall.FILLER.split(". "))
  for i in range(5):
    where, keys = [], set()
    for depth in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0):
      src = data.PasskeySource(length=length, num_records=5, seed=4, depth=depth, digits=digits)
      key = _text(src.answer(i))
      keys.add(key)
      text = _text(src.prompt(i))
      at = text.index(recall.NEEDLE.format(key=key))
      assert abs(at - depth * hay) <= longest, depth
      where.append(at)
      if depth == 1.0:                                       # at most a sentence between needle and question
        assert len(text) - len(recall.QUESTION) - (at + len(recall.NEEDLE.format(key=key))) <= longest
    assert len(keys) == 1
    assert where[0] == 0 and np.all(np.diff(where) > 0)
  free = data.PasskeySource(length=length, num_records=40, seed=4)
  at = [_text(free.prompt(i)).index(recall.NEEDLE.format(key=_text(free.answer(i)))) for i in range(40)]
  assert len(set(at)) > 20 and min(at) < hay / 4 and max(at) > 3 * hay / 4


def test_passkey_seeding():
  """The same (seed, index) gives the same row; another seed gives other keys."""
  a, b, c = (data.PasskeySource(length=300, num_records=20, seed=s) for s in (0, 0, 1))
  for i in range(20):
    np.testing.assert_array_equal(a[i]["inputs"], b[i]["inputs"])
    np.testing.assert_array_equal(a[i]["labels"], b[i]["labels"])
  assert sum(_text(a.answer(i)) != _text(c.answer(i)) for i in range(20)) >= 18


@pytest.mark.parametrize("kw,argument", [
    (dict(length=100), "length"),
    (dict(length=256, digits=0), "digits"),
    (dict(length=256, depth=1.5), "depth"),
    (dict(length=256, depth=-0.1), "depth"),
    (dict(length=256, num_records=0), "num_records"),
])
def test_passkey_bad_arguments_name_the_argument(kw, argument):
  """Each bad argument raises ValueError naming it; a row of exactly the shortest allowed length builds."""
  with pytest.raises(ValueError, match=f"`{argument}`"):
    data.PasskeySource(**dict(dict(num_records=4, seed=0), **kw))
  shortest = len(recall.NEEDLE.format(key="00000")) + len(recall.QUESTION) + 5 + len(recall.FILLER)
  assert data.PasskeySource(length=shortest, num_records=1, seed=0)[0]["inputs"].shape == (shortest,)
  with pytest.raises(ValueError, match="`length`"):
    data.PasskeySource(length=shortest - 1, num_records=1, seed=0)


@pytest.fixture(scope="module")
def splits():
  return {split: data.TextSource("", 8192, split) for split in sources.SPLITS}


@needs_corpus
def test_text_split_partitions_the_blocks(splits):
  """train and validation are disjoint and together are "all", in its order; validation is about one block in
  VALIDATION_EVERY, and holds exactly the blocks in_validation picks."""
  every, train, val = splits["all"], splits["train"], splits["validation"]
  assert not set(train.names) & set(val.names)
  assert sorted(train.names + val.names) == sorted(every.names)
  text_of = dict(zip(every.names, every.records))
  for part in (train, val):
    assert part.records == [text_of[n] for n in part.names]
    assert part.names == [n for n in every.names if n in set(part.names)]
  assert [n for n in every.names if sources.in_validation(n)] == val.names
  share = len(val) / len(every)
  assert 0.4 / sources.VALIDATION_EVERY < share < 2 / sources.VALIDATION_EVERY
  assert len(val) >= 10


@needs_corpus
def test_text_split_depends_only_on_block_names(splits, tmp_path):
  """A corpus of a few of the files, copied in, gives those files' validation blocks of the whole corpus: the
  split does not depend on the other blocks or their order."""
  files = sources.corpus_files()
  with_validation = sorted({n.split(":")[0] for n in splits["validation"].names})
  chosen = [p for p in files if p.stem in with_validation[::-4][:2]] + [files[0]]
  for path in chosen:
    (tmp_path / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
  stems = {p.stem for p in chosen}
  small = data.TextSource(tmp_path, 8192, "validation")
  assert small.names == [n for n in splits["validation"].names if n.split(":")[0] in stems]
  names = list(splits["all"].names)
  np.random.default_rng(0).shuffle(names)
  assert {n for n in names if sources.in_validation(n)} == set(splits["validation"].names)


def test_text_source_bad_split(tmp_path):
  """An unknown split raises ValueError naming `split`."""
  (tmp_path / "a.txt").write_text("A line.\n\nAnother.\n")
  with pytest.raises(ValueError, match="`split`"):
    data.TextSource(tmp_path, 8192, "test")


def _pipe_batches(cfg, seq_len, n=3, batch_size=4):
  pipe = data.make_pipeline(dict(cfg, prefetch=0), seq_len=seq_len, batch_size=batch_size, seed=0)
  out = [next(pipe) for _ in range(n)]
  pipe.close()
  return out


@pytest.mark.parametrize("reads", [1, 2])
@pytest.mark.parametrize("vocab,length,kv", [(8192, 256, 16), (64, 64, 16)], ids=lambda x: str(x))
def test_pipeline_mqar_batches(vocab, length, kv, reads):
  """MQAR batches (seq_len = L + 2·kv·(reads − 1)): kv scored positions per row, reading keys in [1, V//2) of
  the row's kv block(s) and targeting values in [V//2, V); targets 0 elsewhere."""
  seq_len = length + 2 * kv * (reads - 1)
  cfg = dict(source="mqar", vocab_size=vocab, mqar_pairs=kv, mqar_reads=reads, num_records=32)
  for batch in _pipe_batches(cfg, seq_len):
    assert batch["tokens"].shape == (4, seq_len)
    mask = batch["loss_mask"]
    np.testing.assert_array_equal(mask.sum(axis=1), kv)
    scored = mask == 1
    keys, values = batch["tokens"][scored], batch["targets"][scored]
    assert np.all((1 <= keys) & (keys < vocab // 2)) and np.all((vocab // 2 <= values) & (values < vocab))
    assert np.all(batch["targets"][~scored] == 0)
    for row, m in zip(batch["tokens"], mask):
      block = row[: 2 * kv]
      if reads == 2:
        np.testing.assert_array_equal(row[2 * kv:4 * kv], block)
      assert set(row[m == 1].tolist()) == set(block[0::2].tolist())
      assert np.all(np.flatnonzero(m) >= 2 * kv * reads)


@pytest.mark.parametrize("digits,depth", [(5, -1.0), (3, 0.5), (8, 1.0)])
def test_pipeline_passkey_batches(digits, depth):
  """Passkey batches: `passkey_digits` scored positions per row, the row's last but one, targeting ASCII digits
  that the row then reads; targets 0 elsewhere."""
  seq_len = 384
  cfg = dict(source="passkey", passkey_digits=digits, passkey_depth=depth, num_records=32)
  for batch in _pipe_batches(cfg, seq_len):
    mask, targets, tokens = batch["loss_mask"], batch["targets"], batch["tokens"]
    np.testing.assert_array_equal(mask.sum(axis=1), digits)
    assert np.all(mask[:, seq_len - digits - 1:seq_len - 1] == 1)
    digits_scored = targets[mask == 1]
    assert np.all((ord("0") <= digits_scored) & (digits_scored <= ord("9")))
    np.testing.assert_array_equal(targets[:, seq_len - digits - 1:seq_len - 1], tokens[:, seq_len - digits:])
    assert np.all(targets[mask == 0] == 0)
