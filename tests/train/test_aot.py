"""Ahead-of-time compilation for TPU topologies on this host: the topology names, the HLO collective counter on a
written program, and the tiny config's sharded step compiled for a v5e 2x2 slice (libtpu, the `tpu-aot` extra)
through the CLI."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from osdn_jax.train import aot, collectives

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_topology_names():
  assert aot.parse_topology("v5p:4x4x4") == (aot.CHIPS["v5p"], (4, 4, 4))
  assert aot.parse_topology("v5e:16x16") == (aot.CHIPS["v5e"], (16, 16))
  assert aot._wrap(*aot.parse_topology("v5p:4x4x4")) == (True, True, True)
  assert aot._wrap(*aot.parse_topology("v5p:2x4x4")) == (False, False, False)
  assert aot._wrap(*aot.parse_topology("v5e:8x16")) == (False, True, False)
  for bad in ("v5p:4x4", "v5e:16x16x1", "v9:2x2", "v5e", "v5e:axb", "v5e:0x2"):
    with pytest.raises(ValueError, match="topology"):
      aot.parse_topology(bad)


# A while loop of 24 iterations (`i < 24`) holding an all-gather split into a chain of two fusions (one channel
# id), a reduce-scatter (TPU's all-reduce-scatter fusion) and an all-gather run as an all-reduce of a zero buffer
# holding the shard; the entry adds an all-reduce over 4 devices; an unreachable computation's all-gather does not
# count.
_HLO = textwrap.dedent("""\
    HloModule m, entry_computation_layout={()->f32[]}

    %gather.1 (p.0: f32[8,16]) -> f32[32,16] {
      %p.0 = f32[8,16]{1,0} parameter(0)
      ROOT %all-gather.1 = f32[32,16]{1,0:T(8)} all-gather(%p.0), channel_id=7, replica_groups=mesh['a'=4,'b'=2] {'a'}
    }

    %gather.2 (p.1: f32[8,16]) -> f32[32,16] {
      %p.1 = f32[8,16]{1,0} parameter(0)
      ROOT %all-gather.2 = f32[32,16]{1,0} all-gather(%p.1), channel_id=7, replica_groups=mesh['a'=4,'b'=2] {'a'}
    }

    %all-reduce-scatter.3 (p.2: bf16[64,16]) -> bf16[16,16] {
      %p.2 = bf16[64,16]{1,0} parameter(0)
      %all-reduce.3 = bf16[64,16]{1,0} all-reduce(%p.2), channel_id=8, replica_groups={{0,1,2,3},{4,5,6,7}}
      ROOT %ds = bf16[16,16]{1,0} dynamic-slice(%all-reduce.3), dynamic_slice_sizes={16,16}
    }

    %pad.4 (z.0: f32[32,16], p.4: f32[8,16], o.0: s32[]) -> f32[32,16] {
      %z.0 = f32[32,16]{1,0} parameter(0)
      %p.4 = f32[8,16]{1,0} parameter(1)
      %o.0 = s32[] parameter(2)
      ROOT %dus = f32[32,16]{1,0} dynamic-update-slice(%z.0, %p.4, %o.0, %o.0)
    }

    %unused (p.3: f32[8,16]) -> f32[32,16] {
      %p.3 = f32[8,16]{1,0} parameter(0)
      ROOT %all-gather.9 = f32[32,16]{1,0} all-gather(%p.3), channel_id=9, replica_groups={{0,1,2,3}}, dimensions={0}
    }

    %body (t.0: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
      %t.0 = (s32[], f32[8,16]) parameter(0)
      %x = f32[8,16]{1,0} get-tuple-element(%t.0), index=1
      %f.1 = f32[32,16]{1,0} fusion(%x), kind=kCustom, calls=%gather.1
      %f.2 = f32[32,16]{1,0} fusion(%x), kind=kCustom, calls=%gather.2
      %f.3 = bf16[16,16]{1,0} fusion(%x), kind=kCustom, calls=%all-reduce-scatter.3
      %zeros = f32[32,16]{1,0} broadcast(%c.0), dimensions={}
      %f.4 = f32[32,16]{1,0} fusion(%zeros, %x, %i), kind=kLoop, calls=%pad.4
      %all-reduce.5 = f32[32,16]{1,0} all-reduce(%f.4), channel_id=11, replica_groups={{0,1,2,3}}
      ROOT %t.1 = (s32[], f32[8,16]) tuple(%i, %x)
    }

    %cond (t.2: (s32[], f32[8,16])) -> pred[] {
      %t.2 = (s32[], f32[8,16]) parameter(0)
      %i.1 = s32[]{:T(128)} get-tuple-element(%t.2), index=0
      %constant.24 = s32[]{:T(128)} constant(24)
      ROOT %lt = pred[]{:T(512)} compare(%i.1, %constant.24), direction=LT
    }

    ENTRY %main (a: f32[8,16]) -> f32[] {
      %a = f32[8,16]{1,0} parameter(0)
      %w = (s32[], f32[8,16]) while(%init), condition=%cond, body=%body
      ROOT %all-reduce.4 = f32[] all-reduce(%s), channel_id=10, replica_groups={{0,1,2,3}}, to_apply=%add
    }
    """)


def test_collectives_count_loop_iterations_chains_and_reachable_code():
  stats = collectives.count(_HLO, num_devices=8)
  gathered = 24 * 32 * 16 * 4
  assert stats["all-gather"] == {"ops": 2, "executed": 48, "bytes": 2 * gathered,
                                 "traffic_bytes": gathered * 3 // 4 + gathered * 3 // 2}
  assert stats["reduce-scatter"] == {"ops": 1, "executed": 24, "bytes": 24 * 64 * 16 * 2,
                                     "traffic_bytes": 24 * 64 * 16 * 2 * 3 // 4}
  assert stats["all-reduce"] == {"ops": 1, "executed": 1, "bytes": 4, "traffic_bytes": 6}
  assert stats["collective-permute"]["ops"] == stats["all-to-all"]["ops"] == 0
  assert stats["unknown_trip_counts"] == 0


# In the slow step: the TPU compile of a whole training step (the kernels' TPU compiles are in the gate,
# tests/kernels/tpu/).
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (the tpu-aot extra)")
def test_tiny_step_compiles_for_a_v5e_slice(tmp_path):
  """fsdp over the 4 chips: parameters gathered for the forward and gradients reduce-scattered; the report
  fits the chip and holds every memory figure."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}   # the suite's flags are for the CPU compiler
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  out = tmp_path / "aot.json"
  run = subprocess.run([sys.executable, "-m", "osdn_jax.train.aot", "--config=tiny", "--config.model=pgdn-tiny",
                        "--config.mesh.data=1", "--config.mesh.fsdp=-1", "--topology=v5e:2x2", f"--out={out}"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  assert "pgdn-tiny on v5e:2x2" in run.stdout and "all-gather" in run.stdout
  report = json.loads(out.read_text())
  assert report["devices"] == 4 and report["device_kind"] == "TPU v5 lite" and report["mesh"]["fsdp"] == 4
  assert report["implementation"] == "xla"
  memory = report["memory"]
  for key in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "generated_code_bytes"):
    assert memory[key] > 0, key
  assert memory["fits"] and memory["total_bytes"] < memory["hbm_bytes"] == 16 * 2**30
  stats = report["collectives"]
  for kind in ("all-gather", "reduce-scatter", "all-reduce"):
    assert stats[kind]["ops"] >= 1 and stats[kind]["executed"] >= stats[kind]["ops"], kind
    assert stats[kind]["bytes"] > 0, kind
  assert report["compile_s"] > 0 and report["versions"]["libtpu"]
