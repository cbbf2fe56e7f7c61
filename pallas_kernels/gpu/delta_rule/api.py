"""The Pallas GPU delta rule: what this backend supplies to the shell (`pallas_kernels.delta_rule_shell`).

`delta_rule` computes `osdn_jax.ops.delta_rule` (the contract; `osdn_jax.ops.chunked.delta_rule` has this
signature) through the shell's wrapper. This backend's parts: K and V padded to a power of two ≥ 16
(`common.padded_dim`); the chunk from `heuristics` (it may run a smaller chunk than requested, and an
undifferentiated per-channel forward a wider one); per-channel log-decays clamped and cumsummed within chunks by the
`chunk_cumsum` kernels (so the kernels' dG becomes d log_decay through its reverse cumsum); the initial state always
given (zeros), packed as [1, HV, N·K, V]. Inside the custom_vjp: forward = prep → state_pass → output; backward =
W, U from T → state_pass → dv_local → state_bwd → grads. The forward saves its inputs and T = (I + A)⁻¹ (fp32
[B, HV, T, C]: the one costly intermediate, named for rematerialisation); W, U, the chunk states and V_new are
recomputed.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels import delta_rule_shell as shell
from pallas_kernels.gpu.common import MAX_DIM, padded_dim
from pallas_kernels.gpu.delta_rule import backward as _backward
from pallas_kernels.gpu.delta_rule import chunk_cumsum, forward as _forward, heuristics
from pallas_kernels.gpu.delta_rule.config import Config, default_config
from pallas_kernels.gpu.delta_rule.layout import Static
from pallas_kernels.spec import CHUNK_SIZES, LOG_DECAY_FLOOR, Spec


def _check(where: str, config: Config, q, v, chunk_size) -> None:
  config.check(chunk_size)
  if max(q.shape[-1], v.shape[-1]) > MAX_DIM:
    raise ValueError(f"{where}: K and V must be ≤ {MAX_DIM}")


def _plan(config: Config, decay: str, chunk_size: int, *, dtype: str, key_dim: int, value_dim: int, lanes: int,
          packed: bool) -> tuple[int, int]:
  chunk = heuristics.chunk(config, decay, chunk_size, dtype=dtype, kdim=key_dim, lanes=lanes, vdim=value_dim)
  return chunk, heuristics.forward_chunk(config, decay, chunk_size, chunk, packed)


def _channel_decay(g, chunk: int, forward_chunk: int, interpret: bool):
  """The floor and the in-chunk cumsum in one Pallas pass; g itself kept for a wider undifferentiated forward."""
  return chunk_cumsum.chunk_cumsum(g, chunk, LOG_DECAY_FLOOR, interpret=interpret), (g if forward_chunk else None)


def _state_in(st: Static, S0, present):
  """The kernels always read an initial state: zeros when none is given. Packed: [N, HV, K, V] → [1, HV, N·K, V]
  (segments without tokens: zeros)."""
  n = st.segments
  if S0 is None:
    S0 = jnp.zeros((n or st.batch, st.value_heads, st.key_dim, st.value_dim), jnp.float32)
  if not n:
    return S0
  S0 = jnp.where(present[:, None, None, None], S0, 0.0)
  return jnp.swapaxes(S0, 0, 1).reshape(1, st.value_heads, n * st.key_dim, st.value_dim)


def _state_out(st: Static, S):
  if not st.segments:
    return S
  return jnp.swapaxes(S.reshape(st.value_heads, st.segments, st.key_dim, st.value_dim), 0, 1)


def _run_forward(st: Static, q, k, kw, v, beta, G, g, S0, info):
  if g is not None:                     # undifferentiated: cumsum within the wider chunk and run at it
    G = chunk_cumsum.chunk_cumsum(g, st.forward_chunk, LOG_DECAY_FLOOR, interpret=st.interpret)
    st = dataclasses.replace(st, chunk=st.forward_chunk, forward_chunk=0)
  return _forward.forward(st, q, k, k if kw is None else kw, v, beta, G, S0, info)


def _forward_saving(st: Static, q, k, kw, v, beta, G, g, S0, info):
  del g
  return _forward.forward(st, q, k, k if kw is None else kw, v, beta, G, S0, info, emit_t=True)


def _run_backward(st: Static, inputs, T, cts):
  q, k, kw, v, beta, G, S0, info = inputs
  do, dS_T = cts
  return _backward.backward(st, (q, k, k if kw is None else kw, v, beta, G, S0, info, T), do, dS_T)


BACKEND = shell.Backend(
    name="pallas gpu", static=Static, padded_dim=padded_dim, default_config=default_config, check=_check,
    plan=_plan, bf16_allowed=lambda config: config.bf16_matmuls, channel_decay=_channel_decay,
    state_in=_state_in, state_out=_state_out, forward=_run_forward, forward_saving=_forward_saving,
    backward=_run_backward)


def delta_rule(q, k, v, beta, *, k_write=None, log_decay=None, initial_state=None, scale=None, chunk_size=64,
               segment_ids=None, num_segments=None, config: Config | None = None, interpret: bool | None = None,
               bf16_matmuls: bool = True):
  """Chunkwise online solve with Pallas kernels (Triton on GPU, interpret mode on CPU).

  Shapes as `osdn_jax.ops.chunked.delta_rule`: q, k [B, T, H, K]; v [B, T, HV, V]; beta [B, T, HV];
  k_write [B, T, H or HV, K] (cast to q.dtype); log_decay None, [B, T, HV] or [B, T, HV, K];
  initial_state [B, HV, K, V]. Returns (o [B, T, HV, V] in q.dtype, final state [B, HV, K, V] fp32).
  Packed (`pallas_kernels/packed.py`): `segment_ids` [B, T] are segment numbers 0..N−1 in row-major order
  (`osdn_jax.ops.packing.segment_index`), `num_segments` N is static, and initial_state and the final states
  are [N, HV, K, V].
  `config` sets the launch parameters (None: `default_config`, this device's entry of the tuning table);
  `heuristics.chunk` may run a smaller chunk than `chunk_size` (rounding only), and an undifferentiated per-channel
  forward a wider one (`heuristics.forward_chunk`). `interpret` defaults to True on a CPU backend. With bf16
  inputs and `bf16_matmuls` (the default; False overrides `Config.bf16_matmuls`), every dot except those that
  build T = (I + A)⁻¹ and dA takes bf16 operands (fp32 accumulation, fp32 state) and the intermediates are stored
  in bf16; fp32 inputs run every dot in fp32. fp32 dots run as `Dots` says when compiled and in IEEE fp32 in
  interpret mode.
  """
  return shell.delta_rule(BACKEND, q, k, v, beta, k_write=k_write, log_decay=log_decay,
                          initial_state=initial_state, scale=scale, chunk_size=chunk_size, segment_ids=segment_ids,
                          num_segments=num_segments, config=config, interpret=interpret, bf16_matmuls=bf16_matmuls)


def linear_attention(q, k, v, *, beta=None, log_decay=None, initial_state=None, scale=None, chunk_size=64,
                     segment_ids=None, num_segments=None, config: Config | None = None,
                     interpret: bool | None = None, bf16_matmuls: bool = True):
  """The offline solve S_t = D_t S_{t-1} + β_t k_t v_tᵀ with these kernels: the online solve with a zero erase key
  and k as the write key (A = 0, T = I, W = 0, V_new = βV; `wrapper_math.linear_attention`). Signature and
  results of `osdn_jax.ops.chunked.linear_attention` (β default 1)."""
  return shell.linear_attention(BACKEND, q, k, v, beta=beta, log_decay=log_decay, initial_state=initial_state,
                                scale=scale, chunk_size=chunk_size, segment_ids=segment_ids,
                                num_segments=num_segments, config=config, interpret=interpret,
                                bf16_matmuls=bf16_matmuls)


def supports(spec: Spec) -> bool:
  """Compiled on "gpu"; the same kernels in interpret mode on "cpu"; bf16/fp32, K, V ≤ 256, whole sequences
  (not one-token steps); packed only with a static number of segments; a config, when the request carries one, of
  this backend."""
  return (spec.platform in ("gpu", "cpu")
          and spec.dtype in ("bfloat16", "float32")
          and spec.chunk_size in CHUNK_SIZES
          and spec.length is not None
          and 1 <= spec.key_dim <= MAX_DIM and 1 <= spec.value_dim <= MAX_DIM
          and (not spec.packed or spec.num_segments is not None)
          and spec.config_of(Config))
