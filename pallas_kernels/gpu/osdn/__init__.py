"""OSDN's clipped d-pass on the GPU: `api.BACKEND` (this backend's parts of `pallas_kernels.d_pass_shell`; `d_pass`
is the shell's entry bound to it), `config.Config` (by device kind `config.TUNING`, read by `default_config`), the
kernels (`forward.py`, `backward.py`), their token loops (`loops.py`), the block solves (`blocks.py`) and their
tables (`tables.py`), the chains over spans (`spans.py`); `layout.py` has the BlockSpecs. `guard.write_key`: the
write key guard(d ⊙ k) from the d-pass's ds, one pass each way (`guard.BACKEND` in `pallas_kernels.guard_shell`)."""
from pallas_kernels.gpu.osdn.api import BACKEND, d_pass, supports
from pallas_kernels.gpu.osdn.config import DEFAULT, INTERPRET, TUNING, Config, default_config
from pallas_kernels.gpu.osdn.guard import supports_write_key, write_key

__all__ = ["BACKEND", "d_pass", "supports", "write_key", "supports_write_key", "Config", "DEFAULT", "INTERPRET",
           "TUNING", "default_config"]
