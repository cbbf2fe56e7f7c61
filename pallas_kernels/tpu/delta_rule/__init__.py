"""The chunkwise delta rule as Pallas TPU (Mosaic) kernels, forward and backward.

`delta_rule` and `linear_attention` are the entry points (the signatures of `osdn_jax.ops.chunked`; one
`jax.custom_vjp`; packed or not); `forward` is `delta_rule` compiled by default; `Config` holds the launch
parameters, `TUNING` them per TPU generation (`default_config`). `api.py`: this backend's parts of the shell
(`pallas_kernels.delta_rule_shell`: checks, padding, the scalar decay's cumsum in XLA, the custom_vjp);
`layout.py`: array views and BlockSpecs; `kernel.py`: the fused forward (T = (I + A)⁻¹ by recursive block inversion, per-channel scores by
pairwise sub-blocks and reference rows, the state update and the output, one grid step per chunk);
`backward.py`: the fused backward (chunks last to first, the state's cotangent carried in VMEM).
"""
from pallas_kernels.tpu.delta_rule.api import BACKEND, delta_rule, forward, linear_attention, supports
from pallas_kernels.tpu.delta_rule.config import DEFAULT, TUNING, Config, default_config

__all__ = ["BACKEND", "delta_rule", "linear_attention", "forward", "supports", "Config", "DEFAULT", "TUNING",
           "default_config"]
