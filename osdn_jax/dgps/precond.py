"""The P axis: diagonal preconditioners on the write key (online solve) or on the query (offline solve).

Each returns `(k_write or q_tilde, final_state)`; chaining two calls through the final state equals one call.
Packed sequences: with `segment_ids` [B, T] (the convention of `osdn_jax.ops.packing`) every state restarts
at each segment start from that segment's initial state (`initial_state` [N, G, K], default as unpacked), and
the final state is per segment, [N, G, K] (None when N is unknown: traced ids and no initial_state).
Shapes: keys and queries [B, T, H, K]; a per-token gate [B, T, G] where G is the number of heads it lives on
(H for the PDN/ATQ second moment, the gain's heads — H or HV — for OSDN); states [B, G, K]. Results come back in
the keys' (queries') dtype, final states in fp32 (fp64 for fp64 inputs).

* PDN (Preconditioned DeltaNet): A_t = exp(gᴾ_t) A_{t-1} + βᴾ_t k_t²; z = log(A_t + ε) − c;
  k̃_t = exp(−log(x) z / (1 + |z|)) ⊙ k_t ∈ (k/x, x·k).
* ATQ: q̃_t = q_t / (A_t + λ) with A_t as in PDN (its own gates).
* OSDN (Online Scaled DeltaNet): d learned online by hypergradient descent on the surrogate
  h_t(d) = ((1 − β⟨d, k²⟩)² − 1) / (2‖k‖²); token t writes with guard(d_t ⊙ k_t), then
  d̄_{t+1} = r_t d_t + η β_t (1 − β_t⟨d_t, k_t²⟩) k_t² / ‖k_t‖²  (APF anchor "zero"; r ≡ 1 is vanilla OSDN) or
  d̄_{t+1} = d_init + r_t (d_t − d_init) + (same step)             (anchor "init"),  d_{t+1} = clip(d̄, d_min, d_max).
* fixed: k̃ = guard(d ⊙ k) with a constant d (the control that credits gains to the online hypergradient).
* exact (reference only, token-serial, meant for fp64): the full inverse Gram with gains.

`implementation` (`osdn_jax.ops.dispatch`), for the passes with several: "reference" (token-serial `lax.scan`,
`dgps.naive` for the second moment), "xla" (`lax.associative_scan`; OSDN's exact chunked form when unclipped and
unpacked, else the token-serial scan), "pallas" (this backend's kernels "decayed_sum", "precond_key",
"osdn_d_pass", "osdn_guard"; on a CPU the GPU kernels in interpret mode), "pallas-gpu" / "pallas-tpu" (that platform's kernels,
in interpret mode on another backend) or "auto" (pallas on a GPU or TPU when a kernel supports the call, else xla;
OSDN's d-pass takes the exact chunked form whenever it is unclipped and unpacked).

Options given as numbers are range-checked on every call (`dgps.checks`: PDN's x ≥ 1 and ε > 0, λ > 0, η ≥ 0,
d_min ≤ d_max, γ > 0, all finite); traced options pass unchecked.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from osdn_jax.dgps import checks, naive
from osdn_jax.dgps.moment import num_segments, pdn_scale  # noqa: F401  (this module's names too)
from osdn_jax.ops import chunked, common, dispatch, faults, packing
from osdn_jax.ops.scan import affine_scan

_HI = lax.Precision.HIGHEST
_TINY_NORM = 1e-12
_RETENTION_FLOOR = math.exp(common.LOG_DECAY_FLOOR)


def _ct(*xs):
  return common.compute_dtype(jnp.result_type(*[x for x in xs if x is not None]))


def _on_heads(k, heads: int):
  """Key heads expanded to the `heads` a gate lives on (GVA: head i reads key head i // g)."""
  return common.expand_heads(k, heads, axis=2)


# ---------------------------------------------------------------------------------------------------------
# PDN and ATQ: the decayed diagonal second moment (`num_segments` and `pdn_scale` are `dgps.moment`'s, shared
# with the token-serial reference `dgps.naive`).
# ---------------------------------------------------------------------------------------------------------
# A log-decay that empties the second moment: the kernels clamp per-token log-decays at −30, so the carried
# part is scaled by e^−30 ≈ 1e−13 (the packed XLA form zeroes it).
_RESET_LOG_DECAY = -30.0


def _choose(op, dtype, key_dim, segment_ids, implementation, static_params=True, initial_state=None,
            log_decay_p=None, config=None):
  """(kind, kernel, log_decay_p) for one preconditioner pass (kind "reference", "xla" or "pallas"); `config`: the
  caller's `kernel_config` (`ops.dispatch`).

  The second-moment kernels are unpacked. Packed with traced segment_ids and no carried state (a training
  step: no per-segment final state can be returned then either), a segment start is the same as a log-decay
  of −∞ there, so "auto" and "pallas" run the unpacked kernel on the log-decays with the starts folded in."""
  fold = (segment_ids is not None and initial_state is None and log_decay_p is not None
          and num_segments(segment_ids, None) is None)
  dispatch.check_config(op, config)
  request = dispatch.spec(op, dtype, key_dim=key_dim, packed=segment_ids is not None and not fold,
                          static_params=static_params, config=config)
  why = "" if static_params else "the transform's constants must be static numbers"
  if fold:
    try:
      kind, kernel = dispatch.choose(request, implementation, why=why)
    except ValueError:
      kind, kernel = None, None
    if kind == "pallas":
      starts = packing.segment_starts(segment_ids)[..., None]
      return kind, kernel, jnp.where(starts, jnp.asarray(_RESET_LOG_DECAY, jnp.result_type(log_decay_p)),
                                     log_decay_p)
    request = dataclasses.replace(request, packed=True)
  return (*dispatch.choose(request, implementation, why=why), log_decay_p)


def _confined(run, k, beta_p, log_decay_p, segment_ids, kernel):
  """run(k, βᴾ, gᴾ) → (y [B, T, H, K], A_T [B, H, K]), a call of the Pallas function `kernel`, run on the inputs
  with their non-finite entries zeroed, and NaN where the token-serial second moment has it: in a channel from
  its sequence's first fault in it on (a NaN or inf in k_t there, in βᴾ_t, or a log-decay NaN or +inf), and in
  its final state.

  A kernel's chunk meets its tokens in matmuls, where a zero weight times a NaN is NaN: a fault would reach the
  rows of its chunk before it, and, with segment starts folded into a −30 log-decay (`_choose`), the next
  segment through e^−30 · NaN. On finite inputs the selects change nothing. A kernel that declares
  `confines_faults` does this itself for unpacked sequences: it is called as it is then."""
  if segment_ids is None and getattr(getattr(kernel, "func", kernel), "confines_faults", False):
    return run(k, beta_p, log_decay_p)
  bad_k = ~jnp.isfinite(k)
  bad_b = ~jnp.isfinite(beta_p)
  bad_g = jnp.isnan(log_decay_p) | (log_decay_p == jnp.inf)
  since = faults.since_first(bad_k | (bad_b | bad_g)[..., None], segment_ids)
  zero = lambda x, bad: jnp.where(bad, jnp.zeros((), x.dtype), x)
  y, A_T = run(zero(k, bad_k), zero(beta_p, bad_b), zero(log_decay_p, bad_g))
  y = jnp.where(since.at, jnp.asarray(jnp.nan, y.dtype), y)
  if A_T is not None and segment_ids is None:
    A_T = jnp.where(since.poisoned[:, -1], jnp.asarray(jnp.nan, A_T.dtype), A_T)
  return y, A_T


def second_moment(k, beta_p, log_decay_p, *, initial_state=None, segment_ids=None, implementation="auto",
                  kernel_config=None):
  """A_t = exp(gᴾ_t) A_{t-1} + βᴾ_t (k_t ⊙ k_t), A_0 = initial_state (default 0).

  k [B, T, H, K]; beta_p, log_decay_p [B, T, H]; initial_state [B, H, K] ([N, H, K] with segment_ids).
  implementation: "reference" (token-serial), "xla" (`lax.associative_scan`), "pallas" (the chunked kernel
  "decayed_sum": unpacked, fp32/bf16) or "auto"; kernel_config: that kernel's launch parameters (`ops.dispatch`).
  Returns (A [B, T, H, K], A_T [B, H, K] or per segment [N, H, K]).
  """
  kind, kernel, g = _choose("decayed_sum", jnp.result_type(k), k.shape[-1], segment_ids, implementation,
                            initial_state=initial_state, log_decay_p=log_decay_p, config=kernel_config)
  if kind == "pallas":
    A, A_T = _confined(lambda k, b, g: kernel(k, g, beta=b, initial_state=initial_state), k, beta_p, g, segment_ids,
                     kernel)
    return A, (A_T if segment_ids is None else None)
  if kind == "reference":
    return naive.second_moment(k, beta_p, log_decay_p, initial_state=initial_state, segment_ids=segment_ids)
  ct = _ct(k, beta_p, log_decay_p)
  k = jnp.asarray(k, ct)
  a = jnp.exp(jnp.asarray(log_decay_p, ct))[..., None]
  b = jnp.asarray(beta_p, ct)[..., None] * k * k
  init = None if initial_state is None else jnp.asarray(initial_state, ct)
  if segment_ids is None:
    return affine_scan(a, b, initial=init, axis=1)
  return affine_scan(a, b, initial=init, reset=packing.segment_starts(segment_ids),
                     num_segments=num_segments(segment_ids, initial_state), axis=1)


def _saveable(key):
  """The write key, named "precond_pass" for rematerialisation policies (`models.config.REMAT_POLICIES`): saved,
  a block's backward need not rerun the first pass (whose kernels name their residuals alike)."""
  return checkpoint_name(key, "precond_pass")


def _static(*constants):
  return all(isinstance(c, numbers.Real) for c in constants)


def pdn_write_key(k, beta_p, log_decay_p, center, *, x=1.5, eps=1e-6, initial_state=None, segment_ids=None,
                  implementation="auto", kernel_config=None):
  """PDN's write key k̃_t = M_t ⊙ k_t from the current second moment A_t. Returns (k̃ [B,T,H,K], A_T [B,H,K]).

  `implementation` as `second_moment`, but "pallas" runs the fused kernel "precond_key" (A_t never stored;
  unpacked, fp32/bf16, x and eps static numbers; `kernel_config` its launch parameters). x ≥ 1, ε > 0."""
  checks.pdn("pdn_write_key", x=x, eps=eps)
  kind, kernel, g = _choose("precond_key", jnp.result_type(k), k.shape[-1], segment_ids, implementation,
                            _static(x, eps), initial_state=initial_state, log_decay_p=log_decay_p,
                            config=kernel_config)
  if kind == "pallas":
    k_write, A_T = _confined(lambda k, b, g: kernel(k, b, g, transform="pdn", center=center, x=x, eps=eps,
                                                    initial_state=initial_state), k, beta_p, g, segment_ids, kernel)
    return _saveable(k_write), (A_T if segment_ids is None else None)
  A, A_T = second_moment(k, beta_p, log_decay_p, initial_state=initial_state, segment_ids=segment_ids,
                         implementation=implementation)
  return _saveable((pdn_scale(A, center, x=x, eps=eps) * jnp.asarray(k, A.dtype)).astype(k.dtype)), A_T


def atq_query(q, k, beta_p, log_decay_p, *, lam=1.0, initial_state=None, segment_ids=None,
              implementation="auto", kernel_config=None):
  """The apply-to-query transform q̃_t = q_t / (A_t + λ). Returns (q̃ [B,T,H,K], A_T [B,H,K]).

  `implementation` and `kernel_config` as `pdn_write_key` (the fused kernel "precond_key"; λ a static number).
  λ > 0."""
  checks.lam("atq_query", lam)
  kind, kernel, g = _choose("precond_key", jnp.result_type(q, k), k.shape[-1], segment_ids, implementation,
                            _static(lam), initial_state=initial_state, log_decay_p=log_decay_p,
                            config=kernel_config)
  if kind == "pallas":
    q_tilde, A_T = _confined(lambda k, b, g: kernel(k, b, g, transform="atq", q=q, lam=lam,
                                                    initial_state=initial_state), k, beta_p, g, segment_ids, kernel)
    return q_tilde, (A_T if segment_ids is None else None)
  A, A_T = second_moment(k, beta_p, log_decay_p, initial_state=initial_state, segment_ids=segment_ids,
                         implementation=implementation)
  return (jnp.asarray(q, A.dtype) / (A + lam)).astype(q.dtype), A_T


# ---------------------------------------------------------------------------------------------------------
# OSDN: the online hypergradient write scale.
# ---------------------------------------------------------------------------------------------------------
def apply_guard(w, k, beta, guard):
  """w · min(1, γ / max(β⟨k, w⟩, 1e-12)): caps each step's β⟨k, k̃⟩ at γ (2 keeps it stable). None: off.

  w, k [B, T, G, K]; beta [B, T, G].
  """
  checks.guard_option("apply_guard", guard)
  if guard is None:
    return w
  s = beta * jnp.sum(k * w, axis=-1)
  return w * jnp.minimum(1.0, guard / jnp.maximum(s, 1e-12))[..., None]


def bound(d, lo, hi):
  """OSDN's box clip: clip(d, lo, hi), a bound of None not acting (d itself when both are None)."""
  return d if lo is None and hi is None else jnp.clip(d, lo, hi)


def osdn_inputs(k, beta, retention, d_init, initial_state, n_seg=None):
  """The d-pass's arrays as `osdn_write_key` builds them: (k, beta, u, n, retention, d_init, d1).

  k [B, T, H, K] keys, beta [B, T, G] gains, retention None or [B, T, G], d_init a scalar or broadcastable to
  [G, K], initial_state None or [B, G, K] ([n_seg, G, K] when packed). Returns, in the compute dtype: k expanded
  to the G heads [B, T, G, K], beta, u = k ⊙ k, n = max(‖k‖², 1e-12) [B, T, G], retention floored at e^−30
  (None stays None), d_init broadcast to [G, K], and d1, the d of token 1: initial_state, else d_init broadcast to
  [B, G, K] ([n_seg, G, K] with n_seg given). The arguments of `osdn_d_pass` (and `diagnostics.clip`'s).
  """
  heads = beta.shape[2]
  ct = _ct(k, beta, retention)
  k = jnp.asarray(_on_heads(k, heads), ct)
  beta = jnp.asarray(beta, ct)
  u = k * k
  n = jnp.maximum(jnp.sum(u, axis=-1), _TINY_NORM)                    # ‖k‖², floored
  # Retention is floored at e^−30 (≈ 1e−13), the floor every log-decay has in the chunked solves, so that the
  # sequential and chunked d-passes are the same function (values and gradients) for every r in [0, 1].
  r = None if retention is None else jnp.maximum(jnp.asarray(retention, ct), _RETENTION_FLOOR)
  d_init = jnp.asarray(d_init, ct)
  rows = k.shape[0] if n_seg is None else n_seg
  shape = (rows, heads, k.shape[-1])
  d1 = jnp.broadcast_to(d_init, shape) if initial_state is None else jnp.asarray(initial_state, ct)
  return k, beta, u, n, r, jnp.broadcast_to(d_init, shape[1:]), d1


def osdn_d_pass(u, n, beta, retention, d1, d_init, *, eta, d_min, d_max, apf_anchor, segment_ids=None,
                implementation="auto", chunk_size=64, keys=None, kernel_config=None):
  """OSDN's d-pass: the write scale d_t of every token and d_{T+1}, from keys and gains only.

    d̄_{t+1} = keep_t + η β_t (1 − β_t ⟨d_t, u_t⟩) u_t / n_t,   d_{t+1} = clip(d̄_{t+1}, d_min, d_max),
    keep_t = d_t (no retention) | r_t d_t (anchor "zero") | d_init + r_t (d_t − d_init) (anchor "init").

  u [B, T, G, K] (k ⊙ k), n [B, T, G] (max(‖k‖², 1e-12)), beta [B, T, G], retention [B, T, G] in [e^−30, 1]
  (None: r ≡ 1; `osdn_write_key` floors it),
  d1 [B, G, K] (the d of token 1; [N, G, K] with segment_ids, d restarting from d1[n] at segment n's first
  token), d_init broadcastable to [G, K]; eta, d_min, d_max numbers (bounds None: unbounded).
  Returns (ds [B, T, G, K], d_{T+1} [B, G, K] or each segment's last d [N, G, K]).
  implementation: "reference" (the token-serial `lax.scan`: the contract of the Pallas kernel), "xla" (the
  exact chunked form when unclipped and unpacked, else the scan), "pallas" (the kernel "osdn_d_pass"; η and
  the bounds static numbers) or "auto" (the chunked form when unclipped and unpacked, else the kernel on a GPU
  when it supports the call, else the scan).
  keys: None, or the keys k [B, T, G, K] that u squares (u = k ⊙ k in u's dtype, fp32): the GPU kernel then reads
  k in its own dtype and forms u where it loads it, so u is not stored (the other paths use u).
  kernel_config: the kernel's launch parameters (`ops.dispatch`; the unbounded unpacked chunked form takes none).
  """
  checks.apf_anchor_option("osdn_d_pass", apf_anchor)
  checks.d_pass("osdn_d_pass", eta=eta, d_min=d_min, d_max=d_max)
  checks.positive_int("osdn_d_pass", "chunk_size", chunk_size)
  impl = dispatch.normalize("osdn_d_pass", implementation)
  dispatch.check_config("osdn_d_pass", kernel_config)
  if impl in ("xla", "auto") and d_min is None and d_max is None and segment_ids is None:
    return _osdn_chunked(u, n, beta, retention, d1, d_init, eta=eta, apf_anchor=apf_anchor, chunk_size=chunk_size)
  if impl != "reference":
    static = all(x is None or isinstance(x, numbers.Real) for x in (eta, d_min, d_max))
    kind, kernel, _ = _choose("osdn_d_pass", u.dtype, u.shape[-1], segment_ids, impl, static, config=kernel_config)
    if kind == "pallas":
      ids = None if segment_ids is None else packing.segment_index(segment_ids)
      return kernel(u, n, beta, retention, d1, d_init, eta=eta, d_min=d_min, d_max=d_max, apf_anchor=apf_anchor,
                    segment_ids=ids, keys=keys)
  bounds = dict(eta=eta, d_min=d_min, d_max=d_max, apf_anchor=apf_anchor)
  if segment_ids is not None:
    return _osdn_serial_packed(u, n, beta, retention, d1, d_init, segment_ids=segment_ids, **bounds)

  def body(d, x):
    u_t, n_t, b_t, r_t = x
    return osdn_update(d, u_t, n_t, b_t, r_t, d_init, **bounds), d

  time_major = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)
  d_last, ds = lax.scan(body, d1, tuple(map(time_major, (u, n, beta, retention))))
  return jnp.moveaxis(ds, 0, 1), d_last


def osdn_update(d, u_t, n_t, b_t, r_t, d_init, *, eta, d_min, d_max, apf_anchor):
  """One token's step of the d-pass: d_{t+1} = clip(keep_t + η β_t (1 − β_t ⟨d_t, u_t⟩) u_t / n_t, d_min, d_max),
  keep_t as in `osdn_d_pass`. d, u_t [B, G, K]; n_t, b_t, r_t [B, G] (r_t None: r ≡ 1); a bound of None does not
  act (both None: the unclipped d̄_{t+1}). The kernels' copy is `pallas_kernels.osdn_math` (not imported here: the
  library reaches the kernel package only through `pallas_kernels.spec` and the dispatch)."""
  step = (eta * b_t * (1.0 - b_t * jnp.sum(d * u_t, -1)) / n_t)[..., None] * u_t
  if r_t is None:
    keep = d
  elif apf_anchor == "zero":
    keep = r_t[..., None] * d
  else:
    keep = d_init + r_t[..., None] * (d - d_init)
  return bound(keep + step, d_min, d_max)


def _osdn_serial_packed(u, n, beta, r, d1, d_init, *, eta, d_min, d_max, apf_anchor, segment_ids):
  starts = packing.segment_starts(segment_ids)                         # [B, T]
  seg = packing.segment_index(segment_ids)
  count = d1.shape[0]

  def body(d, x):
    u_t, n_t, b_t, r_t, start_t, seg_t = x
    d = jnp.where(start_t[:, None, None], d1[jnp.minimum(seg_t, count - 1)], d)
    d_next = osdn_update(d, u_t, n_t, b_t, r_t, d_init, eta=eta, d_min=d_min, d_max=d_max, apf_anchor=apf_anchor)
    return d_next, (d, d_next)

  time_major = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)
  d0 = jnp.zeros((u.shape[0],) + u.shape[2:], u.dtype)
  _, (ds, ds_next) = lax.scan(body, d0, tuple(map(time_major, (u, n, beta, r, starts, seg))))
  ds, ds_next = jnp.moveaxis(ds, 0, 1), jnp.moveaxis(ds_next, 0, 1)
  ends = jnp.concatenate([starts[:, 1:], jnp.ones_like(starts[:, :1])], axis=1)
  last = jnp.zeros_like(d1).at[jnp.where(ends, seg, count)].set(ds_next, mode="drop")
  return ds, last


def _osdn_chunked(u, n, beta, r, d1, d_init, *, eta, apf_anchor, chunk_size):
  """The unclipped d-pass as a delta rule with a one-column state (exact; finite at β = 0).

  With y = d − o (o = 0 for anchor "zero", d_init for "init"), c = ηβ²/‖k‖² and b = ηβ(1 − β⟨o, k²⟩)/‖k‖²:
      y_{t+1} = r_t y_t − c_t k²(k²ᵀ y_t) + b_t k².
  The delta rule S_t = D_t S_{t-1} + β' k̃' (v' − k'ᵀ D_t S_{t-1}) reads its erase key against the *decayed*
  state, so it is this recurrence with D_t = r_t, read key k' = (c_t / r_t) k², write key k̃' = k², v' = b_t,
  β' = 1 (r is floored at e^−30 in `osdn_inputs` for every form, so 1/r ≤ e^30 stays finite, and the chunk
  form's e^{G_i} cancels it exactly). S_t = y_{t+1}: the states before each token give d_t.
  """
  o = d_init if apf_anchor == "init" else jnp.zeros_like(d_init)
  c = eta * beta * beta / n
  b = eta * beta * (1.0 - beta * jnp.sum(o * u, -1)) / n
  if r is None:
    log_r, read = None, c[..., None] * u
  else:
    log_r = jnp.log(r)
    read = (c * jnp.exp(-log_r))[..., None] * u
  since = _chunked_faults(read, b, u, log_r)
  zero = lambda x: None if x is None else jnp.where(_expand(since.at, x), jnp.zeros((), x.dtype), x)
  states, y_last = chunked.delta_rule_states(
      zero(read), zero(b)[..., None], jnp.ones_like(b), k_write=zero(u), log_decay=zero(log_r),
      initial_state=(d1 - o)[..., None], chunk_size=chunk_size)
  y = jnp.concatenate([(d1 - o)[:, None, :, :, None], states[:, :-1]], axis=1)[..., 0]
  nan = jnp.asarray(jnp.nan, y.dtype)
  return (jnp.where(since.after[..., None], nan, o + y),
          jnp.where(since.poisoned[:, -1, :, None], nan, o + y_last[..., 0]))


def _expand(mask, x):
  return mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim))


def _chunked_faults(read, b, u, log_r):
  """Where each row's first non-finite token of the chunked d-pass is ([B, T, G] masks, `faults.Since`).

  A chunk's tokens meet in matmuls, where a zero weight times a NaN is NaN: one bad token would reach the rows
  of its chunk before it. So the pass runs with the tokens from the first bad one on zeroed (an identity step,
  leaving the earlier rows as in the clean run), and d is NaN after it, as in the token-serial scan."""
  ok = jnp.isfinite(b) & jnp.all(jnp.isfinite(read), -1) & jnp.all(jnp.isfinite(u), -1)
  if log_r is not None:
    ok = ok & jnp.isfinite(log_r)
  return faults.since_first(~ok)


def osdn_write_key(k, beta, *, retention=None, eta=1.0, d_init=1.0, d_min=0.0, d_max=8.0, guard=2.0,
                   apf_anchor="zero", initial_state=None, implementation="auto", chunk_size=64, segment_ids=None,
                   kernel_config=None):
  """OSDN's write key k̃_t = guard(d_t ⊙ k_t), d learned online from keys and gains only (`osdn_d_pass`).

  Args:
    k: [B, T, H, K] keys (expanded to beta's heads G ∈ {H, HV}). beta: [B, T, G] the solve's gains.
    retention: None (r ≡ 1, vanilla OSDN) or [B, T, G] APF retention in [0, 1] (floored at e^−30, like
      every log-decay of the solves).
    eta ≥ 0, d_init (finite; scalar or broadcastable to [G, K]), d_min ≤ d_max (None: unbounded), guard (γ > 0;
      None: off).
    apf_anchor: "zero" (r forgets toward 0) or "init" (toward d_init).
    initial_state: [B, G, K] the d that token 1 writes with (default d_init).
    implementation: one of `ops.dispatch.IMPLEMENTATIONS`, of the d-pass (`osdn_d_pass`).
    kernel_config: the launch parameters of the d-pass and guard kernels (one family's `Config`; `ops.dispatch`).
    segment_ids: None or [B, T] packed sequences (initial_state then [N, G, K]; d_{T+1} per segment).
  Returns:
    (k̃ [B, T, G, K] in k.dtype, d_{T+1} [B, G, K]).
  """
  checks.osdn("osdn_write_key", eta=eta, d_init=d_init, d_min=d_min, d_max=d_max, guard=guard,
              apf_anchor=apf_anchor, d_init_in_bounds=False)
  checks.positive_int("osdn_write_key", "chunk_size", chunk_size)
  dispatch.normalize("osdn_write_key", implementation)
  dispatch.check_config("osdn_write_key", kernel_config)
  if beta.ndim != 3 or beta.shape[:2] != k.shape[:2] or beta.shape[2] % k.shape[2]:
    raise ValueError(f"osdn_write_key: `beta` must be [B, T, G] with G a multiple of H = {k.shape[2]}, "
                     f"got shape {beta.shape}")
  if retention is not None and retention.shape != beta.shape:
    raise ValueError(f"osdn_write_key: `retention` must have beta's shape {beta.shape}, got {retention.shape}")
  out_dtype = k.dtype
  n_seg = None
  if segment_ids is not None:
    # Traced ids and no initial_state: N is unknown, every segment starts from d_init, no final states.
    n_seg = num_segments(segment_ids, initial_state) or 1
  kx, beta, u, n, r, d0, d1 = osdn_inputs(k, beta, retention, d_init, initial_state, n_seg)
  # The keys in their own dtype: a GPU kernel reads them and squares them itself, so u = k ⊙ k is not stored.
  keys = _on_heads(k, beta.shape[2]) if u.dtype == jnp.float32 else None
  ds, d_last = osdn_d_pass(u, n, beta, r, d1, d0, eta=eta, d_min=d_min, d_max=d_max, apf_anchor=apf_anchor,
                           segment_ids=segment_ids, implementation=implementation, chunk_size=chunk_size, keys=keys,
                           kernel_config=kernel_config)
  if segment_ids is not None and num_segments(segment_ids, initial_state) is None:
    d_last = None
  k_write = _guarded_key(ds, kx, keys, beta, n, guard, implementation, kernel_config)
  return _saveable(k_write.astype(out_dtype)), d_last


def _guarded_key(ds, kx, keys, beta, n, guard, implementation, config=None):
  """guard(ds ⊙ k) [B, T, G, K], NaN on the rows whose ‖k‖² is not finite: the kernel "osdn_guard" (one pass,
  in the keys' dtype; `config` the d-pass's kernel config) where `implementation` runs kernels and one supports
  the call, else plain JAX (fp32)."""
  impl = dispatch.normalize("osdn_write_key", implementation)
  if keys is not None and isinstance(guard, numbers.Real) and impl not in ("reference", "xla"):
    try:
      request = dispatch.spec("osdn_guard", keys.dtype, key_dim=keys.shape[-1], config=config)
      kind, kernel = dispatch.choose(request, impl)
    except ValueError:          # an explicit platform without this kernel ("pallas-tpu"): plain JAX
      kind = "xla"
    if kind == "pallas":
      return kernel(ds, keys, beta, n, guard=guard)
  # A key whose ‖k‖² is not finite (a NaN or inf in k, or a finite k whose square overflows) writes NaN: the guard's
  # β⟨k, d ⊙ k⟩ means nothing there, and a finite write key of that size would overflow inside the chunked solve
  # and reach its chunk's other rows, where the solve confines a NaN to its sequence from its token on.
  k_write = apply_guard(ds * kx, kx, beta, guard)
  return jnp.where(~jnp.isfinite(n)[..., None], jnp.asarray(jnp.nan, k_write.dtype), k_write)


def fixed_write_key(k, beta, d, *, guard=2.0):
  """The control point: k̃ = guard(d ⊙ k) with a constant write scale d (broadcastable to [G, K]; γ > 0 or None)."""
  checks.guard_option("fixed_write_key", guard)
  heads = beta.shape[2]
  ct = _ct(k, beta)
  kx = jnp.asarray(_on_heads(k, heads), ct)
  return apply_guard(jnp.asarray(d, ct) * kx, kx, jnp.asarray(beta, ct), guard).astype(k.dtype), None


# ---------------------------------------------------------------------------------------------------------
# Exact full-Gram preconditioner (reference only).
# ---------------------------------------------------------------------------------------------------------
def _exact_pass(k, beta, lam, emit):
  """Token-serial inverse Gram P_t = G_t⁻¹, G_t = λI + Σ_{i≤t} β_i k_i k_iᵀ, by Sherman–Morrison."""
  ct = _ct(k, beta)
  heads = beta.shape[2]
  k = jnp.asarray(_on_heads(k, heads), ct)
  beta = jnp.asarray(beta, ct)
  b, _, _, kd = k.shape
  P0 = jnp.broadcast_to(jnp.eye(kd, dtype=ct) / lam, (b, heads, kd, kd))

  def body(P, x):
    k_t, b_t, extra = x
    Pk = jnp.einsum("...ij,...j->...i", P, k_t, precision=_HI)
    denom = 1.0 + b_t * jnp.sum(k_t * Pk, -1)
    k_tilde = Pk / denom[..., None]                             # = G_t⁻¹ k_t
    P_next = P - (b_t / denom)[..., None, None] * Pk[..., :, None] * Pk[..., None, :]
    return P_next, emit(P_next, k_tilde, extra)

  tm = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)
  return P0, body, tm, k, beta


def exact_write_key(k, beta, *, lam=1.0):
  """k̃_t = G_{t-1}⁻¹k_t / (1 + β_t k_tᵀG_{t-1}⁻¹k_t) (= G_t⁻¹k_t), λ > 0. Returns (k̃ [B,T,G,K], G_T⁻¹ [B,G,K,K])."""
  checks.lam("exact_write_key", lam)
  P0, body, tm, kx, beta = _exact_pass(k, beta, lam, lambda P, kt, _: kt)
  P, ks = lax.scan(body, P0, (tm(kx), tm(beta), None))
  return jnp.moveaxis(ks, 0, 1).astype(k.dtype), P


def exact_query(q, k, beta, *, lam=1.0):
  """q̃_t = G_t⁻¹ q_t (token t included), λ > 0. Returns (q̃ [B,T,G,K], G_T⁻¹)."""
  checks.lam("exact_query", lam)
  P0, body, tm, kx, beta = _exact_pass(k, beta, lam,
                                       lambda P, kt, q_t: jnp.einsum("...ij,...j->...i", P, q_t, precision=_HI))
  qx = jnp.asarray(_on_heads(q, beta.shape[2]), kx.dtype)
  P, qs = lax.scan(body, P0, (tm(kx), tm(beta), tm(qx)))
  return jnp.moveaxis(qs, 0, 1).astype(q.dtype), P
