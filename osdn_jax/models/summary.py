"""What to read before launching a run: parameters per part, FLOPs per token, recurrent state per sequence.

    print(models.summary("pgdn-340m", context_length=4096))

Nothing is allocated: shapes come from `nnx.eval_shape` (parameters) and `jax.eval_shape` (one layer's
prefill, for the state). FLOPs count a multiply-add as 2; the recurrence is the chunkwise form's estimate
(docs/design.md §2) per value head and token with the chunk C = min(chunk_size, context):
  online  6·K·V (W S, Q S, state update) + 2·C·(3K + 2V) (A, Q K̃ᵀ, T·βK, T·V, scores·V_new) + C²/3 (T)
  offline 4·K·V (Q S, Kᵀ V) + 2·C·(K + V) (Q Kᵀ, scores·V)
  MesaNet's pass adds 2·K² (the K×K state) + 2·C·K (diag H_t) + (n + 1)·(2·K² + 4·C·K) (n CG iterations and the
  first residual: H_in p, P Kᵀ, scores·K)
The O(K) preconditioner passes, norms and element-wise gates are left out (< 1%).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from osdn_jax import dgps
from osdn_jax.layers import DGPSMixer
from osdn_jax.models.config import ModelConfig, config
from osdn_jax.models.lm import param_shapes

_MIXER_PARTS = {"q_proj": "q/k/v projections", "k_proj": "q/k/v projections", "v_proj": "q/k/v projections",
                "conv": "short conv", "features": "feature projections", "point_params": "point parameters",
                "o_norm": "output norm", "g_proj": "output gate", "o_proj": "output projection"}


@dataclasses.dataclass(frozen=True)
class Summary:
  """params: {embeddings, mixers, mlps, norms, total}; mixer_parts: the mixers' parameters by piece (all layers);
  flops: forward FLOPs per token {dense, conv, recurrence, total}; state: recurrent bytes per sequence
  {S, precond, conv, total}."""
  cfg: ModelConfig
  context_length: int
  params: dict[str, int]
  mixer_parts: dict[str, int]
  flops: dict[str, float]
  state: dict[str, int]

  def table(self) -> str:
    c, d = self.cfg, self.cfg.mixer.dims
    total = self.params["total"]
    rows = [f"{c.name or c.variant}: point {c.point.name} (D {c.point.axis_name('decay')}, "
            f"G {c.point.axis_name('gain')}, P {c.point.axis_name('precond')}, S {c.point.axis_name('solve')}), compute {jnp.dtype(c.dtype).name}",
            f"  D={c.d_model}, L={c.num_layers}, {d.heads} key heads × {d.key_dim}, "
            f"{d.value_heads} value heads × {d.value_dim}, MLP {c.hidden}, vocab {c.vocab_size}", "",
            f"{'parameters':<34}{'count':>16}{'share':>9}"]
    line = lambda name, n, indent=2: rows.append(f"{' ' * indent}{name:<{32 - indent + 2}}{n:>16,}"
                                                 f"{100 * n / total:>8.1f}%")
    line("embeddings (tied with the head)" if c.tie_embeddings else "embeddings and head",
         self.params["embeddings"])
    line("mixers", self.params["mixers"])
    for part, n in self.mixer_parts.items():
      line(part, n, 4)
    line("MLPs", self.params["mlps"])
    line("norms (blocks + final)", self.params["norms"])
    line("total", total)
    f = self.flops
    rows += ["", f"{'FLOPs per token (context ' + format(self.context_length, ',') + ')':<34}{'forward':>16}"]
    for name, key in (("dense matmuls (with the head)", "dense"), ("short conv", "conv"),
                      (f"recurrence (chunk {min(c.chunk_size, self.context_length)})", "recurrence"),
                      ("total", "total")):
      rows.append(f"  {name:<32}{f[key]:>16,.0f}")
    rows.append(f"  {'training (≈ 3 × forward)':<32}{3 * f['total']:>16,.0f}")
    s = self.state
    rows += ["", f"{'recurrent state per sequence':<34}{'bytes':>16}"]
    for name, key in (("S (fp32)", "S"), ("preconditioner", "precond"), ("short-conv tails", "conv"),
                      ("total", "total")):
      rows.append(f"  {name:<32}{s[key]:>16,}")
    return "\n".join(rows)

  def __str__(self) -> str:
    return self.table()


def _flat(model_or_cfg):
  if isinstance(model_or_cfg, nnx.Module):
    return [(tuple(p), v) for p, v in nnx.to_flat_state(nnx.state(model_or_cfg, nnx.Param))]
  return param_shapes(model_or_cfg)


def param_counts(model_or_cfg) -> tuple[dict[str, int], dict[str, int]]:
  """({embeddings, mixers, mlps, norms, total}, mixer parts) of a model, config or config name."""
  parts = dict(embeddings=0, mixers=0, mlps=0, norms=0)
  mixer_parts = {part: 0 for part in dict.fromkeys(_MIXER_PARTS.values())}
  for path, var in _flat(model_or_cfg):
    n = int(var.size)
    if path[0] in ("embed", "head"):
      parts["embeddings"] += n
    elif path[:2] == ("blocks", "mixer"):
      parts["mixers"] += n
      mixer_parts[_MIXER_PARTS[path[2]]] += n
    elif path[:2] == ("blocks", "mlp"):
      parts["mlps"] += n
    else:
      parts["norms"] += n
  parts["total"] = sum(parts.values())
  return parts, {part: n for part, n in mixer_parts.items() if n}


def _recurrence_flops(cfg: ModelConfig, context_length: int) -> float:
  d = cfg.mixer.dims
  c = min(cfg.chunk_size, context_length)
  k, v = d.key_dim, d.value_dim
  if cfg.point.online:
    per_head = 6 * k * v + 2 * c * (3 * k + 2 * v) + c * c / 3
  else:
    per_head = 4 * k * v + 2 * c * (k + v)
  if dgps.has_mesa_pass(cfg.point):
    per_head += 2 * k * k + 2 * c * k + (cfg.point.opts["cg_steps"] + 1) * (2 * k * k + 4 * c * k)
  return per_head * d.value_heads * cfg.num_layers


def _flops(flat, cfg: ModelConfig, context_length: int) -> dict[str, float]:
  dense = conv = 0
  for path, var in flat:
    if path[-1] == "kernel":                 # every Linear
      dense += 2 * var.size
    elif path[-2:] == ("conv", "weight"):
      conv += 2 * var.size
  dense += 2 * cfg.d_model * cfg.vocab_size  # the tied head
  rec = _recurrence_flops(cfg, context_length)
  return dict(dense=float(dense), conv=float(conv), recurrence=float(rec), total=float(dense + conv + rec))


def state_bytes(cfg: ModelConfig) -> dict[str, int]:
  """Recurrent state bytes per sequence {S, precond, conv, total}, from one layer's abstract prefill."""
  mixer = nnx.eval_shape(lambda: DGPSMixer(cfg.mixer, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(mixer)
  x = jax.ShapeDtypeStruct((1, 1, cfg.d_model), jnp.dtype(cfg.dtype))
  cache = jax.eval_shape(lambda p, x: nnx.merge(graphdef, p)(x, return_cache=True)[1], params, x)
  size = lambda t: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(t)) * cfg.num_layers
  out = dict(S=size(cache.S), precond=size(cache.precond), conv=size(cache.conv))
  out["total"] = sum(out.values())
  return {k: int(v) for k, v in out.items()}


def summary(cfg: ModelConfig | str, *, context_length: int = 2048, **overrides) -> Summary:
  """The summary of a config or config name (printable: `print(summary("pgdn-340m"))`)."""
  if isinstance(cfg, str):
    cfg = config(cfg, **overrides)
  elif overrides:
    cfg = cfg.replace(**overrides)
  flat = param_shapes(cfg)
  params, mixer_parts = param_counts(cfg)
  return Summary(cfg, context_length, params, mixer_parts, _flops(flat, cfg, context_length), state_bytes(cfg))
