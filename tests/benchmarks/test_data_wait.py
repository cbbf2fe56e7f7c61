"""benchmarks.data_wait: the modelled trainer loop over a real pipeline gives one (host wait, device idle) pair of
shares per log window."""
from benchmarks import data_wait
from osdn_jax.train import configs


def test_measure_gives_shares_per_window():
  config = configs.get_config("tiny")
  config.log_every = 3
  rows = data_wait.measure(config, prefetch=4, step_s=0.002, windows=2)
  assert len(rows) == 2
  assert all(0.0 <= share <= 1.0 for row in rows for share in row), rows
