"""Pallas GPU kernels (Triton lowering; interpret mode on CPU). Importing registers them with `lookup`.

The delta rule: `pallas_kernels.gpu.delta_rule.delta_rule` (signature of `osdn_jax.ops.chunked.delta_rule`).
OSDN's sequential d-pass: `pallas_kernels.gpu.osdn.d_pass` (signature of `osdn_jax.dgps.precond._osdn_serial`).
"""
import pallas_kernels
from pallas_kernels.gpu import delta_rule, osdn

pallas_kernels.register("delta_rule", pallas_kernels.Kernel(delta_rule.delta_rule, delta_rule.supports))
pallas_kernels.register("osdn_d_pass", pallas_kernels.Kernel(osdn.d_pass, osdn.supports))
