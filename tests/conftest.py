import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# fp64 oracles need x64; the library must keep fp32 where it promises fp32 with x64 on, which this also tests.
jax.config.update("jax_enable_x64", True)
