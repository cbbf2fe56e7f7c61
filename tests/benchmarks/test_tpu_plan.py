"""The TPU cost model (`benchmarks.tpu_cost`) and its plan (`benchmarks.tpu_plan`).

Without libtpu: the forward kernel's per-chunk model against the dots and exps of the traced kernel, and the
roofline's bookkeeping. With libtpu (the `tpu-aot` extra): the gdn rows at one small shape compiled for one v5p
chip, their expected times positive and bounded, the kernel model against the compiled custom call's cost
estimate, the HLO count against XLA's `cost_analysis()`, the VMEM model against the compiled kernel's, and a
report with every row."""
import importlib.util
import textwrap

import jax
import jax.numpy as jnp
import pytest

from benchmarks import census
from benchmarks import tpu_cost as tc
from benchmarks import tpu_plan as tp

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (the tpu-aot extra)")
SHAPE = "1x512x2x128"      # B, T, H = HV, K = V: 8 chunks of 64 per program, 2 programs
# Bounds of the comparisons with what the compiler reports (observed in brackets at this shape on v5p):
HLO_FLOPS = 0.1            # |HLO count (loops once) / cost_analysis flops − 1|  (≤ 0.06)
HLO_BYTES = (0.45, 1.2)    # HLO count (loops once, VMEM arrays counted) / cost_analysis bytes accessed  (0.53–1.11)
VMEM = (1.0, 2.0)          # compiled scoped VMEM / the model's blocks + scratch  (~1.5)


@pytest.mark.parametrize("decay,chunk", [("none", 64), ("scalar", 64), ("channel", 64), ("scalar", 128)])
def test_forward_model_is_the_traced_kernel(decay, chunk):
  """The model's dots, HIGHEST dots and exps per grid step are the kernel's own (traced, not compiled)."""
  from pallas_kernels.tpu import delta_rule as tdr
  b, t, h, kd = 1, 2 * chunk, 2, 128
  sd = lambda *s, dtype=jnp.float32: jax.ShapeDtypeStruct(s, dtype)
  g = {"none": None, "scalar": sd(b, t, h), "channel": sd(b, t, h, kd)}[decay]
  fn = lambda q, k, v, beta, g: tdr.forward(q, k, v, beta, log_decay=g, chunk_size=chunk, interpret=False)
  [kernel] = census.census(fn, *(sd(b, t, h, kd, dtype=jnp.bfloat16),) * 3, sd(b, t, h), g)
  step = tc.delta_rule_fwd(chunk, kd, kd, decay=decay)
  assert step.flops() == 2 * kernel.macs
  assert step.flops(tc.HIGHEST_PASSES) == 2 * kernel.macs_f32
  assert step.exps == kernel.exps


def test_roofline_bookkeeping():
  """Padding never lowers the MXU work; the modelled backward does 2–3× the forward's dots; an HBM-bound step's
  time is its bytes over the bandwidth."""
  chip = tc.CHIPS["v5p"]
  fwd, bwd = tc.delta_rule_fwd(64), tc.delta_rule_bwd(64)
  assert fwd.padded_flops(128) >= fwd.pass_flops >= fwd.flops() > 0
  assert fwd.padded_flops(256) >= fwd.padded_flops(128)
  assert 2 <= bwd.flops() / fwd.flops() <= 3
  launch = tc.Launch(tc.Step("copy", 64, [], 0, 1e6, 0, 0, 0), 10, 2)
  assert tc.kernel_time(launch, chip)["time_s"] == pytest.approx(1e7 / chip.hbm_bw)


# A loop of 24 iterations (`i < 24`) around an fp32 dot at HIGHEST, [8, 128] × [128, 128].
_HLO = textwrap.dedent("""\
    HloModule m

    %body (t.0: (s32[], f32[8,128])) -> (s32[], f32[8,128]) {
      %t.0 = (s32[], f32[8,128]) parameter(0)
      %i = s32[] get-tuple-element(%t.0), index=0
      %x = f32[8,128]{1,0:T(8,128)} get-tuple-element(%t.0), index=1
      %w = f32[128,128]{1,0:T(8,128)} broadcast(%i), dimensions={}
      DOT
      ROOT %t.1 = (s32[], f32[8,128]) tuple(%i, %d)
    }

    %cond (t.2: (s32[], f32[8,128])) -> pred[] {
      %t.2 = (s32[], f32[8,128]) parameter(0)
      %i.1 = s32[] get-tuple-element(%t.2), index=0
      %n = s32[] constant(24)
      ROOT %lt = pred[] compare(%i.1, %n), direction=LT
    }

    ENTRY %main (p: f32[8,128]) -> f32[8,128] {
      %p = f32[8,128]{1,0:T(8,128)} parameter(0)
      %z = s32[] constant(0)
      %t = (s32[], f32[8,128]) tuple(%z, %p)
      %w.0 = (s32[], f32[8,128]) while(%t), condition=%cond, body=%body
      ROOT %r = f32[8,128]{1,0:T(8,128)} get-tuple-element(%w.0), index=1
    }
    """).replace("DOT", "%d = f32[8,128] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, "
                        "operand_precision={highest,highest}")


def test_hlo_counter():
  """Ops in a loop body count once per iteration (and once with loops=False, as XLA's cost analysis counts them);
  a dot at HIGHEST is six passes; tiled layouts pad, arrays in VMEM (S(1)) move no HBM bytes."""
  for loops, runs in ((True, 24), (False, 1)):
    totals = tc.hlo_totals(tc.hlo_ops(_HLO, loops=loops))
    assert totals["flops"] == totals["flops_highest"] == runs * 2 * 8 * 128 * 128
    assert totals["pass_flops"] == tc.HIGHEST_PASSES * totals["flops"]
    broadcast, dot, compare = 128 * 128 * 4 + 4, 2 * 8 * 128 * 4 + 128 * 128 * 4, 1 + 4 + 4
    assert totals["bytes"] == runs * (broadcast + dot) + compare        # (the loop's condition: once)
  assert tc._nbytes("f32[4,16]{1,0:T(8,128)}") == 8 * 128 * 4
  assert tc._nbytes("bf16[4,16]{1,0:T(8,128)(2,1)}") == 16 * 128 * 2
  assert tc._nbytes("f32[4,16]{1,0:T(8,128)S(1)}") == 0


@needs_libtpu
@pytest.mark.slow
def test_plan_small_shape():
  """The gdn rows (Pallas forward, modelled and compiled forward + backward, XLA forward and forward + backward)
  compiled for one v5p chip: every row reported with positive times, the kernel model equal to the custom call's
  cost estimate in flops and bytes, XLA's counts within the stated factors of the HLO count, and the VMEM model
  within the stated factor of the compiled kernel's."""
  report = tp.build_report([SHAPE], ["v5p"], 64, True, ops=("gdn",), log=lambda *_: None)
  rows = {r["row"]: r for r in report["rows"]}
  expected_rows = {"gdn pallas fwd", "gdn pallas fwd+bwd (model)", "gdn xla fwd", "gdn xla fwd+bwd"}
  assert expected_rows <= set(rows), set(rows)
  assert report["chips"]["v5p"]["vmem_compiler"] == tc.CHIPS["v5p"].vmem_bytes
  for name, r in rows.items():
    e = r["expected"]
    assert e["time_s"] > 0 and e["mxu_s"] > 0 and e["hbm_s"] > 0, name
    assert max(e["mxu_s"], e["hbm_s"]) <= e["time_s"] * (1 + 1e-9) <= (e["mxu_s"] + e["hbm_s"]) * (1 + 1e-9), name
    assert 0 < e["mxu_utilisation"] <= 1, name
    once, ca = r["compiled"]["hlo_once"], r["compiled"]["cost_analysis"]
    flops = once["flops"] + once["vpu_flops"] + once["kernel_flops"]
    assert abs(flops / ca["flops"] - 1) <= HLO_FLOPS, (name, flops, ca)
    assert HLO_BYTES[0] <= once["bytes"] / ca["bytes accessed"] <= HLO_BYTES[1], (name, once, ca)

  fwd = rows["gdn pallas fwd"]
  [kernel] = fwd["expected"]["kernels"]
  [(call, info)] = fwd["compiled"]["kernels"].items()
  assert call.startswith("delta_rule_fwd_tpu")
  assert kernel["useful_flops"] == info["cost_estimate"]["flops"]
  assert kernel["hbm_bytes"] == info["cost_estimate"]["bytes_accessed"]
  assert VMEM[0] <= info["scoped_vmem"] / (kernel["vmem_blocks"] + kernel["vmem_scratch"]) <= VMEM[1], info
  # The XLA path runs every dot at HIGHEST (six passes); loops count by their trip counts (XLA may unroll short ones).
  xla = rows["gdn xla fwd"]["compiled"]
  assert xla["hlo"]["flops_highest"] == xla["hlo"]["flops"] >= xla["hlo_once"]["flops"] > 0

  md = tp.markdown(report)
  for r in report["rows"]:
    assert f"| {r['op']} | {r['mode']} | {r['decay']} | v5p |" in md
