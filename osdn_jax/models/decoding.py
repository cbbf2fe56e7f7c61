"""Recurrent decoding: prefill with the chunked forward, then one-token steps through `Point.step`.

    logits, cache = prefill(model, prompt)                       # [B, T, vocab], per-layer states
    logits_t, cache = step(model, token, cache)                  # one token per sequence
    tokens, state = generate(model, prompt, 32)                  # greedy; temperature>0 (+ top_k) samples
    more, state = generate(model, None, 32, state=state)         # continues: equals one call of 64

All three are jitted (the model is split into its graph and state and merged inside the traced function); the
token loop of `generate` is one `lax.scan`. The cache holds, per layer, the solve's state S [B, HV, K, V], the
preconditioner's state and the short convolution's last W − 1 inputs (a `LayerCache` stacked over layers):
O(1) in the context length.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from osdn_jax.models.lm import Cache, LanguageModel


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


def prefill(model: LanguageModel, tokens, *, cache: Cache | None = None):
  """The chunked forward over tokens [B, T] (continuing `cache` if given). Returns (logits [B, T, vocab],
  cache after the last token)."""
  graphdef, params = nnx.split(model)
  return _prefill(graphdef, params, jnp.asarray(tokens, jnp.int32), cache)


def step(model: LanguageModel, token, cache: Cache):
  """One token per sequence, token [B]. Returns (logits [B, vocab], new cache)."""
  graphdef, params = nnx.split(model)
  return _step(graphdef, params, jnp.asarray(token, jnp.int32), cache)


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
  """
  if prompt is None and state is None:
    raise ValueError("generate: give a `prompt` [B, T] or a `state` from a previous call")
  if temperature < 0:
    raise ValueError(f"generate: `temperature` must be ≥ 0, got {temperature}")
  if temperature > 0 and rng is None:
    raise ValueError("generate: sampling (`temperature` > 0) needs `rng`")
  if top_k is not None and not 0 < top_k <= model.cfg.vocab_size:
    raise ValueError(f"generate: `top_k` must be in [1, vocab_size = {model.cfg.vocab_size}], got {top_k}")
  graphdef, params = nnx.split(model)
  prompt = None if prompt is None else jnp.asarray(prompt, jnp.int32)
  rng = jax.random.key(0) if rng is None else rng       # unused when greedy; one pytree structure either way
  return _generate(graphdef, params, prompt, state, rng, jnp.float32(temperature), num_tokens=int(num_tokens),
                   top_k=top_k)
