"""PDN's write key and ATQ's query on TPU: the second-moment kernel (`decayed_sum`'s scan), then the transform in
XLA; what this backend supplies to the shell (`pallas_kernels.precond_shell`: the recurrence, the entry point, its
checks and custom_vjp; `precond_key` is the shell's bound to `BACKEND`).

Unlike the GPU kernels, the kernel here stores A [B, T, H, K] fp32 once (and saves it, named for rematerialisation):
`finish` applies the transform to it as one elementwise XLA fusion over A and k (or q), and its gradient reaches the
kernel's own backward (`decayed_sum.backward`) through autodiff. Faults stay where the token-serial recurrence puts
them, as `decayed_sum` confines them, with NaN wherever A_t is not finite.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels import precond_shell as shell
from pallas_kernels.shells import bind
from pallas_kernels.spec import Spec
from pallas_kernels.tpu import common
from pallas_kernels.tpu import decayed_sum as moment
from pallas_kernels.tpu.decayed_sum import Config, default_config
from pallas_kernels.wrapper_math import precond_transform


@dataclasses.dataclass(frozen=True)
class Static:
  """The transform, the moment kernel's block sizes and its interpret mode."""
  transform: shell.Transform
  config: Config
  interpret: object


def _prepare(transform: shell.Transform, config: Config, interpret, k, q, beta, g, A0, center):
  """The moment's inputs (k, β, g, A0) for the kernel; q and the center for `finish`."""
  if min(k.shape) < 1:
    raise ValueError(f"precond_key (pallas tpu): every dim of `k` must be ≥ 1, got shape {k.shape}")
  return Static(transform, config, interpret), (k, beta, g, A0), (q, center)


def _forward(st: Static, inputs):
  return moment.scan(*inputs, config=st.config, interpret=st.interpret)


def _forward_saving(st: Static, inputs):
  A, A_T = _forward(st, inputs)
  return (A, A_T), A


def _backward(st: Static, inputs, A, cts):
  return moment.backward(*inputs[:3], A, *cts, config=st.config, interpret=st.interpret)


def _finish(st: Static, inputs, outputs, aux):
  """y from A: the transform in XLA."""
  (A, A_T), (q, center), k = outputs, aux, inputs[0]
  t = st.transform
  if t.name == "atq":                                     # q / (inf + λ) would be a finite 0 (PDN's scale is NaN)
    A = jnp.where(jnp.isfinite(A), A, jnp.nan)
    p, dtype = q.astype(jnp.float32), q.dtype
  else:                                                   # the center per head, against A [B, T, H, K]
    p, dtype = center[:, None], k.dtype
  y = precond_transform(t.name, A, k.astype(jnp.float32), p, x=t.x, eps=t.eps, lam=t.lam)
  return y.astype(dtype), A_T


BACKEND = shell.Backend(
    name="pallas tpu", default_config=default_config, interpret_mode=common.default_interpret, prepare=_prepare,
    forward=_forward, forward_saving=_forward_saving, backward=_backward, finish=_finish)

precond_key = bind(shell.precond_key, BACKEND, __name__)
precond_key.confines_faults = True   # unpacked: NaN where the token-serial recurrence has it (`decayed_sum`)


def supports(spec: Spec) -> bool:
  """Compiled on "tpu"; fp32 or bf16 inputs (computed in fp32); unpacked; static transform constants."""
  return (spec.platform == "tpu" and spec.dtype in ("float32", "bfloat16") and not spec.packed
          and spec.static_params and spec.config_of(Config))
