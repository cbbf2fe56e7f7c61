"""The public solves: validation, then dispatch to the reference oracle, the chunked XLA path or a Pallas kernel.

`implementation` (`dispatch`): "reference" (token-serial oracle; "naive" is an alias), "xla" (chunkwise pure JAX),
"pallas" (this backend's kernel; on a CPU backend the GPU kernel in interpret mode), "pallas-gpu" / "pallas-tpu"
(that platform's kernel, in interpret mode on any other backend) or "auto" (pallas on GPU/TPU when a kernel
supports the shape and dtype, else xla; never the reference). The pallas values raise if no kernel supports the
request.
"""
from __future__ import annotations

import jax.numpy as jnp

from osdn_jax import checking
from osdn_jax.ops import checks, chunked, common, dispatch, faults, naive, packing


def _empty(spec, q, v, initial_state):
  """The result of a solve over no tokens or no rows: o [B, T, HV, V] empty; the final states are the initial
  ones (zeros when not given) in the compute dtype."""
  ct = common.compute_dtype(q.dtype)
  o = jnp.zeros(v.shape, q.dtype)
  rows = spec.batch if spec.num_segments is None else spec.num_segments
  shape = (rows, spec.value_heads, spec.key_dim, spec.value_dim)
  return o, (jnp.zeros(shape, ct) if initial_state is None else jnp.asarray(initial_state, ct))


def _run(op, implementation, spec, segment_ids, output_final_state, q, k, v, beta, *, k_write=None,
         log_decay=None, initial_state=None, scale=None):
  impl = dispatch.normalize(op, implementation)
  if spec.packed and spec.num_segments is None and dispatch.is_pallas(impl):
    raise ValueError(f"{op}: `implementation`={impl!r} with traced `segment_ids` needs N static: pass "
                     "`initial_state` of shape [N, HV, K, V] (zeros are fine), or use 'xla' or 'auto'")
  if spec.batch == 0 or spec.length == 0:
    o, S = _empty(spec, q, v, initial_state)
    return o, (S if output_final_state else None)
  kind, kernel = dispatch.choose(spec, implementation)
  fn = {"reference": getattr(naive, op), "xla": getattr(chunked, op)}.get(kind, kernel)
  static = {} if kind == "reference" else {"chunk_size": spec.chunk_size}
  if segment_ids is not None:   # N goes to kernels always, to the XLA path when the final states are wanted
    static["num_segments"] = spec.num_segments if (output_final_state or kind == "pallas") else None
  scale = common.default_scale(scale, spec.key_dim)
  traced_scale = checking.concrete(scale) is None

  def solve(a, ids):
    args = (a["q"], a["k"], a["v"]) + ((a["beta"],) if op == "delta_rule" else ())
    extra = {"k_write": a["k_write"]} if op == "delta_rule" else {"beta": a["beta"]}
    if ids is not None:
      extra["segment_ids"] = packing.segment_index(ids) if kind == "pallas" else ids
    o, S = fn(*args, **extra, log_decay=a["log_decay"], initial_state=a["initial_state"],
              scale=a["scale"] if traced_scale else scale, **static)
    return o, (S if output_final_state else None)

  arrays = dict(q=q, k=k, v=v, beta=beta, k_write=k_write, log_decay=log_decay, initial_state=initial_state)
  if traced_scale:
    arrays["scale"] = scale
  ids = None if segment_ids is None else jnp.asarray(segment_ids)
  if kind != "xla":     # the oracle is the contract of `faults`; the kernels run as they are (docs/faults.md)
    return solve(arrays, ids)
  return faults.careful(solve, arrays, ids)


def delta_rule(q, k, v, beta, *, k_write=None, log_decay=None, initial_state=None, output_final_state=False,
               scale=None, chunk_size=64, segment_ids=None, implementation="auto", kernel_config=None):
  """The online solve (delta rule with a separate write key) over whole sequences.

  S'_t = D_t S_{t-1};  S_t = S'_t + β_t k̃_t (v_t − S'_tᵀk_t)ᵀ;  o_t = S_tᵀ(scale · q_t).

  Args:
    q, k: [B, T, H, K] queries and read (erase) keys; k_write: [B, T, H, K] or [B, T, HV, K] write keys
      k̃ (default k). v: [B, T, HV, V], HV a multiple of H (value head i reads key head i // (HV/H)).
    beta: [B, T, HV] gains. log_decay: None, [B, T, HV] (scalar per head) or [B, T, HV, K] (per key
      channel), natural log ≤ 0. initial_state: [B, HV, K, V] (default zeros; [N, HV, K, V] when packed).
    output_final_state: return the final state (else None). scale: default K ** -0.5.
    chunk_size: 16, 32, 64 or 128. segment_ids: None or [B, T] packed sequences (below).
    implementation: one of `dispatch.IMPLEMENTATIONS` (the module doc; packed, the kernels need N static: from
      concrete ids or initial_state; else "auto" uses xla and the pallas values raise).
    kernel_config: None (each kernel's default for this device) or one kernel backend's launch parameters (e.g.
      `pallas_kernels.gpu.delta_rule.Config`): only that backend's kernel is chosen, and called with them; the
      pallas values raise when it does not support the request; "auto" falls back to xla, which takes none.
  Returns:
    (o [B, T, HV, V] in q.dtype, final state [B, HV, K, V] ([N, HV, K, V] when packed) in fp32 (fp64 for fp64
    inputs) or None).

  Packed sequences (`segment_ids`): an int array [B, T], non-decreasing along T in each row. A segment is a
  maximal run of equal ids within a row (a new one starts at t = 0 and wherever the id changes); segments are
  numbered n = 0..N-1 in row-major order of appearance, so the id values only mark boundaries
  (`packing.segment_ids_from_cu_seqlens` converts FLA-style cu_seqlens). At the first token of segment n the
  state restarts from initial_state[n]: S'_t = D_t S0[n]; nothing crosses a boundary, in values or gradients.
  initial_state is then [N, HV, K, V] (default zeros) and the final state [N, HV, K, V] holds each segment's
  state after its last token. N must be static: it is initial_state.shape[0] when given, else counted from
  concrete ids; under jax.jit with traced ids and output_final_state=True pass initial_state (zeros are fine).
  Without output_final_state and initial_state N is not needed, so traced ids work under jit as they are.
  Traced ids are checked (non-decreasing; N segments when initial_state gives N) in checked mode
  (`osdn_jax.checking`).

  B = 0 or T = 0 gives empty outputs and the initial states (zeros when not given) as the final states. A NaN or
  inf at token t stays in t's sequence from t on (`faults`; the kernels: from t's chunk on; docs/faults.md).
  """
  spec = checks.check_solve("delta_rule", q, k, v, beta=beta, k_write=k_write, log_decay=log_decay,
                            initial_state=initial_state, scale=scale, chunk_size=chunk_size,
                            segment_ids=segment_ids, output_final_state=output_final_state,
                            implementation=implementation, kernel_config=kernel_config)
  return _run("delta_rule", implementation, spec, segment_ids, output_final_state, q, k, v, beta,
              k_write=k_write, log_decay=log_decay, initial_state=initial_state, scale=scale)


def linear_attention(q, k, v, *, beta=None, log_decay=None, initial_state=None, output_final_state=False,
                     scale=None, chunk_size=64, segment_ids=None, implementation="auto", kernel_config=None):
  """The offline solve (linear attention with decay): S_t = D_t S_{t-1} + β_t k_t v_tᵀ, o_t = S_tᵀ(scale q_t).

  Shapes as `delta_rule` (packing included), `kernel_config` too (the delta rule's kernels run it); `beta`
  [B, T, HV] is optional (default 1). For the apply-to-query (ATQ) preconditioners pass the transformed query q̃ as
  `q`.
  """
  spec = checks.check_solve("linear_attention", q, k, v, beta=beta, beta_required=False,
                            log_decay=log_decay, initial_state=initial_state, scale=scale,
                            chunk_size=chunk_size, segment_ids=segment_ids,
                            output_final_state=output_final_state, implementation=implementation,
                            kernel_config=kernel_config)
  return _run("linear_attention", implementation, spec, segment_ids, output_final_state, q, k, v, beta,
              log_decay=log_decay, initial_state=initial_state, scale=scale)


def _step(online: bool, q, k, v, beta, state, k_write, log_decay, scale):
  out_dtype = q.dtype
  scale = common.default_scale(scale, q.shape[-1])
  q, k, v, beta, k_write, log_decay, state = common.prepare(
      q, k, v, beta, k_write, log_decay, state, head_axis=1)
  state = naive.decay_state(state, log_decay)
  if online:
    state = naive.online_write(state, k, k_write, v, beta)
  else:
    state = naive.offline_write(state, k, v, beta)
  return naive.read(state, q, scale).astype(out_dtype), state


def delta_rule_step(q, k, v, beta, state, *, k_write=None, log_decay=None, scale=None):
  """One token of the online solve for decoding.

  Args: q, k [B, H, K]; v [B, HV, V]; beta [B, HV]; state [B, HV, K, V]; k_write [B, H, K] or [B, HV, K];
    log_decay None, [B, HV] or [B, HV, K]. Every batch row is an independent sequence with its own state:
    rows with different histories (e.g. the per-segment final states of a packed prefill, [N, HV, K, V],
    used as B = N rows) step together exactly as each would alone.
  Returns: (o [B, HV, V] in q.dtype, new state [B, HV, K, V] fp32 (fp64 for fp64 inputs)).
  """
  checks.check_step("delta_rule_step", q, k, v, state, beta=beta, k_write=k_write, log_decay=log_decay,
                    scale=scale)
  return _step(True, q, k, v, beta, state, k_write, log_decay, scale)


def linear_attention_step(q, k, v, state, *, beta=None, log_decay=None, scale=None):
  """One token of the offline solve for decoding; shapes as `delta_rule_step`, `beta` optional.

  Every batch row is an independent sequence with its own state, as in `delta_rule_step`.
  """
  checks.check_step("linear_attention_step", q, k, v, state, beta=beta, beta_required=False,
                    log_decay=log_decay, scale=scale)
  return _step(False, q, k, v, beta, state, None, log_decay, scale)
