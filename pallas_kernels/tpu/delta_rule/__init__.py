"""The chunkwise delta rule as Pallas TPU (Mosaic) kernels, forward and backward.

`delta_rule` and `linear_attention` are the entry points (the signatures of `osdn_jax.ops.chunked`; one
`jax.custom_vjp`; packed or not); `forward` is `delta_rule` compiled by default; `Config` holds the launch
parameters, `config_for` picks them per TPU generation. `api.py`: checks, padding and the scalar decay's cumsum
in XLA; `layout.py`: array views and BlockSpecs; `kernel.py`: the fused forward (T = (I + A)⁻¹ by recursive block inversion, per-channel scores by
pairwise sub-blocks and reference rows, the state update and the output, one grid step per chunk);
`backward.py`: the fused backward (chunks last to first, the state's cotangent carried in VMEM).
"""
from pallas_kernels.tpu.delta_rule.api import delta_rule, forward, linear_attention, supports
from pallas_kernels.tpu.delta_rule.config import CONFIGS, DEFAULT, Config, config_for

__all__ = ["delta_rule", "linear_attention", "forward", "supports", "Config", "DEFAULT", "CONFIGS", "config_for"]
