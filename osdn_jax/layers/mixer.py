"""The DGPS token mixer: one Flax NNX module for every point of the registry (`osdn_jax.dgps`).

    q, k, v = SiLU(ShortConv(W_q x, W_k x, W_v x))      q, k [B, T, H, K], v [B, T, HV, V]
    features = {axis: {name: W_name x}}                 what the point asks for: β logit, decay, PDN gates, APF r
    o = point(q, k, v, features, point_params)          [B, T, HV, V] (the point L2-normalises q and k itself)
    y = W_o (RMSNorm_V(o) [⊙ act(W_g x) when gated: σ for the KDA family by default])

What differs between DN, GDN, KDA, PDN, OSDN, LA, Mamba-2, GLA, ... is the point (its features, parameters and
solve), never the module.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from osdn_jax import dgps, diagnostics
from osdn_jax.dgps import checks
from osdn_jax.layers import sharding
from osdn_jax.layers.conv import ShortConv
from osdn_jax.layers.norms import RMSNorm
from osdn_jax.ops import dispatch

COMPUTE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
CHUNK_SIZES = (16, 32, 64, 128)


def positive(owner: str, **fields) -> None:
  """Raises a ValueError (prefixed by `owner`, e.g. "ModelConfig") unless each of `fields` is None or a positive
  int (not a bool)."""
  for name, value in fields.items():
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
      raise ValueError(f"{owner}: `{name}` must be a positive int, got {value!r}")


def check_heads(owner: str, *, d_model, num_heads, head_dim=None, num_value_heads=None, value_head_dim=None):
  """Validates the head layout; returns (H, K, HV, V). `owner` prefixes the messages (e.g. "ModelConfig")."""
  positive(owner, d_model=d_model, num_heads=num_heads, head_dim=head_dim, num_value_heads=num_value_heads,
           value_head_dim=value_head_dim)
  if head_dim is None and d_model % num_heads:
    raise ValueError(f"{owner}: `num_heads` ({num_heads}) must divide `d_model` ({d_model}) when `head_dim` "
                     "is not given")
  key_dim = head_dim or d_model // num_heads
  value_heads = num_value_heads or num_heads
  if value_heads % num_heads:
    raise ValueError(f"{owner}: `num_value_heads` ({value_heads}) must be a multiple of `num_heads` "
                     f"({num_heads}) (grouped value heads: value head i reads key head i // g)")
  return num_heads, key_dim, value_heads, value_head_dim or key_dim


def check_dtype(owner: str, dtype) -> None:
  try:
    ok = any(jnp.dtype(dtype) == jnp.dtype(d) for d in COMPUTE_DTYPES)
  except TypeError:
    ok = False
  if not ok:
    raise ValueError(f"{owner}: `dtype` must be one of float32, bfloat16, float16, got {dtype!r}")


def check_options(owner: str, *, output_gate, norm_eps, implementation, **positive) -> None:
  """The mixer's non-structural options: output_gate None or a bool, norm_eps and each of `positive` (e.g.
  out_init_scale) finite and > 0, implementation one of `ops.dispatch.IMPLEMENTATIONS` (or "naive")."""
  if output_gate is not None and not isinstance(output_gate, (bool, np.bool_)):
    raise ValueError(f"{owner}: `output_gate` must be None or a bool, got {output_gate!r}")
  for name, value in dict(norm_eps=norm_eps, **positive).items():
    checks.number(owner, name, value, low=0.0, low_open=True)
  if not isinstance(implementation, str):
    raise ValueError(f"{owner}: `implementation` must be a str, got {implementation!r}")
  dispatch.normalize(owner, implementation)


GATE_ACTIVATIONS = {"sigmoid": jax.nn.sigmoid, "swish": jax.nn.silu}


def check_gate_activation(owner: str, activation) -> None:
  if not isinstance(activation, str) or activation not in GATE_ACTIVATIONS:
    raise ValueError(f"{owner}: `output_gate_activation` must be one of {', '.join(GATE_ACTIVATIONS)}, got "
                     f"{activation!r}")


def is_kda_family(point: dgps.Point) -> bool:
  """The online points with a per-channel decay (kda, pkda, osdn-kda, osdn-apf-kda): gated output."""
  return point.channel_decay and point.online


@dataclasses.dataclass(frozen=True)
class MixerConfig:
  """One mixer's configuration.

  point: a `dgps.Point` or a registry name. H = num_heads key heads of size K = head_dim (default D // H);
  HV = num_value_heads (default H, a multiple of H) value heads of size V = value_head_dim (default K).
  conv_size: the short convolution's kernel. gate_rank: the rank of low-rank feature projections (KDA's
  per-channel decay). output_gate: act(W_g x) on the normalised output (default: the KDA family only), act
  `output_gate_activation` ("sigmoid": σ(g); "swish": g·σ(g)); output_gate_rank: None (W_g one D × HV·V matrix,
  no bias) or r (W_g = D → r → HV·V, a bias on the second map: FLA's KDA gate).
  dtype: compute dtype of activations and matmuls; parameters stay fp32, gates and states fp32.
  out_init_scale: the output projection's init std multiplier (e.g. 1/√(2L) in a residual stack).
  norm_eps and out_init_scale are finite and > 0; the point's options are checked when the point is built.
  """
  point: Any
  d_model: int
  num_heads: int
  head_dim: int | None = None
  num_value_heads: int | None = None
  value_head_dim: int | None = None
  conv_size: int = 4
  gate_rank: int = 16
  output_gate: bool | None = None
  norm_eps: float = 1e-6
  chunk_size: int = 64
  implementation: str = "auto"
  dtype: Any = jnp.float32
  out_init_scale: float = 1.0
  output_gate_activation: str = "sigmoid"
  output_gate_rank: int | None = None

  def __post_init__(self):
    if isinstance(self.point, str):
      try:
        object.__setattr__(self, "point", dgps.get(self.point))
      except ValueError as e:
        raise ValueError(f"MixerConfig: unknown `point` {self.point!r}; known: {', '.join(dgps.names())}") from e
    if not isinstance(self.point, dgps.Point):
      raise ValueError(f"MixerConfig: `point` must be a dgps.Point or a registry name, got {self.point!r}")
    check_heads("MixerConfig", d_model=self.d_model, num_heads=self.num_heads, head_dim=self.head_dim,
                num_value_heads=self.num_value_heads, value_head_dim=self.value_head_dim)
    positive("MixerConfig", conv_size=self.conv_size, gate_rank=self.gate_rank,
             output_gate_rank=self.output_gate_rank)
    check_gate_activation("MixerConfig", self.output_gate_activation)
    if self.chunk_size not in CHUNK_SIZES:
      raise ValueError(f"MixerConfig: `chunk_size` must be one of {CHUNK_SIZES}, got {self.chunk_size!r}")
    check_dtype("MixerConfig", self.dtype)
    check_options("MixerConfig", output_gate=self.output_gate, norm_eps=self.norm_eps,
                  implementation=self.implementation, out_init_scale=self.out_init_scale)

  @property
  def dims(self) -> dgps.Dims:
    h, k, hv, v = check_heads("MixerConfig", d_model=self.d_model, num_heads=self.num_heads,
                              head_dim=self.head_dim, num_value_heads=self.num_value_heads,
                              value_head_dim=self.value_head_dim)
    return dgps.Dims(heads=h, value_heads=hv, key_dim=k, value_dim=v)

  @property
  def gated(self) -> bool:
    return is_kda_family(self.point) if self.output_gate is None else bool(self.output_gate)


class LayerCache(NamedTuple):
  """A mixer's decoding state for B sequences.

  S [B, HV, K, V] fp32 (the solve's state); precond: the preconditioner's state (PDN/ATQ second moment
  [B, H, K], OSDN write scale [B, HV, K]) or None; conv [B, W−1, 2·H·K + HV·V]: the short convolution's
  last W − 1 inputs (in the compute dtype).
  """
  S: jax.Array
  precond: Any
  conv: jax.Array


class FeatureProjection(nnx.Module):
  """x [..., D] → [..., *shape]: a Linear map, or D → rank → prod(shape) when low_rank (as KDA's gate).

  The bias (on the last map) exists only when `bias` is not None and starts at that constant.
  """

  def __init__(self, d_model: int, shape: tuple[int, ...], *, bias: float | None, low_rank: bool, rank: int,
               dtype, rngs: nnx.Rngs):
    self.shape = tuple(shape)
    out = math.prod(shape)
    lin = lambda i, o, b: nnx.Linear(i, o, use_bias=b is not None, dtype=dtype, rngs=rngs,
                                     bias_init=nnx.initializers.constant(0.0 if b is None else b))
    self.down = lin(d_model, rank, None) if low_rank else None
    self.proj = lin(rank if low_rank else d_model, out, bias)

  def __call__(self, x):
    h = x if self.down is None else self.down(x)
    return self.proj(h).reshape(x.shape[:-1] + self.shape)


def _values(tree):
  return jax.tree.map(lambda p: p[...], tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


class DGPSMixer(nnx.Module):
  """The token mixer of every DGPS point; see the module doc.

  Parameters: q_proj, k_proj [D, H·K], v_proj [D, HV·V], conv [W, 2·H·K + HV·V], one FeatureProjection per
  feature of the point under features[axis][name], the point's own parameters under point_params[axis][name]
  (e.g. A_log, dt_bias, PDN's center), o_norm [V], g_proj when gated ([D, HV·V], or a FeatureProjection
  D → r → HV·V with a bias when `output_gate_rank` is r), o_proj [HV·V, D].
  """

  def __init__(self, cfg: MixerConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dims = cfg.dims
    d, h, k, hv, v = cfg.d_model, dims.heads, dims.key_dim, dims.value_heads, dims.value_dim
    lin = lambda i, o, **kw: nnx.Linear(i, o, use_bias=False, dtype=cfg.dtype, rngs=rngs, **kw)
    self.q_proj, self.k_proj, self.v_proj = lin(d, h * k), lin(d, h * k), lin(d, hv * v)
    self.conv = ShortConv(2 * h * k + hv * v, cfg.conv_size, dtype=cfg.dtype, rngs=rngs)
    self.features = nnx.Dict({
        axis: nnx.Dict({name: FeatureProjection(d, f.resolve(dims), bias=f.bias, low_rank=f.low_rank,
                                                rank=cfg.gate_rank, dtype=cfg.dtype, rngs=rngs)
                        for name, f in fs.items()})
        for axis, fs in cfg.point.features().items() if fs})
    params = cfg.point.init_params(rngs.params(), dims)
    self.point_params = nnx.data(jax.tree.map(lambda p: nnx.Param(jnp.asarray(p, jnp.float32)), params))
    self.o_norm = RMSNorm(v, eps=cfg.norm_eps)
    if cfg.gated and cfg.output_gate_rank is not None:
      self.g_proj = FeatureProjection(d, (hv * v,), bias=0.0, low_rank=True, rank=cfg.output_gate_rank,
                                      dtype=cfg.dtype, rngs=rngs)
    else:
      self.g_proj = lin(d, hv * v) if cfg.gated else None
    self.o_proj = lin(hv * v, d, kernel_init=nnx.initializers.variance_scaling(
        cfg.out_init_scale ** 2, "fan_in", "truncated_normal"))

  # -- pieces shared by the sequence forward and the one-token step --------------------------------------
  def _qkv(self, x):
    return jnp.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)

  def _split_heads(self, qkv):
    dims = self.cfg.dims
    hk = dims.heads * dims.key_dim
    lead = qkv.shape[:-1]
    q = qkv[..., :hk].reshape(lead + (dims.heads, dims.key_dim))
    k = qkv[..., hk:2 * hk].reshape(lead + (dims.heads, dims.key_dim))
    v = qkv[..., 2 * hk:].reshape(lead + (dims.value_heads, dims.value_dim))
    return q, k, v

  def _features(self, x):
    """The point's per-token features from x [..., D], in fp32 (gates are computed in fp32)."""
    return {axis: {name: proj(x).astype(jnp.float32) for name, proj in fs.items()}
            for axis, fs in self.features.items()}

  def _projected(self, x):
    """x [B, T, D] (the zero conv state) → (q, k, v, features) as the sequence forward projects them."""
    qkv, _ = self.conv(self._qkv(x))
    q, k, v = self._split_heads(jax.nn.silu(qkv))
    return q, k, v, self._features(x)

  def _output(self, o, x):
    """o [..., HV, V] → head-wise RMSNorm (⊙ act(W_g x) when gated) → W_o → [..., D]."""
    y = self.o_norm(o.astype(jnp.float32))
    if self.g_proj is not None:
      act = GATE_ACTIVATIONS[self.cfg.output_gate_activation]
      y = y * act(self.g_proj(x).astype(jnp.float32).reshape(o.shape))
    return self.o_proj(y.reshape(o.shape[:-2] + (-1,)).astype(self.cfg.dtype))

  def _solve(self, q, k, v, features, *, segment_ids, state, return_cache, segments_per_row=None):
    """The point's solve; under a mesh context (`layers.sharding`) a training forward runs per shard.

    segments_per_row: a static bound on the segments in any row of `segment_ids`: with it the solve sees N =
    rows × bound (zero initial states), so the kernels that need N static run on traced segment_ids."""
    cfg = self.cfg
    params = _values(self.point_params)
    dims = cfg.dims

    def run(q, k, v, f, p, seg, context=None):
      st = state
      if seg is not None and segments_per_row and st is None:
        st = {"S": jnp.zeros((q.shape[0] * segments_per_row, v.shape[2], k.shape[3], v.shape[3]), jnp.float32)}
      return cfg.point(q, k, v, f, p, state=st, output_final_state=return_cache, chunk_size=cfg.chunk_size,
                       segment_ids=seg, implementation=cfg.implementation, context=context)

    mesh = sharding.context_mesh()
    if mesh is None or state is not None or return_cache:
      return run(q, k, v, features, params, segment_ids)
    sharding.check_divisible(mesh, batch=q.shape[0], heads=dims.heads, value_heads=dims.value_heads,
                             length=q.shape[1], owner="DGPSMixer")
    if sharding.context_axis(mesh) and segment_ids is not None and not segments_per_row:
      raise ValueError("DGPSMixer: context parallelism with `segment_ids` needs `segments_per_row` (N static)")
    solve = lambda tokens, p, seg, context: run(*tokens, p, seg, context)[0]
    return sharding.shard_solve(solve, mesh, (q, k, v, features), params, segment_ids), None

  # -- public ---------------------------------------------------------------------------------------------
  def __call__(self, x, *, segment_ids=None, cache: LayerCache | None = None, return_cache: bool = False,
               segments_per_row: int | None = None):
    """x [B, T, D] → y [B, T, D] in the compute dtype (and the cache after the last token if return_cache).

    segment_ids: None or [B, T] packed sequences (nothing crosses a segment start: not the short conv, not the
      solve); not combined with a cache. segments_per_row: None or a static bound on the segments in any row
      (lets the Pallas kernels run on traced segment_ids; `_solve`). cache: the state before x (a previous
      prefill or step), default the zero state. Under `jax.set_mesh` (a training step) the solve runs under
      `shard_map` (`layers.sharding`).
    """
    cfg = self.cfg
    if segment_ids is not None and (cache is not None or return_cache):
      raise ValueError("DGPSMixer: `segment_ids` (packed sequences) cannot be combined with `cache` or "
                       "`return_cache`; prefill each sequence in its own batch row instead")
    x = x.astype(cfg.dtype)
    qkv = checkpoint_name(self._qkv(x), "mixer_qkv")
    qkv, tail = self.conv(qkv, tail=None if cache is None else cache.conv, segment_ids=segment_ids)
    q, k, v = self._split_heads(jax.nn.silu(qkv))
    state = None if cache is None else {"S": cache.S, "precond": cache.precond}
    o, final = self._solve(q, k, v, self._features(x), segment_ids=segment_ids, state=state,
                           return_cache=return_cache, segments_per_row=segments_per_row)
    y = self._output(checkpoint_name(o, "solve_out"), x)
    return (y, LayerCache(final["S"], final["precond"], tail)) if return_cache else y

  def diagnostics(self, x, weights=None):
    """What the write does to the state, on x [B, T, D] from the zero state, as fp32 scalars: "q_geo", the
    geometric mean of the residual contraction ρ_t = (1 − β_t⟨k_t, k̃_t⟩)² over tokens and heads (NaN for the
    offline solves, which have no residual); "state_norm", the mean over rows and value heads of ‖S_T‖_F;
    "recall_residual", the mean relative residual ‖S_Tᵀk_t − v_t‖² / ‖v_t‖² of the final state on the pairs
    (k_t, v_t) it was given, over the positions with weights [B, T] > 0 (default: all), weighted."""
    cfg = self.cfg
    x = x.astype(cfg.dtype)
    q, k, v, features = self._projected(x)
    prep = cfg.point.prepare(q, k, v, features, _values(self.point_params), implementation=cfg.implementation)
    _, final = self._solve(q, k, v, features, segment_ids=None, state=None, return_cache=True)
    f32 = lambda a: None if a is None else a.astype(jnp.float32)
    S = f32(final["S"])
    state_norm = jnp.mean(jnp.sqrt(jnp.sum(jnp.square(S), axis=(-2, -1))))
    w = jnp.ones(x.shape[:2], jnp.float32) if weights is None else jnp.asarray(weights, jnp.float32)
    per_row = diagnostics.recall_residual(S, f32(prep["k"]), f32(prep["v"]), weights=w)       # [B, HV]
    rows = jnp.sum(w, axis=1) > 0
    recall = jnp.sum(jnp.where(rows[:, None], per_row, 0.0)) / jnp.maximum(jnp.sum(rows) * per_row.shape[1], 1)
    out = {"state_norm": state_norm, "recall_residual": recall.astype(jnp.float32)}
    if prep["beta"] is None or not cfg.point.online:
      return {"q_geo": jnp.float32(jnp.nan), **out}
    rho = diagnostics.rho_closed_form(f32(prep["k"]), f32(prep["beta"]), f32(prep["k_write"]))
    return {"q_geo": diagnostics.q_geo(rho).astype(jnp.float32), **out}

  def solve_inputs(self, x) -> dict:
    """What the point hands its solve on x [B, T, D] from the zero state, computed as the sequence forward does:
    `Point.prepare`'s dict (q, k normalised [B, T, H, K], v [B, T, HV, V], beta, log_decay, k_write, q_tilde,
    precond_state) and the projected features under "features" ({axis: {name: [B, T, ...]}}, fp32)."""
    cfg = self.cfg
    q, k, v, features = self._projected(x.astype(cfg.dtype))
    prep = cfg.point.prepare(q, k, v, features, _values(self.point_params), implementation=cfg.implementation)
    return dict(prep, features=features)

  def step(self, x, cache: LayerCache):
    """One token for decoding: x [B, D], cache from `__call__(..., return_cache=True)` or a previous step.

    Returns (y [B, D], the new cache). Equals the sequence forward token by token (`Point.step`). ValueError
    naming `cache` when it holds another number of sequences than x's B (`Point.step` checks its states).
    """
    if any(np.shape(getattr(cache, f))[:1] != np.shape(x)[:1] for f in ("S", "conv")):
      raise ValueError(f"DGPSMixer.step: `cache` must hold B = {np.shape(x)[0]} sequences (x's rows), got "
                       f"`cache.S` of shape {np.shape(cache.S)} and `cache.conv` of shape {np.shape(cache.conv)}")
    x = x.astype(self.cfg.dtype)
    qkv, tail = self.conv.step(self._qkv(x), cache.conv)
    q, k, v = self._split_heads(jax.nn.silu(qkv))
    o, state = self.cfg.point.step(q, k, v, self._features(x), _values(self.point_params),
                                   {"S": cache.S, "precond": cache.precond})
    return self._output(o, x), LayerCache(state["S"], state["precond"], tail)
