"""Pallas TPU kernels (Mosaic; TPU interpret mode on a CPU). Importing this package registers them with
`pallas_kernels.lookup` for platform "tpu" only (a CPU backend keeps the GPU kernels in interpret mode; these are
reachable there explicitly, with `interpret=True`):

  "decayed_sum"       `decayed_sum.decayed_sum`       the PDN / ATQ decayed second moment
"""
import pallas_kernels
from pallas_kernels.tpu import decayed_sum

for _op, _fn, _supports in (("decayed_sum", decayed_sum.decayed_sum, decayed_sum.supports),):
  pallas_kernels.register(_op, pallas_kernels.Kernel(f"tpu.{_op}", _fn, _supports))
