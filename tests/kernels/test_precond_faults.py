"""The PDN / ATQ kernels of both backends (interpret mode on CPU) called directly, unpacked, on inputs with a fault:
each confines it as the token-serial recurrence does (`confines_faults`), with no help from the caller. A NaN, an
inf or an overflowing square in k_t (one channel), or a NaN in β_t or in the log-decay g_t, or g_t = +inf (every
channel of the head): outputs from t on and A_T non-finite there; the rows before t, the other channels, heads and
batch rows as in the clean run."""
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gpu import decayed_sum as ds
from pallas_kernels.gpu import precond_key as pk
from pallas_kernels.tpu import decayed_sum as tpu_ds
from pallas_kernels.tpu import precond_key as tpu_pk

B, T, H, K = 2, 300, 2, 20        # T not a multiple of any kernel's chunk (TPU: 128), K padded
CHANNEL = 5

FAULTS = {   # (input, value, the whole head) at (batch 1, token t, head 0[, CHANNEL])
    "k nan": ("k", np.nan, False), "k inf": ("k", np.inf, False), "k overflow": ("k", 1e20, False),
    "beta nan": ("beta", np.nan, True), "log_decay nan": ("g", np.nan, True), "log_decay +inf": ("g", np.inf, True),
}


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(B, T, H, K)).astype(np.float32)
  q = rng.normal(size=(B, T, H, K)).astype(np.float32)
  beta = (1 / (1 + np.exp(-rng.normal(size=(B, T, H))))).astype(np.float32)
  g = np.log(1 / (1 + np.exp(-rng.normal(size=(B, T, H)) - 2))).astype(np.float32)
  return dict(k=k, q=q, beta=beta, g=g)


KERNELS = {
    "decayed_sum": lambda a: ds.decayed_sum(a["k"], a["g"], beta=a["beta"], interpret=True),
    "pdn": lambda a: pk.precond_key(a["k"], a["beta"], a["g"], transform="pdn", center=jnp.zeros(H), interpret=True),
    "atq": lambda a: pk.precond_key(a["k"], a["beta"], a["g"], transform="atq", q=a["q"], interpret=True),
    "tpu decayed_sum": lambda a: tpu_ds.decayed_sum(a["k"], a["g"], beta=a["beta"], interpret=True,
                                                    config=tpu_ds.Config(chunk=128)),
    "tpu atq": lambda a: tpu_pk.precond_key(a["k"], a["beta"], a["g"], transform="atq", q=a["q"], interpret=True,
                                            config=tpu_ds.Config(chunk=128)),
}


@functools.cache
def _clean_run(kernel):
  """`kernel` on the clean inputs (numpy): one run per kernel, shared by its cases."""
  return tuple(map(np.asarray, KERNELS[kernel](_inputs())))


def test_the_kernels_declare_it():
  for kernel in (ds.decayed_sum, pk.precond_key, tpu_ds.decayed_sum, tpu_pk.precond_key):
    assert kernel.confines_faults


@pytest.mark.parametrize("t, fault", [(170, f) for f in FAULTS] + [(30, "k nan")])   # chunk 1 or 2, and chunk 0
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_fault_stays_where_the_recurrence_puts_it(kernel, fault, t):
  clean = _inputs()
  name, value, whole_head = FAULTS[fault]
  faulty = {n: a.copy() for n, a in clean.items()}
  if name == "k":
    faulty["k"][1, t, 0, CHANNEL] = value if value != 1e20 else faulty["k"][1, t, 0, CHANNEL] * value
  else:
    faulty[name][1, t, 0] = value
  y0, last0 = _clean_run(kernel)
  y1, last1 = map(np.asarray, KERNELS[kernel](faulty))
  hit = np.zeros(y0.shape, bool)
  if whole_head:
    hit[1, t:, 0, :] = True
  else:
    hit[1, t:, 0, CHANNEL] = True
  assert np.isfinite(y0).all() and np.isfinite(last0).all()
  assert not np.isfinite(y1[hit]).any(), "the rows from the fault on must be non-finite"
  np.testing.assert_allclose(y1[~hit], y0[~hit], rtol=1e-5, atol=1e-6)
  final = hit[:, -1]
  assert not np.isfinite(last1[final]).any()
  np.testing.assert_allclose(last1[~final], last0[~final], rtol=1e-5, atol=1e-6)
