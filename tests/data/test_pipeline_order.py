"""The records' order of the map-style sources: "epoch" (a permutation per epoch) or "replacement" (every record of
the stream drawn independently), deterministic, split across processes and resumable either way."""
from __future__ import annotations

import numpy as np
import pytest

from osdn_jax import data
from osdn_jax.data import sources

T, B = 16, 4
RANDOM = dict(source="random", vocab_size=1000, num_records=16, prefetch=0)


def _rows(cfg, n, **kw):
  pipe = data.make_pipeline(cfg, seq_len=T, batch_size=B, seed=0, **kw)
  batches = [next(pipe) for _ in range(n)]
  pipe.close()
  return [tuple(np.append(b["tokens"][r], b["targets"][r, -1])) for b in batches for r in range(len(b["tokens"]))]


def test_replacement_draws_records_independently_and_the_same_on_any_number_of_processes():
  """Drawn with replacement, 16 records over 40 batches of 4: every row is a record, a record recurs within an
  epoch's worth of rows (which the epoch order never does), counts are uneven, and 2 processes read the one
  stream's rows between them."""
  cfg = dict(RANDOM, order="replacement")
  records = sources.RandomTokens(cfg["vocab_size"], T + 1, 16, seed=0)
  index = {tuple(records[i]): i for i in range(16)}
  rows = _rows(cfg, 40)
  drawn = np.array([index[r] for r in rows])
  assert any(len(set(drawn[e * 16:(e + 1) * 16])) < 16 for e in range(10))
  epoch = np.array([index[r] for r in _rows(dict(RANDOM, order="epoch"), 40)])
  assert all(len(set(epoch[e * 16:(e + 1) * 16])) == 16 for e in range(10))
  counts = np.bincount(drawn, minlength=16)
  assert counts.min() > 0 and counts.max() > counts.min()
  assert rows == _rows(cfg, 40)
  halves = [_rows(cfg, 40, process_index=i, process_count=2) for i in range(2)]
  assert [r for b in range(40) for h in halves for r in h[2 * b:2 * b + 2]] == rows


def test_a_stream_drawn_with_replacement_resumes_where_it_stopped():
  cfg = dict(RANDOM, order="replacement")
  pipe = data.make_pipeline(cfg, seq_len=T, batch_size=B, seed=0)
  for _ in range(5):
    next(pipe)
  state = pipe.get_state()
  after = [next(pipe) for _ in range(3)]
  pipe.close()
  again = data.make_pipeline(cfg, seq_len=T, batch_size=B, seed=0)
  again.set_state(state)
  for a, b in zip(after, [next(again) for _ in range(3)]):
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
  again.close()


@pytest.mark.parametrize("cfg, match", [(dict(RANDOM, order="shuffled"), "order"),
                                        (dict(source="text", order="replacement"), "order")])
def test_a_bad_order_is_refused_by_name(cfg, match):
  with pytest.raises(ValueError, match=match):
    data.make_pipeline(cfg, seq_len=T, batch_size=B, seed=0)
