"""Small models of each FLA family in configs FLA can express, for the converter's tests."""
import numpy as np

from osdn_jax import models

COMMON = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=2, head_dim=8, mlp_hidden=64, norm_eps=1e-5)
CONFIGS = {
    "dn": dict(value_head_dim=16, output_gate=True, output_gate_activation="swish", tie_embeddings=False),
    "gdn": dict(num_value_heads=4, value_head_dim=16, output_gate=True, output_gate_activation="sigmoid",
                tie_embeddings=False),
    "kda": dict(num_value_heads=4, value_head_dim=16, output_gate=True, output_gate_rank=16, gate_rank=16,
                tie_embeddings=True),
    "pgdn": dict(value_head_dim=16, output_gate=False, tie_embeddings=True, point_options=(("x", 1.7),)),
    "pkda": dict(value_head_dim=16, output_gate=True, output_gate_rank=16, gate_rank=16, tie_embeddings=False,
                 point_options=(("center_init", -0.5), ("eps", 1e-5))),
}


def config(point: str, **overrides) -> models.ModelConfig:
  return models.ModelConfig(variant=point, **{**COMMON, **CONFIGS[point], **overrides})


def model(point: str, seed: int = 0, **overrides):
  """A random model of `point` whose norms and biases are not their initial constants either."""
  from flax import nnx
  import jax
  m = models.LanguageModel(config(point, **overrides), rngs=nnx.Rngs(seed))
  state = nnx.state(m, nnx.Param)
  rng = np.random.default_rng(seed)
  noisy = jax.tree.map(lambda a: np.asarray(a) + 0.1 * rng.standard_normal(a.shape).astype(np.float32), state)
  nnx.update(m, noisy)
  return m
