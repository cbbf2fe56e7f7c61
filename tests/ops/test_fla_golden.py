"""Our ops against a peer implementation: golden inputs and outputs of FLA ops, generated on an H200
(`python3 -m experiments.fla_golden --out tests/fixtures/fla`) and checked here without torch.

Every file holds q, k, v as FLA saw them in bf16 (fp32 arrays of bf16-rounded values), the other inputs in fp32.
chunk_delta_rule: outputs, final state and every input gradient.
chunk_gated_delta_rule: outputs and final state (FLA refuses its backward on Hopper with Triton 3.6).
chunk_precond_gated_delta_rule (PGDN): outputs, final state S and final second moment A (no backward, likewise).
chunk_kda: outputs, final state and every input gradient (per-channel decay g included).
chunk_precond_kda (PKDA): outputs, S, A and every input gradient, the preconditioner's gates and its initial
second moment included (generated with `--one-config`: FLA's first autotuning config only).
The differences are FLA's bf16/TF32 arithmetic: compared at docs/design.md §4's bf16 tolerances.
"""
import os

import numpy as np
import pytest

from experiments import fla_golden
from osdn_jax.testing import BF16_TOL, rel_rms

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "fla")
GOLDEN = ("chunk_delta_rule", "chunk_gated_delta_rule", "chunk_precond_gated_delta_rule", "chunk_kda",
          "chunk_precond_kda")


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
  if op in ("chunk_delta_rule", "chunk_kda", "chunk_precond_kda"):   # FLA ran the backward there
    assert {"d_q", "d_k", "d_v", "d_beta"} <= set(want)
  for name, ref in want.items():
    ours = got[name] if not name.startswith("d_") else grads[name[2:]]
    assert rel_rms(ours, ref) <= _tolerance(name), (name, rel_rms(ours, ref))


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "chunk_kda"])
def test_the_comparison_can_fail(op):
  """A wrong op (the decay dropped) is far outside the tolerance on the GDN and KDA files."""
  data = np.load(os.path.join(DATA, f"{op}.npz"))
  x = {k[3:]: data[k] for k in data.files if k.startswith("in_") and k != "in_g"}
  got, _ = fla_golden.ours("chunk_delta_rule", x)
  assert rel_rms(got["o"], data["out_o"]) > 10 * _tolerance("o")


def test_precond_kda_gradients_can_fail():
  """The preconditioner's gate gradient in the PKDA file tells a wrong second-moment decay from the right one."""
  data = np.load(os.path.join(DATA, "chunk_precond_kda.npz"))
  x = {k[3:]: data[k] for k in data.files if k.startswith("in_")}
  x["g_p"] = x["g_p"] * 0.5
  _, grads = fla_golden.ours("chunk_precond_kda", x)
  assert rel_rms(grads["g_p"], data["out_d_g_p"]) > 3 * _tolerance("d_g_p")
