"""OSDN's clipped d-pass as a Pallas TPU (Mosaic) kernel pair, through the d-pass's shell
(`pallas_kernels.d_pass_shell`: the recurrence, the entry point and its one `jax.custom_vjp`). `d_pass` has the
signature and results of `pallas_kernels.gpu.osdn.d_pass`, packed sequences included.

`kernel.py`: the forward and backward kernels (layout, grid, the reverse token loop); `blocks.py`: the block form's
math (L tokens at once where the clip does not act, `Config(form="blocks")`); `api.py`: this backend's `Backend`
record (the XLA around the kernels; `d_pass` is the shell's bound to it); `config.py`: block sizes and the form.
"""
from pallas_kernels.tpu.osdn.api import BACKEND, d_pass, supports
from pallas_kernels.tpu.osdn.config import MAX_KEY_DIM, TUNING, Config, default_config

__all__ = ["BACKEND", "Config", "MAX_KEY_DIM", "TUNING", "d_pass", "default_config", "supports"]
