"""Core solves: `delta_rule` (online), `linear_attention` (offline) and their one-token decoding steps.

Imports only jax and numpy. Implementations: `naive` (token-serial oracle), `chunked` (XLA), Pallas kernels
through `pallas_kernels.lookup`. Packed sequences: `segment_ids` (see `packing`).
"""
from osdn_jax.ops.api import delta_rule, delta_rule_step, linear_attention, linear_attention_step
from osdn_jax.ops.packing import cu_seqlens_from_segment_ids, segment_ids_from_cu_seqlens

__all__ = ["delta_rule", "delta_rule_step", "linear_attention", "linear_attention_step",
           "cu_seqlens_from_segment_ids", "segment_ids_from_cu_seqlens"]
