"""The decoder-only language model: a stack of pre-norm [DGPS mixer, SwiGLU] blocks, tied embeddings by default."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from osdn_jax import checking
from osdn_jax.layers import DGPSMixer, LayerCache, RMSNorm, SwiGLU
from osdn_jax.models.config import REMAT_POLICIES, ModelConfig, config

# The decoding state of the whole stack: a LayerCache whose leaves carry a leading layer axis [L, B, ...].
Cache = LayerCache


def check_ids(tokens, vocab_size: int, *, where: str, name: str, rank: int = 2):
  """tokens as an integer array of `rank` dims ([B, T] or [B]), checked: ValueError naming `where` and `name`
  for another rank, a non-integer dtype, or a concrete id outside [0, vocab_size) (its position and value).
  Returns (tokens as a jax array, its concrete values as numpy or None when traced)."""
  values = checking.concrete(tokens)
  tokens = jnp.asarray(tokens)
  shape = "[B, T]" if rank == 2 else "[B]"
  if tokens.ndim != rank or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"{where}: `{name}` must be an integer array {shape}, got shape {tuple(tokens.shape)} "
                     f"{tokens.dtype}")
  if values is not None:
    bad = (values < 0) | (values >= vocab_size)
    if bad.any():
      at = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(f"{where}: `{name}`[{', '.join(map(str, at))}] = {int(values[at])} is outside the "
                       f"vocabulary [0, {vocab_size})")
  return tokens, values


class Block(nnx.Module):
  """h = x + mixer(RMSNorm(x)); y = h + MLP(RMSNorm(h)). The residual stream x [B, T, D] stays fp32."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.mixer_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=cfg.dtype)
    self.mixer = DGPSMixer(cfg.mixer, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=cfg.dtype)
    self.mlp = SwiGLU(cfg.d_model, cfg.hidden, dtype=cfg.dtype, out_init_scale=(2 * cfg.num_layers) ** -0.5,
                      rngs=rngs)

  def _mlp(self, h):
    return h + self.mlp(self.mlp_norm(h)).astype(h.dtype)

  def __call__(self, x, *, segment_ids=None, cache=None, return_cache=False, segments_per_row=None):
    """x [B, T, D] → [B, T, D] (and the mixer's LayerCache when return_cache); see `DGPSMixer.__call__`."""
    out = self.mixer(self.mixer_norm(x), segment_ids=segment_ids, cache=cache, return_cache=return_cache,
                     segments_per_row=segments_per_row)
    y, new_cache = out if return_cache else (out, None)
    h = self._mlp(x + y.astype(x.dtype))
    return (h, new_cache) if return_cache else h

  def step(self, x, cache: LayerCache):
    """x [B, D] one token; returns (y [B, D], new cache)."""
    y, cache = self.mixer.step(self.mixer_norm(x), cache)
    return self._mlp(x + y.astype(x.dtype)), cache


class LanguageModel(nnx.Module):
  """Token ids [B, T] → next-token logits [B, T, vocab] (fp32).

  embed [vocab, D] (init N(0, init_std²)) is also the output head, unless `cfg.tie_embeddings` is False: then
  head [vocab, D] (same init) is (`output_head`); blocks: L `Block`s stored stacked (every
  parameter has a leading layer axis [L, ...]) and applied with `lax.scan`, so a step compiles one block
  whatever L (or unrolled: `ModelConfig.scan_layers`); final_norm [D].

  Token ids are checked: a ValueError naming the argument for a wrong rank or dtype or (concrete ids) the first
  position and value outside [0, vocab). Traced ids (under jit) are checked in checked mode (`osdn_jax.checking`);
  otherwise an id outside the vocabulary embeds as NaN at its own position.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Param(nnx.initializers.normal(cfg.init_std)(rngs.params(), (cfg.vocab_size, cfg.d_model),
                                                                 jnp.float32))
    self.head = None if cfg.tie_embeddings else nnx.Param(
        nnx.initializers.normal(cfg.init_std)(rngs.params(), (cfg.vocab_size, cfg.d_model), jnp.float32))

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):
      return Block(cfg, rngs=rngs)

    self.blocks = make_blocks(rngs)
    self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=cfg.dtype)

  def _scan_blocks(self, fn, x, per_layer, *, remat: bool = False):
    """x ← fn(block_l, x, per_layer[l]) for l = 0..L−1 (fn returns (x, out)); returns (x, stacked outs).

    remat: apply the config's rematerialisation policy to each block (`models.config.REMAT_POLICIES`)."""
    graphdef, params = nnx.split(self.blocks)
    body = lambda x, inp: fn(nnx.merge(graphdef, inp[0]), x, inp[1])
    if remat and self.cfg.remat != "none":
      body = jax.checkpoint(body, policy=REMAT_POLICIES[self.cfg.remat], prevent_cse=False)
    return jax.lax.scan(body, x, (params, per_layer), unroll=not self.cfg.scan_layers)

  def _embed(self, tokens, *, where: str, name: str = "tokens", rank: int = 2):
    """Token ids [B, T] (or [B]) → embeddings [B, T, D] fp32, the ids checked (`check_ids`). Traced ids are
    checked in checked mode (`checking.require`, naming the first bad position and id); otherwise an id outside
    [0, vocab) embeds as NaN at its own position."""
    vocab = self.cfg.vocab_size
    tokens, values = check_ids(tokens, vocab, where=where, name=name, rank=rank)
    valid = (tokens >= 0) & (tokens < vocab)
    if values is None and tokens.size:
      first = jnp.argmax(~valid.reshape(-1))
      at = jnp.unravel_index(first, tokens.shape)
      index = ", ".join(["{}"] * rank)
      checking.require(jnp.all(valid), f"{where}: `{name}`[{index}] = {{}} is outside the vocabulary [0, {vocab})",
                       *at, tokens.reshape(-1)[first])
    x = jnp.take(self.embed[...], tokens, axis=0, mode="clip")
    return jnp.where(valid[..., None], x, jnp.nan)

  def output_head(self):
    """The output head [vocab, D]: `embed` when tied, else `head` (logits = hidden · headᵀ)."""
    return (self.embed if self.head is None else self.head)[...]

  def _logits(self, x):
    h = self.final_norm(x)
    return jnp.einsum("...d,vd->...v", h, self.output_head().astype(h.dtype)).astype(jnp.float32)

  def hidden(self, tokens, *, segment_ids=None, segments_per_row=None):
    """tokens [B, T] → the final-normed hidden states [B, T, D] in the compute dtype (what the head reads:
    logits = hidden · `output_head()`ᵀ). Blocks run under the config's rematerialisation policy (training).
    segments_per_row: a static bound on the segments in a row of segment_ids (`DGPSMixer.__call__`)."""
    layer = lambda block, x, _: (block(x, segment_ids=segment_ids, segments_per_row=segments_per_row), None)
    x, _ = self._scan_blocks(layer, self._embed(tokens, where="LanguageModel.hidden"), None, remat=True)
    return self.final_norm(x)

  def diagnostics(self, tokens, weights=None):
    """Per-layer write diagnostics on tokens [B, T] (each sequence from the zero state): {"q_geo": [L],
    "state_norm": [L], "recall_residual": [L]} (`DGPSMixer.diagnostics`; the input of layer l is the residual
    stream the model gives it; weights [B, T] selects the pairs of the recall residual, default all)."""
    return self._map_mixers(tokens, lambda mixer, x: mixer.diagnostics(x, weights), "LanguageModel.diagnostics")

  def map_mixers(self, tokens, fn):
    """fn(mixer, x) for every layer's mixer, x [B, T, D] the input the model gives it on tokens [B, T] (after the
    block's norm; each sequence from the zero state); fn's outputs stacked on a leading layer axis [L, ...]."""
    return self._map_mixers(tokens, fn, "LanguageModel.map_mixers")

  def _map_mixers(self, tokens, fn, where: str):
    def layer(block, x, _):
      return block(x), fn(block.mixer, block.mixer_norm(x))

    _, out = self._scan_blocks(layer, self._embed(tokens, where=where), None)
    return out

  def __call__(self, tokens, *, segment_ids=None, cache: Cache | None = None, return_cache: bool = False):
    """tokens [B, T] int; segment_ids None or [B, T] (packed sequences; not with a cache).

    cache: the state after a previous call (continues those sequences); return_cache: also return the state
    after the last token, for `step` (prefill). Returns logits [B, T, vocab] fp32 (and the cache).
    """
    def layer(block, x, c):
      out = block(x, segment_ids=segment_ids, cache=c, return_cache=return_cache)
      return out if return_cache else (out, None)

    x = self._embed(tokens, where="LanguageModel")
    x, new_cache = self._scan_blocks(layer, x, cache)
    logits = self._logits(x)
    return (logits, new_cache) if return_cache else logits

  def step(self, token, cache: Cache):
    """One token per sequence: token [B] int. Returns (logits [B, vocab] fp32, new cache)."""
    x = self._embed(token, where="LanguageModel.step", name="token", rank=1)
    x, cache = self._scan_blocks(lambda block, x, c: block.step(x, c), x, cache)
    return self._logits(x), cache


def build(cfg: ModelConfig | str, *, rngs: nnx.Rngs | None = None, **overrides) -> LanguageModel:
  """A LanguageModel from a config or a config name ("pgdn-340m"), with optional field overrides."""
  if isinstance(cfg, str):
    cfg = config(cfg, **overrides)
  elif overrides:
    cfg = cfg.replace(**overrides)
  return LanguageModel(cfg, rngs=rngs if rngs is not None else nnx.Rngs(0))


def param_shapes(cfg: ModelConfig | str, **overrides) -> list[tuple[tuple, jax.ShapeDtypeStruct]]:
  """[(path, ShapeDtypeStruct)] of every parameter (paths as `nnx.to_flat_state`), nothing allocated."""
  if isinstance(cfg, str):
    cfg = config(cfg, **overrides)
  elif overrides:
    cfg = cfg.replace(**overrides)
  model = nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)))
  return [(tuple(path), jax.ShapeDtypeStruct(v.shape, v.dtype))
          for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]


def count_params(model_or_cfg) -> int:
  """Total number of parameters of a model, a config or a config name (the latter two without allocation)."""
  if isinstance(model_or_cfg, nnx.Module):
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model_or_cfg, nnx.Param)))
  return sum(int(s.size) for _, s in param_shapes(model_or_cfg))
