"""The chunkwise delta rule (online solve) and, through the same kernels, the offline solve, on the GPU.

`api.delta_rule` / `api.linear_attention` are the entry points (a `jax.custom_vjp` around the kernels);
`config.Config` holds the launch parameters by kernel family and `heuristics` the rules that fill them in;
one file per kernel stage (forward: scores, prep, decayed_tiles, state_fwd, output; backward: dv_local,
state_bwd, grads_state, grads_intra, grads_finish, grads_pairs), orchestrated by `forward.py` and
`backward.py`; `layout.py` has the array layouts and BlockSpecs. README.md beside this package describes the
design.
"""
from pallas_kernels.gpu.delta_rule.api import delta_rule, linear_attention, supports
from pallas_kernels.gpu.delta_rule.config import DEFAULT, Config

__all__ = ["delta_rule", "linear_attention", "supports", "Config", "DEFAULT"]
