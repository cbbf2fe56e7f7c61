"""Our ops against a peer implementation: golden inputs and outputs of FLA ops, generated on an H200
(`python3 -m experiments.fla_golden --out tests/data/fla`) and checked here without torch.

chunk_delta_rule: q, k, v in bf16 (FLA refuses fp32 there), outputs, final state and every input gradient.
chunk_gated_delta_rule: fp32 inputs, outputs and final state (FLA refuses its backward on Hopper with Triton
3.6, FLA #640).
chunk_precond_gated_delta_rule (PGDN): fp32 inputs, outputs, final state S and final second moment A (no
backward, FLA #640).
The inputs in the files are exactly what FLA saw, so the differences are FLA's bf16/TF32 arithmetic: compared
at DESIGN.md §4's bf16 tolerances. chunk_kda and chunk_precond_kda were not generated: FLA's compilation of
chunk_kda outlasted 200 s even with one autotuning config (see docs/benchmarks.md).
"""
import os

import numpy as np
import pytest

from experiments import fla_golden
from osdn_jax.testing import BF16_TOL, rel_rms

DATA = os.path.join(os.path.dirname(__file__), "data", "fla")
GOLDEN = ("chunk_delta_rule", "chunk_gated_delta_rule", "chunk_precond_gated_delta_rule")


def _tolerance(name):
  base = name[2:] if name.startswith("d_") else name
  return BF16_TOL.get({"g": "log_decay", "A": "S"}.get(base, base), BF16_TOL["log_decay"])


@pytest.mark.parametrize("op", GOLDEN)
def test_against_fla(op):
  data = np.load(os.path.join(DATA, f"{op}.npz"))
  x = {k[3:]: data[k] for k in data.files if k.startswith("in_")}
  want = {k[4:]: data[k] for k in data.files if k.startswith("out_")}
  got, grads = fla_golden.ours(op, x)
  assert {"o", "S"} <= set(want)
  for name, ref in want.items():
    ours = got[name] if not name.startswith("d_") else grads[name[2:]]
    assert rel_rms(ours, ref) <= _tolerance(name), (name, rel_rms(ours, ref))


def test_the_comparison_can_fail():
  """A wrong op (the decay dropped) is far outside the tolerance on the GDN file."""
  data = np.load(os.path.join(DATA, "chunk_gated_delta_rule.npz"))
  x = {k[3:]: data[k] for k in data.files if k.startswith("in_") and k != "in_g"}
  got, _ = fla_golden.ours("chunk_delta_rule", x)
  assert rel_rms(got["o"], data["out_o"]) > 10 * _tolerance("o")
