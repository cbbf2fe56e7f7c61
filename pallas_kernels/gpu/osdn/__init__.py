"""OSDN's clipped d-pass on the GPU: `api.d_pass` (the entry point and its custom_vjp; `api.configured`),
`config.Config`, the kernels (`forward.py`, `backward.py`), their token loops (`loops.py`), the block solves
(`blocks.py`) and their tables (`tables.py`), the chains over spans (`spans.py`); `layout.py` has the
BlockSpecs. `guard.write_key`: the write key guard(d ⊙ k) from the d-pass's ds, one pass each way."""
from pallas_kernels.gpu.osdn.api import configured, d_pass, supports
from pallas_kernels.gpu.osdn.config import DEFAULT, INTERPRET, Config
from pallas_kernels.gpu.osdn.guard import supports_write_key, write_key

__all__ = ["configured", "d_pass", "supports", "write_key", "supports_write_key", "Config", "DEFAULT", "INTERPRET"]
