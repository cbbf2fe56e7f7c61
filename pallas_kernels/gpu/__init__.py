"""Pallas GPU kernels (Triton lowering; interpret mode on CPU). Importing registers them with `lookup`.

The delta rule: `pallas_kernels.gpu.delta_rule.delta_rule` (signature of `osdn_jax.ops.chunked.delta_rule`);
the offline solve through the same kernels (zero erase key): `pallas_kernels.gpu.delta_rule.linear_attention`.
OSDN's sequential d-pass: `pallas_kernels.gpu.osdn.d_pass` (signature of `osdn_jax.dgps.precond._osdn_serial`).
The PDN / ATQ decayed second moment: `pallas_kernels.gpu.decayed_sum.decayed_sum`; PDN's write key and ATQ's
query fused with it (A never stored): `pallas_kernels.gpu.precond_key.precond_key`.
"""
import pallas_kernels
from pallas_kernels.gpu import decayed_sum, delta_rule, osdn, precond_key

pallas_kernels.register("delta_rule", pallas_kernels.Kernel(delta_rule.delta_rule, delta_rule.supports))
pallas_kernels.register("linear_attention",
                        pallas_kernels.Kernel(delta_rule.linear_attention, delta_rule.supports))
pallas_kernels.register("osdn_d_pass", pallas_kernels.Kernel(osdn.d_pass, osdn.supports))
pallas_kernels.register("decayed_sum", pallas_kernels.Kernel(decayed_sum.decayed_sum, decayed_sum.supports))
pallas_kernels.register("precond_key", pallas_kernels.Kernel(precond_key.precond_key, precond_key.supports))
