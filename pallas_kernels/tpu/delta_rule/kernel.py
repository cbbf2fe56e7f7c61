"""The fused forward kernel: one chunk per grid step, the state carried across the chunk axis in VMEM.

Per chunk of C tokens (docs/design.md §2), with G the inclusive in-chunk cumulative log-decay and S [K, BV] the
fp32 state entering the chunk, for decay none (G = 0) and scalar (G [C], formed in XLA):

  A     = strictLower(diag(β)(K K̃ᵀ) ⊙ Γ)          Γ_ij = e^{G_i − G_j} for i > j (masked before exp)
  T     = (I + A)⁻¹                                 (`unit_lower_inverse`: matmuls only)
  W     = T diag(β e^G) K          U = T diag(β) V          V_new = U − W S
  O     = scale · (e^G ⊙ (Q S) + ((Q K̃ᵀ) ⊙ Γ') V_new)   Γ' as Γ with i ≥ j
  S    ← e^{G_C} S + K̃ᵀ (e^{G_C − G} ⊙ V_new)

Per-channel decay (G [C, K]) is the same with the decay inside the channel sums: A and the output scores come from
`channel_scores`, W = T diag(β)(K ⊙ e^G), the inter-chunk output (Q ⊙ e^G) S, and S ← diag(e^{G_C}) S +
(K̃ ⊙ e^{G_C − G})ᵀ V_new. Its G is formed in the kernel, as the lower-triangular ones matrix times the clamped
log-decays (an fp32 dot), into a VMEM scratch: the log-decays are read once, and no G of the keys' size goes
through HBM.

Row factors go on the side of a dot that keeps the loaded tiles as they are (β e^G on T's columns, e^G on the
rows of Q S, e^{G_C − G} on the rows of V_new). β and G come in as rows [1, C]; their columns [C, 1] are formed
in the kernel (`column`), since a [T, 1] array in HBM is tiled 128 lanes wide.
"""
from __future__ import annotations

import functools
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.spec import LOG_DECAY_FLOOR
from pallas_kernels.tpu.common import interpret_mode
from pallas_kernels.tpu.delta_rule.layout import Layout

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST


def dot(a, b, *, ta=False, tb=False, precision=None):
  """a @ b (aᵀ with ta, bᵀ with tb) with fp32 accumulation; 2-D operands."""
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def iota(c: int, axis: int):
  """Row (axis 0) or column (axis 1) indices of a [c, c] tile, int32."""
  return lax.broadcasted_iota(jnp.int32, (c, c), axis)


def ones_where(mask):
  """mask as fp32 ones and zeros (a fp32 constant: Python floats would be fp64 with x64 enabled)."""
  return mask.astype(F32)


def unit_lower_inverse(a, precision=HIGHEST):
  """(I + a)⁻¹ [C, C] for strictly lower-triangular a [C, C], C a power of two; fp32 dots only.

  Recursive block inversion from the diagonal up: X starts as I (the inverse of the 1×1 diagonal blocks), and
  each level turns the inverses of the b×b diagonal blocks into those of the 2b×2b blocks,
      [[P, 0], [B, Q]]⁻¹ = [[P⁻¹, 0], [−Q⁻¹ B P⁻¹, Q⁻¹]],   i.e.   X ← X − X (A_b X),
  A_b being a masked to the lower-left b×b block of every 2b×2b diagonal block. log2(C) levels of two dots;
  each level is block forward substitution, so no partial Neumann sum (whose terms can dwarf the result) is
  ever formed. The first level (b = 1, X = I) needs no dot.
  """
  c = a.shape[0]
  i, j = iota(c, 0), iota(c, 1)
  x = None
  b = 1
  while b < c:
    # (i, j) in one 2b-block, i in its second half and j in its first.
    lower_left = ((i ^ j) < 2 * b) & ((i & b) != 0) & ((j & b) == 0)
    a_b = jnp.where(lower_left, a, 0.0)
    if x is None:
      x = ones_where(i == j) - a_b
    else:
      x = x - dot(x, dot(a_b, x, precision=precision), precision=precision)
    b *= 2
  return ones_where(i == j) if x is None else x


def column(row, i, j):
  """[1, C] → [C, 1]: the row's values along sublanes (its diagonal matrix reduced over lanes)."""
  return jnp.sum(jnp.where(i == j, row, 0.0), axis=1, keepdims=True)


def masked_exp(diff, mask):
  """e^diff where mask, else 0, with the exponent masked before exp (so ≤ 1 for the causal pairs)."""
  return jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)


def channel_scores(x_ref, y_ref, g_ref, *, strict: bool, sub: int, mm=F32, precision=HIGHEST):
  """M_ij = Σ_c x_ic y_jc e^{G_ic − G_jc} for j < i (strict) or j ≤ i, else 0: [C, C] fp32, for one chunk's
  x, y [C, K] and per-channel G [C, K] (inclusive cumsum, non-increasing along the rows) read from refs.

  Pairs within one s×s diagonal sub-block (s = min(sub, C)) are formed pairwise, one sub-diagonal offset d at a
  time: y and G rolled down by d rows meet the rows they pair with, the exponent G_i − G_{i−d} ≤ 0 masked before
  exp, and the product reduced over channels lands on the d-th sub-diagonal. Rows of sub-block a against the
  columns before it are factored through the reference row r = a·s − 1, which lies between them:
  e^{G_i − G_j} = e^{G_i − G_r} e^{G_r − G_j}, both factors ≤ 1 (the column factor's exponent is clipped at 0
  for the columns after r, which the mask drops), one [s, K] × [K, C] dot per sub-block.
  """
  c, kd = x_ref.shape
  s = min(sub, c)
  x, y, g = (r[...].astype(F32) for r in (x_ref, y_ref, g_ref))
  i, j = iota(c, 0), iota(c, 1)
  pos = lax.broadcasted_iota(jnp.int32, (c, 1), 0) & (s - 1)        # row index within its sub-block
  out = jnp.zeros((c, c), F32)
  for d in range(1 if strict else 0, s):
    shift = np.int32(d)                                              # (a Python int is int64 under x64)
    y_d, g_d = (y, g) if d == 0 else (pltpu.roll(y, shift, 0), pltpu.roll(g, shift, 0))   # row i: y, G of i − d
    ok = pos >= d
    val = jnp.sum(x * y_d * masked_exp(g - g_d, ok), axis=1, keepdims=True)         # [C, 1]
    out = out + jnp.where((j == i - d) & ok, val, 0.0)
  if c == s:
    return out
  blocks = [jnp.zeros((s, c), F32)]
  cols = lax.broadcasted_iota(jnp.int32, (s, c), 1)
  for a in range(1, c // s):
    rows = slice(a * s, (a + 1) * s)
    g_r = g_ref[a * s - 1:a * s, :].astype(F32)                       # [1, K]
    xa = x_ref[rows, :].astype(F32) * jnp.exp(g_ref[rows, :].astype(F32) - g_r)
    yc = y * jnp.exp(jnp.minimum(g_r - g, 0.0))
    blocks.append(jnp.where(cols < a * s, dot(xa.astype(mm), yc.astype(mm), tb=True, precision=precision), 0.0))
  return out + jnp.concatenate(blocks, axis=0)


def segment_flags(codes_ref, chunk):
  """Packed: whether `chunk` is the first and whether it is the last chunk of its segment (its code)."""
  code = codes_ref[chunk]
  return (code & 1) != 0, (code & 2) != 0


def _bad(x):
  """1.0 where x is NaN or ±inf, else 0.0 (fp32)."""
  return ones_where(~(jnp.abs(x.astype(F32)) < jnp.inf))


def first_fault(k, kw, v, gates_ref, ld, i, j):
  """[1, 1] fp32: the first row of the chunk whose state inputs hold a NaN or inf (k, k̃, v, β, scalar G; the
  log-decays ld [C, K]: NaN or +inf, since −inf is a gate at the floor), C where there is none (Mosaic reduces
  floats, not ints)."""
  n = k.shape[0]
  rows = [jnp.max(_bad(x), axis=1, keepdims=True) for x in (k, v) + (() if kw is None else (kw,))]
  gates = jnp.max(_bad(gates_ref[...]), axis=0, keepdims=True)                   # [1, C]: β (and G)
  rows.append(column(gates, i, j))
  if ld is not None:
    ldf = ld.astype(F32)
    rows.append(jnp.max(ones_where((ldf != ldf) | (ldf == jnp.inf)), axis=1, keepdims=True))
  bad = functools.reduce(jnp.maximum, rows)                                       # [C, 1]
  return jnp.min(jnp.where(bad > 0, _rows(n, 0), float(n)), axis=0, keepdims=True)


def _rows(n: int, axis: int):
  """Row (axis 0: [n, 1]) or column (axis 1: [1, n]) numbers as fp32."""
  return lax.broadcasted_iota(jnp.int32, (n, 1) if axis == 0 else (1, n), axis).astype(F32)


def chunk_forward(q_ref, k_ref, kw_ref, v_ref, gates_ref, ld_ref, g_ref, s, *, decay: str, sub: int, bf16_matmuls: bool,
                  sanitize: bool = False):
  """The forward's quantities of one chunk (module docstring) from its refs and the entering state s [K, BV] fp32,
  shared by the forward and the backward kernel. Per-channel decay writes G into g_ref first. With sanitize (the
  forward), the rows of the chunk from its first faulty row on (`first_fault`) are zeroed in k, k̃, v, β and the
  decays first, so that the rows before it come out as in the clean run; `first` is that row ([1, 1], C where
  there is none). Returns a namespace:
  q, k, kw, v as loaded; n (C); i, j ([C, C] iotas); beta_row [1, C], beta_col [C, 1]; strict, causal (the masked
  pair factors Γ, Γ'; decay none / scalar); eg (e^G: [C, 1] scalar, [C, K] per channel; None without decay),
  g_end (G_C: [1, 1] scalar, [1, K] per channel), ret (e^{G_C − G}); kk (K K̃ᵀ's masked pair sums, A = β kk),
  scores (P), t (T), w_in (W's right factor: K, or K ⊙ e^G per channel), w, u, v_new; lo, prec (the dots'
  operand cast and precision)."""
  exact = None if q_ref.dtype == jnp.bfloat16 else HIGHEST        # bf16 × bf16 is exact with fp32 accumulation
  mm = jnp.bfloat16 if bf16_matmuls else F32
  prec = None if bf16_matmuls else HIGHEST
  lo = lambda x: x.astype(mm)
  q, k, kw, v = q_ref[...], k_ref[...], kw_ref[...], v_ref[...]
  n = q.shape[0]
  i, j = iota(n, 0), iota(n, 1)
  beta_row = gates_ref[0:1, :]                                       # [1, C]
  ld = ld_ref[...] if decay == "channel" else None
  g_row = gates_ref[1:2, :] if decay == "scalar" else None
  first = None
  if sanitize:
    first = first_fault(k, None if kw_ref is k_ref else kw, v, gates_ref, ld, i, j)
    keep_col, keep_row = _rows(n, 0) < first, _rows(n, 1) < first
    k, kw, v = (jnp.where(keep_col, x, jnp.zeros((), x.dtype)) for x in (k, kw, v))
    beta_row = jnp.where(keep_row, beta_row, 0.0)
    ld = None if ld is None else jnp.where(keep_col, ld, jnp.zeros((), ld.dtype))
    g_row = None if g_row is None else jnp.where(keep_row, g_row, 0.0)
  beta_col = column(beta_row, i, j)                                 # [C, 1]
  strict = causal = eg = g_end = ret = None
  if decay == "channel":
    ldf = ld.astype(F32)
    g_ref[...] = dot(ones_where(i >= j), jnp.where(ldf < LOG_DECAY_FLOOR, LOG_DECAY_FLOOR, ldf),
                     precision=HIGHEST)                              # G = in-chunk inclusive cumsum (NaN stays)
    g = g_ref[...]
    g_end = g_ref[n - 1:n, :]                                        # G_C, [1, K]
    eg, ret = jnp.exp(g), jnp.exp(g_end - g)
    kk = channel_scores(k, kw, g_ref, strict=True, sub=sub)
    scores = channel_scores(q, kw, g_ref, strict=False, sub=sub, mm=mm, precision=prec)
    w_in, w_cols = k.astype(F32) * eg, beta_row
  else:
    if decay == "scalar":
      g_col = column(g_row, i, j)
      diff = g_col - g_row                                           # G_i − G_j, [C, C]
      strict, causal = masked_exp(diff, i > j), masked_exp(diff, i >= j)
      last = lax.broadcasted_iota(jnp.int32, (1, n), 1) == n - 1
      g_end = jnp.sum(jnp.where(last, g_row, 0.0), axis=1, keepdims=True)         # G_C, [1, 1]
      eg, ret = jnp.exp(g_col), jnp.exp(g_end - g_col)               # [C, 1]
      w_cols = beta_row * jnp.exp(g_row)
    else:
      strict, causal = ones_where(i > j), ones_where(i >= j)
      w_cols = beta_row
    kk = dot(k, kw, tb=True, precision=exact) * strict
    scores = dot(q, kw, tb=True, precision=exact) * causal
    w_in = k
  t = unit_lower_inverse(beta_col * kk)
  w = dot(lo(t * w_cols), lo(w_in), precision=prec)                  # [C, K]
  u = dot(lo(t * beta_row), lo(v), precision=prec)                  # [C, BV]
  v_new = u - dot(lo(w), lo(s), precision=prec)
  return types.SimpleNamespace(q=q, k=k, kw=kw, v=v, n=n, i=i, j=j, first=first, beta_row=beta_row,
                               beta_col=beta_col, strict=strict, causal=causal, eg=eg, g_end=g_end, ret=ret, kk=kk,
                               scores=scores, t=t, w_in=w_in, w=w, u=u, v_new=v_new, lo=lo, prec=prec)


def _kernel(*refs, decay: str, same_keys: bool, has_s0: bool, scale: float, bf16_matmuls: bool, num_chunks: int,
            sub: int, save_states: bool, packed: bool):
  """One grid step (b, h, j, c). refs: [packed: the chunk codes (SMEM)]; q, k, [k_write], v [C, ·]; the gates
  [1 or 2, C] (β, and G with scalar decay); [log-decays [C, K] with channel decay]; [S0 [K, BV]: packed, the
  chunk's segment's]; outputs o [C, BV], S_T [K, BV], [the state entering the chunk [K, BV] with save_states];
  scratch S [K, BV] fp32 and, with channel decay, G [C, K] fp32. Packed, the state restarts from the segment's S0
  at its first chunk and is stored as its S_T at its last."""
  it = iter(refs)
  codes_ref = next(it) if packed else None
  q_ref, k_ref = next(it), next(it)
  kw_ref = k_ref if same_keys else next(it)
  v_ref, gates_ref = next(it), next(it)
  ld_ref = next(it) if decay == "channel" else None
  s0_ref = next(it) if has_s0 else None
  o_ref, st_ref = next(it), next(it)
  states_ref = next(it) if save_states else None
  s_ref = next(it)
  g_ref = next(it) if decay == "channel" else None
  c = pl.program_id(3)
  starts, ends = segment_flags(codes_ref, c) if packed else (c == 0, c == num_chunks - 1)

  @pl.when(c == 0)
  def _():
    s_ref[...] = jnp.zeros(s_ref.shape, F32)

  if has_s0:
    @pl.when(starts)
    def _():
      s_ref[...] = s0_ref[...].astype(F32)

  s = s_ref[...]
  if save_states:
    states_ref[...] = s
  f = chunk_forward(q_ref, k_ref, kw_ref, v_ref, gates_ref, ld_ref, g_ref, s, decay=decay, sub=sub, bf16_matmuls=bf16_matmuls,
                    sanitize=True)
  q, kw, v_new, lo, prec, kd = f.q, f.kw, f.v_new, f.lo, f.prec, f.k.shape[1]
  nan = jnp.asarray(np.nan, F32)

  if decay == "channel":
    inter = dot(lo(q.astype(F32) * f.eg), lo(s), precision=prec)
  else:
    inter = dot(lo(q), lo(s), precision=prec)
    if decay == "scalar":
      inter = f.eg * inter
  o = inter + dot(lo(f.scores), lo(v_new), precision=prec)
  # From a fault on, the chunk's rows and the state are non-finite, as in the oracle; the rows before it are
  # the clean run's, since the chunk was solved with the fault's row and those after it zeroed.
  o = jnp.where(_rows(f.n, 0) < f.first, o, nan)
  o_ref[...] = (scale * o).astype(o_ref.dtype)

  if decay == "channel":
    s = jnp.exp(column(f.g_end, iota(kd, 0), iota(kd, 1))) * s    # rows of S by e^{G_C}
    kw = kw.astype(F32) * f.ret
  elif decay == "scalar":
    s = jnp.exp(f.g_end) * s
    v_new = f.ret * v_new
  s = s + dot(lo(kw), lo(v_new), ta=True, precision=prec)
  s = jnp.where(f.first < f.n, nan, s)
  s_ref[...] = s

  @pl.when(ends)
  def _():
    st_ref[...] = s


def grid_spec(lay: Layout, in_specs, out_specs, scratch):
  """The launch's grid, blocks and VMEM scratch; packed, the chunk codes are prefetched into SMEM."""
  return pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1 if lay.packed else 0, grid=lay.grid,
                                      in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch)


def _cost(lay: Layout, decay: str, sub: int, args, out_bytes: int):
  """XLA's estimate of the launch (it schedules around the custom call by it): dots, exps, bytes moved."""
  c, kd, bv = lay.chunk, lay.key_dim, lay.block_v
  levels = max(c.bit_length() - 2, 0)                      # dot levels of `unit_lower_inverse`
  per_step = 2 * c * c * (2 * kd + bv) + 4 * levels * c ** 3 + 2 * c * kd * bv * 3 + 2 * c * c * (kd + bv)
  exps = 2 * c * c
  if decay == "channel":                                   # two score matrices: pairwise bands, row factors
    s = min(sub, c)
    per_step += 2 * (3 * s * c * kd)
    exps = 2 * (s + c // s) * c * kd + 3 * c * kd
  steps = lay.batch * lay.value_heads * lay.num_v * lay.num_chunks
  in_bytes = sum(x.size * x.dtype.itemsize for x in args)
  return pl.CostEstimate(flops=int(steps * per_step), transcendentals=int(steps * exps),
                         bytes_accessed=int(in_bytes + out_bytes))


def forward_call(lay: Layout, q, k, kw, v, beta, G, S0, codes=None, *, scale: float, bf16_matmuls: bool, interpret: bool,
                 sub: int = 16, vmem_limit_bytes=None, save_states: bool = False):
  """The pallas_call on prepared arrays. q, k [B, T, H, K]; kw None or [B, T, H | HV, K]; v [B, T, HV, V]
  (T, K, V padded, one dtype); beta [B, HV, T] fp32; G None (no decay), [B, HV, T] (scalar: the in-chunk
  cumsum) or [B, T, HV, K] (per channel: the log-decays themselves, any float dtype); S0 None or [B, HV, K, V]
  fp32; sub: the pairwise sub-block of per-channel decay. Packed (lay.packed; B = 1): codes [NC] int32, the chunk
  codes of `pallas_kernels.packed.chunk_aligned`, and S0 [N, HV, K, V] (required); S_T is then [N, HV, K, V],
  with the rows of segments without tokens unspecified.
  → (o [B, T, HV, V] in q.dtype, S_T [B, HV, K, V] fp32), and with save_states the state entering each chunk,
  [B, HV, NC, K, V] fp32 (what the backward reads)."""
  same_keys = kw is None
  in_specs = [lay.key_spec(lay.heads), lay.key_spec(lay.heads)]
  args = [lay.tokens_in(q), lay.tokens_in(k)]
  if not same_keys:
    in_specs.append(lay.key_spec(lay.kw_heads))
    args.append(lay.tokens_in(kw))
  decay = "none" if G is None else ("scalar" if G.ndim == 3 else "channel")
  gates = jnp.stack([beta, G], axis=2) if decay == "scalar" else beta[:, :, None]
  in_specs += [lay.value_spec(), lay.gates_spec(gates.shape[2])]
  args += [lay.tokens_in(v), lay.gates(gates)]
  if decay == "channel":
    in_specs.append(lay.key_spec(lay.value_heads))
    args.append(lay.tokens_in(G))
  state_spec = lay.segment_state_spec() if lay.packed else lay.state_spec()
  if S0 is not None:
    in_specs.append(state_spec)
    args.append(S0)
  kernel = functools.partial(_kernel, decay=decay, same_keys=same_keys, has_s0=S0 is not None, scale=scale,
                             bf16_matmuls=bf16_matmuls, num_chunks=lay.num_chunks, sub=sub, save_states=save_states,
                             packed=lay.packed)
  rows = S0.shape[0] if lay.packed else lay.batch
  state_shape = (rows, lay.value_heads, lay.key_dim, lay.value_dim)
  out_shape = [jax.ShapeDtypeStruct(lay.output_shape(), q.dtype), jax.ShapeDtypeStruct(state_shape, F32)]
  out_specs = [lay.value_spec(), state_spec]
  if save_states:
    out_shape.append(jax.ShapeDtypeStruct((lay.batch, lay.value_heads, lay.num_chunks, lay.key_dim, lay.value_dim),
                                          F32))
    out_specs.append(lay.chunk_states_spec())
  out_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in out_shape)
  scratch = [pltpu.VMEM((lay.key_dim, lay.block_v), F32)]
  scratch += [pltpu.VMEM((lay.chunk, lay.key_dim), F32)] if decay == "channel" else []
  outs = pl.pallas_call(
      kernel, out_shape=out_shape, grid_spec=grid_spec(lay, in_specs, out_specs, scratch),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=vmem_limit_bytes),
      cost_estimate=_cost(lay, decay, sub, args, out_bytes), interpret=interpret_mode(interpret),
      name="delta_rule_fwd_tpu")(*([codes] if lay.packed else []), *args)
  return (lay.tokens_out(outs[0]),) + tuple(outs[1:])
