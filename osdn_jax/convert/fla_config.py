"""FLA's model configs (config.json of a *ForCausalLM) ↔ `models.ModelConfig`: every field maps, is accepted
because it does not change the function the model computes, or is refused by name (`docs/design.md`, "FLA
checkpoints", has the table).

FLA's blocks and ours compute the same function: embeddings → L × [RMSNorm → mixer → +, RMSNorm → SwiGLU → +] →
RMSNorm → head; the mixer SiLU(causal depthwise conv(W_q x, W_k x, W_v x)) → L2-normalised q, k (ε = 1e-6 inside the
square root) → the delta-rule solve at scale K^-1/2 with β = σ(W_b x) and the gate −exp(A_log)·softplus(W_a x + dt_bias)
→ head-wise RMSNorm (⊙ act(W_g x) when gated) → W_o; every RMSNorm with the config's norm_eps.
"""
from __future__ import annotations

import math
from typing import Any

from osdn_jax import models

# FLA model_type → (our point, FLA's causal-LM class).
FAMILIES = {
    "delta_net": ("dn", "DeltaNetForCausalLM"),
    "gated_deltanet": ("gdn", "GatedDeltaNetForCausalLM"),
    "kda": ("kda", "KDAForCausalLM"),
    "precond_gated_deltanet": ("pgdn", "PrecondGatedDeltaNetForCausalLM"),
    "precond_kda": ("pkda", "PrecondKDAForCausalLM"),
}
POINT_FAMILY = {point: family for family, (point, _) in FAMILIES.items()}
PRECONDITIONED = ("precond_gated_deltanet", "precond_kda")
KDA_LIKE = ("kda", "precond_kda")

# Fields that do not change the function a checkpoint computes: kernel choices (chunk / fused_recurrent, fused
# norms, SwiGLU and losses), the training loss (l2warp), initialisation only (A_log's lower bound), positions FLA's
# models never read, and Hugging Face's generic fields.
IGNORED = frozenset({
    "attn_mode", "fuse_norm", "fuse_swiglu", "fuse_cross_entropy", "fuse_linear_cross_entropy", "use_l2warp",
    "max_position_embeddings", "use_cache", "a_log_init_lower",
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "bos_token_id", "eos_token_id", "pad_token_id", "output_attentions", "output_hidden_states", "return_dict",
    "use_return_dict", "torchscript", "is_encoder_decoder", "is_decoder", "tokenizer_class", "use_bfloat16",
    "_attn_implementation_autoset", "_attn_implementation", "tf_legacy_loss", "pruned_heads",
    "chunk_size_feed_forward", "add_cross_attention", "problem_type", "id2label", "label2id",
})

# What FLA's layers take and we require: (field, the value we compute, FLA's default when absent, why).
REQUIRED = {
    "use_short_conv": (True, True, "the mixer always runs the short convolution"),
    "allow_neg_eigval": (False, False, "β = 2σ(b) (negative eigenvalues) is no point of the registry's FLA families"),
    "hidden_act": ("swish", "swish", "the MLP is SwiGLU"),
    "attn": (None, None, "hybrid attention layers have no counterpart here"),
    "attnres_block_size": (None, None, "attention residuals have no counterpart here"),
}
FAMILY_REQUIRED = {
    "delta_net": {"use_beta": (True, True, "β = 1 is another point"),
                  "qk_norm": ("l2", "l2", "q and k are L2-normalised"),
                  "qk_activation": ("silu", "silu", "q and k pass through SiLU after the convolution")},
    "kda": {"safe_gate": (False, False, "the gate −exp(A_log)·softplus(·) is the channel decay; FLA's safe gate "
                                        "is another"),
            "lower_bound": (None, None, "the bounded gate lower_bound·σ(·) is another decay")},
}
FAMILY_REQUIRED["precond_kda"] = FAMILY_REQUIRED["kda"]
# Fields each family maps (besides REQUIRED's).
COMMON = ("hidden_size", "num_hidden_layers", "vocab_size", "norm_eps", "conv_size", "hidden_ratio",
          "intermediate_size", "tie_word_embeddings", "initializer_range")
MAPPED = {
    "delta_net": COMMON + ("num_heads", "expand_k", "expand_v", "use_gate", "use_output_norm"),
    "gated_deltanet": COMMON + ("num_heads", "num_v_heads", "head_dim", "expand_v", "use_gate",
                                "output_gate_activation"),
    "kda": COMMON + ("num_heads", "num_v_heads", "head_dim", "expand_v"),
}
MAPPED["precond_gated_deltanet"] = MAPPED["gated_deltanet"][:-1] + ("squash_x", "squash_eps", "log_atk_scale_init")
MAPPED["precond_kda"] = MAPPED["kda"] + ("squash_x", "squash_eps", "log_atk_scale_init")

# FLA's defaults of the fields a config.json may leave out (its classes' __init__ defaults).
DEFAULTS = {
    "delta_net": dict(expand_k=1.0, expand_v=1.0, use_gate=False, num_heads=16, norm_eps=1e-6, conv_size=4,
                      hidden_ratio=4, intermediate_size=None, tie_word_embeddings=False, use_output_norm=True),
    "gated_deltanet": dict(expand_v=2.0, use_gate=True, head_dim=256, num_heads=6, num_v_heads=None,
                           norm_eps=1e-6, conv_size=4, hidden_ratio=4, intermediate_size=None,
                           tie_word_embeddings=False, output_gate_activation="swish"),
    "kda": dict(expand_v=1.0, head_dim=128, num_heads=16, num_v_heads=None, norm_eps=1e-6, conv_size=4,
                hidden_ratio=4, intermediate_size=None, tie_word_embeddings=False),
}
DEFAULTS["precond_gated_deltanet"] = dict(DEFAULTS["gated_deltanet"], squash_x=1.5, squash_eps=1e-6,
                                          log_atk_scale_init=-0.2)
# FLA's gate activations (GDN's `output_gate_activation`; the others' gates are swish): silu is swish.
GATE_ACTIVATIONS = {"swish": "swish", "silu": "swish", "sigmoid": "sigmoid"}
DEFAULTS["precond_kda"] = dict(DEFAULTS["kda"], squash_x=1.5, squash_eps=1e-6, log_atk_scale_init=-0.2)


class Unsupported(ValueError):
  """A checkpoint or model that the other side cannot express; the message names the field or tensor."""


def family_of(config: dict) -> str:
  """The FLA family (a FAMILIES key) of a config.json dict, from `model_type` (else `architectures`)."""
  model_type = config.get("model_type")
  if model_type in FAMILIES:
    return model_type
  for arch in config.get("architectures") or ():
    for family, (_, cls) in FAMILIES.items():
      if arch == cls:
        return family
  known = ", ".join(f"{cls} ({family})" for family, (_, cls) in FAMILIES.items())
  raise Unsupported(f"convert: config.json's model_type {model_type!r} (architectures "
                    f"{config.get('architectures')!r}) is not a family this converter reads; it reads {known}")


def _mlp_hidden(d_model: int, hidden_ratio, intermediate_size) -> int:
  """FLA's GatedMLP width: intermediate_size, else 256·⌈int(D·ratio·2/3) / 256⌉ (ratio default 4)."""
  if intermediate_size is not None:
    return int(intermediate_size)
  ratio = 4 if hidden_ratio is None else hidden_ratio
  width = int(d_model * ratio * 2 / 3)
  return 256 * ((width + 255) // 256)


def _int_ratio(owner: str, name: str, base: int, ratio) -> int:
  """base · ratio rounded, as FLA computes it, refused when it is not an integer (FLA's own check)."""
  value = base * ratio
  if not math.isclose(value, round(value), rel_tol=1e-5):
    raise Unsupported(f"{owner}: `{name}` = {ratio!r} gives a non-integer size {value} from {base}")
  return round(value)


def from_fla(config: dict) -> tuple[str, dict[str, Any], dict[str, Any]]:
  """(point, `models.STRUCTURE_FIELDS` values, point options) of an FLA config.json dict. Unsupported naming the
  field for a value we cannot express or a field we do not know."""
  family = family_of(config)
  owner = f"convert ({FAMILIES[family][1]})"
  unknown = sorted(set(config) - IGNORED - set(REQUIRED) - set(FAMILY_REQUIRED.get(family, {}))
                   - set(MAPPED[family]))
  if unknown:
    raise Unsupported(f"{owner}: config field(s) {', '.join(map(repr, unknown))} unknown to this converter "
                      "(neither mapped nor known to leave the model's function unchanged); nothing was converted")
  for name, (want, default, why) in {**REQUIRED, **FAMILY_REQUIRED.get(family, {})}.items():
    got = config.get(name, default)
    if got != want:
      raise Unsupported(f"{owner}: config field `{name}` = {got!r} is not supported (only {want!r}: {why})")
  c = dict(DEFAULTS[family], **{k: v for k, v in config.items() if k in MAPPED[family]})
  for name in ("hidden_size", "num_hidden_layers", "vocab_size"):
    if name not in config:
      raise Unsupported(f"{owner}: config.json lacks `{name}`")
  d = int(c["hidden_size"])
  h = int(c["num_heads"])
  fields: dict[str, Any] = dict(d_model=d, num_layers=int(c["num_hidden_layers"]), num_heads=h,
                                mlp_hidden=_mlp_hidden(d, c["hidden_ratio"], c["intermediate_size"]),
                                conv_size=int(c["conv_size"]), norm_eps=float(c["norm_eps"]),
                                tie_embeddings=bool(c["tie_word_embeddings"]))
  if family == "delta_net":
    key_dim = _int_ratio(owner, "expand_k", d, c["expand_k"])
    value_dim = _int_ratio(owner, "expand_v", d, c["expand_v"])
    if key_dim % h or value_dim % h:
      raise Unsupported(f"{owner}: `num_heads` ({h}) must divide the key and value widths ({key_dim}, {value_dim})")
    fields.update(head_dim=key_dim // h, num_value_heads=h, value_head_dim=value_dim // h)
  else:
    k = int(c["head_dim"])
    hv = int(c["num_v_heads"] or h)
    if hv % h:
      raise Unsupported(f"{owner}: `num_v_heads` ({hv}) must be a multiple of `num_heads` ({h})")
    if family == "precond_kda" and hv != h:
      raise Unsupported(f"{owner}: `num_v_heads` ({hv}) ≠ `num_heads` ({h}) is not supported: FLA's PKDA takes β "
                        "per key head and the preconditioner's gates per value head, the converse of ours")
    fields.update(head_dim=k, num_value_heads=hv, value_head_dim=_int_ratio(owner, "expand_v", k, c["expand_v"]))
  v = fields["value_head_dim"]
  if family in KDA_LIKE:
    fields.update(output_gate=True, output_gate_activation="sigmoid", output_gate_rank=v, gate_rank=v)
  else:
    activation = c.get("output_gate_activation", "swish")
    if activation not in GATE_ACTIVATIONS:
      raise Unsupported(f"{owner}: config field `output_gate_activation` = {activation!r} is not supported (one of "
                        f"{', '.join(GATE_ACTIVATIONS)})")
    fields.update(output_gate=bool(c["use_gate"]), output_gate_activation=GATE_ACTIVATIONS[activation],
                  output_gate_rank=None)
  options = {}
  if family in PRECONDITIONED:
    options = dict(x=float(c["squash_x"]), eps=float(c["squash_eps"]), center_init=float(c["log_atk_scale_init"]))
  return FAMILIES[family][0], fields, options


def to_fla(cfg: models.ModelConfig) -> dict[str, Any]:
  """The FLA config.json dict of a model config. Unsupported naming the field FLA cannot express."""
  owner = "convert (to FLA)"
  family = POINT_FAMILY.get(cfg.variant)
  if family is None:
    raise Unsupported(f"{owner}: point {cfg.variant!r} has no FLA model; FLA has "
                      + ", ".join(f"{p} ({cls})" for p, cls in FAMILIES.values()))
  d = cfg.mixer.dims
  extra = sorted(set(dict(cfg.point_options)) - {"x", "eps", "center_init"})
  if extra:
    raise Unsupported(f"{owner}: point option(s) {extra} have no FLA field")
  gated = cfg.mixer.gated
  out: dict[str, Any] = dict(
      model_type=family, architectures=[FAMILIES[family][1]], hidden_size=cfg.d_model,
      num_hidden_layers=cfg.num_layers, vocab_size=cfg.vocab_size, num_heads=d.heads, conv_size=cfg.conv_size,
      norm_eps=cfg.norm_eps, intermediate_size=cfg.hidden, hidden_ratio=4, hidden_act="swish",
      tie_word_embeddings=cfg.tie_embeddings, use_short_conv=True, allow_neg_eigval=False,
      initializer_range=cfg.init_std, fuse_norm=True, fuse_swiglu=True, fuse_cross_entropy=True, use_cache=True,
      attn=None, attn_mode="chunk", torch_dtype="float32")
  if family in KDA_LIKE:
    if not (gated and cfg.output_gate_activation == "sigmoid" and cfg.output_gate_rank == d.value_dim):
      raise Unsupported(f"{owner}: FLA's {FAMILIES[family][1]} gates its output with σ of a rank-V projection "
                        f"with a bias: `output_gate` True, `output_gate_activation` 'sigmoid' and "
                        f"`output_gate_rank` {d.value_dim} (V); this model has {gated}, "
                        f"{cfg.output_gate_activation!r}, {cfg.output_gate_rank}")
    if cfg.gate_rank != d.value_dim:
      raise Unsupported(f"{owner}: FLA's {FAMILIES[family][1]} projects its decay through rank V = {d.value_dim}; "
                        f"this model's `gate_rank` is {cfg.gate_rank}")
    out.update(safe_gate=False, lower_bound=None)
  elif gated:
    activations = ("swish", "sigmoid") if family == "gated_deltanet" else ("swish",)
    if cfg.output_gate_activation not in activations or cfg.output_gate_rank is not None:
      raise Unsupported(f"{owner}: FLA's {FAMILIES[family][1]} gates its output with {' or '.join(activations)} of "
                        f"a full-rank projection without bias (`output_gate_activation` in {activations}, "
                        f"`output_gate_rank` None); this model has {cfg.output_gate_activation!r}, "
                        f"{cfg.output_gate_rank}")
    if family == "gated_deltanet":
      out.update(output_gate_activation=cfg.output_gate_activation)
  if family == "delta_net":
    if d.value_heads != d.heads:
      raise Unsupported(f"{owner}: FLA's DeltaNetForCausalLM has no grouped value heads; `num_value_heads` "
                        f"({d.value_heads}) must equal `num_heads` ({d.heads})")
    out.update(expand_k=_ratio(owner, "head_dim", d.heads * d.key_dim, cfg.d_model),
               expand_v=_ratio(owner, "value_head_dim", d.heads * d.value_dim, cfg.d_model),
               use_gate=gated, use_beta=True, qk_norm="l2", qk_activation="silu", use_output_norm=True)
  else:
    if family == "precond_kda" and d.value_heads != d.heads:
      raise Unsupported(f"{owner}: FLA's PrecondKDAForCausalLM with `num_value_heads` ({d.value_heads}) ≠ "
                        f"`num_heads` ({d.heads}) computes another function (β per key head, the "
                        "preconditioner's gates per value head)")
    out.update(head_dim=d.key_dim, num_v_heads=d.value_heads,
               expand_v=_ratio(owner, "value_head_dim", d.value_dim, d.key_dim))
    if family not in KDA_LIKE:
      out.update(use_gate=gated)
  if family in PRECONDITIONED:
    o = cfg.point.opts
    out.update(squash_x=float(o["x"]), squash_eps=float(o["eps"]), log_atk_scale_init=float(o["center_init"]))
  return out


def _ratio(owner: str, name: str, width: int, base: int) -> float:
  """width / base as FLA's float expansion, refused when FLA's int(base · ratio) would not give width back."""
  ratio = width / base
  if int(base * ratio) != width or round(base * ratio) != width:   # FLA's int(·) before 0.6, round(·) since
    raise Unsupported(f"{owner}: `{name}` gives a width {width} that FLA's expansion ratio of {base} cannot "
                      "express exactly")
  return ratio
