"""Pallas TPU kernels (Mosaic; TPU interpret mode on a CPU). Importing this package registers them with
`pallas_kernels.lookup` for platform "tpu" only (`implementation="pallas"` on a CPU backend runs the GPU kernels in
interpret mode; `implementation="pallas-tpu"` runs these there, in TPU interpret mode, as does `interpret=True`):

  "delta_rule"        `delta_rule.delta_rule`         the online solve (all three decays, GVA; packed with static N)
  "linear_attention"  `delta_rule.linear_attention`   the offline solve through the same kernels
  "osdn_d_pass"       `osdn.d_pass`                   OSDN's clipped d-pass (packed or not)
  "decayed_sum"       `decayed_sum.decayed_sum`       the PDN / ATQ decayed second moment
  "precond_key"       `precond_key.precond_key`       PDN's write key / ATQ's query: that moment, then the transform
"""
import pallas_kernels
from pallas_kernels.tpu import decayed_sum, delta_rule, osdn, precond_key

for _op, _fn, _supports in (("delta_rule", delta_rule.delta_rule, delta_rule.supports),
                            ("linear_attention", delta_rule.linear_attention, delta_rule.supports),
                            ("osdn_d_pass", osdn.d_pass, osdn.supports),
                            ("decayed_sum", decayed_sum.decayed_sum, decayed_sum.supports),
                            ("precond_key", precond_key.precond_key, precond_key.supports)):
  pallas_kernels.register(_op, pallas_kernels.Kernel(f"tpu.{_op}", _fn, _supports))
