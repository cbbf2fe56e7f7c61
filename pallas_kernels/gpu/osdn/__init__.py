"""OSDN's clipped d-pass on the GPU: `api.d_pass` (the entry point and its custom_vjp), `config.Config`, the
sequential kernels (`forward.py`, `backward.py`), their token loops (`loops.py`), the block solves (`blocks.py`)
and their tables (`tables.py`); `layout.py` has the BlockSpecs."""
from pallas_kernels.gpu.osdn.api import d_pass, supports
from pallas_kernels.gpu.osdn.config import DEFAULT, INTERPRET, Config

__all__ = ["d_pass", "supports", "Config", "DEFAULT", "INTERPRET"]
