"""Recurrent decoding: prefill with the chunked forward, then one-token steps through `Point.step`.

    logits, cache = prefill(model, prompt)                       # [B, T, vocab], per-layer states
    logits_t, cache = step(model, token, cache)                  # one token per sequence
    tokens, state = generate(model, prompt, 32)                  # greedy; temperature>0 (+ top_k) samples
    more, state = generate(model, None, 32, state=state)         # continues: equals one call of 64

All three are jitted (the model is split into its graph and state and merged inside the traced function); the
token loop of `generate` is one `lax.scan`. Arguments are validated on the host (ValueError naming the argument):
concrete token ids outside [0, vocab) by their first position and value, and a cache of another batch size, layer
count or point (`check_cache`). Traced ids (these functions called under the caller's jit) are checked when the
caller runs in checked mode (`osdn_jax.checking.checked`), and otherwise give NaN logits from the bad position
on. The cache holds, per layer, the solve's state S [B, HV, K, V], the preconditioner's state and the short
convolution's last W − 1 inputs (a `LayerCache` stacked over layers): O(1) in the context length.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from osdn_jax import checking
from osdn_jax.models.lm import Cache, LanguageModel, check_ids


class DecodeState(NamedTuple):
  """Where a generation stopped: the cache after every token so far, the next token's logits [B, vocab] and
  the number of tokens consumed (int32; it picks the sampling key of the next token)."""
  cache: Cache
  logits: jax.Array
  position: jax.Array


@functools.partial(jax.jit, static_argnums=0)
def _prefill(graphdef, params, tokens, cache):
  return nnx.merge(graphdef, params)(tokens, cache=cache, return_cache=True)


@functools.partial(jax.jit, static_argnums=0)
def _step(graphdef, params, token, cache):
  return nnx.merge(graphdef, params).step(token, cache)


def _tokens(tokens, vocab_size: int, where: str, name: str, rank: int = 2):
  """tokens checked (`lm.check_ids`; every dimension ≥ 1) as int32."""
  tokens, _ = check_ids(tokens, vocab_size, where=where, name=name, rank=rank)
  if 0 in tokens.shape:
    shape = "[B, T] with B ≥ 1 and T ≥ 1" if rank == 2 else "[B] with B ≥ 1"
    raise ValueError(f"{where}: `{name}` must be an integer array {shape}, got shape {tuple(tokens.shape)}")
  return tokens.astype(jnp.int32)


def check_cache(model: LanguageModel, cache, batch: int, where: str, name: str = "cache") -> None:
  """ValueError naming `name` unless `cache` is a decoding state of `model` for `batch` sequences: a `Cache`
  whose leaves lead with the model's L layers and B = batch rows: S [L, B, HV, K, V], precond the point's
  ([L, B, H, K] for PDN/ATQ, [L, B, HV, K] for OSDN, None for the points without a preconditioner state) and
  conv [L, B, W − 1, 2·H·K + HV·V]."""
  cfg = model.cfg
  d = cfg.mixer.dims
  if not isinstance(cache, Cache):
    raise ValueError(f"{where}: `{name}` must be a models.Cache (from `prefill` or `step`), got "
                     f"{type(cache).__name__}")
  fresh = jax.eval_shape(lambda: cfg.point.initial_state(batch, d))     # one layer's state, nothing allocated
  stacked = lambda x: None if x is None else (cfg.num_layers,) + tuple(x.shape)
  lead = (cfg.num_layers, batch)
  want = dict(S=stacked(fresh["S"]), precond=stacked(fresh["precond"]),
              conv=lead + (cfg.conv_size - 1, 2 * d.heads * d.key_dim + d.value_heads * d.value_dim))
  got = {f: None if getattr(cache, f) is None else tuple(np.shape(getattr(cache, f))) for f in want}
  if got["S"] is not None and len(got["S"]) == 5 and got["S"][:2] != lead:
    layers, rows = got["S"][:2]
    what = (f"{layers} layers, the model has {cfg.num_layers}" if layers != cfg.num_layers else
            f"{rows} sequences, the input has {batch}")
    raise ValueError(f"{where}: `{name}` holds {what} (`{name}.S` must be [L, B, HV, K, V] = {want['S']}, got "
                     f"{got['S']})")
  if (want["precond"] is None) != (got["precond"] is None):
    whose = "a point with" if want["precond"] is None else "a point without"
    raise ValueError(f"{where}: `{name}` is not a {cfg.variant!r} model's (`{name}.precond` must be "
                     f"{want['precond']}, got {got['precond']}: the cache of {whose} a preconditioner state)")
  for f in want:
    if got[f] != want[f]:
      raise ValueError(f"{where}: `{name}.{f}` must be of shape {want[f]} for {cfg.num_layers} layers of "
                       f"{cfg.variant!r} and {batch} sequences, got {got[f]}")


def prefill(model: LanguageModel, tokens, *, cache: Cache | None = None):
  """The chunked forward over tokens [B, T] (continuing `cache` if given, `check_cache`). Returns (logits
  [B, T, vocab], cache after the last token)."""
  tokens = _tokens(tokens, model.cfg.vocab_size, "prefill", "tokens")
  if cache is not None:
    check_cache(model, cache, tokens.shape[0], "prefill")
  graphdef, params = nnx.split(model)
  return _prefill(graphdef, params, tokens, cache)


def step(model: LanguageModel, token, cache: Cache):
  """One token per sequence, token [B]; cache: the model's for B sequences (`check_cache`). Returns (logits
  [B, vocab], new cache)."""
  token = _tokens(token, model.cfg.vocab_size, "step", "token", rank=1)
  check_cache(model, cache, token.shape[0], "step")
  graphdef, params = nnx.split(model)
  return _step(graphdef, params, token, cache)


def sample(logits, key, *, temperature=0.0, top_k: int | None = None):
  """Next tokens [B] int32 from logits [B, vocab]: greedy at temperature 0, else softmax(logits / temperature)
  restricted to the top_k largest logits (all when None). temperature may be traced (one compile serves all);
  key is unused when it is 0."""
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if key is None:
    return greedy
  temperature = jnp.asarray(temperature, jnp.float32)
  scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
  if top_k is not None:
    kth = jax.lax.top_k(scaled, top_k)[0][..., -1:]
    scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
  drawn = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
  return jnp.where(temperature > 0, drawn, greedy)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("num_tokens", "top_k"))
def _generate(graphdef, params, prompt, state, rng, temperature, *, num_tokens, top_k):
  model = nnx.merge(graphdef, params)
  if prompt is not None:
    logits, cache = model(prompt, cache=None if state is None else state.cache, return_cache=True)
    start = prompt.shape[1] + (0 if state is None else state.position)
    state = DecodeState(cache, logits[:, -1], jnp.asarray(start, jnp.int32))

  def body(carry, _):
    cache, logits, position = carry
    token = sample(logits, jax.random.fold_in(rng, position), temperature=temperature, top_k=top_k)
    logits, cache = model.step(token, cache)
    return DecodeState(cache, logits, position + 1), token

  state, tokens = jax.lax.scan(body, state, None, length=num_tokens)
  return tokens.T, state


def generate(model: LanguageModel, prompt, num_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, rng=None, state: DecodeState | None = None):
  """Generates num_tokens tokens per sequence after `prompt` [B, T] (and/or after `state`).

  temperature 0 is greedy; > 0 samples with the top_k largest logits (all when None) and needs `rng`; token
  number n of a sequence (counting the prompt) is drawn with fold_in(rng, n), so chaining calls through the
  returned state draws what one call draws. temperature is traced: changing it does not recompile (num_tokens,
  top_k, the prompt's shape and whether prompt/state are given do). state: a previous call's DecodeState
  (then prompt may be None, or more tokens to feed first). Returns (tokens [B, num_tokens] int32, the
  DecodeState after them: every generated token has been fed, so its logits predict the next one).

  ValueError naming the argument: prompt not an integer array [B, T] with B, T ≥ 1 (or an id outside the
  vocabulary), num_tokens not an int ≥ 0 (0 gives tokens [B, 0] and the state after the prompt), temperature not
  a finite real ≥ 0, top_k not an int in [1, vocab].
  """
  vocab = model.cfg.vocab_size
  if prompt is None and state is None:
    raise ValueError("generate: give a `prompt` [B, T] or a `state` from a previous call")
  if prompt is not None:
    prompt = _tokens(prompt, vocab, "generate", "prompt")
    if state is not None and prompt.shape[0] != state.logits.shape[0]:
      raise ValueError(f"generate: `prompt` has {prompt.shape[0]} rows but `state` holds {state.logits.shape[0]} "
                       f"sequences")
  if state is not None:
    check_cache(model, state.cache, state.logits.shape[0], "generate", "state.cache")
  if not _is_int(num_tokens) or num_tokens < 0:
    raise ValueError(f"generate: `num_tokens` must be an int ≥ 0, got {num_tokens!r}")
  t = checking.concrete(temperature)
  if t is None or t.shape != () or t.dtype.kind not in "iuf" or not math.isfinite(t) or t < 0:
    raise ValueError(f"generate: `temperature` must be a finite real ≥ 0, got {temperature!r}")
  if t > 0 and rng is None:
    raise ValueError("generate: sampling (`temperature` > 0) needs `rng`")
  if top_k is not None and (not _is_int(top_k) or not 0 < top_k <= vocab):
    raise ValueError(f"generate: `top_k` must be an int in [1, vocab_size = {vocab}] or None, got {top_k!r}")
  graphdef, params = nnx.split(model)
  rng = jax.random.key(0) if rng is None else rng       # unused when greedy; one pytree structure either way
  return _generate(graphdef, params, prompt, state, rng, jnp.float32(t), num_tokens=int(num_tokens),
                   top_k=None if top_k is None else int(top_k))


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)
