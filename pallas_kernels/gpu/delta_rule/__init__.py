"""The chunkwise delta rule (online solve) and, through the same kernels, the offline solve, on the GPU.

`api.delta_rule` / `api.linear_attention` are the entry points (`api.BACKEND` in the shell,
`pallas_kernels.delta_rule_shell`); `config.Config` holds the launch parameters by kernel family, `config.TUNING`
the configs by device kind (`default_config`), and `heuristics` the rules that fill them in;
one file per kernel stage (forward: scores, prep, decayed_tiles, state_fwd, output; backward: dv_local,
state_bwd, grads_state, grads_intra, grads_finish, grads_pairs), orchestrated by `forward.py` and
`backward.py`; `layout.py` has the array layouts and BlockSpecs. README.md beside this package describes the
design.
"""
from pallas_kernels.gpu.delta_rule.api import BACKEND, delta_rule, linear_attention, supports
from pallas_kernels.gpu.delta_rule.config import DEFAULT, TUNING, Config, default_config

__all__ = ["BACKEND", "delta_rule", "linear_attention", "supports", "Config", "DEFAULT", "TUNING", "default_config"]
