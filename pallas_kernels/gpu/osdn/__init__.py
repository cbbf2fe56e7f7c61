"""OSDN's clipped d-pass on the GPU: `api.d_pass` (the entry point and its custom_vjp), `config.Config` (by device
kind `config.TUNING`, read by `default_config`), the kernels (`forward.py`, `backward.py`), their token loops (`loops.py`), the block solves
(`blocks.py`) and their tables (`tables.py`), the chains over spans (`spans.py`); `layout.py` has the
BlockSpecs. `guard.write_key`: the write key guard(d ⊙ k) from the d-pass's ds, one pass each way."""
from pallas_kernels.gpu.osdn.api import d_pass, supports
from pallas_kernels.gpu.osdn.config import DEFAULT, INTERPRET, TUNING, Config, default_config
from pallas_kernels.gpu.osdn.guard import supports_write_key, write_key

__all__ = ["d_pass", "supports", "write_key", "supports_write_key", "Config", "DEFAULT", "INTERPRET", "TUNING",
           "default_config"]
