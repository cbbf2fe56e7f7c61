"""OSDN's sequential d-pass (DESIGN.md §1, "OSDN online hypergradient") as a Pallas GPU kernel pair.

The recurrence (one (batch, head) row; u_t = k_t ⊙ k_t, n_t = max(‖k_t‖², 1e-12), s_t = ⟨d_t, u_t⟩):
    coef_t = η β_t (1 − β_t s_t) / n_t
    d̄_{t+1} = keep_t + coef_t u_t,   keep_t = d_t (r ≡ 1) | r_t d_t (anchor "zero") | o + r_t (d_t − o) ("init")
    d_{t+1} = clip(d̄_{t+1}, d_min, d_max)                                            (o = d_init [G, K])
Token t writes with d_t; the results are ds = (d_1 … d_T) [B, T, G, K] and d_{T+1} [B, G, K].

Forward kernel, grid (B, G), one program per (batch, head): ⟨d, u⟩ couples all K channels, so d [K] of one head
lives in one program's registers (one warp up to K = 128). A `fori_loop` over blocks of `block_t` tokens whose
body is unrolled and issues all the block's loads (independent of d) before its first step, so one memory
latency is paid per block, not per token; the T mod block_t tokens left over are unrolled after the loop, so
T needs no padding and no token past T is ever processed (d_{T+1} is exact for both anchors). Per token: one row load of u, scalar loads
of β, n, r, one K-reduction, a row store of d_t.

Backward kernel, same grid, the adjoint in reverse token order. With λ the cotangent of d_{t+1} (d_{T+1}'s
cotangent to start), m_t the clip's derivative at d̄_{t+1} (1 inside, 0 outside, ½ at a bound, exactly as
`jnp.clip`'s), μ = m_t ⊙ λ, p = ⟨u_t, μ⟩ and c_t = η β_t² / n_t (= −∂coef/∂s):
    ∂u_t = coef_t μ − c_t p d_t      ∂β_t = η p (1 − 2 β_t s_t) / n_t      ∂n_t = −coef_t p / n_t
    ∂r_t = ⟨d_t − o, μ⟩ (o = 0 for "zero")      ∂o += (1 − r_t) μ ("init")
    λ ← r_t μ − c_t p u_t + ∂ds_t                 (∂d_1 = λ after token 1)
The forward saves d_t (its output ds), so s_t and d̄_{t+1} are recomputed per token off the dependency chain;
the chain itself is one K-reduction per token.

Packed sequences: one int32 code per token (segment, first, last): d restarts from d1[segment] at a first
token and d_{T+1} of the segment is stored at its last; in reverse, λ restarts from the segment's d_{T+1}
cotangent at a last token and ∂d1[segment] is stored at a first. Segments never span rows, so the (batch, head)
programs write disjoint rows of the per-segment arrays.

`d_pass` is the entry point (padding K to a power of two ≥ 16, one `jax.custom_vjp` around the two kernels);
the guard and d ⊙ k stay in plain JAX in `osdn_jax.dgps.precond`. fp32 throughout. Registered with
`pallas_kernels.lookup` as "osdn_d_pass" (see `supports`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from osdn_jax.ops import packing
from pallas_kernels.gpu.config import padded_dim, pallas_call

F32 = jnp.float32
MAX_KEY_DIM = 256                        # d [K] stays in registers
_SQ = getattr(pl, "squeezed", None)      # a squeezed block dim (None in older JAX)


def _pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class DPassBlocks:
  """Launch parameters of the d-pass kernels (speed only, not numerics).

  block_t:    tokens per iteration of the forward's sequential loop (the loop body is unrolled over them and
              issues all their loads first: registers grow with it).
  block_t_bwd: the same for the backward (three K-rows per token are held: smaller).
  num_warps:  Triton warps per program; None: 1 for K ≤ 128 (the K-reductions stay within a warp), else 2.
  num_stages: Triton num_stages.
  """
  block_t: int = 16       # H200, B=4 T=4096 G=16 K=128 (profile_osdn): 16/8 ran fwd 1.16 ms, fwd+bwd 3.00 ms;
  block_t_bwd: int = 8     # 32/16 1.48 / 3.89; 64/32 1.48 / 4.13
  num_warps: int | None = None
  num_stages: int = 1

  def __post_init__(self):
    for name in ("block_t", "block_t_bwd"):
      if not _pow2(getattr(self, name)):
        raise ValueError(f"DPassBlocks.{name}={getattr(self, name)} must be a power of two")
    if self.num_warps is not None and not _pow2(self.num_warps):
      raise ValueError(f"DPassBlocks.num_warps={self.num_warps} must be a power of two")
    if self.num_stages < 1:
      raise ValueError(f"DPassBlocks.num_stages={self.num_stages} must be ≥ 1")

  def warps(self, key_dim: int) -> int:
    return self.num_warps or (1 if key_dim <= 128 else 2)


DEFAULT_BLOCKS = DPassBlocks()
INTERPRET_BLOCKS = DPassBlocks(block_t=4, block_t_bwd=4)   # interpret mode: unrolling only costs compile time there


@dataclasses.dataclass(frozen=True)
class Static:
  """Everything static about one d-pass call (hashable: the custom_vjp's non-differentiable argument)."""
  batch: int
  length: int              # T (not padded)
  heads: int               # G
  key_dim: int             # padded K
  eta: float
  d_min: float | None
  d_max: float | None
  mode: str                # "none" (r ≡ 1) | "zero" | "init"
  blocks: DPassBlocks
  interpret: bool
  segments: int = 0        # packed: N (per-token codes reset d; d1 and d_{T+1} are per segment); 0: not

  @property
  def has_r(self) -> bool:
    return self.mode != "none"

  @property
  def has_o(self) -> bool:
    return self.mode == "init"


# BlockSpecs over the grid (b, g): whole sequences of one (batch, head).
def _rows(st):     # [B, T, G, K] → [T, K]
  return pl.BlockSpec((_SQ, st.length, _SQ, st.key_dim), lambda b, g: (b, 0, g, 0))


def _scalars(st):  # [B, T, G] → [T]
  return pl.BlockSpec((_SQ, st.length, _SQ), lambda b, g: (b, 0, g))


def _head_vec(st):  # [B, G, K] → [K]; packed: [N, G, K] → [N, K] (every segment's row, read by index)
  if st.segments:
    return pl.BlockSpec((st.segments, _SQ, st.key_dim), lambda b, g: (0, g, 0))
  return pl.BlockSpec((_SQ, _SQ, st.key_dim), lambda b, g: (b, g, 0))


def _batch_vec(st):  # [B, G, K] → [K], also when packed
  return pl.BlockSpec((_SQ, _SQ, st.key_dim), lambda b, g: (b, g, 0))


def _codes(st):    # [B, T] int32 → [T]: segment << 2 | last token of it << 1 | first token of it
  return pl.BlockSpec((_SQ, st.length), lambda b, g: (b, 0))


def _decode(code):
  return code >> 2, (code & 1) == 1, (code & 2) == 2


def _param_vec(st):  # [G, K] → [K]
  return pl.BlockSpec((_SQ, st.key_dim), lambda b, g: (g, 0))


def _split(refs, *present):
  """Splits a flat ref list into one entry per flag (None where the flag is False)."""
  out, i = [], 0
  for p in present:
    out.append(refs[i] if p else None)
    i += int(p)
  assert i == len(refs)
  return out


def _sequential(st, load, step, carry, reverse: bool, block_t: int):
  """Runs carry ← step(t, load(t), carry) for t = 0 … T−1 (or T−1 … 0): a fori_loop over blocks of block_t
  tokens, the last T mod block_t tokens on their own. Each block first issues every load of its tokens, then
  runs the unrolled steps: loads written after the previous token's stores could not be moved above them
  (the refs may alias), so a per-token load would put one memory latency on the dependency chain per token."""
  nf, rem = divmod(st.length, block_t)

  def run(ts, c):
    ts = list(reversed(ts)) if reverse else ts
    xs = [load(t) for t in ts]
    for t, x in zip(ts, xs):
      c = step(t, x, c)
    return c

  def block(i, c):
    return run([i * block_t + j for j in range(block_t)], c)

  tail = lambda c: run([jnp.int32(nf * block_t + j) for j in range(rem)], c)
  zero, count = jnp.int32(0), jnp.int32(nf)
  if reverse:
    c = tail(carry)
    if nf:
      c = lax.fori_loop(zero, count, lambda i, c: block(count - 1 - i, c), c)
    return c
  c = carry
  if nf:
    c = lax.fori_loop(zero, count, block, c)
  return tail(c)


def _pre_clip(st, d, u, b, n, r, o):
  """(d̄_{t+1}, coef_t, s_t) for one token, as `precond._osdn_update` computes them."""
  s = jnp.sum(d * u)
  coef = st.eta * b * (1.0 - b * s) / n
  if st.mode == "none":
    keep = d
  elif st.mode == "zero":
    keep = r * d
  else:
    keep = o + r * (d - o)
  return keep + coef * u, coef, s


def _clip(st, x):
  if st.d_min is not None:
    x = jnp.maximum(x, st.d_min)
  if st.d_max is not None:
    x = jnp.minimum(x, st.d_max)
  return x


def _clip_grad(st, x):
  """∂clip/∂x as `jnp.clip` defines it (1 inside, 0 outside, ½ at a bound; ¼ at d_min = d_max); None: 1."""
  m = None
  if st.d_min is not None:
    m = (x > st.d_min).astype(F32) + 0.5 * (x == st.d_min).astype(F32)
  if st.d_max is not None:
    m_hi = (x < st.d_max).astype(F32) + 0.5 * (x == st.d_max).astype(F32)
    m = m_hi if m is None else m * m_hi
  return m


# ---------------------------------------------------------------------------------------------------------
# Forward: ds [B, T, G, K] (the d each token writes with), d_{T+1} [B, G, K].
# ---------------------------------------------------------------------------------------------------------
def _fwd_kernel(st, *refs):
  packed = st.segments > 0
  u_ref, b_ref, n_ref, r_ref, c_ref, d1_ref, o_ref, ds_ref, dl_ref = _split(
      refs, True, True, True, st.has_r, packed, True, st.has_o, True, True)
  o = o_ref[...] if st.has_o else None

  def load(t):
    code = _decode(c_ref[t]) if packed else None
    d1 = d1_ref[code[0], :] if packed else None
    return u_ref[t, :], b_ref[t], n_ref[t], r_ref[t] if st.has_r else None, code, d1

  def step(t, x, d):
    u, b, n, r, code, d1 = x
    if packed:                            # a segment's first token starts from its own d1
      seg, first, last = code
      d = jnp.where(first, d1, d)
    d_bar, _, _ = _pre_clip(st, d, u, b, n, r, o)
    ds_ref[t, :] = d
    d_next = _clip(st, d_bar)
    if packed:
      @pl.when(last)
      def _():                            # a segment's last token leaves its d_{T+1}
        dl_ref[seg, :] = d_next
    return d_next

  bt = st.blocks.block_t
  if packed:
    _sequential(st, load, step, jnp.zeros((st.key_dim,), F32), False, bt)
  else:
    dl_ref[...] = _sequential(st, load, step, d1_ref[...].astype(F32), False, bt)


def _forward(st, u, n, beta, r, codes, d1, o):
  packed = st.segments > 0
  args = [u, beta, n] + ([r] if st.has_r else []) + ([codes] if packed else []) + [d1] + \
      ([o] if st.has_o else [])
  in_specs = [_rows(st), _scalars(st), _scalars(st)] + ([_scalars(st)] if st.has_r else []) + \
      ([_codes(st)] if packed else []) + [_head_vec(st)] + ([_param_vec(st)] if st.has_o else [])
  b, t, g, k = st.batch, st.length, st.heads, st.key_dim
  return pallas_call(
      functools.partial(_fwd_kernel, st), grid=(b, g), in_specs=in_specs,
      out_specs=[_rows(st), _head_vec(st)],
      out_shape=[jax.ShapeDtypeStruct((b, t, g, k), F32),
                 jax.ShapeDtypeStruct((st.segments or b, g, k), F32)],
      interpret=st.interpret, num_warps=st.blocks.warps(k), num_stages=st.blocks.num_stages,
      name="osdn_d_pass_fwd")(*args)


# ---------------------------------------------------------------------------------------------------------
# Backward: the adjoint pass in reverse token order.
# ---------------------------------------------------------------------------------------------------------
def _bwd_kernel(st, *refs):
  packed = st.segments > 0
  (u_ref, b_ref, n_ref, r_ref, c_ref, o_ref, ds_ref, gds_ref, gl_ref,
   du_ref, db_ref, dn_ref, dr_ref, dd1_ref, do_ref) = _split(
       refs, True, True, True, st.has_r, packed, st.has_o, True, True, True,
       True, True, True, st.has_r, True, st.has_o)
  o = o_ref[...] if st.has_o else None

  def load(t):
    code = _decode(c_ref[t]) if packed else None
    g_last = gl_ref[code[0], :] if packed else None
    return (u_ref[t, :], ds_ref[t, :], gds_ref[t, :], b_ref[t], n_ref[t], r_ref[t] if st.has_r else None,
            code, g_last)

  def step(t, x, carry):
    lam, acc_o = carry
    u, d, g_d, b, n, r, code, g_last = x
    if packed:                            # d_{t+1} of a segment's last token is that segment's d_{T+1}
      seg, first, last = code
      lam = jnp.where(last, g_last, lam)
    d_bar, coef, s = _pre_clip(st, d, u, b, n, r, o)
    m = _clip_grad(st, d_bar)
    mu = lam if m is None else m * lam
    p = jnp.sum(u * mu)
    c = st.eta * b * b / n
    du_ref[t, :] = coef * mu - (c * p) * d
    db_ref[t] = st.eta * p * (1.0 - 2.0 * b * s) / n
    dn_ref[t] = -coef * p / n
    if st.has_r:
      dr_ref[t] = jnp.sum((d - o) * mu) if st.has_o else jnp.sum(d * mu)
      lam_prev = r * mu - (c * p) * u
    else:
      lam_prev = mu - (c * p) * u
    if st.has_o:
      acc_o = acc_o + (1.0 - r) * mu
    lam_prev = lam_prev + g_d
    if packed:
      @pl.when(first)
      def _():                            # d of a segment's first token is its d1
        dd1_ref[seg, :] = lam_prev
    return lam_prev, acc_o

  lam0 = jnp.zeros((st.key_dim,), F32) if packed else gl_ref[...].astype(F32)
  lam, acc_o = _sequential(st, load, step, (lam0, jnp.zeros_like(lam0)), True, st.blocks.block_t_bwd)
  if not packed:
    dd1_ref[...] = lam
  if st.has_o:
    do_ref[...] = acc_o


def _backward(st, u, n, beta, r, codes, o, ds, g_ds, g_last):
  packed = st.segments > 0
  args = [u, beta, n] + ([r] if st.has_r else []) + ([codes] if packed else []) + \
      ([o] if st.has_o else []) + [ds, g_ds, g_last]
  in_specs = [_rows(st), _scalars(st), _scalars(st)] + ([_scalars(st)] if st.has_r else []) + \
      ([_codes(st)] if packed else []) + ([_param_vec(st)] if st.has_o else []) + \
      [_rows(st), _rows(st), _head_vec(st)]
  b, t, g, k = st.batch, st.length, st.heads, st.key_dim
  rows, scal, vec = (jax.ShapeDtypeStruct(s, F32) for s in ((b, t, g, k), (b, t, g), (st.segments or b, g, k)))
  # dO per (batch, head) program: [B, G, K] even when packed (summed over B by the caller).
  out_specs = [_rows(st), _scalars(st), _scalars(st)] + ([_scalars(st)] if st.has_r else []) + \
      [_head_vec(st)] + ([_batch_vec(st)] if st.has_o else [])
  out_shape = [rows, scal, scal] + ([scal] if st.has_r else []) + [vec] + \
      ([jax.ShapeDtypeStruct((b, g, k), F32)] if st.has_o else [])
  outs = pallas_call(
      functools.partial(_bwd_kernel, st), grid=(b, g), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, interpret=st.interpret, num_warps=st.blocks.warps(k),
      num_stages=st.blocks.num_stages, name="osdn_d_pass_bwd")(*args)
  du, dbeta, dn, dr, dd1, do = _split_outs(st, outs)
  return du, dn, dbeta, dr, dd1, None if do is None else jnp.sum(do, axis=0)


def _split_outs(st, outs):
  outs = list(outs)
  du, dbeta, dn = outs[:3]
  rest = outs[3:]
  dr = rest.pop(0) if st.has_r else None
  dd1 = rest.pop(0)
  do = rest.pop(0) if st.has_o else None
  return du, dbeta, dn, dr, dd1, do


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _d_pass(st: Static, u, n, beta, r, codes, d1, o):
  return tuple(_forward(st, u, n, beta, r, codes, d1, o))


def _d_pass_fwd(st, u, n, beta, r, codes, d1, o):
  ds, d_last = _forward(st, u, n, beta, r, codes, d1, o)
  return (ds, d_last), (u, n, beta, r, codes, o, ds)


def _d_pass_bwd(st, res, cts):
  u, n, beta, r, codes, o, ds = res
  g_ds, g_last = cts
  du, dn, dbeta, dr, dd1, do = _backward(st, u, n, beta, r, codes, o, ds, g_ds, g_last)
  return du, dn, dbeta, dr, None, dd1, do


_d_pass.defvjp(_d_pass_fwd, _d_pass_bwd)


# ---------------------------------------------------------------------------------------------------------
# Entry point.
# ---------------------------------------------------------------------------------------------------------
def _pad_last(x, size):
  return x if x.shape[-1] == size else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def _segment_codes(segment_ids, count: int):
  """[B, T] int32 codes (segment << 2 | last token << 1 | first token; segments past `count` clamped) and
  present [count] bool (the segment has tokens)."""
  first = packing.segment_starts(segment_ids)
  last = jnp.concatenate([first[:, 1:], jnp.ones(first.shape[:1] + (1,), bool)], axis=1)
  seg = jnp.minimum(packing.segment_index(segment_ids), count - 1)
  present = jnp.zeros((count,), bool).at[seg].set(True)
  return (seg << 2) | (last.astype(jnp.int32) << 1) | first.astype(jnp.int32), present


@functools.partial(jax.jit, static_argnames=("eta", "d_min", "d_max", "mode", "blocks", "interpret"))
def _run(u, n, beta, r, d1, d_init, segment_ids, *, eta, d_min, d_max, mode, blocks, interpret):
  b, t, g, kd = u.shape
  kp = padded_dim(kd)
  count = d1.shape[0] if segment_ids is not None else 0
  st = Static(batch=b, length=t, heads=g, key_dim=kp, eta=eta, d_min=d_min, d_max=d_max, mode=mode,
              blocks=blocks, interpret=interpret, segments=count)
  f32 = lambda x: None if x is None else jnp.asarray(x, F32)
  # Padded channels have u = 0: they never reach ⟨d, u⟩, and their d is sliced off.
  u, d1 = _pad_last(f32(u), kp), _pad_last(f32(d1), kp)
  o = _pad_last(jnp.broadcast_to(f32(d_init), (g, kd)), kp) if mode == "init" else None
  codes, present = None, None
  if count:      # rows of segments without tokens are neither read nor written by the kernels: zeros
    codes, present = _segment_codes(segment_ids, count)
    d1 = jnp.where(present[:, None, None], d1, 0.0)
  ds, d_last = _d_pass(st, u, f32(n), f32(beta), f32(r) if mode != "none" else None, codes, d1, o)
  if count:
    d_last = jnp.where(present[:, None, None], d_last, 0.0)
  return ds[..., :kd], d_last[..., :kd]


def _static_bound(name, x):
  if x is None:
    return None
  try:
    return float(x)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise ValueError(f"osdn d_pass (pallas gpu): `{name}` must be a static number, got {x!r}") from e


def d_pass(u, n, beta, retention, d1, d_init, *, eta, d_min, d_max, anchor, segment_ids=None,
           blocks: DPassBlocks | None = None, interpret: bool | None = None):
  """OSDN's sequential d-pass with the Pallas kernels (Triton on GPU, interpret mode on CPU).

  The signature and results of the unpacked `osdn_jax.dgps.precond._osdn_serial`:
    u [B, T, G, K] (k ⊙ k), n [B, T, G] (max(‖k‖², 1e-12)), beta [B, T, G], retention None (r ≡ 1) or
    [B, T, G], d1 [B, G, K] (the d of token 1), d_init [G, K] (or broadcastable; used by anchor "init" with
    a retention); eta, d_min, d_max static numbers (bounds None: unbounded); anchor "zero" | "init".
  Returns (ds [B, T, G, K], d_{T+1} [B, G, K]), fp32. Differentiable w.r.t. u, n, beta, retention, d1 and
  d_init (zero gradient through clipped entries). Packed (`segment_ids` [B, T], as the packed `_osdn_serial`):
  d1 is [N, G, K], d restarts from d1[n] at segment n's first token, and the second result is each segment's
  last d [N, G, K] (zeros for segments without tokens). `interpret` defaults to True on a CPU backend; `blocks`
  to DEFAULT_BLOCKS compiled and INTERPRET_BLOCKS in interpret mode.
  """
  if u.ndim != 4:
    raise ValueError(f"osdn d_pass (pallas gpu): `u` must be [B, T, G, K], got shape {u.shape}")
  b, t, g, kd = u.shape
  if t < 1:
    raise ValueError(f"osdn d_pass (pallas gpu): `u` needs T ≥ 1 tokens, got shape {u.shape}")
  if kd > MAX_KEY_DIM:
    raise ValueError(f"osdn d_pass (pallas gpu): K = {kd} must be ≤ {MAX_KEY_DIM}")
  for name, x in (("n", n), ("beta", beta), ("retention", retention)):
    if x is not None and x.shape != (b, t, g):
      raise ValueError(f"osdn d_pass (pallas gpu): `{name}` must be [B, T, G] = {(b, t, g)}, got {x.shape}")
  if segment_ids is None and d1.shape != (b, g, kd):
    raise ValueError(f"osdn d_pass (pallas gpu): `d1` must be [B, G, K] = {(b, g, kd)}, got {d1.shape}")
  if segment_ids is not None:
    if segment_ids.shape != (b, t):
      raise ValueError(f"osdn d_pass (pallas gpu): `segment_ids` must be [B, T] = {(b, t)}, got "
                       f"{segment_ids.shape}")
    if d1.ndim != 3 or d1.shape[1:] != (g, kd) or d1.shape[0] < 1:
      raise ValueError(f"osdn d_pass (pallas gpu): packed, `d1` must be [N, G, K] with G, K = {(g, kd)}, got "
                       f"{d1.shape}")
  if anchor not in ("zero", "init"):
    raise ValueError(f"osdn d_pass (pallas gpu): `anchor` must be 'zero' or 'init', got {anchor!r}")
  eta = _static_bound("eta", eta)
  d_min, d_max = _static_bound("d_min", d_min), _static_bound("d_max", d_max)
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  if blocks is None:
    blocks = INTERPRET_BLOCKS if interpret else DEFAULT_BLOCKS
  mode = "none" if retention is None else anchor
  return _run(u, n, beta, retention, d1, jnp.asarray(d_init), segment_ids, eta=eta, d_min=d_min, d_max=d_max,
              mode=mode, blocks=blocks, interpret=bool(interpret))


def supports(spec, dtype, chunk_size: int, platform: str) -> bool:
  """Compiled on "gpu", interpret mode on "cpu"; fp32 (the d-pass's compute dtype for fp32 and bf16 keys),
  K ≤ 256 (spec: anything with a `key_dim`, or None), packed or not; chunk_size is ignored."""
  key_dim = getattr(spec, "key_dim", None)
  return (platform in ("gpu", "cpu")
          and jnp.dtype(dtype) == jnp.dtype(F32)
          and (key_dim is None or 1 <= key_dim <= MAX_KEY_DIM))
