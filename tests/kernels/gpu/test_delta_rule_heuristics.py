"""The launch rules of the GPU delta-rule kernels (`pallas_kernels.gpu.delta_rule.heuristics`) and the checks of
their config (`config.Config`): which chunk, V block, warps, stages and flags a request gets. No kernel runs."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osdn_jax.testing import random_problem
from pallas_kernels.gpu import delta_rule as gpu
from pallas_kernels import delta_rule_shell as shell
from pallas_kernels.gpu.delta_rule import heuristics, layout
from pallas_kernels.gpu.delta_rule.config import DEFAULT, Config

F32, BF16 = "float32", "bfloat16"


def _static(config=DEFAULT, **kw):
  return layout.Static(**{**dict(batch=1, length=64, heads=8, value_heads=8, kw_heads=8, key_dim=128,
                                 value_dim=128, chunk=64, decay="none", scale=1.0, same_keys=True, config=config,
                                 interpret=True, bf16_matmuls=True), **kw})


def test_online_chunk_rule(monkeypatch):
  """Decay none / scalar with fp32 inputs at padded K ≥ 128 run at most at 16 (the tuned table), never above the
  requested chunk nor below `Chunks.sub`; bf16, K ≤ 64 and per-channel decay keep their own rules; `delta_rule`
  passes the chosen chunk to the kernels for every decay."""
  chunk = lambda c=DEFAULT, decay="none", req=64, **kw: heuristics.chunk(c, decay, req, **kw)
  for decay in ("none", "scalar"):
    assert [chunk(decay=decay, kdim=kd, dtype=F32) for kd in (16, 64, 128, 256)] == [64, 64, 16, 16]
    assert chunk(decay=decay, kdim=128, dtype=BF16) == 64 and chunk(decay=decay, req=32, kdim=256, dtype=F32) == 16
  assert chunk(DEFAULT.override(chunks__sub=32), kdim=128, dtype=F32) == 32
  assert chunk(DEFAULT.override(chunks__online=64), decay="scalar", kdim=256, dtype=F32) == 64
  assert chunk(decay="channel", lanes=64, vdim=128, kdim=128, dtype=BF16) == 32     # its own rule
  with pytest.raises(ValueError, match="Chunks.online"):
    DEFAULT.override(chunks__online=8)
  seen = []
  monkeypatch.setattr(shell, "_delta_rule", lambda *a, **kw: seen.append(kw["chunk_size"]))
  q = jnp.zeros((1, 64, 1, 128), jnp.float32)
  beta = g = jnp.zeros((1, 64, 1), jnp.float32)
  for dtype, log_decay in ((jnp.float32, None), (jnp.float32, g), (jnp.bfloat16, g)):
    gpu.delta_rule(q.astype(dtype), q.astype(dtype), q.astype(dtype), beta, log_decay=log_decay, chunk_size=64)
  gpu.delta_rule(q[..., :64], q[..., :64], q[..., :64], beta, chunk_size=64)
  assert seen == [16, 16, 64, 64]


def test_channel_chunk_rule():
  """Per-channel decay runs at `Chunks.channel` (tuned: 32 for bf16 at padded K = 128, else 16), or at
  `Chunks.channel_serial` (32) when even BV = 16 would leave the state passes under STATE_PROGRAMS programs;
  never above the requested chunk; other decays keep it. Chunks.channel 64 is refused (shared memory)."""
  chunk = lambda c=DEFAULT, req=64, decay="channel", **kw: heuristics.chunk(c, decay, req, **kw)
  assert chunk() == 16 and chunk(lanes=64, vdim=128) == 16
  assert chunk(lanes=64, vdim=128, kdim=128, dtype=BF16) == 32
  assert chunk(lanes=64, vdim=128, kdim=128, dtype=F32) == 16
  assert [chunk(lanes=64, vdim=128, kdim=kd, dtype=BF16) for kd in (16, 32, 64, 256)] == [16] * 4
  assert chunk(req=16, lanes=64, vdim=128, kdim=128, dtype=BF16) == 16
  assert chunk(lanes=8, vdim=128) == 32 and chunk(req=16, lanes=8, vdim=128) == 16
  assert chunk(lanes=16, vdim=128, kdim=64) == 16          # 128 programs at BV 16
  assert chunk(decay="scalar", lanes=1, vdim=16) == 64
  assert chunk(DEFAULT.override(chunks__channel_serial=16), lanes=1, vdim=16) == 16
  assert chunk(DEFAULT.override(chunks__channel=16), lanes=64, vdim=128, kdim=128, dtype=BF16) == 16
  assert chunk(DEFAULT.override(chunks__channel=32), lanes=64, vdim=64, kdim=64) == 32
  with pytest.raises(ValueError, match="Chunks.channel_serial"):
    DEFAULT.override(chunks__channel_serial=8)
  with pytest.raises(ValueError, match="Chunks.channel="):
    DEFAULT.override(chunks__channel=64)


def test_forward_chunk_rule():
  """`heuristics.forward_chunk`: per-channel and unpacked, `Chunks.channel_forward` (64, at most the requested
  chunk) when wider than `chunk`'s; else 0."""
  fc = lambda c=DEFAULT, *a: heuristics.forward_chunk(c, *a)
  assert fc(DEFAULT, "channel", 64, 32, False) == 64
  assert fc(DEFAULT, "channel", 64, 16, False) == 64
  assert fc(DEFAULT, "channel", 32, 16, False) == 32
  assert fc(DEFAULT, "channel", 64, 32, True) == 0            # packed
  assert fc(DEFAULT, "scalar", 64, 64, False) == 0
  assert fc(DEFAULT, "channel", 16, 16, False) == 0
  assert fc(DEFAULT.override(chunks__channel_forward=0), "channel", 64, 32, False) == 0
  with pytest.raises(ValueError, match="channel_forward"):
    DEFAULT.override(chunks__channel_forward=48)


def test_chunk_rule_sees_the_rows(monkeypatch):
  """`delta_rule` hands the chunk rule batch rows × value heads (packed: segments × value heads), the padded
  V, the padded K and the inputs' dtype (traced only: jax.eval_shape)."""
  seen = []
  rule = heuristics.chunk
  monkeypatch.setattr(heuristics, "chunk", lambda c, decay, req, **kw: seen.append((decay, req, kw)) or
                      rule(c, decay, req, **kw))
  p = random_problem(3, B=2, T=40, H=2, HV=4, K=16, V=24, decay="channel", k_write="key")
  a = p.arrays(jnp.float32)
  ids = jnp.asarray(np.repeat(np.array([[0, 0, 1, 1, 1], [2, 2, 2, 3, 3]]), 8, axis=1), jnp.int32)
  run = lambda **kw: jax.eval_shape(lambda a: gpu.delta_rule(
      a["q"], a["k"], a["v"], a["beta"], k_write=a["k_write"], log_decay=a["log_decay"], **kw), a)
  run()
  run(segment_ids=ids, num_segments=5)
  want = lambda lanes: ("channel", 64, dict(dtype=F32, kdim=16, lanes=lanes, vdim=32))
  assert seen == [want(8), want(20)]


def test_state_pass_block_v():
  """The state passes' V block: capped by the [K, BV] state tile, then halved (to 16 at least) while fewer than
  STATE_PROGRAMS programs would run; packed calls count segments, not batch rows; their stages."""
  bv = lambda *a, **kw: heuristics.state_block_v(DEFAULT, *a, **kw)
  assert bv(128, 128) == 64 and bv(128, 256) == 32
  assert bv(128, 128, lanes=64) == 64        # B=4, HV=16: 128 programs
  assert bv(128, 128, lanes=32) == 32        # 128 programs
  assert bv(128, 128, lanes=8) == 16         # B=1, HV=8: 64 programs, the floor
  assert _static().v_block(DEFAULT.output.block_v) == 128          # other kernels keep theirs
  st = _static
  assert st().state_block_v == 16 and st(batch=8).state_block_v == 64
  assert st(segments=16).state_block_v == 64 and st(segments=16).state_stages == 1 == st(segments=16).stages - 2
  # one stage with fp32 intermediates (an H200's shared memory at K = V = 128) and with K or V above 128
  assert st(bf16_matmuls=False).stages == 1 == st(bf16_matmuls=False).state_stages
  assert st(key_dim=256).stages == 1 == st(value_dim=256).stages and st(key_dim=64).stages == DEFAULT.stages == 3


def test_prep_warps():
  """prep and wu run `Prep.warps_fp32` warps whenever the intermediates are fp32, for every decay and T source;
  with bf16 intermediates each keeps its own field. Fewer than 4 is refused (a Triton miscompile)."""
  c = DEFAULT.override(prep__warps=2, prep__warps_channel=4, prep__warps_given_a=16, prep__warps_fp32=32)
  warps = lambda decay, low, source: heuristics.prep_warps(c, decay, low, source)
  for decay in ("none", "scalar", "channel"):
    for source in ("gram", "a", "t"):
      assert warps(decay, False, source) == 32
  assert warps("none", True, "gram") == 2 == warps("scalar", True, "t")
  assert warps("channel", True, "gram") == 4 and warps("channel", True, "a") == 16
  assert DEFAULT.prep.warps_fp32 == 8 and DEFAULT.override(prep__warps_fp32=4).prep.warps_fp32 == 4
  with pytest.raises(ValueError, match="warps_fp32"):
    DEFAULT.override(prep__warps_fp32=2)


def test_grad_block_v():
  """`grads_state` and `grads_intra` step V by `Grads.block_v_fp32` with fp32 intermediates, by `Grads.block_v`
  otherwise, both clamped to the padded V."""
  c = DEFAULT.override(grads__block_v=64, grads__block_v_fp32=16)
  st = lambda config=c, **kw: _static(config, chunk=16, decay="channel", **kw)
  assert st().grad_block_v == 64 and st(bf16_matmuls=False).grad_block_v == 16
  assert st(value_dim=32).grad_block_v == 32 and st(DEFAULT).grad_block_v == 128
  assert st(DEFAULT, bf16_matmuls=False).grad_block_v == 32
  with pytest.raises(ValueError, match="block_v_fp32"):
    DEFAULT.override(grads__block_v_fp32=8)


def test_fuse_inter_rule():
  """`State.fuse_inter` None fuses the inter-chunk output into the state pass exactly when the chunk states
  (state dtype) would outweigh the fp32 output and the state pass fills the GPU: KDA's chunk 16 in bf16 at
  B=8 HV=8, not DeltaNet's chunk 64, not with one batch row."""
  st = lambda config=DEFAULT, **kw: _static(config, **{"batch": 8, **kw})
  assert not st().fuse_inter and st(chunk=16, decay="channel").fuse_inter
  assert not st(chunk=16, batch=1).fuse_inter and st(chunk=16, batch=1, segments=8).fuse_inter
  assert not st(chunk=16, key_dim=32).fuse_inter and st(chunk=16, key_dim=64).fuse_inter
  assert st(bf16_matmuls=False).fuse_inter and not st(bf16_matmuls=False, key_dim=64).fuse_inter
  assert st(DEFAULT.override(state__fuse_inter=True), batch=1).fuse_inter
  assert not st(DEFAULT.override(state__fuse_inter=False), chunk=16).fuse_inter
  with pytest.raises(ValueError, match="fuse_inter"):
    DEFAULT.override(state__fuse_inter="yes")


def test_predecay_rule():
  """`State.predecay` None pre-decays the state passes' tiles exactly for per-channel decay when those passes
  run fewer than STATE_PROGRAMS programs at BV 16: the long benchmark shape (B=1, HV=8), not the main one
  (B=4, HV=16); never without per-channel decay; True / False as given."""
  st = lambda config=DEFAULT, **kw: _static(config, **{"chunk": 32, "decay": "channel", **kw})
  assert st().predecay and not st(batch=4, heads=16, value_heads=16, kw_heads=16).predecay
  assert not st(decay="scalar").predecay and not st(segments=16).predecay and st(value_dim=64, batch=2).predecay
  on, off = DEFAULT.override(state__predecay=True), DEFAULT.override(state__predecay=False)
  assert st(on, batch=8).predecay and not st(off).predecay and not st(on, decay="none").predecay
  with pytest.raises(ValueError, match="predecay"):
    DEFAULT.override(state__predecay="yes")


def test_config_checks_and_overrides():
  """Every family checks its fields and names the field; `Config.override` takes "family.field=value" strings
  (ints, True / False / None, strings) and keyword arguments, and refuses unknown fields."""
  for bad, match in (({"dots__fp32": "bf16"}, "Dots.fp32"), ({"dots__bf16": "tf16"}, "Dots.bf16"),
                     ({"chunks__sub": 8}, "Chunks.sub"), ({"state__block_v": 24}, "State.block_v"),
                     ({"grads__block_k_pairs": 128}, "Grads.block_k_pairs"), ({"stages": 0}, "Config.stages"),
                     ({"scores__block_k": 128}, "Scores.block_k")):
    with pytest.raises(ValueError, match=match):
      DEFAULT.override(**bad)
  c = DEFAULT.override("scores.warps=4", "dots.bf16=tf32x3", "chunks.channel_forward=0", "state.predecay=None",
                       "scores.tiles=False", "stages=2")
  assert (c.scores.warps, c.dots.bf16, c.chunks.channel_forward, c.state.predecay, c.scores.tiles, c.stages) == (
      4, "tf32x3", 0, None, False, 2)
  assert c.scores.block_k == DEFAULT.scores.block_k and isinstance(c, Config) and hash(c) != hash(DEFAULT)
  for bad in ("scores.nothing=1", "nothing.warps=1", "warps=4", "scores.warps"):
    with pytest.raises(ValueError, match="Config.override"):
      DEFAULT.override(bad)
  with pytest.raises(ValueError, match="chunk_size=24"):
    DEFAULT.check(24)
  with pytest.raises(ValueError, match="Chunks.sub=32 must divide chunk_size=16"):
    DEFAULT.override(chunks__sub=32).check(16)


def test_tuning_table():
  """`default_config` reads the tuning table by device kind ("interpret" in interpret mode; kinds without an entry
  get DEFAULT), and the largest chunks measured are the config's own data (`Chunks.tuned`): without them the
  requested chunk runs."""
  assert gpu.default_config(None, "NVIDIA H200") is gpu.TUNING["H200"]
  assert gpu.default_config(None, "interpret") is gpu.TUNING["interpret"]
  assert gpu.default_config(None, "NVIDIA A100-SXM4-40GB") is gpu.DEFAULT
  untuned = dataclasses.replace(DEFAULT, chunks=dataclasses.replace(DEFAULT.chunks, tuned=()))
  assert heuristics.chunk(DEFAULT, "none", 64, dtype=F32, kdim=128) == 16
  assert heuristics.chunk(untuned, "none", 64, dtype=F32, kdim=128) == 64
