"""Block sizes (`Config`) and what the kernels are specialised on (`Static`)."""
from __future__ import annotations

import dataclasses

from pallas_kernels.tpu import common
from pallas_kernels.tpu.common import LANES

MAX_KEY_DIM = 256                 # d [Hb, K] of a head block stays in vregs
NAME = "osdn d_pass (pallas tpu)"
FORMS = ("tokens", "blocks")
BLOCK_TS = (16, 32)               # L of the block form (a power of two: `blocks.unit_inverse` doubles on token bits)


@dataclasses.dataclass(frozen=True)
class Config:
  """chunk: tokens per grid step, a multiple of 128 (the lane dim of the head-major scalar blocks); a sequence of at
  most `chunk` tokens runs as one chunk of T rounded up to 8. block_h: heads per program for G a multiple of it, a
  multiple of 8 (else all G). unroll: tokens per iteration of the token loop (1, 2, 4 or 8). form: "tokens" (one
  token at a time) or "blocks" (L = `block_t` tokens at a time where the clip does not act, `blocks.py`; packed
  sequences run "tokens"). block_t: L, 16 or 32."""
  chunk: int = 128
  block_h: int = 8
  unroll: int = 8
  form: str = "tokens"
  block_t: int = 16

  def __post_init__(self):
    for name, ok, what in (("chunk", lambda v: v % LANES == 0, f"a positive multiple of {LANES}"),
                           ("block_h", lambda v: v % 8 == 0, "a positive multiple of 8"),
                           ("unroll", lambda v: v in (1, 2, 4, 8), "1, 2, 4 or 8"),
                           ("block_t", lambda v: v in BLOCK_TS, " or ".join(map(str, BLOCK_TS)))):
      value = getattr(self, name)
      if not (isinstance(value, int) and not isinstance(value, bool) and value > 0 and ok(value)):
        raise ValueError(f"{NAME}: `{name}` must be {what}, got {value!r}")
    if self.form not in FORMS:
      raise ValueError(f"{NAME}: `form` must be one of {', '.join(map(repr, FORMS))}, got {self.form!r}")


# By TPU generation (`common.generation`); none measured yet: every generation runs the defaults.
TUNING: dict[str, Config] = {}


def default_config(spec=None, device_kind: str | None = None) -> Config:
  """The tuning table's config for a TPU `device_kind`, else `Config()`; every entry holds for every request (`spec`,
  unused here)."""
  del spec
  return TUNING.get(common.generation(device_kind), Config())


@dataclasses.dataclass(frozen=True)
class Static:
  """Everything the kernels are specialised on. mode: "none" (r ≡ 1) | "zero" | "init"; segments: N (0 unpacked);
  form: "tokens" | "blocks" ("tokens" when packed); block_t: L of the block form."""
  length: int
  heads: int
  key_dim: int
  eta: float
  d_min: float | None
  d_max: float | None
  mode: str
  segments: int
  chunk: int
  block_h: int
  unroll: int
  form: str
  block_t: int
  interpret: object

  @property
  def tp(self) -> int:
    return common.round_up(self.length, self.chunk)

  @property
  def num_chunks(self) -> int:
    return self.tp // self.chunk


def static(t, g, kd, *, eta, d_min, d_max, mode, segments, config: Config, interpret) -> Static:
  """The chunk (C, or T rounded up to 8 when T ≤ C) and head block (block_h, or all G) for T, G; packed sequences
  run the token form."""
  chunk = config.chunk if t > config.chunk else common.round_up(t, 8)
  block_h = config.block_h if g % config.block_h == 0 else g
  return Static(length=t, heads=g, key_dim=kd, eta=eta, d_min=d_min, d_max=d_max, mode=mode, segments=segments,
                chunk=chunk, block_h=block_h, unroll=config.unroll, form="tokens" if segments else config.form,
                block_t=config.block_t, interpret=interpret)
