"""Pallas GPU kernels (Triton lowering; interpret mode on CPU). Importing this package registers them with
`pallas_kernels.lookup`:

  "delta_rule"        `delta_rule.delta_rule`         the online solve (all three decays, packed, GVA)
  "linear_attention"  `delta_rule.linear_attention`   the offline solve through the same kernels
  "osdn_d_pass"       `osdn.d_pass`                   OSDN's clipped d-pass
  "osdn_guard"        `osdn.write_key`                OSDN's write key guard(d ⊙ k) from the d-pass's ds
  "decayed_sum"       `decayed_sum.decayed_sum`       the PDN / ATQ decayed second moment
  "precond_key"       `precond_key.precond_key`       PDN's write key / ATQ's query fused with that moment
"""
import pallas_kernels
from pallas_kernels.gpu import decayed_sum, delta_rule, osdn, precond_key

for _op, _fn, _supports in (("delta_rule", delta_rule.delta_rule, delta_rule.supports),
                            ("linear_attention", delta_rule.linear_attention, delta_rule.supports),
                            ("osdn_d_pass", osdn.d_pass, osdn.supports),
                            ("osdn_guard", osdn.write_key, osdn.supports_write_key),
                            ("decayed_sum", decayed_sum.decayed_sum, decayed_sum.supports),
                            ("precond_key", precond_key.precond_key, precond_key.supports)):
  pallas_kernels.register(_op, pallas_kernels.Kernel(f"gpu.{_op}", _fn, _supports))
