"""OSDN's clipped d-pass as a Pallas TPU (Mosaic) kernel pair behind one `jax.custom_vjp`.

The recurrence, per (batch, head) row (u_t = k_t ⊙ k_t, n_t = max(‖k_t‖², 1e-12), o = d_init):
    s_t = ⟨d_t, u_t⟩,   coef_t = a_t − c_t s_t,   a_t = η β_t / n_t,   c_t = η β_t² / n_t
    d̄_{t+1} = keep_t + coef_t u_t,   keep_t = d_t (r ≡ 1) | r_t d_t (anchor "zero") | o + r_t (d_t − o) ("init")
    d_{t+1} = clip(d̄_{t+1}, d_min, d_max)
Token t writes with d_t; `d_pass` returns ds = (d_1 … d_T) and d_{T+1}, fp32. The contract is
`osdn_jax.dgps.precond.osdn_d_pass(implementation="reference")` (the token-serial scan); signature and results are
those of `pallas_kernels.gpu.osdn.d_pass`, packed sequences included.

`kernel.py`: the forward and backward kernels (layout, grid, the reverse token loop); `blocks.py`: the block form's
math (L tokens at once where the clip does not act, `Config(form="blocks")`); `api.py`: the entry point, the
custom_vjp and the XLA around the kernels; `config.py`: block sizes and the form.
"""
from pallas_kernels.tpu.osdn.api import d_pass, supports
from pallas_kernels.tpu.osdn.config import MAX_KEY_DIM, TUNING, Config, default_config

__all__ = ["Config", "MAX_KEY_DIM", "TUNING", "d_pass", "default_config", "supports"]
