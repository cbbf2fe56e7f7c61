"""Pallas GPU kernels (Triton lowering; interpret mode on CPU). Importing registers them with `lookup`.

The delta rule: `pallas_kernels.gpu.delta_rule.delta_rule` (signature of `osdn_jax.ops.chunked.delta_rule`).
"""
import pallas_kernels
from pallas_kernels.gpu import delta_rule

pallas_kernels.register("delta_rule", pallas_kernels.Kernel(delta_rule.delta_rule, delta_rule.supports))
