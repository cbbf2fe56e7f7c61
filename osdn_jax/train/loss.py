"""Next-token cross-entropy through the tied embedding, one piece of positions at a time.

A [B, T, vocab] fp32 logits array is 4.2 GB for the 340M recipe (16 × 2048 × 32000), and its gradient as much
again. `cross_entropy` splits T into pieces of `chunk` positions and scans over them: each piece's logits
[B, chunk, vocab] are formed in fp32 from the compute-dtype hidden states, reduced to a loss and dropped, and
the backward recomputes them piece by piece (`jax.checkpoint`). Rows stay whole, so a batch sharded over rows
stays sharded. `plain_cross_entropy` is the same sum with the logits materialised: the reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _token_losses(hidden, embed, targets):
  """hidden [..., D] (compute dtype), embed [vocab, D] fp32, targets [...] → −log p(target) [...] fp32."""
  logits = jnp.einsum("...d,vd->...v", hidden, embed.astype(hidden.dtype), preferred_element_type=jnp.float32)
  target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits, axis=-1) - target


def plain_cross_entropy(hidden, embed, targets, mask):
  """Σ mask · (−log softmax(hidden · embedᵀ)[target]) with the logits materialised. Shapes as below."""
  return jnp.sum(_token_losses(hidden, embed, targets) * mask)


def cross_entropy(hidden, embed, targets, mask, *, chunk: int):
  """Σ_{b,t} mask[b, t] · (−log softmax(hidden[b, t] · embedᵀ)[targets[b, t]]), fp32.

  hidden [B, T, D] (any float dtype; the logits are accumulated in fp32), embed [vocab, D], targets [B, T]
  int, mask [B, T] (0 drops a token). chunk: positions per piece (T is padded to a multiple with mask 0).
  """
  b, t, d = hidden.shape
  chunk = min(chunk, t)
  pad = -t % chunk
  if pad:
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    mask = jnp.pad(mask, ((0, 0), (0, pad)))
  pieces = (t + pad) // chunk
  split = lambda x: jnp.moveaxis(x.reshape((b, pieces, chunk) + x.shape[2:]), 1, 0)

  @jax.checkpoint
  def piece(embed, h, y, m):
    return jnp.sum(_token_losses(h, embed, y) * m)

  def body(total, xs):
    return total + piece(embed, *xs), None

  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                          (split(hidden), split(targets), split(mask.astype(jnp.float32))))
  return total
