"""The chunkwise delta rule's forward as a Pallas TPU (Mosaic) kernel.

`forward` is the entry point (the forward of `osdn_jax.ops.delta_rule`, every decay, unpacked sequences; no
backward); `Config` holds the launch parameters. `api.py`: checks, padding and the scalar decay's cumsum in XLA;
`layout.py`: array views and BlockSpecs; `kernel.py`: the fused kernel (T = (I + A)⁻¹ by recursive block
inversion, per-channel scores by pairwise sub-blocks and reference rows, the state update and the output, one
grid step per chunk).
"""
from pallas_kernels.tpu.delta_rule.api import forward
from pallas_kernels.tpu.delta_rule.config import DEFAULT, Config

__all__ = ["forward", "Config", "DEFAULT"]
