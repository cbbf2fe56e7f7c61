"""Language-model configurations: every registry point × every size, named "<point>-<size>" (e.g. "pgdn-340m").

Sizes (FLA's recipes for the DeltaNet family; 24 layers above `tiny`, vocabulary 32000, SwiGLU width
256·⌈(2/3·4·D)/256⌉, tied input/output embeddings):

  tiny   D = 64,   2 heads × 32,   2 layers, vocab 256     (CPU tests)
  mqar   D = 128,  2 heads × 64,   2 layers, vocab 8192    (zoology's MQAR models)
  340m   D = 1024, 8 heads × 128,  24 layers
  1b     D = 1792, 14 heads × 128, 24 layers
  1.3b   D = 2048, 16 heads × 128, 24 layers
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from osdn_jax import dgps
from osdn_jax.layers import mixer as mixer_lib
from osdn_jax.layers.mlp import hidden_width

SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(d_model=64, num_heads=2, num_layers=2, vocab_size=256),
    "mqar": dict(d_model=128, num_heads=2, num_layers=2, vocab_size=8192),
    "340m": dict(d_model=1024, num_heads=8, num_layers=24, vocab_size=32000),
    "1b": dict(d_model=1792, num_heads=14, num_layers=24, vocab_size=32000),
    "1.3b": dict(d_model=2048, num_heads=16, num_layers=24, vocab_size=32000),
}


_SAVE_SOLVE = ("solve_out", "delta_rule_T", "precond_pass")
# What a block keeps for the backward pass (`ModelConfig.remat`); everything else is recomputed from the block's
# input. "none": no rematerialisation (everything saved). "full": only the block input. "dots": every matmul
# output (projections, MLP); the solve and the element-wise work rerun. "solve": the solve's output, its
# in-chunk inverse and the preconditioner's first pass (PDN's write key and its chunk carries, or its second moment
# on a TPU; OSDN's write key, its d and the d-pass kernels' tables); the projections rerun. "dots_solve": both.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "solve": jax.checkpoint_policies.save_only_these_names(*_SAVE_SOLVE),
    "dots_solve": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*_SAVE_SOLVE)),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only LM: embedding (tied with the head unless tie_embeddings is False), L × [RMSNorm → mixer →
  +, RMSNorm → SwiGLU → +], final RMSNorm.

  variant: a DGPS registry point (`osdn_jax.dgps.names()`); point_options override its preconditioner options
  (a mapping or (name, value) pairs, e.g. (("x", 2.0),); range-checked by `dgps.get`). Heads: H = num_heads of
  size head_dim (default D // H); num_value_heads HV (a multiple of H; default H) of size value_head_dim (default
  head_dim). mlp_hidden: default 256·⌈(2/3·4·D)/256⌉.
  output_gate: default the KDA family only; output_gate_activation ("sigmoid" | "swish") and output_gate_rank
  (None | r) as `layers.MixerConfig`. tie_embeddings: False gives the model its own output head [vocab, D]
  (`LanguageModel.head`). dtype: the compute dtype (activations
  and matmuls); parameters are fp32 and the residual stream stays fp32. init_std: the embedding's init std.
  remat: what each block keeps for the backward pass in `LanguageModel.hidden` (`REMAT_POLICIES`).
  scan_layers: the blocks run as one `lax.scan` step compiled once (True), or unrolled (False: no loop, so no
  per-layer stacking of activations and residuals; faster for a few layers, compiles longer for many).
  norm_eps and init_std are finite and > 0.
  """
  variant: str
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  head_dim: int | None = None
  num_value_heads: int | None = None
  value_head_dim: int | None = None
  mlp_hidden: int | None = None
  conv_size: int = 4
  gate_rank: int = 16
  output_gate: bool | None = None
  norm_eps: float = 1e-6
  chunk_size: int = 64
  implementation: str = "auto"
  point_options: tuple[tuple[str, Any], ...] = ()
  dtype: Any = jnp.float32
  init_std: float = 0.02
  remat: str = "none"
  scan_layers: bool = True
  name: str = ""
  output_gate_activation: str = "sigmoid"
  output_gate_rank: int | None = None
  tie_embeddings: bool = True

  def __post_init__(self):
    if not isinstance(self.variant, str) or self.variant.lower() not in dgps.POINTS:
      raise ValueError(f"ModelConfig: unknown `variant` {self.variant!r}; known: {', '.join(dgps.names())}")
    mixer_lib.positive("ModelConfig", vocab_size=self.vocab_size, num_layers=self.num_layers,
                       mlp_hidden=self.mlp_hidden, conv_size=self.conv_size, gate_rank=self.gate_rank,
                       output_gate_rank=self.output_gate_rank)
    mixer_lib.check_gate_activation("ModelConfig", self.output_gate_activation)
    if not isinstance(self.tie_embeddings, bool):
      raise ValueError(f"ModelConfig: `tie_embeddings` must be a bool, got {self.tie_embeddings!r}")
    if self.chunk_size not in mixer_lib.CHUNK_SIZES:
      raise ValueError(f"ModelConfig: `chunk_size` must be one of {mixer_lib.CHUNK_SIZES}, "
                       f"got {self.chunk_size!r}")
    mixer_lib.check_heads("ModelConfig", d_model=self.d_model, num_heads=self.num_heads, head_dim=self.head_dim,
                          num_value_heads=self.num_value_heads, value_head_dim=self.value_head_dim)
    mixer_lib.check_dtype("ModelConfig", self.dtype)
    mixer_lib.check_options("ModelConfig", output_gate=self.output_gate, norm_eps=self.norm_eps,
                            implementation=self.implementation, init_std=self.init_std)
    if not isinstance(self.remat, str) or self.remat not in REMAT_POLICIES:
      raise ValueError(f"ModelConfig: `remat` must be one of {', '.join(REMAT_POLICIES)}, got {self.remat!r}")
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f"ModelConfig: `scan_layers` must be a bool, got {self.scan_layers!r}")
    if not isinstance(self.name, str):
      raise ValueError(f"ModelConfig: `name` must be a str, got {self.name!r}")
    options = dgps.checks.option_mapping("ModelConfig", self.point_options)
    object.__setattr__(self, "point_options", tuple(sorted(options.items())))
    try:
      self.point  # unknown or out-of-range options raise here, naming them
    except ValueError as e:
      raise ValueError(f"ModelConfig: `point_options`: {e}") from None

  @property
  def point(self) -> dgps.Point:
    return dgps.get(self.variant, **dict(self.point_options))

  @property
  def hidden(self) -> int:
    return self.mlp_hidden or hidden_width(self.d_model)

  @property
  def mixer(self) -> mixer_lib.MixerConfig:
    return mixer_lib.MixerConfig(
        self.point, d_model=self.d_model, num_heads=self.num_heads, head_dim=self.head_dim,
        num_value_heads=self.num_value_heads, value_head_dim=self.value_head_dim, conv_size=self.conv_size,
        gate_rank=self.gate_rank, output_gate=self.output_gate, norm_eps=self.norm_eps,
        chunk_size=self.chunk_size, implementation=self.implementation, dtype=self.dtype,
        out_init_scale=(2 * self.num_layers) ** -0.5, output_gate_activation=self.output_gate_activation,
        output_gate_rank=self.output_gate_rank)

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)


STRUCTURE_FIELDS = ("d_model", "num_layers", "num_heads", "head_dim", "num_value_heads", "value_head_dim",
                    "mlp_hidden", "conv_size", "gate_rank", "output_gate", "output_gate_activation",
                    "output_gate_rank", "tie_embeddings", "norm_eps")


def structure_fields(fields) -> dict[str, Any]:
  """`fields` (a mapping, e.g. a run config's `model_fields`) checked to hold only `STRUCTURE_FIELDS`, the fields
  that fix a model's parameters beyond its point and size; ValueError naming any other. Returns a dict."""
  fields = dict(fields or {})
  unknown = sorted(set(fields) - set(STRUCTURE_FIELDS))
  if unknown:
    raise ValueError(f"model_fields: unknown field(s) {', '.join(map(repr, unknown))}; known: "
                     f"{', '.join(STRUCTURE_FIELDS)}")
  return fields


def names() -> list[str]:
  """Every named config: "<point>-<size>" for each registry point and size."""
  return [f"{p}-{s}" for p in dgps.names() for s in SIZES]


def config(name: str, **overrides) -> ModelConfig:
  """The named config ("pgdn-340m", "osdn-apf-kda-tiny", ...), with fields overridden by `overrides`
  (e.g. dtype=jnp.bfloat16, num_value_heads=16). ValueError naming `name` unless it is such a str."""
  if not isinstance(name, str):
    raise ValueError(f"models.config: `name` must be a config name '<point>-<size>' (a str, e.g. 'pgdn-340m'), "
                     f"got {name!r}")
  variant, _, size = name.lower().rpartition("-")
  if size not in SIZES:
    raise ValueError(f"models.config: unknown size {size!r} in {name!r}; sizes: {', '.join(SIZES)} "
                     "(names are '<point>-<size>', e.g. 'pgdn-340m')")
  if variant not in dgps.POINTS:
    raise ValueError(f"models.config: unknown `variant` {variant!r} in {name!r}; known: "
                     f"{', '.join(dgps.names())}")
  return ModelConfig(variant=variant, name=name.lower(), **dict(SIZES[size], **overrides))
