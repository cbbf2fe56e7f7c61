"""The Pallas TPU delta rule: what this backend supplies to the shell (`pallas_kernels.delta_rule_shell`).

`delta_rule` computes `osdn_jax.ops.delta_rule` (the contract) for every decay (none, scalar, per channel), with
write keys, grouped value heads and an initial state, forward and backward; `linear_attention` is the offline
solve through the same kernels. This backend's parts: K and V padded to `layout.padded_dim`; the chunk as requested;
per-channel log-decays handed to the kernel as they come ([B, T, HV, K]: it clamps and cumsums them); the initial
state optional (required, zeros, when packed); the kernels' layout from the config (`layout.Static.layout`). The
forward under autodiff also saves the state entering every chunk (fp32 [B, HV, NC, K, V]), which the backward
kernel reads.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import delta_rule_shell as shell
from pallas_kernels.spec import CHUNK_SIZES, LOG_DECAY_FLOOR, Spec
from pallas_kernels.tpu.delta_rule.backward import backward_call
from pallas_kernels.tpu.delta_rule.config import Config, default_config
from pallas_kernels.tpu.delta_rule.kernel import forward_call
from pallas_kernels.tpu.delta_rule.layout import Static, padded_dim


def _check(where: str, config: Config, q, v, chunk_size) -> None:
  del config, q, v
  if chunk_size not in CHUNK_SIZES:
    raise ValueError(f"{where}: `chunk_size` must be one of {CHUNK_SIZES}, got {chunk_size!r}")


def _plan(config: Config, decay: str, chunk_size: int, **request) -> tuple[int, int]:
  del config, decay, request
  return chunk_size, 0


def _channel_decay(g, chunk: int, forward_chunk: int, interpret: bool):
  del chunk, forward_chunk, interpret        # clamped and cumsummed in the kernel
  return g, None


def _state_in(st: Static, S0, present):
  del present                                # rows of segments without tokens: zeroed on the way out
  if S0 is None and st.segments:
    return jnp.zeros((st.segments, st.value_heads, st.key_dim, st.value_dim), jnp.float32)
  return S0


def _launch(st: Static) -> dict:
  return dict(scale=st.scale, bf16_matmuls=st.bf16_matmuls, interpret=st.interpret, sub=st.config.sub,
              vmem_limit_bytes=st.config.vmem_limit_bytes)


def _codes(st: Static, info):
  return None if info is None else info[:st.length // st.chunk]


def _forward(st: Static, q, k, kw, v, beta, G, g, S0, info):
  del g
  return tuple(forward_call(st.layout, q, k, kw, v, beta, G, S0, _codes(st, info), **_launch(st)))


def _forward_saving(st: Static, q, k, kw, v, beta, G, g, S0, info):
  del g
  return tuple(forward_call(st.layout, q, k, kw, v, beta, G, S0, _codes(st, info), save_states=True,
                            **_launch(st)))


def _grad_dtype(st: Static, dtype, kw):
  """The partials' dtype: the inputs' own where nothing is summed (one V block, one value head per key head),
  else fp32 for the sums."""
  lay = st.layout
  one = lay.num_v == 1 and lay.value_heads == lay.heads and (kw is None or lay.kw_heads == lay.value_heads)
  return dtype if one else jnp.float32


def _backward(st: Static, inputs, states, cts):
  q, k, kw, v, beta, G, S0, info = inputs
  do, dS_T = cts
  del S0
  dq, dk, dkw, dv, dgates, dld, dS0 = backward_call(
      st.layout, q, k, kw, v, beta, G, states, do, dS_T, _codes(st, info), grad_dtype=_grad_dtype(st, q.dtype, kw),
      segments=dS_T.shape[0], **_launch(st))
  # dq, dk, dkw: [B, T, HV, NV, K] partials per value head and V block (the shell sums them)
  dbeta = dgates[:, :, 0]
  if G is None:
    dG = None
  elif G.ndim == 3:
    dG = dgates[:, :, 1]
  else:                                        # the kernel clamps the log-decays: no gradient below the floor
    dG = jnp.where(G >= LOG_DECAY_FLOOR, dld.sum(axis=3), 0.0).astype(G.dtype)
  return dq, dk, dkw, dv, dbeta, dG, dS0


BACKEND = shell.Backend(
    name="pallas tpu", static=Static, padded_dim=padded_dim, default_config=default_config, check=_check,
    plan=_plan, bf16_allowed=lambda config: config.bf16_matmuls, channel_decay=_channel_decay,
    state_in=_state_in, state_out=lambda st, S: S, forward=_forward, forward_saving=_forward_saving,
    backward=_backward, name_residual=False)


def delta_rule(q, k, v, beta, *, k_write=None, log_decay=None, initial_state=None, scale=None, chunk_size=64,
               segment_ids=None, num_segments=None, config: Config | None = None, interpret: bool | None = None,
               bf16_matmuls: bool = True):
  """The chunkwise online solve as two Mosaic kernels (forward; backward in one `jax.custom_vjp`): the signature
  and results of `osdn_jax.ops.chunked.delta_rule`.

  q, k [B, T, H, K]; v [B, T, HV, V] (HV a multiple of H: value head i reads key head i // (HV / H));
  beta [B, T, HV]; k_write None (k) or [B, T, H or HV, K]; log_decay None, [B, T, HV] (one per value head) or
  [B, T, HV, K] (one per key channel), natural logs ≤ 0; initial_state None (zeros) or [B, HV, K, V];
  scale None (K ** −0.5), a number or a traced scalar. q, k, k_write, v in bf16 or fp32 (cast to q.dtype).
  Returns (o [B, T, HV, V] in q.dtype, S_T [B, HV, K, V] fp32), differentiable w.r.t. every array.
  Packed (`pallas_kernels/packed.py`): `segment_ids` [B, T] are segment numbers 0..N−1 in row-major order
  (`osdn_jax.ops.packing.segment_index`), `num_segments` N is static, and initial_state and the final states
  are [N, HV, K, V]; the segments are laid out chunk-aligned in one row, whose chunks one program per value head
  runs in order. `interpret` None: TPU interpret mode on a CPU backend, compiled otherwise; `config` sets block
  sizes and precision (None: `default_config`, this backend's TPU generation; `bf16_matmuls` False overrides
  `config.bf16_matmuls`).
  """
  return shell.delta_rule(BACKEND, q, k, v, beta, k_write=k_write, log_decay=log_decay,
                          initial_state=initial_state, scale=scale, chunk_size=chunk_size, segment_ids=segment_ids,
                          num_segments=num_segments, config=config, interpret=interpret, bf16_matmuls=bf16_matmuls)


def linear_attention(q, k, v, *, beta=None, log_decay=None, initial_state=None, scale=None, chunk_size=64,
                     segment_ids=None, num_segments=None, config: Config | None = None, interpret: bool | None = None,
                     bf16_matmuls: bool = True):
  """The offline solve S_t = D_t S_{t−1} + β_t k_t v_tᵀ through the same kernels: the online solve with a zero
  erase key and k as the write key (A = 0, T = I, W = 0, V_new = β V). Signature and results of
  `osdn_jax.ops.chunked.linear_attention` (β default 1; `wrapper_math.linear_attention`)."""
  return shell.linear_attention(BACKEND, q, k, v, beta=beta, log_decay=log_decay, initial_state=initial_state,
                                scale=scale, chunk_size=chunk_size, segment_ids=segment_ids,
                                num_segments=num_segments, config=config, interpret=interpret,
                                bf16_matmuls=bf16_matmuls)


def forward(q, k, v, beta, *, k_write=None, log_decay=None, initial_state=None, scale=None, chunk_size=64,
            segment_ids=None, num_segments=None, interpret=False, config: Config | None = None):
  """`delta_rule` with `interpret` False by default (compiled by Mosaic: a TPU, or ahead of time)."""
  return delta_rule(q, k, v, beta, k_write=k_write, log_decay=log_decay, initial_state=initial_state,
                    scale=scale, chunk_size=chunk_size, segment_ids=segment_ids, num_segments=num_segments,
                    config=config, interpret=interpret)


def supports(spec: Spec) -> bool:
  """Compiled on "tpu" (a CPU backend reaches these kernels explicitly, in interpret mode); bf16/fp32; any K, V
  (padded); whole sequences (not one-token steps); packed only with a static number of segments; a config, when the
  request carries one, of this backend."""
  return (spec.platform == "tpu"
          and spec.dtype in ("bfloat16", "float32")
          and spec.chunk_size in CHUNK_SIZES
          and spec.length is not None
          and spec.key_dim >= 1 and spec.value_dim >= 1
          and (not spec.packed or spec.num_segments is not None)
          and spec.config_of(Config))
