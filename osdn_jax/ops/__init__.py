"""Core solves: `delta_rule` (online), `linear_attention` (offline) and their one-token decoding steps.

Imports only jax and numpy. Implementations: `naive` (token-serial oracle), `chunked` (XLA), Pallas kernels
through `pallas_kernels.lookup`.
"""
from osdn_jax.ops.api import delta_rule, delta_rule_step, linear_attention, linear_attention_step

__all__ = ["delta_rule", "delta_rule_step", "linear_attention", "linear_attention_step"]
