"""The benchmark runner (`benchmarks`): variants parse into kernel configs, the plan crosses them with the right
implementations, the trace reader counts device kernels per call, the census counts a kernel's dots, the results
file is rewritten row by row, and the runner's main loop measures, checks and tabulates a tiny op on CPU."""
import gzip
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from benchmarks import registry, run, trace
from benchmarks.census import census


# ---------------------------------------------------------------------------------------------------------
# Variants and the plan.
# ---------------------------------------------------------------------------------------------------------
def test_variants_parse_into_kernel_configs():
  from pallas_kernels.gpu import delta_rule, osdn, precond_key
  assert registry.parse_kernel_variant("default") is registry.DEFAULT
  v = registry.parse_kernel_variant("delta_rule:state.block_v=32+grads.warps_intra=4+stages=2")
  assert v.family == "delta_rule" and isinstance(v.config, delta_rule.Config)
  assert (v.config.state.block_v, v.config.grads.warps_intra, v.config.stages) == (32, 4, 2)
  assert v.config.prep == delta_rule.DEFAULT.prep
  v = registry.parse_kernel_variant("osdn:solve_t=16+tables=kernel+share_inverse=False")
  assert isinstance(v.config, osdn.Config)
  assert (v.config.solve_t, v.config.tables, v.config.share_inverse) == (16, "kernel", False)
  v = registry.parse_kernel_variant("precond_key:chunk=8+warps=4")
  assert isinstance(v.config, precond_key.Config) and (v.config.chunk, v.config.warps) == (8, 4)


@pytest.mark.parametrize("text, field", [
    ("delta_rule:state.block_v=33", "block_v"),           # not a power of two
    ("delta_rule:state.bogus=1", "state.bogus"),          # no such field
    ("delta_rule:dots.bf16=fp16", "bf16"),
    ("osdn:tables=gpu", "tables"),
    ("osdn:solve_t=8", "solve_t"),
    ("osdn:bogus=1", "bogus"),
    ("precond_key:chunk=128", "chunk"),
    ("fused:chunk=16", "family"),                         # no such family
    ("delta_rule:", "family"),
])
def test_invalid_variants_name_the_field(text, field):
  with pytest.raises(ValueError, match=field):
    registry.parse_kernel_variant(text)


def test_plan_crosses_variants_with_pallas_and_their_families():
  variants = [registry.DEFAULT, registry.parse_kernel_variant("delta_rule:state.block_v=32"),
              registry.parse_kernel_variant("osdn:solve_t=0")]
  s = run.Settings(ops=("dn", "d_pass"), shapes=("tiny", "1x8192x2x16"), impls=("reference", "xla", "pallas"),
                   modes=("fwd",))
  got = [(t.shape, t.op.name, t.impl, t.variant.name) for t in run.plan(s, variants, fla_ok=True)]
  assert got[:5] == [("tiny", "dn", "fla", "default"), ("tiny", "dn", "reference", "default"),
                     ("tiny", "dn", "xla", "default"), ("tiny", "dn", "pallas", "default"),
                     ("tiny", "dn", "pallas", "delta_rule:state.block_v=32")]
  assert ("tiny", "d_pass", "pallas", "osdn:solve_t=0") in got
  assert not any(op == "d_pass" and v.startswith("delta_rule") for _, op, _, v in got)
  assert not any(op == "d_pass" and impl == "fla" for _, op, impl, _ in got)
  long = [(op, impl) for shape, op, impl, _ in got if shape == "1x8192x2x16"]
  assert ("dn", "reference") not in long and ("d_pass", "reference") in long    # the serial solve: T ≤ 4096
  with pytest.raises(ValueError, match="shape"):
    registry.parse_shape("1,64,2,16")
  with pytest.raises(ValueError, match="gdn2"):
    run.Settings(ops=("gdn2",)).validate()


def test_inputs_are_fresh_random_and_fp32():
  for name in ("pkda", "osdn-apf", "packed", "d_pass"):
    op = registry.OPS[name]
    x, y = op.inputs((1, 64, 2, 16), 0), op.inputs((1, 64, 2, 16), 1)
    for n, a in x.items():
      assert a.dtype == (np.int32 if n == "segment_ids" else np.float32), (name, n)
      assert np.all(np.isfinite(a)) and np.any(a != 0), (name, n)
    assert not np.array_equal(x[op.diff[0]], y[op.diff[0]])
    assert set(op.wide) <= set(x) and set(op.diff) <= set(x)
  x = registry.OPS["pkda"].inputs((1, 64, 2, 16), 0)
  np.testing.assert_allclose(np.linalg.norm(x["q"], axis=-1), 1, rtol=1e-5)
  assert x["g"].shape == (1, 64, 2, 16) and np.all(x["g"] < 0) and np.all((x["beta"] > 0) & (x["beta"] < 1))


# ---------------------------------------------------------------------------------------------------------
# The trace reader.
# ---------------------------------------------------------------------------------------------------------
def _write_trace(folder):
  events = [
      {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
      {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "pid": 7, "tid": 3, "name": "thread_name", "args": {"name": "Stream #14(Compute)"}},
      {"ph": "X", "pid": 1, "tid": 9, "name": "python call", "ts": 0, "dur": 5000.0},   # host: ignored
      {"ph": "X", "pid": 7, "tid": 3, "name": "delta_rule_prep", "ts": 0, "dur": 300.0},
      {"ph": "X", "pid": 7, "tid": 3, "name": "delta_rule_prep", "ts": 400, "dur": 260.0},
      {"ph": "X", "pid": 7, "tid": 3, "name": "osdn_d_pass_fwd", "ts": 700, "dur": 1000.0},
      {"ph": "i", "pid": 7, "tid": 3, "name": "marker", "ts": 5},                         # not complete
  ]
  path = os.path.join(folder, "plugins", "profile", "run")
  os.makedirs(path)
  with gzip.open(os.path.join(path, "perfetto_trace.json.gz"), "wt") as f:
    json.dump({"traceEvents": events}, f)


def test_device_events_and_table(tmp_path):
  _write_trace(str(tmp_path))
  events = trace.device_events(str(tmp_path))
  assert sorted(events) == [("Stream #14(Compute)", "delta_rule_prep", 260.0),
                            ("Stream #14(Compute)", "delta_rule_prep", 300.0),
                            ("Stream #14(Compute)", "osdn_d_pass_fwd", 1000.0)]
  lines = trace.table(events, calls=2, top=5)
  assert lines[0].strip() == "[Stream #14(Compute)] total 0.780 ms per call"
  assert "0.500 ms  64.1%  osdn_d_pass_fwd" in lines[1] and "0.280 ms  35.9%  delta_rule_prep" in lines[2]
  times = {(line, name): 0.0 for line, name, _ in events}
  for line, name, us in events:
    times[line, name] += us / 2
  assert trace.by_kernel(times) == {"osdn_d_pass_fwd": 0.5, "delta_rule_prep": 0.28}


def test_no_trace_is_an_error(tmp_path):
  with pytest.raises(FileNotFoundError):
    trace.device_events(str(tmp_path))


def test_per_call_runs_under_the_profiler(tmp_path):
  """The profiler round trip itself (on CPU: no device lines, so no kernels)."""
  times = trace.per_call(jax.jit(lambda x: x * 2.0), jnp.ones(8), calls=2, folder=str(tmp_path))
  assert isinstance(times, dict) and all(us >= 0 for us in times.values())


# ---------------------------------------------------------------------------------------------------------
# The census.
# ---------------------------------------------------------------------------------------------------------
def test_census_counts_a_known_dot():
  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = jnp.exp(jnp.dot(a_ref[...], b_ref[...]))

  def f(a, b):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 32), jnp.float32), grid=(3,),
                          in_specs=[pl.BlockSpec((16, 64), lambda i: (0, 0)), pl.BlockSpec((64, 32), lambda i: (0, 0))],
                          out_specs=pl.BlockSpec((16, 32), lambda i: (0, 0)), interpret=True, name="tiny_dot")(a, b)

  (c,) = census(f, jax.ShapeDtypeStruct((16, 64), jnp.float32), jax.ShapeDtypeStruct((64, 32), jnp.float32))
  assert "tiny_dot" in c.name and c.grid == (3,) and c.programs == 3
  assert dict(c.dots) == {(16, 64, 32, "float32", "float32"): 1}
  assert c.macs == c.macs_f32 == 16 * 64 * 32 and c.exps == 16 * 32


def test_a_variant_reaches_its_kernel_and_the_census_prints():
  """precond_key:chunk=8 halves the programs of the fused key's kernels (interpret mode runs chunk 4), and
  osdn:chain=False takes the d-pass's chain out of the osdn op; traced only."""
  op = registry.OPS["pdn_key"]
  x = {n: jax.ShapeDtypeStruct(a.shape, a.dtype) for n, a in op.inputs((1, 64, 2, 16)).items()}
  programs = lambda v: {c.name: c.programs for c in census(op.build("pallas", v), x)}
  default, wider = programs(registry.DEFAULT), programs(registry.parse_kernel_variant("precond_key:chunk=8"))
  assert default["precond_key_apply"] == 2 * wider["precond_key_apply"] == 32
  op = registry.OPS["pdn"]
  x = {n: jax.ShapeDtypeStruct(a.shape, a.dtype) for n, a in op.inputs((1, 64, 2, 16)).items()}
  names = lambda v: {c.name for c in census(op.build("pallas", v), x)}
  assert {"precond_key_apply", "delta_rule_prep"} <= names(registry.DEFAULT)
  op = registry.OPS["osdn"]                     # an osdn variant reaches the d-pass inside osdn_write_key
  x = {n: jax.ShapeDtypeStruct(a.shape, a.dtype) for n, a in op.inputs((1, 64, 2, 16)).items()}
  names = lambda v: {c.name for c in census(op.build("pallas", v), x)}
  assert "osdn_d_pass_fwd_chain" in names(registry.DEFAULT)
  assert "osdn_d_pass_fwd_chain" not in names(registry.parse_kernel_variant("osdn:chain=False"))
  printed = []
  run.print_census(run.Settings(ops=("dn", "d_pass"), shapes=("tiny",), modes=("fwd",)), log=printed.append)
  text = "\n".join(printed)
  assert "tiny/dn/fwd/pallas/default: 4 kernel launches" in text and "delta_rule_prep" in text
  assert "osdn_d_pass_fwd" in text


# ---------------------------------------------------------------------------------------------------------
# Results and the runner.
# ---------------------------------------------------------------------------------------------------------
def test_results_append_and_replace_rows(tmp_path):
  path = str(tmp_path / "r.json")
  row = dict(shape="tiny", op="dn", mode="fwd", impl="xla", variant="default", dtype="bf16", precision="default")
  first = run.Results(path, dict(jax="x"))
  first.add(dict(row, ms=1.0))
  first.add(dict(row, impl="pallas", ms=2.0))
  second = run.Results(path, dict(jax="y"))
  second.add(dict(row, ms=3.0))
  data = json.load(open(path))
  assert [m["jax"] for m in data["runs"]] == ["x", "y"]
  assert sorted((r["impl"], r["ms"], r["run"]) for r in data["rows"]) == [("pallas", 2.0, 0), ("xla", 3.0, 1)]
  assert not os.path.exists(path + ".tmp")
  (tmp_path / "other.json").write_text("[1, 2]")
  with pytest.raises(ValueError, match="not a benchmarks.run results file"):
    run.Results(str(tmp_path / "other.json"), {})


def test_runner_measures_checks_and_tabulates(tmp_path):
  out = str(tmp_path / "b.json")
  s = run.Settings(ops=("dn",), shapes=("tiny",), impls=("xla", "pallas"), modes=("fwd",), check=True, calls=2,
                   reps=2, warmup=1, fla=False, out=out)
  printed = []
  rows = run.benchmark(s, log=printed.append)
  text = "\n".join(printed)
  assert "[1/2] tiny/dn/fwd/xla/default" in text and "[2/2] tiny/dn/fwd/pallas/default" in text
  data = json.load(open(out))
  assert data["runs"][0]["jax"] == jax.__version__ and data["runs"][0]["flags"]["ops"] == ["dn"]
  assert [(r["impl"], r["mode"]) for r in data["rows"]] == [("xla", "fwd"), ("pallas", "fwd")] == \
      [(r["impl"], r["mode"]) for r in rows]
  for r in data["rows"]:
    assert "error" not in r and math.isfinite(r["ms"]) and r["ms"] > 0, r
    assert set(r["errors"]) == {"o"} and r["max_err"] < 2e-2, r      # bf16 vs fp32 HIGHEST
  table = text[text.index("[fwd] ms per call"):]
  assert "pallas÷base" in table and "err pallas" in table and "tiny/dn" in table
