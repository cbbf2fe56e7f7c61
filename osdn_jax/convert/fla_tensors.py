"""FLA's tensor names ↔ our parameter tree, per family, both ways.

A torch Linear holds W [out, in] and computes x Wᵀ; an nnx.Linear holds kernel [in, out] and computes x·kernel, so
kernels are transposes. FLA's three ShortConvolutions hold weight [C, 1, W] each (y_t = Σ_i w[c, 0, i] x_{t−W+1+i},
the causal depthwise convolution); ours is one filter [W, Cq + Ck + Cv] over the concatenated q, k, v channels. KDA's
dt_bias is flat [HV·K], ours [HV, K]. Our blocks are stacked: every block parameter has a leading layer axis.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from osdn_jax import models
from osdn_jax.convert.fla_config import KDA_LIKE, PRECONDITIONED, Unsupported

EMBED, NORM, HEAD = "model.embeddings.weight", "model.norm.weight", "lm_head.weight"
CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")


@dataclasses.dataclass(frozen=True)
class Entry:
  """One tensor of a block: FLA's name after "model.layers.{i}.", our path under "blocks", and how it maps
  ("linear": transposed; "same": as is; "reshape": to our shape)."""
  fla: str
  ours: tuple[str, ...]
  kind: str = "linear"


def _linear(fla: str, *ours: str) -> Entry:
  return Entry(f"{fla}.weight", (*ours, "kernel"))


def block_entries(family: str, cfg: models.ModelConfig) -> list[Entry]:
  """Every tensor of one FLA block of `family` (the short convolutions apart: `CONVS`) for a model of `cfg`."""
  m = ("mixer",)
  out = [Entry("attn_norm.weight", ("mixer_norm", "scale"), "same"),
         Entry("mlp_norm.weight", ("mlp_norm", "scale"), "same"),
         *(_linear(f"mlp.{n}", "mlp", n) for n in ("gate_proj", "up_proj", "down_proj")),
         *(_linear(f"attn.{n}", *m, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
         Entry("attn.o_norm.weight", (*m, "o_norm", "scale"), "same"),
         _linear("attn.b_proj", *m, "features", "gain", "b", "proj")]
  if family != "delta_net":
    decay = (*m, "point_params", "decay")
    out += [Entry("attn.A_log", (*decay, "A_log"), "same"),
            Entry("attn.dt_bias", (*decay, "dt_bias"), "reshape")]
  if family in KDA_LIKE:
    out += [_linear("attn.f_proj.0", *m, "features", "decay", "a", "down"),
            _linear("attn.f_proj.1", *m, "features", "decay", "a", "proj"),
            _linear("attn.g_proj.0", *m, "g_proj", "down"),
            _linear("attn.g_proj.1", *m, "g_proj", "proj"),
            Entry("attn.g_proj.1.bias", (*m, "g_proj", "proj", "bias"), "same")]
  elif family != "delta_net":
    out.append(_linear("attn.a_proj", *m, "features", "decay", "a", "proj"))
  if family not in KDA_LIKE and cfg.mixer.gated:
    out.append(_linear("attn.g_proj", *m, "g_proj"))
  if family in PRECONDITIONED:
    pre, feat = (*m, "point_params", "precond"), (*m, "features", "precond")
    # PKDA's a_proj is its preconditioner's decay (its main decay is f_proj); PGDN's is a_atk_proj.
    decay_proj = "attn.a_proj" if family == "precond_kda" else "attn.a_atk_proj"
    out += [_linear(decay_proj, *feat, "a", "proj"), _linear("attn.b_atk_proj", *feat, "b", "proj"),
            Entry("attn.A_log_atk", (*pre, "A_log"), "same"), Entry("attn.dt_bias_atk", (*pre, "dt_bias"), "same"),
            Entry("attn.log_atk_scale", (*pre, "center"), "same")]
  return out


def _get(tree, path):
  for p in path:
    tree = tree[p]
  return tree


def _put(tree, path, value):
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  tree[path[-1]] = value


def _shapes(cfg) -> dict[tuple[str, ...], tuple[int, ...]]:
  return {tuple(str(p) for p in path): tuple(s.shape) for path, s in models.param_shapes(cfg)}


def _fp32(name: str, t) -> np.ndarray:
  a = np.asarray(t)
  if not np.issubdtype(a.dtype, np.floating) and a.dtype.name != "bfloat16":
    raise Unsupported(f"convert: tensor {name!r} has dtype {a.dtype}, not a floating type")
  return a.astype(np.float32)


def fla_to_params(family: str, cfg: models.ModelConfig, tensors: dict[str, np.ndarray]) -> dict:
  """Our parameter tree (nested dict of fp32 numpy arrays, the layout of `nnx.state(model, nnx.Param)
  .to_pure_dict()`) from FLA's tensors. Unsupported naming the tensor that is missing, has the wrong shape, or is
  unknown (a tensor no parameter takes is an error, never dropped)."""
  shapes = _shapes(cfg)
  left = dict(tensors)

  def take(name: str, want: tuple[int, ...]) -> np.ndarray:
    if name not in left:
      raise Unsupported(f"convert: tensor {name!r} is missing from the checkpoint (the config asks for it, shape "
                        f"{list(want)})")
    a = _fp32(name, left.pop(name))
    if a.shape != tuple(want):
      raise Unsupported(f"convert: tensor {name!r} has shape {list(a.shape)}, the config gives {list(want)}")
    return a

  params: dict = {}
  d, vocab = cfg.d_model, cfg.vocab_size
  embed = take(EMBED, (vocab, d))
  params["embed"] = embed
  params["final_norm"] = {"scale": take(NORM, (d,))}
  if cfg.tie_embeddings:
    if HEAD in left:
      head = _fp32(HEAD, left.pop(HEAD))
      if head.shape != embed.shape or not np.array_equal(head, embed):
        raise Unsupported(f"convert: tensor {HEAD!r} differs from {EMBED!r} but the config ties them "
                          "(`tie_word_embeddings` true)")
  else:
    params["head"] = take(HEAD, (vocab, d))
  per_layer: dict[tuple[str, ...], list[np.ndarray]] = {}
  entries = block_entries(family, cfg)
  conv_path = ("mixer", "conv", "weight")
  for i in range(cfg.num_layers):
    prefix = f"model.layers.{i}."
    for e in entries:
      ours = shapes[("blocks", *e.ours)][1:]
      want = {"linear": ours[::-1], "same": ours, "reshape": (int(np.prod(ours)),)}[e.kind]
      if e.kind == "reshape" and family not in KDA_LIKE:
        want = ours
      a = take(prefix + e.fla, want)
      per_layer.setdefault(e.ours, []).append(a.T if e.kind == "linear" else a.reshape(ours))
    d_conv = cfg.mixer.dims
    widths = (d_conv.heads * d_conv.key_dim,) * 2 + (d_conv.value_heads * d_conv.value_dim,)
    parts = [take(f"{prefix}attn.{c}.weight", (w, 1, cfg.conv_size))[:, 0, :].T for c, w in zip(CONVS, widths)]
    per_layer.setdefault(conv_path, []).append(np.concatenate(parts, axis=1))
  for path, arrays in per_layer.items():
    _put(params, ("blocks", *path), np.stack(arrays))
  if left:
    names = sorted(left)
    raise Unsupported(f"convert: tensor(s) {', '.join(map(repr, names[:5]))}{' ...' if len(names) > 5 else ''} "
                      f"({len(names)} in all) have no parameter in a {family} model of this config; nothing was "
                      "converted")
  _check_complete(params, shapes)
  return params


def _check_complete(params: dict, shapes: dict) -> None:
  for path, shape in shapes.items():
    try:
      a = _get(params, path)
    except KeyError:
      raise Unsupported(f"convert: parameter {'/'.join(path)} was not filled from the checkpoint") from None
    if tuple(a.shape) != shape:
      raise Unsupported(f"convert: parameter {'/'.join(path)} has shape {a.shape}, the model wants {shape}")


def params_to_fla(family: str, cfg: models.ModelConfig, params: dict, dtype=np.float32) -> dict[str, np.ndarray]:
  """FLA's tensors {name: array in `dtype`} from our parameter tree (the inverse of `fla_to_params`)."""
  shapes = _shapes(cfg)
  _check_complete(params, shapes)
  cast = lambda a: np.asarray(a, np.float32).astype(dtype)
  out = {EMBED: cast(params["embed"]), NORM: cast(params["final_norm"]["scale"])}
  if not cfg.tie_embeddings:
    out[HEAD] = cast(params["head"])
  d = cfg.mixer.dims
  widths = (d.heads * d.key_dim,) * 2 + (d.value_heads * d.value_dim,)
  for i in range(cfg.num_layers):
    prefix = f"model.layers.{i}."
    for e in block_entries(family, cfg):
      a = np.asarray(_get(params["blocks"], e.ours))[i]
      out[prefix + e.fla] = cast(a.T if e.kind == "linear" else
                                 a.reshape(-1) if e.kind == "reshape" and family in KDA_LIKE else a)
    conv = np.asarray(params["blocks"]["mixer"]["conv"]["weight"])[i]           # [W, C]
    start = 0
    for c, w in zip(CONVS, widths):
      out[f"{prefix}attn.{c}.weight"] = cast(conv[:, start:start + w].T[:, None, :])
      start += w
  return out
